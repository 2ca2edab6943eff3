"""Disk tier: one file per chunk under a directory, size-bounded, pluggable eviction and admission policies,
atomic writes, shared across processes.

Contract:
- A chunk lives at `<root>/<key hex[:2]>/<key hex>.kvc`; it is written to `<root>/tmp/` and renamed into place
  (os.replace is atomic), so a reader never sees a half-written file under a chunk's name; a crash leaves only
  a temp file, removed at the next start once it is old.
- On start the index is rebuilt from the directory, oldest access first (mtime; reads touch it), so a restarted
  process finds and evicts what earlier processes stored (the eviction policy starts from that order; the
  admission policy is not asked about chunks that already exist). A key unknown to the index is looked up on
  disk before answering "absent", so chunks written by another process after our start are found.
- Not trusted: the stack verifies every blob read from here (checksums), so a damaged file is a counted miss.
- A put is booked in the index first (admission, then the policy's victims are unlinked), then written: the
  bytes this process keeps on disk never exceed `capacity_bytes`, and a refused chunk is never written.
  Pinned keys are never evicted. An evicted chunk is read back for the evict listener (demotion) only when
  one is set.
- `new_blob` hands out buffers of chunks already written (tiers/pool.py: never one a reader or a queued write
  still holds), at most WRITE_BUFFERS_BYTES of them (a quarter of the capacity when that is less) kept free: a
  fresh buffer costs a page fault per 4 KiB, and a store of chunks into fresh memory ran well below a plain file
  write of the same bytes, the difference mostly faults on the engine's thread (docs/design/measurements.md).
- A directory deleted while running is made again by the next put (the index starts over); a full file system
  makes puts fail (False, counted by the stack) until there is room again.
- Modes (kvfabric.host.permissions): the directories it makes get `mode` (default 0700: only this user), chunk files
  `mode` without execute bits (0600); a root directory that grants more than `mode` is a warning at start, an
  error with `strict`. `disk.mode: "0770"` lets a group of service users share one cache directory.
"""
from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvfabric.codec.format import HEADER_BYTES
from kvfabric.host.pages import Scratch
from kvfabric.host.permissions import PRIVATE_DIR, check_mode, create_file, file_mode, make_private_dir
from kvfabric.observe.counters import Counters
from kvfabric.tiers.base import Blob, PolicyTier
from kvfabric.tiers.policies import NO_META, AccessMeta, EvictionPolicy, make_index
from kvfabric.tiers.pool import BlobPool

SUFFIX = ".kvc"
STALE_TMP_S = 3600.0
WRITE_BUFFERS_BYTES = 256 << 20  # free write buffers kept for reuse, at most


def fadvise(paths: Iterable[str | os.PathLike], advice: int) -> None:
    """posix_fadvise(advice) on whole files; missing files are skipped (a hint, never an error)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        finally:
            os.close(fd)


class FileRange:
    """A chunk file open for ranged reads (`RangedBlob`)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    def read_into(self, offset: int, buf: memoryview) -> bool:
        try:
            return os.preadv(self.fd, [buf], offset) == len(buf)
        except OSError:
            return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class DiskTier(PolicyTier):
    name = "disk"
    is_trusted = False
    is_read_only = False
    is_persistent = True
    is_shared = True  # every process using the same directory
    honors_capacity = True  # the bytes this process knows of; another process sharing the directory has its own
    honors_pins = True
    is_ranged = True  # open_ranged: a chunk file read one piece at a time

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, fsync: bool = False,
                 eviction: str | EvictionPolicy = "lru", admission: str = "always", mode: int = PRIVATE_DIR,
                 strict: bool = False) -> None:
        self.root = Path(root).expanduser()
        self.capacity_bytes = capacity_bytes
        self.is_fsync = fsync
        self.mode = mode
        self._tmp = self.root / "tmp"
        make_private_dir(self._tmp, mode)
        check_mode(self.root, mode, "disk cache directory", strict)
        self._index = make_index(capacity_bytes, eviction, admission, on_evict=self._evicted)
        self._writing: set[bytes] = set()  # booked in the index, file not yet in place
        self._dropped: set[bytes] = set()  # of those, evicted or deleted meanwhile: unlinked once written
        self._events = Counters()
        self.pool = BlobPool(lambda: min(WRITE_BUFFERS_BYTES, capacity_bytes // 4), align_offset=HEADER_BYTES)
        self._rebuild()

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def file_of(self, key: bytes) -> Path:
        return self.path(key)  # immutable once renamed into place

    def _rebuild(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for sub in self.root.iterdir():
            if sub == self._tmp or not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(entry.name[:-len(SUFFIX)])
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime, key, st.st_size))
        now = time.time()
        for entry in os.scandir(self._tmp):
            try:
                if now - entry.stat().st_mtime > STALE_TMP_S:
                    os.unlink(entry.path)
            except OSError:
                pass
        for _, key, size in sorted(found):
            if not self._index.adopt(key, size):
                self._unlink(key)

    def _adopt(self, key: bytes) -> bool:
        """Index a chunk another process wrote after our start; True if it exists (and fits)."""
        try:
            size = self.path(key).stat().st_size
        except OSError:
            return False
        return self._index.adopt(key, size)

    def _evicted(self, key: bytes) -> None:
        """The index evicted `key` (under its lock): hand its bytes to the listener (demotion), then unlink it."""
        if key in self._writing:
            self._dropped.add(key)
            return
        if self._evict_listener is not None:
            try:
                blob = self.path(key).read_bytes()
            except OSError:
                blob = None
            if blob is not None:
                self._evict_listener(key, blob)
        self._unlink(key)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self._index or self._adopt(key) for key in keys]

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Ask the kernel to start reading these chunks now (POSIX_FADV_WILLNEED): the reads then overlap
        with decoding instead of queueing behind it."""
        fadvise([self.path(key) for key in keys], os.POSIX_FADV_WILLNEED)

    def get(self, key: bytes, meta: AccessMeta = NO_META) -> Blob | None:
        return self._read(key, None, meta)

    def get_into(self, key: bytes, scratch: Scratch, meta: AccessMeta = NO_META) -> memoryview | None:
        return self._read(key, scratch, meta)

    def open_ranged(self, key: bytes) -> FileRange | None:
        """The chunk's file, open for ranged reads (the vLLM loader reads a block-layout chunk one layer at a time,
        each piece copied on while in cache). The open fd keeps reading the same file even if it is replaced."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except OSError:
            if key not in self._writing:
                self._index.remove(key)
            return None
        try:
            size = os.fstat(fd).st_size
            with contextlib.suppress(OSError):
                os.utime(fd)
        except OSError:
            os.close(fd)
            return None
        if not self._index.touch(key, NO_META):
            self._adopt(key)
        return FileRange(fd, size)

    def _read(self, key: bytes, scratch: Scratch | None, meta: AccessMeta) -> Blob | None:
        try:
            # plain calls on an fd (no file object: fewer system calls per read, each one a GIL release). The read
            # asks for exactly the file's size: one read to EOF into the whole scratch buffer was slower (see
            # docs/design/measurements.md).
            fd = os.open(self.path(key), os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                blob: Blob | None = bytearray(size) if scratch is None else scratch.view(size)
                if os.preadv(fd, [blob], 0) != size:  # changed while read
                    blob = None
                with contextlib.suppress(OSError):
                    os.utime(fd)  # keeps LRU order across restarts
            finally:
                os.close(fd)
        except OSError:
            if key not in self._writing:  # gone (another process evicted or cleared it), not yet written
                self._index.remove(key)
            return None
        if blob is not None and not self._index.touch(key, meta):
            self._adopt(key)
        return blob

    def new_blob(self, size: int) -> memoryview:
        return self.pool.take(size)

    def put(self, key: bytes, blob: Blob, meta: AccessMeta = NO_META) -> bool:
        try:
            return self._put(key, blob, meta)
        finally:
            self.pool.give(blob)  # written (or refused): reused once nobody else holds it

    def _put(self, key: bytes, blob: Blob, meta: AccessMeta) -> bool:
        if not self._index.can_fit(len(blob)):
            return False
        with self._index.lock:
            was_resident = key in self._index
            if not self._index.add(key, len(blob), meta):  # refused, or a resident key that no longer fits
                if was_resident:
                    self._unlink(key)
                return False
            self._writing.add(key)
        is_written = self._write(key, blob)
        if not is_written and not self._tmp.is_dir() and self._recreate():
            with self._index.lock:  # the cache directory was deleted under us: booked again, written once more
                self._dropped.discard(key)
                is_written = self._index.add(key, len(blob), meta)
            is_written = is_written and self._write(key, blob)
        with self._index.lock:
            self._writing.discard(key)
            if key in self._dropped:  # evicted or deleted while we wrote it: the index forgot it already
                self._dropped.discard(key)
                self._unlink(key)
                return False
            if not is_written:
                self._index.remove(key)
        return is_written

    def _write(self, key: bytes, blob: Blob) -> bool:
        path = self.path(key)
        tmp = self._tmp / f"{key.hex()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            if not path.parent.is_dir():
                make_private_dir(path.parent, self.mode)
            with open(create_file(tmp, file_mode(self.mode)), "wb") as f:
                f.write(blob)
                if self.is_fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        return True

    def _recreate(self) -> bool:
        """The directory is gone (deleted while running): make it again; the index forgets what was in it."""
        try:
            make_private_dir(self._tmp, self.mode)
        except OSError:
            return False
        self._index.clear()
        self._events.add("directory_recreated")
        return True

    def _unlink(self, key: bytes) -> None:
        try:
            os.unlink(self.path(key))
        except OSError:
            pass

    def delete(self, key: bytes) -> bool:
        with self._index.lock:
            existed = self._index.remove(key)
            if key in self._writing:
                self._dropped.add(key)
        path = self.path(key)
        existed = existed or path.exists()
        self._unlink(key)
        return existed

    def clear(self) -> None:
        with self._index.lock:
            keys = self._index.keys()
            self._index.clear()
            self._dropped |= self._writing
        for key in keys:
            self._unlink(key)
        for sub in self.root.iterdir():  # also what other processes wrote
            if sub.is_dir() and sub != self._tmp:
                for entry in os.scandir(sub):
                    if entry.name.endswith(SUFFIX):
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)

    def close(self) -> None:
        self.pool.close()
