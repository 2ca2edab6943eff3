"""kvfabric.data.genres: the calibration and held-out texts exist offline, are disjoint, and cut into runs."""
from __future__ import annotations

import json

import pytest

from kvfabric.data import genres as G


def chars(text: str) -> list[int]:  # a tokenizer stand-in: one token per character
    return [ord(c) for c in text]


def test_calibration_and_held_out_files_are_disjoint_and_present():
    held = {p.resolve() for pats in G.HELD_OUT.values() for pat in pats for p in G.files(pat)}
    cal = {p.resolve() for pats in G.CALIBRATION.values() for pat in pats for p in G.files(pat)}
    assert not held & cal
    for pats in G.HELD_OUT.values():  # held-out text ships with every interpreter
        assert all(G.files(pat) for pat in pats), pats
    assert all(G.files(pat) for pat in G.CALIBRATION["prose"] + G.CALIBRATION["code"])


def test_calibration_questions_come_before_every_held_out_question():
    assert max(G.CALIBRATION_QUESTIONS) < G.HELD_OUT_FIRST_QUESTION
    assert set(G.CALIBRATION_GENRES) == {"retrieval", *G.CALIBRATION}


def test_held_out_text_shares_no_long_line_with_calibration_text():
    def lines(patterns):
        return {ln.strip() for ln in G.genre_text(patterns).splitlines() if len(ln.strip()) > 60}
    cal = set().union(*(lines(p) for p in G.CALIBRATION.values()))
    for genre, pats in G.HELD_OUT.items():
        held = lines(pats)
        assert len(held & cal) < 0.01 * len(held), genre  # licence boilerplate aside, nothing in common


def test_topics_and_html_are_read_as_prose():
    prose = G.read_text(G.files("pydoc_data/topics.py")[0])
    assert "topics = {" not in prose and "The \"if\" statement" in prose
    help_text = G.read_text(G.files("idlelib/help.html")[0])
    assert "<div" not in help_text and "IDLE" in help_text


def test_runs_are_spread_and_sized():
    runs = G.spread_runs(list(range(1000)), 4, 100)
    assert [r[0] for r in runs] == [0, 300, 600, 900] and all(len(r) == 100 for r in runs)
    assert len(G.spread_runs([1, 2, 3], 2, 5)[1]) == 5  # too short: repeated
    docs = G.held_out(chars, "code", 3, 500, None)
    assert len(docs) == 3 and all(len(d) == 500 for d in docs) and docs == G.held_out(chars, "code", 3, 500, None)
    with pytest.raises(FileNotFoundError):
        G.held_out(chars, "musique", 1, 10, None)


def test_mix_and_musique_runs(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"ctxs": [{"title": f"t{i}", "text": "x" * 50}]} for i in range(200)]))
    mix = G.held_out(chars, "mix", 6, 120, path)
    assert [d[:4] for d in mix[::3]] == [chars("t100"), chars("t103")]  # musique first; 3 questions a document
    assert mix[1] == G.held_out(chars, "prose", 2, 120, None)[0]
    cal = G.calibration(chars, 2, 120, path)
    assert set(cal) >= {"retrieval", "prose", "code"} and cal["retrieval"][0][:2] == chars("t0")
    assert "retrieval" not in G.calibration(chars, 2, 120, None)
