"""Attention with its probabilities recorded: what the head study and the H2O baseline need to see.

Contract: `AttentionProbe(num_layers, page_size)` is a ``kv_attention`` hook (engines.runtime): passed to a forward
over a dense `BufferCache`, it computes every layer's attention explicitly (softmax(q k^T * scale) v, causal,
queries in chunks of CHUNK so a 6k-token prefill never holds a [T, T] matrix) from the cache's own K/V and returns
the same output sdpa would (up to float rounding). It records, per layer:
- `page_mass[layer]`: after a one-token (decode) forward, float32 [H, pages]: the attention probability each KV
  page of `page_size` tokens receives, summed over the query heads of its group;
- `page_bound[layer]` (with `record_bounds=True`): after a decode forward, float32 [H, pages]: Quest's bound of
  every page for this query (radar.page_bounds over the pages' min/max keys; the study ranks by it);
- `prompt_mass[layer]` (with `record_prompt=True`): float32 [H, T]: the attention each key received from every
  query of a multi-token (prefill) forward, summed over queries and group heads (H2O's accumulated score).
"""
from __future__ import annotations

from typing import Any

import torch

from kvfabric.engines.flexicache.radar import page_bounds, summarize

CHUNK = 256  # queries per block of the explicit prefill attention: [H, G, CHUNK, T] floats at a time


class AttentionProbe:
    def __init__(self, num_layers: int, page_size: int, record_prompt: bool = False,
                 record_bounds: bool = False) -> None:
        self.page_size = page_size
        self.record_prompt, self.record_bounds = record_prompt, record_bounds
        self.page_mass: list[torch.Tensor | None] = [None] * num_layers
        self.page_bound: list[torch.Tensor | None] = [None] * num_layers
        self.prompt_mass: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        layer = module.layer_idx
        # query [1, Hq, q, D]; key / value [1, H, T, D] with T = past + q (the dense cache's views)
        num_q, num_keys = query.shape[2], key.shape[2]
        heads, dim = key.shape[1], key.shape[3]
        group = query.shape[1] // heads
        q = query[0].reshape(heads, group, num_q, dim)  # [H, G, q, D]
        k_t = key[0].transpose(1, 2).unsqueeze(1)  # [H, 1, D, T]
        v = value[0].unsqueeze(1)  # [H, 1, T, D]
        out = torch.empty(num_q, heads * group, dim)
        key_pos = torch.arange(num_keys)
        mass = torch.zeros(heads, num_keys) if self.record_prompt and num_q > 1 else None
        for start in range(0, num_q, CHUNK):
            end = min(num_q, start + CHUNK)
            scores = torch.matmul(q[:, :, start:end], k_t) * scaling  # [H, G, c, T]
            q_pos = num_keys - num_q + torch.arange(start, end)  # absolute positions of these queries
            scores.masked_fill_(key_pos[None, :] > q_pos[:, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start:end] = torch.matmul(probs, v).reshape(heads * group, end - start, dim).transpose(0, 1)
            if mass is not None:
                mass += probs.sum(dim=(1, 2))
        if mass is not None:
            self.prompt_mass[layer] = mass
        if num_q == 1:
            self.page_mass[layer] = self._pages(probs[:, :, 0].sum(1))
            if self.record_bounds:
                self.page_bound[layer] = page_bounds(q[:, :, 0], summarize(key[0], num_keys, self.page_size))
        return out.unsqueeze(0)  # [1, q, Hq, D]

    def _pages(self, token_mass: torch.Tensor) -> torch.Tensor:
        """[H, T] -> [H, pages]: sum per page (the last page may be partial)."""
        heads, num_keys = token_mass.shape
        num_pages = -(-num_keys // self.page_size)
        padded = torch.zeros(heads, num_pages * self.page_size)
        padded[:, :num_keys] = token_mass
        return padded.view(heads, num_pages, self.page_size).sum(-1)

