"""The head-stability study and profiler (`kvfabric profile flexicache`, `kvfabric bench flexicache --study`).

Contract:
- `study_prompts(tok, data, doc_questions, musique)`: long chat prompts of two kinds: `doc` (the shipped demo
  document, ~4k tokens, with a question) and `musique` (10 retrieved passages and a multi-hop question, ~6k tokens).
- `head_steps(model, ids, steps, ...)`: prefill, then `steps` greedy decode steps on full KV (end-of-sequence
  banned, so every prompt runs all steps); at each step, per (layer, KV head), the indices of the `top_k` pages with
  the most attention mass (AttentionProbe), leaving out the sink page and the `recent` newest pages, which every
  method keeps resident anyway (int32 [steps, L, H, top_k]); and `miss` [L, H]: the mean share of the head's
  attention that falls outside the pages the radar would keep at `share` of its pages (sink + recent + the best by
  min/max bound): how much a top-K resident set leaks even before time moves its focus.
- `bench_prompts(tok, data, num_musique)`: `kvfabric bench flexicache`'s prompts, none of them the study's.
- `overlap(tops, lag)`: float [L, H]: mean over t of |top(t) ∩ top(t + lag)| / top_k.
- `run_study(...)` -> `Study` (per-prompt overlaps and misses); `Study.table(threshold)` -> HeadTable; `profile(...)`
  measures and saves the table (default: over the shipped one of the model). Deterministic (greedy, no sampling).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvfabric.data import demo_document, find_musique
from kvfabric.engines.flexicache.heads import HeadTable, save_table, table_path
from kvfabric.engines.model import DEFAULT_MODEL
from kvfabric.engines.runtime import BufferCache, load_for_inference, prefill
from kvfabric.research.attention_probe import AttentionProbe

SYSTEM_DOC = "You are a helpful assistant. Answer using only the document."
SYSTEM_QA = "You are a helpful assistant. Answer the question using the passages."
DOC_QUESTIONS = (
    "Summarize the document in detail, part by part.",
    "Who are the people named in the document, and what did each of them do?",
    "Which dates and numbers appear in the document, and what does each one refer to?",
)
DEFAULT_THRESHOLD = 0.63  # overlap at lag 16 below which a head is unstable: no natural gap, ~the lower quartile


@dataclass(frozen=True, slots=True)
class StudyPrompt:
    kind: str  # "doc" | "musique"
    name: str
    ids: tuple[int, ...]


def chat_ids(tok: Any, system: str, user: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                   tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def musique_user(example: dict, num_passages: int = 10) -> str:
    passages = "\n\n".join(f"{c['title']}\n{c['text']}" for c in example["ctxs"][:num_passages])
    return f"{passages}\n\nQuestion: {example['question']} Explain your answer step by step."


def study_prompts(tok: Any, data: str | Path | None = None, doc_questions: Sequence[int] = (0, 1),
                  musique: Sequence[int] = (0, 1, 2)) -> list[StudyPrompt]:
    prompts = [StudyPrompt("doc", f"doc:q{i}", tuple(chat_ids(tok, SYSTEM_DOC, f"Document:\n{demo_document()}"
                                                                               f"\n\nQuestion: {DOC_QUESTIONS[i]}")))
               for i in doc_questions]
    if musique:
        examples = json.loads(find_musique(data).read_text())
        prompts += [StudyPrompt("musique", f"musique:{i}", tuple(chat_ids(tok, SYSTEM_QA, musique_user(examples[i]))))
                    for i in musique]
    return prompts


def bench_prompts(tok: Any, data: str | Path | None, num_musique: int, first: int = 100) -> list[StudyPrompt]:
    """The bench's prompts, held out from the study: the document with a question it did not use, MuSiQue from
    question `first` on."""
    prompts = study_prompts(tok, data, doc_questions=(2,), musique=())
    if num_musique:
        examples = json.loads(find_musique(data).read_text())
        prompts += [StudyPrompt("musique", f"musique:{i}", tuple(chat_ids(tok, SYSTEM_QA, musique_user(examples[i]))))
                    for i in range(first, first + num_musique)]
    return prompts


def banned_ids(model: Any, tok: Any) -> list[int]:
    """End-of-sequence ids: banned from the greedy pick so that every prompt decodes all of its steps."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {tok.eos_token_id} | set([eos] if isinstance(eos, int) else (eos or []))
    return sorted(i for i in ids if i is not None)


@torch.inference_mode()
def head_steps(model: Any, tok: Any, ids: Sequence[int], steps: int, page_size: int = 16, top_k: int = 32,
               recent: int = 2, share: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decode on full KV, watching every (layer, KV head) (see the module doc). Returns
    (int32 [steps, L, H, top_k]: each step's top pages by attention mass, sink and recent pages left out;
     float [L, H]: the mean share of attention outside the pages a radar-ranked head would keep resident at `share`
     of its pages: the sink, the recent pages and the best by bound)."""
    n = len(ids) - 1  # the prefill stops one short: step 0 feeds the last prompt token and sees all the prompt
    buf = prefill(model, list(ids[:n]), n + steps)  # [L, 2, H, n + steps, D]
    cache = BufferCache(buf, n)
    num_layers, heads = buf.shape[0], buf.shape[2]
    group = model.config.num_attention_heads // heads
    probe = AttentionProbe(num_layers, page_size, record_bounds=True)
    banned = banned_ids(model, tok)
    tops = np.zeros((steps, num_layers, heads, top_k), np.int32)
    miss = np.zeros((num_layers, heads))
    token = int(ids[-1])
    for step in range(steps):
        out = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[n + step]]), cache=cache,
                    use_cache=True, logits_to_keep=1, kv_attention=probe)
        logits = out.logits[0, -1].float()
        logits[banned] = float("-inf")
        token = int(torch.argmax(logits))
        for layer, (mass, bound) in enumerate(zip(probe.page_mass, probe.page_bound)):  # [H, pages] each
            num_pages = mass.shape[1]
            pinned = torch.zeros(num_pages, dtype=torch.bool)
            pinned[0] = True
            pinned[max(1, num_pages - recent):] = True
            tops[step, layer] = torch.topk(mass.masked_fill(pinned, float("-inf")), top_k, dim=1).indices.numpy()
            keep = max(int(pinned.sum()), round(share * num_pages)) - int(pinned.sum())
            picked = torch.topk(bound.masked_fill(pinned, float("-inf")), keep, dim=1).indices
            kept = mass[:, pinned].sum(1) + mass.gather(1, picked).sum(1)
            miss[layer] += (1.0 - kept / group).numpy()
    return tops, miss / steps


def overlap(tops: np.ndarray, lag: int) -> np.ndarray:
    """float [L, H]: mean over t of |top(t) ∩ top(t + lag)| / top_k."""
    steps, num_layers, heads, top_k = tops.shape
    out = np.zeros((num_layers, heads))
    for t in range(steps - lag):
        for layer in range(num_layers):
            for h in range(heads):
                out[layer, h] += len(np.intersect1d(tops[t, layer, h], tops[t + lag, layer, h]))
    return out / ((steps - lag) * top_k)


@dataclass(frozen=True, slots=True)
class Study:
    model_id: str
    prompts: tuple[tuple[str, str, int], ...]  # (kind, name, prompt tokens)
    overlaps: np.ndarray  # float [prompts, L, H]
    misses: np.ndarray  # float [prompts, L, H]
    steps: int
    lag: int
    top_k: int
    page_size: int
    share: float

    def by_kind(self) -> dict[str, np.ndarray]:
        kinds = sorted({k for k, _, _ in self.prompts})
        return {k: self.overlaps[[i for i, p in enumerate(self.prompts) if p[0] == k]].mean(0) for k in kinds}

    def table(self, threshold: float = DEFAULT_THRESHOLD) -> HeadTable:
        meta = {"steps": self.steps, "lag": self.lag, "top_k": self.top_k, "page_size": self.page_size,
                "miss_share": self.share, "prompts": [list(p) for p in self.prompts]}
        return HeadTable(model_id=self.model_id, stability=self.overlaps.mean(0).astype(np.float32),
                         threshold=threshold, kinds={k: v.astype(np.float32) for k, v in self.by_kind().items()},
                         miss=self.misses.mean(0).astype(np.float32), meta=meta)


def run_study(model_name: str = DEFAULT_MODEL, data: str | Path | None = None, steps: int = 256, lag: int = 16,
              top_k: int = 32, page_size: int = 16, share: float = 0.1, doc_questions: Sequence[int] = (0, 1),
              musique: Sequence[int] = (0, 1, 2), progress: Callable[[str], None] | None = None) -> Study:
    model, tok = load_for_inference(model_name)
    prompts = study_prompts(tok, data, doc_questions, musique)
    overlaps, misses = [], []
    for p in prompts:
        if progress is not None:
            progress(f"{p.name}: {len(p.ids)} tokens, {steps} steps")
        tops, miss = head_steps(model, tok, p.ids, steps, page_size, top_k, share=share)
        overlaps.append(overlap(tops, lag))
        misses.append(miss)
    return Study(model_id=model_name, prompts=tuple((p.kind, p.name, len(p.ids)) for p in prompts),
                 overlaps=np.stack(overlaps), misses=np.stack(misses), steps=steps, lag=lag, top_k=top_k,
                 page_size=page_size, share=share)


def profile(model_name: str = DEFAULT_MODEL, threshold: float = DEFAULT_THRESHOLD, out: Path | None = None,
            **study_args: Any) -> tuple[Path, HeadTable]:
    """Measure and save the head table (default: over the shipped table of the model)."""
    table = run_study(model_name, **study_args).table(threshold)
    path = out or table_path(model_name)
    save_table(table, path)
    return path, table


def _overlap(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(|a ∩ b| / |a ∪ b|, |a ∩ b| / min(|a|, |b|)) of two boolean head masks."""
    inter, union, least = int((a & b).sum()), int((a | b).sum()), int(min(a.sum(), b.sum()))
    return (inter / union if union else 1.0), (inter / least if least else 1.0)


def report(table: HeadTable, share: float = 0.25) -> dict[str, Any]:
    """The study's figures from a head table: the split at the threshold, per-kind unstable sets and their
    overlap (at the threshold, and as each kind's `share` least stable heads), per-layer mean stability."""
    unstable = table.unstable()
    out: dict[str, Any] = {
        "model": table.model_id, "heads": int(unstable.size), "threshold": table.threshold,
        "unstable": int(unstable.sum()), "unstable_frac": float(unstable.mean()),
        "stability_mean": float(table.stability.mean()),
        "stability_quartiles": [round(float(x), 3) for x in np.quantile(table.stability, [0.25, 0.5, 0.75])],
        "layer_stability": [round(float(x), 3) for x in table.stability.mean(1)],
        **{k: table.meta[k] for k in ("steps", "lag", "top_k", "page_size", "miss_share") if k in table.meta}}
    if table.miss is not None:
        heads = table.shape[1]
        out.update({"miss_mean": float(table.miss.mean()),
                    "layer_miss": [round(float(x), 3) for x in table.miss.mean(1)],
                    "stability_miss_corr": float(np.corrcoef(table.stability.ravel(), table.miss.ravel())[0, 1]),
                    "kept_whole_first": [f"{i // heads}.{i % heads}" for i in table.full_order("retention")[:12]]})
    kinds = sorted(table.kinds)
    if len(kinds) == 2:
        a, b = (table.unstable(table.kinds[k]) for k in kinds)
        jaccard, coeff = _overlap(a, b)
        count = max(1, round(share * unstable.size))
        low = [np.isin(np.arange(unstable.size), np.argsort(table.kinds[k].reshape(-1), kind="stable")[:count])
               for k in kinds]
        out.update({"kinds": kinds, "unstable_by_kind": [int(a.sum()), int(b.sum())],
                    "kind_overlap_jaccard": jaccard, "kind_overlap_coeff": coeff,
                    f"kind_overlap_bottom{round(share * 100)}": float((low[0] & low[1]).sum() / count),
                    "kind_stability_corr": float(np.corrcoef(table.kinds[kinds[0]].ravel(),
                                                             table.kinds[kinds[1]].ravel())[0, 1])})
    return out
