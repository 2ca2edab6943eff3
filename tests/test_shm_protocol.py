"""The shm pool's publish protocol (tiers/shm/__init__.py): the non-coherent mode's flushes, fences and
invalidations in the right order, checked with a recording shim of the primitives (the only fake here), and a
writer SIGKILLed at each step of a put: a reader never sees a torn blob, the next writer recovers."""
from __future__ import annotations

import os
import signal
import struct

from kvfabric.config import ShmTierConfig
from kvfabric.tiers.shm import ShmTier
from kvfabric.tiers.shm.coherence import CacheOps, MsyncCacheOps
from kvfabric.tiers.shm.layout import ENTRY_BYTES, READY, SEQ, STATS_AT, SUPERSEDED_AT
from tests.redis_fixtures import make_blob
from tests.test_shm_tier import FORK, entry_base, key_of, pool_name  # noqa: F401 - pool_name is a fixture

HEAD = struct.Struct("<QI")  # an entry's seq and state; the header's dirty flag is the first u64 at STATS_AT
CAPACITY = 1 << 20


class Recorder(CacheOps):
    """Records each primitive call with the first 12 bytes of the range as they are at the call."""
    is_coherent = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, bytes]] = []

    def flush(self, mm, start: int, length: int) -> None:
        self.calls.append(("flush", start, length, bytes(mm[start:start + 12])))

    def fence(self) -> None:
        self.calls.append(("fence", 0, 0, b""))

    def invalidate(self, mm, start: int, length: int) -> None:
        self.calls.append(("invalidate", start, length, b""))


def _position(calls, op: str, start: int, length: int, match=lambda head: True) -> int:
    found = [i for i, (name, s, n, head) in enumerate(calls) if (name, s, n) == (op, start, length) and match(head)]
    assert found, f"no {op}({start}, {length}) in {[(c[0], c[1], c[2]) for c in calls]}"
    return found[0]


def test_put_flushes_payload_and_entry_before_the_publish_flag(pool_name):
    recorder = Recorder()
    tier = ShmTier(pool_name, CAPACITY, ops=recorder)
    key, blob = key_of(1), make_blob(key_of(1), 3000)
    assert tier.put(key, blob)
    calls = list(recorder.calls)
    index = tier.arena.current
    ref = index.find(key)
    base, payload = entry_base(index, ref.slot), index.geo.data_offset + ref.offset
    # a writer under the lock re-reads only the writers' state in the header (another writer may have changed it)
    # and the superseded flag (a process that replaced the pool file set it: arena.refresh)
    assert {(start, length) for name, start, length, _ in calls if name == "invalidate"} == \
        {(STATS_AT, 32), (SUPERSEDED_AT, 8)}
    dirty_on = _position(calls, "flush", STATS_AT, 32, lambda head: head[:8] != bytes(8))
    data = _position(calls, "flush", payload, len(blob))
    fields = _position(calls, "flush", base, ENTRY_BYTES,
                       lambda head: HEAD.unpack(head)[0] & 1 and HEAD.unpack(head)[1] == READY)
    publish = _position(calls, "flush", base, SEQ.size, lambda head: HEAD.unpack(head)[0] == ref.seq)
    dirty_off = len(calls) - 2
    assert calls[dirty_off][1:3] == (STATS_AT, 32) and calls[dirty_off][3][:8] == bytes(8)
    assert dirty_on < data < fields < publish < dirty_off
    for i in (dirty_on, data, fields, publish, dirty_off):
        assert calls[i + 1][0] == "fence"  # each write-back is ordered before the next store
    # the entry's final seq is stored only after the fence that follows the fields' flush
    assert HEAD.unpack(calls[fields][3])[0] == ref.seq - 1
    tier.close()


def test_read_invalidates_entry_then_payload_then_rechecks_the_seq(pool_name):
    writer = ShmTier(pool_name, CAPACITY)
    key, blob = key_of(2), make_blob(key_of(2), 5000)
    assert writer.put(key, blob)
    recorder = Recorder()
    reader = ShmTier(pool_name, CAPACITY, ops=recorder)
    index = reader.arena.current
    ref = index.find(key)
    base, payload = entry_base(index, ref.slot), index.geo.data_offset + ref.offset
    recorder.calls.clear()
    assert bytes(reader.get(key)) == bytes(blob)
    calls = [(name, start, length) for name, start, length, _ in recorder.calls]
    assert all(name == "invalidate" for name, _, _ in calls)  # a reader writes nothing back
    entry = calls.index(("invalidate", base, ENTRY_BYTES))
    data = calls.index(("invalidate", payload, len(blob)))
    recheck = calls.index(("invalidate", base, SEQ.size))
    assert entry < data < recheck
    reader.close()
    writer.close()


def test_non_coherent_mode_round_trips_with_real_msync(pool_name, tmp_path):
    config = ShmTierConfig(name=pool_name, capacity=CAPACITY, root=str(tmp_path), coherent=False)
    tier = ShmTier.from_config(config)  # a pool in a file outside /dev/shm: msync writes it back
    assert isinstance(tier.arena.ops, MsyncCacheOps) and (tmp_path / f"kvfabric-{pool_name}").exists()
    key, blob = key_of(3), make_blob(key_of(3), 10_000)
    assert tier.put(key, blob) and bytes(tier.get(key)) == bytes(blob)
    assert tier.delete(key) and tier.get(key) is None
    tier.close()
    ShmTier.destroy(pool_name, tmp_path)


class KillAt(CacheOps):
    """SIGKILLs this process at its n-th flush or fence: a writer dying between two protocol steps."""
    is_coherent = False

    def __init__(self, n: int) -> None:
        self.n = n

    def _step(self) -> None:
        self.n -= 1
        if self.n == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def flush(self, mm, start: int, length: int) -> None:
        self._step()

    def fence(self) -> None:
        self._step()


def _child_put(name: str, n: int, key: bytes, blob: bytes) -> None:
    ShmTier(name, CAPACITY, ops=KillAt(n)).put(key, blob)


def test_writer_killed_at_each_protocol_step_never_leaves_a_torn_read(pool_name):
    key, old, new = key_of(4), bytes(make_blob(key_of(4), 4000, seed=1)), bytes(make_blob(key_of(4), 4000, seed=2))
    recorder = Recorder()
    probe = ShmTier(pool_name, CAPACITY, ops=recorder)
    assert probe.put(key, old)
    recorder.calls.clear()
    assert probe.put(key, old)  # a put over a held key: every step of the protocol, retire included
    num_steps = sum(name in ("flush", "fence") for name, *_ in recorder.calls)
    probe.close()
    assert num_steps >= 12
    seen = set()
    for n in range(1, num_steps + 2):
        writer = ShmTier(pool_name, CAPACITY)
        assert writer.put(key, old)
        writer.close()
        child = FORK.Process(target=_child_put, args=(pool_name, n, key, new), daemon=True)
        child.start()
        child.join(20)
        assert child.exitcode == (-signal.SIGKILL if n <= num_steps else 0), n
        reader = ShmTier(pool_name, CAPACITY)
        got = reader.get(key)
        got = None if got is None else bytes(got)
        assert got in (None, old, new), f"torn read after a kill at step {n}"
        seen.add("miss" if got is None else "old" if got == old else "new")
        assert reader.put(key_of(5), old) and bytes(reader.get(key_of(5))) == old  # the next writer recovers
        assert reader.put(key, new) and bytes(reader.get(key)) == new
        reader.close()
    assert seen == {"miss", "old", "new"}  # the kills landed before, inside and after the critical window
