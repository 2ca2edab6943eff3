"""Framing of a KV stream (all integers little-endian).

    frame := header (20 bytes: magic b"KVST", u8 kind, u8 level, u16 reserved, u32 chunk index, u64 length)
             + `length` bytes of body
    kinds:   HELLO  JSON {num_tokens, chunk_size, model_id,
                          layout: {num_layers, num_kv_heads, head_dim, dtype, is_latent, fingerprint (hex)},
                          tokens: [...], report_work (optional bool)}
             KV     one chunk blob (kvfabric.codec.format: header + payload of any registered codec)
             TOKENS the chunk's token ids as u32: the receiver recomputes its KV
             END    empty; the sender has sent every chunk
    and back, receiver -> sender, only when the HELLO asks for it ("report_work": true):
             DONE   u64 nanoseconds the receiver's worker spent on chunk `index` (decode, or recompute): what an
                    option costs this receiver under its real load, for the sender's policy

The receiver checks every header against what the stream already told it before reading a body: kind known,
index in order, length within the bound for that kind (a KV body is at most twice the chunk's raw size plus
1 MiB; TOKENS exactly 4 bytes a token). A violation raises ProtocolError and the connection is dropped.
Reading exact byte counts and the error types come from kvfabric.net.framing (shared with the cluster protocol).
"""
from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass

from kvfabric.net.framing import ProtocolError, recv_exact

MAGIC = b"KVST"
FRAME = struct.Struct("<4sBBHIQ")
HELLO, KV, TOKENS, END, DONE = 1, 2, 3, 4, 5
DONE_BODY = struct.Struct("<Q")
MAX_HELLO = 16 << 20
MAX_TOKENS = 1 << 22


@dataclass(frozen=True)
class Frame:
    kind: int
    level: int
    index: int
    length: int


def pack(kind: int, index: int, length: int, level: int = 0) -> bytes:
    return FRAME.pack(MAGIC, kind, level, 0, index, length)


def send_frame(sock: socket.socket, kind: int, index: int, body: bytes | bytearray | memoryview = b"",
               level: int = 0) -> int:
    """Send one frame; returns the bytes put on the wire."""
    head = pack(kind, index, len(body), level)
    sock.sendall(head + bytes(body) if len(body) < 4096 else head)
    if len(body) >= 4096:
        sock.sendall(body)
    return len(head) + len(body)


def recv_header(sock: socket.socket) -> Frame:
    magic, kind, level, _, index, length = FRAME.unpack(recv_exact(sock, FRAME.size))
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r}")
    if kind not in (HELLO, KV, TOKENS, END, DONE):
        raise ProtocolError(f"unknown frame kind {kind}")
    return Frame(kind, level, index, length)


def hello_body(tokens: list[int], chunk_size: int, model_id: str, layout,  # noqa: ANN001
               report_work: bool = False) -> bytes:
    return json.dumps({"num_tokens": len(tokens), "chunk_size": chunk_size, "model_id": model_id,
                       "report_work": report_work,
                       "layout": {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                                  "head_dim": layout.head_dim, "dtype": layout.dtype, "is_latent": layout.is_latent,
                                  "fingerprint": layout.fingerprint.hex()},  # names the layer groups too
                       "tokens": [int(t) for t in tokens]}).encode()


def parse_hello(body: bytes) -> dict:
    try:
        meta = json.loads(body)
        tokens = meta["tokens"]
        ok = (isinstance(tokens, list) and len(tokens) == meta["num_tokens"] and 0 < len(tokens) <= MAX_TOKENS
              and all(isinstance(t, int) and 0 <= t < 1 << 32 for t in tokens)
              and isinstance(meta["chunk_size"], int) and 0 < meta["chunk_size"] <= 1 << 16
              and isinstance(meta["model_id"], str) and isinstance(meta["layout"], dict)
              and isinstance(meta.get("report_work", False), bool))
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"malformed HELLO: {exc}") from exc
    if not ok:
        raise ProtocolError("malformed HELLO")
    return meta
