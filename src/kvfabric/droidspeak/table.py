"""A (sender, receiver) pair's profile table: what the receiver reads to choose the block of layers it recomputes.

Contract
--------
* :class:`ProfileTable` holds the mean KL per block over the profiling prompts (the gap closed is
  ``1 - KL / KL(reuse)``), picks the cheapest block meeting a threshold on both row sets (:meth:`choose`), the best
  block of a given size (:meth:`best_of_size`), and round-trips through JSON
  (``$KVFABRIC_HOME/droidspeak/<sender>--<receiver>.json``: :func:`save_table`, atomically; :func:`load_table`).
  It is measured offline by kvfabric.research.droidspeak_profile (`kvfabric droidspeak profile`).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from kvfabric.config import kvfabric_home
from kvfabric.droidspeak.runtime import Block


@dataclass(frozen=True, slots=True)
class ProfileTable:
    sender: str
    receiver: str
    num_layers: int
    num_prompts: int
    kl: tuple[tuple[float, ...], ...]  # [L + 1][L + 1], mean over prompts (see PromptProfile)
    kl_ans: tuple[tuple[float, ...], ...]

    def gap_closed(self, block: Block) -> tuple[float, float]:
        """(share of the reuse KL gap closed over every row, over the answer rows)."""
        s, e = block.start, block.stop
        reuse, reuse_ans = self.kl[0][0], self.kl_ans[0][0]
        return (1 - self.kl[s][e] / reuse if reuse > 0 else 1.0,
                1 - self.kl_ans[s][e] / reuse_ans if reuse_ans > 0 else 1.0)

    def blocks(self) -> list[Block]:
        """The profiled blocks (a strided profile leaves the others NaN)."""
        return [Block(s, e) for s in range(self.num_layers) for e in range(s + 1, self.num_layers + 1)
                if math.isfinite(self.kl[s][e]) and math.isfinite(self.kl_ans[s][e])]

    def best_of_size(self, num_layers: int) -> Block | None:
        """The profiled block of ``num_layers`` layers closing the most of the gap (mean of both row sets)."""
        if num_layers == 0:
            return Block(0, 0)
        sized = [b for b in self.blocks() if b.num_layers == num_layers]
        return max(sized, key=lambda b: sum(self.gap_closed(b))) if sized else None

    def choose(self, threshold: float = 0.9) -> Block:
        """The cheapest block closing >= threshold of the gap on every row and on the answer rows (the whole
        model when none does)."""
        for size in range(self.num_layers + 1):
            best = self.best_of_size(size)
            if best is not None and min(self.gap_closed(best)) >= threshold:
                return best
        return Block(0, self.num_layers)

    def nearest_of_size(self, num_layers: int) -> Block:
        """``best_of_size`` for the nearest profiled size at or above ``num_layers``."""
        for size in range(num_layers, self.num_layers + 1):
            best = self.best_of_size(size)
            if best is not None:
                return best
        return Block(0, self.num_layers)

    def to_json(self) -> str:
        return json.dumps({"sender": self.sender, "receiver": self.receiver, "num_layers": self.num_layers,
                           "num_prompts": self.num_prompts, "kl": self.kl, "kl_ans": self.kl_ans})

    @classmethod
    def from_json(cls, text: str) -> ProfileTable:
        d = json.loads(text)
        size = d["num_layers"] + 1
        if len(d["kl"]) != size or any(len(r) != size for r in (*d["kl"], *d["kl_ans"])):
            raise ValueError("profile table: shape does not match num_layers")
        return cls(d["sender"], d["receiver"], d["num_layers"], d["num_prompts"],
                   tuple(map(tuple, d["kl"])), tuple(map(tuple, d["kl_ans"])))


def table_path(sender: str, receiver: str) -> Path:
    safe = lambda name: Path(name).name or name  # noqa: E731  (a folder path: its last part)
    return kvfabric_home() / "droidspeak" / f"{safe(sender)}--{safe(receiver)}.json"


def save_table(table: ProfileTable, path: Path | None = None) -> Path:
    """Write atomically (temp file + rename)."""
    path = path or table_path(table.sender, table.receiver)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(table.to_json())
    os.replace(tmp, path)
    return path


def load_table(sender: str, receiver: str, path: Path | None = None) -> ProfileTable | None:
    path = path or table_path(sender, receiver)
    return ProfileTable.from_json(path.read_text()) if path.is_file() else None
