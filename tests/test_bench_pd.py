"""bench pd's parts that need no vLLM (the whole bench: `kvfabric bench pd`; the real pair: test_pd_vllm.py)."""
from __future__ import annotations

from kvfabric.bench.pd import copy_baselines, pd_extra, prompts_of
from kvfabric.config import Config


def test_prompts_are_seeded_and_distinct():
    first = prompts_of(300, 3, seed=7)
    assert first == prompts_of(300, 3, seed=7) and len({tuple(p) for p in first}) == 3
    assert all(len(p) == 300 for p in first) and first != prompts_of(300, 3, seed=8)


def test_baselines_time_the_same_bytes():
    memcpy_s, socket_s = copy_baselines(3 << 20, repeats=3)  # over a piece boundary: 1 MiB pieces
    assert 0 < memcpy_s and 0 < socket_s


def test_pair_config_is_a_valid_kvfabric_config(tmp_path):
    for url in (None, "redis://127.0.0.1:1/0"):
        extra = pd_extra("p", tmp_path / "s.json", "64MiB", url)
        options = {k: extra.pop(k) for k in ("model_id", "stats_path")}
        config = Config.from_dict(extra)
        assert config.tiers == (("redis",) if url else ("shm",)) and options["stats_path"].endswith("s.json")
        assert config.redis.url == url if url else config.shm.capacity == 64 << 20


def test_p2p_pair_config_is_a_cluster_of_two_serving_process_memory(tmp_path):
    configs = []
    for name in ("prefill", "decode"):
        extra = pd_extra("p", tmp_path / "s.json", "64MiB", controller_url="http://127.0.0.1:1", instance_id=name)
        for k in ("model_id", "stats_path"):
            extra.pop(k)
        configs.append(Config.from_dict(extra))
    assert all(c.tiers == ("cpu", "peer") and c.cpu.capacity == 64 << 20 for c in configs)
    assert [c.cluster.instance_id for c in configs] == ["prefill", "decode"]
    assert all(c.cluster.serve_tiers == ("cpu",) and not c.cluster.keep_fetched for c in configs)


def test_loaded_counters_are_read_from_the_stats_file_and_subtracted(tmp_path):
    from kvfabric.bench.pd import Loaded, _loaded

    stats = tmp_path / "decode.json"
    assert _loaded(stats) == Loaded()  # not written yet
    stats.write_text('{"connector": {"load_read_ns": 3000000000, "load_chunk_read_ns": 0, "load_scatter_ns": 1000000000, '
                     '"load_verify_ns": 500000000, "bytes_loaded.shm": 70, "bytes_loaded.disk": 30}}')
    got = _loaded(stats)
    assert got == Loaded(3.0, 0.0, 1.0, 0.5, 100)
    assert got.minus(Loaded(1.0, 0.0, 0.25, 0.5, 40)) == Loaded(2.0, 0.0, 0.75, 0.0, 60)
