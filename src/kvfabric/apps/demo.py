"""`kvfabric demo`: cache reuse on a real model, end to end, on the embedded defaults.

It reads a long document that ships with the package (original text, CC0), asks three questions about it with
SmolLM2-135M-Instruct, and shows for each the tokens reused, the time to first token and the answer: the first
question pays the full prefill, the next two reuse the document's KV from the cpu tier. Then it starts a fresh
process that asks again, so the KV comes from the disk tier (~/.cache/kvfabric/chunks) across processes.
The document's chunks are removed from the cache first (unless --keep-cache), so the first request is a real miss.
With --plot, it also draws TTFT against context length, cache miss vs hit (`ttft_vs_context`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvfabric.config import Config
from kvfabric.data import demo_document

QUESTIONS = (
    "How many steps does the lighthouse tower have?",
    "On what date did the Margaret Vale strike Gull Ledge?",
    "Who was the last keeper of the lighthouse?",
)
PLOT_LENGTHS = (256, 512, 1024, 2048, 3072)  # context tokens of the --plot figure
SYSTEM = "You are a helpful assistant. Answer the question using only the document, in one short sentence."


@dataclass(frozen=True, slots=True)
class Answer:
    phase: str
    question: str
    prompt_tokens: int
    hit_tokens: int
    ttft_s: float
    answer: str


def prompt_ids(tokenizer, question: str) -> list[int]:
    """Chat prompt as token ids: [system + document] then [question]. Tokenized in two parts so the document's
    tokens never merge with the question's: every question shares the document prefix token for token."""
    user = "Document:\n" + demo_document() + "\n\nQuestion: " + question
    text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                                         tokenize=False, add_generation_prompt=True)
    head, _, tail = text.partition("\n\nQuestion: ")
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(head) + encode("\n\nQuestion: " + tail)


def ask_all(engine, phase: str, questions: tuple[str, ...] = QUESTIONS, show_progress: bool = False) -> list[Answer]:
    answers = []
    for question in questions:
        ids = prompt_ids(engine.tokenizer, question)
        if show_progress:
            with Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                          TimeElapsedColumn(), transient=True) as bar:
                task = bar.add_task("prefill", total=len(ids))
                result = engine.generate(ids, max_new_tokens=32,
                                         progress=lambda done, total: bar.update(task, completed=done))
        else:
            result = engine.generate(ids, max_new_tokens=32)
        answer = result.text.strip().split("\n\n")[0]  # a 135M model rambles on after its answer
        answers.append(Answer(phase, question, result.prompt_tokens, result.hit_tokens, result.ttft_s, answer))
        if phase == "cold":
            phase = "warm (cpu)"
    engine.cache.flush()
    return answers


def _show(console: Console, answers: list[Answer]) -> None:
    for a in answers:
        console.print(f"[bold]{a.phase:>12}[/] | reused {a.hit_tokens:>5}/{a.prompt_tokens} tokens | "
                      f"TTFT {a.ttft_s:6.2f} s | Q: {a.question}\n{'':>12} | A: [green]{a.answer}[/]")


def child_main() -> None:
    """The fresh process: load the model, ask again, print one JSON line per answer."""
    from kvfabric.engines.hf import HFEngine
    with HFEngine() as engine:
        for a in ask_all(engine, "warm (disk)"):
            print(json.dumps(dataclasses.asdict(a)), flush=True)


def run(keep_cache: bool = False, plot: str | None = None) -> None:
    from kvfabric.engines.hf import HFEngine
    from kvfabric.engines.model import ensure_model
    console = Console()
    console.rule("kvfabric demo: KV cache reuse on SmolLM2-135M-Instruct (CPU)")
    ensure_model()
    with console.status("loading the model"):
        engine = HFEngine()
    console.print(f"tiers: {', '.join(engine.cache.config.tiers)} | disk at {engine.cache.config.disk.resolved_path()}"
                  f" | chunk {engine.cache.chunk_size} tokens | torch threads {__import__('torch').get_num_threads()}")
    if not keep_cache:
        removed = sum(engine.cache.delete(prompt_ids(engine.tokenizer, q)) for q in QUESTIONS)
        console.print(f"removed {removed} cached chunks of this document, so the first question is a real miss")
    console.print("question 1 pays the full prefill; questions 2 and 3 reuse the document's KV from memory")
    answers = ask_all(engine, "cold", show_progress=True)
    _show(console, answers)
    engine.close()
    console.print("\nrestarting in a fresh process (empty memory; the KV comes from disk)...")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kvfabric.apps.demo", "--child"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONHASHSEED="random"))
    if proc.returncode != 0:
        console.print(proc.stderr[-2000:])
        raise SystemExit(f"the fresh process failed with exit code {proc.returncode}")
    warm = [Answer(**json.loads(line)) for line in proc.stdout.splitlines() if line.startswith("{")]
    _show(console, warm)
    console.print(f"(fresh process, model load included: {time.perf_counter() - started:.1f} s)")
    _summary(console, answers, warm)
    if plot:
        ttft_vs_context(plot, console)


def _summary(console: Console, answers: list[Answer], warm: list[Answer]) -> None:
    cold = answers[0].ttft_s
    cpu = min(a.ttft_s for a in answers[1:])
    disk = warm[0].ttft_s  # the first: it really came from disk (the fresh process's later ones hit its memory)
    table = Table(title="time to first token")
    for col in ("request", "reused tokens", "TTFT s", "speed-up vs cold"):
        table.add_column(col, justify="left" if col == "request" else "right")
    table.add_row("cold (full prefill)", f"{answers[0].hit_tokens}/{answers[0].prompt_tokens}", f"{cold:.2f}", "1.0x")
    table.add_row("warm from cpu", f"{answers[1].hit_tokens}/{answers[1].prompt_tokens}", f"{cpu:.2f}",
                  f"{cold / cpu:.1f}x")
    table.add_row("warm from disk, new process", f"{warm[0].hit_tokens}/{warm[0].prompt_tokens}", f"{disk:.2f}",
                  f"{cold / disk:.1f}x")
    console.print(table)
    if min(a.hit_tokens for a in answers[1:] + warm) == 0:
        raise SystemExit("no reuse happened: the warm requests found nothing in the cache")



def ttft_vs_context(path: str, console: Console, lengths: tuple[int, ...] = PLOT_LENGTHS) -> list[dict]:
    """TTFT vs context length, cache miss vs cache hit (`kvfabric demo --plot FILE.png`): for each length the
    first tokens of the demo document are prefilled without the cache (miss), then stored, then asked again with
    a short question after them (hit: only the question is computed). A cpu-only cache of its own: the user's
    disk cache is left untouched."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvfabric.engines.hf import HFEngine
    rows = []
    with HFEngine(config=Config(tiers=("cpu",))) as engine:
        doc = engine.tokenizer(demo_document(), add_special_tokens=False)["input_ids"]
        question = engine.tokenizer("\nQuestion: what is this text about?\nAnswer:",
                                    add_special_tokens=False)["input_ids"]
        for length in lengths:
            if length > len(doc):
                break
            ids = doc[:length] + question
            miss = engine.generate(ids, max_new_tokens=1, use_cache=False)
            engine.generate(doc[:length], max_new_tokens=1)  # stores the context's chunks
            hit = engine.generate(ids, max_new_tokens=1)
            rows.append({"context_tokens": length, "miss_s": miss.ttft_s, "hit_s": hit.ttft_s,
                         "hit_tokens": hit.hit_tokens})
            console.print(f"context {length:>5}: miss {miss.ttft_s:6.2f} s, hit {hit.ttft_s:5.2f} s "
                          f"({hit.hit_tokens} tokens reused)")
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["context_tokens"] for r in rows]
    ax.plot(xs, [r["miss_s"] for r in rows], "o-", label="cache miss (full prefill)")
    ax.plot(xs, [r["hit_s"] for r in rows], "o-", label="kvfabric hit (load + question)")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("SmolLM2-135M on CPU: TTFT vs context")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    console.print(f"plot written to {path}")
    return rows

if __name__ == "__main__":
    if "--child" in sys.argv:
        child_main()
