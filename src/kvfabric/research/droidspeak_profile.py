"""DroidSpeak's profiler (`kvfabric droidspeak profile`, `kvfabric bench droidspeak`): the quality of every
contiguous recompute block for a (sender, receiver) pair, saved as the pair's table (kvfabric.droidspeak.table).

Contract
--------
* :func:`profile_prompt` runs one profiling prompt (``context`` reused, ``suffix`` = question then the receiver's
  own greedy answer tokens, computed by the receiver on top): for every block ``[s, e)`` (``0 <= s < e <= L``) and
  for the empty block, the mean KL(receiver's full prefill || receiver on the mixed KV) over every suffix row and
  over the last ``num_answer`` rows (the answer). O(L^2) candidates, but each context layer is computed once per
  block start: for a fixed ``s`` the block grows one layer at a time. Returns a :class:`PromptProfile`.
* :func:`table_from_prompts` averages prompts into a :class:`~kvfabric.droidspeak.table.ProfileTable` (mean KL per
  block, rounded to 6 digits).
* :func:`profile_pair` profiles ``num_prompts`` questions (from ``first``; ``passages`` passages each, short on
  purpose: O(L^2) suffix passes per prompt) and saves the table (``table.save_table``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from kvfabric.blend.runner import LlamaRunner
from kvfabric.droidspeak.pair import check_pair, load_examples, load_sibling, musique_prompt
from kvfabric.droidspeak.runtime import sender_prefill
from kvfabric.droidspeak.table import ProfileTable, save_table
from kvfabric.research.finetune import DERIVED, ensure_finetuned


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


def table_from_prompts(sender: str, receiver: str, profiles: Sequence[PromptProfile]) -> ProfileTable:
    kl = torch.stack([p.kl for p in profiles]).mean(0)
    kl_ans = torch.stack([p.kl_ans for p in profiles]).mean(0)
    as_rows = lambda t: tuple(tuple(round(float(x), 6) for x in row) for row in t)  # noqa: E731
    return ProfileTable(sender, receiver, kl.shape[0] - 1, len(profiles), as_rows(kl), as_rows(kl_ans))


def profile_pair(sender_name: str, receiver_name: str, num_prompts: int = 3, first: int = 100, passages: int = 3,
                 num_answer: int = 8, stride: int = 1, data: str | Path | None = None, log: Any = None) -> tuple[ProfileTable, Path]:
    for name in (sender_name, receiver_name):
        if name in DERIVED:
            ensure_finetuned(name)  # a fine-tuned sibling: built here on first use
    sender, receiver = load_sibling(sender_name), load_sibling(receiver_name)
    check_pair(sender, receiver)
    profiles = []
    for i, example in enumerate(load_examples(data, first, num_prompts)):
        context, question = musique_prompt(receiver.tokenizer, example, passages)
        answer = greedy_answer(receiver.runner, context + question, num_answer)
        profiles.append(profile_prompt(sender.runner, receiver.runner, context, question + answer, num_answer, stride))
        if log is not None:
            log(f"prompt {i + 1}/{num_prompts}: {len(context)} context tokens, reuse KL {float(profiles[-1].kl[0, 0]):.4f}")
    table = table_from_prompts(sender_name, receiver_name, profiles)
    return table, save_table(table)
