"""A layer-by-layer forward of Llama-family decoders over Hugging Face weights, able to run any subset of tokens.

Contract
--------
* :class:`LlamaRunner` wraps a loaded HF ``*ForCausalLM`` of the Llama family (Llama, Mistral and Qwen2 without
  sliding windows, Qwen3 with its q/k norms). It reuses the model's own modules (norms, projections, MLP, rotary
  embedding), so with every token computed it equals the HF forward (fp32: logits within 1e-4).
* KV lives in one fp32 workspace ``kv [L, 2, H_kv, T, D]`` (K after RoPE, as HF caches it). Token ``i`` of the
  prompt sits at position ``i`` and at slot ``i``: positions are slot indices.
* :meth:`LlamaRunner.tokens` describes a set of tokens (sorted positions, any subset) once: their RoPE, where their
  K/V go, and how they attend (:class:`Tokens`). A caller that runs the same set through several layers builds it
  once. :meth:`LlamaRunner.layer` runs one decoder layer for such a set: it writes their fresh K/V into their slots
  of layer ``l`` and lets them attend, causally by position, to slots ``[key_start, length)`` of that layer,
  whatever those slots hold (fresh or cached KV). Split in two (:meth:`qkv` then :meth:`attend`) so a caller can
  look at the fresh K/V before it overwrites the old.
* Attention: every slot in order runs the causal kernel; one token at the end (decode) attends to everything; any
  other set (scattered queries, a suffix over a cached prefix) runs a plan of :mod:`kvfabric.blend.sparse` (blocks
  of queries: an unmasked prefix and a masked window, merged by log-sum-exp).
* :meth:`forward` runs a token run through all layers (prefill of a prompt, a passage, a suffix, decode steps).
* :func:`rotate` applies RoPE by a position delta: K computed at positions ``p`` becomes K at ``p + delta``
  (RoPE is a rotation, R(p + d) = R(d) R(p)); exact up to fp error.
Everything here runs under ``torch.inference_mode`` by the callers; nothing is thread-safe on a shared workspace.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvfabric.blend import sparse

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


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


@dataclass(frozen=True, slots=True)
class Tokens:
    """A set of tokens as one layer runs them (built by :meth:`LlamaRunner.tokens`)."""
    positions: torch.Tensor  # [s] sorted, distinct; also their slots in the workspace
    slots: slice | torch.Tensor  # the same positions; a slice when contiguous (a copy instead of a scatter)
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [s, D]
    length: int  # they attend to key slots [key_start, length), causally by position
    key_start: int
    kind: str  # "causal" (every slot in order), "last" (one token at the end: sees everything), "planned"
    plan: sparse.Plan | None  # for "planned": the query blocks

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())


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

    def tokens(self, positions: torch.Tensor, length: int | None = None, key_start: int = 0) -> Tokens:
        """Describe the tokens at ``positions`` [s] (sorted, distinct) attending to slots [key_start, length)
        (default: up to the last position)."""
        positions = positions.view(-1).to(torch.int64)
        num, first, last = int(positions.numel()), int(positions[0]), int(positions[-1])
        length = last + 1 if length is None else int(length)
        if first < key_start or last >= length:
            raise ValueError(f"positions [{first}, {last}] outside the keys [{key_start}, {length})")
        slots: slice | torch.Tensor = slice(first, last + 1) if last - first + 1 == num else positions
        plan = None
        if first == key_start and num == length - key_start:
            kind = "causal"
        elif num == 1 and first == length - 1:
            kind = "last"
        else:
            kind = "planned"
            plan = sparse.plan(positions - key_start, self.num_heads // self.num_kv_heads, self.dtype)
        return Tokens(positions, slots, self.rope(positions), length, key_start, kind, plan)

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
    def write_kv(kv: torch.Tensor, l: int, slots: torch.Tensor | slice, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [1, Hkv, s, D] into layer l at ``slots`` (a slice or a LongTensor, e.g. ``Tokens.slots``)."""
        if isinstance(slots, slice):
            kv[l, 0, :, slots].copy_(k[0])
            kv[l, 1, :, slots].copy_(v[0])
        else:
            kv[l, 0].index_copy_(1, slots, k[0])
            kv[l, 1].index_copy_(1, slots, v[0])

    def attend(self, l: int, hidden: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, tokens: Tokens) -> torch.Tensor:
        """Attention of ``tokens`` (q [1, Hq, s, D]) over their keys in layer l, then the MLP. hidden [1, s, E] is
        the layer input of the same tokens; returns the layer output."""
        layer = self.layers[l]
        s = q.shape[2]
        keys = kv[l, 0, :, tokens.key_start:tokens.length].unsqueeze(0)
        values = kv[l, 1, :, tokens.key_start:tokens.length].unsqueeze(0)
        if tokens.plan is not None:
            out = sparse.attend(tokens.plan, q, keys, values, self.scaling)  # [1, s, Hq, D]
        else:  # every slot in order (causal: the fastest kernel), or one token at the end attending to everything
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=tokens.kind == "causal",
                                                 scale=self.scaling, enable_gqa=True).transpose(1, 2)
        hidden = hidden + layer.self_attn.o_proj(out.reshape(1, s, -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def layer(self, l: int, hidden: torch.Tensor, kv: torch.Tensor, tokens: Tokens) -> torch.Tensor:
        q, k, v = self.qkv(l, hidden, tokens.rope)
        self.write_kv(kv, l, tokens.slots, k, v)
        return self.attend(l, hidden, q, kv, tokens)

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
        tokens = self.tokens(positions, length, key_start)
        hidden = self.embed(ids)
        for l in range(self.num_layers):
            hidden = self.layer(l, hidden, kv, tokens)
        return hidden[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden [s, E] -> fp32 logits [s, V]."""
        return self.lm_head(self.norm(hidden)).float()

