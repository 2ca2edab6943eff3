"""`kvfabric stats` against a running `kvfabric node` (a real process with synthetic load), and its arithmetic."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import yaml

from kvfabric.apps.statsview import InstanceStats, minus, quantile, scrape
from tests.cluster_scripts.helpers import free_port, wait_for


def test_quantile_interpolates_inside_buckets_like_prometheus():
    buckets = [(0.001, 10.0), (0.01, 90.0), (0.1, 100.0), (float("inf"), 100.0)]
    assert quantile(0.05, buckets) == pytest.approx(0.0005)
    assert quantile(0.5, buckets) == pytest.approx(0.001 + 0.009 * 40 / 80)
    assert quantile(0.95, buckets) == pytest.approx(0.01 + 0.09 * 5 / 10)
    assert quantile(0.5, [(float("inf"), 0.0)]) is None


def test_minus_keeps_gauges_and_subtracts_counters():
    key = ("kvfabric_requests_total", (("op", "lookup"),))
    usage = ("kvfabric_tier_usage_bytes", (("tier", "cpu"),))
    before = InstanceStats("u", "", {key: 5.0, usage: 100.0})
    now = InstanceStats("u", "", {key: 12.0, usage: 80.0})
    diff = minus(now, before)
    assert diff.value("kvfabric_requests_total") == 7 and diff.value("kvfabric_tier_usage_bytes") == 80


@pytest.fixture
def node(tmp_path):
    port = free_port()
    config = {"chunk_size": 32, "tiers": ["cpu", "disk"], "cpu": {"capacity": "1MiB"},
              "disk": {"path": str(tmp_path / "chunks"), "capacity": "4MiB"}, "metrics": {"port": port}}
    (tmp_path / "node.yaml").write_text(yaml.safe_dump(config))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-m", "kvfabric.apps.cli", "node", "--config", str(tmp_path / "node.yaml"),
                             "--load", "50"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"

    def busy() -> bool:
        try:
            stats = scrape(url)
        except httpx.HTTPError:
            return False
        return not stats.error and stats.value("kvfabric_hit_tokens_total", op="retrieve") > 0
    try:
        wait_for(busy, 120, 0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), COLUMNS="120")
    return subprocess.run([sys.executable, "-m", "kvfabric.apps.cli", "stats", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_stats_shows_a_running_node(node):
    stats = scrape(node)
    assert not stats.error and 0 < stats.hit_rate < 1
    assert [t.name for t in stats.tiers()] == ["cpu", "disk"]
    assert stats.tiers()[0].capacity_bytes == 1 << 20
    result = run_cli(node)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("hit rate", "tokens saved", "cpu", "disk", "lookup", "retrieve", "store", "p99"):
        assert text in out, out
    watched = run_cli("--watch", "--interval", "0.5", "--iterations", "2", node)
    assert watched.returncode == 0 and "since last refresh" in watched.stdout


def test_stats_of_an_unreachable_url_fails_clearly():
    result = run_cli(f"http://127.0.0.1:{free_port()}/metrics")
    assert result.returncode == 1 and "ConnectError" in result.stdout
