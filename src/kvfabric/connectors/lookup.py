"""The scheduler's lookup channel to the worker's cache: one lookup authority.

vLLM makes the connector twice: in the scheduler (EngineCore) and in each worker. Only the worker holds the cache
(its CacheEngine, or a RemoteCache with `mode: server`), so the scheduler asks that cache, with its rule (window
parts included), instead of keeping tiers and a mirror of its own.

Contract:
- `LookupService(cache, path)`: in the worker (rank 0 of its engine); a thread accepts connections on the Unix
  socket `path` (mode 0600; a socket left by a dead worker is replaced, and so is any other engine's socket of
  this user in that folder that refuses connections: vLLM ends its workers without their clean-up, so each
  `vllm serve` would otherwise leave one behind) and answers each request with
  `cache.lookup_keys(keys, num_tokens)`. A malformed request closes that connection (counted in `counters`); the
  service keeps serving. `close()` stops it and removes the socket. `start_lookup_service(cache, path)` is the
  worker's entry: a socket it cannot create (a temp folder it cannot write, a path too long for AF_UNIX) is one
  logged line and None, and the scheduler's lookups then miss; the worker itself serves on.
- `LookupClient(path)`: in the scheduler; `lookup(keys, num_tokens) -> KeyLookup`. One connection, opened on first
  use and again after a failure. A worker that does not answer within `timeout_s` is a miss (`KeyLookup()`,
  counted), and is not asked again for `retry_s`: a dead worker costs one timeout, not one per request.
  `ask` / `answer`: the same lookup in two halves, so that `EveryRank` sends every rank its question before it
  waits for any answer (the ranks look up at once: about one round trip at any TP, not one per rank).
- Frames: a 4-byte little-endian length, then a msgpack map: request {"keys": [bytes], "num_tokens": int},
  answer {"num_chunks": int, "num_in_memory": int}. At most MAX_KEYS keys of at most 64 bytes each.
- Tails (`find_tail`): a request may add "tails": [[key, num_tokens], ...], keys of partial chunks
  that would follow all of "keys", longest first (at most MAX_TAILS); the answer then adds "tail": the 1-based
  index of the first one that is loadable after every key (0: none).
  `EveryRank` answers the shortest of the ranks' tails: a rank without that one fails its load and vLLM
  recomputes (ranks store a step's chunks together, so this only follows an eviction on one rank).
- `lookup_path(engine_id, dp_rank, rank)`: where the two sides meet, in the temp folder, named by vLLM's engine id
  (one per `vllm serve`, the same in its scheduler and workers), data-parallel rank and worker rank.
- A tensor- or pipeline-parallel engine: every worker serves lookups for its own share (its cache holds its share,
  in its own process memory too); `EveryRank(clients)` asks them all and answers the least: a chunk is promised
  only when every share a load needs is there. (One shared answer would need the shares in a shared tier: a rank's
  process memory would not count.)
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack

from kvfabric.cache.protocol import KeyLookup, KVCache
from kvfabric.net.framing import ProtocolError, recv_exact, send_all
from kvfabric.observe.counters import Counters

log = logging.getLogger(__name__)
LENGTH = struct.Struct("<I")
MAX_KEYS = 1 << 16  # 16M tokens at chunk 256: far beyond any model's context
MAX_KEY_BYTES = 64
MAX_TAILS = 256  # a chunk's leading parts: chunk_size / step
MAX_FRAME = (MAX_KEYS + MAX_TAILS) * (MAX_KEY_BYTES + 12) + 64
TIMEOUT_S = 2.0  # a lookup runs in the scheduler's step: a worker that slow is treated as gone
RETRY_S = 5.0
PROBE_TIMEOUT_S = 0.5
MAX_SOCKET_PATH = 107  # bytes of an AF_UNIX path (sun_path holds 108 with the NUL)


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    found: KeyLookup  # the leading keys the worker can load
    tail: int = 0  # 1-based index of the first tail loadable after all of them, 0: none (or none asked)


def _tails(message: dict) -> list[tuple[bytes, int]]:
    tails = message.get("tails", [])
    if not isinstance(tails, list) or len(tails) > MAX_TAILS:
        raise ProtocolError("tails: a list of [key, num_tokens]")
    out = []
    for tail in tails:
        if not (isinstance(tail, list) and len(tail) == 2 and isinstance(tail[0], bytes)
                and 0 < len(tail[0]) <= MAX_KEY_BYTES and type(tail[1]) is int and 0 < tail[1] <= 1 << 40):
            raise ProtocolError("tails: a list of [key, num_tokens]")
        out.append((tail[0], tail[1]))
    return out


def lookup_path(engine_id: str, dp_rank: int = 0, rank: int = 0) -> str:
    """Worker `rank` (of its data-parallel engine; rank 0 the first) answers on this path. In a temp folder too
    long for the engine id spelled out (AF_UNIX paths hold MAX_SOCKET_PATH bytes), the id is hashed short: both
    sides compute the same name."""
    safe = "".join(c for c in str(engine_id) if c.isalnum() or c in "-_")[:64] or "default"
    worker = f"-r{int(rank)}" if rank else ""
    path = Path(tempfile.gettempdir()) / f"kvfabric-lookup-{safe}-{int(dp_rank)}{worker}.sock"
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        short = hashlib.sha256(str(engine_id).encode()).hexdigest()[:16]
        path = path.with_name(f"kvfabric-lookup-{short}-{int(dp_rank)}{worker}.sock")
    return str(path)


def sweep_dead_sockets(folder: str | os.PathLike) -> int:
    """Remove this user's lookup sockets in `folder` that nobody listens on any more (the connection is refused);
    a live worker's socket answers the connect and stays. Returns how many went."""
    removed = 0
    for path in Path(folder).glob("kvfabric-lookup-*.sock"):
        with contextlib.suppress(OSError):
            if path.lstat().st_uid != os.getuid() or not path.is_socket():
                continue
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(PROBE_TIMEOUT_S)  # a live worker whose backlog is full must not stall this start
            try:
                probe.connect(str(path))
            except ConnectionRefusedError:
                path.unlink()
                removed += 1
            finally:
                probe.close()
    return removed


def _send(sock: socket.socket, message: dict) -> None:
    body = msgpack.packb(message, use_bin_type=True)
    send_all(sock, [LENGTH.pack(len(body)), body])


def _recv(sock: socket.socket, timeout_s: float | None) -> dict:
    (size,) = LENGTH.unpack(recv_exact(sock, LENGTH.size, timeout_s))
    if size > MAX_FRAME:
        raise ProtocolError(f"frame of {size} bytes")
    try:
        message = msgpack.unpackb(recv_exact(sock, size, timeout_s), raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds for bytes that are not a message
        raise ProtocolError(f"undecodable frame: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("a frame is a map")
    return message


def _count(message: dict, name: str, upper: int) -> int:
    value = message.get(name)
    if type(value) is not int or not 0 <= value <= upper:
        raise ProtocolError(f"{name}: {value!r}")
    return value


class LookupService:
    def __init__(self, cache: KVCache, path: str) -> None:
        self.cache = cache
        self.path = path
        self.counters = Counters()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a dead worker's socket (the engine id is this engine's: nobody else serves it)
        sweep_dead_sockets(Path(path).parent)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # created 0600: only this user asks this worker's cache
        try:
            self._listener.bind(path)
            self._listener.listen(8)
        except OSError:
            self._listener.close()
            raise
        finally:
            os.umask(old_umask)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="kvfabric-lookup", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="kvfabric-lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    message = _recv(conn, None)
                    keys = message.get("keys")
                    if not isinstance(keys, list) or len(keys) > MAX_KEYS or \
                            not all(isinstance(k, bytes) and 0 < len(k) <= MAX_KEY_BYTES for k in keys):
                        raise ProtocolError("keys: a list of byte strings")
                    num_tokens = _count(message, "num_tokens", 1 << 40)
                    tails = _tails(message)
                    found = self.cache.lookup_keys(keys, num_tokens or None)
                    answer = {"num_chunks": found.num_chunks, "num_in_memory": found.num_in_memory}
                    if tails:
                        answer["tail"] = self._tail(keys, found, tails)
                    self.counters.add("lookups")  # before the answer: a client that has it sees it counted
                    _send(conn, answer)
                except ProtocolError as exc:
                    if not isinstance(exc, ConnectionError):  # a closed connection is how a client says goodbye
                        self.counters.add("bad_requests")
                        log.warning("kvfabric lookup service: dropping a connection: %s", exc)
                    return
                except OSError:
                    return

    def _tail(self, keys: list[bytes], found: KeyLookup, tails: list[tuple[bytes, int]]) -> int:
        if found.num_chunks < len(keys):
            return 0
        for i, (key, num_tokens) in enumerate(tails, 1):
            if self.cache.lookup_keys([*keys, key], num_tokens).num_chunks > len(keys):
                return i
        return 0

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def start_lookup_service(cache: KVCache, path: str) -> LookupService | None:
    try:
        return LookupService(cache, path)
    except OSError as exc:
        log.warning("kvfabric lookup service: cannot listen on %s (%s); the scheduler's lookups will miss",
                    path, exc.strerror or exc)
        return None


class LookupClient:
    def __init__(self, path: str, timeout_s: float = TIMEOUT_S, retry_s: float = RETRY_S) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.counters = Counters()
        self._sock: socket.socket | None = None
        self._down_until = 0.0
        self._asked_at = 0.0  # when the question being answered was sent
        self._num_tails = 0  # tails in that question
        self._lock = threading.Lock()

    def lookup(self, keys: Sequence[bytes], num_tokens: int | None = None) -> KeyLookup:
        return self.answer(self.ask(keys, num_tokens)).found

    def find_tail(self, keys: Sequence[bytes], num_tokens: int, tails: Sequence[tuple[bytes, int]]) -> int:
        """The 1-based index of the first of `tails` loadable after all of `keys` (0: none)."""
        return self.answer(self.ask(keys, num_tokens, tails)).tail

    def ask(self, keys: Sequence[bytes], num_tokens: int | None = None,
            tails: Sequence[tuple[bytes, int]] = ()) -> int:
        """Send a lookup and hold this client until its `answer` (EveryRank asks every rank before it waits for
        any). Returns how many keys were asked (plus one with tails): 0 when nothing was sent (nothing to ask, a
        worker taken for gone)."""
        if not keys and not tails:
            return 0
        self._lock.acquire()
        if time.monotonic() < self._down_until:
            self.counters.add("lookups_skipped")
            self._lock.release()
            return 0
        try:
            message = {"keys": list(keys), "num_tokens": int(num_tokens or 0)}
            if tails:
                message["tails"] = [[key, num] for key, num in tails[:MAX_TAILS]]
            _send(self._connect(), message)
            self._asked_at = time.monotonic()
            self._num_tails = min(len(tails), MAX_TAILS)
        except (OSError, ProtocolError) as exc:
            self._failed(exc)
            self._lock.release()
            return 0
        return len(keys) + (1 if tails else 0)  # the lock stays held until `answer`

    def answer(self, num_asked: int) -> LookupAnswer:
        """The answer to the last `ask` (a miss where it sent nothing or the worker fails to answer in time)."""
        if not num_asked:
            return LookupAnswer(KeyLookup())
        try:
            assert self._sock is not None
            # the deadline runs from the question: ranks asked together time out together (an answer that is
            # already there is still taken)
            reply = _recv(self._sock, max(1e-3, self.timeout_s - (time.monotonic() - self._asked_at)))
            num_keys = num_asked - (1 if self._num_tails else 0)
            found = LookupAnswer(KeyLookup(_count(reply, "num_chunks", num_keys),
                                           _count(reply, "num_in_memory", num_keys)),
                                 _count(reply, "tail", self._num_tails) if self._num_tails else 0)
        except (OSError, ProtocolError) as exc:  # timeouts, a worker gone or restarted, a bad answer: misses
            self._failed(exc)
            return LookupAnswer(KeyLookup())
        finally:
            self._lock.release()
        self.counters.add("lookups")
        return found

    def _failed(self, exc: BaseException) -> None:
        self._drop()
        self._down_until = time.monotonic() + self.retry_s
        self.counters.add("lookup_errors")
        log.warning("kvfabric: the worker's cache did not answer a lookup (%s); treating it as a miss for %.0f s",
                    exc, self.retry_s)

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()


class EveryRank:
    """The lookups of a parallel engine's scheduler: each worker's answer for its share; the least of them."""

    def __init__(self, clients: Sequence[LookupClient]) -> None:
        self.clients = list(clients)

    def _ask(self, keys: Sequence[bytes], num_tokens: int | None,
             tails: Sequence[tuple[bytes, int]] = ()) -> list[LookupAnswer]:
        asked = [client.ask(keys, num_tokens, tails) for client in self.clients]  # every rank works on it at once
        return [client.answer(num) for client, num in zip(self.clients, asked)]

    def lookup(self, keys: Sequence[bytes], num_tokens: int | None = None) -> KeyLookup:
        answers = self._ask(keys, num_tokens)
        return KeyLookup(min(a.found.num_chunks for a in answers), min(a.found.num_in_memory for a in answers))

    def find_tail(self, keys: Sequence[bytes], num_tokens: int, tails: Sequence[tuple[bytes, int]]) -> int:
        """The shortest of the ranks' tails (the largest index), 0 when a rank has none."""
        found = [a.tail for a in self._ask(keys, num_tokens, tails)]
        return 0 if 0 in found else max(found)

    def close(self) -> None:
        for client in self.clients:
            client.close()
