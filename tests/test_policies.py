"""Eviction policies: the shared contract (tests/policy_contract.py) for each, hand-computed traces where LRU,
LFU, S3-FIFO and ARC differ, and PrefixHeat's own rules (tail first, parents outlive children, cost). Belady's
offline optimum (kvfabric.research.belady) has its own file, tests/test_belady.py."""
from __future__ import annotations

import pytest

from kvfabric.tiers.policies import ARC, LFU, LRU, S3FIFO, AccessMeta, PolicyIndex, PrefixHeat, make_eviction
from tests.policy_contract import PolicyContract


class TestLRUContract(PolicyContract):
    def make_policy(self, capacity_bytes, requests):
        return LRU(capacity_bytes)


class TestLFUContract(PolicyContract):
    def make_policy(self, capacity_bytes, requests):
        return LFU(capacity_bytes)


class TestS3FIFOContract(PolicyContract):
    def make_policy(self, capacity_bytes, requests):
        return S3FIFO(capacity_bytes)


class TestARCContract(PolicyContract):
    def make_policy(self, capacity_bytes, requests):
        return ARC(capacity_bytes)


class TestPrefixHeatContract(PolicyContract):
    def make_policy(self, capacity_bytes, requests):
        return PrefixHeat(capacity_bytes)


class TestPrefixHeatUntunedContract(PolicyContract):
    def make_policy(self, capacity_bytes, requests):
        return PrefixHeat(capacity_bytes, small_frac=0.3, is_tuned=False)


# ---- hand-computed: one key per request, unit sizes, capacity 3 ------------------------------------------
# Derivations (state after each access; LRU order oldest first):
#  LRU:  A A A B C -> [A B C]; D evicts A; B hits; E evicts C; A misses (evicts D); F evicts B; B misses
#        (evicts E); E misses (evicts A); A misses.
#  LFU-DA: priorities A=3 (three uses), B=C=1; D (prio 1) evicts B (oldest of prio 1, age 1); B misses, comes
#        back at prio 2 and evicts C; E (prio 2) evicts D; A hits (prio 5); F (prio 2) evicts B (age 2);
#        B misses (prio 3) and evicts E; E misses (prio 3) and evicts F; A hits.
#  S3-FIFO: A, B, C wait in the small queue, A with two hits; D: A moves to main, B is evicted to the ghost;
#        B comes back from the ghost into main, C is evicted; E evicts D; A hits; F evicts E (small first);
#        B hits in main; E comes back from the ghost into main, F is evicted; A hits.
#  ARC: A goes to T2 after its second use; B, C, D in T1, D evicts B into B1; B (B1 hit, p=1) goes to T2 and
#        C is evicted; E evicts D; A hits; F evicts E into B1; B hits in T2; E (B1 hit, p=2) goes to T2 and
#        T1 is not above p, so T2's LRU, A, is evicted; A misses.
SEQUENCE = "AAABCDBEAFBEA"
EXPECTED_HITS = {
    "lru": "MHHMMMHMMMMMM",
    "lfu": "MHHMMMMMHMMMH",
    "s3fifo": "MHHMMMMMHMHMH",
    "arc": "MHHMMMMMHMHMM",
}


def hit_string(policy) -> str:
    index = PolicyIndex(3, policy)
    out = []
    for key in SEQUENCE:
        meta = AccessMeta(0, 1)
        out.append("H" if index.touch(key, meta) else "M")
        if out[-1] == "M":
            assert index.add(key, 1, meta)
    return "".join(out)


@pytest.mark.parametrize("name", sorted(EXPECTED_HITS))
def test_hand_computed_trace(name):
    assert hit_string(make_eviction(name, 3)) == EXPECTED_HITS[name]


def test_hand_computed_traces_differ():
    assert len(set(EXPECTED_HITS.values())) == len(EXPECTED_HITS)


# ---- PrefixHeat's own rules --------------------------------------------------------------------------------
def heat(**kwargs) -> PrefixHeat:
    return PrefixHeat(0, **{"small_frac": 0.5, "is_tuned": False, **kwargs})


def added_victims(index, keys) -> list[tuple]:
    """The keys each add evicts (one new single-chunk prompt per key)."""
    out = []
    for key in keys:
        victims = []
        index.on_evict = victims.append
        index.add(key, 1, AccessMeta(0, 1))
        out.append(tuple(victims))
    return out


def test_heat_evicts_a_prompts_tail_first_and_its_last_chunk_before_all():
    index = PolicyIndex(3, heat())
    for position, key in enumerate(["h", "m", "t"]):  # a prompt of three chunks; "t" is its last
        index.add(key, 1, AccessMeta(position, 3))
    # A new prompt of one chunk: the last chunk of the old prompt goes first, then the middle, then the head.
    assert added_victims(index, "xyz") == [("t",), ("m",), ("h",)]


def test_heat_without_tail_rule_evicts_in_prompt_order_reversed():
    index = PolicyIndex(3, heat(is_tail_first=False))
    for position, key in enumerate(["h", "m", "t"]):
        index.add(key, 1, AccessMeta(position, 3))
    assert added_victims(index, "xyz") == [("t",), ("m",), ("h",)]  # the chain is queued tail first either way


def test_heat_child_never_holds_more_credit_than_its_parent():
    policy = heat(is_cost_aware=False)
    index = PolicyIndex(10, policy)
    for position, key in enumerate(["a", "b"]):
        index.add(key, 1, AccessMeta(position, 3))
    index.touch("b", AccessMeta(1, 2))  # "b" alone: its parent was not touched just before
    index.touch("a", AccessMeta(0, 2))
    index.touch("b", AccessMeta(1, 2))  # capped at a's credit
    assert policy._credit["b"] <= policy._credit["a"]


def test_heat_cost_awareness_keeps_expensive_chunks_longer():
    def survivors(cost_of):
        policy = heat(small_frac=0.1, is_tail_first=False)
        index = PolicyIndex(4, policy)
        for key in "abcd":
            index.add(key, 1, AccessMeta(0, 1, 16, cost_of(key)))
        for key in "cdab":  # the running mean starts at the first cost seen: the expensive ones
            index.touch(key, AccessMeta(0, 1, 16, cost_of(key)))
        for key in "efgh":
            index.add(key, 1, AccessMeta(0, 1, 16, 1.0))
        return set(index.keys())
    # A hit on a chunk that is cheap to get back (under a quarter of the mean miss cost) earns no credit: the
    # cheap chunks leave first although all four were hit once.
    assert survivors(lambda key: 0.01 if key in "ab" else 1.0) >= {"c", "d"}
    assert survivors(lambda key: 0.01 if key in "cd" else 1.0) >= {"a", "b"}


def test_heat_tuner_leaves_clock_mode_under_a_scan():
    # A hot set of 1500 keys, each reused every 6000 accesses, between one-time keys (3 of every 4 accesses).
    # In a 2048-key cache, CLOCK (share 1, the start) is flushed by the one-time keys; a small probation share
    # keeps the hot set. The tuner must find that, and beat LRU by far.
    def run(policy):
        index = PolicyIndex(2048, policy)
        hits = 0
        for i in range(48000):
            key = i // 4 % 1500 if i % 4 == 0 else 10**6 + i
            if index.touch(key, AccessMeta()):
                hits += 1
            else:
                index.add(key, 1, AccessMeta())
        return hits
    heat_policy = PrefixHeat(2048)
    heat_hits, lru_hits = run(heat_policy), run(LRU(2048))
    assert heat_policy._tuner is not None and heat_policy.small_frac < 0.5
    assert heat_hits > 2 * lru_hits + 1000


def test_unknown_policy_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        make_eviction("mru", 10)
