"""Process faults with real processes: a writer SIGKILLed while writing to shm and disk, a peer killed in the middle
of transfers, the controller killed and restarted. No wrong chunk, no call past its deadline, the recovery time."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfabric.cache.builder import build_engine
from kvfabric.cluster.client import ControllerClient
from kvfabric.cluster.controller_app import create_app
from kvfabric.config import Config
from kvfabric.engines.synthetic import MODEL_ID, Workload
from kvfabric.tiers.shm import ShmTier
from tests.cluster_scripts.helpers import ControllerThread, free_port, wait_for
from tests.reliability.harness import Load, assert_clean, controller_healthy, report, time_until
from tests.reliability.peer_node import BIG_LAYOUT

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")


def start_node(config: dict, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(HERE / "peer_node.py"), "--config", json.dumps(config), *args],
                            env=ENV, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line == "ready", f"node did not start ({line!r}, exit {proc.poll()})"
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def test_writer_sigkilled_while_writing_to_shm_and_disk(tmp_path):
    pool = f"rel-{os.getpid()}-{random.randrange(1 << 30)}"
    config = {"chunk_size": 64, "tiers": ["shm", "disk"], "shm": {"name": pool, "capacity": "24MiB"},
              "disk": {"path": str(tmp_path / "chunks"), "capacity": "48MiB"}}
    rng = random.Random(0)
    recoveries, leftovers, checked, wrong, corrupt = [], 0, 0, 0, 0
    try:
        for _ in range(3):
            writer = start_node(config, "--layout", "big", "--prompts", "2", "--write-forever")
            time.sleep(rng.uniform(0.5, 2.0))  # the writer stores all the time: the kill lands mid-write
            kill(writer)
            killed_at = time.monotonic()
            leftovers += len(list((tmp_path / "chunks" / "tmp").glob("*.tmp")))
            with build_engine(Config.from_dict(config), BIG_LAYOUT, MODEL_ID) as engine:
                workload = Workload(engine, num_prompts=400)
                # the pool's writers' lock was held by the dead process: the next put must get it
                tokens = workload.prompt(10_000 + len(recoveries))
                engine.store(tokens, workload.kv_for(tokens, 0))
                engine.flush()
                assert engine.stats().counters.get("failed_writes.shm", 0) == 0
                recoveries.append(time.monotonic() - killed_at)
                for i in range(400):  # everything the writer may have stored: exact or a miss, never other bytes
                    tokens = workload.prompt(i)
                    kv = engine.retrieve(tokens)
                    num, bad = workload.check(tokens, kv)
                    checked, wrong = checked + num, wrong + bad
                corrupt += sum(v for k, v in engine.stats().counters.items() if k.startswith("corrupt."))
    finally:
        ShmTier.destroy(pool)
    assert checked > 100 and wrong == 0
    report("writer SIGKILLed while writing to shm and disk (3 kills)", None, checked_chunks=checked, wrong=wrong,
           hangs=0, corrupt_dropped=corrupt, temp_files_left=leftovers, recovery_s=max(recoveries))


@pytest.fixture
def controller():
    ctl = ControllerThread(create_app(token="t", instance_ttl_s=3, sweep_interval_s=0.2)).start()
    yield ctl
    ctl.stop()


def cluster_config(url: str, name: str, tiers=("cpu", "peer"), cpu="256KiB") -> dict:
    return {"chunk_size": 64, "tiers": list(tiers), "cpu": {"capacity": cpu},
            "cluster": {"controller_url": url, "token": "t", "instance_id": name, "report_interval_s": 0.1,
                        "heartbeat_interval_s": 0.5, "lookup_ttl_s": 0.2, "fetch_timeout_s": 2.0,
                        "connect_timeout_s": 0.5, "lookup_timeout_s": 0.5}}


def test_peer_killed_mid_transfer(controller):
    a = start_node(cluster_config(controller.url, "a", cpu="256MiB"), "--layout", "big", "--prompts", "120")
    api = ControllerClient(controller.url, "t")
    try:
        with build_engine(Config.from_dict(cluster_config(controller.url, "b")), BIG_LAYOUT, MODEL_ID) as b:
            load = Load(b, deadline_s=10.0, num_prompts=120).start()
            time_until(lambda: b.stats().counters.get("hit.peer", 0) > 20, 120)
            kill(a)  # b is fetching from a nearly all the time
            dropped_s = time_until(lambda: all(i["instance_id"] != "a" for i in api.instances()), 60)
            ops_after = load.ops_after(3)
            load.stop()
            peer = b.stats().tier_counters["peer"]
    finally:
        if a.poll() is None:
            kill(a)
        api.close()
    assert ops_after > 0
    assert peer.get("fetch_errors", 0) + peer.get("suspected", 0) >= 1  # b saw the transfer fail
    assert_clean(load)
    report("peer killed (SIGKILL) mid-transfer", load, fetch_errors=peer.get("fetch_errors", 0),
           recovery_s=dropped_s, note="recovery: until the controller dropped the dead peer")


def test_controller_killed_and_restarted(tmp_path):
    port = free_port()
    token = tmp_path / "token"
    token.write_text("t")
    url = f"http://127.0.0.1:{port}"

    def start_controller() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "kvfabric.cluster.controller", "--port", str(port),
                                 "--token-file", str(token), "--instance-ttl", "5"], env=ENV)
        wait_for(lambda: controller_healthy(url), 60, 0.1)
        return proc

    ctl = start_controller()
    try:
        a_cfg, b_cfg = cluster_config(url, "a", cpu="64MiB"), cluster_config(url, "b")
        with build_engine(Config.from_dict(a_cfg), BIG_LAYOUT, MODEL_ID) as a, \
                build_engine(Config.from_dict(b_cfg), BIG_LAYOUT, MODEL_ID) as b:
            writer = Workload(a, num_prompts=120)
            for i in range(60):
                tokens = writer.prompt(i)
                a.store(tokens, writer.kv_for(tokens, 0))
            assert a.node.flush_reports(30)
            load = Load(b, deadline_s=5.0, num_prompts=60).start()
            time_until(lambda: b.stats().counters.get("hit.peer", 0) > 10, 120)
            kill(ctl)
            ops_during = load.ops_after(4)  # the controller is gone: b's lookups are fast local misses
            for i in range(60, 120):  # a keeps storing; the controller will learn of these after its restart
                tokens = writer.prompt(i)
                a.store(tokens, writer.kv_for(tokens, 0))
            ctl = start_controller()  # same port, an empty in-memory index
            late = writer.prompt(119)
            recovery_s = time_until(lambda: b.lookup(late) == len(late) // 64 * 64, 60)
            load.stop()
    finally:
        kill(ctl)
    assert ops_during > 0
    assert_clean(load)
    report("controller killed (SIGKILL) and restarted (in-memory index)", load, ops_during_outage=ops_during,
           recovery_s=recovery_s)
