"""RemoteCache: CacheEngine's public seam, served by `kvfabric server` (config `mode: server`).

Contract (what differs from CacheEngine; the rest is the same: token ids in, KV in and out, chunk keys computed
here with the same root, so in-process and server engines name chunks alike):
- Data moves through the server's shared-memory pool (remote/pool.py). `retrieve` copies each chunk once, from its
  pool slot straight into `out` (dense, any float dtype), while the server decodes the next chunk into the next
  slot. `read_chunk` returns a zero-copy view of the slot, leased until the caller passes the same `scratch`
  again (or drops it, or closes this cache); with `out`, without `scratch`, or when this client already holds its
  slot cap, it copies and releases at once. `store` copies each chunk once into a leased slot and commits it; the
  server encodes and persists in the background. `new_payload` hands out a leased slot when one is free (else
  private memory); `store_chunk` commits it. A payload whose lease was lost is not stored (counted): its slot may
  have been reused.
- Faults never reach the caller: a server that is down, refuses us, misbehaves or misses a request's deadline
  (`server.timeout_s`) makes the call a miss (lookup 0, retrieve a shorter prefix of valid KV, store 0, read_chunk
  ChunkMiss("missing")), and for `server.retry_s` every call is a miss without trying; then the next call
  reconnects (a restarted server's new pool is mapped then). Errors are raised only for bad arguments.
- Thread-safe: up to MAX_CONNECTIONS connections, each used by one thread at a time.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfabric.blocks import BlockLayout
from kvfabric.codec.format import HEADER_BYTES
from kvfabric.config import Config
from kvfabric.counters import Counters, merged
from kvfabric.framing import ProtocolError
from kvfabric.hashing import ChunkKey, KeySpace
from kvfabric.kvcache import (ChunkHit, ChunkMiss, ChunkPayload, EngineStats, KeyLookup, Tokens, chunks_to_store,
                              retrieve_buffer)
from kvfabric.layout import KVLayout
from kvfabric.metrics import Histograms
from kvfabric.pages import Scratch
from kvfabric.remote import protocol as P
from kvfabric.remote.connection import Connection, RemoteError
from kvfabric.remote.pool import PoolError, SlotPool
from kvfabric.tiers.base import TierUsage

MAX_CONNECTIONS = 4
_MISSING = ChunkMiss("missing")


class _Down(Exception):
    """The server cannot serve this call: the caller answers a miss."""


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
    def __init__(self, config: Config | None, layout: KVLayout, model_id: str, *, name: str | None = None) -> None:
        self.config = config or Config()
        self.settings = self.config.server
        self.layout = layout
        self.model_id = model_id
        self.chunk_size = self.config.chunk_size
        self.key_space = KeySpace.of(model_id, layout, self.chunk_size, self.config.salt, self.config.hash,
                                     self.config.save_partial_chunk)
        self._hello = {"name": name or f"{Path(sys.argv[0] or 'python').name}-{os.getpid()}", "pid": os.getpid(),
                       "model_id": model_id, "chunk_size": self.chunk_size, "hash": self.config.hash,
                       "salt": self.config.salt, "session": secrets.token_bytes(8),
                       "layout": [layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
                                  *(["latent"] if layout.is_latent else [])]}
        self._conns: list[Connection] = []
        self._lock = threading.Lock()
        self._pool: SlotPool | None = None
        self._down_until = 0.0
        self._counters = Counters()
        self.histograms = Histograms()  # this client's lookup / retrieve / store latencies, as CacheEngine's
        self.events = None  # chunk events come from the server's tiers, not from here (CacheEngine.events: none)
        self._views: dict[int, tuple[Connection, int, weakref.finalize]] = {}  # id(scratch) -> its leased slot
        self._orphans: list[tuple[Connection, int]] = []  # leases whose holder was garbage-collected

    # ---- keys --------------------------------------------------------------------------------------------
    def keys(self, tokens: Tokens) -> list[ChunkKey]:
        return self.key_space.keys(tokens)

    def _span(self, i: int, num_tokens: int) -> tuple[int, int]:
        return i * self.chunk_size, min((i + 1) * self.chunk_size, num_tokens)

    def _counts(self, first: int, num_chunks: int, num_tokens: int) -> list[int]:
        """Tokens of chunks first, first + 1, ... of a prompt of num_tokens."""
        return [e - s for s, e in (self._span(i, num_tokens) for i in range(first, first + num_chunks))]

    # ---- connections -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _session(self, conn: Connection | None = None) -> Iterator[Connection]:
        """A connection for one call; a failure marks the server down for retry_s and raises _Down."""
        if conn is None and time.monotonic() < self._down_until:
            self._counters.add("server_down_calls")
            raise _Down
        started = time.perf_counter_ns()
        held: Connection | None = None
        try:
            held = self._take(conn)
            self._release_orphans(held)
            yield held
        except RemoteError as exc:
            self._counters.add("server_refusals")
            raise _Down from exc
        except (OSError, ProtocolError, PoolError, ValueError) as exc:  # TimeoutError is an OSError
            self._failed(held, exc)
            raise _Down from exc
        finally:
            if held is not None:
                held.lock.release()
            self._counters.add("client_ns", time.perf_counter_ns() - started)

    def _take(self, wanted: Connection | None) -> Connection:
        if wanted is not None:
            if wanted not in self._conns:
                raise ProtocolError("the connection holding this lease is gone")
            wanted.lock.acquire()
            return wanted
        with self._lock:
            for conn in self._conns:
                if conn.lock.acquire(blocking=False):
                    return conn
            if len(self._conns) < MAX_CONNECTIONS:
                conn = self._open()
                conn.lock.acquire()
                self._conns.append(conn)
                return conn
            conn = self._conns[len(self._conns) - 1]
        conn.lock.acquire()
        return conn

    def _open(self) -> Connection:
        conn = Connection.open(self.settings, self._hello)
        try:
            pool_id = P.bytes_of(conn.info, "pool_id", 16)
            if self._pool is None or self._pool.pool_id != pool_id:  # first contact or a restarted server
                for old in self._conns:
                    old.close()
                self._conns.clear()
                self._pool = SlotPool.open(P.text_of(conn.info, "pool", max_len=4096), pool_id)
                self._counters.add("server_connects")
        except BaseException:
            conn.close()
            raise
        return conn

    def _failed(self, conn: Connection | None, exc: BaseException) -> None:
        self._counters.add("server_errors")
        self._down_until = time.monotonic() + self.settings.retry_s
        if conn is not None and not isinstance(exc, TimeoutError):  # a timeout leaves the stream in sync
            conn.close()
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)

    def _release_orphans(self, conn: Connection) -> None:
        with self._lock:
            mine = [slot for c, slot in self._orphans if c is conn]
            self._orphans = [(c, slot) for c, slot in self._orphans if c is not conn and c in self._conns]
        conn.release(mine)

    def _orphan(self, conn: Connection, slot: int) -> None:
        with self._lock:
            self._orphans.append((conn, slot))

    def _room(self, conn: Connection) -> int:
        return max(0, int(conn.info.get("max_slots", 1)) - conn.num_leased)

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
            with self._session() as conn:
                return KeyLookup(P.int_of(conn.call(P.LOOKUP, {"keys": list(keys)}), "chunks", upper=len(keys) + 1))
        except _Down:
            return KeyLookup()

    def retrieve(self, tokens: Tokens, out: torch.Tensor | None = None) -> torch.Tensor:
        started = time.perf_counter()
        num_tokens = len(tokens)
        keys = self.keys(tokens)
        out = retrieve_buffer(self.layout, num_tokens, out)
        done = _Copied()  # chunks copied into out; kept when the server goes away mid-call
        try:
            while done.num_chunks < len(keys):
                with self._session() as conn:
                    batch = keys[done.num_chunks:done.num_chunks + max(1, self._room(conn))]
                    got, stop = self._read_into(conn, batch, num_tokens, out, done)
                if got < len(batch) and not (got and stop in ("pool_full", "busy")):
                    break  # a miss; a pool short of slots (others hold them) only shrinks the batch
        except _Down:
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
            out[:, :, :, s:e, :].copy_(self._pool.tensor(slot, self.layout, e - s))  # type: ignore[union-attr]
            done.num_chunks += 1

        try:
            reply = conn.call(P.RETRIEVE, {"keys": list(keys), "tokens": self._counts(first, len(keys), num_tokens)},
                              on_chunk)
        finally:
            conn.release(leased)
            with contextlib.suppress(OSError):
                conn.flush_releases()
        return done.num_chunks - first, str(reply.get("miss", ""))

    def read_chunk(self, key: bytes, out: torch.Tensor | None = None, *, num_tokens: int | None = None,
                   scratch: Scratch | None = None, promote: bool = True, window: bool = True,
                   in_place: bool = False, blocks: BlockLayout | None = None,
                   check_later: bool = False) -> ChunkHit | ChunkMiss:
        """CacheEngine.read_chunk through the server, with its call shape (the vLLM loader passes every keyword;
        `blocks` and `check_later` are moot: the server stores token-major chunks and verifies what it serves):
        the server's own engine decides promotion between its tiers; `window=False` still gets the whole chunk
        (every layer: a superset of what the caller needs); `in_place` is moot, the slot is already a view of
        the server's pool that this process holds until it lets the slot go."""
        num_tokens = out.shape[3] if out is not None else num_tokens or self.chunk_size
        if scratch is not None:
            self._drop_view(scratch)
        answer: dict = {}
        try:
            with self._session() as conn:
                keep = out is None and scratch is not None and self._room(conn) > 1
                reply = conn.call(P.RETRIEVE, {"keys": [key], "tokens": [num_tokens]}, answer.update)
                if not answer:
                    return ChunkMiss(reply.get("miss") if reply.get("miss") in ("corrupt", "wrong_layout")
                                     else "missing")
                slot = P.int_of(answer, "slot")
                view = self._pool.tensor(slot, self.layout, num_tokens)  # type: ignore[union-attr]
                if keep:
                    assert scratch is not None
                    done = weakref.finalize(scratch, self._orphan, conn, slot)
                    self._views[id(scratch)] = (conn, slot, done)
                    kv = view
                else:
                    kv = self._copy_out(view, out, scratch)
                    conn.release([slot])
                    conn.flush_releases()
        except _Down:
            return _MISSING
        return ChunkHit(kv, str(answer.get("tier", "server")), int(answer.get("bytes", 0)))

    def _copy_out(self, view: torch.Tensor, out: torch.Tensor | None, scratch: Scratch | None) -> torch.Tensor:
        if out is not None:
            return out.copy_(view)
        if scratch is None:
            return view.clone()
        flat = torch.frombuffer(scratch.view(view.numel() * view.element_size()), dtype=view.dtype)
        return flat.view(view.shape).copy_(view)

    def _drop_view(self, scratch: Scratch) -> None:
        held = self._views.pop(id(scratch), None)
        if held is not None:
            conn, slot, done = held
            done.detach()
            self._orphan(conn, slot)

    def store(self, tokens: Tokens, kv: torch.Tensor, start: int = 0) -> int:
        started = time.perf_counter()
        num_tokens = len(tokens)
        keys = self.keys(tokens)
        wanted = chunks_to_store(self.layout, self.chunk_size, num_tokens, len(keys), kv, start)
        num_stored = 0
        try:
            while wanted:
                with self._session() as conn:
                    batch, wanted = wanted[:max(1, self._room(conn))], wanted[max(1, self._room(conn)):]
                    spans = [self._span(i, num_tokens) for i in batch]
                    num_stored += self._write(conn, [keys[i] for i in batch],
                                              [kv[:, :, :, s - start:e - start, :] for s, e in spans])
        except _Down:
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
            self._pool.tensor(slot, self.layout, chunk.shape[3]).copy_(chunk)  # type: ignore[union-attr]
        return self._commit(conn, [t[0] for t in todo], [t[1] for t in todo], [t[2].shape[3] for t in todo])

    def _commit(self, conn: Connection, keys: list[bytes], slots: list[int], counts: list[int]) -> int:
        if not keys:
            return 0
        conn.num_leased -= len(slots)  # committed or not, the server takes the slots back
        return P.int_of(conn.call(P.COMMIT, {"keys": keys, "slots": slots, "tokens": counts}), "stored")

    def chunk_blob_bytes(self) -> int:
        """Bytes of one whole chunk's blob with the raw codec (header + payload), as CacheEngine.chunk_blob_bytes."""
        return HEADER_BYTES + self.layout.num_bytes(self.chunk_size)

    def premap(self, num_tokens: int | None = None, blocks: BlockLayout | None = None, is_paused: bool = False) -> None:
        """Nothing to map ahead here: the server's pool is mapped when it starts."""

    def new_payload(self, num_tokens: int | None = None, blocks: BlockLayout | None = None) -> ChunkPayload:
        """Where the caller lays out one chunk's KV for `store_chunk`: a leased pool slot when this client has
        room (so the store needs no further copy), else private memory. Always token-major (`blocks` is moot:
        ChunkPayload.blocks stays None)."""
        num_tokens = num_tokens or self.chunk_size
        try:
            with self._session() as conn:
                if self._room(conn) > 1:
                    slots = conn.call(P.LEASE, {"tokens": [num_tokens]}).get("slots")
                    if isinstance(slots, list) and len(slots) == 1 and type(slots[0]) is int:
                        conn.num_leased += 1
                        kv = self._pool.tensor(slots[0], self.layout, num_tokens)  # type: ignore[union-attr]
                        self._views[id(kv)] = (conn, slots[0], weakref.finalize(kv, self._orphan, conn, slots[0]))
                        return ChunkPayload(kv, None)
        except _Down:
            pass
        return ChunkPayload(torch.empty(self.layout.shape(num_tokens), dtype=self.layout.torch_dtype), None)

    def store_chunk(self, key: bytes, payload: ChunkPayload) -> bool:
        held = self._views.pop(id(payload.kv), None)
        try:
            if held is None:
                with self._session() as conn:
                    stored = self._write(conn, [key], [payload.kv])
            else:
                conn, slot, done = held
                done.detach()
                with self._session(conn) as conn:
                    stored = self._commit(conn, [key], [slot], [payload.kv.shape[3]])
        except _Down:
            self._counters.add("store_lost" if held is not None else "store_missed")
            return False
        self._counters.add("chunks_stored", stored)
        return bool(stored)

    # ---- server-side work --------------------------------------------------------------------------------
    def fetch_stream(self, host: str, port: int, timeout_s: float = 60.0) -> StreamFetch | None:
        """Have the server receive a KV stream (kvfabric.stream) from host:port, decode it into its pool and store
        it; then `retrieve` the prompt to copy it here. None when the server cannot."""
        try:
            with self._session() as conn:
                r = conn.call(P.FETCH_STREAM, {"host": host, "port": port, "timeout_ms": int(timeout_s * 1000)},
                              timeout_s=timeout_s + self.settings.timeout_s)
        except _Down:
            return None
        return StreamFetch(P.int_of(r, "chunks"), P.int_of(r, "tokens"), P.int_of(r, "wire_bytes", upper=1 << 62),
                           float(r.get("decode_s", 0.0)), float(r.get("seconds", 0.0)))

    def _simple(self, op: int, body: dict, default: dict, timeout_s: float | None = None) -> dict:
        try:
            with self._session() as conn:
                return conn.call(op, body, timeout_s=timeout_s)
        except _Down:
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

    def discard_chunk(self, key: bytes, tier: str, why: str) -> None:
        """Nothing to do: the server verifies what it serves (read_chunk's check_later is moot here)."""

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
        with self._lock:
            conns, self._conns = self._conns, []
            self._views.clear()
            self._orphans.clear()
        for conn in conns:
            conn.close()  # the server reclaims every slot these connections leased
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RemoteCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
