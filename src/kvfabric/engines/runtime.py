"""Model runtime helpers shared by the reference engine, the benchmarks and the offline profiler.

Contract:
- `BufferCache(buf, length)`: a transformers ``Cache`` whose layers are views of one preallocated buffer
  ``buf [L, 2, H, T, D]`` with a fill pointer: a forward writes K/V in place (no cat, no reallocation) and a
  full buffer raises RuntimeError.
- `use_fast_attention(model)`: switches an sdpa model to the same attention math with native GQA under a mask.
  A forward called with ``kv_attention=obj`` hands every layer's attention to ``obj.attend(module, query, key,
  value, scaling) -> [B, q, Hq, D]`` instead (paged decode KV, attention probes), with the cache's own K/V.
- `layout_for(model_config, kv_dtype)`: the KVLayout of a HF decoder config.
- `default_num_threads()`: $OMP_NUM_THREADS, else every core this process may run on.
- `load_for_inference(name)`: an fp32 eval model and its tokenizer, threads set, fast attention on.
- `prefill(model, ids, capacity)` -> fp32 KV buffer; `next_logprobs(model, kv, ids, start)`: teacher-forced
  log-probs on top of a KV prefix.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from kvfabric.engines.model import DEFAULT_MODEL, ensure_model, load_model
from kvfabric.kv.layout import KVLayout


class BufferLayer(CacheLayerMixin):
    """One layer's K/V: views ``[1, H, T, D]`` of the shared buffer plus a fill pointer."""

    is_croppable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int = 0) -> None:
        super().__init__()
        self.keys, self.values = keys, values  # [1, H, T, D] views, written in place
        self.length = length  # tokens held: positions [0, length)
        self.device = keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the storage exists from the start."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states / value_states: [1, H, q, D] for positions [length, length + q)
        end = self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            raise RuntimeError(f"KV buffer full: {end} tokens > capacity {self.keys.shape[-2]}")
        self.keys[:, :, self.length : end].copy_(key_states)
        self.values[:, :, self.length : end].copy_(value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0  # (kv_length, kv_offset), like a dynamic layer

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return int(self.keys.shape[-2])

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - abs(tokens_to_remove))


class BufferCache(Cache):
    """A transformers ``Cache`` whose layers are views of ``buf [L, 2, H, T, D]``."""

    def __init__(self, buf: torch.Tensor, length: int = 0) -> None:
        layers = [BufferLayer(buf[i, 0].unsqueeze(0), buf[i, 1].unsqueeze(0), length) for i in range(buf.shape[0])]
        super().__init__(layers=layers)


FAST_ATTENTION = "kvfabric_sdpa_gqa"  # name registered in transformers' attention registries


def sdpa_gqa_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Stock sdpa, but with native GQA also under a mask (CPU kernels support it): stock sdpa copies
    the whole past per layer (repeat_kv) for every masked suffix prefill. q [B,Hq,q,D], k/v [B,Hkv,kv,D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    hook = kwargs.pop("kv_attention", None)
    if hook is not None:  # the KV lives elsewhere (engines.flexicache) or the caller records attention
        return hook.attend(module, query, key, value, scaling), None
    q_len = query.shape[2]
    if (query.device.type != "cpu" or q_len == 1 or key.shape[1] == query.shape[1]
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    causal = attention_mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if causal and key.shape[2] > q_len:  # same slicing as stock sdpa (upper-left causal alignment)
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=bool(causal), enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None  # [B, q, Hq, D]


def use_fast_attention(model: Any) -> bool:
    """Switch an sdpa model to :func:`sdpa_gqa_attention` (same math). Returns whether it did."""
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", FAST_ATTENTION):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(FAST_ATTENTION, sdpa_gqa_attention)  # idempotent
    AttentionMaskInterface.register(FAST_ATTENTION, sdpa_mask)
    model.set_attn_implementation(FAST_ATTENTION)
    return True


def layout_for(model_config: Any, kv_dtype: str = "float16") -> KVLayout:
    """KVLayout of a HF decoder config: its layer groups from `config.layer_types` (transformers folds Qwen2's
    `use_sliding_window` / `max_window_layers` into it) and `config.sliding_window`. Raises ValueError for
    attention kinds kvfabric cannot store (e.g. linear attention, chunked attention, MLA in transformers' cache)."""
    model_config = getattr(model_config, "text_config", None) or model_config  # multimodal wrappers (Gemma 3 4B+)
    if getattr(model_config, "kv_lora_rank", None):  # transformers caches MLA's K and V decompressed, of two sizes
        raise ValueError("multi-head latent attention (kv_lora_rank): kvfabric stores MLA latents as vLLM's MLA "
                         "backends cache them (the vLLM connector), not transformers' decompressed K and V")
    heads = int(getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads)
    head_dim = int(getattr(model_config, "head_dim", None)
                   or model_config.hidden_size // model_config.num_attention_heads)
    num_layers = int(model_config.num_hidden_layers)
    layer_types = list(getattr(model_config, "layer_types", None) or ["full_attention"] * num_layers)
    if len(layer_types) != num_layers:
        raise ValueError(f"config.layer_types names {len(layer_types)} layers, the model has {num_layers}")
    window = getattr(model_config, "sliding_window", None)
    return KVLayout.from_layer_types(layer_types, heads, head_dim, int(window) if window else None, kv_dtype)


def default_num_threads() -> int:
    """$OMP_NUM_THREADS if set, else every core this process may run on."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0)) or os.cpu_count() or 1


def load_for_inference(name_or_path: str = DEFAULT_MODEL, num_threads: int | None = None) -> tuple[Any, Any]:
    """(model, tokenizer): fp32, eval mode, fast attention, torch threads set (default: every core)."""
    torch.set_num_threads(num_threads or default_num_threads())
    model, tok = load_model(str(ensure_model(name_or_path)), dtype=torch.float32)
    model.eval()
    use_fast_attention(model)
    return model, tok


@torch.inference_mode()
def prefill(model: Any, ids: list[int], capacity: int) -> torch.Tensor:
    """fp32 KV buffer [L, 2, H, capacity, D] holding the KV of `ids` in [0, len(ids))."""
    buf = torch.zeros(layout_for(model.config).shape(capacity))
    model(input_ids=torch.tensor([ids]), cache=BufferCache(buf, 0), use_cache=True, logits_to_keep=1)
    return buf


@torch.inference_mode()
def next_logprobs(model: Any, kv: torch.Tensor, ids: list[int], start: int) -> torch.Tensor:
    """Teacher-forced log-probs [len(ids) - start, vocab] of ids[start:] on top of kv[..., :start, :]."""
    buf = torch.zeros(kv.shape[:3] + (len(ids), kv.shape[4]))
    buf[:, :, :, :start] = kv[:, :, :, :start]
    out = model(input_ids=torch.tensor([ids[start:]]), position_ids=torch.arange(start, len(ids))[None],
                cache=BufferCache(buf, start), use_cache=True)
    return torch.log_softmax(out.logits[0].float(), -1)
