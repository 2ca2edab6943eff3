"""vLLM's kv_role in the connector: a P/D producer loads hits and stores, a consumer loads and never stores."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvfabric import CacheEngine  # noqa: E402
from kvfabric.config import Config, ConfigError  # noqa: E402
from kvfabric.connectors.vllm.config import kv_transfer_config, role_of  # noqa: E402
from kvfabric.kv.layout import KVLayout  # noqa: E402
from tests.scheduler_fixtures import scheduler_asking  # noqa: E402

CHUNK = 256
LAYOUT = KVLayout(2, 1, 4, "float32")


def _request(tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id="a", prompt_token_ids=tokens, lora_request=None, mm_features=[],
                           cache_salt=None, block_hashes=[], num_tokens=len(tokens), kv_transfer_params=None)


def _scheduled(tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="a", block_ids=([0, 1, 2, 3, 4],), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]), num_scheduled_tokens={"a": len(tokens)},
        finished_req_ids=set(), total_num_scheduled_tokens=len(tokens))


@pytest.mark.parametrize("kv_role, loads, saves", [("kv_both", True, True), ("kv_producer", True, True),
                                                  ("kv_consumer", True, False)])
def test_kv_role_decides_loads_and_saves(tmp_path, kv_role, loads, saves):
    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["disk"], "disk": {"path": str(tmp_path)}})
    stored = list(range(2 * CHUNK + 5))  # two whole chunks held by the pool (a producer's prefix cache too)
    with CacheEngine(config, LAYOUT, "m") as engine, scheduler_asking(engine, config, LAYOUT,
                                                                      role=role_of(kv_role)) as side:
        engine.store(stored, torch.randn(LAYOUT.shape(2 * CHUNK)))
        engine.flush()
        _roles(side, stored, loads, saves)


def _roles(side, stored, loads, saves) -> None:
    request = _request(stored)
    assert side.num_new_matched_tokens(request, 0) == (2 * CHUNK if loads else 0)
    side.forget("a")
    fresh = _request([7] * (2 * CHUNK + 5))  # nothing stored: a producer and kv_both save both chunks
    assert side.num_new_matched_tokens(fresh, 0) == 0
    side.after_alloc(fresh, SimpleNamespace(get_block_ids=lambda: ([0, 1, 2, 3, 4],)), 0)
    meta = side.build_meta(_scheduled(fresh.prompt_token_ids))
    assert [len(save.keys) for save in meta.saves] == ([2] if saves else [])


def test_kv_transfer_config_carries_the_role_and_rejects_unknown_ones():
    assert kv_transfer_config({}, "kv_consumer")["kv_role"] == "kv_consumer"
    assert role_of(None) == role_of("kv_both")
    assert role_of("kv_producer").is_sync_store and not role_of("kv_consumer").is_sync_store
    with pytest.raises(ConfigError, match="kv_role"):
        kv_transfer_config({}, "kv_prefill")
