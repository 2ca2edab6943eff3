"""Offline calibration of cachegen's per-model profile (`kvfabric profile cachegen`): runs the model.

Contract:
- `fisher_diagonal(model, contexts)` measures, with autograd, how sensitive the next-token distribution is to
  every KV channel: the mean squared gradient of log p(y) over the contexts, [L, 2, H, D], plus each context's KV.
- `calibrate(...)` reads calibration text of several genres (kvfabric.data.genres: MuSiQue passages,
  prose, dialogue-like mail, code; disjoint from the held-out text of `bench codec --text`), measures the
  Fisher diagonal per genre, has the codec build the profile from it (codec.cachegen.profile.build) and
  saves it, by default over the shipped table of the model's layout. Deterministic for a given seed.
The codec never imports this module: at run time it only loads the saved tables.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from kvfabric.codec.cachegen import profile as P
from kvfabric.data import genres as G
from kvfabric.engines.model import DEFAULT_MODEL
from kvfabric.engines.runtime import layout_for, load_for_inference, prefill
from kvfabric.kv.layout import KVLayout

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


def reach(layout: KVLayout, num_tokens: int) -> np.ndarray:
    """First token each layer's next tokens can read after a context of num_tokens (>= 1: the sink is left
    out): 1 for full attention, the window's start for a sliding-window layer (older rows get no gradient and
    must not dilute the mean)."""
    first = np.ones(layout.num_layers, dtype=np.int64)
    for group in layout.window_groups:
        first[list(group.layers)] = max(1, group.window_start(num_tokens))
    return first


def fisher_diagonal(model: Any, contexts: list[list[int]], num_next: int = 64, draws: int = 2, seed: int = 0
                    ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Mean over contexts of the squared gradient of log p(y) (y drawn from the model itself, summed over the
    `num_next` positions after each context) with respect to every KV entry: [L, 2, H, T, D] per context,
    reduced here to [L, 2, H, D] (mean over the tokens each layer reads, the sink token 0 excluded). Also
    returns each context's KV (fp16-rounded, float32 numpy [L, 2, H, T, D]) for the rest of the calibration."""
    gen = torch.Generator().manual_seed(seed)
    layout = layout_for(model.config, "float16")
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
        first = reach(layout, t)
        for r in range(draws):
            y = torch.multinomial(logp.detach().exp(), 1, generator=gen)[:, 0]
            (grad,) = torch.autograd.grad(logp.gather(1, y[:, None]).sum(), kv, retain_graph=r + 1 < draws)
            g2 = torch.stack([grad[i, :, :, int(first[i]):].pow(2).mean(2) for i in range(len(first))])  # [L, 2, H, D]
            total = g2 if total is None else total + g2
    return (total / (len(contexts) * draws)).double().numpy(), kvs


def calibrate(texts: Path | None = None, *, model_name: str = DEFAULT_MODEL, per_genre: int = 12,
              genres: tuple[str, ...] = G.CALIBRATION_GENRES, ctx_tokens: int = 1536, shrink: float = 1.0,
              out: Path | None = None) -> tuple[Path, P.Profile]:
    """Measure and save a profile; returns where it was written. Contexts: `per_genre` runs of `ctx_tokens`
    (+ 64 next tokens) of each calibration genre (kvfabric.data.genres; retrieval = MuSiQue questions 0.. from
    `texts`, left out without it); the Fisher diagonal is the mean of the genres' means (each genre weighs the
    same). Without `out` it replaces the shipped table of the model's layout; with `out` the Fisher diagonal is
    kept beside it (`.fisher.npy`, for study)."""
    model, tok = load_for_inference(model_name)
    num_next = 64
    by_genre = G.calibration(lambda s: tok(s)["input_ids"], per_genre, ctx_tokens + num_next, texts, genres)
    if not by_genre:
        raise ValueError(f"no calibration text for genres {genres}")
    layout = layout_for(model.config, "float16")
    fishers, kvs = [], []
    for ctxs in by_genre.values():
        f, k = fisher_diagonal(model, ctxs, num_next=num_next)
        fishers.append(f)
        kvs += k
    fisher = np.mean(fishers, axis=0)
    chunks = [kv[:, :, :, s:s + CHUNK] for kv in kvs for s in range(0, kv.shape[3] - CHUNK + 1, CHUNK)]
    meta = {"model": model_name, "genres": {g: len(c) for g, c in by_genre.items()},
            "texts": {g: G.describe(g) for g in by_genre}, "ctx_tokens": ctx_tokens, "shrink": shrink,
            "alpha1": ALPHA1}
    prof = P.build(layout, fisher, chunks, alpha1=ALPHA1, shrink=shrink, meta=meta)
    path = out or P.TABLES / f"profile_{layout.fingerprint.hex()}.npz"
    P.save(prof, path)
    if out is not None:
        np.save(path.with_suffix(".fisher.npy"), fisher)
    return path, prof
