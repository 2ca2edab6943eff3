"""The control protocol between engines and `kvfabric server`: small frames over a Unix-domain socket.

    frame := header (20 bytes, little-endian: magic b"KVSV", u8 version, u8 op, u16 flags, u32 request id,
             u32 budget_ms, u32 body length) + body (msgpack: a map with str keys; bytes for chunk keys)

A request carries its deadline as a budget in milliseconds from its arrival (both ends are on one host but need
not share a clock epoch). Every request gets exactly one final frame back (REPLY or ERROR, same request id),
preceded for RETRIEVE by one CHUNK frame per chunk as it becomes ready; a request with flag NO_REPLY (RELEASE)
gets nothing back. Bodies are plain msgpack values: no pickle, no extension types.

`read_frame` rejects, before reading a body: a bad magic or version, an unknown op, a body over MAX_BODY; `unpack`
rejects a body that is not a msgpack map with str keys or that exceeds the container limits. The field
accessors (`keys_of`, `ints_of`, `text_of`, ...) reject a field of the wrong type or size. Each raises
ProtocolError; the server closes that one connection.

HELLO names the client's namespace: model, `layout` (the model's), chunk size, hash, salt and, for a parallel
engine's rank, its `share` and `parallel` shape (server/namespaces.py); the answer's `slot_layout` is what a pool
slot of that namespace holds, in `slot_layout`'s form.
"""
from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvfabric.kv.layout import KVLayout
from kvfabric.net.framing import ProtocolError, recv_exact, send_all

MAGIC = b"KVSV"
VERSION = 1
HEADER = struct.Struct("<4sBBHIII")
MAX_BODY = 1 << 20
MAX_KEY_BYTES = 64
MAX_ITEMS = 1 << 16  # keys in one request: a 16M-token prompt at chunk size 256

# requests
(HELLO, LOOKUP, RETRIEVE, LEASE, COMMIT, RELEASE, PREFETCH, PIN, UNPIN, STATS, FLUSH, FETCH_STREAM, PING,
 HOLDS) = range(1, 15)
REQUESTS = frozenset(range(HELLO, HOLDS + 1))
# answers
REPLY, CHUNK, ERROR = 0x81, 0x82, 0x83
ANSWERS = frozenset((REPLY, CHUNK, ERROR))
OP_NAMES = {HELLO: "hello", LOOKUP: "lookup", RETRIEVE: "retrieve", LEASE: "lease", COMMIT: "commit",
            RELEASE: "release", PREFETCH: "prefetch", PIN: "pin", UNPIN: "unpin", STATS: "stats", FLUSH: "flush",
            FETCH_STREAM: "fetch_stream", PING: "ping", HOLDS: "holds"}

NO_REPLY = 1  # flag: a one-way request


def slot_layout(layout: KVLayout) -> list[Any]:
    """A layout on the wire: [num_layers, num_kv_heads, head_dim, dtype] (and "latent" for MLA)."""
    return [layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
            *(["latent"] if layout.is_latent else [])]


@dataclass(frozen=True, slots=True)
class Frame:
    op: int
    flags: int
    request_id: int
    budget_ms: int
    body: dict[str, Any]


def pack(op: int, request_id: int, body: dict[str, Any] | None = None, *, budget_ms: int = 0,
         flags: int = 0) -> bytes:
    payload = msgpack.packb(body or {}, use_bin_type=True)
    if len(payload) > MAX_BODY:
        raise ValueError(f"frame body of {len(payload)} bytes exceeds {MAX_BODY}")
    return HEADER.pack(MAGIC, VERSION, op, flags, request_id, budget_ms, len(payload)) + payload


def send(sock: socket.socket, op: int, request_id: int, body: dict[str, Any] | None = None, *, budget_ms: int = 0,
         flags: int = 0) -> None:
    send_all(sock, [pack(op, request_id, body, budget_ms=budget_ms, flags=flags)])


def read_frame(sock: socket.socket, allowed: frozenset[int], timeout_s: float | None = None,
               deadline: float | None = None) -> Frame:
    """One frame whose op is in `allowed`. Raises ProtocolError (PeerClosed when the peer hung up), TimeoutError
    or OSError."""
    magic, version, op, flags, request_id, budget_ms, length = HEADER.unpack(
        recv_exact(sock, HEADER.size, timeout_s, deadline))
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad frame magic or version {bytes(magic)!r} v{version}")
    if op not in allowed:
        raise ProtocolError(f"unexpected op {op:#x}")
    if length > MAX_BODY:
        raise ProtocolError(f"frame body of {length} bytes exceeds {MAX_BODY}")
    body = unpack(recv_exact(sock, length, timeout_s, deadline)) if length else {}
    return Frame(op, flags, request_id, budget_ms, body)


def unpack(data: bytes | bytearray) -> dict[str, Any]:
    try:
        body = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True,
                               max_bin_len=MAX_BODY, max_str_len=MAX_BODY, max_array_len=MAX_ITEMS,
                               max_map_len=64, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"body is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(body, dict) or not all(isinstance(k, str) for k in body):
        raise ProtocolError("body must be a map with string keys")
    return body


# ---- field accessors: a wrong type or size is a ProtocolError -------------------------------------------------
def keys_of(body: dict[str, Any], name: str = "keys") -> list[bytes]:
    keys = body.get(name, [])
    if not isinstance(keys, list) or not all(isinstance(k, bytes) and 0 < len(k) <= MAX_KEY_BYTES for k in keys):
        raise ProtocolError(f"{name}: expected a list of chunk keys (1-{MAX_KEY_BYTES} bytes each)")
    return keys


def ints_of(body: dict[str, Any], name: str, upper: int = 1 << 31) -> list[int]:
    values = body.get(name, [])
    if not isinstance(values, list) or not all(type(v) is int and 0 <= v < upper for v in values):
        raise ProtocolError(f"{name}: expected a list of integers in [0, {upper})")
    return values


def int_of(body: dict[str, Any], name: str, default: int | None = None, upper: int = 1 << 31) -> int:
    value = body.get(name, default)
    if type(value) is not int or not 0 <= value < upper:
        raise ProtocolError(f"{name}: expected an integer in [0, {upper})")
    return value


def text_of(body: dict[str, Any], name: str, default: str | None = None, max_len: int = 256) -> str:
    value = body.get(name, default)
    if not isinstance(value, str) or len(value) > max_len:
        raise ProtocolError(f"{name}: expected a string of at most {max_len} characters")
    return value


def bytes_of(body: dict[str, Any], name: str, max_len: int = 64) -> bytes:
    value = body.get(name, b"")
    if not isinstance(value, bytes) or len(value) > max_len:
        raise ProtocolError(f"{name}: expected at most {max_len} bytes")
    return value


def same_length(*lists: Sequence[object]) -> None:
    if len({len(x) for x in lists}) > 1:
        raise ProtocolError("parallel lists differ in length")
