"""Belady's offline optimum (kvfabric.research.belady, the bound of `kvfabric bench trace`): the eviction-policy
contract (tests/policy_contract.py), hand-computed traces (block and prefix hits) and its future."""
from __future__ import annotations

from kvfabric.research.belady import Belady, BeladyFuture
from kvfabric.tiers.policies import LRU, AccessMeta, PolicyIndex, make_eviction
from tests.policy_contract import PolicyContract, workload


class TestBeladyContract(PolicyContract):
    def make_policy(self, capacity_bytes, requests):
        return Belady(capacity_bytes, BeladyFuture(requests))


def run_requests(policy, requests, capacity):
    """Per request: (prefix hit blocks, block hits)."""
    index = PolicyIndex(capacity, policy)
    out = []
    for r, keys in enumerate(requests):
        if getattr(policy, "future", None) is not None:
            policy.future.now = r
        present = [key in index for key in keys]
        prefix = present.index(False) if False in present else len(keys)
        out.append((prefix, sum(present)))
        for position, key in enumerate(keys):
            meta = AccessMeta(position, len(keys))
            if not index.touch(key, meta):
                index.add(key, 1, meta)
    return out


def test_belady_bypasses_a_key_used_later_than_every_resident():
    # Capacity 2: A, B; C is never used again, so Belady drops C itself and both later accesses hit. LRU
    # evicts A for C and then misses A.
    requests = [["A"], ["B"], ["C"], ["B"], ["A"]]
    belady = run_requests(Belady(2, BeladyFuture(requests)), requests, 2)
    assert belady == [(0, 0), (0, 0), (0, 0), (1, 1), (1, 1)]
    assert run_requests(LRU(2), requests, 2) == [(0, 0), (0, 0), (0, 0), (1, 1), (0, 0)]


def test_belady_evicts_the_tail_on_a_tie():
    # Capacity 2. X0, X1 are next used together (request 3); Y0 sooner. Equal next use: the deeper chunk X1
    # goes, so request 3 still hits its first block (a prefix hit). Evicting X0 would leave X1 as a block
    # hit that no lookup can use.
    requests = [["X0", "X1"], ["Y0"], ["Y0"], ["X0", "X1"]]
    assert run_requests(Belady(2, BeladyFuture(requests)), requests, 2)[3] == (1, 1)


def test_belady_beats_every_online_policy_on_a_workload():
    requests = workload(800, 30, seed=9)
    def hits(policy):
        return sum(block for _, block in run_requests(policy, requests, 40))
    best = hits(Belady(40, BeladyFuture(requests)))
    for name in ("lru", "lfu", "s3fifo", "arc", "heat"):
        assert hits(make_eviction(name, 40)) <= best, name


def test_belady_future_next_use():
    future = BeladyFuture([[1, 2], [2], [1]])
    future.now = 0
    assert (future.next_use(1), future.next_use(2), future.next_use(3)) == (2, 1, float("inf"))
    future.now = 2
    assert future.next_use(1) == float("inf") and future.num_uses(1) == 2
