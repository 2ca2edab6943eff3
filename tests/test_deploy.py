"""deploy/: the Grafana dashboard names only metrics that kvfabric processes export (compared with /metrics
scraped from real engines over cpu + disk + redis + peer with KV events, and from the controller), and the
deploy example runs: a real Prometheus scrapes a `kvfabric node` demo instance and a controller, and every
dashboard query evaluates there."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvfabric import Config
from kvfabric.cache.builder import build_engine
from kvfabric.cluster.controller_app import create_app
from kvfabric.config import ClusterConfig, CpuTierConfig, DiskTierConfig, KVEventsConfig, MetricsConfig, RedisTierConfig
from tests.cluster_scripts.helpers import LAYOUT, ControllerThread, free_port, wait_for
from tests.redis_fixtures import needs_redis, redis_server, redis_url  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvfabric.json"
METRIC = re.compile(r"\b((?:kvfabric|process)_[a-z0-9_]+)")
PROMETHEUS = shutil.which("prometheus")


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] == "kvfabric" and dash["panels"]
    ids = [panel["id"] for panel in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = []
    for panel in dash["panels"]:
        assert panel["title"] and panel["type"] in ("timeseries", "stat", "gauge") and panel["targets"]
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        exprs += [target["expr"] for target in panel["targets"]]
    return exprs


def sample_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


@needs_redis
def test_dashboard_queries_name_only_exported_metrics(tmp_path, redis_url):  # noqa: F811
    controller = ControllerThread(create_app(token="t", instance_ttl_s=30, sweep_interval_s=0.2)).start()
    try:
        def config(name: str) -> Config:
            return Config(chunk_size=16, tiers=("cpu", "disk", "redis", "peer"),
                          cpu=CpuTierConfig(capacity=1 << 22), disk=DiskTierConfig(path=str(tmp_path / name)),
                          redis=RedisTierConfig(url=redis_url), metrics=MetricsConfig(port=free_port()),
                          kv_events=KVEventsConfig(enabled=True, endpoint=f"tcp://127.0.0.1:{free_port()}"),
                          cluster=ClusterConfig(controller_url=controller.url, token="t", instance_id=name,
                                                report_interval_s=0.05, lookup_ttl_s=0.1))
        tokens = list(range(64))
        with build_engine(config("a"), LAYOUT, "m") as a, build_engine(config("b"), LAYOUT, "m") as b:
            a.store(tokens, torch.randn(LAYOUT.shape(64)))
            a.flush()
            a.node.flush_reports()
            b.clear_tier("cpu")
            b.clear_tier("redis")  # shared with a: make b fetch from a's p2p server
            b.clear_tier("disk")
            assert wait_for(lambda: b.lookup(tokens) == 64)
            assert b.retrieve(tokens).shape[3] == 64
            exported = set()
            for engine in (a, b):
                exported |= sample_names(httpx.get(engine.metrics_endpoint.url, timeout=10).text)
        exported |= sample_names(generate_latest(controller.controller.metrics.registry).decode())
    finally:
        controller.stop()
    named = {name for expr in dashboard_exprs() for name in METRIC.findall(expr)}
    assert len(named) >= 25
    missing = sorted(name for name in named if name not in exported)
    assert not missing, f"the dashboard names metrics nobody exports: {missing}"


def test_prometheus_config_matches_the_deploy_example():
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    node = yaml.safe_load((ROOT / "deploy" / "node.yaml").read_text())
    assert jobs["kvfabric-node"] == [f"127.0.0.1:{node['metrics']['port']}"]
    Config.from_dict(node)  # the demo instance's config is valid
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    assert {"controller", "node", "prometheus", "grafana"} <= set(compose["services"])


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (scripts/setup.sh --test installs it)")
def test_real_prometheus_scrapes_a_demo_node_and_evaluates_the_dashboard(tmp_path):
    node_port, ctl_port, ctl_metrics, prom_port = free_port(), free_port(), free_port(), free_port()
    node_yaml = yaml.safe_load((ROOT / "deploy" / "node.yaml").read_text())
    node_yaml["metrics"]["port"] = node_port
    node_yaml["disk"]["path"] = str(tmp_path / "chunks")
    node_yaml["kv_events"]["endpoint"] = f"tcp://127.0.0.1:{free_port()}"
    (tmp_path / "node.yaml").write_text(yaml.safe_dump(node_yaml))
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    prom["global"]["scrape_interval"] = "1s"
    for job in prom["scrape_configs"]:
        port = node_port if job["job_name"] == "kvfabric-node" else ctl_metrics
        job["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prom))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), KVFABRIC_HOME=str(tmp_path / "home"))
    kvf = [sys.executable, "-m", "kvfabric.apps.cli"]
    procs = [
        subprocess.Popen([*kvf, "node", "--config", str(tmp_path / "node.yaml"), "--load", "40"], env=env,
                         stdout=subprocess.DEVNULL),
        subprocess.Popen([*kvf, "controller", "--port", str(ctl_port), "--metrics-port", str(ctl_metrics)], env=env),
        subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]
    api = f"http://127.0.0.1:{prom_port}/api/v1/query"

    def query(expr: str) -> dict:
        try:
            return httpx.get(api, params={"query": expr}, timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return {"status": "down"}

    try:
        # both targets up, and enough samples of the node's counters for rates over 30 s windows
        wait_for(lambda: len(query("up == 1").get("data", {}).get("result", [])) == 2, 120, 0.5)
        wait_for(lambda: query("rate(kvfabric_requests_total[30s]) > 0").get("data", {}).get("result"), 120, 0.5)
        time.sleep(3)  # a few more scrapes, so every rate() window has two points
        empty = []
        for expr in dashboard_exprs():
            answer = query(expr.replace("$__rate_interval", "30s"))
            assert answer["status"] == "success", (expr, answer)
            if not answer["data"]["result"]:
                empty.append(expr)
        core = ("kvfabric_hit_tokens_total{op=\"lookup\"}", "kvfabric_tier_usage_bytes", "kvfabric_lookup_seconds",
                "kvfabric_requests_total", "kvfabric_controller_instances", "kvfabric_tier_evictions_total")
        for name in core:
            assert not [e for e in empty if name in e], f"no data for {name}: {empty}"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
