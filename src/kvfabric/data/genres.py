"""Text of several genres, offline, for calibrating cachegen's profiles and for measuring codecs on text the
profile never saw. Everything but MuSiQue ships with the Python interpreter (the stdlib and its docs), so it
exists wherever kvfabric runs; MuSiQue comes from ../shared/data (`find_musique`) and is used only if present.

Two disjoint sets of files (tests/test_genres.py checks it):

| genre     | calibration (`kvfabric profile cachegen`)      | held out (`kvfabric bench codec --text`)        |
|-----------|------------------------------------------------|-------------------------------------------------|
| retrieval | MuSiQue questions 0-23 (passages joined)       | `musique`: MuSiQue questions 100.. (disjoint)   |
| prose     | LICENSE.txt, idlelib/help.html (its text)      | `prose`: pydoc_data/topics.py (the reference)   |
| dialogue  | test/test_email/data/msg_*.txt (mail, replies) | -                                               |
| code      | difflib, tarfile, configparser, pdb (.py)      | `code`: argparse, typing, _pydecimal, inspect   |

`mix` (held out) takes its documents in turn from musique, prose and code.
A document is a run of consecutive tokens; the runs of one genre are spread evenly over its text.
"""
from __future__ import annotations

import ast
import html
import json
import re
import sysconfig
from collections.abc import Callable
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
HELD_OUT = {"prose": ("pydoc_data/topics.py",),
            "code": ("argparse.py", "typing.py", "_pydecimal.py", "inspect.py")}
CALIBRATION = {"prose": ("LICENSE.txt", "idlelib/help.html"),
               "dialogue": ("test/test_email/data/msg_*.txt",),
               "code": ("difflib.py", "tarfile.py", "configparser.py", "pdb.py")}
CALIBRATION_GENRES = ("retrieval", "prose", "dialogue", "code")
TEXTS = ("musique", "prose", "code", "mix")  # the held-out choices of `bench codec --text`
CALIBRATION_QUESTIONS = range(0, 24)  # MuSiQue questions the shipped profiles were calibrated on
HELD_OUT_FIRST_QUESTION = 100

Tokenize = Callable[[str], list[int]]


def files(pattern: str) -> list[Path]:
    """The stdlib files a pattern names (sorted; none if the interpreter lacks them, e.g. without test/)."""
    return sorted(STDLIB.glob(pattern))


def read_text(path: Path) -> str:
    """A file's text: pydoc's topics as their prose, HTML without tags, anything else as it is."""
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.name == "topics.py":
        tree = ast.parse(raw)
        topics = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign))
        return "\n\n".join(topics[k] for k in sorted(topics))
    if path.suffix == ".html":
        body = re.sub(r"(?s)<(script|style).*?</\1>", " ", raw)
        return re.sub(r"[ \t]*\n\s*\n+", "\n\n", html.unescape(re.sub(r"<[^>]+>", "", body))).strip()
    return raw


def describe(genre: str) -> str:
    """What a calibration genre reads, for a profile's meta."""
    if genre == "retrieval":
        return f"MuSiQue questions {CALIBRATION_QUESTIONS.start}.."
    return ", ".join(CALIBRATION[genre])


def genre_text(patterns: tuple[str, ...]) -> str:
    return "\n\n".join(read_text(p) for pat in patterns for p in files(pat))


def spread_runs(ids: list[int], count: int, num_tokens: int) -> list[list[int]]:
    """`count` runs of `num_tokens` consecutive tokens, spread evenly over ids (repeated if too short)."""
    if not ids:
        raise ValueError("no text for this genre")
    while len(ids) < num_tokens * max(count, 1):
        ids = ids + ids
    gap = (len(ids) - num_tokens) // max(count - 1, 1) if count > 1 else 0
    return [ids[i * gap:i * gap + num_tokens] for i in range(count)]


def musique_runs(tokenize: Tokenize, path: Path, questions: range, num_tokens: int, disjoint: bool = False
                 ) -> list[list[int]]:
    """One run per question in `questions`: its passages, then the next questions' until `num_tokens`
    (disjoint: each run goes on from the question after the last one the run before used)."""
    data = json.loads(path.read_text())
    runs = []
    j = questions.start
    for i in questions:
        ids: list[int] = []
        j = j if disjoint else i
        while len(ids) < num_tokens:
            ids += tokenize("\n\n".join(c["title"] + "\n" + c["text"] for c in data[j % len(data)]["ctxs"]))
            j += 1
        runs.append(ids[:num_tokens])
    return runs


def held_out(tokenize: Tokenize, text: str, count: int, num_tokens: int, musique: Path | None,
             first: int = HELD_OUT_FIRST_QUESTION) -> list[list[int]]:
    """`count` held-out documents of `text` (one of TEXTS); musique needs the MuSiQue file."""
    if text == "mix":
        parts = {g: held_out(tokenize, g, -(-count // 3), num_tokens, musique, first) if g != "musique" or musique
                 else [] for g in ("musique", "prose", "code")}
        order = [g for g in ("musique", "prose", "code") if parts[g]]
        return [parts[order[i % len(order)]][i // len(order)] for i in range(count)]
    if text == "musique":
        if musique is None:
            raise FileNotFoundError("held-out musique needs ../shared/data/musique_s.json")
        return musique_runs(tokenize, musique, range(first, first + count), num_tokens, disjoint=True)
    if text not in HELD_OUT:
        raise ValueError(f"unknown text {text!r}; one of {', '.join(TEXTS)}")
    return spread_runs(tokenize(genre_text(HELD_OUT[text])), count, num_tokens)


def calibration(tokenize: Tokenize, per_genre: int, num_tokens: int, musique: Path | None,
                genres: tuple[str, ...] = CALIBRATION_GENRES) -> dict[str, list[list[int]]]:
    """Calibration contexts by genre: retrieval = MuSiQue questions 0.. (up to 24, if the file exists), the
    others `per_genre` runs of their calibration files (a genre whose files are missing is left out)."""
    out: dict[str, list[list[int]]] = {}
    for g in genres:
        if g == "retrieval":
            if musique is not None:
                out[g] = musique_runs(tokenize, musique, CALIBRATION_QUESTIONS[:per_genre], num_tokens)
        elif genre_text(CALIBRATION[g]):
            out[g] = spread_runs(tokenize(genre_text(CALIBRATION[g])), per_genre, num_tokens)
    return out
