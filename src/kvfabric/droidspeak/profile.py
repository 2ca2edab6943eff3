"""Profiling a (sender, receiver) pair: the quality of every contiguous recompute block, saved as a small table.

Contract
--------
* :func:`profile_prompt` runs one profiling prompt (``context`` reused, ``suffix`` = question then the receiver's
  own greedy answer tokens, computed by the receiver on top): for every block ``[s, e)`` (``0 <= s < e <= L``) and
  for the empty block, the mean KL(receiver's full prefill || receiver on the mixed KV) over every suffix row and
  over the last ``num_answer`` rows (the answer). O(L^2) candidates, but each context layer is computed once per
  block start: for a fixed ``s`` the block grows one layer at a time. Returns a :class:`PromptProfile`.
* :class:`ProfileTable` averages prompts (mean KL per block; the gap closed is ``1 - KL / KL(reuse)``), picks the
  cheapest block meeting a threshold on both row sets (:meth:`choose`), the best block of a given size
  (:meth:`best_of_size`), and round-trips through JSON (``$KVFABRIC_HOME/droidspeak/<sender>--<receiver>.json``).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from kvfabric.blend.runner import LlamaRunner
from kvfabric.config import kvfabric_home
from kvfabric.droidspeak.runtime import Block, sender_prefill


def kl_rows(ref_logprobs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per row; ref_logprobs [m, V] log-softmaxed, logits [m, V] raw."""
    other = F.log_softmax(logits.float(), dim=-1)
    return (ref_logprobs.exp() * (ref_logprobs - other)).sum(-1).clamp_min(0.0)


@torch.inference_mode()
def greedy_answer(runner: LlamaRunner, ids: Sequence[int], num_tokens: int) -> list[int]:
    """The runner's greedy continuation of ``ids`` (``num_tokens`` tokens, full prefill first)."""
    kv = runner.workspace(len(ids) + num_tokens)
    hidden = runner.forward(torch.tensor(list(ids)), kv)
    out: list[int] = []
    for i in range(num_tokens):
        token = int(runner.logits(hidden[-1:]).argmax(-1))
        out.append(token)
        if i + 1 < num_tokens:
            hidden = runner.forward(torch.tensor([token]), kv, start=len(ids) + i)
    return out


@dataclass(frozen=True, slots=True)
class PromptProfile:
    kl: torch.Tensor  # [L + 1, L + 1]: [s, e] = block [s, e) for s < e; the diagonal = the empty block (reuse)
    kl_ans: torch.Tensor  # the same over the answer rows


@torch.inference_mode()
def profile_prompt(sender: LlamaRunner, receiver: LlamaRunner, context: Sequence[int], suffix: Sequence[int],
                   num_answer: int, stride: int = 1) -> PromptProfile:
    """Why it is affordable: the suffix's hidden state at the input of layer ``e`` is the same for every block
    ``[s, e')`` with ``e' >= e`` (its layers below ``e`` see the same context KV), so for each block start the
    suffix advances one layer with the growing block, and each candidate only runs the layers ``[e, L)``.
    ``stride > 1`` scores only blocks whose ends lie on multiples of ``stride`` (or at ``L``): a coarser, cheaper
    table (the other entries stay NaN)."""
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    n, m, num_layers = len(context), len(suffix), receiver.num_layers
    ids = torch.tensor(list(context) + list(suffix))
    ref_kv = receiver.workspace(n + m)
    ref = F.log_softmax(receiver.logits(receiver.forward(ids, ref_kv)[n:]), dim=-1)  # [m, V]
    del ref_kv
    kv_a, hidden_a = sender_prefill(sender, context, capture=range(1, num_layers))
    ws = receiver.workspace(n + m)
    ctx = receiver.tokens(torch.arange(n), n)  # built once: positions, rope, attention plan
    suf = receiver.tokens(torch.arange(n, n + m), n + m)
    kl = torch.full((num_layers + 1, num_layers + 1), float("nan"))
    kl_ans = kl.clone()

    def suffix_layer(l: int, g: torch.Tensor) -> torch.Tensor:
        return receiver.layer(l, g, ws, suf)

    def score(s: int, e: int, g: torch.Tensor) -> None:  # g: the suffix's hidden at the input of layer e
        for l in range(e, num_layers):
            g = suffix_layer(l, g)
        rows = kl_rows(ref, receiver.logits(g[0]))
        kl[s, e], kl_ans[s, e] = rows.mean(), rows[m - num_answer:].mean()

    ws[:, :, :, :n] = kv_a
    reuse_in = [receiver.embed(ids[n:])]  # the suffix's input of each layer with the sender's KV everywhere
    for l in range(num_layers):
        reuse_in.append(suffix_layer(l, reuse_in[-1]))
    rows = kl_rows(ref, receiver.logits(reuse_in[-1][0]))  # the empty block: plain reuse
    kl.fill_diagonal_(float(rows.mean()))
    kl_ans.fill_diagonal_(float(rows[m - num_answer:].mean()))
    for s in range(0, num_layers, stride):
        ws[:, :, :, :n] = kv_a  # the previous start recomputed layers >= s - 1
        h = receiver.embed(ids[:n]) if s == 0 else hidden_a[s].view(1, n, -1)
        g = reuse_in[s]
        for e in range(s + 1, num_layers + 1):
            h = receiver.layer(e - 1, h, ws, ctx)  # the block grows by layer e - 1
            g = suffix_layer(e - 1, g)
            if e % stride == 0 or e == num_layers:
                score(s, e, g)
    return PromptProfile(kl, kl_ans)


@dataclass(frozen=True, slots=True)
class ProfileTable:
    sender: str
    receiver: str
    num_layers: int
    num_prompts: int
    kl: tuple[tuple[float, ...], ...]  # [L + 1][L + 1], mean over prompts (see PromptProfile)
    kl_ans: tuple[tuple[float, ...], ...]

    @classmethod
    def from_prompts(cls, sender: str, receiver: str, profiles: Sequence[PromptProfile]) -> ProfileTable:
        kl = torch.stack([p.kl for p in profiles]).mean(0)
        kl_ans = torch.stack([p.kl_ans for p in profiles]).mean(0)
        as_rows = lambda t: tuple(tuple(round(float(x), 6) for x in row) for row in t)  # noqa: E731
        return cls(sender, receiver, kl.shape[0] - 1, len(profiles), as_rows(kl), as_rows(kl_ans))

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
