"""SealedTier: a shared tier (Redis, Mooncake) that stores every chunk sealed (kvfabric.tiers.seal: AES-256-GCM, the chunk
key as associated data), so that whoever reads the server's memory or the wire reads no prompt.

Contract:
- Wraps one tier; every Tier call goes to it, with blobs sealed on the way in and opened on the way out. What the
  wrapped tier declares (shared, persistent, capacity, pins) stays true (its budget counts the sealed blobs,
  OVERHEAD bytes more each; `usage` reports chunk bytes); `is_trusted` is False (the stack checks
  the opened blob's own checksums as for any shared tier), `is_zero_copy` / `is_ranged` False.
- Puts seal into this thread's reused buffer (the wrapped tier copies or sends it before `put` returns). `get_into`
  / `get_many_into` open into the caller's scratch buffers; `get` into a recycled buffer (tiers/pool.py: one the
  caller still holds is never reused), since a fresh one per read faults in its pages.
- A blob that does not open (damaged, truncated, moved under another chunk key, sealed by a key this ring lacks)
  is a miss, counted (`seal_failed`); a damaged one is deleted from the tier, one sealed with an unknown key is
  left (another deployment's, or a key not rolled out here yet).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from kvfabric.host.pages import Scratch
from kvfabric.observe.counters import Counters
from kvfabric.tiers.base import Blob, Tier, TierBase, TierUsage
from kvfabric.tiers.pool import BlobPool
from kvfabric.tiers.seal import OVERHEAD, Sealer, SealError, opened_size, sealed_size

OPENED_POOL_BYTES = 256 << 20  # free opened-blob buffers kept for reuse

log = logging.getLogger(__name__)


class SealedTier(TierBase):
    is_trusted = False
    is_zero_copy = False
    is_ranged = False

    def __init__(self, inner: Tier, sealer: Sealer) -> None:
        self.inner = inner
        self.sealer = sealer
        self.name = inner.name
        for flag in ("is_read_only", "is_persistent", "is_shared", "honors_capacity", "honors_pins"):
            setattr(self, flag, getattr(inner, flag))
        self._events = Counters()
        self._local = threading.local()
        self._opened = BlobPool(lambda: OPENED_POOL_BYTES)

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    @property
    def counters(self) -> Counters:
        inner = getattr(self.inner, "counters", None)
        own = self._events.snapshot()
        return Counters({**(inner.snapshot() if isinstance(inner, Counters) else {}), **own})

    @property
    def breaker(self):  # the wrapped tier's circuit breaker, if it has one (engine stats report it)
        return getattr(self.inner, "breaker", None)

    def _buffers(self) -> tuple[Scratch, list[Scratch]]:
        local = self._local
        if not hasattr(local, "seal"):
            local.seal, local.reads = Scratch(), []
        return local.seal, local.reads

    # ---- writes ------------------------------------------------------------------------------------------
    def put(self, key: bytes, blob: Blob) -> bool:
        out, _ = self._buffers()
        return self.inner.put(key, self.sealer.seal_into(key, blob, out.view(sealed_size(len(blob)))))

    def put_many(self, items: Sequence[tuple[bytes, Blob]]) -> list[bool]:
        sealed = []
        for key, blob in items:  # one buffer each: the wrapped tier sends the batch at once
            out = memoryview(np.empty(sealed_size(len(blob)), dtype=np.uint8))
            sealed.append((key, self.sealer.seal_into(key, blob, out)))
        return self.inner.put_many(sealed)

    # ---- reads -------------------------------------------------------------------------------------------
    def _open(self, key: bytes, sealed: Blob | None, out: Scratch | None) -> Blob | None:
        if sealed is None:
            return None
        size = opened_size(len(sealed))
        if size < 0:
            target = memoryview(bytearray(0))
        elif out is not None:
            target = out.view(size)
        else:
            target = self._opened.take(size)
            self._opened.give(target)  # reused only once the caller lets go of it (BlobPool's contract)
        try:
            return self.sealer.open_into(key, sealed, target)
        except SealError as exc:
            self._events.add("seal_failed")
            if self.sealer.knows(sealed):
                log.warning("dropping chunk %s from tier %s: it does not open: %s", key.hex()[:16], self.name, exc)
                self.inner.delete(key)
            return None

    def get(self, key: bytes) -> Blob | None:
        return self._open(key, self.inner.get(key), None)

    def get_into(self, key: bytes, scratch: Scratch) -> Blob | None:
        _, reads = self._buffers()
        if not reads:
            reads.append(Scratch())
        return self._open(key, self.inner.get_into(key, reads[0]), scratch)

    def get_many_into(self, keys: Sequence[bytes], scratches: Sequence[Scratch]) -> list[Blob | None]:
        _, reads = self._buffers()
        reads.extend(Scratch() for _ in range(len(keys) - len(reads)))
        blobs = self.inner.get_many_into(keys, reads[:len(keys)])
        return [self._open(key, blob, scratch) for key, blob, scratch in zip(keys, blobs, scratches, strict=True)]

    # ---- everything else is the wrapped tier's -----------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.contains_many(keys)

    def prefetch(self, keys: Sequence[bytes]) -> None:
        self.inner.prefetch(keys)

    def file_of(self, key: bytes) -> Path | None:
        return None  # a sealed file is no chunk a peer could send as it is

    def delete(self, key: bytes) -> bool:
        return self.inner.delete(key)

    def keys(self) -> list[bytes]:
        return self.inner.keys()

    def usage(self) -> TierUsage:
        """In chunk bytes, as every tier reports them (the wrapped tier stores OVERHEAD more for each)."""
        inner = self.inner.usage()
        return TierUsage(inner.name, inner.num_chunks, max(0, inner.num_bytes - inner.num_chunks * OVERHEAD),
                         inner.capacity_bytes)

    def pin(self, keys: Iterable[bytes]) -> None:
        self.inner.pin(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        self.inner.unpin(keys)

    def clear(self) -> None:
        self.inner.clear()

    def close(self) -> None:
        self._opened.close()
        self.inner.close()
