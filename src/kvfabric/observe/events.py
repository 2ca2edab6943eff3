"""KV events for KV-aware routers: chunks stored on, and gone from, this instance, in vLLM's wire format.

Wire (identical to vLLM's `--kv-events-config` publisher, vllm.distributed.kv_events; tests decode what we send
with vLLM's own classes): ZMQ PUB, one multipart message per batch: (topic, sequence number as 8 bytes
big-endian, payload). The payload is msgpack of an `EventBatch` array [ts, [event, ...], data_parallel_rank];
each event is a map tagged by "type": `BlockStored` {block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name}, `BlockRemoved` {block_hashes, medium}, `AllBlocksCleared` {}. A block here is a
kvfabric chunk: its hash is the 32-byte chunk key, `block_size` the chunk size, `token_ids` the chunks' tokens.
With a replay endpoint (ZMQ ROUTER), a subscriber that sends (b"", start_seq as 8 bytes) gets every buffered
batch from that sequence number on, then (b"", -1 as 8 bytes, b"").

Contract of `ChunkEvents` (one per engine):
- `stored(keys, ...)` queues a BlockStored and remembers the keys (at most `max_tracked`, oldest forgotten);
  `removed(keys)` queues a BlockRemoved (a delete); `cleared()` an AllBlocksCleared.
- `sweep(contains)` looks for remembered chunks that vanished without a delete (evicted, expired, deleted by
  another process) by asking `contains(keys)` for a bounded batch per call, round robin, and queues a
  BlockRemoved for them. The queue is bounded (`max_queued` events; beyond it events are dropped and counted).
- `take()` hands over the queued events (the vLLM connector forwards them to vLLM's own publisher).
`EventPublisher` is the thread that, every `interval_s`, sweeps, takes and publishes on ZMQ. pyzmq and msgspec
are imported only when a publisher or an encoder is made.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvfabric.observe.counters import Counters

log = logging.getLogger(__name__)

SWEEP_BATCH = 16384
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def wire_types() -> dict[str, Any]:
    """msgspec structs with exactly vLLM's field names, order and encoding options."""
    import msgspec

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes]
        parent_block_hash: bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return {"EventBatch": EventBatch, "BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
            "AllBlocksCleared": AllBlocksCleared}


class ChunkEvents:
    def __init__(self, block_size: int, *, max_tracked: int = 1_000_000, max_queued: int = 100_000,
                 make: Callable[[str, dict[str, Any]], Any] | None = None) -> None:
        """`make(type_name, fields)` builds an event object (default: our msgspec structs; the vLLM connector
        passes vLLM's classes)."""
        self.block_size = block_size
        self.max_tracked = max_tracked
        self.max_queued = max_queued
        self.counters = Counters()
        self._make = make or _struct_maker()
        self._queue: deque[Any] = deque()
        self._tracked: set[bytes] = set()
        self._order: deque[bytes] = deque()  # tracked keys, oldest first (may hold keys no longer tracked)
        self._lock = threading.Lock()

    def _push(self, kind: str, fields: dict[str, Any]) -> None:
        with self._lock:
            if len(self._queue) >= self.max_queued:
                self.counters.add("dropped")
                return
            self._queue.append(self._make(kind, fields))
        self.counters.add(kind)

    def stored(self, keys: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int],
               medium: str | None = "CPU") -> None:
        """Chunks `keys` (in prompt order, the first one chained to `parent`) now held; `token_ids` their tokens
        (empty when the caller has only keys)."""
        if not keys:
            return
        with self._lock:
            new = [bytes(k) for k in keys if k not in self._tracked]
            self._tracked.update(new)
            self._order.extend(new)
            while len(self._tracked) > self.max_tracked and self._order:
                self._tracked.discard(self._order.popleft())
        self._push("BlockStored", {"block_hashes": [bytes(k) for k in keys], "parent_block_hash":
                                   bytes(parent) if parent is not None else None,
                                   "token_ids": [int(t) for t in token_ids], "block_size": self.block_size,
                                   "lora_id": None, "medium": medium, "lora_name": None})

    def removed(self, keys: Sequence[bytes], kind: str = "removed") -> None:
        if not keys:
            return
        with self._lock:
            self._tracked.difference_update(keys)
        self.counters.add(kind, len(keys))
        self._push("BlockRemoved", {"block_hashes": [bytes(k) for k in keys], "medium": None})

    def cleared(self) -> None:
        with self._lock:
            self._tracked.clear()
            self._order.clear()
        self._push("AllBlocksCleared", {})

    def sweep(self, contains: Callable[[list[bytes]], list[bool]], batch: int = SWEEP_BATCH) -> int:
        """Queue BlockRemoved for up to `batch` remembered chunks that `contains` no longer finds; returns how
        many vanished."""
        with self._lock:
            keys = []
            while self._order and len(keys) < batch:
                key = self._order.popleft()
                if key in self._tracked:
                    keys.append(key)
        if not keys:
            return 0
        try:
            present = contains(keys)
        except Exception:  # a tier fault is not a removal: look again next time
            log.exception("kv events: sweep failed")
            present = [True] * len(keys)
        gone = [key for key, hit in zip(keys, present) if not hit]
        with self._lock:
            self._order.extend(key for key, hit in zip(keys, present) if hit and key in self._tracked)
        if gone:
            self.removed(gone, "evicted")
        return len(gone)

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    def take(self) -> list[Any]:
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out


def _struct_maker() -> Callable[[str, dict[str, Any]], Any]:
    types: dict[str, Any] = {}

    def make(kind: str, fields: dict[str, Any]) -> Any:
        if not types:
            types.update(wire_types())
        return types[kind](**fields)

    return make


class EventPublisher:
    """Publishes an engine's `ChunkEvents` on ZMQ every `interval_s` (after a sweep for vanished chunks)."""

    def __init__(self, events: ChunkEvents, contains: Callable[[list[bytes]], list[bool]], endpoint: str, *,
                 topic: str = "", replay_endpoint: str = "", buffer_steps: int = 10_000, interval_s: float = 0.5,
                 hwm: int = 100_000) -> None:
        import msgspec
        import zmq
        self.events = events
        self.contains = contains
        self.interval_s = interval_s
        self._types = wire_types()
        self._encoder = msgspec.msgpack.Encoder()
        self._topic = topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_endpoint = ""
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._lock = threading.Lock()  # publish_now may also be called by the owner (close, tests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvfabric-kv-events", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_at = 0.0
        while not self._stop.is_set():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            now = time.monotonic()
            if now >= next_at:
                next_at = now + self.interval_s
                self.publish_now()
            self._stop.wait(min(0.05, self.interval_s))
        self.publish_now()  # what was queued before close

    def publish_now(self) -> None:
        self.events.sweep(self.contains)
        with self._lock:
            batch = self.events.take()
            if not batch:
                return
            payload = self._encoder.encode(self._types["EventBatch"](ts=time.time(), events=batch))
            seq, self._seq = self._seq, self._seq + 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        with self._lock:
            buffered = list(self._buffer)
        for seq, payload in buffered:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
