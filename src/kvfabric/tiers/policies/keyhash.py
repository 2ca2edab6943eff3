"""Deterministic key hashing for the policies: the same value in every process (never Python's per-process
`hash()` of bytes). Keys are bytes (kvfabric chunk keys, already cryptographic digests) or int ids (traces)."""
from __future__ import annotations

from kvfabric.tiers.policies.types import Key

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # also inlined by heat.py's per-access sampling check


def key_hash64(key: Key, seed: int = 0) -> int:
    """A 64-bit hash of a key (splitmix64 finaliser of an int id, or of a digest's last 8 bytes)."""
    if isinstance(key, bytes | bytearray | memoryview):
        x = int.from_bytes(bytes(key[-8:]), "little")
    elif isinstance(key, int):
        x = key & MASK64
    else:
        raise TypeError(f"keys must be bytes or int, got {type(key).__name__}")
    x = (x + GOLDEN * (seed + 1)) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def sample_bucket(key: Key) -> int:
    """A key's bucket in 0..255, uniform over keys; cheap enough to run on every access."""
    cls = key.__class__
    if cls is bytes:
        return key[-1]  # a digest's bytes are already uniform
    if cls is int:
        return ((key * GOLDEN) & MASK64) >> 56  # Fibonacci hashing: the top byte of key x golden ratio
    return key_hash64(key) >> 56
