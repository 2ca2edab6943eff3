"""The main job, end to end: `kvfabric demo` on the real model, as a user runs it (a separate process)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def test_demo_reuses_the_document_in_memory_and_across_processes(tmp_path):
    env = dict(os.environ, KVFABRIC_DISK__PATH=str(tmp_path / "chunks"), COLUMNS="200")
    proc = subprocess.run([sys.executable, "-m", "kvfabric.apps.cli", "demo"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = re.findall(r"(cold|warm \(cpu\)|warm \(disk\)) \| reused\s+(\d+)/(\d+) tokens \| TTFT\s+([\d.]+) s", proc.stdout)
    assert [phase for phase, *_ in lines] == ["cold", "warm (cpu)", "warm (cpu)"] + ["warm (disk)"] * 3
    cold, *warm = lines
    assert int(cold[1]) == 0
    for _, hit, total, _ in warm:
        assert int(total) > 3000 and int(hit) >= int(total) - 512  # the whole document but its last chunk
    answers = re.findall(r"\| A: (.*)", proc.stdout)
    assert answers[:3] == answers[3:]  # KV from disk in a new process gives the same answers as before
    assert "warm from disk, new process" in proc.stdout


@pytest.mark.slow
def test_demo_rag_answers_each_question_with_full_prefill_and_blend(capsys, monkeypatch):
    """`kvfabric demo --rag` on a short document: passages cached once, reused in each question's own order."""
    monkeypatch.setenv("COLUMNS", "250")  # the table's headers on one line
    from kvfabric.apps.demo_rag import run, split_passages
    from kvfabric.data import demo_document
    document = "\n\n".join(demo_document().split("\n\n")[:16])  # the first sections only: a short run
    passages = split_passages(document)
    assert len(passages) >= 4 and all(p.endswith("\n\n") for p in passages)
    questions = ("Who founded Halvor's Point?", "Why was a lighthouse needed at Halvor's Point?")
    answers = run(document=document, questions=questions, top_k=3)  # fewer than the passages
    out = capsys.readouterr().out
    assert [a.question for a in answers] == list(questions)
    assert answers[0].order != answers[1].order  # the passages come in another order for each question
    for a in answers:
        assert len(a.order) == 3 and a.full_s > 0 and a.blend_s > 0 and 0 < a.recompute_frac < 1
        assert a.full_answer and a.blend_answer
    assert f"cached {len(passages)} passages once" in out  # every passage, not only those retrieved
    assert "TTFT blend s" in out and "answer (blend)" in out and "median speed-up" in out


def test_demo_rag_retrieves_by_shared_words_and_splits_sections():
    from kvfabric.apps.demo_rag import retrieve, split_passages
    text = "Title\n\nAbout Cats\n\nCats purr. Cats sleep.\n\nAbout Dogs\n\nDogs bark.\n\nMore on dogs: they fetch."
    passages = split_passages(text)
    assert passages == ["About Cats\nCats purr. Cats sleep.\n\n", "About Dogs\nDogs bark.\nMore on dogs: they fetch.\n\n"]
    assert retrieve("Why do dogs bark?", passages, 2) == [1, 0]
    assert retrieve("Do cats purr?", passages, 1) == [0]


def test_the_summary_shows_the_first_fresh_process_answer_as_the_disk_figure(capsys):
    """Only the fresh process's first answer comes from disk (its later ones hit the memory tier it just filled):
    the summary's disk row is that one, never the fastest of them."""
    from rich.console import Console

    from kvfabric.apps.demo import Answer, _summary

    def answer(phase: str, ttft: float) -> Answer:
        return Answer(phase=phase, question="q", answer="a", hit_tokens=512, prompt_tokens=600, ttft_s=ttft)

    console = Console(width=120, force_terminal=False)
    _summary(console, [answer("cold", 4.0), answer("cold", 0.5), answer("cold", 0.4)],
             [answer("warm (disk)", 0.8), answer("warm (disk)", 0.3), answer("warm (disk)", 0.2)])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "warm from disk" in line)
    assert "0.80" in row and "5.0x" in row
