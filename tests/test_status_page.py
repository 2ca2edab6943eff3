"""The controller's status page (/ui): the same token as the API, and, in a real headless browser (Debian's
chromium), the page of a running two-instance cluster shows both instances with the numbers /v1/instances gives.
A screenshot is kept as a test artifact (tests/artifacts.py; its path is printed)."""
from __future__ import annotations

import html.parser
import shutil
import subprocess

import httpx
import pytest
import torch

from kvfabric import Config
from kvfabric.cache.builder import build_engine
from kvfabric.cluster.controller_app import create_app
from kvfabric.config import ClusterConfig, CpuTierConfig
from tests.artifacts import keep_artifact
from tests.cluster_scripts.helpers import LAYOUT, ControllerThread, wait_for

TOKEN = "page-token"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                  "--virtual-time-budget=15000"]


@pytest.fixture
def cluster():
    controller = ControllerThread(create_app(token=TOKEN, instance_ttl_s=60, sweep_interval_s=0.5)).start()
    engines = []
    try:
        for name in ("alpha", "beta"):
            config = Config(chunk_size=16, tiers=("cpu", "peer"), cpu=CpuTierConfig(capacity=1 << 22),
                            cluster=ClusterConfig(controller_url=controller.url, token=TOKEN, instance_id=name,
                                                  report_interval_s=0.05, heartbeat_interval_s=0.3,
                                                  lookup_ttl_s=0.1))
            engines.append(build_engine(config, LAYOUT, "m"))
        a, b = engines
        for i in range(3):
            tokens = list(range(i * 1000, i * 1000 + 64))
            a.store(tokens, torch.randn(LAYOUT.shape(64)))
            a.lookup(tokens)
            assert wait_for(lambda t=tokens: b.lookup(t) == 64)
            b.retrieve(tokens)
        b.lookup(list(range(50_000, 50_064)))  # a miss: b's hit rate is below 100 %
        for engine in engines:
            engine.flush()
            assert engine.node.flush_reports()
        ctl = controller.controller
        wait_for(lambda: ctl.latest_stats("alpha") and ctl.latest_stats("beta") and
                 ctl.latest_stats("beta") == engines[1].summary(), 20)
        yield controller, engines
    finally:
        for engine in engines:
            engine.close()
        controller.stop()


def test_ui_needs_the_token_and_basic_auth_works_for_the_api(cluster):
    controller, _ = cluster
    assert httpx.get(controller.url + "/ui").status_code == 401
    assert "Basic" in httpx.get(controller.url + "/ui").headers["www-authenticate"]
    assert httpx.get(controller.url + "/ui", auth=("x", "wrong")).status_code == 401
    page = httpx.get(controller.url + "/ui", auth=("anyone", TOKEN))
    assert page.status_code == 200 and "<svg" in page.text and "/v1/instances" in page.text
    assert httpx.get(controller.url + "/v1/history", auth=("x", TOKEN)).status_code == 200
    assert httpx.get(controller.url + "/v1/history").status_code == 401
    history = httpx.get(controller.url + "/v1/history", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert set(history["instances"]) == {"alpha", "beta"}


class Rows(html.parser.HTMLParser):
    """The data-* attributes of the page's instance rows, tier spans and chart paths."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self.paths: dict[str, int] = {}
        self.summary: dict[str, str] = {}
        self._row: str | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "tr" and a.get("class") == "instance":
            self._row = a["data-id"]
            self.rows[self._row] = {k: v for k, v in a.items() if k.startswith("data-")}
        elif tag == "span" and a.get("class") == "tier" and self._row is not None:
            self.rows[self._row][f"tier-{a['data-tier']}"] = a["data-chunks"]
        elif tag == "path" and "data-instance" in a:
            self.paths[a["data-instance"]] = int(a["data-points"])
        elif a.get("id") == "summary":
            self.summary = a


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/setup.sh --test installs it)")
def test_page_in_a_headless_browser_matches_the_api(cluster, tmp_path):
    controller, engines = cluster
    ctl = controller.controller

    def two_points() -> bool:  # a line in the chart needs a second history point per instance (2 s apart)
        for engine in engines:
            assert engine.node.flush_reports()
        return all(len(points) >= 2 for points in ctl.history().instances.values())
    assert wait_for(two_points, 20, 0.1)
    url = controller.url.replace("http://", f"http://viewer:{TOKEN}@") + "/ui"
    profile = tmp_path / "chromium-profile"
    dom = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    api = httpx.get(controller.url + "/v1/instances", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    page = Rows()
    page.feed(dom.stdout)
    assert page.summary.get("data-instances") == "2", dom.stdout[-3000:]
    assert set(page.rows) == {i["instance_id"] for i in api["instances"]} == {"alpha", "beta"}
    for inst in api["instances"]:
        row = page.rows[inst["instance_id"]]
        assert int(row["data-chunks"]) == sum(t["num_chunks"] for t in inst["tiers"])
        assert int(row["data-bytes"]) == sum(t["num_bytes"] for t in inst["tiers"])
        for tier in inst["tiers"]:
            assert int(row[f"tier-{tier['name']}"]) == tier["num_chunks"]
        assert int(row["data-hit-tokens"]) == inst["stats"]["hit_tokens"]
        assert int(row["data-lookup-tokens"]) == inst["stats"]["lookup_tokens"]
        assert int(row["data-saved-tokens"]) == inst["stats"]["retrieved_tokens"]
    assert int(page.rows["beta"]["data-saved-tokens"]) == 3 * 64  # beta loaded 3 prompts from alpha
    assert set(page.paths) == {"alpha", "beta"} and min(page.paths.values()) >= 2
    shot = tmp_path / "status-page.png"
    subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1280,900",
                    f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 10_000
    print(f"status page screenshot: {keep_artifact(shot)}")
