"""CacheEngine: the in-process cache. Token ids in, KV tensors in and out; chunking, keys and tiers inside.

Contract (the `KVCache` protocol of kvfabric.cache.protocol, in full, plus `TierAdmin`):
- `lookup(tokens)`: the longest prefix, in tokens, whose chunks are all cached (chunk-aligned, or the whole prompt
  when its partial last chunk is cached with `save_partial_chunk`), every part a load of it needs included. It
  reads no chunk data. `lookup_keys(keys, num_tokens)`: the same by chunk keys, in chunks (`KeyLookup`).
- `store(tokens, kv, start=0)`: kv [L, 2, H, T, D] holds the KV of tokens[start:start+T] (start chunk-aligned);
  every whole chunk in that range not yet cached is stored (kvfabric.cache.writes). It returns once the fastest
  tier holds the chunks; slower tiers are written in the background. `flush()` waits for those writes;
  `flush(to_peers=True)` with tier "peer" also for the controller to know what the served tiers hold (bounded by
  `cluster.fetch_timeout_s`), so that a peer's lookup right after finds it.
- `retrieve(tokens, out=None)`: KV of the longest retrievable prefix (kvfabric.cache.retrieve).
- Chunks by key: `read_into`, `read_chunk`, `open_chunk`, `read_many` (kvfabric.cache.reads: verified KV or a
  miss, the check inside the cache); `new_payload` + `store_chunks`, `premap`, `paused` (kvfabric.cache.writes);
  `holds(keys)`: whether a writable tier holds every part of each chunk.
- A chunk has a shape (kvfabric.kv.shapes): stored whole, or split into parts under derived keys (sliding-window
  layouts); every call above takes and gives whole chunks, the parts are the engine's business.
- `delete(tokens)` removes a prompt's chunks from every tier; `tier_keys`, `tier_usage`, `clear_tier` address one
  tier by name; `stats()` is an `EngineStats` snapshot. For the server process on the same host (kvfabric.server):
  `contains`, `pinned`/`pin`/`unpin`, `prefetch` and `store_blob`.
- Observability (kvfabric.observe): lookup / store / retrieve / read latencies and codec times go into
  `histograms`; given `events`, chunk stored / removed events are queued there. The /metrics endpoint, the ZMQ
  publisher and the cluster node of tier "peer" are made by kvfabric.cache.builder and attached.
- Nothing here raises for a damaged or missing cache entry (a chunk that fails its checks is dropped, counted and
  a miss; a source that fails while copied raises ChunkFailed to its reader); errors are raised only for bad
  arguments. Counters are thread-safe; reads and writes may run on different threads.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence

import torch

from kvfabric.cache.core import EngineCore
from kvfabric.cache.protocol import (
    ChunkHit,
    ChunkMiss,
    ChunkPayload,
    EngineStats,
    KeyLookup,
    PeerNode,
    Read,
    Tokens,
    TokenSource,
)
from kvfabric.cache.reads import ChunkReads
from kvfabric.cache.retrieve import Retriever
from kvfabric.cache.writes import Writes
from kvfabric.codec.base import Codec, LatentCodecError, check_codec
from kvfabric.codec.raw import blob_bytes
from kvfabric.codec.registry import CodecChoice, parse_codec
from kvfabric.config import Config, ConfigError
from kvfabric.host.pages import Scratch
from kvfabric.kv.blocks import BlockLayout
from kvfabric.kv.hashing import ChunkKey, KeySpace
from kvfabric.kv.layout import KVLayout
from kvfabric.kv.shapes import ChunkShape
from kvfabric.kv.shares import Share, shape_of
from kvfabric.observe.counters import Counters, merged
from kvfabric.observe.events import ChunkEvents, EventPublisher
from kvfabric.observe.metrics import MetricsEndpoint
from kvfabric.tiers.base import Blob, Tier, TierUsage
from kvfabric.tiers.factory import build_tiers, codec_spec
from kvfabric.tiers.stack import TierStack

log = logging.getLogger(__name__)


class CacheEngine:
    def __init__(self, config: Config | None, layout: KVLayout, model_id: str,
                 tiers: Sequence[Tier] | None = None, *, node: PeerNode | None = None,
                 events: ChunkEvents | None = None, share: Share | None = None,
                 parallel: tuple[int, int] = (1, 1)) -> None:
        """`layout`: the model's (keys are the model's, whatever share this engine holds). `tiers`: the stack,
        fastest first (default: the local tiers the config names). `node`: the cluster node composed with those
        tiers (tier "peer"), closed with the engine; `events`: where stored / removed chunks are queued. `share`: a
        parallel engine rank's share of the model's KV (kvfabric.kv.shares; None: the whole model), `parallel` its
        engine's (pp_size, tp_size). `kvfabric.cache.builder.build_engine` composes all of it from the config."""
        self.config = config = config or Config()
        shape = shape_of(layout, share, parallel)
        self.layout = shape.layout  # what this engine's tensors hold: the model's, or its share's
        self.model_id = model_id
        self.chunk_size = config.chunk_size
        self.key_space = KeySpace.of(model_id, layout, self.chunk_size, config.salt, config.hash,
                                     config.save_partial_chunk)
        tier_names = config.tiers if tiers is None else [tier.name for tier in tiers]
        for spec in [config.codec, *filter(None, (codec_spec(config, name) for name in tier_names))]:
            try:  # before any tier is made: nothing to close on the way out
                check_codec(parse_codec(spec), layout)
            except LatentCodecError as exc:
                raise ConfigError(f"codec: {exc}") from None
        if tiers is None:
            if "peer" in config.tiers:
                raise ValueError("tier 'peer' needs a cluster node: build the engine with "
                                 "kvfabric.cache.builder.build_engine(config, layout, model_id)")
            tiers = build_tiers(config, config.tiers)
        self.node = node
        self.stack = TierStack(tiers, config.write_queue_chunks, config.placement)  # for tests' and benches' eyes
        self.core = EngineCore(config, self.layout, shape, self.stack)
        self.histograms = self.core.histograms
        self.events = events
        codec = parse_codec(config.codec).make()
        self._reads = ChunkReads(self.core)
        self._writes = Writes(self.core, self.key_space, codec, self._tier_codecs(codec), events)
        self._retriever = Retriever(self.core, self.key_space, self._reads.from_alternatives)
        self.metrics_endpoint: MetricsEndpoint | None = None  # serving this engine's /metrics (attach_observers)
        self.publisher: EventPublisher | None = None  # publishing `events` on ZMQ (attach_observers)
        if node is not None:  # last: the node's reporting thread is already running and may ask at once
            node.stats_source = self.summary

    def _tier_codecs(self, codec: Codec) -> dict[int, Codec]:
        """Stack level -> its codec, for tiers whose config names another than the engine's (e.g. raw in process
        memory, cachegen on the network tiers); blobs are self-describing, so reads never need to know."""
        codecs: dict[CodecChoice, Codec] = {parse_codec(self.config.codec): codec}
        by_level: dict[int, Codec] = {}
        for level, tier in enumerate(self.stack.tiers):
            spec = codec_spec(self.config, tier.name)
            if not spec:
                continue
            parsed = parse_codec(spec)
            if parsed not in codecs:
                codecs[parsed] = parsed.make()
            if codecs[parsed] is not codec:
                by_level[level] = codecs[parsed]
        return by_level

    def attach_observers(self, metrics_endpoint: MetricsEndpoint | None = None,
                         publisher: EventPublisher | None = None) -> None:
        """What a builder made around this engine once it existed (they read its stats and tiers): closed with the
        engine, before its tiers."""
        self.metrics_endpoint = metrics_endpoint or self.metrics_endpoint
        self.publisher = publisher or self.publisher

    @property
    def shape(self) -> ChunkShape:
        """How a chunk of this layout is stored (kvfabric.kv.shapes)."""
        return self.core.shape

    # ---- keys and lookups --------------------------------------------------------------------------------
    def keys(self, tokens: Tokens) -> list[ChunkKey]:
        return self.key_space.keys(tokens)

    def lookup(self, tokens: Tokens) -> int:
        c = self.core
        started = time.perf_counter()
        keys = self.keys(tokens)
        num_hit = self.prefix(keys, len(tokens))
        c.histograms.observe("kvfabric_lookup_seconds", time.perf_counter() - started)
        found = c.span(num_hit - 1, len(tokens))[1] if num_hit else 0
        for name, n in (("lookups", 1), ("lookup_tokens", len(tokens)), ("lookup_hit_tokens", found),
                        ("lookup_chunks", len(keys)), ("lookup_hit_chunks", num_hit)):
            c.counters.add(name, n)
        return found

    def lookup_keys(self, keys: Sequence[bytes], num_tokens: int | None = None) -> KeyLookup:
        """`lookup` by chunk keys (a connector's own key scheme in this namespace too) of a prompt of num_tokens
        tokens (default: whole chunks): the same rule, every part included. No chunk data is read."""
        num_chunks = self.prefix(keys, num_tokens)
        for name, n in (("lookups", 1), ("lookup_chunks", len(keys)), ("lookup_hit_chunks", num_chunks)):
            self.core.counters.add(name, n)
        first = self.shape.parts[0]  # what the first read of a chunk asks for (a share's own part)
        return KeyLookup(num_chunks, sum(self.stack.is_in_memory(first.key(k)) for k in keys[:num_chunks]))

    def prefix(self, keys: Sequence[bytes], num_tokens: int | None = None) -> int:
        """The leading chunks of `keys` a load can read, every part it needs included (the shape decides), of a
        prompt of num_tokens (default: whole chunks); uncounted (the server asks it for its clients' lookups)."""
        return self.shape.prefix(keys, num_tokens or len(keys) * self.chunk_size, self.chunk_size,
                                 self.stack.contains_many)

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        return self._writes.held(keys)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether some tier, a read-only one (a peer) included, holds what a read of each chunk needs."""
        return self.shape.present(keys, self.stack.contains_many)

    # ---- writes (kvfabric.cache.writes) ------------------------------------------------------------------
    def store(self, tokens: Tokens, kv: torch.Tensor, start: int = 0) -> int:
        return self._writes.store(tokens, kv, start)

    def new_payload(self, num_tokens: int | None = None, blocks: BlockLayout | None = None) -> ChunkPayload:
        return self._writes.new_payload(num_tokens, blocks)

    def store_chunks(self, items: Sequence[tuple[bytes, ChunkPayload]]) -> list[bool]:
        return self._writes.store_chunks(items)

    def premap(self, num_tokens: int | None = None, blocks: BlockLayout | None = None) -> None:
        self._writes.premap(num_tokens, blocks)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return self._writes.paused()

    def store_blob(self, key: bytes, blob: Blob) -> bool:
        """A whole chunk's blob made elsewhere (a KV stream's, kvfabric.codec.format), stored as it is; False for a
        layout stored in parts (store its KV instead)."""
        if not self.shape.is_whole:
            return False
        self.stack.put(key, blob)
        return True

    # ---- reads (kvfabric.cache.reads, kvfabric.cache.retrieve) -------------------------------------------
    def retrieve(self, tokens: Tokens, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._retriever.retrieve(tokens, out)

    def read_into(self, key: bytes, out: torch.Tensor) -> ChunkHit | ChunkMiss:
        got = self._reads.read_into(key, out)
        return got if isinstance(got, ChunkMiss) else ChunkHit(*got)

    def read_chunk(self, key: bytes, num_tokens: int | None = None, *, blocks: BlockLayout | None = None,
                   layers: Sequence[int] | None = None, scratch: Scratch | None = None) -> Read:
        return self._reads.read(key, num_tokens or self.chunk_size, blocks, layers, scratch, is_open=False)

    def open_chunk(self, key: bytes, num_tokens: int | None = None, *, blocks: BlockLayout | None = None,
                   layers: Sequence[int] | None = None, scratch: Scratch | None = None) -> Read:
        return self._reads.read(key, num_tokens or self.chunk_size, blocks, layers, scratch, is_open=True)

    def read_many(self, keys: Sequence[bytes], scratches: Sequence[Scratch]) -> list[TokenSource | ChunkMiss]:
        return self._reads.read_many(keys, scratches)

    def chunk_blob_bytes(self) -> int:
        """Bytes of one whole chunk's blob with the raw codec (header, payload, head table): the size a read buffer needs."""
        return blob_bytes(self.layout, self.chunk_size)

    # ---- for the host's server (kvfabric.server) ---------------------------------------------------------
    @contextlib.contextmanager
    def pinned(self, keys: Sequence[bytes]) -> Iterator[None]:
        """Chunks no tier of this process evicts while the block runs (every part)."""
        with self.stack.pinned([k for part in self.shape.parts for k in map(part.key, keys)]):
            yield

    def pin(self, keys: Sequence[bytes]) -> None:
        for tier in self.stack.tiers:
            tier.pin([k for part in self.shape.parts for k in map(part.key, keys)])

    def unpin(self, keys: Sequence[bytes]) -> None:
        for tier in self.stack.tiers:
            tier.unpin([k for part in self.shape.parts for k in map(part.key, keys)])

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """A hint that these chunks will be read soon (slow tiers start reading)."""
        self.stack.prefetch([k for part in self.shape.parts for k in map(part.key, keys)])

    # ---- tier administration -----------------------------------------------------------------------------
    def delete(self, tokens: Tokens) -> int:
        """Remove the chunks of `tokens` from every tier; returns how many chunks some tier held."""
        keys = self.keys(tokens)
        first, *others = self.shape.parts
        stored = [first.key(k) for k in keys]
        gone = set(self.stack.delete(stored))  # queued writes of these keys are cancelled
        held = [key for key, part in zip(keys, stored) if part in gone]  # events name chunks, not parts
        for part in others:
            self.stack.delete([part.key(k) for k in keys])
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
        breakers = {t.name: bool(getattr(t, "is_breaker_open", b.is_open))  # a tier with several breakers: any
                    for t in tiers if (b := getattr(t, "breaker", None)) is not None}
        return EngineStats(merged(self.core.counters, self.stack.counters), tuple(t.usage() for t in tiers),
                           tier_counters, breakers, self.stack.queue_depth, self.stack.queue_capacity,
                           self.node.p2p_counters() if self.node is not None else {},
                           self.events.counters.snapshot() if self.events is not None else {})

    def sweep_events(self) -> None:
        """Queue removal events for tracked chunks that no writable tier holds any more (evicted, expired, deleted
        elsewhere); the engine's own publisher does this by itself, a caller that takes `events` calls it."""
        if self.events is not None:
            self.events.sweep(self.holds)

    def summary(self) -> dict[str, int]:
        """A few cumulative counts (the cluster node sends them with its heartbeats, for the controller's page)."""
        c = merged(self.core.counters, self.stack.counters)
        evictions = sum(tc.get("evicted") for t in self.stack.tiers
                        if isinstance(tc := getattr(t, "counters", None), Counters))
        errors = sum(v for k, v in c.items() if k.startswith(("corrupt.", "failed_writes")) or k == "dropped_writes")
        return {"lookup_tokens": c.get("lookup_tokens", 0), "hit_tokens": c.get("lookup_hit_tokens", 0),
                "retrieved_tokens": c.get("tokens_retrieved", 0), "stored_chunks": c.get("chunks_stored", 0),
                "evictions": evictions, "errors": errors + c.get("discarded", 0)}

    def close(self) -> None:
        for observer in (self.metrics_endpoint, self.publisher):
            if observer is not None:
                observer.close()
        self._retriever.close()
        if self.node is not None:
            self.node.close()  # stop serving and reporting first: the stack then closes the tiers
        self.stack.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
