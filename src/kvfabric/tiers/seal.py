"""Sealed chunks: AES-256-GCM over a chunk blob bound for a shared tier, the chunk key as associated data.

A sealed blob (what Redis or Mooncake stores instead of the chunk blob):

    offset  size  field
    0       4     magic b"KVSL"
    4       1     version (1)
    5       3     zero
    8       8     key id: the first 8 bytes of sha256(key); says which key of the ring opens it
    16      12    nonce (random per seal)
    28      n     the chunk blob, encrypted
    28+n    16    GCM tag

The associated data is the chunk key followed by bytes 0-28, so a blob copied under another chunk key, or with its
header changed, fails to open. Contract:
- `Sealer(keys)`: a key ring of 32-byte keys; the first seals, every one opens (rotation: put the new key first,
  drop the old one once nothing sealed with it is wanted). `parse_keys(text)` reads the config form: base64 keys
  separated by commas; a key that is not 32 bytes is `SealKeyError`, one line.
- `seal_into(key, blob, out)` seals into `out` (`sealed_size(len(blob))` bytes, the caller's reused buffer);
  `open_into(key, sealed, out)` opens into `out` (`opened_size(len(sealed))` bytes) and returns the view, or raises
  `SealError` saying why (not sealed, truncated, an unknown key id, a failed tag). Nothing is allocated per call
  but the small headers: the cipher writes straight into the caller's buffer (a fresh 33 MB buffer per call cost
  more than the cipher itself).
- Needs `cryptography` (the `security` extra); importing this module without it is the extras' one-line error.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"KVSL"
VERSION = 1
HEAD = struct.Struct("<4sB3x8s12s")  # magic, version, key id, nonce
TAG_BYTES = 16
OVERHEAD = HEAD.size + TAG_BYTES
KEY_BYTES = 32


class SealError(ValueError):
    """A blob that does not open: a miss, never served."""


class SealKeyError(ValueError):
    """A configured sealing key that is not usable (one line, naming which)."""


def parse_keys(text: str) -> list[bytes]:
    keys = []
    for i, item in enumerate(part.strip() for part in text.split(",") if part.strip()):
        try:
            key = base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError):
            raise SealKeyError(f"seal.keys: key {i + 1} is not base64") from None
        if len(key) != KEY_BYTES:
            raise SealKeyError(f"seal.keys: key {i + 1} is {len(key)} bytes, not {KEY_BYTES} "
                               f"(make one with: python -c 'import os, base64; print(base64.b64encode(os.urandom(32)).decode())')")
        keys.append(key)
    return keys


def key_id(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()[:8]


def sealed_size(blob_bytes: int) -> int:
    return blob_bytes + OVERHEAD


def opened_size(sealed_bytes: int) -> int:
    return sealed_bytes - OVERHEAD


class Sealer:
    def __init__(self, keys: list[bytes]) -> None:
        if not keys:
            raise SealKeyError("seal.keys: at least one key is needed to seal")
        self._ring = {key_id(key): AESGCM(key) for key in keys}
        self._sealing_id = key_id(keys[0])

    def seal_into(self, chunk_key: bytes, blob, out: memoryview) -> memoryview:
        size = len(blob)
        out = out[:sealed_size(size)]
        HEAD.pack_into(out, 0, MAGIC, VERSION, self._sealing_id, os.urandom(12))
        head = bytes(out[:HEAD.size])
        self._ring[self._sealing_id].encrypt_into(head[16:28], blob, chunk_key + head, out[HEAD.size:])
        return out

    def open_into(self, chunk_key: bytes, sealed, out: memoryview) -> memoryview:
        if len(sealed) < OVERHEAD:
            raise SealError(f"truncated: {len(sealed)} bytes")
        head = bytes(memoryview(sealed)[:HEAD.size])
        magic, version, kid, nonce = HEAD.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise SealError("not a sealed chunk (or another version)")
        cipher = self._ring.get(kid)
        if cipher is None:
            raise SealError(f"sealed with an unknown key (id {kid.hex()})")
        out = out[:opened_size(len(sealed))]
        try:
            cipher.decrypt_into(nonce, memoryview(sealed)[HEAD.size:], chunk_key + head, out)
        except InvalidTag:
            raise SealError("the tag does not match: damaged, or sealed under another chunk key") from None
        return out

    def knows(self, sealed) -> bool:
        """Whether a key of this ring sealed it (a blob sealed with an unknown key is not damage: it stays)."""
        return len(sealed) >= HEAD.size and bytes(memoryview(sealed)[8:16]) in self._ring
