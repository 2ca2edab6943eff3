"""`kvfabric bench trace` and its parts: the trace loader, the simulator (one and two tiers) on a hand-computed
trace, the TTFT model, the command's JSON and plot, and the issue-16 table on the shared Mooncake traces."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfabric.apps.cli import main
from kvfabric.bench.trace import simulate
from kvfabric.bench.trace_data import TraceError, find_trace, load_trace
from kvfabric.bench.trace_replay import ReplaySetup, TierSpec, replay, trace_keys
from kvfabric.bench.trace_sim import TierConfig, TTFTModel, request_metas, simulate_two_tiers
from kvfabric.config import PlacementConfig
from kvfabric.tiers.policies import LRU, PolicyIndex

# Four requests, 512-token blocks; ids name prefix blocks. Distinct blocks: 1, 2, 3, 4.
TINY = [(1024, [1, 2]), (1536, [1, 2, 3]), (700, [1, 4]), (1024, [1, 2])]
PROMPT_TOKENS = 1024 + 1536 + 700 + 1024


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids}) + "\n"
                            for i, (n, ids) in enumerate(TINY)))
    return path


def test_load_trace(tiny):
    trace = load_trace(str(tiny))
    assert (trace.num_distinct_blocks, trace.num_accesses, len(trace.requests)) == (4, 9, 4)
    assert trace.requests[2].block_tokens(1) == 700 - 512
    assert len(load_trace(str(tiny), limit=2).requests) == 2


@pytest.mark.parametrize("line, message", [
    ("{not json", "not a trace record"),
    ('{"timestamp": 0, "input_length": 600}', "not a trace record"),
    ('{"timestamp": 0, "input_length": 600, "hash_ids": [1]}', "needs 2 blocks"),
    ('{"timestamp": 0, "input_length": 0, "hash_ids": []}', "non-empty"),
])
def test_bad_trace_lines_are_errors_with_their_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=rf"bad.jsonl:2: .*{message}"):
        load_trace(str(path))


def test_find_trace_by_env(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("KVFABRIC_BENCH_TRACE_DIR", str(tiny.parent))
    assert find_trace("tiny.jsonl") == tiny.resolve()
    with pytest.raises(FileNotFoundError, match="KVFABRIC_BENCH_TRACE_DIR"):
        find_trace("absent.jsonl")


def test_one_tier_lru_and_belady_by_hand(tiny):
    # Capacity 2 blocks (50 % of 4). LRU: r1 hits 1, 2 (1024 tokens), then 3 evicts 1; r2 misses 1 and 4
    # (they evict 2 and 3); r3 hits 1 (512 tokens), misses 2. Belady (request time): r1 hits 1, 2 and drops
    # 3 (never used again); r2 hits 1 (512) and drops 4; r3 hits 1 and 2 (1024).
    trace = load_trace(str(tiny))
    metas = request_metas(trace, TTFTModel())
    lru = simulate(trace, "lru", 1, 0.5, TTFTModel(), metas)
    belady = simulate(trace, "belady", 1, 0.5, TTFTModel(), metas)
    assert (lru.prefix_hit_tokens, lru.block_hits, lru.num_evicted) == (1536, 3, (4,))
    assert (belady.prefix_hit_tokens, belady.block_hits, belady.num_refused) == (2560, 5, (2,))
    assert lru.prefix_hit_ratio == pytest.approx(1536 / PROMPT_TOKENS)
    assert belady.ttft_mean_s < lru.ttft_mean_s


@pytest.mark.parametrize("mode", ["write-through", "exclusive"])
def test_two_tiers_with_a_slow_tier_holding_everything(tiny, mode):
    # Fast tier: 1 block; slow: 10 blocks (all 4 fit): every reuse hits somewhere, as with an infinite cache.
    trace = load_trace(str(tiny))
    make = lambda capacity: PolicyIndex(capacity, LRU(capacity))  # noqa: E731
    res = simulate_two_tiers(trace, make, make, 0.25, "lru", TierConfig(mode))
    assert res.prefix_hit_tokens == 2560 and 0 < res.slow_hit_tokens < res.prefix_hit_tokens
    assert res.block_hits == 5 and res.capacity_blocks == 1
    assert res.blocks_moved >= 1
    assert res.num_evicted[1] == 0  # the slow tier never had to evict


def test_two_tier_config_is_checked(tiny):
    trace = load_trace(str(tiny))
    make = lambda capacity: PolicyIndex(capacity, LRU(capacity))  # noqa: E731
    with pytest.raises(ValueError, match="bad tier config"):
        simulate_two_tiers(trace, make, make, 0.5, "lru", TierConfig("write-back"))


def test_ttft_model():
    model = TTFTModel(prefill_tokens_per_s=2000.0, prefill_halving_tokens=8192.0)
    assert model.prefill_s(0, 8192) == pytest.approx((8192 + 4096) / 2000)
    assert model.prefill_s(0, 300) + model.prefill_s(300, 900) == pytest.approx(model.prefill_s(0, 900))
    full_hit = model.ttft_s(1024, 1024, 0)
    load = model.bytes_per_token * 1024 / model.fast_bytes_per_s
    assert full_hit == pytest.approx(load + model.prefill_s(1023, 1024))
    assert model.ttft_s(1024, 0, 1024) > full_hit and model.ttft_s(1024, 0, 0) > model.ttft_s(1024, 0, 1024)


def test_bench_trace_json_and_plot(tiny, tmp_path):
    plot = tmp_path / "trace.png"
    result = CliRunner().invoke(main, ["bench", "trace", "--trace", str(tiny), "--json", "--capacities", "0.5",
                                       "--policies", "lru,heat,lru+second,shm", "--plot", str(plot), "--bounds",
                                       "--model-defaults", "--replay-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    table = [row for row in rows if "policy" in row]
    for row in table:
        for field in ("trace", "policy", "tiers", "capacity_frac", "prefix_hit_ratio", "block_hit_ratio",
                      "ttft_mean_s", "ttft_p99_s", "ns_per_access", "source"):
            assert field in row, field
    one = {row["policy"]: row for row in table if row["tiers"] == 1}
    assert set(one) >= {"lru", "belady", "heat", "lru+second", "shm", "default", "oracle-alive", "oracle-popularity"}
    assert one["lru"]["source"] == "replay" and one["oracle-alive"]["source"] == "sim"
    # Through the real tiers, the hand-computed figures of the simulator (test above): same policy, same trace.
    assert one["lru"]["prefix_hit_ratio"] == pytest.approx(1536 / PROMPT_TOKENS, abs=1e-4)
    assert one["shm"]["prefix_hit_ratio"] == one["lru"]["prefix_hit_ratio"]  # the pool evicts LRU too
    assert one["belady"]["prefix_hit_ratio"] == pytest.approx(2560 / PROMPT_TOKENS, abs=1e-4)
    assert one["belady"]["gap_closed"] == 1.0 and one["lru"]["gap_closed"] == 0.0
    assert one["lru"]["hit_tokens"] == [1536] and one["lru"]["evicted"] == [4]
    two = {row["policy"]: row for row in table if row["tiers"] == 2}
    assert set(two) >= {"lru", "belady", "default", "lru/exclusive"}
    assert two["lru/exclusive"]["bytes_moved"][1] > 0 and two["lru"]["tier_names"] == ["cpu", "disk"]
    assert plot.stat().st_size > 10_000


def test_bench_trace_rejects_bad_options(tiny):
    result = CliRunner().invoke(main, ["bench", "trace", "--trace", str(tiny), "--capacities", "2"])
    assert result.exit_code != 0 and "capacities" in result.output
    result = CliRunner().invoke(main, ["bench", "trace", "--trace", str(tiny), "--policies", "mru", "--sim",
                                       "--model-defaults"])
    assert result.exit_code != 0 and "unknown eviction policy" in result.output


# ---- the shared Mooncake traces (issue 16's table) -----------------------------------------------------------
def shared_trace(name: str, limit: int | None = None):
    try:
        return load_trace(name, limit)
    except FileNotFoundError:
        pytest.skip("../shared/data has no Mooncake traces")


@pytest.mark.parametrize("name, lru_block, belady_block", [("conversation", 0.126, 0.348),
                                                           ("synthetic", 0.106, 0.314)])
def test_issue_table_at_3_percent(name, lru_block, belady_block):
    # Issue 16 reports LRU 0.125 / 0.101 and Belady 0.348 / 0.314 (block hits). Belady matches to 3 digits;
    # LRU differs in the third digit because this simulator looks a request up before storing its blocks.
    trace = shared_trace(name)
    metas = request_metas(trace, TTFTModel())
    lru = simulate(trace, "lru", 1, 0.03, TTFTModel(), metas)
    belady = simulate(trace, "belady", 1, 0.03, TTFTModel(), metas)
    assert lru.block_hit_ratio == pytest.approx(lru_block, abs=0.001)
    assert belady.block_hit_ratio == pytest.approx(belady_block, abs=0.001)


@pytest.fixture
def replay_dir(tmp_path):
    """Chunk files on tmpfs where there is one (real files, without the shared disk's latency)."""
    if not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="kvfabric-test-replay-", dir="/dev/shm") as path:
        yield Path(path)


@pytest.mark.parametrize("name", ["conversation", "synthetic"])
def test_first_500_requests_counters_add_up(name, replay_dir):
    trace = shared_trace(name, limit=500)
    keys = trace_keys(trace)
    model = TTFTModel()
    seen = {}

    def check(engine, tiers) -> None:
        counters = engine.stats().counters
        # every block either hit (some tier held it) or was recomputed and stored: hits + misses = accesses
        seen["stored"] = counters.get("chunks_stored", 0)
        for tier in tiers:
            usage = tier.usage()
            assert usage.num_bytes <= tier.capacity_bytes
            stats = tier.index_stats()
            assert stats.num_hits == counters.get(f"hit.{tier.name}", 0)  # the index saw every read the stack did
            if tier.name == "disk":  # bytes on disk = the sum of the resident chunks' sizes
                files = list(tier.root.rglob("*.kvc"))
                assert sum(f.stat().st_size for f in files) == usage.num_bytes
                assert {bytes.fromhex(f.stem) for f in files} == set(tier.keys())

    for setup in (ReplaySetup("heat", (TierSpec("cpu", "heat"),)),
                  ReplaySetup("lru", (TierSpec("cpu", "lru"), TierSpec("disk", "lru"))),
                  ReplaySetup("heat+lru/exclusive", (TierSpec("cpu", "heat"), TierSpec("disk", "lru")),
                              PlacementConfig(mode="exclusive"))):
        res = replay(trace, setup, 0.03, model, replay_dir, keys, on_end=check)
        assert seen["stored"] + res.block_hits == res.num_accesses == trace.num_accesses
        assert sum(res.hit_tokens) == res.prefix_hit_tokens <= res.prompt_tokens
        assert 0 < res.prefix_hit_tokens and res.block_hits >= res.prefix_hit_tokens // trace.block_tokens
        assert len(setup.tiers) == 1 or res.hit_tokens[1] > 0  # the disk tier served what cpu had dropped
