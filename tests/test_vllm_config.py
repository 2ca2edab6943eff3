"""The connector's configuration (kvfabric.connectors.vllm.config): options split from kvfabric's config keys,
their defaults, and a clear error for a bad value. Needs vllm importable (the .venv-vllm venv); skips otherwise."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvfabric.config import ConfigError  # noqa: E402
from kvfabric.connectors.vllm.config import DEFAULT_LOAD_NICE, DEFAULT_TAIL_STEP, resolve_config  # noqa: E402


def test_options_are_split_from_config_keys_and_get_their_defaults(tmp_path):
    config, options = resolve_config({"chunk_size": 64, "tiers": ["disk"], "disk": {"path": str(tmp_path)},
                                      "load_threads": 3})
    assert config.chunk_size == 64 and tuple(config.tiers) == ("disk",)
    assert options["load_threads"] == 3 and options["load_nice"] == DEFAULT_LOAD_NICE
    assert options["load_mode"] == "async" and options["key_mode"] == "tokens"
    assert options["hold_newcomers"] is True
    assert resolve_config({"hold_newcomers": False})[1]["hold_newcomers"] is False
    assert options["tail_step"] == DEFAULT_TAIL_STEP == 64 and resolve_config({"tail_step": 0})[1]["tail_step"] == 0


@pytest.mark.parametrize("bad", [{"load_nice": 20}, {"load_nice": -1}, {"load_nice": True}, {"load_threads": 0},
                                 {"load_mode": "sync"}, {"key_mode": "hash"}, {"load_failure_policy": "ignore"},
                                 {"hold_newcomers": "yes"}, {"hold_newcomers": 1}, {"tail_step": -16},
                                 {"tail_step": "block"}, {"tail_step": True}])
def test_a_bad_option_is_a_clear_error(bad):
    name = next(iter(bad))
    with pytest.raises(ConfigError, match=name):
        resolve_config(bad)


def test_each_rank_is_its_own_cluster_member_with_its_own_counters():
    from kvfabric.connectors.vllm.config import for_rank

    config, options = resolve_config({"tiers": ["cpu", "peer"], "stats_path": "/tmp/s.json", "cluster": {
        "controller_url": "http://127.0.0.1:1", "instance_id": "prefill", "p2p_port": 9000}})
    assert for_rank(config, options, 0) == (config, options)
    config1, options1 = for_rank(config, options, 1)
    assert config1.cluster.instance_id == "prefill-r1" and config1.cluster.p2p_port == 9001
    assert options1["stats_path"] == "/tmp/s.json.rank1" and options["stats_path"] == "/tmp/s.json"
    config, options = resolve_config({})
    config1, options1 = for_rank(config, options, 1)  # host-pid names and free ports differ anyway
    assert config1.cluster.instance_id == "" and config1.cluster.p2p_port == 0
