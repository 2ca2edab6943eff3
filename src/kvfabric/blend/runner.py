"""A layer-by-layer forward of Llama-family decoders over Hugging Face weights, able to run any subset of tokens.

Contract
--------
* :class:`LlamaRunner` wraps a loaded HF ``*ForCausalLM`` of the Llama family (Llama, Mistral and Qwen2 without
  sliding windows, Qwen3 with its q/k norms). It reuses the model's own modules (norms, projections, MLP, rotary
  embedding), so with every token computed it equals the HF forward (fp32: logits within 1e-4).
* KV lives in one fp32 workspace ``kv [L, 2, H_kv, T, D]`` (K after RoPE, as HF caches it). Token ``i`` of the
  prompt sits at position ``i`` and at slot ``i``: positions are slot indices.
* :meth:`LlamaRunner.layer` runs one decoder layer for a chosen subset of tokens ``positions`` (sorted, any subset):
  it writes their fresh K/V into slots ``positions`` of layer ``l`` and lets them attend, causally, to slots
  ``[0, length)`` of that layer, whatever those slots hold (fresh or cached KV). Split in two
  (:meth:`qkv` then :meth:`attend`) so a caller can look at the fresh K/V before it overwrites the old.
* :meth:`forward` runs a token run through all layers (prefill of a prompt, a passage, a suffix, decode steps).
* :func:`rotate` applies RoPE by a position delta: K computed at positions ``p`` becomes K at ``p + delta``
  (RoPE is a rotation, R(p + d) = R(d) R(p)); exact up to fp error.
Everything here runs under ``torch.inference_mode`` by the callers; nothing is thread-safe on a shared workspace.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
SPARSE_BLOCK = 64  # queries per block of scattered-query attention (fastest of 32-256 at 1k of 6k tokens)
# torch's CPU flash-attention kernel; unlike scaled_dot_product_attention it also returns the log-sum-exp of
# each query's scores, which lets two partial attentions merge exactly
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class UnsupportedModel(ValueError):
    """The model is not a Llama-family decoder this runner can drive."""


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., s, D] rotated by cos/sin [s, D] (or [D]); HF's convention (rotate_half)."""
    return x * cos + rotate_half(x) * sin


def rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Re-rotate K in place by the rotation whose cos/sin ([D] or [s, D]) are given; returns k."""
    k.copy_(apply_rope(k, cos, sin))
    return k


class LlamaRunner:
    def __init__(self, model: Any) -> None:
        cfg = model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"blend supports model types {sorted(SUPPORTED_MODEL_TYPES)}, "
                                   f"not {getattr(cfg, 'model_type', None)!r}")
        base = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if base is None or not all(hasattr(base, name) for name in needed) or not hasattr(model, "lm_head"):
            raise UnsupportedModel(f"{type(model).__name__}: expected model.model.{{{','.join(needed)}}} and lm_head")
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or (
                cfg.model_type in ("mistral", "qwen2") and getattr(cfg, "sliding_window", None)
                and getattr(cfg, "use_sliding_window", True)):
            raise UnsupportedModel("sliding-window attention is not supported by blend")
        self.model = model
        self.config = cfg
        self.embed_tokens = base.embed_tokens
        self.layers = list(base.layers)
        self.norm = base.norm
        self.rotary_emb = base.rotary_emb
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        self.num_layers = len(self.layers)
        self.head_dim = int(attn.head_dim)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.scaling = float(attn.scaling)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        self.rope_scale = float(getattr(self.rotary_emb, "attention_scaling", 1.0) or 1.0)
        self.dtype = next(model.parameters()).dtype
        self._probe = torch.empty(0, dtype=self.dtype)

    # ---- buffers and rope --------------------------------------------------------------------------------
    def workspace(self, capacity: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.empty((self.num_layers, 2, self.num_kv_heads, capacity, self.head_dim),
                           dtype=dtype or self.dtype)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [s, D] for positions [s], exactly as the model computes them."""
        cos, sin = self.rotary_emb(self._probe, positions.view(1, -1))
        return cos[0], sin[0]

    def delta_rotation(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [D] of the rotation by ``delta`` positions (attention scaling of the rope undone)."""
        cos, sin = self.rope(torch.tensor([delta]))
        return cos[0] / self.rope_scale, sin[0] / self.rope_scale

    # ---- one layer ---------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [s] -> hidden [1, s, E]."""
        return self.embed_tokens(ids.view(1, -1))

    def qkv(self, l: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [1, s, E] -> q [1, Hq, s, D], k and v [1, Hkv, s, D] (q and k rotated)."""
        attn = self.layers[l].self_attn
        h = self.layers[l].input_layernorm(hidden)
        s = h.shape[1]
        q = attn.q_proj(h).view(1, s, -1, self.head_dim)
        k = attn.k_proj(h).view(1, s, -1, self.head_dim)
        v = attn.v_proj(h).view(1, s, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rope
        return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v

    @staticmethod
    def write_kv(kv: torch.Tensor, l: int, positions: torch.Tensor | slice, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [1, Hkv, s, D] into layer l at slots ``positions`` (a slice or a LongTensor)."""
        if isinstance(positions, slice):
            kv[l, 0, :, positions].copy_(k[0])
            kv[l, 1, :, positions].copy_(v[0])
        else:
            kv[l, 0].index_copy_(1, positions, k[0])
            kv[l, 1].index_copy_(1, positions, v[0])

    def attend(self, l: int, hidden: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
               length: int, key_start: int = 0) -> torch.Tensor:
        """Attention of the tokens ``positions`` (q [1, Hq, s, D]) over slots [key_start, length) of layer l, causal
        by position, then the MLP. hidden [1, s, E] is the layer input of the same tokens; returns the layer output."""
        layer = self.layers[l]
        attn = layer.self_attn
        s = q.shape[2]
        keys = kv[l, 0, :, key_start:length].unsqueeze(0)
        values = kv[l, 1, :, key_start:length].unsqueeze(0)
        first, num_keys = int(positions[0]), length - key_start
        if first == key_start and s == num_keys:  # every slot, in order: plain causal (the fastest kernel)
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=self.scaling, enable_gqa=True)
        elif s == 1 and first == length - 1:  # one token attending to everything (decode)
            out = F.scaled_dot_product_attention(q, keys, values, scale=self.scaling, enable_gqa=True)
        else:
            out = self._attend_sparse(q, keys, values, positions, key_start)
        out = attn.o_proj(out.transpose(1, 2).reshape(1, s, -1))
        hidden = hidden + out
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _attend_sparse(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                       key_start: int) -> torch.Tensor:
        """Queries at scattered (increasing) positions, causal by position; q [1, Hq, s, D], keys/values
        [1, Hkv, n, D] -> [1, Hq, s, D]. Why two kernel calls per block of queries: a masked kernel cannot skip
        the keys a query never sees and pays for the mask on every score. A block of queries at positions
        [p0, p1] sees every key before p0: that part runs unmasked (the fast kernel), only the window [p0, p1]
        is masked, and the two partial softmaxes are merged by their log-sum-exp. The query heads that share a
        KV head are stacked, so each key is read once per KV head (GQA)."""
        _, num_q_heads, s, dim = q.shape
        num_kv_heads = keys.shape[1]
        group = num_q_heads // num_kv_heads
        outs = []
        for a in range(0, s, SPARSE_BLOCK):
            b = min(s, a + SPARSE_BLOCK)
            m = b - a
            p0, p1 = int(positions[a]) - key_start, int(positions[b - 1]) + 1 - key_start  # key slots
            qb = q[:, :, a:b].reshape(1, num_kv_heads, group * m, dim)  # [1, Hkv, group * m, D]
            seen = torch.arange(p0, p1).view(1, -1) <= (positions[a:b] - key_start).view(-1, 1)  # [m, p1 - p0]
            mask = torch.zeros(m, p1 - p0, dtype=q.dtype).masked_fill_(~seen, float("-inf")).repeat(group, 1)
            out, lse = _flash(qb, keys[:, :, p0:p1], values[:, :, p0:p1], attn_mask=mask.view(1, 1, group * m, -1),
                              scale=self.scaling)
            if p0 > 0:
                out0, lse0 = _flash(qb, keys[:, :, :p0], values[:, :, :p0], scale=self.scaling)
                top = torch.maximum(lse, lse0)
                w, w0 = (lse - top).exp().unsqueeze(-1), (lse0 - top).exp().unsqueeze(-1)
                out = ((out * w + out0 * w0) / (w + w0)).to(q.dtype)
            outs.append(out.reshape(1, num_q_heads, m, dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def layer(self, l: int, hidden: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, length: int,
              rope: tuple[torch.Tensor, torch.Tensor], key_start: int = 0) -> torch.Tensor:
        q, k, v = self.qkv(l, hidden, rope)
        self.write_kv(kv, l, _as_slice(positions), k, v)
        return self.attend(l, hidden, q, kv, positions, length, key_start)

    # ---- whole model -------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, kv: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None,
                length: int | None = None, key_start: int = 0) -> torch.Tensor:
        """Run tokens ``ids`` [s] at ``positions`` (default ``start .. start+s-1``) through every layer, writing
        their KV; they attend to slots [key_start, length) (default: up to the last position). Returns final
        hidden [s, E] (before the final norm; see :meth:`logits`). ``key_start > 0`` runs a text as if it began
        at position key_start (what a passage computed at its true position alone would give)."""
        ids = ids.view(-1)
        if positions is None:
            positions = torch.arange(start, start + ids.numel())
        length = int(positions[-1]) + 1 if length is None else length
        if length > kv.shape[3]:
            raise ValueError(f"workspace holds {kv.shape[3]} tokens, need {length}")
        if length > self.max_positions:
            raise ValueError(f"{length} tokens exceed the model's context of {self.max_positions}")
        rope = self.rope(positions)
        hidden = self.embed(ids)
        for l in range(self.num_layers):
            hidden = self.layer(l, hidden, kv, positions, length, rope, key_start)
        return hidden[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden [s, E] -> fp32 logits [s, V]."""
        return self.lm_head(self.norm(hidden)).float()


def _as_slice(positions: torch.Tensor) -> slice | torch.Tensor:
    """A contiguous run of positions as a slice (a plain copy instead of a scatter)."""
    first, last = int(positions[0]), int(positions[-1])
    if last - first + 1 == positions.numel():
        return slice(first, last + 1)
    return positions
