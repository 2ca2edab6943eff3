"""`kvfabric bench vllm`'s rows from its engines' results (no engine runs here): medians of the repeated hits; what a
failed run leaves behind."""
from __future__ import annotations

import pytest

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


def test_a_parallel_load_is_its_slowest_rank():
    from kvfabric.bench.vllm_engine import load_figures

    before = [{"loaded_tokens": 0, "load_read_ns": 0}, {}]
    after = [{"loaded_tokens": 512, "load_read_ns": 2e8, "bytes_loaded.disk": 1000},
             {"loaded_tokens": 512, "load_read_ns": 3e8, "bytes_loaded.disk": 900}]
    row = load_figures(before, after)
    assert row["load_s"] == 0.3 and row["bytes_loaded"] == {"disk": 900} and row["loaded_tokens"] == 512


def test_engines_of_several_ranks_get_a_core_each():
    from kvfabric.bench.vllm import cpu_bind

    assert cpu_bind(1) == "0-1"
    assert cpu_bind(2) == "0|1"


def test_chunk_files_per_chunk_follow_the_shares(tmp_path):
    import json

    from kvfabric.bench.vllm import files_per_chunk

    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 128,
              "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert files_per_chunk(str(tmp_path), 1, 1) == 1
    assert files_per_chunk(str(tmp_path), 2, 1) == 2  # a head each
    assert files_per_chunk(str(tmp_path), 4, 1) == 2  # two replicas of each head: one writes
    assert files_per_chunk(str(tmp_path), 2, 2) == 4  # a head each in each of two stages


def test_a_parallel_shape_the_model_cannot_take_is_one_line(tmp_path, monkeypatch):
    import json

    from kvfabric.bench import vllm as bench_vllm

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4,
              "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "intermediate_size": 128,
              "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(bench_vllm, "find_python", lambda python=None: "python")
    monkeypatch.setattr(bench_vllm, "make_prompts", lambda *args, **kwargs: {})
    with pytest.raises(SystemExit, match=r"--tp 2 --pp 1 with .*: 3 KV heads do not split over 2 tensor ranks"):
        bench_vllm.run([1024], model=str(tmp_path), workdir=str(tmp_path / "w"), tp=2)


def test_a_failed_engine_leaves_no_chunk_cache(tmp_path, monkeypatch):
    """The chunks a run writes (GBs) go when an engine fails too, not only after a run that ends well; the engine's
    log stays for a look. The engine here writes a chunk file, then exits with an error."""
    import json
    import sys
    import tempfile

    from kvfabric.bench import vllm as bench_vllm

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4,
              "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "intermediate_size": 128,
              "vocab_size": 100}
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    engine = tmp_path / "engine"
    engine.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"import json, pathlib, sys; "
                      "cache = pathlib.Path(json.load(open(sys.argv[1]))['cache']); cache.mkdir(parents=True); "
                      "(cache / 'chunk.kvc').write_bytes(bytes(4096)); sys.exit(3)\" \"$3\"\n")
    engine.chmod(0o755)
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(runs))
    monkeypatch.setattr(bench_vllm, "find_python", lambda python=None: str(engine))
    monkeypatch.setattr(bench_vllm, "make_prompts", lambda *args, **kwargs: {})
    with pytest.raises(RuntimeError, match="engine plain failed"):
        bench_vllm.run([1024], model=str(model), lmcache=False)
    (work,) = runs.glob("kvfabric-bench-vllm-*")
    assert not (work / "cache").exists() and (work / "engine-plain.log").exists()
