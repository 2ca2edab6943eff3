"""Benchmarks of the shared tiers (shm pool, Redis), each beside a raw baseline of the same bytes in the same run.

- redis: the tier's put / get vs raw redis-py SET / GET of the same bytes on the same server (its own client);
  with `seal`, also the sealed tier (tiers/sealed.py: AES-256-GCM) vs the plain tier, rows with `sealed: true`
  and `ratio_vs_unsealed` (target >= 0.8);
- shm: store = tier.put vs a memcpy of the same bytes into a preallocated buffer, in this process; retrieve = a
  read *from another process* (the point of the pool) vs a memcpy of the same bytes in that process, both through
  `get_into` (the stack's fast path: a reused buffer) and through `get` (a fresh private copy each time).
Sizes are one chunk of each benchmark layout (256 tokens): SmolLM2-135M 5.9 MB, Llama-8B-like 33.6 MB.
Times are medians of `repeats` runs, ours and baseline alternated (order too). `gbps` is GB/s. The shm rows carry
`huge_pages`: the `huge=` option of the tmpfs that holds the pool (`never` unless the host mounts it otherwise). With
4 KiB pages a copy into the pool is slower than the baseline's copy into numpy memory (which numpy advises onto
2 MiB pages); the configuration page of the docs says how to give the pool huge pages.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import uuid
import warnings
from collections.abc import Mapping

import numpy as np

from kvfabric.bench.common import paired
from kvfabric.codec.format import HEADER_BYTES

SIZES: dict[str, int] = {"smollm2-135m": 30 * 2 * 3 * 256 * 64 * 2 + HEADER_BYTES,   # 5.9 MB
                         "llama-8b": 32 * 2 * 8 * 256 * 128 * 2 + HEADER_BYTES}      # 33.6 MB


def _row(tier: str, op: str, layout: str, num_bytes: int, seconds: float, base_seconds: float, baseline: str) -> dict:
    gbps, base = num_bytes / seconds / 1e9, num_bytes / base_seconds / 1e9
    return {"tier": tier, "op": op, "layout": layout, "mb": round(num_bytes / 1e6, 1),
            "size_mb": round(num_bytes / 1e6, 1), "gbps": round(gbps, 3), "baseline_gbps": round(base, 3),
            "ratio": float(f"{gbps / base:.3g}"), "baseline": baseline}


def tmpfs_huge_option(path: str, mounts: str = "/proc/mounts") -> str:
    """The `huge=` option of the tmpfs mount holding `path` ("never" when unset; "" when not tmpfs or unknown)."""
    try:
        with open(mounts) as f:
            rows = [line.split() for line in f]
    except OSError:
        return ""
    real, best = os.path.realpath(path), None
    for row in rows:
        if len(row) >= 4 and (real == row[1] or real.startswith(row[1].rstrip("/") + "/")):
            if best is None or len(row[1]) >= len(best[1]):  # the innermost mount point wins
                best = row
    if best is None or best[2] != "tmpfs":
        return ""
    return next((opt[5:] for opt in best[3].split(",") if opt.startswith("huge=")), "never")


def _sizes(sizes: Mapping[str, int] | tuple | list | None) -> list[tuple[str, int]]:
    if sizes is None:
        return list(SIZES.items())
    if isinstance(sizes, Mapping):
        return [(str(name), int(size)) for name, size in sizes.items()]
    return [(f"{size / 1e6:.1f} MB", int(size)) for size in sizes]


def _payload(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


# ---- redis -------------------------------------------------------------------------------------------------
def bench_redis(url: str, sizes: Mapping[str, int] | tuple | list | None = None, repeats: int = 3,
                is_cluster: bool = False, timeout_s: float = 2.0, seal: bool = False) -> list[dict]:
    import redis

    from kvfabric.tiers.redis import RedisTier

    if is_cluster:
        raw = redis.cluster.RedisCluster.from_url(url, socket_timeout=30)
    else:
        raw = redis.Redis.from_url(url, socket_timeout=30)
    tier = RedisTier(url, is_cluster=is_cluster, timeout_s=timeout_s)
    rows: list[dict] = []
    try:
        for name, size in _sizes(sizes):
            blob = _payload(size, seed=size)
            key = hashlib.sha256(b"kvfabric-bench-redis" + size.to_bytes(8, "little")).digest()
            raw_key = b"kvfbench:raw:" + key.hex().encode()
            got: list[object] = [None, None]

            def put() -> None:
                if not tier.put(key, blob):
                    raise RuntimeError(f"redis tier put failed: {tier.counters.snapshot()}")

            def get() -> None:
                got[0] = tier.get(key)

            def raw_get() -> None:
                got[1] = raw.get(raw_key)

            put(), raw.set(raw_key, blob), get(), raw_get()  # warm up connections and server allocations
            store_s, set_s = paired(put, lambda: raw.set(raw_key, blob), repeats)
            retrieve_s, get_s = paired(get, raw_get, repeats)
            if got[0] != blob or got[1] != blob:
                raise RuntimeError("redis returned different bytes")
            rows += [_row("redis", "store", name, size, store_s, set_s, "raw redis-py SET, same bytes, same server"),
                     _row("redis", "retrieve", name, size, retrieve_s, get_s, "raw redis-py GET, same bytes/server")]
            if seal:
                rows += _sealed_rows(url, is_cluster, timeout_s, tier, key, blob, name, repeats)
            tier.delete(key)
            raw.delete(raw_key)
    finally:
        tier.close()
        raw.close()
    return rows


def _sealed_rows(url: str, is_cluster: bool, timeout_s: float, plain, key: bytes, blob: bytes, name: str,
                 repeats: int) -> list[dict]:
    """The sealed redis tier vs the plain one, same bytes, same server, alternated."""
    from kvfabric.tiers.redis import RedisTier
    from kvfabric.tiers.seal import Sealer
    from kvfabric.tiers.sealed import SealedTier

    sealed = SealedTier(RedisTier(url, is_cluster=is_cluster, timeout_s=timeout_s), Sealer([os.urandom(32)]))
    sealed_key = hashlib.sha256(b"sealed" + key).digest()
    got: list[object] = [None]
    try:
        def put() -> None:
            if not sealed.put(sealed_key, blob):
                raise RuntimeError("sealed redis put failed")

        def get() -> None:
            got[0] = sealed.get(sealed_key)

        put(), get()
        store_s, plain_store_s = paired(put, lambda: plain.put(key, blob), repeats)
        retrieve_s, plain_retrieve_s = paired(get, lambda: plain.get(key), repeats)
        if bytes(got[0]) != blob:
            raise RuntimeError("the sealed tier returned different bytes")
        rows = [_row("redis", "store", name, len(blob), store_s, plain_store_s, "the plain redis tier, same bytes"),
                _row("redis", "retrieve", name, len(blob), retrieve_s, plain_retrieve_s,
                     "the plain redis tier, same bytes")]
        for row in rows:
            row.update(sealed=True, ratio_vs_unsealed=row["ratio"], cipher="AES-256-GCM")
        return rows
    finally:
        sealed.delete(sealed_key)
        sealed.close()


# ---- shm ---------------------------------------------------------------------------------------------------
def _shm_reader(pool: str, capacity: int, root: str, key: bytes, size: int, repeats: int, conn) -> None:
    """In another process: read the chunk from the pool vs memcpy of the same bytes, both warm."""
    from kvfabric.host.pages import Scratch
    from kvfabric.tiers.shm import ShmTier

    try:
        tier = ShmTier(pool, capacity, root=root)
        scratch = Scratch()
        src = tier.get(key)
        if src is None or len(src) != size:
            raise RuntimeError("the reader process does not see the chunk")
        src_arr = np.frombuffer(src, dtype=np.uint8)
        dst = np.empty(size, dtype=np.uint8)
        ok = [True]

        def get_into() -> None:
            ok[0] &= tier.get_into(key, scratch) is not None

        def get() -> None:
            ok[0] &= tier.get(key) is not None

        def memcpy() -> None:
            np.copyto(dst, src_arr)

        get_into(), get(), memcpy()  # map the pool's pages in this process, size the buffers
        into_s, copy1_s = paired(get_into, memcpy, repeats)
        get_s, copy2_s = paired(get, memcpy, repeats)
        if not ok[0] or bytes(tier.get_into(key, scratch)) != src:
            raise RuntimeError("the reader process got a miss or different bytes")
        tier.close()
        conn.send(("ok", into_s, copy1_s, get_s, copy2_s))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", repr(exc)))
    finally:
        conn.close()


def bench_shm(sizes: Mapping[str, int] | tuple | list | None = None, repeats: int = 3, root: str = "/dev/shm"
              ) -> list[dict]:
    from kvfabric.tiers.shm import ShmPoolError, ShmTier

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    rows: list[dict] = []
    for name, size in _sizes(sizes):
        pool = f"bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        capacity = max(1 << 30, 4 * size)  # the default pool size: a realistic index (16384 slots)
        try:
            tier = ShmTier(pool, capacity, root=root)
        except ShmPoolError:
            try:  # a small /dev/shm (containers default to 64 MB): the smallest pool that holds the chunk
                capacity = size + size // 4
                tier = ShmTier(pool, capacity, root=root)
            except ShmPoolError as exc:
                warnings.warn(f"shm benchmark of {name} skipped: {exc}", stacklevel=2)
                ShmTier.destroy(pool, root)
                continue
        try:
            blob = _payload(size, seed=size)
            key = hashlib.sha256(b"kvfabric-bench-shm" + size.to_bytes(8, "little")).digest()
            src = np.frombuffer(blob, dtype=np.uint8)
            dst = np.empty(size, dtype=np.uint8)

            def put() -> None:
                if not tier.put(key, blob):
                    raise RuntimeError("shm put failed")

            put(), np.copyto(dst, src)
            store_s, copy_s = paired(put, lambda: np.copyto(dst, src), repeats)
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_shm_reader, args=(pool, capacity, root, key, size, repeats, child))
            proc.start()
            child.close()
            try:
                if not parent.poll(300):
                    raise RuntimeError("the shm reader process did not answer")
                result = parent.recv()
            finally:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
            if result[0] != "ok":
                raise RuntimeError(f"shm reader process failed: {result[1]}")
            _, into_s, copy1_s, get_s, copy2_s = result
            baseline = "memcpy of the same bytes into a preallocated buffer"
            huge = tmpfs_huge_option(root)
            rows += [_row("shm", "store", name, size, store_s, copy_s, baseline + ", same process"),
                     _row("shm", "retrieve", name, size, into_s, copy1_s,
                          baseline + ", reader in another process (get_into)"),
                     _row("shm", "retrieve-copy", name, size, get_s, copy2_s,
                          baseline + ", reader in another process (get: fresh bytes)")]
            for row in rows[-3:]:
                row["huge_pages"] = huge
        finally:
            tier.close()
            ShmTier.destroy(pool, root)
    return rows


if __name__ == "__main__":  # python -m kvfabric.bench.tiers_shared [redis-url]
    import json
    import sys

    out = bench_shm()
    if len(sys.argv) > 1:
        out += bench_redis(sys.argv[1])
    for r in out:
        print(json.dumps(r))
