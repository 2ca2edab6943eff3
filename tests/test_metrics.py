"""Metrics in every process (kvfabric.observe.metrics): an engine's /metrics scraped over real HTTP must say what its
stats say; the naming scheme; the controller's extra metrics port; the P2P numbers of a two-engine cluster."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvfabric import Config, KVLayout
from kvfabric.cache.builder import build_engine
from kvfabric.config import ClusterConfig, CpuTierConfig, DiskTierConfig, MetricsConfig, RedisTierConfig
from kvfabric.observe.metrics import METRICS, Histograms, tier_misses
from tests.cluster_scripts.helpers import ControllerThread, free_port, wait_for

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
CHUNK = 16
CHUNK_BYTES = LAYOUT.shape(CHUNK)[0] * 2 * 2 * CHUNK * 8 * 4


def kv(num_tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(num_tokens), generator=torch.Generator().manual_seed(seed))


def scrape(url: str, token: str | None = None) -> dict[tuple[str, tuple], float]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    text = httpx.get(url, headers=headers, timeout=10, trust_env=False).raise_for_status().text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    found = [v for (n, lab), v in samples.items() if n == name and want <= set(lab)]
    assert found, f"{name} {labels} not scraped"
    return sum(found)


def engine_config(tmp_path, **kw) -> Config:
    base = dict(chunk_size=CHUNK, cpu=CpuTierConfig(capacity=4 * 1024 * 1024),
                disk=DiskTierConfig(path=str(tmp_path / "chunks")), metrics=MetricsConfig(port=free_port()))
    base.update(kw)
    return Config(**base)


def test_engine_metrics_over_http_match_its_stats(tmp_path):
    tokens = list(range(100))  # 6 whole chunks
    with build_engine(engine_config(tmp_path), LAYOUT, "m") as engine:
        url = engine.metrics_endpoint.url
        assert url.startswith("http://127.0.0.1:")
        assert engine.lookup(tokens) == 0
        assert engine.store(tokens, kv(100)) == 6
        assert engine.lookup(tokens) == 96
        engine.flush()
        engine.clear_tier("cpu")
        got = engine.retrieve(tokens[:96])  # from disk, promoted back into cpu
        assert got.shape[3] == 96
        samples = scrape(url)
        stats = engine.stats()
    assert value(samples, "kvfabric_requests_total", op="lookup") == 2
    assert value(samples, "kvfabric_requested_tokens_total", op="lookup") == 200
    assert value(samples, "kvfabric_hit_tokens_total", op="lookup") == 96
    assert value(samples, "kvfabric_hit_tokens_total", op="retrieve") == 96
    assert value(samples, "kvfabric_stored_chunks_total") == 6
    assert value(samples, "kvfabric_stored_tokens_total") == 96
    assert value(samples, "kvfabric_tier_hits_total", tier="disk") == 6
    assert value(samples, "kvfabric_tier_misses_total", tier="cpu") == 6
    assert value(samples, "kvfabric_promotions_total") == 6
    for usage in stats.tiers:
        assert value(samples, "kvfabric_tier_usage_bytes", tier=usage.name) == usage.num_bytes
        assert value(samples, "kvfabric_tier_chunks", tier=usage.name) == usage.num_chunks
        assert value(samples, "kvfabric_tier_capacity_bytes", tier=usage.name) == usage.capacity_bytes
    assert value(samples, "kvfabric_lookup_seconds_count") == 2
    assert value(samples, "kvfabric_retrieve_seconds_count", op="retrieve") == 1
    assert value(samples, "kvfabric_store_seconds_count", op="store") == 1
    assert value(samples, "kvfabric_codec_encode_seconds_count", codec="raw") == 6
    assert value(samples, "kvfabric_codec_decode_seconds_count", codec="raw") == 6
    assert value(samples, "kvfabric_write_queue_capacity_chunks") == 64
    assert value(samples, "process_resident_memory_bytes") > 0
    assert value(samples, "kvfabric_info", model="m", codec="raw") == 1


def test_evictions_corrupt_chunks_and_drops_are_counted(tmp_path):
    config = engine_config(tmp_path, cpu=CpuTierConfig(capacity=3 * CHUNK_BYTES + 2000), write_queue_chunks=1)
    tokens = list(range(6 * CHUNK))
    with build_engine(config, LAYOUT, "m") as engine:
        engine.store(tokens, kv(len(tokens)))
        engine.flush()
        disk = engine._tier("disk")
        victim = engine.keys(tokens)[0]
        raw = bytearray(disk.path(victim).read_bytes())
        raw[-1] ^= 0xFF
        disk.path(victim).write_bytes(bytes(raw))
        assert engine.retrieve(tokens).shape[3] == 0  # chunk 0 was evicted from cpu and is damaged on disk
        samples = scrape(engine.metrics_endpoint.url)
        assert value(samples, "kvfabric_tier_evictions_total", tier="cpu") == engine.stats().tier_counters["cpu"][
            "evicted"] >= 3
        assert value(samples, "kvfabric_corrupt_chunks_total", tier="disk") == 1
        assert value(samples, "kvfabric_write_drops_total") == engine.stats().counters.get("dropped_writes", 0)


def test_dead_redis_opens_the_breaker_and_the_metrics_say_so(tmp_path):
    dead = RedisTierConfig(url=f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.1, breaker_failures=1,
                           backoff_max_s=60)
    config = engine_config(tmp_path, tiers=("cpu", "redis"), redis=dead)
    with build_engine(config, LAYOUT, "m") as engine:
        engine.store(list(range(32)), kv(32))
        engine.flush()
        samples = scrape(engine.metrics_endpoint.url)
    assert value(samples, "kvfabric_breaker_open", tier="redis") == 1
    errors = [v for (n, lab), v in samples.items() if n == "kvfabric_tier_events_total"
              and dict(lab)["tier"] == "redis" and dict(lab)["event"].endswith((".errors", ".skipped"))]
    assert sum(errors) >= 2  # the call that failed, and the ones the open breaker answered at once
    assert value(samples, "kvfabric_write_failures_total", tier="redis") >= 1


def test_a_taken_metrics_port_is_logged_not_fatal(tmp_path, caplog):
    config = engine_config(tmp_path)
    with build_engine(config, LAYOUT, "a") as first, build_engine(config, LAYOUT, "b") as second:
        assert first.metrics_endpoint is not None and second.metrics_endpoint is None
        assert second.store(list(range(16)), kv(16)) == 1
    assert "cannot serve" in caplog.text


def test_names_follow_one_scheme():
    units = ("_seconds", "_bytes", "_tokens", "_chunks", "_total", "_open", "_info")
    for name, spec in METRICS.items():
        assert name.startswith("kvfabric_"), name
        assert (name.endswith("_total")) == (spec.kind == "counter"), name
        assert spec.kind != "histogram" or name.endswith("_seconds"), name
        assert name.endswith(units) or name == "kvfabric_info", name


def test_histograms_keep_bounded_observations():
    hist = Histograms(keep_observations=True)
    for i in range(10):
        hist.observe("kvfabric_lookup_seconds", i / 1000)
    snap = hist.snapshot()[("kvfabric_lookup_seconds", "")]
    assert snap.count == 10 and sum(snap.counts) == 10 and abs(snap.sum - 0.045) < 1e-9
    assert hist.take_observations()[("kvfabric_lookup_seconds", "")] == [i / 1000 for i in range(10)]
    assert hist.take_observations() == {}


def test_tier_misses_follow_the_read_order():
    hits = {"cpu": 5, "pending": 1, "disk": 3, "redis": 2}
    assert tier_misses(hits, ["cpu", "disk", "redis"], num_miss=4, num_pending=1) == {
        "cpu": 4 + 3 + 2 + 1, "disk": 4 + 2, "redis": 4}


def test_controller_metrics_port_serves_without_token_on_loopback(tmp_path):
    port, metrics_port = free_port(), free_port()
    token = tmp_path / "token"
    token.write_text("s3cret")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-m", "kvfabric.cluster.controller", "--port", str(port),
                             "--token-file", str(token), "--metrics-port", str(metrics_port)], env=env)
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(up, 60, 0.1)
        httpx.get(f"http://127.0.0.1:{port}/v1/instances", headers={"Authorization": "Bearer s3cret"}, timeout=5)
        samples = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        assert value(samples, "kvfabric_controller_requests_total", route="/v1/instances", status="200") == 1
        assert value(samples, "process_open_fds") > 0
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 401
        assert scrape(f"http://127.0.0.1:{port}/metrics", "s3cret")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cluster_engines_export_p2p_traffic(tmp_path):
    controller = ControllerThread(__import__("kvfabric.cluster.controller_app", fromlist=["create_app"]).create_app(
        token="t", instance_ttl_s=30, sweep_interval_s=0.2)).start()
    try:
        def config(name: str) -> Config:
            return engine_config(tmp_path, tiers=("cpu", "peer"), cluster=ClusterConfig(
                controller_url=controller.url, token="t", instance_id=name, report_interval_s=0.05,
                heartbeat_interval_s=0.2, lookup_ttl_s=0.1), metrics=MetricsConfig(port=free_port()))
        tokens = list(range(64))
        with build_engine(config("a"), LAYOUT, "m") as a, build_engine(config("b"), LAYOUT, "m") as b:
            a.store(tokens, kv(64))
            assert wait_for(lambda: b.lookup(tokens) == 64)
            assert b.retrieve(tokens).shape[3] == 64
            sa, sb = scrape(a.metrics_endpoint.url), scrape(b.metrics_endpoint.url)
            assert value(sa, "kvfabric_p2p_server_chunks_total") == 4
            assert value(sa, "kvfabric_p2p_server_bytes_total") == value(sb, "kvfabric_p2p_fetched_bytes_total") > 0
            assert value(sb, "kvfabric_tier_hits_total", tier="peer") == 4
            assert value(sb, "kvfabric_p2p_errors_total", side="client") == 0
            # the heartbeat carries the counts the status page shows
            assert a.node.flush_reports() and wait_for(
                lambda: controller.controller.latest_stats("a").get("stored_chunks") == 4, 10)
    finally:
        controller.stop()
    time.sleep(0)  # nothing left running


@pytest.mark.slow
def test_reference_engine_serves_metrics(tmp_path):
    """The HF reference engine on the real model, configured with metrics.port: a cold and a warm generate."""
    from kvfabric.engines.hf import HFEngine
    from kvfabric.engines.model import ensure_model
    config = engine_config(tmp_path, chunk_size=32)
    prompt = "The keeper of the lighthouse wrote down the weather every evening. " * 12
    with HFEngine(ensure_model(), config=config, num_threads=1) as llm:
        cold = llm.generate(prompt, max_new_tokens=2)
        warm = llm.generate(prompt, max_new_tokens=2)
        samples = scrape(llm.cache.metrics_endpoint.url)
    assert cold.hit_tokens == 0 and warm.hit_tokens > 0
    assert value(samples, "kvfabric_hit_tokens_total", op="retrieve") == warm.hit_tokens
    assert value(samples, "kvfabric_stored_chunks_total") == cold.stored_chunks > 0
    assert value(samples, "kvfabric_requested_tokens_total", op="lookup") == 2 * cold.prompt_tokens
