"""The KVCache protocol and the values that cross it: what connectors and engines use of a cache, whichever it is.

Contract:
- `KVCache` is met by `kvfabric.engine.CacheEngine` (tiers in this process) and `kvfabric.remote.RemoteCache`
  (`mode: server`, the host's `kvfabric server`); `kvfabric.builder.build_engine` picks one. Connectors and engines
  use its members and nothing else; their semantics are CacheEngine's (kvfabric.engine's docstring).
- The values are frozen slotted dataclasses, except the hit of a read (`ChunkHit`) and its `SlabReader`, which
  hold what the read opened (`close()` them).
- `chunks_to_store` and `retrieve_buffer` are the argument checks every cache shares, so that both give the same
  errors for the same mistakes.
- KV tensors are [layers, 2, kv_heads, tokens, head_dim] (`KVLayout.shape`); a block-layout payload is
  [layers, num_blocks, kv_heads, 2, block_size * head_dim] (kvfabric.blocks).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch

from kvfabric.blocks import WORD_DTYPES, BlockLayout, as_words
from kvfabric.codec.format import HEADER_BYTES, ChunkHeader
from kvfabric.codec.raw import payload_shape
from kvfabric.events import ChunkEvents
from kvfabric.hashing import ChunkKey
from kvfabric.layout import KVLayout
from kvfabric.metrics import Histograms
from kvfabric.pages import FileMapping, Scratch, map_file
from kvfabric.tiers.base import RangedBlob, TierUsage, TierView

Tokens = Sequence[int] | np.ndarray | torch.Tensor
MissReason = Literal["missing", "corrupt", "wrong_layout"]


@dataclass(frozen=True, slots=True)
class ChunkHit:
    kv: torch.Tensor  # [L, 2, H, T, D]: the caller's `out`, or a view / new tensor (see CacheEngine.read_chunk)
    tier: str  # the tier that served it ("pending": a write still queued)
    num_bytes: int  # bytes of the blob read
    layers: tuple[int, ...] | None = None  # the layout's layers kv holds, in order (None: all of them)
    view: TierView | None = None  # read in place (read_chunk(in_place=True)): see is_intact
    blocks: BlockLayout | None = None  # kv is the payload in this block layout [L, num_blocks, H, 2, B*D]
    unchecked_sum: int | None = None  # read_chunk(check_later=True): the xxh3-64 kv's bytes must hash to
    reader: SlabReader | None = None  # a block-layout chunk read layer by layer (kv is None then)

    def slab(self, index: int) -> np.ndarray | None:
        """Layer `index` of a block-layout hit as integer words [num_blocks, *block_shape]: a view of kv, or read
        now into the read's scratch (valid until the next slab); None when the stored blob turned out short."""
        if self.reader is not None:
            return self.reader.slab(index)
        return as_words(self.kv[index])

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()

    def is_intact(self) -> bool:
        """After copying kv elsewhere: whether it was still the stored chunk throughout (False only for a read in
        place whose shared memory a writer reused meanwhile: the copy may be torn, throw it away)."""
        return self.view is None or self.view.is_current()


class SlabReader:
    """A block-layout raw payload read one layer's slab at a time from a ranged tier, into a reusable buffer:
    small enough to stay in cache while the caller hashes it and copies it on."""

    def __init__(self, source: RangedBlob, header: ChunkHeader, layout: KVLayout, scratch: Scratch) -> None:
        self.source = source
        self.scratch = scratch
        self.slab_shape = payload_shape(layout, header.num_tokens, header.blocks)[1:]
        self.slab_bytes = header.payload_len // layout.num_layers
        self.dtype = WORD_DTYPES[layout.itemsize]
        self.fd = source.fd  # for a native reader (connectors.block_kernel): slab i at file_offset + i * slab_bytes
        self.file_offset = HEADER_BYTES
        self.payload_bytes = header.payload_len

    def map_payload(self) -> FileMapping | None:
        """The whole payload mapped from the chunk file (`pages.map_file`: no copy into a buffer), or None where
        the source is not a file or the file is shorter than its header says (read by slabs then: found short)."""
        return map_file(self.fd, self.file_offset, self.payload_bytes) if self.fd >= 0 else None

    def slab(self, index: int) -> np.ndarray | None:
        buf = self.scratch.view(self.slab_bytes)
        if not self.source.read_into(HEADER_BYTES + index * self.slab_bytes, buf):
            return None
        return np.frombuffer(buf, dtype=self.dtype).reshape(self.slab_shape)

    def close(self) -> None:
        self.source.close()


@dataclass(frozen=True, slots=True)
class ChunkMiss:
    reason: MissReason  # missing: no tier holds a valid blob; corrupt / wrong_layout: found, failed, discarded


@dataclass(frozen=True, slots=True)
class ChunkPayload:
    kv: torch.Tensor  # [L, 2, H, T, D] in the layout dtype (with blocks: [L, num_blocks, H, 2, B*D]): write here
    blob: memoryview | None  # raw codec: the blob around `kv`, sealed by store_chunk; None: `kv` is encoded
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
    breakers_open: dict[str, bool] = field(default_factory=dict)  # tiers with a circuit breaker: is it open
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
class KVCache(Protocol):
    """The cache an engine process uses, whichever it is: this module's CacheEngine, or RemoteCache (`mode: server`,
    kvfabric.remote) over the host's `kvfabric server`. Connectors and engines use these members and nothing else
    (kvfabric.builder.build_engine picks one). Semantics: CacheEngine's (the module docstring)."""
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
    def read_chunk(self, key: bytes, out: torch.Tensor | None = None, **options) -> ChunkHit | ChunkMiss: ...
    def chunk_blob_bytes(self) -> int: ...
    def new_payload(self, num_tokens: int | None = None, blocks: BlockLayout | None = None) -> ChunkPayload: ...
    def premap(self, num_tokens: int | None = None, blocks: BlockLayout | None = None,
               is_paused: bool = False) -> None: ...
    def store_chunk(self, key: bytes, payload: ChunkPayload) -> bool: ...
    def discard_chunk(self, key: bytes, tier: str, why: str) -> None: ...
    def sweep_events(self) -> None: ...
    def flush(self, *, to_peers: bool = False) -> None: ...
    def stats(self) -> EngineStats: ...
    def close(self) -> None: ...


class PeerNode(Protocol):
    """What the engine uses of the cluster node that serves its tiers to peers (kvfabric.cluster.worker)."""
    stats_source: Callable[[], dict[str, int]] | None  # the counts the node sends with its heartbeats

    def flush_reports(self, timeout_s: float = 10.0) -> bool: ...
    def p2p_counters(self) -> dict[str, int]: ...
    def close(self) -> None: ...
