"""CacheBlend: reuse the KV of cached passages anywhere in the prompt, recomputing only the tokens that deviate most.

Contract
--------
``Blender(model, ...)`` drives a Llama-family HF model (:class:`~kvfabric.blend.runner.LlamaRunner`) with passage KV
kept in a :class:`~kvfabric.blend.store.PassageStore` (a CacheEngine namespace ``"<model_id>/blend"``).

* ``cache_passage(tokens)``: compute the passage alone from position 0 and store it (no-op when cached).
* ``prefill(segments, mode=...)``: the prompt is the concatenation of ``segments`` (token lists); by default every
  segment but the last may be reused, the last (the question / suffix) is always computed. A reusable segment that is
  cached is loaded and its K re-rotated to its offset; any other token is computed. Modes:
    - ``"full"``: ordinary prefill of every token (the reference; also the fallback when the gate failed);
    - ``"reuse"``: every cached token taken as is (re-rotated), only the rest computed: no cross-attention fix;
    - ``"blend"``: layers before the first check layer run for every token; at each check layer the fresh K/V of
      the tokens still active are compared with the cached ones, the reused tokens are ranked by that deviation
      (by default weighted by the attention the computed tokens pay them: ``BlendConfig.score``) and
      only the top fraction stays active (gradual filtering: ``gradual`` x ratio at the first check layer, narrowing
      linearly to the final ratio at the last); later layers run only for the active tokens (plus every computed
      token) and write their K/V over the cached ones. ``recompute_frac`` (default ``BlendConfig.recompute_frac``,
      or the load controller's choice) is the compute: the share of the reused tokens recomputed per layer,
      averaged over all layers, a check layer counted with every token it scores; the final ratio follows from it.
  ``ranking`` replaces the blend score at every check layer (higher first), the hook of studies and controls: a score
  per prompt token (e.g. the oracle of ``kvfabric bench blend --oracle``, built from a full prefill), or a
  ``Ranker``, called at each check layer with the positions of the reused tokens still active (e.g. the bench's
  seeded random control, ``random@F``).
  Loads are pipelined: a loader thread fetches the passages' KV from the tiers layer group by layer group, in layer
  order, re-rotating each as it lands, and runs ahead of the compute thread, which waits only for the group of the
  layer it is about to run (layer i+1 loads while layer i computes; layers before the first check layer are
  recomputed for every token and not loaded at all). A passage that vanishes between the lookup and the load makes
  the prompt fall back to ``"full"`` (never a wrong answer); an error in the loader is raised to the caller.
  Returns a :class:`BlendResult`: the fp32 KV workspace (positions [0, length) filled; room to decode), the logits
  from ``logits_from`` to the last prompt position, and what was done (tokens per layer, timings).
* ``extend(result, tokens)`` runs more tokens after the prompt (teacher forcing, decoding); ``generate`` is greedy.
* ``prefill_tokens(tokens)``: the same from a flat token list, cached passages found by the rolling-hash matcher.
* Correctness gate: at construction (``self_test=True``), K of a probe text computed at position 0, stored in the KV
  dtype and re-rotated by several deltas is compared with K computed at the true positions. If the relative error
  exceeds ``gate_bound`` blending is disabled (a warning says so) and every prefill is a full prefill.
A Blender is not thread-safe (one prefill at a time).
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvfabric.blend.controller import LoadController
from kvfabric.blend.loader import Loader, LoadFailed
from kvfabric.blend.matcher import PassageMatcher
from kvfabric.blend.runner import LlamaRunner, rotate
from kvfabric.blend.store import PassageStore
from kvfabric.blend.values import MODES, BlendConfig, BlendResult, Mode, Ranker
from kvfabric.config import Config

log = logging.getLogger("kvfabric.blend")


class Blender:
    def __init__(self, model: Any, *, model_id: str = "model", store: PassageStore | None = None,
                 config: Config | None = None, kv_dtype: str = "float16", layers_per_group: int = 1,
                 blend: BlendConfig | None = None, controller: LoadController | None = None,
                 matcher_window: int = 16, decode_room: int = 64) -> None:
        self.runner = LlamaRunner(model)
        self.model_id = model_id
        self._owns_store = store is None  # close() closes only a store built here
        self.store = store or PassageStore.for_runner(self.runner, model_id, config=config, kv_dtype=kv_dtype,
                                                      layers_per_group=layers_per_group)
        if self.store.num_layers != self.runner.num_layers:
            raise ValueError("the passage store was made for another model")
        self.config = blend or BlendConfig()
        if self.config.check_layers[-1] >= self.runner.num_layers:
            raise ValueError(f"check layer {self.config.check_layers[-1]} >= {self.runner.num_layers} layers")
        self.controller = controller
        self.matcher = PassageMatcher(matcher_window)
        self.decode_room = decode_room
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfabric-blend-loader")
        self.enabled = True
        self.gate_error: float | None = None
        if self.config.self_test:
            self.self_test()

    # ---- correctness gate --------------------------------------------------------------------------------
    @torch.inference_mode()
    def self_test(self, num_tokens: int = 32, deltas: Sequence[int] | None = None) -> float:
        """Re-rotation check (see module doc). Sets ``enabled``; returns the worst relative K (or V) error."""
        runner = self.runner
        vocab = int(runner.embed_tokens.num_embeddings)
        ids = torch.from_numpy(np.random.default_rng(0).integers(min(100, vocab - 1), vocab, num_tokens))
        if deltas is None:
            far = max(1, min(4096, runner.max_positions - num_tokens))
            deltas = sorted({1, min(257, far), far})
        base = runner.workspace(num_tokens)
        runner.forward(ids, base)
        stored = base.to(self.store.layout.torch_dtype).to(base.dtype)  # what a load gives back
        worst = 0.0
        for d in deltas:
            true = runner.workspace(d + num_tokens)
            runner.forward(ids, true, start=d, key_start=d)
            k = stored[:, 0].clone()
            rotate(k, *runner.delta_rotation(d))
            k_true, v_true = true[:, 0, :, d:], true[:, 1, :, d:]
            err_k = float((k - k_true).norm() / k_true.norm().clamp_min(1e-30))
            err_v = float((stored[:, 1] - v_true).norm() / v_true.norm().clamp_min(1e-30))
            worst = max(worst, err_k, err_v)
        self.gate_error = worst
        self.enabled = bool(worst <= self.config.gate_bound)
        if self.enabled:
            log.info("kvfabric.blend: re-rotation self-test passed for %s (relative error %.2e <= %.2e)",
                     self.model_id, worst, self.config.gate_bound)
        else:
            log.warning("kvfabric.blend: re-rotation self-test FAILED for %s (relative error %.3g > bound %.3g): "
                        "blending disabled, every prompt falls back to a full prefill",
                        self.model_id, worst, self.config.gate_bound)
        return worst

    # ---- passages ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def cache_passage(self, tokens: Sequence[int]) -> bool:
        """Make sure the passage's KV (computed alone from position 0) is cached. True when it was computed now."""
        tokens = [int(t) for t in tokens]
        self.matcher.add(tokens)
        if self.store.contains(tokens):
            return False
        kv = self.runner.workspace(len(tokens))
        self.runner.forward(torch.tensor(tokens), kv)
        self.store.store(tokens, kv)
        return True

    # ---- prefill -----------------------------------------------------------------------------------------
    def prefill_tokens(self, tokens: Sequence[int], **kwargs: Any) -> BlendResult:
        """Prefill a flat token list: cached passages are found by the matcher (the tail is always computed)."""
        tokens = [int(t) for t in tokens]
        parts = self.matcher.split(tokens)
        segments = [tokens[s:e] for s, e, _ in parts]
        reuse = [matched for _, _, matched in parts]
        if reuse and reuse[-1]:  # the last token must be computed: it gives the next-token logits
            reuse[-1] = False
        return self.prefill(segments, reuse=reuse, **kwargs)

    @torch.inference_mode()
    def prefill(self, segments: Sequence[Sequence[int]], *, mode: Mode = "blend", reuse: Sequence[bool] | None = None,
                recompute_frac: float | None = None, logits_from: int | None = None, capacity: int | None = None,
                ranking: torch.Tensor | Ranker | None = None) -> BlendResult:
        started = time.perf_counter()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if ranking is not None and mode != "blend":
            raise ValueError(f"a ranking is only used by mode='blend', not {mode!r}")
        segments = [[int(t) for t in seg] for seg in segments]
        if not segments or not segments[-1]:
            raise ValueError("need one or more segments, the last one non-empty")
        reuse = [True] * (len(segments) - 1) + [False] if reuse is None else list(reuse)
        if len(reuse) != len(segments) or reuse[-1]:
            raise ValueError("reuse needs one flag per segment, and the last segment is always computed")
        tokens = [t for seg in segments for t in seg]
        n = len(tokens)
        if n > self.runner.max_positions:
            raise ValueError(f"prompt has {n} tokens, more than the model's context of {self.runner.max_positions}")
        logits_from = n - 1 if logits_from is None else logits_from
        capacity = max(capacity or 0, n + self.decode_room)
        kv = self.runner.workspace(capacity)

        spans: list[tuple[int, list[int]]] = []  # (offset, tokens) of the cached passages used
        if mode != "full" and self.enabled:
            offset = 0
            for seg, flag in zip(segments, reuse):
                if flag and seg and self.store.contains(seg):
                    spans.append((offset, seg))
                offset += len(seg)
        fixed = torch.ones(n, dtype=torch.bool)  # tokens always computed
        for off, seg in spans:
            fixed[off:off + len(seg)] = False
        if isinstance(ranking, torch.Tensor) and tuple(ranking.shape) != (n,):
            raise ValueError(f"ranking must have one score per prompt token ({n}), got {tuple(ranking.shape)}")
        if logits_from < 0 or logits_from >= n or not bool(fixed[logits_from:].all()):
            raise ValueError(f"logits_from={logits_from} must fall in the computed suffix of the prompt")
        reused = n - int(fixed.sum())
        fallback = "" if self.enabled or mode == "full" else "gate"
        if not spans or mode == "full":
            return self._full(tokens, kv, logits_from, started, mode, fallback or ("" if mode == "full" else "miss"))

        num_layers = self.runner.num_layers
        if mode == "reuse":
            ratio = 0.0
        elif recompute_frac is not None:
            ratio = self.config.ratio_for(float(recompute_frac), num_layers)
        elif self.controller is not None:  # the controller thinks per layer: it gives the final ratio
            per_layer = reused * self.store.layout.num_bytes(1) // self.store.group
            ratio = self.controller.choose(reused, per_layer, fixed_tokens=n - reused)
        else:
            ratio = self.config.ratio_for(self.config.recompute_frac, num_layers)
        checks = [] if mode == "reuse" else list(self.config.check_layers)
        first_loaded = checks[0] if checks else 0  # layers before it run for every token: no load needed
        groups = sorted({self.store.group_of(l) for l in range(first_loaded, self.runner.num_layers)})
        loader = Loader(self.store, self.runner, self._pool, kv, spans, groups)
        try:
            result = self._blend(tokens, kv, fixed, loader, checks, ratio, mode, logits_from, started, ranking)
        except LoadFailed:
            loader.finish()  # raises if the loader failed with an error rather than a miss
            log.warning("kvfabric.blend: a cached passage vanished during the load; full prefill instead")
            return self._full(tokens, kv, logits_from, started, mode, "load")
        except BaseException:
            with contextlib.suppress(Exception):
                loader.finish()  # never leave a load writing into a workspace
            raise
        loader.finish()
        result.load_s, result.load_bytes = loader.busy_s, loader.bytes
        if self.controller is not None:
            self.controller.observe_load(loader.bytes, loader.busy_s)
        return result

    def _full(self, tokens: list[int], kv: torch.Tensor, logits_from: int, started: float, mode: str,
              fallback: str) -> BlendResult:
        n = len(tokens)
        hidden = self.runner.forward(torch.tensor(tokens), kv)
        logits = self.runner.logits(hidden[logits_from:])
        return BlendResult(tokens, kv, n, logits, logits_from, mode, False, 0, 1.0,
                           [n] * self.runner.num_layers, time.perf_counter() - started, fallback=fallback)

    def _blend(self, tokens: list[int], kv: torch.Tensor, fixed: torch.Tensor, loader: Loader, checks: list[int],
               ratio: float, mode: str, logits_from: int, started: float,
               ranking: torch.Tensor | Ranker | None) -> BlendResult:
        runner, store = self.runner, self.store
        n = len(tokens)
        num_reused = n - int(fixed.sum())
        ids = torch.tensor(tokens)
        keep = dict(zip(checks, self.config.fractions(ratio))) if checks else {}
        first = checks[0] if checks else 0
        active = torch.arange(n) if first > 0 else torch.nonzero(fixed).view(-1)
        run = runner.tokens(active, n)  # rope, slots and attention plan of the active set, shared by its layers
        hidden = runner.embed(ids[active])
        per_layer: list[int] = []
        wait_s = compute_s = 0.0
        token_layers = 0
        for l in range(runner.num_layers):
            # Wait for this layer's group even below the first check layer: a group that spans it is being
            # written by the loader, and fresh K/V must never race with cached ones for the same slots.
            t = time.perf_counter()
            loader.wait(store.group_of(l))  # returns at once for a group that is not loaded
            wait_s += time.perf_counter() - t
            t = time.perf_counter()
            per_layer.append(run.num_tokens)
            if l in keep:
                q, k, v = runner.qkv(l, hidden, run.rope)
                local_reused = torch.nonzero(~fixed[active]).view(-1)
                pos_reused = active[local_reused]
                old = (kv[l, 0][:, pos_reused], kv[l, 1][:, pos_reused])  # gathered (copies) before the write
                runner.write_kv(kv, l, run.slots, k, v)  # fresh K/V for every active token
                if isinstance(ranking, torch.Tensor):  # the caller's own ranking (studies: an oracle)
                    scores = ranking[pos_reused]
                elif ranking is not None:  # the caller's ranker (the bench's random control)
                    scores = ranking(l, pos_reused)
                else:
                    local_fixed = torch.nonzero(fixed[active]).view(-1)
                    scores = self.score(l, pos_reused, (k[0][:, local_reused], v[0][:, local_reused]), old,
                                        q[0][:, local_fixed], active[local_fixed], kv, n)
                count = min(local_reused.numel(), int(round(keep[l] * num_reused)))
                chosen = local_reused[torch.topk(scores, count).indices] if count else local_reused[:0]
                selected = torch.sort(torch.cat([torch.nonzero(fixed[active]).view(-1), chosen])).values
                active, hidden, q = active[selected], hidden[:, selected], q[:, :, selected]
                run = runner.tokens(active, n)
                hidden = runner.attend(l, hidden, q, kv, run)
            else:
                hidden = runner.layer(l, hidden, kv, run)
            dt = time.perf_counter() - t
            if l > first:
                compute_s += dt
                token_layers += int(active.numel())
        if self.controller is not None:
            self.controller.observe_compute(token_layers, compute_s)
        rows = torch.nonzero(active >= logits_from).view(-1)
        logits = runner.logits(hidden[0, rows])
        return BlendResult(tokens, kv, n, logits, logits_from, mode, True, num_reused, ratio, per_layer,
                           time.perf_counter() - started, load_wait_s=wait_s)

    def score(self, layer: int, positions: torch.Tensor, fresh: tuple[torch.Tensor, torch.Tensor],
              cached: tuple[torch.Tensor, torch.Tensor], q_fixed: torch.Tensor, pos_fixed: torch.Tensor,
              kv: torch.Tensor, length: int) -> torch.Tensor:
        """Rank of the reused tokens at ``positions`` [r] at a check layer (higher: recompute first) from their
        fresh and cached K/V ([H, r, D] each). Also given: the queries of the computed tokens q_fixed [Hq, f, D] at
        pos_fixed, and the layer's KV [L, 2, H, cap, D] (fresh where computed). See BlendConfig.score."""
        if self.config.score == "attn_v":
            return self._attention_weighted_dv(layer, positions, fresh[1], cached[1], q_fixed, pos_fixed, kv, length)
        return self._deviation(fresh[0], fresh[1], cached[0], cached[1])

    def _attention_weighted_dv(self, layer: int, positions: torch.Tensor, v: torch.Tensor, v_old: torch.Tensor,
                               q_fixed: torch.Tensor, pos_fixed: torch.Tensor, kv: torch.Tensor,
                               length: int) -> torch.Tensor:
        """sum over query heads and computed tokens f of A[h, f, t] * |v_fresh[t] - v_cached[t]| (per KV head).
        Why: what reaches the output is attention times values; a token whose V moved but that the question does
        not look at changes nothing. A uses this layer's keys (fresh where computed), causal by position."""
        num_kv_heads, num_q_heads = kv.shape[2], q_fixed.shape[0]
        group = num_q_heads // num_kv_heads
        keys = kv[layer, 0, :, :length].repeat_interleave(group, dim=0)  # [Hq, n, D]
        logits = torch.matmul(q_fixed, keys.transpose(1, 2)) * self.runner.scaling  # [Hq, f, n]
        unseen = torch.arange(length).view(1, -1) > pos_fixed.view(-1, 1)  # [f, n]
        attn = torch.softmax(logits.masked_fill_(unseen, float("-inf")), dim=-1)[:, :, positions]  # [Hq, f, r]
        dv = (v - v_old).norm(dim=-1).repeat_interleave(group, dim=0)  # [Hq, r]
        return (attn * dv.unsqueeze(1)).sum(dim=(0, 1))

    def _deviation(self, k: torch.Tensor, v: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor:
        """Per-token KV deviation; k, v, k_old, v_old [H, r, D] -> [r]."""
        dk = (k - k_old).pow(2).sum(dim=(0, 2))
        dv = (v - v_old).pow(2).sum(dim=(0, 2))
        score = self.config.score
        if score == "k":
            return dk
        if score == "v":
            return dv
        if score == "kv_norm":
            return dk / k_old.pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-30) + \
                dv / v_old.pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-30)
        return dk + dv

    # ---- after the prompt --------------------------------------------------------------------------------
    @torch.inference_mode()
    def extend(self, result: BlendResult, tokens: Sequence[int], start: int | None = None) -> torch.Tensor:
        """Run ``tokens`` at positions ``start..`` (default: right after the prompt) over the result's KV; returns
        their logits [len, V]. Positions from ``start`` on are overwritten (restart at ``result.length`` to decode
        another continuation of the same prompt)."""
        start = result.length if start is None else start
        if not result.length <= start <= result.kv.shape[3] - len(tokens):
            raise ValueError(f"no room for {len(tokens)} tokens at {start} (capacity {result.kv.shape[3]})")
        hidden = self.runner.forward(torch.tensor([int(t) for t in tokens]), result.kv, start=start)
        return self.runner.logits(hidden)

    def generate(self, result: BlendResult, max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy continuation of the prompt (positions from ``result.length`` are overwritten)."""
        stop = set(stop_ids)
        out: list[int] = []
        room = result.kv.shape[3] - result.length
        token = result.next_token
        while len(out) < min(max_new_tokens, room):
            out.append(token)
            if token in stop or len(out) >= min(max_new_tokens, room):
                break
            token = int(torch.argmax(self.extend(result, [token], start=result.length + len(out) - 1)[-1]))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> Blender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

