"""`kvfabric bench droidspeak --pair qwen-0.5b-1.5b | qwen-1.5b-0.5b`: KV reuse across model sizes via linear maps.

Sender and receiver are Qwen2.5-Coder-0.5B- and -1.5B-Instruct (one family and tokenizer, different sizes: 24 vs 28
layers, 2x64 vs 2x128 KV). Per-layer linear maps from the sender's KV to the receiver's (droidspeak.maps) are fitted
by least squares on ``profile_prompts`` MuSiQue prompts (questions 100..), then measured on held-out questions
(from ``start``). For the receiver, methods side by side:
- ``full``: its own prefill of context + question (TTFT baseline, KL 0);
- ``none``: the question alone, the context dropped: the gap baseline (no KV of another size can be reused as is);
- ``maps``: every layer's KV mapped from the sender's, nothing recomputed (only the question computed);
- ``maps+recompute@K``: layers [0, K) recomputed by the receiver from its own embedding, the rest mapped.
TTFT = mapping + recompute + the question's prefill (the sender's KV is the cached asset, already in memory).
Quality vs ``full`` as in bench.droidspeak: KL over the question rows and the first answer tokens (teacher-forced),
``gap_closed`` = 1 - KL / KL(none) over all rows, ``gap_ans`` over the answer rows, top-1, answer F1. The fit's
``r2`` (variance of the receiver's K and V the maps explain on the profiling tokens, mean over layers) is reported.
"""
from __future__ import annotations

import time

import torch
from rich.console import Console

from kvfabric.droidspeak.maps import fit_maps, kv_features, layer_map
from kvfabric.droidspeak.pair import load_examples, load_sibling, musique_prompt
from kvfabric.droidspeak.runtime import Block, recompute_block, sender_prefill

SIZE_PAIRS = {"qwen-0.5b-1.5b": ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"),
              "qwen-1.5b-0.5b": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")}


@torch.inference_mode()
def fit_pair(sender, receiver, examples: list[dict], passages: int, ridge: float):  # noqa: ANN001
    def features():
        for example in examples:
            context, _ = musique_prompt(receiver.tokenizer, example, passages)
            n = len(context)
            kv_a, _ = sender_prefill(sender.runner, context)
            kv_b, _ = sender_prefill(receiver.runner, context)
            yield kv_features(sender.runner, kv_a, n), kv_features(receiver.runner, kv_b, n)
    layers = layer_map(sender.runner.num_layers, receiver.runner.num_layers)
    return fit_maps(features(), layers, ridge)


@torch.inference_mode()
def run(pair: str, as_json: bool = False, limit: int = 3, start: int = 110, passages: int = 2,
        data: str | None = None, answer_tokens: int = 8, max_new_tokens: int = 16, profile_prompts: int = 4,
        ridge: float = 1e-3, progress: bool = True) -> list[dict]:
    from kvfabric.bench.common import emit, threads_note
    from kvfabric.bench.droidspeak import COLUMNS, _finish, report_question, score, summarize

    sender_name, receiver_name = SIZE_PAIRS[pair]
    console = Console(stderr=True)
    sender, receiver = load_sibling(sender_name), load_sibling(receiver_name)
    a, b = sender.member, receiver.member
    if (a.family, a.tokenizer) != (b.family, b.tokenizer):
        raise ValueError(f"{receiver_name} and {sender_name} do not share a family and tokenizer")
    started = time.perf_counter()
    maps = fit_pair(sender, receiver, load_examples(data, 100, profile_prompts), passages, ridge)
    r2 = [round(float(maps.r2[:, kind].mean()), 3) for kind in (0, 1)]
    console.print(f"maps fitted on {profile_prompts} prompts in {time.perf_counter() - started:.0f} s: "
                  f"mean R^2 K {r2[0]}, V {r2[1]}")
    runner, tok = receiver.runner, receiver.tokenizer
    num_layers = runner.num_layers
    budgets = sorted({num_layers // 4, num_layers // 2, 3 * num_layers // 4})
    methods = ["full", "none", "maps"] + [f"maps+recompute@{k}" for k in budgets]
    stop = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if i is not None}
    rows: list[dict] = []
    for qi, example in enumerate(load_examples(data, start, limit), start):
        context, question = musique_prompt(tok, example, passages)
        n, cap = len(context), len(context) + len(question) + max_new_tokens + answer_tokens + 1
        kv_a, _ = sender_prefill(sender.runner, context)
        ref = None
        for method in methods:
            t0 = time.perf_counter()
            kv = runner.workspace(cap)
            base = n
            if method == "full":
                logits_q = runner.logits(runner.forward(torch.tensor(context + question), kv)[n:])
            elif method == "none":
                base = 0
                logits_q = _finish(runner, kv, 0, question)
            else:
                maps.apply(sender.runner, kv_a, n, runner, kv)
                if "@" in method:
                    recompute_block(runner, context, kv, Block(0, int(method.split("@")[1])), None)
                logits_q = _finish(runner, kv, n, question)
            ttft = time.perf_counter() - t0
            scored = score(runner, tok, kv, logits_q, base + len(question), len(question), ref, answer_tokens,
                           max_new_tokens, stop, example.get("answers") or [])
            ref = ref or scored
            rows.append({"q": qi, "pair": pair, "method": method, "block": None, "context_tokens": n,
                         "ttft_s": round(ttft, 4), **scored.fields,
                         "bytes_per_token": round(a.layout.num_bytes(1), 1) if method.startswith("maps") else 0.0})
        report_question([r for r in rows if r["q"] == qi], qi, n, as_json, console if progress else None)
    summary = summarize(rows, methods, baseline="none")
    for s in summary:
        s.update(r2_k=r2[0], r2_v=r2[1], profile_prompts=profile_prompts)
    emit(summary, as_json, f"bench droidspeak: {pair} ({sender_name} -> {receiver_name}) through linear KV maps, "
                           f"{len({r['q'] for r in rows})} MuSiQue questions x {passages} passages ({threads_note()})",
         COLUMNS + ["r2_k", "r2_v"])
    maps_row = next(s for s in summary if s["method"] == "maps")
    verdict = {"summary": "report", "pair": pair, "maps_gap_closed": maps_row["gap_closed"],
               "maps_gap_ans": maps_row["gap_ans"], "maps_top1": maps_row["top1"],
               "best_recompute": max((s for s in summary if "@" in s["method"]), key=lambda s: s["gap_closed"] or 0)
               ["method"], "r2_k": r2[0], "r2_v": r2[1]}
    emit([verdict], as_json, "cross-size reuse (report: no target)", list(verdict))
    return rows + summary + [verdict]

