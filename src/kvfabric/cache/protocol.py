"""The cache protocol: what connectors and engines use of a cache, whichever it is, and the values that cross it.

Contract:
- `KVCache` = `PrefixCache` (token ids in, KV in and out) + `ChunkStore` (chunks by key). It is met in full by
  `kvfabric.cache.engine.CacheEngine` (tiers in this process) and `kvfabric.cache.remote.RemoteCache` (`mode:
  server`, the host's `kvfabric server`); `kvfabric.cache.builder.build_engine` picks one. Optional abilities are
  protocols of their own: `TierAdmin` (one tier by name: only a cache with tiers in this process has it).
- Reads by key are three typed operations, each giving a verified chunk or a miss, never a payload plus a duty:
  `read_into(key, out)` decodes a whole chunk into the caller's tensor; `read_chunk` and `open_chunk` give a
  `ChunkSource` (kvfabric.cache.sources: a `TokenSource` or a `BlockSource`, matched on type) to use inside a
  `with` (`num_tokens`: the chunk's tokens, default chunk_size). `read_chunk`'s source was verified before it is handed out (for a caller that uses the KV before it
  could take it back: a layer-wise load). `open_chunk`'s is checked while the caller copies it, where the tier
  allows (a disk file read layer by layer, a view of shared memory, a block-layout payload hashed slab by slab);
  its verdict comes at the `with`'s exit as `ChunkFailed`. `read_many` reads whole chunks with one batch call
  per tier. Whether a read in place or by ranges is used, and whether a chunk read promotes it to faster tiers
  (`placement.promote_chunk_reads`), is the cache's choice, not the caller's.
- Writes by key: `new_payload(num_tokens, blocks)` is where the caller lays out a chunk (with the raw codec, the
  payload region of the very blob that will be stored), `store_chunks` stores such payloads. `premap` maps
  payload memory ahead of need; `paused()` holds that work back while the caller's hot work runs.
- The values are frozen slotted dataclasses. `chunks_to_store` and `retrieve_buffer` are the argument checks every
  cache shares, so that both give the same errors for the same mistakes.
- KV tensors are [layers, 2, kv_heads, tokens, head_dim] (`KVLayout.shape`); a block-layout payload is
  [layers, num_blocks, kv_heads, 2, block_size * head_dim] (kvfabric.kv.blocks).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from kvfabric.cache.sources import BlockSource, ChunkFailed, ChunkMiss, ChunkSource, MissReason, TokenSource
from kvfabric.host.pages import Scratch
from kvfabric.kv.blocks import BlockLayout
from kvfabric.kv.hashing import ChunkKey
from kvfabric.kv.layout import KVLayout
from kvfabric.observe.events import ChunkEvents
from kvfabric.observe.metrics import Histograms
from kvfabric.tiers.base import TierUsage

__all__ = ["BlockSource", "ChunkFailed", "ChunkHit", "ChunkMiss", "ChunkPayload", "ChunkSource", "ChunkStore",
           "EngineStats", "KVCache", "KeyLookup", "LocalCache", "MissReason", "PeerNode", "PrefixCache", "Read",
           "TierAdmin", "TierUsage", "TokenSource", "Tokens", "chunks_to_store", "retrieve_buffer"]

Tokens = Sequence[int] | np.ndarray | torch.Tensor
Read = TokenSource | BlockSource | ChunkMiss  # what read_chunk and open_chunk give


@dataclass(frozen=True, slots=True)
class ChunkHit:
    """`read_into`'s answer: the chunk is in the caller's tensor."""
    tier: str  # the tier that served it ("pending": a write still queued)
    num_bytes: int  # bytes of the blob(s) read


@dataclass(frozen=True, slots=True)
class ChunkPayload:
    kv: torch.Tensor  # [L, 2, H, T, D] in the layout dtype (with blocks: [L, num_blocks, H, 2, B*D]): write here
    blob: memoryview | None  # raw codec: the blob around `kv`, sealed by store_chunks; None: `kv` is encoded
    blocks: BlockLayout | None = None  # kv is in this block layout (new_payload(blocks=...))
    block_tokens: int = 0  # with blocks: the chunk's tokens (its last block may be partial)

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[3] if self.blocks is None else self.block_tokens


@dataclass(frozen=True, slots=True)
class KeyLookup:
    """`lookup_keys`' answer: the leading chunks of a prompt that can be loaded, and how many of those process
    memory (or a write still queued) holds."""
    num_chunks: int = 0
    num_in_memory: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    counters: dict[str, int]  # the engine's and its tier stack's counters, summed
    tiers: tuple[TierUsage, ...]  # fastest first
    tier_counters: dict[str, dict[str, int]] = field(default_factory=dict)  # each tier's own counters, by name
    breakers_open: dict[str, bool] = field(default_factory=dict)  # tiers with breakers: is one open
    write_queue_depth: int = 0
    write_queue_capacity: int = 0
    p2p_server: dict[str, int] = field(default_factory=dict)  # the cluster node's P2P server counters
    kv_events: dict[str, int] = field(default_factory=dict)  # events queued, by type; evicted / removed chunks


def chunks_to_store(layout: KVLayout, chunk_size: int, num_tokens: int, num_keys: int, kv: torch.Tensor,
                    start: int) -> list[int]:
    """`store`'s argument checks (shared by every cache with this seam): the chunk indices whose tokens kv
    [L, 2, H, T, D], holding tokens [start, start + T) of a prompt of num_tokens, covers entirely."""
    if start % chunk_size or not 0 <= start <= num_tokens:
        raise ValueError(f"start must be a multiple of chunk_size={chunk_size} within the prompt, got {start}")
    layout.check(kv)
    end = start + kv.shape[3]
    if end > num_tokens:
        raise ValueError(f"kv holds {kv.shape[3]} tokens from {start}, beyond the prompt's {num_tokens} tokens")
    return [i for i in range(start // chunk_size, num_keys) if min((i + 1) * chunk_size, num_tokens) <= end]


def retrieve_buffer(layout: KVLayout, num_tokens: int, out: torch.Tensor | None) -> torch.Tensor:
    """`retrieve`'s destination: `out` checked ([L, 2, H, >= num_tokens, D], any float dtype), or a new tensor."""
    if out is None:
        return torch.empty(layout.shape(num_tokens), dtype=layout.torch_dtype)
    if out.dim() != 5 or out.shape[3] < num_tokens or tuple(out.shape[:3]) + (out.shape[4],) != \
            layout.shape(0)[:3] + (layout.head_dim,):
        raise ValueError(f"out must be {layout.shape(num_tokens)} or longer in dim 3, got {tuple(out.shape)}")
    return out


@runtime_checkable
class PrefixCache(Protocol):
    """Token ids in, KV in and out (semantics: kvfabric.cache.engine's docstring)."""
    layout: KVLayout
    model_id: str
    chunk_size: int
    histograms: Histograms  # lookup / store / retrieve / read latencies in this process
    events: ChunkEvents | None  # chunks stored and removed here, for KV events (None: not tracked in this process)

    def keys(self, tokens: Tokens) -> list[ChunkKey]: ...
    def lookup(self, tokens: Tokens) -> int: ...
    def lookup_keys(self, keys: Sequence[bytes], num_tokens: int | None = None) -> KeyLookup: ...
    def store(self, tokens: Tokens, kv: torch.Tensor, start: int = 0) -> int: ...
    def retrieve(self, tokens: Tokens, out: torch.Tensor | None = None) -> torch.Tensor: ...
    def flush(self, *, to_peers: bool = False) -> None: ...
    def stats(self) -> EngineStats: ...
    def close(self) -> None: ...


@runtime_checkable
class ChunkStore(Protocol):
    """Chunks by key (semantics: kvfabric.cache.engine's docstring)."""

    def holds(self, keys: Sequence[bytes]) -> list[bool]: ...
    def read_into(self, key: bytes, out: torch.Tensor) -> ChunkHit | ChunkMiss: ...
    def read_chunk(self, key: bytes, num_tokens: int | None = None, *, blocks: BlockLayout | None = None,
                   layers: Sequence[int] | None = None, scratch: Scratch | None = None) -> Read: ...
    def open_chunk(self, key: bytes, num_tokens: int | None = None, *, blocks: BlockLayout | None = None,
                   layers: Sequence[int] | None = None, scratch: Scratch | None = None) -> Read: ...
    def read_many(self, keys: Sequence[bytes], scratches: Sequence[Scratch]) -> list[TokenSource | ChunkMiss]: ...
    def chunk_blob_bytes(self) -> int: ...
    def new_payload(self, num_tokens: int | None = None, blocks: BlockLayout | None = None) -> ChunkPayload: ...
    def store_chunks(self, items: Sequence[tuple[bytes, ChunkPayload]]) -> list[bool]: ...
    def premap(self, num_tokens: int | None = None, blocks: BlockLayout | None = None) -> None: ...
    def paused(self) -> AbstractContextManager[None]: ...
    def sweep_events(self) -> None: ...


@runtime_checkable
class KVCache(PrefixCache, ChunkStore, Protocol):
    """The cache an engine process uses: CacheEngine, or RemoteCache over the host's `kvfabric server`."""


@runtime_checkable
class TierAdmin(Protocol):
    """One tier by name, and removal: a cache whose tiers live in this process (CacheEngine)."""

    def tier_keys(self, name: str) -> list[bytes]: ...
    def tier_usage(self, name: str) -> TierUsage: ...
    def clear_tier(self, name: str) -> None: ...
    def delete(self, tokens: Tokens) -> int: ...


@runtime_checkable
class LocalCache(KVCache, TierAdmin, Protocol):
    """A KVCache with TierAdmin (the SGLang backend's cache: it empties its tier on SGLang's `clear`)."""


class PeerNode(Protocol):
    """What the engine uses of the cluster node that serves its tiers to peers (kvfabric.cluster.worker)."""
    stats_source: Callable[[], dict[str, int]] | None  # the counts the node sends with its heartbeats

    def flush_reports(self, timeout_s: float = 10.0) -> bool: ...
    def p2p_counters(self) -> dict[str, int]: ...
    def close(self) -> None: ...
