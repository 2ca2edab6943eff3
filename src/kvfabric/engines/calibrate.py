"""Offline calibration of cachegen's per-model profile (`kvfabric profile cachegen`): runs the model.

Contract:
- `fisher_diagonal(model, contexts)` measures, with autograd, how sensitive the next-token distribution is to
  every KV channel: the mean squared gradient of log p(y) over the contexts, [L, 2, H, D], plus each context's KV.
- `calibrate(...)` reads calibration text (MuSiQue-style JSON questions with passages, plus plain-text files),
  measures the Fisher diagonal, has the codec build the profile from it (codec.cachegen.profile.build) and
  saves it, by default over the shipped table of the model's layout. Deterministic for a given seed.
The codec never imports this module: at run time it only loads the saved tables.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from kvfabric.codec.cachegen import profile as P
from kvfabric.engines.model import DEFAULT_MODEL
from kvfabric.engines.runtime import layout_for, load_for_inference, prefill

ALPHA1 = 2.5e-5  # level-1 step scale: step = sqrt(ALPHA1^2 / Fisher), see profile.build
CHUNK = 256


def _growing_cache(kv: torch.Tensor) -> DynamicCache:
    """transformers' DynamicCache seeded with kv [L, 2, H, T, D], which requires grad: new tokens are
    concatenated (autograd follows them), never written in place (in-place writes into views of one buffer, as
    BufferCache does, would invalidate the saved ones)."""
    cache = DynamicCache()
    for i in range(kv.shape[0]):
        cache.update(kv[i, 0][None], kv[i, 1][None], i)
    return cache


def fisher_diagonal(model: Any, contexts: list[list[int]], num_next: int = 64, draws: int = 2, seed: int = 0
                    ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Mean over contexts of the squared gradient of log p(y) (y drawn from the model itself, summed over the
    `num_next` positions after each context) with respect to every KV entry: [L, 2, H, T, D] per context,
    reduced here to [L, 2, H, D] (mean over tokens 1.., the sink token 0 excluded). Also returns each context's
    KV (fp16-rounded, float32 numpy [L, 2, H, T, D]) for the rest of the calibration."""
    gen = torch.Generator().manual_seed(seed)
    total = None
    kvs = []
    for ids in contexts:
        ctx, nxt = ids[:-num_next], ids[-num_next:]
        buf = prefill(model, ctx, len(ctx))  # [L, 2, H, T, D] fp32
        kvs.append(buf.half().float().numpy())
        kv = buf.clone().requires_grad_(True)
        t = kv.shape[3]
        out = model(input_ids=torch.tensor([nxt]), position_ids=torch.arange(t, t + len(nxt))[None],
                    cache=_growing_cache(kv), use_cache=True)
        logp = torch.log_softmax(out.logits[0].float(), -1)
        for r in range(draws):
            y = torch.multinomial(logp.detach().exp(), 1, generator=gen)[:, 0]
            (grad,) = torch.autograd.grad(logp.gather(1, y[:, None]).sum(), kv, retain_graph=r + 1 < draws)
            g2 = grad[:, :, :, 1:].pow(2).mean(3)  # [L, 2, H, D], sink excluded
            total = g2 if total is None else total + g2
    return (total / (len(contexts) * draws)).double().numpy(), kvs


def calibration_contexts(tok: Any, texts: Path, first: int, count: int, num_tokens: int,
                         extra_texts: tuple[Path, ...] = ()) -> list[list[int]]:
    """`count` token runs of `num_tokens`: run i joins the passages of questions i, i+1, ... (from `first`);
    then every whole run of each plain-text file."""
    data = json.loads(texts.read_text())
    contexts = []
    for i in range(first, first + count):
        ids: list[int] = []
        j = i
        while len(ids) < num_tokens:
            ids += tok("\n\n".join(c["title"] + "\n" + c["text"] for c in data[j % len(data)]["ctxs"]))["input_ids"]
            j += 1
        contexts.append(ids[:num_tokens])
    for path in extra_texts:
        ids = tok(path.read_text())["input_ids"]
        contexts += [ids[i:i + num_tokens] for i in range(0, len(ids) - num_tokens + 1, num_tokens)]
    return contexts


def calibrate(texts: Path, *, model_name: str = DEFAULT_MODEL, first: int = 0, count: int = 24,
              ctx_tokens: int = 1536, extra_texts: tuple[Path, ...] = (), shrink: float = 1.0,
              out: Path | None = None) -> tuple[Path, P.Profile]:
    """Measure and save a profile; returns where it was written. Without `out` it replaces the shipped table
    of the model's layout; with `out` the Fisher diagonal is kept beside it (`.fisher.npy`, for study)."""
    model, tok = load_for_inference(model_name)
    num_next = 64
    contexts = calibration_contexts(tok, texts, first, count, ctx_tokens + num_next, extra_texts)
    layout = layout_for(model.config, "float16")
    fisher, kvs = fisher_diagonal(model, contexts, num_next=num_next)
    chunks = [kv[:, :, :, s:s + CHUNK] for kv in kvs for s in range(0, kv.shape[3] - CHUNK + 1, CHUNK)]
    meta = {"model": model_name, "texts": texts.name, "first": first, "count": len(contexts),
            "ctx_tokens": ctx_tokens, "shrink": shrink, "alpha1": ALPHA1}
    prof = P.build(layout, fisher, chunks, alpha1=ALPHA1, shrink=shrink, meta=meta)
    path = out or P.TABLES / f"profile_{layout.fingerprint.hex()}.npz"
    P.save(prof, path)
    if out is not None:
        np.save(path.with_suffix(".fisher.npy"), fisher)
    return path, prof
