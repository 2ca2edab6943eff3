"""CacheEngine: the public entry point. Token ids in, KV tensors in and out; chunking, keys and tiers inside.

Contract:
- `lookup(tokens)`: the longest prefix, in tokens, whose chunks are all cached (chunk-aligned, or the whole
  prompt when its partial last chunk is cached with `save_partial_chunk`). It does not read chunk data.
  `lookup_keys(keys, num_tokens)`: the same by chunk keys, in chunks (`KeyLookup`, with those in process memory).
- `store(tokens, kv, start=0)`: kv [L, 2, H, T, D] holds the KV of tokens[start:start+T] (start chunk-aligned);
  every whole chunk in that range not yet cached is encoded and stored. Returns the number of chunks stored.
  It returns once the fastest tier holds the chunks; slower tiers are written in the background. `flush()`
  waits for those writes; `flush(to_peers=True)` with tier "peer" also for the controller to know what the
  served tiers hold (bounded by `cluster.fetch_timeout_s`), so that a peer's lookup right after finds it (a P/D
  prefill instance over P2P answers only then).
- `retrieve(tokens, out=None)`: KV of the longest retrievable prefix of `tokens`, [L, 2, H, m, D] with m <= the
  lookup; a chunk that vanished or fails its checks ends the prefix there (a miss), is counted and removed, and is
  never returned. With `out` ([L, 2, H, >= len(tokens), D], any float dtype), chunks are copied into place and
  `out[..., :m, :]` is returned: the fast path (no allocation, one copy per chunk).
- `read_chunk(key, out=None)`: one chunk by key, a `ChunkHit` (KV, serving tier, bytes read) or a `ChunkMiss`
  (missing, corrupt, wrong_layout); a chunk that fails its checks is discarded and counted, as in `retrieve`.
  With `promote=False` a chunk from a lower tier is read into the caller's scratch and not promoted (a caller
  that copies the KV elsewhere at once pays no allocation); `chunk_blob_bytes()` sizes such a scratch.
- `new_payload()` then `store_chunk(key, payload)`: the caller lays a chunk's KV out in the payload (raw codec:
  the payload region of the very blob that will be stored, no encode copy); a chunk already held is skipped.
  `new_payload(blocks=B)` (raw codec, chunks stored whole): the payload is in the paged engine's block layout B
  ([L, num_blocks, H, 2, B*D], kvfabric.blocks), filled by copying whole blocks; the header names B.
- Block layouts on reads: every reader gets [L, 2, H, T, D] (converted once, kvfabric.blocks) except
  `read_chunk(key, blocks=B)` of a chunk stored in layout B: its payload as it is (`ChunkHit.blocks` set), for
  a copy of whole blocks. With `check_later=True` too (promote=False, no `out`), an untrusted tier's payload is
  not hashed by the read: the caller hashes it while copying (`ChunkHit.unchecked_sum`) and reports a mismatch
  with `discard_chunk` (verifying in cache instead of in a separate pass over memory). Such a hit from the disk
  tier is not read whole: `ChunkHit.slab(i)` reads layer i's slab into `scratch` when asked (kv is None), so that
  each slab is hashed and copied on while it is in cache; `ChunkHit.close()` when done.
- Layouts with sliding-window layers (kvfabric.chunk_parts): a chunk is stored as its full-attention part and,
  under a derived key, its window part; `retrieve` reads the window part only of chunks holding rows a
  continuation still reads (`KVLayout.live_start`) and zeros the window layers' earlier rows; `lookup` counts a
  prefix only while those window parts are present. `read_chunk` / `store_chunk` take and give whole chunks;
  `read_chunk(key, window=False)` reads a split chunk's full-attention part only (its `ChunkHit.layers` name the
  layers it holds): for a caller that needs no window row of that chunk (vLLM's hybrid manager, window rows
  before the window). `read_chunk(key, promote=False, in_place=True)`: a chunk in the shm pool is verified and
  viewed where it lies; `ChunkHit.is_intact()` after copying it out says whether a writer reused it meanwhile.
- `delete(tokens)` removes a prompt's chunks from every tier; `tier_keys`, `tier_usage`, `clear_tier` address one
  tier by name; `stats()` is an `EngineStats` snapshot.
- Observability (kvfabric.metrics, kvfabric.events): lookup / store / retrieve / read_chunk latencies and codec
  times go into `histograms`; given `events`, the engine queues chunk stored / removed events there. The /metrics
  endpoint (its counters and tier usage read at scrape time) and the ZMQ event publisher are made by
  `kvfabric.builder.build_engine` from the config and attached (`attach_observers`); so is the cluster node of tier
  "peer" (`node`). This module imports nothing from the cluster.
- The `KVCache` protocol this class meets, and the values it answers with, are in kvfabric.kvcache.
- Nothing here raises for a damaged or missing cache entry; errors are raised only for bad arguments. Counters
  are thread-safe; `read_chunk` and `store_chunk` may run on different threads (the vLLM connector's step and saver).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvfabric.blocks import BlockLayout
from kvfabric.chunk_parts import ChunkParts
from kvfabric.codec.base import Codec, Decoders, LatentCodecError, WrongLayoutError, check_codec
from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, check_payload, parse
from kvfabric.codec.raw import RawCodec, new_payload, payload_bytes, seal
from kvfabric.codec.registry import CODECS, CodecChoice, parse_codec
from kvfabric.config import Config, ConfigError
from kvfabric.counters import Counters, merged
from kvfabric.events import ChunkEvents, EventPublisher
from kvfabric.hashing import ChunkKey, KeySpace
from kvfabric.kvcache import (ChunkHit, ChunkMiss, ChunkPayload, EngineStats, KeyLookup, PeerNode, SlabReader,
                              Tokens, chunks_to_store, retrieve_buffer)
from kvfabric.layout import KVLayout
from kvfabric.metrics import Histograms, MetricsEndpoint
from kvfabric.pages import Scratch
from kvfabric.tiers.base import Blob, Tier, TierUsage
from kvfabric.tiers.factory import build_tiers, codec_spec
from kvfabric.tiers.policies import NO_META, AccessMeta, prefill_cost_s
from kvfabric.tiers.stack import StackHit, TierStack

log = logging.getLogger(__name__)


_MISSING = ChunkMiss("missing")
READ_AHEAD_BYTES = 24 << 20  # how far ahead of the decoding a retrieve asks slow tiers to start reading


def _whole(found: StackHit, scratch: Scratch) -> StackHit | None:
    """A ranged hit read whole into scratch (its payload still to be checked), or None when the read falls short."""
    ranged = found.ranged
    assert ranged is not None
    try:
        blob = scratch.view(ranged.size)
        if not ranged.read_into(0, blob):
            return None
    finally:
        ranged.close()
    return StackHit(blob, found.header, found.tier, None, False)


class CacheEngine:
    def __init__(self, config: Config | None, layout: KVLayout, model_id: str,
                 tiers: Sequence[Tier] | None = None, *, node: PeerNode | None = None,
                 events: ChunkEvents | None = None) -> None:
        """`tiers`: the stack, fastest first (default: the local tiers the config names). `node`: the cluster node
        composed with those tiers (tier "peer"), closed with the engine; `events`: where stored / removed chunks
        are queued. `kvfabric.builder.build_engine` composes all of it from the config."""
        self.config = config or Config()
        self.layout = layout
        self.model_id = model_id
        self.chunk_size = self.config.chunk_size
        self.codec = parse_codec(self.config.codec).make()
        self._decoders = Decoders()
        self.key_space = KeySpace.of(model_id, layout, self.chunk_size, self.config.salt, self.config.hash,
                                     self.config.save_partial_chunk)
        self._parts = ChunkParts.of(layout)  # None: chunks are stored whole
        tier_names = self.config.tiers if tiers is None else [tier.name for tier in tiers]
        for spec in [self.config.codec, *filter(None, (codec_spec(self.config, name) for name in tier_names))]:
            try:  # before any tier is made: nothing to close on the way out
                check_codec(parse_codec(spec), layout)
            except LatentCodecError as exc:
                raise ConfigError(f"codec: {exc}") from None
        if tiers is None:
            if "peer" in self.config.tiers:
                raise ValueError("tier 'peer' needs a cluster node: build the engine with "
                                 "kvfabric.builder.build_engine(config, layout, model_id)")
            tiers = build_tiers(self.config, self.config.tiers)
        self.node = node
        if node is not None:
            node.stats_source = self.summary
        self.stack = TierStack(tiers, self.config.write_queue_chunks, self.config.placement)
        self._counters = Counters()
        # Tiers whose config names another codec get their own encoding of each chunk (e.g. raw in process
        # memory, cachegen on the network tiers); blobs are self-describing, so reads never need to know.
        self._tier_codecs: dict[int, Codec] = {}  # stack level -> its codec, where not the engine's
        codecs: dict[CodecChoice, Codec] = {parse_codec(self.config.codec): self.codec}
        for level, tier in enumerate(self.stack.tiers):
            spec = codec_spec(self.config, tier.name)
            if not spec:
                continue
            parsed = parse_codec(spec)
            if parsed not in codecs:
                codecs[parsed] = parsed.make()
            if codecs[parsed] is not self.codec:
                self._tier_codecs[level] = codecs[parsed]
        # One reader thread fetches chunk i+1 (file or network I/O, checksum) while chunk i is decoded:
        # both release the GIL, so a load costs about max(I/O, copy) rather than their sum.
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfabric-reader")
        self._scratch = threading.local()
        self.histograms = Histograms()
        self.events = events
        self.metrics_endpoint: MetricsEndpoint | None = None  # serving this engine's /metrics (attach_observers)
        self.publisher: EventPublisher | None = None  # publishing `events` on ZMQ (attach_observers)

    def attach_observers(self, metrics_endpoint: MetricsEndpoint | None = None,
                         publisher: EventPublisher | None = None) -> None:
        """What a builder made around this engine once it existed (they read its stats and tiers): closed with the
        engine, before its tiers."""
        self.metrics_endpoint = metrics_endpoint or self.metrics_endpoint
        self.publisher = publisher or self.publisher

    # ---- keys --------------------------------------------------------------------------------------------
    def keys(self, tokens: Tokens) -> list[ChunkKey]:
        return self.key_space.keys(tokens)

    def _span(self, i: int, num_tokens: int) -> tuple[int, int]:
        return i * self.chunk_size, min((i + 1) * self.chunk_size, num_tokens)

    # ---- API ---------------------------------------------------------------------------------------------
    def lookup(self, tokens: Tokens) -> int:
        started = time.perf_counter()
        keys = self.keys(tokens)
        num_hit = self._prefix(keys, len(tokens))
        found = self._span(num_hit - 1, len(tokens))[1] if num_hit else 0
        self.histograms.observe("kvfabric_lookup_seconds", time.perf_counter() - started)
        c = self._counters
        c.add("lookups")
        c.add("lookup_tokens", len(tokens))
        c.add("lookup_hit_tokens", found)
        c.add("lookup_chunks", len(keys))
        c.add("lookup_hit_chunks", num_hit)
        return found

    def lookup_keys(self, keys: Sequence[bytes], num_tokens: int | None = None) -> KeyLookup:
        """`lookup` by chunk keys (a connector's own key scheme in this namespace too) of a prompt of num_tokens
        tokens (default: whole chunks): the same rule, window parts included. No chunk data is read."""
        num_chunks = self._prefix(keys, num_tokens or len(keys) * self.chunk_size)
        self._counters.add("lookups")
        self._counters.add("lookup_chunks", len(keys))
        self._counters.add("lookup_hit_chunks", num_chunks)
        return KeyLookup(num_chunks, sum(map(self.stack.is_in_memory, keys[:num_chunks])))

    def _prefix(self, keys: Sequence[bytes], num_tokens: int) -> int:
        """The leading chunks all present; on a layout with window layers, only while the window parts a load of
        that prefix needs are present too (`ChunkParts.live_prefix`)."""
        num_hit = self.stack.prefix_length(keys)
        if self._parts is not None and num_hit:
            num_hit = self._parts.live_prefix(num_hit, num_tokens, self.chunk_size, lambda chunks: self.stack.
                                              contains_many([self._parts.window_key(keys[i]) for i in chunks]))
        return num_hit

    def store(self, tokens: Tokens, kv: torch.Tensor, start: int = 0) -> int:
        num_tokens = len(tokens)
        started = time.perf_counter()
        keys = self.keys(tokens)
        wanted = chunks_to_store(self.layout, self.chunk_size, num_tokens, len(keys), kv, start)
        end = start + kv.shape[3]
        present = self._held([keys[i] for i in wanted])
        stored: list[int] = []
        for i, is_present in zip(wanted, present):
            if is_present:
                continue
            s, e = self._span(i, num_tokens)
            self._put_chunk(keys[i], kv[:, :, :, s - start:e - start, :], meta=self._meta(i, len(keys), s, e))
            stored.append(i)
        self.histograms.observe("kvfabric_store_seconds", time.perf_counter() - started, "store")
        num_tokens_stored = sum(e - s for s, e in (self._span(i, num_tokens) for i in stored))
        c = self._counters
        c.add("stores")
        c.add("store_tokens", end - start)
        c.add("store_chunks", len(wanted))
        c.add("chunks_stored", len(stored))
        c.add("tokens_stored", num_tokens_stored)
        if self.events is not None and stored:
            self._announce(tokens, keys, stored)
        return len(stored)

    def _announce(self, tokens: Tokens, keys: list[ChunkKey], stored: list[int]) -> None:
        """KV events for newly stored chunks, one BlockStored per run of consecutive chunks."""
        ids = tokens.tolist() if isinstance(tokens, (torch.Tensor, np.ndarray)) else list(tokens)
        run: list[int] = []
        for i in [*stored, -1]:
            if run and i != run[-1] + 1:
                first, last = run[0], run[-1]
                self.events.stored([keys[j] for j in run], keys[first - 1] if first else None,
                                   ids[self._span(first, len(ids))[0]:self._span(last, len(ids))[1]])
                run = []
            run.append(i)

    @staticmethod
    def _meta(i: int, num_chunks: int, start: int, end: int) -> AccessMeta:
        """What the tiers' policies learn about chunk i (tokens [start, end)) of a prompt of num_chunks chunks."""
        return AccessMeta(i, num_chunks, end - start, prefill_cost_s(start, end))

    def _held(self, keys: list[bytes]) -> list[bool]:
        """Whether a writable tier holds each chunk (both parts of a split chunk: one whose window part is gone is
        stored again, else its hits would stay short)."""
        held = self.stack.contains_many(keys, writable_only=True)
        if self._parts is None:
            return held
        windows = self.stack.contains_many([self._parts.window_key(k) for k in keys], writable_only=True)
        return [a and b for a, b in zip(held, windows)]

    def _put_chunk(self, key: bytes, kv: torch.Tensor, blob: Blob | None = None, meta: AccessMeta = NO_META) -> None:
        """Store one chunk's KV [L, 2, H, C, D] under `key`, whole or as its two parts (chunk_parts)."""
        if self._parts is None:
            self._put_part(key, kv, blob, meta, self.layout)
            return
        full, window = self._parts.split(kv)
        self._put_part(key, full, None, meta, self._parts.full)
        self._put_part(self._parts.window_key(key), window, None, meta, self._parts.window)

    def _put_part(self, key: bytes, kv: torch.Tensor, blob: Blob | None, meta: AccessMeta, layout: KVLayout) -> None:
        """Store kv [L', 2, H, C, D] of `layout` under `key`: encoded once with the engine's codec (or `blob`, that
        encoding made by the caller) and once more for each other codec a tier the chunk goes to asks for. A raw
        blob is written into a buffer from the first tier (process memory recycles them: no page faults) and
        left unsealed: the stack fills its checksums in only if it is written beyond process memory."""
        if blob is None:
            if isinstance(self.codec, RawCodec):
                out = self.stack.new_blob(HEADER_BYTES + layout.num_bytes(kv.shape[3]))
                blob = self._encode(self.codec, kv, key, layout, out=out, with_checksums=False)
            else:
                blob = self._encode(self.codec, kv, key, layout)
        encoded: dict[int, Blob] = {}  # id(codec) -> blob: tiers sharing a codec share one encoding
        per_level: dict[int, Blob] = {}
        for level, codec in self._tier_codecs.items():
            if level not in self.stack.levels.store:
                continue  # exclusive placement: this tier only gets chunks demoted to it (as they are)
            if id(codec) not in encoded:
                encoded[id(codec)] = self._encode(codec, kv, key, layout)
            per_level[level] = encoded[id(codec)]
        self.stack.put(key, blob, per_level, meta)

    def _encode(self, codec: Codec, kv: torch.Tensor, key: bytes, layout: KVLayout, **options) -> Blob:
        started = time.perf_counter()
        blob = codec.encode(kv, key, layout, **options)
        self.histograms.observe("kvfabric_codec_encode_seconds", time.perf_counter() - started, codec.name)
        return blob

    def new_payload(self, num_tokens: int | None = None, blocks: BlockLayout | None = None) -> ChunkPayload:
        """Where the caller lays out one chunk's KV [L, 2, H, T, D] (T = num_tokens, default chunk_size) for
        `store_chunk`: with the raw codec, the payload region of the blob that will be stored (uninitialized).
        With `blocks`, where the engine stores such payloads (raw codec, chunks stored whole), the payload is in
        that block layout (`ChunkPayload.blocks` says whether it is)."""
        num_tokens = num_tokens or self.chunk_size
        if self.codec.codec_id == RawCodec.codec_id and self._parts is None:
            size = HEADER_BYTES + payload_bytes(self.layout, num_tokens, blocks)
            blob, kv = new_payload(self.layout, num_tokens, self.stack.new_blob(size), blocks)
            return ChunkPayload(kv, blob, blocks, num_tokens if blocks is not None else 0)
        return ChunkPayload(torch.empty(self.layout.shape(num_tokens), dtype=self.layout.torch_dtype), None)

    def premap(self, num_tokens: int | None = None, blocks: BlockLayout | None = None, is_paused: bool = False) -> None:
        """Payloads like `new_payload(num_tokens, blocks)` will be asked for: map their memory ahead, off the caller's
        thread, while not `is_paused` (pause it while the caller's hot work runs: a vLLM forward). `num_tokens` 0:
        only pause or resume. (The cpu tier's `premap` bytes; a fresh buffer costs far more than a copy.)"""
        size = 0
        if num_tokens != 0 and self.codec.codec_id == RawCodec.codec_id and self._parts is None:
            size = HEADER_BYTES + payload_bytes(self.layout, num_tokens or self.chunk_size, blocks)
        self.stack.premap(size, is_paused)

    def store_chunk(self, key: bytes, payload: ChunkPayload) -> bool:
        """Store a chunk laid out in `new_payload()` under `key`; False when a writable tier already holds it.
        The payload belongs to the engine from here on: the caller must not write into it again."""
        return self.store_chunks([(key, payload)])[0]

    def store_chunks(self, items: Sequence[tuple[bytes, ChunkPayload]]) -> list[bool]:
        """`store_chunk` for each (key, payload), with one batched check of what the tiers hold."""
        held = self._held([key for key, _ in items])
        return [not is_held and self._store_new(key, payload) for (key, payload), is_held in zip(items, held)]

    def _store_new(self, key: bytes, payload: ChunkPayload) -> bool:
        started = time.perf_counter()
        num_tokens = payload.num_tokens
        if payload.blob is not None:  # the stack seals it if it leaves memory
            seal(payload.blob, key, self.layout, False, num_tokens, payload.blocks)
        kv = payload.kv
        if payload.blocks is not None and self._tier_codecs:  # another codec encodes [L, 2, H, T, D]
            kv = self._decoders.view(parse(payload.blob, key, is_trusted=True), payload.blob, self.layout, num_tokens)
        self._put_chunk(key, kv, payload.blob)
        self.histograms.observe("kvfabric_store_seconds", time.perf_counter() - started, "store_chunk")
        for name, n in (("chunks_stored", 1), ("tokens_stored", num_tokens), ("store_chunks", 1),
                        ("store_tokens", num_tokens)):
            self._counters.add(name, n)
        if self.events is not None:
            self.events.stored([key], None, [])  # the caller knows the key only
        return True

    @property
    def chunk_parts(self) -> ChunkParts | None:
        """How a chunk is split into stored parts (None: stored whole)."""
        return self._parts

    def read_chunk(self, key: bytes, out: torch.Tensor | None = None, *, num_tokens: int | None = None,
                   scratch: Scratch | None = None, promote: bool = True, window: bool = True,
                   in_place: bool = False, blocks: BlockLayout | None = None,
                   check_later: bool = False) -> ChunkHit | ChunkMiss:
        """One chunk by key. With `out` [L, 2, H, T, D] (any float dtype, T the chunk's tokens) it is decoded
        into `out`. Without, `kv` holds num_tokens (default chunk_size) tokens in the layout dtype: a raw chunk
        is a zero-copy view, over `scratch` when the first tier reads into it (valid until the caller reuses
        `scratch`) or over the stored blob (read it, never write it); other codecs decode into a new tensor.
        `promote=False`: a chunk found below the first tier is not copied into the faster tiers, and every tier
        reads into `scratch` (no fresh allocation: for a caller that copies the KV elsewhere right away).
        `window=False` on a split layout: the full-attention part only, kv [Lf, 2, H, T, D] (`out` of that shape)
        and `layers` = its layers; the window part is not read.
        `in_place=True` (with promote=False, no `out`): a raw chunk in a tier that reads in place (the shm pool)
        is verified and viewed where it lies, with no copy at all; the caller copies kv where it goes and then
        calls `hit.is_intact()`, which is False when a writer reused that memory meanwhile (a miss, after the
        fact). The copy out of the pool into `scratch` is the one this saves: for P/D, a whole transfer's worth.
        `blocks` / `check_later`: see the module docstring (block layouts on reads)."""
        started = time.perf_counter()
        num_tokens = out.shape[3] if out is not None else num_tokens or self.chunk_size
        if self._parts is None:
            raw_ok = blocks is not None and out is None
            found = self.stack.get(key, scratch, promote=promote, in_place=in_place and out is None,
                                   verify_payload=not (raw_ok and check_later),
                                   ranged=raw_ok and check_later and scratch is not None)
            if found is not None and found.ranged is not None and (found.header.blocks != blocks or
                                                                   found.header.codec_id != RawCodec.codec_id):
                found = _whole(found, scratch)  # not for a copy of blocks: read it all, checked below
            if found is not None and raw_ok and found.header.blocks == blocks and \
                    found.header.codec_id == RawCodec.codec_id:
                result = self._take_blocks(key, found, num_tokens, scratch)
            else:
                checked = self._checked(key, found)
                result = checked if isinstance(checked, ChunkMiss) else self._take(key, checked, num_tokens, out)
        elif not window:
            result = self._take(key, self.stack.get(key, scratch, promote=promote), num_tokens, out, self._parts.full)
            if isinstance(result, ChunkHit):
                result = ChunkHit(result.kv, result.tier, result.num_bytes, self._parts.full_layers)
        else:
            result = self._read_parts(key, out, num_tokens, scratch, promote)
        self.histograms.observe("kvfabric_retrieve_seconds", time.perf_counter() - started, "read_chunk")
        self._counters.add("chunk_reads")
        self._counters.add("chunk_read_requests")
        if isinstance(result, ChunkHit):
            self._counters.add("chunk_read_hits")
        return result

    def read_chunks(self, keys: Sequence[bytes], scratches: Sequence[Scratch]) -> list[ChunkHit | ChunkMiss]:
        """Whole chunks by key, each read into its own `scratch` and viewed there (`read_chunk(key, scratch=...,
        promote=False)` for each), with one batch call per tier: for a caller that copies each chunk elsewhere at
        once and reads many (the SGLang backend's host pages). Layouts whose chunks are stored whole only."""
        if self._parts is not None:
            raise ValueError("read_chunks: this layout stores its chunks in parts (use read_chunk)")
        started = time.perf_counter()
        found = self.stack.get_many(keys, scratches)
        results = [self._take(key, hit, self.chunk_size, None) for key, hit in zip(keys, found)]
        self.histograms.observe("kvfabric_retrieve_seconds", time.perf_counter() - started, "read_chunks")
        self._counters.add("chunk_reads")
        self._counters.add("chunk_read_requests", len(keys))
        self._counters.add("chunk_read_hits", sum(isinstance(r, ChunkHit) for r in results))
        return results

    def chunk_blob_bytes(self) -> int:
        """Bytes of one whole chunk's blob with the raw codec (header + payload): the size a read buffer needs."""
        return HEADER_BYTES + self.layout.num_bytes(self.chunk_size)

    def _read_parts(self, key: bytes, out: torch.Tensor | None, num_tokens: int, scratch: Scratch | None,
                    promote: bool) -> ChunkHit | ChunkMiss:
        """read_chunk of a split chunk: both parts, joined into out (or a new tensor) [L, 2, H, T, D]."""
        parts = self._parts
        whole = out if out is not None else torch.empty(self.layout.shape(num_tokens), dtype=self.layout.torch_dtype)
        num_bytes, tier = 0, ""
        for part_key, layout, put in ((key, parts.full, parts.put_full),
                                      (parts.window_key(key), parts.window, parts.put_window)):
            part = torch.empty(layout.shape(num_tokens), dtype=whole.dtype)
            got = self._take(part_key, self.stack.get(part_key, scratch, promote=promote), num_tokens, part, layout)
            if isinstance(got, ChunkMiss):
                return got
            put(whole, part)
            num_bytes, tier = num_bytes + got.num_bytes, tier or got.tier
        return ChunkHit(whole, tier, num_bytes)

    def _checked(self, key: bytes, found: StackHit | None) -> StackHit | ChunkMiss | None:
        """found, its payload verified now if the read left that to us; a miss (discarded) when it fails."""
        if found is None or found.is_verified:
            return found
        try:
            check_payload(found.blob, found.header)
        except ChunkFormatError as exc:
            if found.view is not None and not found.view.is_current():
                return _MISSING  # rewritten while we checked it: not damage
            self.discard_chunk(key, found.tier, str(exc))
            return ChunkMiss("corrupt")
        return found

    def _take_blocks(self, key: bytes, found: StackHit, num_tokens: int,
                     scratch: Scratch | None) -> ChunkHit | ChunkMiss:
        """A raw chunk in the caller's block layout, as it is (unverified payload: its sum goes to the caller);
        from a ranged tier, read layer by layer into `scratch` when the caller asks (`ChunkHit.slab`)."""
        kv, reader, size = None, None, len(found.blob)
        try:
            if found.ranged is None:
                kv = self._decoders.block_view(found.header, found.blob, self.layout, num_tokens)
            else:
                self._decoders.check_blocks(found.header, self.layout, num_tokens)
                reader, size = SlabReader(found.ranged, found.header, self.layout, scratch), found.ranged.size
        except ChunkFormatError as exc:
            if found.ranged is not None:
                found.ranged.close()
            log.warning("dropping undecodable chunk %s from tier %s: %s", key.hex()[:16], found.tier, exc)
            self.stack.discard(key)
            return ChunkMiss("wrong_layout" if isinstance(exc, WrongLayoutError) else "corrupt")
        return ChunkHit(kv, found.tier, size, view=found.view, blocks=found.header.blocks,  # type: ignore[arg-type]
                        unchecked_sum=None if found.is_verified else found.header.payload_sum, reader=reader)

    def discard_chunk(self, key: bytes, tier: str, why: str) -> None:
        """Drop a chunk a caller found damaged (e.g. its payload did not hash to `ChunkHit.unchecked_sum`): counted
        as `corrupt.<tier>`, as a damaged chunk found by a read is."""
        log.warning("dropping damaged chunk %s from tier %s: %s", key.hex()[:16], tier, why)
        self.stack.discard(key, damaged_in=tier)

    def _take(self, key: bytes, found: StackHit | None, num_tokens: int, out: torch.Tensor | None,
              layout: KVLayout | None = None) -> ChunkHit | ChunkMiss:
        """The checked, decoded chunk of a stack read (in `layout`, default the engine's), or a miss; a chunk that
        fails its checks is discarded."""
        if found is None:
            return _MISSING
        layout = layout or self.layout
        started = time.perf_counter()
        try:
            if out is None:
                kv = self._decoders.view(found.header, found.blob, layout, num_tokens)
            else:
                self._decoders.decode(found.header, found.blob, layout, out)
                kv = out
            self.histograms.observe("kvfabric_codec_decode_seconds", time.perf_counter() - started,
                                    _codec_name(found.header.codec_id))
        except ChunkFormatError as exc:
            log.warning("dropping undecodable chunk %s from tier %s: %s", key.hex()[:16], found.tier, exc)
            self.stack.discard(key)
            return ChunkMiss("wrong_layout" if isinstance(exc, WrongLayoutError) else "corrupt")
        return ChunkHit(kv, found.tier, len(found.blob), view=found.view)

    def retrieve(self, tokens: Tokens, out: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens = len(tokens)
        keys = self.keys(tokens)
        out = retrieve_buffer(self.layout, num_tokens, out)
        num_done = num_chunks = 0
        started = time.perf_counter()
        parts = self._parts
        pinned = keys if parts is None else [*keys, *map(parts.window_key, keys)]
        with self.stack.pinned(pinned), self.stack.load_permit() as permit:
            if parts is not None:  # the window parts a hit of the whole prompt needs
                first = parts.first_live_chunk(num_tokens, self.chunk_size)
                self.stack.prefetch([parts.window_key(k) for k in keys[first:]])
            # a split chunk's full part is decoded here, then copied into its layers of out: one buffer per load
            part = None if parts is None else torch.empty(parts.full.shape(self.chunk_size), dtype=out.dtype)
            for i, found in enumerate(self._fetch_ahead(keys, num_tokens, permit)):
                s, e = self._span(i, num_tokens)
                if isinstance(self._take_into(keys[i], found, out[:, :, :, s:e, :], part), ChunkMiss):
                    break
                num_done, num_chunks = e, i + 1
            if parts is not None and num_chunks:
                num_chunks = self._load_windows(keys, num_chunks, num_tokens, out, permit)
                num_done = self._span(num_chunks - 1, num_tokens)[1] if num_chunks else 0
        elapsed = time.perf_counter() - started
        self.histograms.observe("kvfabric_retrieve_seconds", elapsed, "retrieve")
        c = self._counters
        c.add("retrieves")
        c.add("retrieve_tokens", num_tokens)
        c.add("tokens_retrieved", num_done)
        c.add("retrieve_chunks", len(keys))
        c.add("retrieve_hit_chunks", num_chunks)
        c.add("retrieve_ns", int(elapsed * 1e9))
        return out[:, :, :, :num_done, :]

    def _take_into(self, key: bytes, found: StackHit | None, out: torch.Tensor,
                   buffer: torch.Tensor | None) -> ChunkHit | ChunkMiss:
        """Decode a chunk read by retrieve into out [L, 2, H, T, D]: whole, or a split chunk's full part (decoded
        into buffer [Lf, 2, H, >= T, D] first)."""
        if self._parts is None:
            return self._take(key, found, out.shape[3], out)
        part = buffer[:, :, :, :out.shape[3]]
        got = self._take(key, found, out.shape[3], part, self._parts.full)
        if isinstance(got, ChunkHit):
            self._parts.put_full(out, part)
        return got

    def _load_windows(self, keys: Sequence[bytes], num_chunks: int, num_tokens: int, out: torch.Tensor,
                      permit) -> int:
        """Read the window parts a prefix of num_chunks chunks needs into out, zero the window rows before them;
        returns the chunks of the prefix served (fewer when a needed window part is missing or fails its checks)."""
        parts, scratch = self._parts, Scratch()
        buffer = torch.empty(parts.window.shape(self.chunk_size), dtype=out.dtype)  # one per load, as above
        num_read = 0

        def read(chunks: Sequence[int]) -> list[bool]:
            nonlocal num_read
            found = []
            for i in chunks:
                s, e = self._span(i, num_tokens)
                key = parts.window_key(keys[i])
                part = buffer[:, :, :, :e - s]
                got = self._take(key, self.stack.get(key, scratch, self._meta(i, len(keys), s, e), permit), e - s,
                                 part, parts.window)
                if isinstance(got, ChunkHit):
                    parts.put_window(out[:, :, :, s:e, :], part)
                found.append(isinstance(got, ChunkHit))
                num_read += 1
            return found

        served = parts.live_prefix(num_chunks, num_tokens, self.chunk_size, read)
        end = self._span(served - 1, num_tokens)[1] if served else 0
        first_live = parts.first_live_chunk(end, self.chunk_size)
        parts.zero_window_rows(out, first_live * self.chunk_size)
        self._counters.add("window_parts_read", num_read)
        self._counters.add("window_parts_skipped", first_live)
        return served

    def _fetch_ahead(self, keys: Sequence[bytes], num_tokens: int, permit) -> Iterator[StackHit | None]:
        """Yield stack.get(key) for each key in order (with each chunk's AccessMeta, under the load's slow-read
        permit). A chunk not in process memory is read one step ahead by the reader thread (file or network
        I/O and its checksum overlap the decoding of the previous chunk); two scratch buffers alternate, so the
        one being decoded is never the one being filled. Chunks in memory are taken directly: a thread
        hand-off would cost more than the dict lookup. A chunk read by a slow tier is hashed here (`confirm`), after
        the next chunk's read has started: the reader thread reads back to back, the disk never waits on a hash."""
        if not hasattr(self._scratch, "pair"):
            self._scratch.pair = (Scratch(), Scratch())
        pair = self._scratch.pair
        metas = [self._meta(i, len(keys), *self._span(i, num_tokens)) for i in range(len(keys))]
        ahead: Future | None = None
        # Read-ahead hints (disk: posix_fadvise) for READ_AHEAD_BYTES past the chunk being read, not for the whole
        # prompt: hinted at once, the kernel reads the files side by side and the first chunk arrives late. Small
        # chunks gain from hints; chunks as large as the window get none: a hinted read competes with the read in
        # progress (docs/benchmarks.md, bench tiers, has the figures). When hints are given, the first chunk is
        # hinted too: a peer tier's prefetch is its fetch, in the order asked (see P2P).
        num_hinted = READ_AHEAD_BYTES // max(1, self.layout.num_bytes(self.chunk_size))
        if num_hinted:
            self.stack.prefetch(keys[:num_hinted + 1])
        try:
            for i, key in enumerate(keys):
                if num_hinted and i + num_hinted + 1 < len(keys):
                    self.stack.prefetch(keys[i + num_hinted + 1:i + num_hinted + 2])
                current = ahead.result() if ahead is not None else \
                    self.stack.get(key, pair[i % 2], metas[i], permit, verify_payload=False)
                ahead = None
                if current is not None and i + 1 < len(keys) and not self.stack.is_in_memory(keys[i + 1]):
                    started = threading.Event()
                    ahead = self._reader.submit(self._read_unverified, keys[i + 1], pair[(i + 1) % 2],
                                                metas[i + 1], permit, started)
                    # the hash below holds the GIL: a reader not yet in its read would wait for it
                    started.wait()
                if current is not None and not self.stack.confirm(key, current, metas[i]):  # a lower tier's copy?
                    current = self.stack.get(key, pair[i % 2], metas[i], permit, from_level=current.level + 1)
                if current is None:
                    yield None
                    return
                yield current
        finally:
            if ahead is not None:
                ahead.result()  # never leave a read in flight into a buffer the next call reuses

    def _read_unverified(self, key: bytes, scratch: Scratch, meta: AccessMeta, permit,
                         started: threading.Event) -> StackHit | None:
        started.set()
        return self.stack.get(key, scratch, meta, permit, verify_payload=False)

    def delete(self, tokens: Tokens) -> int:
        """Remove the chunks of `tokens` from every tier; returns how many chunks some tier held."""
        keys = self.keys(tokens)
        held = self.stack.delete(keys)  # queued writes of these keys are cancelled
        if self._parts is not None:
            self.stack.delete([self._parts.window_key(k) for k in keys])
        if self.events is not None:
            self.events.removed(held)
        return len(held)

    def flush(self, *, to_peers: bool = False) -> None:
        self.stack.flush()
        if to_peers and self.node is not None and not self.node.flush_reports(self.config.cluster.fetch_timeout_s):
            log.warning("kvfabric: the controller does not know this instance's latest chunks yet")

    def _tier(self, name: str) -> Tier:
        for tier in self.stack.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier {name!r} in this engine ({', '.join(t.name for t in self.stack.tiers)})")

    def tier_keys(self, name: str) -> list[bytes]:
        """The keys the tier called `name` holds."""
        return self._tier(name).keys()

    def tier_usage(self, name: str) -> TierUsage:
        return self._tier(name).usage()

    def clear_tier(self, name: str) -> None:
        """Empty one tier (e.g. process memory, so that the next read is served by a slower tier)."""
        self._tier(name).clear()

    def stats(self) -> EngineStats:
        tiers = self.stack.tiers
        tier_counters = {t.name: c.snapshot() for t in tiers if isinstance(c := getattr(t, "counters", None), Counters)}
        breakers = {t.name: b.is_open for t in tiers if (b := getattr(t, "breaker", None)) is not None}
        return EngineStats(merged(self._counters, self.stack.counters), tuple(t.usage() for t in tiers),
                           tier_counters, breakers, self.stack.queue_depth, self.stack.queue_capacity,
                           self.node.p2p_counters() if self.node is not None else {},
                           self.events.counters.snapshot() if self.events is not None else {})

    def sweep_events(self) -> None:
        """Queue removal events for tracked chunks that no writable tier holds any more (evicted, expired, deleted
        elsewhere); the engine's own publisher does this by itself, a caller that takes `events` calls it."""
        if self.events is not None:
            self.events.sweep(self.holds)

    def holds(self, keys: list[bytes]) -> list[bool]:
        """Whether a writable tier holds each chunk (an event publisher's sweep asks)."""
        return self.stack.contains_many(keys, writable_only=True)

    def summary(self) -> dict[str, int]:
        """A few cumulative counts (the cluster node sends them with its heartbeats, for the controller's page)."""
        c = merged(self._counters, self.stack.counters)
        evictions = sum(t.counters.get("evicted") for t in self.stack.tiers
                        if isinstance(getattr(t, "counters", None), Counters))
        errors = sum(v for k, v in c.items() if k.startswith(("corrupt.", "failed_writes")) or k == "dropped_writes")
        return {"lookup_tokens": c.get("lookup_tokens", 0), "hit_tokens": c.get("lookup_hit_tokens", 0),
                "retrieved_tokens": c.get("tokens_retrieved", 0), "stored_chunks": c.get("chunks_stored", 0),
                "evictions": evictions, "errors": errors + c.get("discarded", 0)}

    def close(self) -> None:
        for observer in (self.metrics_endpoint, self.publisher):
            if observer is not None:
                observer.close()
        self._reader.shutdown(wait=True)
        if self.node is not None:
            self.node.close()  # stop serving and reporting first: the stack then closes the tiers
        self.stack.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_CODEC_NAMES = {entry.codec_id: entry.name for entry in CODECS}


def _codec_name(codec_id: int) -> str:
    return _CODEC_NAMES.get(codec_id, str(codec_id))
