"""SGLang HiCache storage backend over kvfabric's cache with one tier: `KVFabricStorage`. SGLang loads it by module
path:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "kvfabric",
      "module_path": "kvfabric.connectors.sglang", "class_name": "KVFabricStorage", "interface_v1": 1,
      "tiers": ["mooncake"], "mooncake": {"master": "10.0.0.1:50051", "metadata_url": "http://10.0.0.1:8080/metadata"}}'

Contract:
- The cache: a cache with tiers in this process (kvfabric.cache.builder.build_engine; `LocalCache`: the KVCache
  protocol and one tier by name) made when SGLang hands over its host pool, whose
  layout reads a page as one chunk: [1, 2, 1, page_size, elements per token / 2] in the pool's dtype, chunk_size
  = page_size, raw codec. So a page is a chunk blob like any other (codec.format: checksummed header + the page's
  bytes), checked, counted and dropped when damaged by the cache's tier stack, with its metrics and events.
- Keys: SGLang names a page by a hash string of its tokens and their prefix (the page key); its chunk key is
  sha256(namespace || page key). The namespace names the model (`model_id`, default SGLang's model name), the
  shard (TP rank for MHA pools; MLA pages are shared by the TP ranks, as in SGLang's HiCacheFile; PP, attention-CP
  and DCP ranks) and the page format: pages of other models, shards or formats never share a key.
- Calls: the v1 batch calls (`interface_v1: 1` in the extra config) move pages between the tier and SGLang's host
  pool. `batch_get_v1` reads `SLOTS` pages per batch (`KVCache.read_many`: one tier batch call; with the
  mooncake tier, straight into registered scratch buffers) and copies each verified payload into its host page;
  `batch_set_v1` skips pages the tier holds (one batched check) and stores the rest (`store_chunks`), then waits
  for the writes and answers whether the tier holds each page. Without `interface_v1`
  SGLang calls `get` / `set` / `batch_get` / `batch_set` with page tensors; they answer as SGLang's HiCacheFile
  does (tests/test_sglang_backend.py compares the two call by call). `exists` / `batch_exists` (how many leading
  pages are present) are one batched contains call. The v2 calls (hybrid models' extra pools) are not offered.
- Configuration: the extra-config keys that are kvfabric config keys configure the cache, on top of
  `config_file` (or $KVFABRIC_CONFIG) and KVFABRIC_* variables; `tiers` (default ["mooncake"]) names the one
  local tier pages live in (HiCache's host memory is the level above it; `mode: server` and "peer" are refused).
  Other keys belong to SGLang and are left alone. Pages are stored as they are: codecs are set to raw.
- Faults are the tier's: a miss or False, never an exception into SGLang's I/O threads (a dead Mooncake master
  is misses within the tier's timeout). Thread safe: each calling thread has its own scratch buffers.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvfabric.cache.builder import build_engine
from kvfabric.cache.protocol import ChunkFailed, ChunkPayload, LocalCache, TokenSource
from kvfabric.config import Config, ConfigError
from kvfabric.host.pages import Scratch
from kvfabric.kv.layout import DTYPES, KVLayout
from kvfabric.observe.counters import Counters

log = logging.getLogger(__name__)

SLOTS = 16  # pages per tier batch: bounds a reading thread's scratch memory to SLOTS pages
OPTION_KEYS = ("model_id", "config_file")
NAMESPACE = b"kvfabric/sglang/pages/v1"
_DTYPE_NAMES = {torch_dtype: name for name, (torch_dtype, _, _) in DTYPES.items()}


def backend_config(extra: dict[str, Any]) -> tuple[Config, dict[str, Any]]:
    """(kvfabric Config, our options) from SGLang's extra config; see the module doc."""
    fields = {field.name for field in dataclasses.fields(Config)}
    options = {key: extra[key] for key in OPTION_KEYS if key in extra}
    data = {key: value for key, value in extra.items() if key in fields}
    config = Config.load(options.get("config_file")).merged({"tiers": ["mooncake"], **data})
    if len(config.tiers) != 1 or config.tiers[0] == "peer":
        raise ConfigError(f"tiers: the SGLang backend stores pages in one local tier (HiCache's host memory is the "
                          f"level above it), got {list(config.tiers)}")
    if config.mode == "server":
        raise ConfigError("mode: the SGLang backend keeps pages in a tier of its own process; 'server' is not "
                          "supported")
    tier = config.tiers[0]
    return config.merged({"codec": "raw", tier: {"codec": ""}}), options  # pages as they are


class KVFabricStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.config, options = backend_config(dict(storage_config.extra_config or {}))
        self.model_id = str(options.get("model_id") or storage_config.model_name or "")
        self.tier_name = self.config.tiers[0]
        self.cache: LocalCache | None = None  # made when the host pool fixes the page format
        self.counters = Counters()
        self._local = threading.local()
        self._namespace = b""

    # ---- the page format, the cache and the keys, fixed when SGLang hands over its host pool ---------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_dummy_flat_data_page()
        page_size, numel = int(mem_pool_host.page_size), page.numel()
        if page.dtype not in _DTYPE_NAMES:
            raise NotImplementedError(f"KVFabricStorage stores float16, bfloat16 or float32 pages, not {page.dtype}")
        if numel % (2 * page_size):
            raise NotImplementedError(f"a page of {numel} elements does not split into 2 x {page_size} tokens")
        page_format = f"{type(mem_pool_host).__name__}/{mem_pool_host.layout}/{page.dtype}/{page_size}/{numel}"
        layout = KVLayout(1, 1, numel // (2 * page_size), _DTYPE_NAMES[page.dtype])  # a page read as one chunk
        name = "|".join([self.model_id, self._shard(), page_format])
        self._namespace = hashlib.sha256(NAMESPACE + b"|" + name.encode()).digest()
        if self.cache is None or self.cache.layout != layout or self.cache.chunk_size != page_size:
            cache = build_engine(self.config.merged({"chunk_size": page_size}), layout, self.model_id, name="sglang")
            if not isinstance(cache, LocalCache):  # backend_config refuses `mode: server`: never here
                cache.close()
                raise ConfigError("the SGLang backend needs a cache with its tier in this process")
            old, self.cache = self.cache, cache
            if old is not None:
                old.close()
        self._numel = numel

    def _shard(self) -> str:
        c = self.storage_config
        shard = f"pp{c.pp_rank}/{c.pp_size}" if c.pp_size > 1 else ""
        if c.attn_cp_size > 1:
            shard += f"/cp{c.attn_cp_rank}/{c.attn_cp_size}"
        if c.dcp_size > 1:
            shard += f"/tp{c.tp_size}/dcp{c.dcp_rank}/{c.dcp_size}/page{c.logical_page_size}"
        return shard if c.is_mla_model else f"{shard}/tp{c.tp_rank}/{c.tp_size}"

    def chunk_key(self, page_key: str) -> bytes:
        if not self._namespace:
            raise RuntimeError("KVFabricStorage: register_mem_pool_host must come first (it fixes the page format)")
        return hashlib.sha256(self._namespace + page_key.encode()).digest()

    def _cache(self) -> LocalCache:
        if self.cache is None:
            raise RuntimeError("KVFabricStorage: register_mem_pool_host must come first (it fixes the page format)")
        return self.cache

    # ---- batched page I/O -------------------------------------------------------------------------------
    def _read_pages(self, page_keys: Sequence[str], use: Callable[[int, torch.Tensor], object]) -> list[bool]:
        """Hand each page's verified data (flat: [1, 2, 1, page_size, D] of this thread's scratch buffers, valid only
        during the call) to `use(i, page)`; whether each page was there and whole when its copy ended."""
        cache = self._cache()
        scratches = getattr(self._local, "scratches", None)
        if scratches is None:
            scratches = self._local.scratches = [Scratch() for _ in range(SLOTS)]
        found: list[bool] = []
        for start in range(0, len(page_keys), SLOTS):
            keys = [self.chunk_key(page_key) for page_key in page_keys[start:start + SLOTS]]
            for i, source in enumerate(cache.read_many(keys, scratches[:len(keys)]), start=start):
                if isinstance(source, TokenSource):
                    try:
                        with source:
                            use(i, source.kv.reshape(-1))
                        found.append(True)
                        continue
                    except ChunkFailed:  # what `use` copied is not used: the page is reported missing
                        pass
                self.counters.add("miss")
                found.append(False)
        return found

    def _write_pages(self, page_keys: Sequence[str], page_of: Callable[[int], torch.Tensor]) -> list[bool]:
        """Store the pages the tier lacks, each key once (a page the tier holds is left as it is, as HiCacheFile
        does; a key repeated in the batch keeps its first page); then wait for the writes and answer whether the
        tier holds each page."""
        cache = self._cache()
        keys = [self.chunk_key(page_key) for page_key in page_keys]
        results = cache.holds(keys)
        first = {key: i for i, key in reversed(list(enumerate(keys)))}
        todo = [i for i, present in enumerate(results) if not present and first[keys[i]] == i]
        for start in range(0, len(todo), SLOTS):
            group = todo[start:start + SLOTS]
            self.counters.add("pages_stored", sum(cache.store_chunks([(keys[i], self._payload(page_of(i)))
                                                                      for i in group])))
        if todo:
            cache.flush()  # the tier's writes run on the cache's writer thread: SGLang expects them done
            for i, present in zip(todo, cache.holds([keys[i] for i in todo])):
                results[i] = present
        return [results[first[key]] for key in keys]

    def _payload(self, page: torch.Tensor) -> ChunkPayload:
        """The page copied into a new chunk payload of the cache (its blob, header sealed by the cache)."""
        cache, data = self._cache(), page.detach().reshape(-1)
        if data.numel() != self._numel or data.dtype != cache.layout.torch_dtype:
            raise ValueError(f"a page is {self._numel} elements of {cache.layout.torch_dtype}, got {data.numel()} "
                             f"of {data.dtype}")
        payload = cache.new_payload()
        payload.kv.view(-1).copy_(data)
        return payload

    # ---- HiCacheStorage: v1 batch calls (`interface_v1: 1`) ------------------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        page_size = self.mem_pool_host.page_size
        return self._read_pages(keys, lambda i, page: self.mem_pool_host.set_from_flat_data_page(
            int(host_indices[i * page_size]), page))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        page_size = self.mem_pool_host.page_size
        return self._write_pages(keys, lambda i: self.mem_pool_host.get_data_page(int(host_indices[i * page_size]),
                                                                                  flat=True))

    # ---- HiCacheStorage: page tensors (SGLang's generic path) and existence -------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        targets = list(target_locations or [None] * len(keys))
        out: list[torch.Tensor | None] = [None] * len(keys)

        def use(i: int, page: torch.Tensor) -> None:
            target = targets[i]
            out[i] = page.clone() if target is None else target.copy_(page.view(target.shape))

        found = self._read_pages(keys, use)
        return [page if is_found else None for page, is_found in zip(out, found)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self._write_pages(keys, lambda i: values[i]))

    def exists(self, key: str) -> bool:
        return self._cache().holds([self.chunk_key(key)])[0]

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        present = self._cache().holds([self.chunk_key(key) for key in keys])
        return present.index(False) if False in present else len(keys)

    def clear(self) -> None:
        """Every kvfabric chunk in the tier goes (as HiCacheFile empties its whole directory)."""
        cache = self._cache()
        cache.flush()
        cache.clear_tier(self.tier_name)

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
