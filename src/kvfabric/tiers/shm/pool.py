"""The pool file: creating, mapping, validating and replacing it, and the writers' lock.

Contract:
- Writers hold `fcntl.flock` on `<root>/kvfabric-<name>.lock` (the kernel releases it when a process dies, even by
  SIGKILL) plus a thread lock (`_locked`, reentrant within a thread). A writer waits at most `lock_timeout_s`,
  then gets ShmLockTimeout: a stopped process holding the lock must not hang every other writer.
- One pool object per process and pool name: a forked child gets its own lock file description and fresh thread
  locks automatically (`_after_fork_in_child`).
- The pool survives process restarts: opening validates the header and every entry (bad entries are retired,
  overlapping extents reset the pool). A header with a bad magic, version, checksum or size, or a budget that
  differs from this tier's, is replaced by a fresh pool (with a warning): the new file is built aside and renamed
  over the old one, so processes still mapping the old file never fault; they notice the new inode and remap
  (`_refresh`, called by every operation).
- Space for the whole file is reserved at creation (posix_fallocate), so a full /dev/shm fails the constructor
  with ShmPoolError instead of killing a writer with SIGBUS later.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvfabric.tiers.shm.index import _PoolIndex
from kvfabric.tiers.shm.layout import (_ENTRY, _STATS, ALIGN, KEY_AT, MAX_KEY_BYTES, READY, STATS_AT, TOMBSTONE,
                                       _Geometry, _entry_sum, default_num_slots)

log = logging.getLogger("kvfabric.tiers.shm")  # the package's logger, as before the split into modules

DEFAULT_ROOT = "/dev/shm"


class ShmPoolError(RuntimeError):
    """The pool cannot be created (e.g. not enough space in /dev/shm)."""


class ShmLockTimeout(ShmPoolError):
    """The writers' lock stayed busy past the timeout (e.g. a stopped process holds it)."""


_INSTANCES: weakref.WeakSet[_ShmPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child gets its own lock file description (flock is per open file description: an inherited fd
    would share the parent's lock) and fresh thread locks (another thread may have held them at fork time)."""
    for tier in list(_INSTANCES):
        tier._tlock = threading.RLock()
        tier._lock_depth = 0
        if tier._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(tier._lock_fd)
            tier._lock_fd = os.open(tier.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


os.register_at_fork(after_in_child=_after_fork_in_child)


class _ShmPool(_PoolIndex):
    """One process's handle on a pool file: its mapping, its lock, and the checks that make a mapping usable."""

    def __init__(self, name: str, capacity_bytes: int, *, root: str | os.PathLike, num_slots: int | None,
                 lock_timeout_s: float) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"pool name must be a plain file name, got {name!r}")
        if num_slots is not None and (num_slots < 8 or num_slots & (num_slots - 1)):
            raise ValueError(f"num_slots must be a power of two >= 8, got {num_slots}")
        self.pool_name = name
        self.root = Path(root)
        self.path = self.root / f"kvfabric-{name}"
        self.lock_path = self.root / f"kvfabric-{name}.lock"
        self._path_str = str(self.path)
        self.capacity_bytes = capacity_bytes
        self.lock_timeout_s = lock_timeout_s
        self.counters: Counter[str] = Counter()
        self._want = _Geometry(num_slots or default_num_slots(capacity_bytes), capacity_bytes)
        self._tlock = threading.RLock()
        self._lock_depth = 0
        self._map: tuple[mmap.mmap, _Geometry] | None = None  # replaced as one object: readers snapshot it
        self._ident: tuple[int, int] = (0, 0)
        self._closed = False
        self._stats = [0, 0, 0]  # live_bytes, live_count, used_slots: valid while writing (see _writing)
        self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            with self._locked(timeout_s=max(30.0, lock_timeout_s)):
                self._open(strict=True)
        except BaseException:
            os.close(self._lock_fd)
            raise
        _INSTANCES.add(self)

    @staticmethod
    def destroy(name: str, root: str | os.PathLike = DEFAULT_ROOT) -> None:
        """Remove a pool's files. Only when no process uses the pool: one still running keeps its mapping and the
        old lock file, so it would no longer exclude writers that open the pool afresh."""
        for suffix in ("", ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(Path(root) / f"kvfabric-{name}{suffix}")

    # ---- open / create / validate (lock held) --------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, timeout_s: float | None = None) -> Iterator[None]:
        """The writers' lock: this process's thread lock, then flock on the pool's lock file. Raises
        ShmLockTimeout after `timeout_s` (default `lock_timeout_s`): a stopped process holding the lock must not
        hang every other writer; the write is then dropped."""
        timeout_s = self.lock_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if not self._tlock.acquire(timeout=timeout_s):
            raise ShmLockTimeout(f"{self.lock_path}: busy in this process for {timeout_s} s")
        try:
            if self._lock_depth:
                self._lock_depth += 1
                try:
                    yield
                finally:
                    self._lock_depth -= 1
                return
            delay = 50e-6
            while True:
                try:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise ShmLockTimeout(f"{self.lock_path}: held by another process for {timeout_s} s") from None
                    time.sleep(delay)
                    delay = min(delay * 2, 2e-3)
            self._lock_depth = 1
            try:
                yield
            finally:
                self._lock_depth = 0
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            self._tlock.release()

    def _open(self, strict: bool) -> None:
        """Map the pool file, creating or replacing it when needed. strict: the budget must be ours."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise ShmPoolError(f"cannot open shared-memory pool {self.path}: {exc}") from exc
            try:
                st = os.fstat(fd)
                if st.st_size == 0:  # new (or its creator died before sizing it): nobody can be using it
                    self._format(fd, self._want)
                    st = os.fstat(fd)
                mm = mmap.mmap(fd, st.st_size)
            finally:
                os.close(fd)
            geo = _Geometry.parse(mm, st.st_size)
            if isinstance(geo, _Geometry) and strict and geo.capacity != self._want.capacity:
                geo = f"pool budget {geo.capacity} bytes differs from the configured {self._want.capacity}"
            if isinstance(geo, str):
                log.warning("shared-memory pool %s is unusable (%s); replacing it with a fresh pool", self.path, geo)
                mm.close()
                self.counters["pool_reset"] += 1
                self._replace()
                continue
            self._set_mapping(mm, geo, (st.st_dev, st.st_ino))
            problem = self._validate()
            if problem:
                log.warning("shared-memory pool %s index is inconsistent (%s); replacing it with a fresh pool",
                            self.path, problem)
                self.counters["pool_reset"] += 1
                self._replace()
                continue
            return

    def _format(self, fd: int, geo: _Geometry) -> None:
        try:
            os.ftruncate(fd, geo.file_bytes)
            os.posix_fallocate(fd, 0, geo.file_bytes)  # reserve tmpfs pages now: no SIGBUS on a full /dev/shm later
        except OSError as exc:
            os.ftruncate(fd, 0)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise ShmPoolError(f"not enough space in {self.root} for a {geo.file_bytes}-byte pool "
                                   f"(capacity {geo.capacity}); lower shm.capacity or enlarge {self.root}") from exc
            raise
        os.pwrite(fd, geo.header(), 0)  # the index is all zeros (EMPTY) already

    def _replace(self) -> None:
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            self._format(fd, self._want)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, self.path)

    def _set_mapping(self, mm: mmap.mmap, geo: _Geometry, ident: tuple[int, int]) -> None:
        # The old mapping is not closed here: a reader in another thread may still copy from it; refcounting
        # unmaps it once the last reader lets go.
        self._map = (mm, geo)
        self._ident = ident
        self.capacity_bytes = geo.capacity

    def _validate(self) -> str | None:
        """Retire bad entries; report what makes the whole index unusable."""
        self._repair()
        index = self._index()
        ready = np.flatnonzero(index["state"] == READY)
        bad_state = np.flatnonzero(index["state"] > TOMBSTONE)
        geo = self._geo
        for slot in bad_state.tolist():
            self._retire(slot, TOMBSTONE)
        offsets, lengths = index["offset"][ready], index["length"][ready]
        del index
        good = []
        for slot, off, length in zip(ready.tolist(), offsets.tolist(), lengths.tolist()):
            seq, state, key_len, _, _, _, esum = _ENTRY.unpack_from(self._mm, self._base(slot))
            key = self._mm[self._base(slot) + KEY_AT:self._base(slot) + KEY_AT + min(key_len, MAX_KEY_BYTES)]
            if (key_len > MAX_KEY_BYTES or off % ALIGN or off + length > geo.data_bytes
                    or esum != _entry_sum(seq, state, key_len, off, length, key)):
                self._retire(slot, TOMBSTONE)
                self.counters["bad_entries"] += 1
            else:
                good.append((off, off + length))
        good.sort()
        for (_, end), (start, _) in zip(good, good[1:]):
            if start < end:
                return "overlapping extents"
        self._rebuild_extents()
        _STATS.pack_into(self._mm, STATS_AT, 0, *self._recount())
        return None

    def _refresh(self) -> bool:
        """Follow a pool that another process replaced; False if the pool cannot be reached."""
        if self._closed:
            return False
        try:
            st = os.stat(self._path_str)
            if (st.st_dev, st.st_ino) == self._ident and self._map is not None:
                return True
        except FileNotFoundError:
            pass
        try:
            with self._locked():
                self._open(strict=False)
        except (OSError, ShmPoolError) as exc:
            log.warning("shared-memory pool %s unavailable: %s", self.path, exc)
            return False
        self.counters["remapped"] += 1
        return True
