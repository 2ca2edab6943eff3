"""The arena: this process's handle on the pool file: its mapping, the writers' lock, and the data copies.

Contract:
- `current` is the `Index` of the mapping in use (index.py), replaced as one object on a remap: readers take it
  once per operation. `refresh()` returns it after following a pool that another process replaced (a new inode:
  map the new file), or None when the arena is closed or the pool cannot be reached. A process that replaces
  the pool first sets the old file's superseded flag, so the others follow on their next operation; a file
  removed or replaced by hand is noticed within `recheck_s`.
- Writers hold `locked()`: `fcntl.flock` on `<root>/kvfabric-<name>.lock` (the kernel releases it when a process
  dies, even by SIGKILL) plus a thread lock, reentrant within a thread. A writer waits at most `lock_timeout_s`,
  then gets ShmLockTimeout: a stopped process holding the lock must not hang every other writer.
- One arena per process and pool name: a forked child gets its own lock file description and fresh thread locks
  automatically (`_after_fork_in_child`).
- Opening validates the header and every entry (bad entries are retired, overlapping extents reset the pool). A
  header with a bad magic, version, checksum or size, or a budget that differs from this arena's, is replaced
  by a fresh pool (with a warning): the new file is built aside and renamed over the old one, so processes
  still mapping the old file never fault; they notice the new inode and remap.
- Space for the whole file is reserved at creation (posix_fallocate), so a full /dev/shm fails the constructor
  with ShmPoolError instead of killing a writer with SIGBUS later.
- `write` copies a blob into the data region (lock held); `read` copies one out into a private object or the
  caller's scratch buffer: nothing handed out points into the mapping. A private copy of POOLED_COPY_BYTES or
  more goes into a recycled buffer (`BlobPool`, at most COPY_POOL_BYTES kept free): one a caller still holds is
  never handed out again, one it dropped is reused, so a steady stream of reads faults no fresh pages in (a copy
  into a fresh buffer ran well below one into a reused buffer: docs/design/measurements.md).
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
from collections.abc import Iterator
from pathlib import Path

from kvfabric.host.pages import Scratch
from kvfabric.host.permissions import PRIVATE_FILE, check_mode
from kvfabric.observe.counters import Counters
from kvfabric.tiers.base import Blob
from kvfabric.tiers.pool import BlobPool
from kvfabric.tiers.shm.coherence import CacheOps
from kvfabric.tiers.shm.index import EntryRef, Index
from kvfabric.tiers.shm.layout import SUPERSEDED_AT, U64, Geometry, default_num_slots

log = logging.getLogger("kvfabric.tiers.shm")

DEFAULT_ROOT = "/dev/shm"
POOLED_COPY_BYTES = 1 << 20  # from here on `read` copies into a recycled buffer instead of a fresh heap object
COPY_POOL_BYTES = 256 << 20  # free copy buffers kept for reuse (at least two, whatever their size)


class ShmPoolError(RuntimeError):
    """The pool cannot be created (e.g. not enough space in /dev/shm)."""


class ShmLockTimeout(ShmPoolError):
    """The writers' lock stayed busy past the timeout (e.g. a stopped process holds it)."""


# Fork hooks are process-wide, so the arenas a child must fix up are found through this weak set.
_LIVE_ARENAS: weakref.WeakSet[Arena] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for arena in list(_LIVE_ARENAS):
        arena._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Arena:
    def __init__(self, name: str, capacity_bytes: int, *, root: str | os.PathLike, num_slots: int | None,
                 lock_timeout_s: float, counters: Counters, ops: CacheOps | None = None, recheck_s: float = 1.0,
                 strict_permissions: bool = False) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"pool name must be a plain file name, got {name!r}")
        if num_slots is not None and (num_slots < 8 or num_slots & (num_slots - 1)):
            raise ValueError(f"num_slots must be a power of two >= 8, got {num_slots}")
        self.name = name
        self.root = Path(root)
        self.path = self.root / f"kvfabric-{name}"
        self.lock_path = self.root / f"kvfabric-{name}.lock"
        self._path_str = str(self.path)
        self.capacity_bytes = capacity_bytes
        self.lock_timeout_s = lock_timeout_s
        self.counters = counters
        self.ops = ops or CacheOps()
        self.current: Index | None = None
        self._copies = BlobPool(lambda: COPY_POOL_BYTES)
        self._want = Geometry(num_slots or default_num_slots(capacity_bytes), capacity_bytes)
        self._tlock = threading.RLock()
        self._lock_depth = 0
        self._ident: tuple[int, int] = (0, 0)
        self.recheck_s = recheck_s
        self._recheck_at = 0.0  # refresh() stats the path from then on
        self._closed = False
        self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            with self.locked(timeout_s=max(30.0, lock_timeout_s)):
                self._open(strict=True)
            for path, what in ((self.path, "shm pool"), (self.lock_path, "shm pool lock file")):
                check_mode(path, PRIVATE_FILE, what, strict_permissions)  # made 0600; one made by hand may not be
        except BaseException:
            os.close(self._lock_fd)
            raise
        _LIVE_ARENAS.add(self)

    @staticmethod
    def destroy(name: str, root: str | os.PathLike = DEFAULT_ROOT) -> None:
        """Remove a pool's files. Only when no process uses the pool: one still running keeps its mapping and the
        old lock file, so it would no longer exclude writers that open the pool afresh."""
        for suffix in ("", ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(Path(root) / f"kvfabric-{name}{suffix}")

    # ---- the writers' lock ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self, timeout_s: float | None = None) -> Iterator[None]:
        """This process's thread lock, then flock on the pool's lock file. Raises ShmLockTimeout after
        `timeout_s` (default `lock_timeout_s`)."""
        self.acquire(timeout_s)
        try:
            yield
        finally:
            self.release()

    def acquire(self, timeout_s: float | None = None) -> None:
        """`locked()`'s entry, for the put's fast path (a generator's frames cost a put's hot path more than the
        locking itself); every acquire is paired with one `release`."""
        timeout_s = self.lock_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if not self._tlock.acquire(timeout=timeout_s):
            raise ShmLockTimeout(f"{self.lock_path}: busy in this process for {timeout_s} s")
        if self._lock_depth:
            self._lock_depth += 1
            return
        try:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._wait_for_flock(deadline, timeout_s)
        except BaseException:
            self._tlock.release()
            raise
        self._lock_depth = 1

    def _wait_for_flock(self, deadline: float, timeout_s: float) -> None:
        delay = 50e-6
        while True:
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ShmLockTimeout(f"{self.lock_path}: held by another process for {timeout_s} s") from None

    def release(self) -> None:
        try:
            self._lock_depth -= 1
            if self._lock_depth == 0:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            self._tlock.release()

    def _after_fork_in_child(self) -> None:
        """flock is per open file description (an inherited fd would share the parent's lock), and another
        thread may have held the thread lock (or the copy pool's) at fork time."""
        self._tlock = threading.RLock()
        self._lock_depth = 0
        self._copies = BlobPool(lambda: COPY_POOL_BYTES)
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    # ---- the mapping ---------------------------------------------------------------------------------------
    @property
    def is_closed(self) -> bool:
        return self._closed

    def refresh(self) -> Index | None:
        """The current index, after following a pool that another process replaced; None if unreachable.
        The path is stat'ed once the mapping's superseded flag is set (a process that replaces the pool sets it
        in the old file first), else at most every `recheck_s` (a file removed by hand is followed then): a stat
        on every operation cost as much as the rest of a small read's index work (docs/design/measurements.md)."""
        if self._closed:
            return None
        index = self.current
        try:
            if index is not None and time.monotonic() < self._recheck_at and not index.is_superseded():
                return index
        except ValueError:  # closed under us by close()
            return None
        try:
            st = os.stat(self._path_str)
            if (st.st_dev, st.st_ino) == self._ident and index is not None:
                self._recheck_at = time.monotonic() + self.recheck_s
                return index
        except FileNotFoundError:
            pass
        try:
            with self.locked():
                self._open(strict=False)
        except (OSError, ShmPoolError) as exc:
            log.warning("shared-memory pool %s unavailable: %s", self.path, exc)
            return None
        self.counters.add("remapped")
        return self.current

    def _open(self, strict: bool) -> None:
        """Map the pool file, creating or replacing it when needed (lock held). strict: the budget must be ours."""
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
                # populated: the page tables of the whole (fallocated) pool are filled now, at attach, so no read
                # or write of a chunk pays first-touch faults (they cost as much as the copy itself)
                mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            finally:
                os.close(fd)
            geo = Geometry.parse(mm, st.st_size)
            if isinstance(geo, Geometry) and strict and geo.capacity != self._want.capacity:
                geo = f"pool budget {geo.capacity} bytes differs from the configured {self._want.capacity}"
            if isinstance(geo, str):
                problem: str | None = geo
            else:
                index = Index(mm, geo, self.counters, self.ops)
                problem = index.validate()
            if problem is not None:
                log.warning("shared-memory pool %s is unusable (%s); replacing it with a fresh pool", self.path,
                            problem)
                self.counters.add("pool_reset")
                self._supersede(mm)
                self._replace()
                continue
            # The old mapping is not closed here: a reader in another thread may still copy from it;
            # refcounting unmaps it once the last reader lets go.
            self.current = index
            self._ident = (st.st_dev, st.st_ino)
            self._recheck_at = time.monotonic() + self.recheck_s
            self.capacity_bytes = index.geo.capacity
            return

    def _format(self, fd: int, geo: Geometry) -> None:
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

    def _supersede(self, mm: mmap.mmap) -> None:
        """Set the superseded flag of a pool file about to be replaced: processes mapping it stat the path on
        their next operation and follow the new file (without the flag they stat only every `recheck_s`)."""
        if len(mm) >= SUPERSEDED_AT + U64.size:
            U64.pack_into(mm, SUPERSEDED_AT, 1)
            self.ops.flush(mm, SUPERSEDED_AT, U64.size)
            self.ops.fence()

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

    # ---- data ------------------------------------------------------------------------------------------------
    def write(self, index: Index, offset: int, blob: memoryview) -> None:
        """Copy a blob into the data region of the index's mapping (one memcpy; lock held)."""
        start = index.geo.data_offset + offset
        index.mm[start:start + len(blob)] = blob
        self.ops.flush(index.mm, start, len(blob))  # the payload in memory before the entry that publishes it
        self.ops.fence()

    def read(self, index: Index, ref: EntryRef, scratch: Scratch | None) -> Blob:
        """A copy of the entry's bytes: into `scratch` (a view valid until it is reused), else a private object
        (`bytes`; from POOLED_COPY_BYTES a recycled buffer). The caller checks `index.is_current(ref)` after."""
        mm, start, length = index.mm, index.geo.data_offset + ref.offset, ref.length
        self.ops.invalidate(mm, start, length)
        if scratch is None and length < POOLED_COPY_BYTES:
            return mm[start:start + length]  # one memcpy into a private bytes object
        blob = self._copies.take(length) if scratch is None else scratch.view(length)
        with memoryview(mm) as arena:
            blob[:] = arena[start:start + length]  # one memcpy into a reused buffer
        if scratch is None:
            self._copies.give(blob)  # free for reuse once the caller drops it (the pool checks before reuse)
        return blob

    def view(self, index: Index, ref: EntryRef) -> memoryview:
        """The entry's bytes in place (read-only, no copy); the caller checks `index.is_current(ref)` after use."""
        start = index.geo.data_offset + ref.offset
        self.ops.invalidate(index.mm, start, ref.length)
        return memoryview(index.mm)[start:start + ref.length].toreadonly()

    def close(self) -> None:
        """Unmap the pool; its contents stay for other and later processes."""
        with self._tlock:
            self._closed = True
            index, self.current = self.current, None
            if index is not None:
                index.release()
                with contextlib.suppress(BufferError):  # still exported (a numpy view alive): GC unmaps it
                    index.mm.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
        self._copies.close()
