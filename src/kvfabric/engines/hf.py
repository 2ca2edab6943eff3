"""Reference engine: a small runner over a Hugging Face causal LM that uses kvfabric's cache.

Contract
--------
``HFEngine.generate(prompt)``:
  1. ``cache.lookup`` finds the longest cached prefix (chunk-aligned);
  2. ``cache.retrieve(..., out=buf)`` copies it straight into ONE preallocated fp32 buffer
     ``buf [L, 2, H, T, D]`` (T >= prompt + new tokens), reused across calls;
  3. the model's cache (:class:`BufferCache`) is a set of views of ``buf`` with a fill
     pointer, so the suffix prefill and every decode step write K/V in place: no cat,
     no reallocation. At least the last prompt token is always recomputed;
  4. newly computed whole chunks are stored (``cache.store``), then decoding runs
     (greedy, or sampling with an explicit seed). With a KV budget (``generate(kv_budget=0.3)`` or the config's
     ``flexicache.kv_budget``) decoding runs on paged KV (engines.flexicache): the prompt's KV is paged per
     (layer, KV head), only the budget's share stays in the fast pool, and ``result.decode_memory`` reports it.
The cache is in-process (``CacheEngine``) or, with ``mode: server`` in the config, the host's ``kvfabric server``
(``RemoteCache``: same calls; a server that is down is a miss, never an error).
Compute is always fp32; the cache stores KV in ``kv_dtype`` (default float16). With
float32 storage a hit gives the same logits as a full prefill (|diff| < 1e-4).
Sliding-window layers (Gemma 3; the layout's window groups) live full-length in the same buffer: the model's
mask applies the window by absolute position, so every window-layer row a prefill computes is there to store,
and a hit restores exactly the rows a continuation reads (``KVLayout.window_start``); tested on Gemma-3-270m
and Qwen2.5-Coder-0.5B in tests/test_hf_models.py.
An ``HFEngine`` is not thread-safe (it owns one reusable buffer).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvfabric import CacheEngine, Config
from kvfabric.cache.builder import build_engine
from kvfabric.cache.remote import RemoteCache
from kvfabric.engines.flexicache import DecodeMemoryStats, paged_kv
from kvfabric.engines.gguf import MARKER, ModelError
from kvfabric.engines.model import DEFAULT_MODEL, load_model
from kvfabric.engines.runtime import BufferCache, default_num_threads, layout_for, use_fast_attention

PREFILL_PIECE = 512  # tokens per forward when the caller wants prefill progress

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids (prompt excluded)
    prompt_tokens: int
    hit_tokens: int  # prompt tokens whose KV came from the cache (chunk-aligned)
    stored_chunks: int
    ttft_s: float  # start of generate() to the first generated token
    retrieve_s: float  # tokenize + lookup + retrieve into the buffer
    prefill_s: float  # forward over the uncached suffix
    store_s: float
    decode_s: float
    logits: torch.Tensor  # [vocab] fp32 next-token logits after the prompt
    decode_memory: DecodeMemoryStats | None = None  # paged decode (kv_budget > 0): resident KV, moves, time


def _default_model_id(name_or_path: str | Path) -> str:
    """The builtin name of a converted folder, else the folder name (pass model_id to disambiguate)."""
    marker = Path(str(name_or_path)).expanduser() / MARKER
    if marker.is_file():
        return str(json.loads(marker.read_text()).get("name") or Path(str(name_or_path)).name)
    return Path(str(name_or_path)).name


class HFEngine:
    """Runs a HF causal LM with prefix KV served by a :class:`kvfabric.CacheEngine`."""

    def __init__(
        self,
        model_name_or_path: str | Path = DEFAULT_MODEL,
        *,
        cache: CacheEngine | RemoteCache | None = None,
        config: Config | None = None,
        kv_dtype: str = "float16",
        model_id: str | None = None,
        fast_attention: bool = True,
        num_threads: int | None = None,
        model: Any = None,
        tokenizer: Any = None,
    ) -> None:
        torch.set_num_threads(num_threads or default_num_threads())
        if model is None or tokenizer is None:
            model, tokenizer = load_model(str(model_name_or_path), dtype=torch.float32)
        if getattr(model.config, "is_encoder_decoder", False) or not model.can_generate():
            raise ModelError(f"{model_name_or_path}: not a decoder-only causal LM")
        self.model = model.float().eval()
        # note: switches a caller-provided model too; paged decode needs it (its attention hook lives there)
        self._hooked = fast_attention and use_fast_attention(self.model)
        config = config or Config()
        self.decode_config = config.flexicache
        self.layout = layout_for(model.config, kv_dtype)
        self._check_budget(self.decode_config.kv_budget)  # a configured budget this model cannot serve: at start-up
        self.tokenizer = tokenizer
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.model_id = model_id or _default_model_id(model_name_or_path)
        self._owns_cache = cache is None  # close() closes only a cache we built
        if cache is None:
            cache = build_engine(config, self.layout, self.model_id)  # mode: server too
        self.cache = cache
        # tenant mode: an engine that names no tenant (no salt) is served without the cache, never in a shared
        # namespace whose hits (and their timing) other tenants could see
        self.is_tenantless = config.tenant_mode and not config.salt
        if self.is_tenantless:
            log.warning("kvfabric: tenant_mode is on and this engine names no tenant (salt): no cache is used")
        ours = layout_for(model.config, self.cache.layout.dtype)
        if self.cache.layout != ours:
            raise ValueError(f"cache layout {self.cache.layout} does not match the model's {ours}")
        self.layout = ours
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._buf: torch.Tensor | None = None  # reusable workspace [L, 2, H, capacity, D] fp32

    # ---- helpers ----------------------------------------------------------------------------------------
    def _check_budget(self, budget: float) -> None:
        """Paged decode (FlexiCache) attends over every resident page: it has no sliding window, so on a model with
        window layers it would read keys the model never reads. Refused, never computed wrong."""
        if not budget:
            return
        if not self._hooked:
            raise ValueError("kv_budget needs the engine's fast attention path (fast_attention=True, an sdpa model)")
        if self.layout.window_groups:
            raise ValueError(f"kv_budget (FlexiCache paged decode) does not support sliding-window layers "
                             f"({', '.join(g.describe() for g in self.layout.window_groups)}); decode with "
                             "kv_budget=0 on this model")

    def encode(self, prompt: str | Sequence[int] | torch.Tensor, chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if chat:
                ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                         add_generation_prompt=True, tokenize=True, return_dict=False)
            else:
                ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        return [int(t) for t in ids]

    def _workspace(self, num_tokens: int) -> torch.Tensor:
        """fp32 [L, 2, H, num_tokens, D] view of a buffer kept across calls (fresh pages are slow)."""
        if self._buf is None or self._buf.shape[3] < num_tokens:
            self._buf = None  # free the old one first
            capacity = -(-num_tokens // 512) * 512  # headroom: a slightly longer next prompt reuses it
            self._buf = torch.empty(self.layout.shape(capacity), dtype=torch.float32)
        return self._buf[:, :, :, :num_tokens]

    def _forward(self, ids: Sequence[int], cache: Any, start: int, **hooks: Any) -> torch.Tensor:
        """Run tokens at positions [start, start + len(ids)); returns last-position logits [vocab] fp32."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long)  # [1, q]
        positions = torch.arange(start, start + len(ids), dtype=torch.long).unsqueeze(0)  # [1, q]
        out = self.model(input_ids=input_ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1,
                         **hooks)
        return out.logits[0, -1].float()

    @staticmethod
    def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
        if temperature <= 0.0 or gen is None:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen))

    # ---- main entry -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        max_new_tokens: int = 32,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        use_cache: bool = True,
        store: bool = True,
        chat: bool = False,
        progress: Callable[[int, int], None] | None = None,
        kv_budget: float | None = None,
    ) -> GenerationResult:
        """Generate after ``prompt`` (text or token ids). ``temperature > 0`` samples and needs ``seed``.
        With ``progress``, the prefill runs in pieces of PREFILL_PIECE tokens and ``progress(done, total)`` is
        called after each (same result up to float rounding; costs a little). ``kv_budget`` in (0, 1] decodes
        on paged KV holding that share resident (default: the config's flexicache.kv_budget; 0 = dense)."""
        t0 = time.perf_counter()
        ids = self.encode(prompt, chat=chat)
        n = len(ids)
        if n == 0:
            raise ValueError("empty prompt: need at least one token")
        if n > self.max_positions:
            raise ValueError(f"prompt has {n} tokens, more than the model's context of {self.max_positions}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature > 0.0 and seed is None:
            raise ValueError("sampling (temperature > 0) needs an explicit seed")
        budget = self.decode_config.kv_budget if kv_budget is None else kv_budget
        self._check_budget(budget)
        max_new = min(max_new_tokens, self.max_positions - n)
        buf = self._workspace(n + max(max_new, 1))  # [L, 2, H, n + new, D] fp32

        use_cache = use_cache and not self.is_tenantless
        hit = self.cache.lookup(ids) if use_cache else 0
        got = self.cache.retrieve(ids[:hit], out=buf).shape[3] if hit else 0  # tokens now in buf[..., :got, :]
        past = min(got, n - 1)  # always recompute at least the last prompt token
        t1 = time.perf_counter()

        kv_cache = BufferCache(buf, past)
        step = PREFILL_PIECE if progress is not None else n
        for start in range(past, n, step):
            logits = self._forward(ids[start:start + step], kv_cache, start)  # [vocab] after the last piece
            if progress is not None:
                progress(min(start + step, n), n)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        tokens = [self._pick(logits, temperature, gen)] if max_new else []
        t2 = time.perf_counter()

        stored = 0
        if store and use_cache and got < n:
            stored = self.cache.store(ids, buf[:, :, :, got:n], start=got)  # KV of ids[got:n]
        t3 = time.perf_counter()

        paged, hooks = None, {}
        if budget and max_new > 1:  # the prompt's KV moves into pages; the dense buffer only served the prefill
            paged = paged_kv(self.model.config, self.model_id, self.decode_config, n + max_new, budget=budget)
            paged.ingest(buf, n)
            kv_cache, hooks = paged, {"kv_attention": paged}
        pos = n
        while tokens and len(tokens) < max_new and tokens[-1] not in self.eos_ids:
            tokens.append(self._pick(self._forward([tokens[-1]], kv_cache, pos, **hooks), temperature, gen))
            pos += 1
        decode_memory = paged.stats() if paged is not None and paged.step else None
        if paged is not None:
            paged.close()
        t4 = time.perf_counter()
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return GenerationResult(
            text=text, token_ids=tokens, prompt_tokens=n, hit_tokens=got, stored_chunks=stored,
            ttft_s=t2 - t0, retrieve_s=t1 - t0, prefill_s=t2 - t1, store_s=t3 - t2, decode_s=t4 - t3,
            logits=logits.clone(), decode_memory=decode_memory,
        )

    def close(self) -> None:
        self.cache.flush()
        if self._owns_cache:
            self.cache.close()
        self._buf = None

    def __enter__(self) -> HFEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
