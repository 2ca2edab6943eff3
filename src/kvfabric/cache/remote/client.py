"""RemoteCache: the KVCache protocol (kvfabric.cache.protocol) served by `kvfabric server` (config `mode: server`).

Contract (what differs from CacheEngine; the rest is the same: token ids in, KV in and out, chunk keys computed
here with the same root, so in-process and server engines name chunks alike):
- Data moves through the server's shared-memory pool (remote/pool.py). `retrieve` copies each chunk once, from its
  pool slot straight into `out` (dense, any float dtype), while the server decodes the next chunk into the next
  slot; `read_into` copies one chunk the same way. `read_chunk` / `open_chunk` give a `TokenSource` viewing the
  slot, leased until the source's exit (where this client already holds its slot cap, the slot is copied into
  `scratch` and let go at once); the server verified the chunk, so the source has nothing left to check. The
  server stores token-major chunks: `blocks` is moot, the source is a TokenSource of every layer.
- `store` copies each chunk once into a leased slot and commits it; the server encodes and persists in the
  background. `new_payload` hands out a leased slot when one is free (else private memory); `store_chunks` commits
  it. A payload whose lease was lost is not stored (counted): its slot may have been reused.
- Faults never reach the caller: a server that is down, refuses us, misbehaves or misses a request's deadline
  (`server.timeout_s`) makes the call a miss (lookup 0, retrieve a shorter prefix of valid KV, store 0, a read
  ChunkMiss("missing")), and for `server.retry_s` every call is a miss without trying (remote/sessions.py).
  Errors are raised only for bad arguments.
- A parallel engine's rank (`share`, `parallel`: kvfabric.kv.shares) has the server keep its share's namespace:
  keys stay the model's, tensors hold the share, and the server's reads put a missing share together from what
  another parallel shape stored. A server whose answer does not hold this client's share in its slots
  (`slot_layout`: one older than shares) is not used: every call a miss, counted as `server_errors`.
- Thread-safe: up to MAX_CONNECTIONS connections, each used by one thread at a time.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfabric.cache.protocol import (
    ChunkHit,
    ChunkMiss,
    ChunkPayload,
    EngineStats,
    KeyLookup,
    Read,
    Tokens,
    TokenSource,
    chunks_to_store,
    retrieve_buffer,
)
from kvfabric.cache.remote import wire as P
from kvfabric.cache.remote.connection import Connection
from kvfabric.cache.remote.reads import RemoteReads
from kvfabric.cache.remote.sessions import MAX_CONNECTIONS, Down, Sessions
from kvfabric.codec.raw import blob_bytes
from kvfabric.config import Config
from kvfabric.host.pages import Scratch
from kvfabric.kv.blocks import BlockLayout
from kvfabric.kv.hashing import ChunkKey, KeySpace
from kvfabric.kv.layout import KVLayout
from kvfabric.kv.shares import Share, shape_of
from kvfabric.net.framing import ProtocolError
from kvfabric.observe.counters import Counters, merged
from kvfabric.observe.events import ChunkEvents
from kvfabric.observe.metrics import Histograms
from kvfabric.tiers.base import TierUsage

__all__ = ["MAX_CONNECTIONS", "RemoteCache", "StreamFetch"]
_MISSING = ChunkMiss("missing")


@dataclass(slots=True)
class _Copied:
    """A retrieve's progress: chunks copied into its buffer so far (mutable: a failing call must not lose it)."""
    num_chunks: int = 0


@dataclass(frozen=True, slots=True)
class StreamFetch:
    num_chunks: int  # leading chunks that arrived as KV, now decoded in the server's pool and stored in its tiers
    num_tokens: int  # tokens of the streamed prompt
    wire_bytes: int
    decode_s: float  # the server's decode time
    seconds: float  # the whole fetch, as the server saw it


class RemoteCache:
    def __init__(self, config: Config | None, layout: KVLayout, model_id: str, *, name: str | None = None,
                 share: Share | None = None, parallel: tuple[int, int] = (1, 1)) -> None:
        """`layout`: the model's (keys are the model's). `share`: a parallel engine rank's share of the model's KV
        (None: the whole model), `parallel` its engine's (pp_size, tp_size): the server keeps that share's own
        namespace, and this client's tensors hold the share (as CacheEngine's with the same arguments)."""
        self.config = config or Config()
        self.settings = self.config.server
        self.layout = shape_of(layout, share, parallel).layout  # a share of a window model is refused here
        self.model_id = model_id
        self.chunk_size = self.config.chunk_size
        self.key_space = KeySpace.of(model_id, layout, self.chunk_size, self.config.salt, self.config.hash,
                                     self.config.save_partial_chunk)
        hello = {"name": name or f"{Path(sys.argv[0] or 'python').name}-{os.getpid()}", "pid": os.getpid(),
                 "model_id": model_id, "chunk_size": self.chunk_size, "hash": self.config.hash,
                 "salt": self.config.salt, "session": secrets.token_bytes(8),
                 "layout": P.slot_layout(layout), "parallel": list(parallel)}
        if share is not None:
            hello["share"] = [*share.layers, *share.heads, share.is_writer]
        self._counters = Counters()
        self._sessions = Sessions(self.settings, hello, self._counters, P.slot_layout(self.layout))
        self.histograms = Histograms()  # this client's lookup / retrieve / store latencies, as CacheEngine's
        self.events: ChunkEvents | None = None  # chunk events come from the server's tiers, not from here
        self._payloads: dict[int, tuple[Connection, int, weakref.finalize]] = {}  # id(payload kv) -> its lease
        self._reads = RemoteReads(self._sessions, self.layout)

    # ---- keys --------------------------------------------------------------------------------------------
    def keys(self, tokens: Tokens) -> list[ChunkKey]:
        return self.key_space.keys(tokens)

    def _span(self, i: int, num_tokens: int) -> tuple[int, int]:
        return i * self.chunk_size, min((i + 1) * self.chunk_size, num_tokens)

    def _counts(self, first: int, num_chunks: int, num_tokens: int) -> list[int]:
        """Tokens of chunks first, first + 1, ... of a prompt of num_tokens."""
        return [e - s for s, e in (self._span(i, num_tokens) for i in range(first, first + num_chunks))]

    def _slot(self, slot: int, num_tokens: int) -> torch.Tensor:
        """A pool slot's KV [L, 2, H, num_tokens, D] (a view of the server's pool)."""
        assert self._sessions.pool is not None
        return self._sessions.pool.tensor(slot, self.layout, num_tokens)

    # ---- API ---------------------------------------------------------------------------------------------
    def lookup(self, tokens: Tokens) -> int:
        started = time.perf_counter()
        num_hit = self.lookup_keys(self.keys(tokens)).num_chunks
        self.histograms.observe("kvfabric_lookup_seconds", time.perf_counter() - started)
        return self._span(num_hit - 1, len(tokens))[1] if num_hit else 0

    def lookup_keys(self, keys: Sequence[bytes], num_tokens: int | None = None) -> KeyLookup:
        """How many leading chunks of `keys` the server holds (any key scheme in this namespace: a connector's
        own keys too); none when it is down. (num_in_memory is 0: this process holds nothing.)"""
        self._counters.add("lookups")
        try:
            with self._sessions.session() as conn:
                return KeyLookup(P.int_of(conn.call(P.LOOKUP, {"keys": list(keys)}), "chunks", upper=len(keys) + 1))
        except Down:
            return KeyLookup()

    def retrieve(self, tokens: Tokens, out: torch.Tensor | None = None) -> torch.Tensor:
        started = time.perf_counter()
        num_tokens = len(tokens)
        keys = self.keys(tokens)
        out = retrieve_buffer(self.layout, num_tokens, out)
        done = _Copied()  # chunks copied into out; kept when the server goes away mid-call
        try:
            while done.num_chunks < len(keys):
                with self._sessions.session() as conn:
                    batch = keys[done.num_chunks:done.num_chunks + max(1, Sessions.room(conn))]
                    got, stop = self._read_into(conn, batch, num_tokens, out, done)
                if got < len(batch) and not (got and stop in ("pool_full", "busy")):
                    break  # a miss; a pool short of slots (others hold them) only shrinks the batch
        except Down:
            pass  # what was copied stays: each chunk was whole in its slot when the server answered it
        num_done = done.num_chunks
        end = self._span(num_done - 1, num_tokens)[1] if num_done else 0
        self._counters.add("retrieves")
        self._counters.add("tokens_retrieved", end)
        self.histograms.observe("kvfabric_retrieve_seconds", time.perf_counter() - started, "retrieve")
        return out[:, :, :, :end, :]

    def _read_into(self, conn: Connection, keys: Sequence[bytes], num_tokens: int, out: torch.Tensor,
                   done: _Copied) -> tuple[int, str]:
        """RETRIEVE `keys` (chunks done.num_chunks, ... of the request) and copy each slot into `out` as its answer
        arrives, counting it in `done` at once (a call that fails later keeps it): the chunks copied, and why the
        server stopped."""
        leased: list[int] = []
        first = done.num_chunks

        def on_chunk(body: dict) -> None:
            slot = P.int_of(body, "slot")
            leased.append(slot)
            if P.int_of(body, "i") != done.num_chunks - first:
                raise ProtocolError("chunks out of order")
            s, e = self._span(done.num_chunks, num_tokens)
            out[:, :, :, s:e, :].copy_(self._slot(slot, e - s))
            done.num_chunks += 1

        try:
            reply = conn.call(P.RETRIEVE, {"keys": list(keys), "tokens": self._counts(first, len(keys), num_tokens)},
                              on_chunk)
        finally:
            conn.release(leased)
            with contextlib.suppress(OSError):
                conn.flush_releases()
        return done.num_chunks - first, str(reply.get("miss", ""))

    # ---- chunks by key (remote/reads.py) -----------------------------------------------------------------
    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        return self._reads.holds(keys)

    def read_into(self, key: bytes, out: torch.Tensor) -> ChunkHit | ChunkMiss:
        return self._reads.read_into(key, out)

    def read_chunk(self, key: bytes, num_tokens: int | None = None, *, blocks: BlockLayout | None = None,
                   layers: Sequence[int] | None = None, scratch: Scratch | None = None) -> Read:
        return self._reads.read_chunk(key, num_tokens or self.chunk_size, scratch)

    def open_chunk(self, key: bytes, num_tokens: int | None = None, *, blocks: BlockLayout | None = None,
                   layers: Sequence[int] | None = None, scratch: Scratch | None = None) -> Read:
        """read_chunk: the server verified the chunk already, a view of its slot is the fastest read there is."""
        return self._reads.read_chunk(key, num_tokens or self.chunk_size, scratch)

    def read_many(self, keys: Sequence[bytes], scratches: Sequence[Scratch]) -> list[TokenSource | ChunkMiss]:
        return self._reads.read_many(keys, scratches, self.chunk_size)

    def store(self, tokens: Tokens, kv: torch.Tensor, start: int = 0) -> int:
        started = time.perf_counter()
        num_tokens = len(tokens)
        keys = self.keys(tokens)
        wanted = chunks_to_store(self.layout, self.chunk_size, num_tokens, len(keys), kv, start)
        num_stored = 0
        try:
            while wanted:
                with self._sessions.session() as conn:
                    batch, wanted = wanted[:max(1, Sessions.room(conn))], wanted[max(1, Sessions.room(conn)):]
                    spans = [self._span(i, num_tokens) for i in batch]
                    num_stored += self._write(conn, [keys[i] for i in batch],
                                              [kv[:, :, :, s - start:e - start, :] for s, e in spans])
        except Down:
            pass
        self._counters.add("chunks_stored", num_stored)
        self.histograms.observe("kvfabric_store_seconds", time.perf_counter() - started, "store")
        return num_stored

    def _write(self, conn: Connection, keys: list[bytes], chunks: list[torch.Tensor]) -> int:
        """Lease a slot for each key the server lacks, copy the chunk in, commit: the chunks stored."""
        reply = conn.call(P.LEASE, {"keys": keys, "tokens": [c.shape[3] for c in chunks]})
        slots = reply.get("slots")
        if not isinstance(slots, list) or len(slots) != len(keys):
            raise ProtocolError("LEASE answer does not match the request")
        todo = [(key, slot, chunk) for key, slot, chunk in zip(keys, slots, chunks) if slot is not None]
        if not all(type(slot) is int for _, slot, _ in todo):
            raise ProtocolError("LEASE answer names a slot that is not an integer")
        conn.num_leased += len(todo)
        for _, slot, chunk in todo:
            self._slot(slot, chunk.shape[3]).copy_(chunk)
        return self._commit(conn, [t[0] for t in todo], [t[1] for t in todo], [t[2].shape[3] for t in todo])

    def _commit(self, conn: Connection, keys: list[bytes], slots: list[int], counts: list[int]) -> int:
        if not keys:
            return 0
        conn.num_leased -= len(slots)  # committed or not, the server takes the slots back
        return P.int_of(conn.call(P.COMMIT, {"keys": keys, "slots": slots, "tokens": counts}), "stored")

    def chunk_blob_bytes(self) -> int:
        """Bytes of one whole chunk's blob with the raw codec (header, payload, head table), as CacheEngine.chunk_blob_bytes."""
        return blob_bytes(self.layout, self.chunk_size)

    def premap(self, num_tokens: int | None = None, blocks: BlockLayout | None = None) -> None:
        """Nothing to map ahead here: the server's pool is mapped when it starts."""

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing premaps here, so nothing to hold back."""
        yield

    def new_payload(self, num_tokens: int | None = None, blocks: BlockLayout | None = None) -> ChunkPayload:
        """Where the caller lays out one chunk's KV for `store_chunks`: a leased pool slot when this client has
        room (so the store needs no further copy), else private memory. Always token-major (`blocks` is moot:
        ChunkPayload.blocks stays None)."""
        num_tokens = num_tokens or self.chunk_size
        try:
            with self._sessions.session() as conn:
                if Sessions.room(conn) > 1:
                    slots = conn.call(P.LEASE, {"tokens": [num_tokens]}).get("slots")
                    if isinstance(slots, list) and len(slots) == 1 and type(slots[0]) is int:
                        conn.num_leased += 1
                        kv = self._slot(slots[0], num_tokens)
                        done = weakref.finalize(kv, self._sessions.orphan, conn, slots[0])
                        self._payloads[id(kv)] = (conn, slots[0], done)
                        return ChunkPayload(kv, None)
        except Down:
            pass
        return ChunkPayload(torch.empty(self.layout.shape(num_tokens), dtype=self.layout.torch_dtype), None)

    def store_chunks(self, items: Sequence[tuple[bytes, ChunkPayload]]) -> list[bool]:
        return [self._store_chunk(key, payload) for key, payload in items]

    def _store_chunk(self, key: bytes, payload: ChunkPayload) -> bool:
        held = self._payloads.pop(id(payload.kv), None)
        try:
            if held is None:
                with self._sessions.session() as conn:
                    stored = self._write(conn, [key], [payload.kv])
            else:
                conn, slot, done = held
                done.detach()
                with self._sessions.session(conn) as conn:
                    stored = self._commit(conn, [key], [slot], [payload.kv.shape[3]])
        except Down:
            self._counters.add("store_lost" if held is not None else "store_missed")
            return False
        self._counters.add("chunks_stored", stored)
        return bool(stored)

    # ---- server-side work --------------------------------------------------------------------------------
    def fetch_stream(self, host: str, port: int, timeout_s: float = 60.0) -> StreamFetch | None:
        """Have the server receive a KV stream (kvfabric.stream) from host:port, decode it into its pool and store
        it; then `retrieve` the prompt to copy it here. None when the server cannot."""
        try:
            with self._sessions.session() as conn:
                r = conn.call(P.FETCH_STREAM, {"host": host, "port": port, "timeout_ms": int(timeout_s * 1000)},
                              timeout_s=timeout_s + self.settings.timeout_s)
        except Down:
            return None
        return StreamFetch(P.int_of(r, "chunks"), P.int_of(r, "tokens"), P.int_of(r, "wire_bytes", upper=1 << 62),
                           float(r.get("decode_s", 0.0)), float(r.get("seconds", 0.0)))

    def _simple(self, op: int, body: dict, default: dict, timeout_s: float | None = None) -> dict:
        try:
            with self._sessions.session() as conn:
                return conn.call(op, body, timeout_s=timeout_s)
        except Down:
            return default

    def prefetch(self, tokens: Tokens) -> int:
        """Have the server decode the prompt's cached chunks into its pool ahead of a retrieve; chunks ready."""
        keys = self.keys(tokens)
        body = {"keys": keys, "tokens": self._counts(0, len(keys), len(tokens))}
        return int(self._simple(P.PREFETCH, body, {"chunks": 0}).get("chunks", 0))

    def pin(self, tokens: Tokens) -> int:
        return int(self._simple(P.PIN, {"keys": self.keys(tokens)}, {"chunks": 0}).get("chunks", 0))

    def unpin(self, tokens: Tokens) -> int:
        return int(self._simple(P.UNPIN, {"keys": self.keys(tokens)}, {"chunks": 0}).get("chunks", 0))

    def sweep_events(self) -> None:
        """Nothing to do: chunk events come from the server's tiers (`events` is None here)."""

    def flush(self, *, to_peers: bool = False) -> None:
        """Wait until the server has persisted this namespace's committed stores (slow tiers included); what the
        server's own tiers announce to a cluster is the server's business (`to_peers`: as CacheEngine.flush)."""
        self._simple(P.FLUSH, {}, {}, timeout_s=max(30.0, self.settings.timeout_s))

    def is_connected(self) -> bool:
        return self._simple(P.PING, {}, {"ok": False}).get("ok") is True

    def stats(self) -> EngineStats:
        reply = self._simple(P.STATS, {}, {})
        server = {f"server.{k}": int(v) for k, v in (reply.get("counters") or {}).items() if type(v) is int}
        tiers = tuple(TierUsage(str(t[0]), int(t[1]), int(t[2]), int(t[3])) for t in reply.get("tiers") or ()
                      if isinstance(t, list) and len(t) == 4)
        return EngineStats(merged(self._counters, server), tiers)

    def close(self) -> None:
        self._payloads.clear()
        self._sessions.close()

    def __enter__(self) -> RemoteCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

