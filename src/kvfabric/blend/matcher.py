"""Find known passages inside a flat token list: a rolling hash at every offset, confirmed by the full hash.

Contract
--------
* ``add(tokens)`` registers a passage (>= ``min_tokens`` tokens): its anchor is the polynomial hash of its first
  ``w = min(window, len)`` tokens, its proof the sha256 of all its tokens (:func:`kvfabric.blend.store.passage_digest`).
* ``find(tokens)`` hashes the w-token window starting at every offset of ``tokens`` (vectorised; 64-bit arithmetic
  modulo 2**64; one pass per distinct w, so at most ``window`` passes), and at each offset whose hash is an anchor
  checks the registered passages with that anchor by their full hash over the span. Matches are returned left to
  right, non-overlapping; at one offset the longest confirmed passage wins. A hash collision can cost a sha256,
  never a wrong match.
* ``split(tokens)`` turns the matches into segments covering the whole list: (start, end, matched) triples.
The registry is in memory (per process); whether a passage's KV is still cached is the caller's check.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvfabric.blend.store import passage_digest

_BASE = np.uint64(0x100000001B3)  # odd 64-bit multiplier (FNV prime)


@dataclass(frozen=True, slots=True)
class Match:
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def window_hashes(tokens: np.ndarray, window: int) -> np.ndarray:
    """Polynomial hash (mod 2**64) of tokens[i:i+window] for every i in [0, len - window]."""
    t = np.asarray(tokens, dtype=np.uint64)
    count = t.size - window + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    h = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(window):
            h = h * _BASE + t[j:j + count] + np.uint64(1)
    return h


class PassageMatcher:
    def __init__(self, window: int = 16, min_tokens: int = 4) -> None:
        if not 0 < min_tokens <= window:
            raise ValueError(f"need 0 < min_tokens <= window, got {min_tokens}, {window}")
        self.window = window
        self.min_tokens = min_tokens
        self._by_anchor: dict[tuple[int, int], list[tuple[int, bytes]]] = {}  # (w, hash) -> [(length, digest)]
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_anchor.values())

    def add(self, tokens: Sequence[int] | np.ndarray) -> bool:
        """Register a passage; False when shorter than ``min_tokens`` (it can then only be passed as a segment)."""
        arr = np.asarray(tokens, dtype=np.int64)
        if arr.size < self.min_tokens:
            return False
        w = min(self.window, int(arr.size))
        anchor = (w, int(window_hashes(arr[:w], w)[0]))
        entry = (int(arr.size), passage_digest(arr))
        with self._lock:
            entries = self._by_anchor.setdefault(anchor, [])
            if entry not in entries:
                entries.append(entry)
                entries.sort(reverse=True)  # longest first
        return True

    def find(self, tokens: Sequence[int] | np.ndarray) -> list[Match]:
        arr = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            anchors = dict(self._by_anchor)
        if not anchors:
            return []
        # candidates[i] = registered (length, digest) whose anchor matches at offset i, longest first
        candidates: dict[int, list[tuple[int, bytes]]] = {}
        for w in sorted({w for w, _ in anchors}):
            hashes = window_hashes(arr, w)
            keys = np.fromiter((h for ww, h in anchors if ww == w), dtype=np.uint64)
            for i in np.flatnonzero(np.isin(hashes, keys)).tolist():
                candidates.setdefault(i, []).extend(anchors.get((w, int(hashes[i])), ()))
        matches: list[Match] = []
        cursor = 0
        for i in sorted(candidates):
            if i < cursor:
                continue
            for length, digest in sorted(candidates[i], reverse=True):
                if i + length <= arr.size and passage_digest(arr[i:i + length]) == digest:
                    matches.append(Match(i, length))
                    cursor = i + length
                    break
        return matches

    def split(self, tokens: Sequence[int] | np.ndarray) -> list[tuple[int, int, bool]]:
        """Segments (start, end, matched) covering ``tokens`` in order."""
        out: list[tuple[int, int, bool]] = []
        cursor = 0
        for m in self.find(tokens):
            if m.start > cursor:
                out.append((cursor, m.start, False))
            out.append((m.start, m.end, True))
            cursor = m.end
        if cursor < len(tokens):
            out.append((cursor, len(tokens), False))
        return out
