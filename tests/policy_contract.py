"""The contract every eviction policy passes (tiers/policies/types.py), driven through `PolicyIndex`.
Subclass and provide `make_policy(capacity_bytes, requests)`; `requests` is the whole workload (lists of
keys, head chunk first), which only an offline policy (Belady, tests/test_belady.py) reads.

Checked: the resident bytes never exceed the capacity; a victim is never pinned; the same sequence gives the
same victims (also with bytes keys); the policy and the index agree on what is resident; bookkeeping is O(1)
per access, by counting the policy's loop iterations (`num_steps`) at two cache sizes, not by timing.
"""
from __future__ import annotations

import random

from kvfabric.tiers.policies import AccessMeta, PolicyIndex


def workload(num_requests: int, num_roots: int, seed: int, max_chunks: int = 8) -> list[list[int]]:
    """Prefix-chained requests: a request picks a root (skewed), shares a random prefix of an earlier chain
    from that root and adds new chunks. Block ids are unique per prefix, like the Mooncake traces."""
    rng = random.Random(seed)
    chains: dict[int, list[list[int]]] = {}
    next_id = num_roots
    requests = []
    for _ in range(num_requests):
        root = min(int(rng.paretovariate(1.2)) - 1, num_roots - 1)
        known = chains.setdefault(root, [[root]])
        base = rng.choice(known)
        keep = rng.randint(1, len(base))
        chain = base[:keep]
        for _ in range(rng.randint(0, max_chunks - len(chain)) if len(chain) < max_chunks else 0):
            chain.append(next_id)
            next_id += 1
        known.append(chain)
        requests.append(chain)
    return requests


def replay(index: PolicyIndex, requests: list[list], sizes, pin_every: int = 0, check=None) -> list:
    """Store or touch every chunk of every request; returns the victims in order. With `pin_every`, every
    pin_every-th request pins its first chunk while its other chunks are stored."""
    future = getattr(index.policy, "future", None)
    victims = []
    pinned = []

    def evicted(key) -> None:
        assert key not in pinned, "a pinned key was evicted"
        victims.append(key)
    index.on_evict = evicted
    for r, keys in enumerate(requests):
        if future is not None:
            future.now = r
        pinned = keys[:1] if pin_every and r % pin_every == 0 else []
        index.pin(pinned)
        for position, key in enumerate(keys):
            meta = AccessMeta(position, len(keys), 16, 0.001 * (1 + position))
            if not index.touch(key, meta):
                index.add(key, sizes(key), meta)
            if check is not None:
                check(index)
        index.unpin(pinned)
    index.on_evict = None
    return victims


def unit(key) -> int:
    return 1


def varied(key) -> int:
    return 1 + (hash(key) % 4 if isinstance(key, int) else key[0] % 4)


class PolicyContract:
    steps_per_access_bound = 12.0

    def make_policy(self, capacity_bytes: int, requests: list[list]):  # pragma: no cover - overridden
        raise NotImplementedError

    def index(self, capacity: int, requests: list[list]) -> PolicyIndex:
        return PolicyIndex(capacity, self.make_policy(capacity, requests))

    def test_capacity_never_exceeded_and_policy_agrees(self):
        requests = workload(600, 20, seed=1)

        def check(index: PolicyIndex) -> None:
            assert index.num_bytes <= index.capacity_bytes
            assert len(index.policy) == len(index)
        index = self.index(40, requests)
        victims = replay(index, requests, varied, pin_every=3, check=check)
        assert victims, "the workload must overflow the cache"
        assert sum(index.size_of(key) for key in index.keys()) == index.num_bytes

    def test_victim_never_pinned(self):
        requests = workload(400, 10, seed=2)
        index = self.index(30, requests)
        replay(index, requests[:100], unit, pin_every=2)  # replay asserts no victim was pinned
        held = index.keys()[:5]
        index.pin(held)
        index.pin(held[:2])  # pins are counted: two pins need two unpins
        replay(index, requests[100:300], unit, pin_every=2)
        assert all(key in index for key in held)
        index.unpin(held)
        replay(index, requests[300:], unit)
        assert all(key in index for key in held[:2])
        index.unpin(held[:2])
        assert index.num_bytes <= index.capacity_bytes

    def test_all_pinned_refuses_the_newcomer(self):
        requests = [[i] for i in range(10)]
        index = self.index(4, requests)
        replay(index, requests[:4], unit)
        index.pin(index.keys())
        evicted = []
        index.on_evict = evicted.append
        assert not index.add(99, 1) and evicted == []
        assert 99 not in index and len(index) == 4

    def test_deterministic(self):
        requests = workload(500, 15, seed=3)
        first = replay(self.index(25, requests), requests, varied, pin_every=4)
        second = replay(self.index(25, requests), requests, varied, pin_every=4)
        assert first == second and first
        as_bytes = [[key.to_bytes(4, "little") * 8 for key in keys] for keys in requests]
        third = replay(self.index(25, as_bytes), as_bytes, unit)
        fourth = replay(self.index(25, as_bytes), as_bytes, unit)
        assert third == fourth and third

    def test_removed_key_is_never_a_victim(self):
        requests = workload(300, 10, seed=4)
        index = self.index(20, requests)
        replay(index, requests[:100], unit)
        gone = set(index.keys()[:5])
        for key in gone:
            assert index.remove(key)
            assert not index.remove(key)
        rest = [[key for key in keys if key not in gone] for keys in requests[100:]]
        victims = replay(index, [keys for keys in rest if keys], unit)
        assert victims and not gone & set(victims)
        assert len(index.policy) == len(index)

    def test_bookkeeping_is_constant_per_access(self):
        counts = []
        for capacity in (64, 4096):
            requests = workload(20 * capacity // 4, 4 * capacity // 8, seed=5)
            index = self.index(capacity, requests)
            replay(index, requests, unit)
            accesses = sum(len(keys) for keys in requests)
            counts.append(index.policy.num_steps / accesses)
        assert max(counts) <= self.steps_per_access_bound, counts
        assert counts[1] <= 2.0 * counts[0] + 1.0, counts  # does not grow with the cache
