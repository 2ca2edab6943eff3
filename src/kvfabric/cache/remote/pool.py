"""The data-plane pool of `kvfabric server`: one file in /dev/shm of fixed-size slots, mapped by the server and by
every engine that uses it. A slot holds one chunk's KV [L, 2, H, T, D] in the layout dtype, contiguous.

    [0, 4096)   header: magic, slot_bytes, num_slots, pool id (16 random bytes), xxh3 of these
    [4096, ..)  num_slots slots of slot_bytes each

Contract:
- Only the server creates a pool (`SlotPool.create`): the file is built aside (mode 0600, space reserved with
  posix_fallocate so a full /dev/shm fails here and never as SIGBUS later), then renamed over the path. A
  restarted server makes a new file with a new id; a client still mapping the old one keeps valid memory (the old
  inode lives while mapped) and remaps when its next hello names another id. A pool file is never truncated.
- The server holds an exclusive flock on its pool file from creation (taken before the rename) until `close`; the
  kernel drops it when the process dies, even by SIGKILL. `SlotPool.reclaim(root)` (a server calls it at
  start) removes every `kvfabric-server-*` pool in `root` (and a creator's leftover temporary file) that no live
  server holds: a killed server's pool does not stay in /dev/shm for ever.
- `SlotPool.open(path, pool_id)` maps an existing pool and checks its header and id (PoolError otherwise).
- `tensor(slot, layout, num_tokens)` is a zero-copy view of a slot. Which slot may be read or written when is the
  server's business (leases); this module only maps bytes.
"""
from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import struct
from pathlib import Path

import torch
import xxhash

from kvfabric.kv.layout import KVLayout

MAGIC = b"KVFSRVP1"
HEADER = struct.Struct("<8sQQ16s")
HEADER_BYTES = 4096


class PoolError(RuntimeError):
    """The pool file is missing, damaged, another server's, or cannot be created."""


class SlotPool:
    def __init__(self, path: Path, mm: mmap.mmap, slot_bytes: int, num_slots: int, pool_id: bytes,
                 owner_fd: int = -1) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.pool_id = pool_id
        self._mm = mm
        self._owner_fd = owner_fd  # the server's: holds the flock that marks the pool as in use

    @classmethod
    def create(cls, path: str | os.PathLike, slot_bytes: int, num_slots: int) -> SlotPool:
        path = Path(path)
        if slot_bytes <= 0 or slot_bytes % 64 or num_slots <= 0:
            raise ValueError(f"need a positive slot size (a multiple of 64) and slot count, got {slot_bytes}, "
                             f"{num_slots}")
        pool_id = secrets.token_bytes(16)
        head = HEADER.pack(MAGIC, slot_bytes, num_slots, pool_id)
        size = HEADER_BYTES + slot_bytes * num_slots
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # ours from the start: `reclaim` never takes a pool being made
            os.fchmod(fd, 0o600)  # whatever the umask
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise PoolError(f"cannot reserve {size} bytes for the pool at {path}: {exc}") from None
            os.pwrite(fd, head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)), 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)  # no first-touch faults per slot
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            os.close(fd)
            raise
        return cls(path, mm, slot_bytes, num_slots, pool_id, owner_fd=fd)

    @staticmethod
    def reclaim(root: str | os.PathLike, prefix: str = "kvfabric-server-") -> list[Path]:
        """Remove the pools in `root` that no live server holds (see the contract); the paths removed."""
        removed = []
        for path in sorted(Path(root).glob(f"*{prefix}*")):
            if not (path.name.startswith(prefix) or (path.name.startswith(f".{prefix}") and
                                                     path.name.endswith(".tmp"))):
                continue
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live server: BlockingIOError
                if os.fstat(fd).st_ino == os.stat(path).st_ino:  # still the file we locked
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                pass
            finally:
                os.close(fd)
        return removed

    @classmethod
    def open(cls, path: str | os.PathLike, pool_id: bytes) -> SlotPool:
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise PoolError(f"cannot open the pool {path}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, HEADER.size + 8, 0)
            if size < HEADER_BYTES or len(head) < HEADER.size + 8:
                raise PoolError(f"{path}: not a pool (too short)")
            magic, slot_bytes, num_slots, found_id = HEADER.unpack_from(head)
            (stored,) = struct.unpack_from("<Q", head, HEADER.size)
            if magic != MAGIC or stored != xxhash.xxh3_64_intdigest(head[:HEADER.size]):
                raise PoolError(f"{path}: not a kvfabric server pool")
            if found_id != pool_id:
                raise PoolError(f"{path}: belongs to another server (restarted?)")
            if size != HEADER_BYTES + slot_bytes * num_slots:
                raise PoolError(f"{path}: size does not match its header")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)  # no first-touch faults per slot
        finally:
            os.close(fd)
        return cls(path, mm, slot_bytes, num_slots, pool_id)

    def tensor(self, slot: int, layout: KVLayout, num_tokens: int) -> torch.Tensor:
        """Slot `slot` as KV [L, 2, H, num_tokens, D] in the layout dtype (a view of the shared mapping)."""
        nbytes = layout.num_bytes(num_tokens)
        if not 0 <= slot < self.num_slots or nbytes > self.slot_bytes:
            raise ValueError(f"slot {slot} of {self.num_slots} cannot hold {nbytes} bytes ({self.slot_bytes} a slot)")
        flat = torch.frombuffer(self._mm, dtype=layout.torch_dtype, count=nbytes // layout.itemsize,
                                offset=HEADER_BYTES + slot * self.slot_bytes)
        return flat.view(layout.shape(num_tokens))

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes when the last one does
            self._mm.close()
        if self._owner_fd >= 0:
            os.close(self._owner_fd)  # the flock goes with it
            self._owner_fd = -1

    def unlink(self) -> None:
        """Remove the file (the server, at shutdown); mappings stay valid until closed."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
