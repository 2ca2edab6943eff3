"""What the server does for each request: lookups, reads decoded into pool slots, leased writes persisted in the
background, prefetch, pins, stats. The socket side (listener.py) calls `connect`, `handle` and `disconnect`.

Contract:
- A client is one connection, bound at HELLO to one namespace (namespaces.py). Its leases (slots.py) are capped
  at `server.max_slots_per_client`; committed chunks waiting to be encoded and persisted at
  `server.max_store_queue` (beyond: dropped and counted, never waited for). Nothing one client does makes another
  wait for it: reads and decodes run on the requesting connection's thread (at most as many at once as the server
  has cores), encodes on a pool sized to the cores.
- RETRIEVE: for each key in order, a READY slot is leased, or a slot is allocated, the chunk read from the tiers
  and decoded straight into it (checksums verified; a damaged chunk is discarded and ends the read); a CHUNK
  answer names the slot as soon as it is ready. The read stops at the first miss, a full pool, the client's cap
  or the request's deadline; the final REPLY says how many chunks were sent and why it stopped.
- LEASE then COMMIT: a chunk the client wrote into a leased slot becomes READY at commit (visible to every
  client at once) and is encoded with the server's codec and stored in its tiers in the background. An
  uncommitted slot (a client killed mid-write) is freed, never published.
- Bad arguments raise ProtocolError (the listener closes that connection); a request the server cannot serve now
  raises Refusal (an ERROR answer; the connection stays).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from kvfabric.cache.protocol import ChunkHit, ChunkPayload
from kvfabric.cache.remote import wire as P
from kvfabric.cache.remote.pool import SlotPool
from kvfabric.config import Config
from kvfabric.observe.counters import Counters, merged
from kvfabric.server.metrics import ServerMetrics
from kvfabric.server.namespaces import Namespace, Namespaces
from kvfabric.server.slots import Holder, SlotCapError, SlotTable

SendChunk = Callable[[dict[str, Any]], None]


class Refusal(Exception):
    """This request cannot be served now (an ERROR answer; the connection stays)."""


@dataclass(eq=False)
class Client:
    name: str
    space: Namespace
    holder: Holder
    pins: Counter[bytes] = field(default_factory=Counter)
    storing: int = 0  # committed chunks of this client not yet persisted


class Service:
    def __init__(self, config: Config, pool: SlotPool, num_cpus: int) -> None:
        self.settings = config.server
        self.pool = pool
        self.slots = SlotTable(pool.num_slots, self.settings.max_slots_per_client)
        self.spaces = Namespaces(config)
        self.metrics = ServerMetrics()
        self.counters = Counters()
        self.cpu = threading.BoundedSemaphore(num_cpus)  # decodes and encodes running at once
        self._encoder = ThreadPoolExecutor(num_cpus, thread_name_prefix="kvfabric-server-encode")
        self.decoder = ThreadPoolExecutor(num_cpus, thread_name_prefix="kvfabric-server-decode")  # stream chunks
        self._lock = threading.Lock()
        self._in_flight: dict[Namespace, set[Future]] = {}
        from kvfabric.server.streams import fetch_stream  # the stream receiver: a sibling module with its own imports
        self._ops: dict[int, Callable[[Client, dict[str, Any], float, SendChunk], dict[str, Any]]] = {
            P.LOOKUP: self.lookup, P.RETRIEVE: self.retrieve, P.LEASE: self.lease, P.COMMIT: self.commit,
            P.PREFETCH: self.prefetch, P.PIN: self.pin, P.UNPIN: self.unpin, P.STATS: self.stats,
            P.FLUSH: self.flush, P.PING: lambda *_: {"ok": True}, P.RELEASE: lambda *_: {},
            P.FETCH_STREAM: lambda c, b, d, s: fetch_stream(self, c, b, d), P.HOLDS: self.holds}

    # ---- sessions ----------------------------------------------------------------------------------------
    def connect(self, body: dict[str, Any], peer: str) -> tuple[Client, dict[str, Any]]:
        """A client bound to the namespace its HELLO names; the answer says what the namespace's pool slots hold
        (`slot_layout`: a rank's share, or the whole model), which the client checks before it uses a slot."""
        space = self.spaces.get(body)
        name = P.text_of(body, "name", peer, max_len=64) or peer
        client = Client(name, space, Holder(name))
        info = {"pool": str(self.pool.path), "pool_id": self.pool.pool_id, "slot_bytes": self.pool.slot_bytes,
                "num_slots": self.pool.num_slots, "max_slots": self.settings.max_slots_per_client,
                "slot_layout": P.slot_layout(space.layout)}
        return client, info

    def disconnect(self, client: Client) -> None:
        reclaimed = self.slots.release_all(client.holder)
        self.counters.add("slots_reclaimed", reclaimed)
        if client.pins:
            client.space.engine.unpin(list(client.pins.elements()))
        self.metrics.slots_referenced.set(self.slots.usage()["referenced"])

    def handle(self, client: Client, op: int, body: dict[str, Any], deadline: float, send: SendChunk) -> dict:
        for slot in P.ints_of(body, "release", self.pool.num_slots):
            self.slots.release(slot, client.holder)
        self.metrics.requests.labels(client.name, P.OP_NAMES[op]).inc()
        if time.monotonic() > deadline:
            raise Refusal("deadline passed before the request was served")
        return self._ops[op](client, body, deadline, send)

    # ---- reads -------------------------------------------------------------------------------------------
    def lookup(self, client: Client, body: dict, deadline: float, send: SendChunk) -> dict:
        """The leading chunks held, each committed to a slot or readable from the tiers. Runs of chunks not in the
        pool are asked of the engine as prefixes (its shape's few questions per run: a share's alternatives are
        asked for the first chunk it lacks, not for every chunk), so a miss costs what it costs in process."""
        keys = P.keys_of(body)
        num = 0
        while num < len(keys):
            if self.slots.contains(client.space.slot_key(keys[num])):
                num += 1
                continue
            found = client.space.engine.prefix(keys[num:])
            if not found:
                break
            num += found
        return {"chunks": num}

    def holds(self, client: Client, body: dict, deadline: float, send: SendChunk) -> dict:
        """Whether each chunk is held: committed to a slot, or in a writable tier of the namespace's engine."""
        keys = P.keys_of(body)
        held = client.space.engine.holds(keys)
        return {"held": [hit or self.slots.contains(client.space.slot_key(key)) for hit, key in zip(held, keys)]}

    def _counts(self, client: Client, body: dict, keys: list[bytes] | None) -> list[int]:
        """The token count of each chunk (`tokens`, parallel to `keys` when given); each must fit a slot."""
        counts = P.ints_of(body, "tokens", client.space.ident.chunk_size + 1)
        if keys is not None:
            P.same_length(keys, counts)
        if any(n == 0 or client.space.layout.num_bytes(n) > self.pool.slot_bytes for n in counts):
            raise Refusal(f"a chunk must hold 1 or more tokens and fit a slot of {self.pool.slot_bytes} bytes")
        return counts

    def retrieve(self, client: Client, body: dict, deadline: float, send: SendChunk) -> dict:
        keys = P.keys_of(body)
        counts = self._counts(client, body, keys)
        engine = client.space.engine
        num_sent, stop = 0, "done"
        with engine.pinned(keys):
            engine.prefetch([key for key in keys if not self.slots.contains(client.space.slot_key(key))])
            for i, (key, num_tokens) in enumerate(zip(keys, counts)):
                if time.monotonic() > deadline:
                    stop = "deadline"
                    break
                try:
                    found = self._lease_or_decode(client.space, key, num_tokens, client.holder)
                except SlotCapError:
                    stop = "busy"
                    break
                if isinstance(found, str):
                    stop = found
                    break
                slot, tier, num_bytes = found
                send({"i": i, "slot": slot, "tier": tier, "bytes": num_bytes})
                num_sent += 1
                self.metrics.hit_tokens.labels(client.name).inc(num_tokens)
                self.metrics.bytes.labels(client.name, "out").inc(client.space.layout.num_bytes(num_tokens))
        self.counters.add(f"retrieve_stop.{stop}")
        return {"chunks": num_sent, "miss": stop}

    def _lease_or_decode(self, space: Namespace, key: bytes, num_tokens: int,
                         holder: Holder | None) -> tuple[int, str, int] | str:
        """(slot, tier, blob bytes) of `key` decoded in a slot leased by `holder` (None: held by the server, which
        must `unhold` it), or why not: "missing", "corrupt", "wrong_layout", "pool_full"."""
        if holder is not None:
            slot = self.slots.lease(space.slot_key(key), holder)
            if slot is not None:
                self.counters.add("hit.pool")
                return slot, "pool", 0
        slot = self.slots.allocate(holder)
        if slot is None:
            self.counters.add("pool_full")
            return "pool_full"
        started = time.perf_counter()
        with self.cpu:  # the engine reads the chunk (every part of it), verifies it and decodes it into the slot
            got = space.engine.read_into(key, self.pool.tensor(slot, space.layout, num_tokens))
        self.metrics.fetch_seconds.labels("tier").observe(time.perf_counter() - started)
        if isinstance(got, ChunkHit):
            self.slots.publish(slot, space.slot_key(key))
            self.counters.add(f"hit.{got.tier}")
            return slot, got.tier, got.num_bytes
        self._drop(slot, holder)
        self.counters.add(f"miss.{got.reason}")
        return got.reason

    def _drop(self, slot: int, holder: Holder | None) -> None:
        if holder is None:
            self.slots.unhold(slot)
        else:
            self.slots.release(slot, holder)

    def prefetch(self, client: Client, body: dict, deadline: float, send: SendChunk) -> dict:
        keys = P.keys_of(body)
        counts = self._counts(client, body, keys)
        num_ready = 0
        for key, num_tokens in zip(keys, counts):
            if time.monotonic() > deadline:
                break
            if not self.slots.contains(client.space.slot_key(key)):
                found = self._lease_or_decode(client.space, key, num_tokens, None)
                if isinstance(found, str):
                    break
                self.slots.unhold(found[0])
            num_ready += 1
        return {"chunks": num_ready}

    # ---- writes ------------------------------------------------------------------------------------------
    def lease(self, client: Client, body: dict, deadline: float, send: SendChunk) -> dict:
        keys = P.keys_of(body)
        counts = self._counts(client, body, keys or None)
        present = [False] * len(counts)  # no keys: slots for payloads whose keys come at commit
        if keys:
            held = client.space.engine.holds(keys)
            present = [hit or self.slots.contains(client.space.slot_key(key)) for hit, key in zip(held, keys)]
        slots: list[int | None] = []
        for is_present in present:
            slot = None
            if not is_present:
                try:
                    slot = self.slots.lease_for_write(client.holder)
                except SlotCapError:
                    self.counters.add("lease_refused")
            slots.append(slot)
        return {"slots": slots}

    def commit(self, client: Client, body: dict, deadline: float, send: SendChunk) -> dict:
        keys = P.keys_of(body)
        slots = P.ints_of(body, "slots", self.pool.num_slots)
        counts = self._counts(client, body, keys)
        P.same_length(keys, slots)
        num_stored = 0
        for key, slot, num_tokens in zip(keys, slots, counts):
            with self._lock:
                full = client.storing >= self.settings.max_store_queue
                if not full:
                    client.storing += 1
            if full:
                self.slots.release(slot, client.holder)
                self.counters.add("store_dropped")
                continue
            if not self.slots.commit(slot, client.space.slot_key(key), client.holder):
                with self._lock:
                    client.storing -= 1
                continue
            future = self._encoder.submit(self._persist, client, key, slot, num_tokens)
            with self._lock:
                self._in_flight.setdefault(client.space, set()).add(future)
            future.add_done_callback(lambda f, space=client.space: self._done(space, f))
            self.metrics.bytes.labels(client.name, "in").inc(client.space.layout.num_bytes(num_tokens))
            num_stored += 1
        return {"stored": num_stored}

    def _persist(self, client: Client, key: bytes, slot: int, num_tokens: int) -> None:
        space = client.space
        try:
            with self.cpu:
                space.engine.store_chunks([(key, ChunkPayload(self.pool.tensor(slot, space.layout, num_tokens), None))])
            self.counters.add("chunks_persisted")
        finally:
            self.slots.unhold(slot)
            with self._lock:
                client.storing -= 1

    def _done(self, space: Namespace, future: Future) -> None:
        with self._lock:
            self._in_flight.get(space, set()).discard(future)
        if future.exception() is not None:
            self.counters.add("persist_errors")

    def flush(self, client: Client, body: dict, deadline: float, send: SendChunk) -> dict:
        with self._lock:
            pending = list(self._in_flight.get(client.space, ()))
        wait(pending, timeout=max(0.0, deadline - time.monotonic()))
        client.space.engine.flush()
        return {"ok": True}

    # ---- pins and stats ----------------------------------------------------------------------------------
    def pin(self, client: Client, body: dict, deadline: float, send: SendChunk) -> dict:
        keys = P.keys_of(body)
        client.space.engine.pin(keys)
        client.pins.update(keys)
        return {"chunks": len(keys)}

    def unpin(self, client: Client, body: dict, deadline: float, send: SendChunk) -> dict:
        keys = [key for key in P.keys_of(body) if client.pins[key] > 0]
        client.space.engine.unpin(keys)
        client.pins.subtract(keys)
        client.pins = +client.pins
        return {"chunks": len(keys)}

    def stats(self, client: Client, body: dict, deadline: float, send: SendChunk) -> dict:
        engine = client.space.engine.stats()
        usage = self.slots.usage()
        self.metrics.slots_referenced.set(usage["referenced"])
        return {"counters": merged(self.counters, engine.counters, {f"pool.{k}": v for k, v in usage.items()}),
                "tiers": [[t.name, t.num_chunks, t.num_bytes, t.capacity_bytes] for t in engine.tiers]}

    def close(self) -> None:
        self.decoder.shutdown(wait=True)
        self._encoder.shutdown(wait=True)
        self.spaces.close()
        self.metrics.close()

