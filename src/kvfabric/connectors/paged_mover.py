"""Chunks between one cache group's paged layers (vLLM 0.32's GPU layouts, K|V content, any device) and a
CacheEngine, through a CopyStream: the worker-side data path for vLLM's GPU attention backends.

Contract:
- `PagedMover(engine, views, layout, stream)`: `views` are the group's per-layer logical views [B, H, N, C] as
  vLLM hands them over (or `paged_views.layer_views` builds them), all on `stream.device`. The engine's layout
  says what C holds: K|V, or (`is_latent`) an MLA latent with H = 1, moved the same way as one state.
- `save(key, block_ids, start, end)` -> `SaveJob`: tokens [start, end) (start block-aligned) of every layer are
  copied on the copy stream after the engine's current work (`after_compute`: the copies see the forward's
  writes; the forward never waits for them). `job.is_done()` polls; `job.finish()` (a saver thread) waits for
  the copies and stores the chunk: True when stored, False when a tier held it already (the caller, like the
  CPU path's scheduler, saves only what the cache lacks).
- `load(key, block_ids, start, end, first=, chunk_tokens=)` -> `LoadJob`, or None on a miss (the caller recomputes
  those tokens). The chunk holds chunk_tokens tokens from `first` (block-aligned); tokens [start, end) of it go
  in. It is opened on the calling thread (`KVCache.open_chunk`); its blocks are copied into the layers on the copy
  stream (through the staging buffer on a staged stream). A chunk that fails its check as it is copied
  (`ChunkFailed` at the source's exit) is a miss: the copies already queued land, then the caller recomputes
  those blocks. `job.done` is the copies' `CopyDone` (`hold_compute()`: the engine's stream waits for them, the
  host does not); `job.finish()` waits and gives the staging back.
- `load_layered(reads, block_ids)` -> `LayeredLoad` (a layer-wise load, within the step that computes the request):
  every chunk of `reads` (each a `ChunkRead`, in prompt order, up to the first miss) is opened, copied into a
  host buffer of the stream's pool and verified (the source's exit) on the calling thread first, then the copies
  are queued layer by layer, so `layer_done[l]` (l's copies of every chunk) lands before l + 1's: the forward's
  layer l waits for it alone (`hold_compute`).
- vLLM's hybrid KV cache manager (several KV cache groups): `layer_groups` names each layer's group, and `save` /
  `load` take `group_tables` (one block table per group, each from token 0) in place of `block_ids`; a window
  layer (`window_layers`) loads only tokens from `window_from` on (vLLM holds no block of it before: its null
  block). `load_layered` moves one group only (the connector refuses layer-wise loads with several groups).
- Whole runs of blocks are copied as they are when the chunk was written in this layout (`block_layout`), else
  the chunk is converted once (kvfabric.kv.blocks) and scattered token-major; chunks of any layout load.
- On a CPU device the copies go straight between the layers and the chunk's payload. On a staged stream (CUDA)
  they go through pinned host buffers of the stream's pool (a copy between a device and pageable memory is not
  asynchronous), one host copy between that buffer and the chunk's payload, on the saver's or loader's thread.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from kvfabric.cache.protocol import BlockSource, ChunkFailed, ChunkMiss, ChunkPayload, KVCache, TokenSource
from kvfabric.connectors.copy_stream import CopyDone, CopyStream
from kvfabric.connectors.paged_views import DeviceLayer, block_layout, content_of, zero_tail
from kvfabric.host.pages import Scratch


@dataclass(frozen=True, slots=True)
class SaveJob:
    mover: PagedMover
    key: bytes
    payload: ChunkPayload
    staging: torch.Tensor | None  # pinned, on a device: [L, ...] of the payload's shape
    done: CopyDone

    def is_done(self) -> bool:
        return self.done.is_done()

    def finish(self) -> bool:
        self.done.wait()
        if self.staging is not None:
            self.payload.kv.copy_(self.staging)
            self.mover.release(self.staging)
        if self.payload.blocks is not None:  # the copies have landed: clear what follows the chunk's last token
            axis = self.mover.layers[0].blocks.token_axis
            for layer in self.payload.kv:
                zero_tail(layer, axis, self.payload.block_tokens)
        return self.mover.engine.store_chunks([(self.key, self.payload)])[0]


@dataclass(frozen=True, slots=True)
class LoadJob:
    mover: PagedMover
    staging: torch.Tensor | None
    done: CopyDone
    tier: str  # where the chunk was found
    num_bytes: int  # its bytes read

    def finish(self) -> None:
        self.done.wait()
        self.mover.release(self.staging)


@dataclass(frozen=True, slots=True)
class ChunkRead:
    """Tokens [start, end) of the chunk `key`, which holds chunk_tokens tokens from `first` (block-aligned)."""
    key: bytes
    first: int
    start: int
    end: int
    chunk_tokens: int


@dataclass(frozen=True, slots=True)
class LayeredLoad:
    mover: PagedMover
    layer_done: list[CopyDone]  # per layer: its copies of every chunk read
    staging: list[torch.Tensor | None]
    num_read: int  # reads [0, num_read) are in; the one after (if any) was missing or damaged
    by_tier: dict[str, int]  # bytes read per tier

    def finish(self) -> None:
        for done in self.layer_done:
            done.wait()
        for staging in self.staging:
            self.mover.release(staging)


class PagedMover:
    def __init__(self, engine: KVCache, views: Sequence[torch.Tensor], layout: str, stream: CopyStream,
                 layer_groups: Sequence[int] = (), window_layers: Iterable[int] = ()) -> None:
        if len(views) != engine.layout.num_layers:
            raise ValueError(f"{len(views)} layer views for a {engine.layout.num_layers}-layer model")
        if layer_groups and len(layer_groups) != len(views):
            raise ValueError(f"{len(layer_groups)} layers' KV cache groups for {len(views)} layer views")
        self.layer_groups = list(layer_groups) or [0] * len(views)  # layer index -> its KV cache group
        self.window_layers = frozenset(window_layers)
        self.engine = engine
        content = content_of(engine.layout)
        self.layers = [DeviceLayer.of(view, layout, content) for view in views]  # each layer's copies
        self.layout = layout
        self.stream = stream
        self.block_layout = block_layout(layout, self.layers[0].block_size)
        self._scratch = Scratch()

    def _staging(self, like: torch.Tensor) -> torch.Tensor | None:
        """A pinned host tensor shaped like `like` (None on a CPU device: no staging)."""
        if not self.stream.is_staged:
            return None
        raw = self.stream.host_buffer(like.numel() * like.element_size())
        return raw.view(like.dtype).view(like.shape)

    @property
    def is_hybrid(self) -> bool:
        return len(set(self.layer_groups)) > 1

    def _table(self, index: int, block_ids: Sequence[int], group_tables: Sequence[Sequence[int]]) -> Sequence[int]:
        """Layer `index`'s block table: its group's under the hybrid manager, else `block_ids`."""
        return group_tables[self.layer_groups[index]] if group_tables else block_ids

    def _load_from(self, index: int, start: int, window_from: int) -> int:
        """First token layer `index` loads: a window layer has no block before `window_from`."""
        return max(start, window_from) if index in self.window_layers else start

    def release(self, staging: torch.Tensor | None) -> None:
        """A staging tensor back to the stream's pool (once its copies have landed)."""
        if staging is not None:
            self.stream.release(staging.view(-1).view(torch.uint8))

    def save(self, key: bytes, block_ids: Sequence[int], start: int, end: int, *,
             group_tables: Sequence[Sequence[int]] = ()) -> SaveJob:
        payload = self.engine.new_payload(end - start, self.block_layout)
        staging = self._staging(payload.kv)
        target = payload.kv if staging is None else staging

        def copy() -> None:
            for index, layer in enumerate(self.layers):
                table = self._table(index, block_ids, group_tables)
                if payload.blocks is not None:  # whole blocks as they are
                    layer.save_blocks(table, start, end, target[index])
                else:  # a codec or split layout wants [L, S, H, T, D]
                    layer.gather(table, start, end, target[index])

        self.stream.after_compute()
        self.stream.run(copy)
        return SaveJob(self, key, payload, staging, self.stream.record())

    def load_layered(self, reads: Sequence[ChunkRead], block_ids: Sequence[int]) -> LayeredLoad:
        if self.is_hybrid:
            raise ValueError("a layer-wise load moves one KV cache group")
        staged: list[tuple[ChunkRead, torch.Tensor, bool]] = []  # (read, its staging [L, ...], whole blocks?)
        by_tier: dict[str, int] = {}
        for read in reads:
            source = self.engine.open_chunk(read.key, read.chunk_tokens, blocks=self.block_layout,
                                            scratch=self._scratch)
            if isinstance(source, ChunkMiss):
                break
            staging = None
            try:
                with source:  # verified at the exit, before any of it reaches a layer
                    staging = self._host_copy(source, read)
            except ChunkFailed:
                self.release(staging)  # taken when the copy ended before the check failed
                break
            staged.append((read, staging, isinstance(source, BlockSource)))
            by_tier[source.tier] = by_tier.get(source.tier, 0) + source.num_bytes
        layer_done = []
        for index, layer in enumerate(self.layers):
            def copy(index: int = index, layer: DeviceLayer = layer) -> None:
                for read, staging, is_blocks in staged:
                    if is_blocks:
                        layer.load_blocks(block_ids, read.start, read.end, staging[index], read.first)
                    else:
                        layer.scatter(block_ids, read.start, read.end, staging[index])

            self.stream.run(copy)
            layer_done.append(self.stream.record())
        return LayeredLoad(self, layer_done, [staging for _, staging, _ in staged], len(staged), by_tier)

    def _host_copy(self, source: TokenSource | BlockSource, read: ChunkRead) -> torch.Tensor:
        """The chunk's part in a host buffer of the stream's pool (kept until every layer's copies landed):
        whole blocks [L, n, ...] as stored, or tokens [L, S, H, end - start, D]; given back when a slab is short."""
        dtype = self.layers[0].view.dtype
        if isinstance(source, TokenSource):
            part = source.kv[:, :, :, read.start - read.first:read.end - read.first, :]
            staging = self.stream.host_buffer(part.numel() * part.element_size()).view(dtype).view(part.shape)
            staging.copy_(part)
            return staging
        layer = torch.from_numpy(source.slab(0)).view(dtype)
        staging = self.stream.host_buffer(layer.numel() * layer.element_size() * len(self.layers)).view(dtype)
        staging = staging.view(len(self.layers), *layer.shape)
        try:
            staging[0].copy_(layer)
            for index in range(1, len(self.layers)):
                staging[index].copy_(torch.from_numpy(source.slab(index)).view(dtype))
        except ChunkFailed:
            self.release(staging)
            raise
        return staging

    def load(self, key: bytes, block_ids: Sequence[int], start: int, end: int, *, first: int, chunk_tokens: int,
             group_tables: Sequence[Sequence[int]] = (), window_from: int = 0) -> LoadJob | None:
        if not first <= start <= end <= first + chunk_tokens:
            raise ValueError(f"tokens [{start}, {end}) are not in the chunk's [{first}, {first + chunk_tokens})")
        source = self.engine.open_chunk(key, chunk_tokens, blocks=self.block_layout, scratch=self._scratch)
        if isinstance(source, ChunkMiss):
            return None
        queued = _Queued()
        try:
            with source:
                self._queue_load(source, queued, block_ids, start, end, first, group_tables, window_from)
        except ChunkFailed:  # what was queued lands, then the caller recomputes those blocks
            self.stream.record().wait()
            self.release(queued.staging)
            return None
        return LoadJob(self, queued.staging, self.stream.record(), source.tier, source.num_bytes)

    def _queue_load(self, source: TokenSource | BlockSource, queued: _Queued, block_ids: Sequence[int], start: int,
                    end: int, first: int, group_tables: Sequence[Sequence[int]], window_from: int) -> None:
        """Queue the copies of tokens [start, end) of an open chunk into the layers (the staging buffer they read,
        on a staged stream, goes into `queued` as soon as it is taken)."""
        dtype = self.layers[0].view.dtype
        if isinstance(source, TokenSource):  # [L, S, H, T, D] from `first`: only [start, end) goes in
            chunk = source.kv[:, :, :, start - first:end - first, :]
            queued.staging = self._staging(chunk)
            if queued.staging is not None:
                queued.staging.copy_(chunk)
                chunk = queued.staging

            def copy() -> None:
                for index, layer in enumerate(self.layers):
                    lo = self._load_from(index, start, window_from)
                    if lo < end:  # [S, H, T, D] from `start`: the layer's part from lo
                        layer.scatter(self._table(index, block_ids, group_tables), lo, end, chunk[index][:, :, lo - start:])

            self.stream.run(copy)
            return
        # this layout's blocks, layer by layer (a slab read from a file is valid until the next one)
        for index, device_layer in enumerate(self.layers):
            lo = self._load_from(index, start, window_from)
            if lo >= end:  # a window layer wholly before vLLM's first block of it: nothing to copy
                continue
            layer = torch.from_numpy(source.slab(index)).view(dtype)
            if self.stream.is_staged:
                if queued.staging is None:
                    queued.staging = self._staging(layer.expand(len(self.layers), *layer.shape))
                assert queued.staging is not None
                queued.staging[index].copy_(layer)
                layer = queued.staging[index]
            self.stream.run(partial(device_layer.load_blocks, self._table(index, block_ids, group_tables), lo, end,
                                    layer, first))


@dataclass
class _Queued:
    """A load's staging buffer (on a staged stream), known as soon as it is taken: given back if the load fails."""
    staging: torch.Tensor | None = None
