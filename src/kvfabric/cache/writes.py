"""CacheEngine's writes: `store` (a prompt's KV by tokens) and `new_payload` + `store_chunks` (chunks by key).

Contract:
- A chunk is stored in every part of its shape (kvfabric.kv.shapes) and encoded once per codec its tiers ask for
  (the engine's codec, and another where a tier's config names one). With the raw codec the blob is written into a
  buffer of the first tier (process memory recycles them: no page faults) and left unsealed: the stack fills its
  checksums in only if it is written beyond process memory.
- A chunk is skipped when a writable tier already holds every part of it (one whose window part is gone is stored
  again, else its hits would stay short).
- `new_payload(num_tokens, blocks)`: with the raw codec and chunks stored whole, the payload region of the blob
  that will be stored (uninitialized), in the block layout `blocks` when given; else a tensor that is encoded at
  `store_chunks`. The payload belongs to the engine once stored: the caller must not write into it again.
- `premap` asks the first tier to map payload buffers ahead, off the caller's thread; `paused()` holds that back
  while the caller's hot work runs (a vLLM forward); pauses nest.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kvfabric.cache.core import EngineCore
from kvfabric.cache.protocol import ChunkPayload, Tokens, chunks_to_store
from kvfabric.codec.base import Codec
from kvfabric.codec.format import parse
from kvfabric.codec.raw import RawCodec, blob_bytes, new_payload, seal
from kvfabric.kv.blocks import BlockLayout
from kvfabric.kv.hashing import ChunkKey, KeySpace
from kvfabric.kv.layout import KVLayout
from kvfabric.observe.events import ChunkEvents
from kvfabric.tiers.base import Blob
from kvfabric.tiers.policies import NO_META, AccessMeta

# The buffers one store pass (_put_many) takes before it stores any: a prompt longer than the cpu tier's capacity
# must not map all its chunks at once, beyond what the tier keeps.
STORE_PASS_BYTES = 256 << 20


class Writes:
    def __init__(self, core: EngineCore, key_space: KeySpace, codec: Codec, tier_codecs: dict[int, Codec],
                 events: ChunkEvents | None) -> None:
        self.core = core
        self.key_space = key_space
        self.codec = codec
        self.tier_codecs = tier_codecs  # stack level -> its codec, where not the engine's
        self.events = events
        self._is_raw_whole = isinstance(codec, RawCodec) and core.shape.is_whole
        self._lock = threading.Lock()
        self._num_paused = 0

    def store(self, tokens: Tokens, kv: torch.Tensor, start: int = 0) -> int:
        c = self.core
        num_tokens = len(tokens)
        started = time.perf_counter()
        keys = self.key_space.keys(tokens)
        wanted = chunks_to_store(c.layout, c.chunk_size, num_tokens, len(keys), kv, start)
        end = start + kv.shape[3]
        stored = [i for i, is_held in zip(wanted, self.held([keys[i] for i in wanted])) if not is_held]
        per_pass = max(1, STORE_PASS_BYTES // max(1, c.layout.num_bytes(c.chunk_size)))
        for first in range(0, len(stored), per_pass):
            chunks = stored[first:first + per_pass]
            if not self._put_many(keys, chunks, kv, start, num_tokens):
                for i in chunks:
                    s, e = c.span(i, num_tokens)
                    self._put(keys[i], kv[:, :, :, s - start:e - start, :], meta=c.meta(i, len(keys), s, e))
        c.histograms.observe("kvfabric_store_seconds", time.perf_counter() - started, "store")
        num_tokens_stored = sum(e - s for s, e in (c.span(i, num_tokens) for i in stored))
        for name, n in (("stores", 1), ("store_tokens", end - start), ("store_chunks", len(wanted)),
                        ("chunks_stored", len(stored)), ("tokens_stored", num_tokens_stored)):
            c.counters.add(name, n)
        if self.events is not None and stored:
            self._announce(tokens, keys, stored)
        return len(stored)

    def _announce(self, tokens: Tokens, keys: list[ChunkKey], stored: list[int]) -> None:
        """KV events for newly stored chunks, one BlockStored per run of consecutive chunks."""
        assert self.events is not None
        ids = tokens.tolist() if isinstance(tokens, (torch.Tensor, np.ndarray)) else list(tokens)
        span = self.core.span
        run: list[int] = []
        for i in [*stored, -1]:
            if run and i != run[-1] + 1:
                first, last = run[0], run[-1]
                self.events.stored([keys[j] for j in run], keys[first - 1] if first else None,
                                   ids[span(first, len(ids))[0]:span(last, len(ids))[1]])
                run = []
            run.append(i)

    def held(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether a writable tier holds what a read of each chunk needs (a replica holds everything: it never
        writes)."""
        if not self.core.shape.is_writer:
            return [True] * len(keys)
        return self.core.shape.held(keys, lambda found: self.core.stack.contains_many(found, writable_only=True))

    def _put_many(self, keys: list[ChunkKey], chunks: list[int], kv: torch.Tensor, start: int, num_tokens: int) -> bool:
        """Store `chunks` of kv (tokens from `start`) as `_put` does, their copies made in one pass over kv
        (RawCodec.encode_chunks: a whole-chunk raw store reads kv in address order instead of a chunk at a time);
        False, having stored nothing, where that does not apply (another codec, split chunks, a tier asking for
        its own codec, a first tier outside process memory, no streamed copy): the caller puts them one by one.
        Only into process memory: there every buffer taken is a stored chunk at once, whereas a disk tier's
        buffers come back only after their writes, so taking them all first would map fresh ones."""
        c = self.core
        if len(chunks) < 2 or not self._is_raw_whole or not c.stack.stores_in_memory or \
                any(level in c.stack.levels.store for level in self.tier_codecs):
            return False
        assert isinstance(self.codec, RawCodec)
        spans = [c.span(i, num_tokens) for i in chunks]
        started = time.perf_counter()
        part = c.shape.parts[0]
        outs = self.codec.encode_chunks(kv, [(s - start, e - start) for s, e in spans],
                                        [part.key(keys[i]) for i in chunks], c.layout, c.stack.new_blob)
        if outs is None:
            return False
        share = (time.perf_counter() - started) / len(chunks)
        for i, out, (s, e) in zip(chunks, outs, spans):
            c.histograms.observe("kvfabric_codec_encode_seconds", share, self.codec.name)  # each chunk's share
            c.stack.put(part.key(keys[i]), out, {}, c.meta(i, len(keys), s, e))
        return True

    def _put(self, key: bytes, kv: torch.Tensor, blob: Blob | None = None, meta: AccessMeta = NO_META) -> None:
        """Store one chunk's KV [L, 2, H, C, D] under `key`, each part of its shape under the part's key (`blob`: the
        engine's encoding of a whole chunk, made by the caller)."""
        shape = self.core.shape
        for part, part_kv in zip(shape.parts, shape.split(kv)):
            self._put_part(part.key(key), part_kv, blob if shape.is_whole else None, meta, part.layout)

    def _put_part(self, key: bytes, kv: torch.Tensor, blob: Blob | None, meta: AccessMeta, layout: KVLayout) -> None:
        """Store kv [L', 2, H, C, D] of `layout` under `key`: encoded once with the engine's codec (or `blob`, that
        encoding made by the caller) and once more for each other codec a tier the chunk goes to asks for."""
        stack = self.core.stack
        if blob is None:
            if isinstance(self.codec, RawCodec):
                out = stack.new_blob(blob_bytes(layout, kv.shape[3]))
                blob = self._encode(self.codec, kv, key, layout, out=out, with_checksums=False)
            else:
                blob = self._encode(self.codec, kv, key, layout)
        encoded: dict[int, Blob] = {}  # id(codec) -> blob: tiers sharing a codec share one encoding
        per_level: dict[int, Blob] = {}
        for level, codec in self.tier_codecs.items():
            if level not in stack.levels.store:
                continue  # exclusive placement: this tier only gets chunks demoted to it (as they are)
            if id(codec) not in encoded:
                encoded[id(codec)] = self._encode(codec, kv, key, layout)
            per_level[level] = encoded[id(codec)]
        stack.put(key, blob, per_level, meta)

    def _encode(self, codec: Codec, kv: torch.Tensor, key: bytes, layout: KVLayout, **options: object) -> Blob:
        started = time.perf_counter()
        blob = codec.encode(kv, key, layout, **options)
        self.core.histograms.observe("kvfabric_codec_encode_seconds", time.perf_counter() - started, codec.name)
        return blob

    def _blob_size(self, num_tokens: int | None, blocks: BlockLayout | None) -> int:
        c = self.core
        return blob_bytes(c.layout, num_tokens or c.chunk_size, blocks)

    def new_payload(self, num_tokens: int | None = None, blocks: BlockLayout | None = None) -> ChunkPayload:
        c = self.core
        num_tokens = num_tokens or c.chunk_size
        if self._is_raw_whole:
            blob, kv = new_payload(c.layout, num_tokens, memoryview(c.stack.new_blob(self._blob_size(num_tokens, blocks))),
                                   blocks)
            return ChunkPayload(kv, blob, blocks, num_tokens if blocks is not None else 0)
        return ChunkPayload(torch.empty(c.layout.shape(num_tokens), dtype=c.layout.torch_dtype), None)

    def premap(self, num_tokens: int | None = None, blocks: BlockLayout | None = None) -> None:
        if self._is_raw_whole:
            self.core.stack.premap(self._blob_size(num_tokens, blocks))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self._lock:
            self._num_paused += 1
            if self._num_paused == 1:
                self.core.stack.pause_premap(True)
        try:
            yield
        finally:
            with self._lock:
                self._num_paused -= 1
                if self._num_paused == 0:
                    self.core.stack.pause_premap(False)

    def store_chunks(self, items: Sequence[tuple[bytes, ChunkPayload]]) -> list[bool]:
        held = self.held([key for key, _ in items])
        return [not is_held and self._store_new(key, payload) for (key, payload), is_held in zip(items, held)]

    def _store_new(self, key: bytes, payload: ChunkPayload) -> bool:
        c = self.core
        started = time.perf_counter()
        num_tokens = payload.num_tokens
        stored = c.shape.parts[0].key(key)  # a share is stored under its own key
        if payload.blob is not None:  # the stack seals it if it leaves memory
            seal(payload.blob, stored, c.layout, False, num_tokens, payload.blocks)
        kv = payload.kv
        if payload.blocks is not None and self.tier_codecs:  # another codec encodes [L, 2, H, T, D]
            assert payload.blob is not None
            kv = c.decoders.view(parse(payload.blob, stored, is_trusted=True), payload.blob, c.layout, num_tokens)
        self._put(key, kv, payload.blob)
        c.histograms.observe("kvfabric_store_seconds", time.perf_counter() - started, "store_chunk")
        for name, n in (("chunks_stored", 1), ("tokens_stored", num_tokens), ("store_chunks", 1),
                        ("store_tokens", num_tokens)):
            c.counters.add(name, n)
        if self.events is not None:
            self.events.stored([key], None, [])  # the caller knows the key only
        return True
