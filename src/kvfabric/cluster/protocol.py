"""The peer-to-peer wire protocol: fixed binary frames on TCP, no pickle, bounded sizes.

Every frame is a 16-byte header followed by `length` bytes of body (integers little-endian):

    offset size  field
    0      4     magic b"KVP2"
    4      1     protocol version (1)
    5      1     frame type (FrameType)
    6      2     flags (CHUNK: the Status of the key; otherwise 0)
    8      8     body length in bytes

Exchanges (one at a time per connection; a connection is reused for many requests):

    GET      client -> server  body: u16 token length, token, u8 tier length, tier name (ascii, empty: any
                               served tier), u32 key count, count x 32-byte chunk keys
             server -> client  one CHUNK per key, in request order, then END
    CHUNK    server -> client  flags = Status; body: the 32-byte key, then (OK only) the chunk blob exactly as
                               stored: the core chunk format (codec.format) with its own header and payload
                               checksums, which the receiving stack verifies
    END      server -> client  body: u32 number of CHUNK frames sent
    CONTROL  client -> server  body: u16 token length, token, then one JSON object (small control messages)
    REPLY    server -> client  body: one JSON object
    ERROR    server -> client  body: u16 code (HTTP-like: 400, 401, 413, 503), UTF-8 message; the server then
                               closes the connection

Bounds: request bodies (GET, CONTROL) are at most `MAX_REQUEST_BYTES` and `MAX_KEYS` keys; a CHUNK body is at
most the receiver's `max_frame_bytes`; every read has a timeout. Token check: hmac.compare_digest.
Exact reads, scatter-gather sends and the error types come from kvfabric.net.framing (shared with the KV stream).
"""
from __future__ import annotations

import json
import socket
import struct
from collections.abc import Sequence
from enum import IntEnum

from kvfabric.net.framing import ProtocolError, recv_into

MAGIC = b"KVP2"
VERSION = 1
HEADER = struct.Struct("<4sBBHQ")
HEADER_BYTES = HEADER.size  # 16
KEY_BYTES = 32
MAX_REQUEST_BYTES = 1 << 20
MAX_KEYS = 8192
MAX_TOKEN_BYTES = 4096
DEFAULT_MAX_FRAME_BYTES = 1 << 30  # one chunk blob; real chunks are a few MiB to a few hundred MiB
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


class FrameType(IntEnum):
    GET = 1
    CHUNK = 2
    END = 3
    ERROR = 4
    CONTROL = 5
    REPLY = 6


class Status(IntEnum):
    OK = 0
    MISSING = 1


class RemoteError(ProtocolError):
    """The peer answered with an ERROR frame."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"peer error {code}: {message}")
        self.code = code


def pack_header(frame_type: int, length: int, flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, frame_type, flags, length)


def parse_header(data: bytes | bytearray | memoryview) -> tuple[FrameType, int, int]:
    """(type, flags, length) of a frame header; ProtocolError if it is not one of ours."""
    magic, version, frame_type, flags, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version}")
    try:
        kind = FrameType(frame_type)
    except ValueError:
        raise ProtocolError(f"unknown frame type {frame_type}") from None
    return kind, flags, length


# ---- bodies ------------------------------------------------------------------------------------------------
def _pack_token(token: str | None) -> bytes:
    raw = (token or "").encode()
    if len(raw) > MAX_TOKEN_BYTES:
        raise ValueError("token too long")
    return _U16.pack(len(raw)) + raw


def _unpack_token(body: memoryview) -> tuple[bytes, int]:
    if len(body) < 2:
        raise ProtocolError("truncated token")
    (n,) = _U16.unpack_from(body, 0)
    if n > MAX_TOKEN_BYTES or 2 + n > len(body):
        raise ProtocolError("bad token length")
    return bytes(body[2:2 + n]), 2 + n


def encode_get(token: str | None, keys: Sequence[bytes], tier: str = "") -> bytes:
    if len(keys) > MAX_KEYS:
        raise ValueError(f"at most {MAX_KEYS} keys per request, got {len(keys)}")
    tier_raw = tier.encode("ascii")
    if len(tier_raw) > 255:
        raise ValueError("tier name too long")
    for key in keys:
        if len(key) != KEY_BYTES:
            raise ValueError(f"chunk keys are {KEY_BYTES} bytes, got {len(key)}")
    return b"".join([_pack_token(token), bytes([len(tier_raw)]), tier_raw, _U32.pack(len(keys)), *keys])


def decode_get(body: bytes | bytearray | memoryview) -> tuple[bytes, str, list[bytes]]:
    view = memoryview(body)
    token, pos = _unpack_token(view)
    if pos + 1 > len(view):
        raise ProtocolError("truncated tier")
    n = view[pos]
    pos += 1
    if pos + n + 4 > len(view):
        raise ProtocolError("truncated tier or key count")
    try:
        tier = bytes(view[pos:pos + n]).decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("tier name is not ascii") from None
    pos += n
    (count,) = _U32.unpack_from(view, pos)
    pos += 4
    if count > MAX_KEYS:
        raise ProtocolError(f"too many keys: {count} > {MAX_KEYS}")
    if len(view) - pos != count * KEY_BYTES:
        raise ProtocolError("key list length does not match the count")
    keys = [bytes(view[pos + i * KEY_BYTES:pos + (i + 1) * KEY_BYTES]) for i in range(count)]
    return token, tier, keys


def encode_control(token: str | None, message: dict) -> bytes:
    return _pack_token(token) + encode_json(message)


def decode_control(body: bytes | bytearray | memoryview) -> tuple[bytes, dict]:
    view = memoryview(body)
    token, pos = _unpack_token(view)
    return token, decode_json(view[pos:])


def encode_json(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode_json(data: bytes | bytearray | memoryview) -> dict:
    try:
        message = json.loads(bytes(data).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"bad JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("a control message must be a JSON object")
    return message


def encode_error(code: int, message: str) -> bytes:
    body = _U16.pack(code) + message.encode()[:1000]
    return pack_header(FrameType.ERROR, len(body)) + body


def decode_error(body: bytes | bytearray | memoryview) -> RemoteError:
    if len(body) < 2:
        return RemoteError(0, "malformed error frame")
    (code,) = _U16.unpack_from(body, 0)
    return RemoteError(code, bytes(body[2:]).decode(errors="replace"))


# ---- socket helpers ----------------------------------------------------------------------------------------
def recv_header(sock: socket.socket, timeout_s: float, deadline: float | None = None) -> tuple[FrameType, int, int]:
    buf = bytearray(HEADER_BYTES)
    recv_into(sock, memoryview(buf), timeout_s, deadline)
    return parse_header(buf)
