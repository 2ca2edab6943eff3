"""`kvfabric bench vllm`'s rows from its engines' results (no engine runs here): medians of the repeated hits."""
from __future__ import annotations

from kvfabric.bench.vllm import _row


def _results(with_samples: bool) -> dict:
    plain = {"cold": 10.0, "hit": 1.0, "hit_cached": 960}
    hit = {"cold": 0.5, "cold_cached": 1023, "load_s": 0.2, "pagecache_copy_bps": 1e9,
           "bytes_loaded": {"disk": 100_000_000}}
    lm_hit = {"cold": 2.0, "cold_cached": 1023}
    if with_samples:
        plain["hits"] = [1.0, 0.8, 3.0]
        hit.update(hits=[0.5, 0.2, 0.3], hits_cached=[1023, 1023, 1023])
        lm_hit.update(hits=[2.0, 1.0, 1.2], hits_cached=[1023, 1023, 1023])
    return {"plain": {"ttft": {"1024": plain}},
            "kvfabric-cold": {"ttft": {"1024": {"on": [10.2, 10.1], "off": [10.0, 10.0]}}},
            "kvfabric-hit": {"ttft": {"1024": hit}},
            "lmcache-cold": {"ttft": {"1024": {"cold": 9.0}}}, "lmcache-hit": {"ttft": {"1024": lm_hit}}}


def test_hits_are_medians_of_the_samples():
    row = _row(_results(True), 1024, 2, "")
    assert row["floor_s"] == 1.0 and row["kvf_hit_s"] == 0.3 and row["lmcache_hit_s"] == 1.2
    assert row["hit_vs_floor"] == 0.3 and abs(row["kvf_vs_lmcache"] - 0.25) < 1e-12
    assert row["lmcache_vs_floor"] == 1.2 and row["kvf_hit_samples_s"] == [0.5, 0.2, 0.3]
    assert abs(row["load_vs_copy"] - 2.0) < 1e-12  # the first sample's load: 0.2 s for 0.1 s of page-cache copy


def test_results_without_samples_use_the_single_hit():
    row = _row(_results(False), 1024, 2, "")
    assert row["floor_s"] == 1.0 and row["kvf_hit_s"] == 0.5 and row["lmcache_hit_s"] == 2.0
    assert row["floor_samples_s"] == [1.0] and row["kvf_reused_samples"] == [1023]
