"""`kvfabric bench droidspeak`: a receiver model reusing a sibling's KV (DroidSpeak) on MuSiQue prompts.

Pair ``finetuned``: sender SmolLM2-135M-Instruct, receiver its fine-tuned sibling ``smollm2-135m-musique`` (trained
on the passages of questions 0-99; profiled on 100-104 by default; measured here on questions from 110: held out).
Per question the sender prefills the context (system text + passages) once and stores its KV and the hidden states
the blocks need in the family namespace (disk tier in a temporary folder: a real write and read of checked chunks).
Then, for the receiver, methods side by side:
- ``full``: the receiver's own prefill of context + question (the TTFT baseline; KL 0 by definition);
- ``reuse``: the sender's KV for every layer, nothing recomputed (only the question computed);
- ``droidspeak``: the profiled block recomputed from the sender's hidden state, the sender's KV elsewhere, the load
  overlapped with the recompute; ``droidspeak@K``: the best profiled block of K layers (two other budgets);
- ``cacheblend`` / ``cacheblend@K``: CacheBlend's token selection (``kvfabric.blend``, its default check layers and
  score) over the sender's KV of the context, at the same compute as ``droidspeak`` / ``droidspeak@K``: it
  recomputes ``block / L`` of the context's token-layers, a chosen share of the tokens on every layer instead of
  every token on a block of layers (``recompute_frac`` in its rows). The sender's KV is stored once more, in the
  blend runner's own passage store (one passage: the whole context, at its own offset, so nothing is re-rotated),
  on the same disk tier, and loaded layer by layer during the recompute.
TTFT = the load + recompute + the question's prefill up to its first token's logits. Quality vs ``full`` over every
question row and the first ``answer_tokens`` of full's greedy answer (teacher-forced): mean KL(full || method),
``gap_closed`` = 1 - KL / KL(reuse) (all rows), ``gap_ans`` the same over the answer rows; top-1 agreement; answer F1
(greedy, SQuAD-normalised) beside ``f1_full``; bytes fetched per context token (KV + hidden state). The ``full``
row also carries ``model_kl``: KL(receiver's full || the sender's own full prefill) over the same rows, i.e. how far
apart the two models are on this held-out text.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from rich.console import Console

from kvfabric.bench.blend import compare, f1_score
from kvfabric.bench.common import emit, threads_note
from kvfabric.blend.fusion import Blender
from kvfabric.blend.values import BlendConfig
from kvfabric.config import Config, DiskTierConfig
from kvfabric.droidspeak.family import DroidStore
from kvfabric.droidspeak.pair import check_pair, load_examples, load_sibling, musique_prompt
from kvfabric.droidspeak.runtime import Block, droid_prefill, sender_prefill
from kvfabric.droidspeak.table import load_table
from kvfabric.research.droidspeak_profile import profile_pair
from kvfabric.research.finetune import DERIVED, ensure_finetuned

PAIRS = {"finetuned": ("smollm2-135m-instruct", "smollm2-135m-musique")}
COLUMNS = ["pair", "method", "block", "questions", "ttft_s", "ttft_speedup", "model_kl", "kl", "gap_closed", "gap_ans", "top1",
           "f1", "f1_full", "bytes_per_token"]


@torch.inference_mode()
def _decode(runner, kv: torch.Tensor, first_logits: torch.Tensor, start: int, num_tokens: int,
            stop: set[int]) -> list[int]:
    out: list[int] = []
    logits = first_logits
    for i in range(num_tokens):
        token = int(logits.argmax(-1))
        if token in stop:
            break
        out.append(token)
        logits = runner.logits(runner.forward(torch.tensor([token]), kv, start=start + i))[-1]
    return out


@torch.inference_mode()
def _finish(runner, kv: torch.Tensor, n: int, question: list[int]) -> torch.Tensor:
    """The question's prefill on top of slots [0, n): logits of every question row [q, V]."""
    return runner.logits(runner.forward(torch.tensor(question), kv, start=n))


@torch.inference_mode()
def blend_prefill(blender: Blender, context: list[int], question: list[int], frac: float,
                  capacity: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """CacheBlend over the context's KV in ``blender``'s store (another model's, stored under the context's
    tokens), ``frac`` of its token-layers recomputed: (KV workspace, logits of the question rows, bytes loaded)."""
    res = blender.prefill([context, question], mode="blend", recompute_frac=frac, logits_from=len(context),
                          capacity=capacity)
    if res.fallback:
        raise RuntimeError(f"cacheblend fell back to a full prefill ({res.fallback})")
    return res.kv, res.logits, res.load_bytes


@dataclass(frozen=True, slots=True)
class Scored:
    """One method's output on one question, against the reference method's (the first one scored)."""
    logits: torch.Tensor  # [question rows + forced answer rows, V]
    forced: list[int]  # the reference's first answer tokens, teacher-forced after the question
    fields: dict  # kl, kl_ans, top1, f1, answer: the JSON row's quality fields


@torch.inference_mode()
def score(runner, tok, kv: torch.Tensor, logits_q: torch.Tensor, end: int, num_question: int,  # noqa: ANN001
          ref: Scored | None, answer_tokens: int, max_new_tokens: int, stop: set[int], answers: list[str]) -> Scored:
    """Greedy answer from the question's last row (slots [0, end) filled), the reference's answer teacher-forced,
    KL / top-1 over question + answer rows and over the answer rows alone, F1 of the greedy answer."""
    answer = _decode(runner, kv, logits_q[-1], end, max_new_tokens, stop)
    forced = answer[:answer_tokens] if ref is None else ref.forced
    tf = _finish(runner, kv, end, forced) if forced else logits_q[:0]
    logits = torch.cat([logits_q, tf])
    base = logits if ref is None else ref.logits
    kl, top1 = compare(base, logits)
    kl_ans = compare(base[num_question:], tf)[0] if tf.shape[0] else 0.0
    text = tok.decode(answer, skip_special_tokens=True).strip()
    return Scored(logits, forced, {"kl": round(kl, 5), "kl_ans": round(kl_ans, 5), "top1": round(top1, 4),
                                   "f1": round(f1_score(text, answers), 4), "answer": text})


@torch.inference_mode()  # every method alike: no autograd graph (a full prefill with one is ~2x slower)
def run(pair: str = "finetuned", as_json: bool = False, limit: int = 3, start: int = 110, passages: int = 10,
        data: str | None = None, answer_tokens: int = 8, max_new_tokens: int = 16, threshold: float = 0.9,
        profile_prompts: int = 3, blend: bool = True, progress: bool = True) -> list[dict]:
    sender_name, receiver_name = PAIRS[pair]
    console = Console(stderr=True)
    table = load_table(sender_name, receiver_name)
    if table is None:
        console.print(f"profiling {sender_name} -> {receiver_name} first ({profile_prompts} prompts)")
        table, _ = profile_pair(sender_name, receiver_name, num_prompts=profile_prompts, log=console.print)
    chosen = table.choose(threshold)
    budgets = sorted({max(1, chosen.num_layers // 2), min(table.num_layers, chosen.num_layers * 2)} -
                     {chosen.num_layers})
    methods: list[tuple[str, Block | None]] = [("full", None), ("reuse", Block(0, 0)), ("droidspeak", chosen)]
    others = [table.nearest_of_size(k) for k in budgets]
    methods += [(f"droidspeak@{b.num_layers}", b) for b in dict.fromkeys(others) if b != chosen]
    # CacheBlend at each DroidSpeak budget's compute (share of the context's token-layers recomputed); it runs every
    # token up to its first check layer, so it cannot spend less than that
    blend_fracs: dict[str, float] = {}
    if blend:
        floor = (BlendConfig().check_layers[0] + 1) / table.num_layers
        for method, b in methods[2:]:
            if b is not None and b.num_layers / table.num_layers >= floor:
                blend_fracs[method.replace("droidspeak", "cacheblend")] = b.num_layers / table.num_layers
        methods += [(name, None) for name in blend_fracs]
    for name in (sender_name, receiver_name):
        if name in DERIVED:
            ensure_finetuned(name)  # PAIRS["finetuned"]'s receiver: built here on first use
    sender, receiver = load_sibling(sender_name), load_sibling(receiver_name)
    check_pair(sender, receiver)
    runner, tok = receiver.runner, receiver.tokenizer
    stop = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if i is not None}
    capture = {b.start for _, b in methods if b is not None and b.needs_hidden}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvfabric-droid-") as folder, ThreadPoolExecutor(1) as loader:
        config = Config(chunk_size=256, tiers=("disk",), disk=DiskTierConfig(path=folder))
        hidden_size = runner.config.hidden_size
        blend_config = Config(chunk_size=256, tiers=("disk",), disk=DiskTierConfig(path=f"{folder}/blend"))
        with DroidStore(sender.member, sender_name, hidden_size, config) as out_store, \
                DroidStore(receiver.member, sender_name, hidden_size, config) as in_store, \
                Blender(runner.model, model_id=f"{sender_name}--{receiver_name}", config=blend_config) as blender:
            _finish(runner, runner.workspace(96), 0, list(range(64)))  # warm-up outside the measurements
            for qi, example in enumerate(load_examples(data, start, limit), start):
                context, question = musique_prompt(tok, example, passages)
                n, cap = len(context), len(context) + len(question) + max_new_tokens + answer_tokens + 1
                kv_a, hidden_a = sender_prefill(sender.runner, context, capture)
                out_store.store(context, kv_a, hidden_a)
                del hidden_a
                if blend_fracs:
                    blender.store.store(context, kv_a)
                ref: Scored | None = None
                for method, block in methods:
                    t0 = time.perf_counter()
                    num_bytes = 0
                    if method in blend_fracs:
                        kv, logits_q, num_bytes = blend_prefill(blender, context, question, blend_fracs[method], cap)
                    elif block is None:
                        kv = runner.workspace(cap)
                        logits_q = runner.logits(runner.forward(torch.tensor(context + question), kv)[n:])
                    else:
                        got = droid_prefill(runner, in_store, context, block, cap, loader)
                        if got is None:
                            raise RuntimeError(f"q{qi} {method}: the sender's chunks were not found")
                        kv, num_bytes = got.kv, got.num_bytes
                        logits_q = _finish(runner, kv, n, question)
                    ttft = time.perf_counter() - t0
                    scored = score(runner, tok, kv, logits_q, n + len(question), len(question), ref, answer_tokens,
                                   max_new_tokens, stop, example.get("answers") or [])
                    ref = ref or scored
                    rows.append({"q": qi, "pair": pair, "method": method,
                                 "block": None if block is None else [block.start, block.stop],
                                 **({"recompute_frac": round(blend_fracs[method], 4)} if method in blend_fracs else {}),
                                 "context_tokens": n, "ttft_s": round(ttft, 4), **scored.fields,
                                 "bytes_per_token": round(num_bytes / n, 1)})
                # how far the two models are apart here: the sender's own distributions vs the receiver's full
                ws_a = sender.runner.workspace(cap)
                ws_a[:, :, :, :n] = kv_a
                own = _finish(sender.runner, ws_a, n, question)
                if ref.forced:
                    own = torch.cat([own, _finish(sender.runner, ws_a, n + len(question), ref.forced)])
                mine = [r for r in rows if r["q"] == qi]
                mine[0]["model_kl"] = round(compare(ref.logits, own)[0], 5)
                del kv_a, ws_a
                report_question(mine, qi, n, as_json, console if progress else None)
    summary = summarize(rows, [m for m, _ in methods])
    emit(summary, as_json, f"bench droidspeak: {pair} ({sender_name} -> {receiver_name}), "
                           f"{len({r['q'] for r in rows})} MuSiQue questions x {passages} passages ({threads_note()})",
         COLUMNS)
    targets = targets_row(summary, pair)
    emit([targets], as_json, "targets", list(targets))
    return rows + summary + [targets]


def report_question(mine: list[dict], qi: int, n: int, as_json: bool, console: Console | None) -> None:
    """One question's rows: as JSON lines, and a progress line on stderr."""
    if as_json:
        for r in mine:
            print(json.dumps(r), flush=True)
    if console is not None:
        console.print(f"q{qi} {n} tokens: " + ", ".join(
            f"{r['method']} {r['ttft_s']:.2f}s KL {r['kl']:.3f}" for r in mine))


def summarize(rows: list[dict], methods: list[str], baseline: str = "reuse") -> list[dict]:
    """One row per method; gap_closed / gap_ans measure the KL gap closed against the `baseline` method's."""
    by_q = {(r["q"], r["method"]): r for r in rows}
    reuse = [r for r in rows if r["method"] == baseline]
    reuse_kl = statistics.fmean(r["kl"] for r in reuse) if reuse else 0.0
    reuse_ans = statistics.fmean(r["kl_ans"] for r in reuse) if reuse else 0.0
    f1_full = statistics.fmean(r["f1"] for r in rows if r["method"] == "full") if rows else 0.0
    out = []
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        kl, kl_ans = statistics.fmean(r["kl"] for r in mine), statistics.fmean(r["kl_ans"] for r in mine)
        out.append({"summary": "droidspeak", "pair": mine[0]["pair"], "method": method, "block": mine[0]["block"],
                    "questions": len(mine), "ttft_s": round(statistics.median(r["ttft_s"] for r in mine), 3),
                    "ttft_speedup": round(statistics.median(by_q[r["q"], "full"]["ttft_s"] / r["ttft_s"]
                                                            for r in mine), 2),
                    "kl": round(kl, 4), "kl_ans": round(kl_ans, 4),
                    "gap_closed": round(1 - kl / reuse_kl, 3) if reuse_kl > 0 else None,
                    "gap_ans": round(1 - kl_ans / reuse_ans, 3) if reuse_ans > 0 else None,
                    "top1": round(statistics.fmean(r["top1"] for r in mine), 3),
                    "f1": round(statistics.fmean(r["f1"] for r in mine), 3), "f1_full": round(f1_full, 3),
                    "bytes_per_token": mine[0]["bytes_per_token"]})
        if "recompute_frac" in mine[0]:  # cacheblend: the share of the context's token-layers recomputed
            out[-1]["recompute_frac"] = mine[0]["recompute_frac"]
        if method == "full" and "model_kl" in mine[0]:  # KL(receiver || the sender's own prefill): how far apart
            out[-1]["model_kl"] = round(statistics.fmean(r["model_kl"] for r in mine), 4)
    return out


def targets_row(summary: list[dict], pair: str) -> dict:
    ds = next((s for s in summary if s["method"] == "droidspeak"), None)
    if ds is None:
        return {"summary": "targets", "pair": pair, "met": None}
    gap_ok = all(g is not None and g >= 0.9 for g in (ds["gap_closed"], ds["gap_ans"]))
    return {"summary": "targets", "pair": pair, "ttft_speedup": ds["ttft_speedup"], "speedup_target": 2.5,
            "speedup_met": ds["ttft_speedup"] >= 2.5, "gap_closed": ds["gap_closed"], "gap_ans": ds["gap_ans"],
            "gap_target": 0.9, "gap_met": gap_ok}
