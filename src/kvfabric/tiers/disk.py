"""Disk tier: one file per chunk under a directory, size-bounded LRU, atomic writes, shared across processes.

Contract:
- A chunk lives at `<root>/<key hex[:2]>/<key hex>.kvc`; it is written to `<root>/tmp/` and renamed into place
  (os.replace is atomic), so a reader never sees a half-written file under a chunk's name; a crash leaves only
  a temp file, removed at the next start once it is old.
- On start the index is rebuilt from the directory, oldest access first (mtime; reads touch it), so a restarted
  process finds and evicts what earlier processes stored. A key unknown to the index is looked up on disk before
  answering "absent", so chunks written by another process after our start are found.
- Not trusted: the stack verifies every blob read from here (checksums), so a damaged file is a counted miss.
- Bytes on disk beyond `capacity_bytes` are evicted LRU-first, except pinned keys.
- A directory deleted while running is made again by the next put (the index starts over); a full file system
  makes puts fail (False, counted by the stack) until there is room again.
"""
from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvfabric.tiers.base import Blob, IndexedTier, LRUIndex, Scratch

SUFFIX = ".kvc"
STALE_TMP_S = 3600.0


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


class DiskTier(IndexedTier):
    name = "disk"
    is_trusted = False
    is_read_only = False
    is_persistent = True
    is_shared = True  # every process using the same directory
    honors_capacity = True  # the bytes this process knows of; another process sharing the directory has its own
    honors_pins = True

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, fsync: bool = False) -> None:
        self.root = Path(root).expanduser()
        self.capacity_bytes = capacity_bytes
        self.is_fsync = fsync
        self._tmp = self.root / "tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._index = LRUIndex(capacity_bytes)
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
            for victim in self._index.add(key, size):
                self._unlink(victim)

    def _adopt(self, key: bytes) -> bool:
        """Index a chunk another process wrote after our start; True if it exists."""
        try:
            size = self.path(key).stat().st_size
        except OSError:
            return False
        for victim in self._index.add(key, size):
            self._unlink(victim)
        return True

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self._index or self._adopt(key) for key in keys]

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Ask the kernel to start reading these chunks now (POSIX_FADV_WILLNEED): the reads then overlap
        with decoding instead of queueing behind it."""
        fadvise([self.path(key) for key in keys], os.POSIX_FADV_WILLNEED)

    def get(self, key: bytes) -> Blob | None:
        return self._read(key, None)

    def get_into(self, key: bytes, scratch: Scratch) -> memoryview | None:
        return self._read(key, scratch)

    def _read(self, key: bytes, scratch: Scratch | None) -> Blob | None:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                blob = bytearray(size) if scratch is None else scratch.view(size)
                num_read = f.readinto(blob)
        except OSError:
            self._index.remove(key)
            return None
        if num_read != size:
            return None
        if not self._index.touch(key):
            self._adopt(key)
        try:
            os.utime(path)  # keeps LRU order across restarts
        except OSError:
            pass
        return blob

    def put(self, key: bytes, blob: Blob) -> bool:
        if not self._index.can_fit(len(blob)):
            return False
        if not self._write(key, blob):
            if self._tmp.is_dir() or not self._recreate():
                return False
            if not self._write(key, blob):  # the cache directory was deleted under us: once more, recreated
                return False
        for victim in self._index.add(key, len(blob)):
            self._unlink(victim)
        return True

    def _write(self, key: bytes, blob: Blob) -> bool:
        path = self.path(key)
        tmp = self._tmp / f"{key.hex()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
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
            self._tmp.mkdir(parents=True, exist_ok=True)
        except OSError:
            return False
        self._index.clear()
        self.counters.add("directory_recreated")
        return True

    def _unlink(self, key: bytes) -> None:
        try:
            os.unlink(self.path(key))
        except OSError:
            pass

    def delete(self, key: bytes) -> bool:
        existed = self._index.remove(key)
        path = self.path(key)
        existed = existed or path.exists()
        self._unlink(key)
        return existed

    def clear(self) -> None:
        for key in self._index.keys():
            self._unlink(key)
        self._index.clear()
        for sub in self.root.iterdir():  # also what other processes wrote
            if sub.is_dir() and sub != self._tmp:
                for entry in os.scandir(sub):
                    if entry.name.endswith(SUFFIX):
                        os.unlink(entry.path)

    def close(self) -> None:
        pass
