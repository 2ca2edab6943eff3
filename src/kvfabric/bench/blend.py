"""`kvfabric bench blend`: CacheBlend on the real model over MuSiQue questions (10 retrieved passages each).

Prompt (chat template of the model): a system/prefix segment, the passages (each cached alone, from position 0, in
the blend namespace), then the question segment, always computed. For each question, settings side by side:
- `full`: ordinary prefill of the whole prompt: the reference (TTFT baseline, KL 0 by definition);
- `reuse`: every passage's cached KV re-rotated to its offset, nothing recomputed (only the question computed);
- `blend@R`: CacheBlend recomputing the top R of the passage tokens by KV deviation (R = 5 %, 15 %, 30 %);
- `random@15`: the same pipeline with 15 % random tokens (the control);
- `auto` (optional): the ratio picked by the loading controller from the measured load speed;
- `oracle@15` (optional, a study): the same pipeline ranking tokens by what a full prefill reveals (the attention the
  question pays each token in every layer from the first check layer on, times how far its cached V is from the
  true V): a bound on what a better online score could buy at 15 %.
Metrics per setting, against `full`: next-token distributions over every question position and the first
`answer_tokens` tokens of full's greedy answer (teacher-forced): mean KL(full || setting) and top-1 agreement;
`kl_q` / `kl_ans`: the KL over the question positions / over the answer tokens only;
answer F1 (SQuAD-normalised, greedy answer vs the gold answers); TTFT; mean recomputed fraction of the passage
tokens per layer. Summary: medians of TTFT and of the per-question speed-up vs `full`, mean KL, the share of the
full-reuse KL gap closed (1 - mean KL / mean KL of reuse; also the mean of per-question shares), top-1, F1.
"""
from __future__ import annotations

import collections
import json
import os
import re
import statistics
import string
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console

from kvfabric.bench.common import emit, threads_note
from kvfabric.data import find_musique

SYSTEM = "You are a helpful assistant. Answer the question using the passages."
PLACEHOLDER = "\x00KVFABRIC\x00"
COLUMNS = ["setting", "questions", "ttft_s", "speedup", "recompute_frac", "kl", "gap_closed", "gap_closed_q", "kl_ans",
           "gap_ans", "top1", "f1"]


# ---- answer F1 (SQuAD normalisation) --------------------------------------------------------------------
def _normalize(text: str) -> list[str]:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def f1_score(prediction: str, answers: list[str]) -> float:
    best = 0.0
    pred = _normalize(prediction)
    for answer in answers:
        gold = _normalize(answer)
        common = collections.Counter(pred) & collections.Counter(gold)
        same = sum(common.values())
        if not pred or not gold or same == 0:
            continue
        precision, recall = same / len(pred), same / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


# ---- prompt ---------------------------------------------------------------------------------------------
def prompt_parts(tokenizer: Any) -> tuple[str, str]:
    """(text before the user content, text after it) of the chat template, generation prompt included."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PLACEHOLDER}],
            add_generation_prompt=True, tokenize=False)
        head, tail = text.split(PLACEHOLDER)
        return head, tail
    return SYSTEM + "\n\n", "\nAnswer:"


def build_segments(tokenizer: Any, example: dict, num_passages: int) -> tuple[list[list[int]], list[str]]:
    head, tail = prompt_parts(tokenizer)

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    passages = [enc(f"{c['title']}\n{c['text']}\n\n") for c in example["ctxs"][:num_passages]]
    question = enc(f"Question: {example['question']}\nAnswer in a few words.{tail}")
    answers = list(example.get("answers") or [])
    return [enc(head), *passages, question], answers


@torch.inference_mode()
def oracle_ranking(runner: Any, tokens: list[int], q_start: int, cached_kv: torch.Tensor,
                   first_layer: int) -> torch.Tensor:
    """A score per token [n] that needs the answer: a full prefill of ``tokens`` run layer by layer; from
    ``first_layer`` on, the attention the question tokens (``q_start``..) pay each token (summed over heads and
    questions) times the norm of (true V - cached V), summed over layers. ``cached_kv`` [L, 2, H, >= n, D] holds the
    reused KV (a ``reuse`` prefill's workspace). A study tool: it costs a full prefill."""
    n = len(tokens)
    kv = runner.workspace(n)
    pos = torch.arange(n)
    rope = runner.rope(pos)
    hidden = runner.embed(torch.tensor(tokens))
    group = runner.num_heads // runner.num_kv_heads
    unseen = pos.view(1, -1) > pos[q_start:].view(-1, 1)  # [f, n]: causal mask of the question rows
    rank = torch.zeros(n)
    for l in range(runner.num_layers):
        q, k, v = runner.qkv(l, hidden, rope)
        runner.write_kv(kv, l, slice(0, n), k, v)
        if l >= first_layer:
            keys = kv[l, 0, :, :n].repeat_interleave(group, dim=0)  # [Hq, n, D]
            scores = torch.matmul(q[0][:, q_start:], keys.transpose(1, 2)) * runner.scaling  # [Hq, f, n]
            attn = torch.softmax(scores.masked_fill_(unseen, float("-inf")), dim=-1).sum(dim=(0, 1))  # [n]
            rank += attn * (kv[l, 1, :, :n] - cached_kv[l, 1, :, :n]).norm(dim=-1).sum(dim=0)
        hidden = runner.attend(l, hidden, q, kv, pos, n)
    return rank


# ---- metrics --------------------------------------------------------------------------------------------
def compare(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || other) and top-1 agreement over rows."""
    ref = F.log_softmax(ref_logits.float(), dim=-1)
    other = F.log_softmax(logits.float(), dim=-1)
    kl = (ref.exp() * (ref - other)).sum(dim=-1).clamp_min(0.0)
    top1 = (ref.argmax(-1) == other.argmax(-1)).float()
    return float(kl.mean()), float(top1.mean())


def run(as_json: bool = False, limit: int = 5, passages: int = 10, ratios: tuple[float, ...] = (0.05, 0.15, 0.30),
        random_ratio: float = 0.15, data: str | os.PathLike | None = None, answer_tokens: int = 8,
        max_new_tokens: int = 24, kv_dtype: str = "float16", model: str | None = None, start: int = 0,
        auto: bool = False, seed: int = 0, progress: bool = True, stride: int = 1,
        check_layers: tuple[int, ...] | None = None, oracle: bool = False) -> list[dict]:
    from kvfabric.blend import BlendConfig, Blender, LoadController
    from kvfabric.config import Config, CpuTierConfig
    from kvfabric.engines.model import DEFAULT_MODEL, load_model
    from kvfabric.engines.runtime import default_num_threads

    examples = json.loads(find_musique(data).read_text())[start:start + limit * stride:stride]
    blend_config = BlendConfig(check_layers=check_layers) if check_layers else BlendConfig()  # validates
    torch.set_num_threads(default_num_threads())
    name = model or DEFAULT_MODEL
    hf_model, tokenizer = load_model(name, dtype=torch.float32)
    console = Console(stderr=True)
    config = Config(chunk_size=1024, tiers=("cpu",), cpu=CpuTierConfig(capacity=2 * 2**30))
    controller = LoadController() if auto else None
    settings: list[tuple[str, str, float | None]] = [("full", "full", None), ("reuse", "reuse", 0.0)]
    settings += [(f"blend@{round(r * 100)}", "blend", r) for r in ratios]
    settings += [(f"random@{round(random_ratio * 100)}", "random", random_ratio)]
    if auto:
        settings += [("auto", "blend", None)]
    if oracle:
        settings += [("oracle@15", "blend", 0.15)]
    stop_ids = {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if i is not None}
    rows: list[dict] = []
    with Blender(hf_model, model_id=name, kv_dtype=kv_dtype, config=config, controller=controller,
                 blend=blend_config) as blender:
        if not blender.enabled:
            console.print(f"[red]blend gate failed (error {blender.gate_error:.3g}): every setting is a full prefill")
        # warm-up (kernels, allocator) outside the measurements
        blender.prefill([[1] * 64, [2] * 32], mode="full")
        for done, example in enumerate(examples):
            qi = start + done * stride
            segments, answers = build_segments(tokenizer, example, passages)
            n = sum(map(len, segments))
            q_start = n - len(segments[-1])
            t = time.perf_counter()
            for seg in segments[:-1]:
                blender.cache_passage(seg)
            cache_s = time.perf_counter() - t
            capacity = n + max(max_new_tokens, answer_tokens) + 1
            ref_logits: torch.Tensor | None = None
            ref_answer: list[int] = []
            reuse_kv: torch.Tensor | None = None
            for setting, mode, ratio in settings:
                ranking = None
                if setting.startswith("oracle") and reuse_kv is not None:
                    tokens = [t for seg in segments for t in seg]
                    ranking = oracle_ranking(blender.runner, tokens, q_start, reuse_kv, blend_config.check_layers[0])
                res = blender.prefill(segments, mode=mode, recompute_ratio=ratio if setting != "auto" else None,
                                      logits_from=q_start, capacity=capacity, seed=seed + qi, ranking=ranking)
                if setting == "reuse" and oracle:
                    reuse_kv = res.kv
                answer = blender.generate(res, max_new_tokens, stop_ids)
                if ref_logits is None:  # full comes first: its greedy answer is the teacher-forced continuation
                    ref_answer = [t for t in answer if t not in stop_ids][:answer_tokens]
                tf = blender.extend(res, ref_answer, start=n) if ref_answer else res.logits[:0]
                logits = torch.cat([res.logits, tf])
                if ref_logits is None:
                    ref_logits = logits
                kl, top1 = compare(ref_logits, logits)
                rows_q = res.logits.shape[0]
                kl_q = compare(ref_logits[:rows_q], res.logits)[0]
                kl_ans = compare(ref_logits[rows_q:], tf)[0] if tf.shape[0] else 0.0
                reused = max(res.reused_tokens, 1)
                fixed = n - res.reused_tokens
                frac = [(t - fixed) / reused for t in res.tokens_per_layer]
                text = tokenizer.decode([t for t in answer if t not in stop_ids], skip_special_tokens=True).strip()
                rows.append({"q": qi, "setting": setting, "mode": mode, "ratio": round(res.ratio, 4),
                             "passages": len(segments) - 2, "prompt_tokens": n, "reused_tokens": res.reused_tokens,
                             "ttft_s": round(res.ttft_s, 4), "load_s": round(res.load_s, 4),
                             "load_wait_s": round(res.load_wait_s, 4), "cache_s": round(cache_s, 3),
                             "recompute_frac": round(statistics.fmean(frac[1:]) if res.blended else 1.0, 4),
                             "kl": round(kl, 5), "kl_q": round(kl_q, 5), "kl_ans": round(kl_ans, 5),
                             "top1": round(top1, 4), "f1": round(f1_score(text, answers), 4),
                             "answer": text, "fallback": res.fallback})
            mine = {r["setting"]: r for r in rows if r["q"] == qi}
            if as_json:  # stream: a long run keeps what it measured so far
                for row in mine.values():
                    print(json.dumps(row), flush=True)
            if progress:  # on stderr: never mixed into the JSON lines
                console.print(f"q{qi} ({done + 1}/{len(examples)}) {n} tokens: " + ", ".join(
                    f"{s} {r['ttft_s']:.1f}s KL {r['kl']:.3f}" for s, r in mine.items()))
    summary = summarize(rows, [s for s, _, _ in settings])
    title = (f"bench blend: {len({r['q'] for r in rows})} MuSiQue questions x {passages} passages, "
             f"{name}, KV {kv_dtype}, check layers {list(blend_config.check_layers)} ({threads_note()})")
    emit(summary, as_json, title, COLUMNS)
    targets = targets_row(summary, passages)
    emit([targets], as_json, "targets", list(targets))
    return rows + summary + [targets]


def summarize(rows: list[dict], settings: list[str]) -> list[dict]:
    by_q: dict[int, dict[str, dict]] = collections.defaultdict(dict)
    for r in rows:
        by_q[r["q"]][r["setting"]] = r
    reuse_kl = statistics.fmean(r["kl"] for r in rows if r["setting"] == "reuse") if rows else 0.0
    reuse_ans = _mean([r for r in rows if r["setting"] == "reuse"], "kl_ans")
    out = []
    for s in settings:
        mine = [r for r in rows if r["setting"] == s]
        if not mine:
            continue
        kl = statistics.fmean(r["kl"] for r in mine)
        kl_ans = _mean(mine, "kl_ans")
        shares = [1 - by_q[r["q"]][s]["kl"] / by_q[r["q"]]["reuse"]["kl"] for r in mine
                  if by_q[r["q"]]["reuse"]["kl"] > 0]
        out.append({"summary": "blend", "setting": s, "questions": len(mine),
                    "ttft_s": round(statistics.median(r["ttft_s"] for r in mine), 3),
                    "speedup": round(statistics.median(by_q[r["q"]]["full"]["ttft_s"] / r["ttft_s"] for r in mine), 2),
                    "recompute_frac": round(statistics.fmean(r["recompute_frac"] for r in mine), 3),
                    "kl": round(kl, 4),
                    "gap_closed": round(1 - kl / reuse_kl, 3) if reuse_kl > 0 else None,
                    "gap_closed_q": round(statistics.fmean(shares), 3) if shares else None,
                    "kl_q": _mean(mine, "kl_q"), "kl_ans": kl_ans,
                    "gap_ans": round(1 - kl_ans / reuse_ans, 3) if kl_ans is not None and reuse_ans else None,
                    "top1": round(statistics.fmean(r["top1"] for r in mine), 3),
                    "f1": round(statistics.fmean(r["f1"] for r in mine), 3)})
    return out


def _mean(rows: list[dict], key: str) -> float | None:
    """Mean of ``key`` over rows, None when a row lacks it (JSON lines of an older run)."""
    values = [r.get(key) for r in rows]
    return round(statistics.fmean(values), 4) if values and None not in values else None


def targets_row(summary: list[dict], passages: int) -> dict:
    at15 = next((s for s in summary if s["setting"] == "blend@15"), None)
    if at15 is None:
        return {"summary": "targets", "met": None}
    gap, speed = at15["gap_closed"], at15["speedup"]
    return {"summary": "targets", "passages": passages, "gap_closed@15": gap, "gap_target": 0.8,
            "gap_met": gap is not None and gap >= 0.8, "speedup@15": speed, "speedup_target": 3.0,
            "speedup_met": speed >= 3.0}


def report(path: str | os.PathLike, as_json: bool = False) -> list[dict]:
    """Summarise the per-question JSON lines of a (possibly unfinished) ``run(as_json=True)`` saved to ``path``."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.startswith('{"q"')]
    complete = {q for q in {r["q"] for r in rows}
                if {"full", "reuse"} <= {r["setting"] for r in rows if r["q"] == q}}
    rows = [r for r in rows if r["q"] in complete]
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    summary = summarize(rows, settings)
    emit(summary, as_json, f"bench blend (from {path}): {len(complete)} questions", COLUMNS)
    passages = rows[0].get("passages", 10) if rows else 10  # runs before the field existed: the default 10
    targets = targets_row(summary, passages)
    emit([targets], as_json, "targets", list(targets))
    return summary + [targets]
