"""Clock jumps for TTLs: a controller process whose wall clock (libfaketime; CLOCK_MONOTONIC untouched, as with an
NTP step) jumps an hour ahead (every instance looks silent) and back (an instance that died just before would
look alive for an hour unless the controller refuses stamps from the future); Redis TTLs all expiring at once, as
a server clock jump makes them. No wrong chunk, no call past its deadline, recovery times."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfabric.cache.builder import build_engine
from kvfabric.cluster.client import ControllerClient
from kvfabric.config import Config
from kvfabric.engines.synthetic import MODEL_ID, SMALL_LAYOUT, Workload
from tests.cluster_scripts.helpers import free_port, wait_for
from tests.redis_fixtures import needs_redis, redis_server  # noqa: F401 - fixtures
from tests.reliability.harness import Load, assert_clean, controller_healthy, report, time_until

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")
pytestmark = pytest.mark.slow


class Clock:
    """The wall clock of the processes started with `env`: an offset from real time, changed while they run."""

    def __init__(self, tmp_path: Path) -> None:
        self.file = tmp_path / "faketime"
        self.set(0)
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), LD_PRELOAD=str(LIBFAKETIME),
                        FAKETIME_TIMESTAMP_FILE=str(self.file), FAKETIME_CACHE_DURATION="1",
                        DONT_FAKE_MONOTONIC="1")  # re-read the offset once a second; monotonic time untouched

    def set(self, offset_s: int) -> None:
        self.file.write_text(f"{offset_s:+d}\n")


@needs_redis
def test_redis_ttls_all_expiring_at_once(redis_server):  # noqa: F811
    """libfaketime cannot be preloaded into Debian's redis-server (its allocator calls clock_gettime before the
    library is set up), so the server's jump an hour ahead is reproduced by its effect on 600 s TTLs: every
    kvf: key expires at once (PEXPIRE 1 ms), under load; the jump back by PERSIST (keys outlive their TTL)."""
    client = redis_server.client()
    config = Config.from_dict({"chunk_size": 32, "tiers": ["cpu", "redis"], "cpu": {"capacity": 256 * 1024},
                               "redis": {"url": redis_server.url, "ttl_s": 600, "timeout_s": 0.5}})
    with build_engine(config, SMALL_LAYOUT, MODEL_ID) as engine:
        load = Load(engine).start()
        time_until(lambda: engine.stats().counters.get("hit.redis", 0) > 20, 120)
        names = list(client.scan_iter(match=b"kvf:*"))
        assert names and all(0 < client.ttl(n) <= 600 for n in names[:20])
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.pexpire(name, 1)
        pipe.execute()
        hits = engine.stats().counters["hit.redis"]
        recovery_s = time_until(lambda: engine.stats().counters["hit.redis"] > hits + 20, 60)
        for name in client.scan_iter(match=b"kvf:*"):
            client.persist(name)
        load.run_for(2)
        load.stop()
    assert_clean(load)
    report("redis TTLs all expiring at once (the server's clock +1 h), then kept past their TTL", load,
           keys_expired=len(names), recovery_s=recovery_s)


def _num_expired(api: ControllerClient) -> float:
    """The controller's count of instances dropped for missed heartbeats (its /metrics)."""
    for line in api.metrics().splitlines():
        if line.startswith("kvfabric_controller_instances_expired_total "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.skipif(not LIBFAKETIME.exists(), reason="libfaketime is not installed (setup.sh --test)")
def test_controller_clock_jumps(tmp_path):
    clock = Clock(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ctl = subprocess.Popen([sys.executable, "-m", "kvfabric.cluster.controller", "--port", str(port),
                            "--instance-ttl", "3"], env=clock.env)

    def config(name: str) -> Config:
        return Config.from_dict({"chunk_size": 32, "tiers": ["cpu", "peer"], "cluster": {
            "controller_url": url, "instance_id": name, "report_interval_s": 0.1, "heartbeat_interval_s": 0.5,
            "lookup_ttl_s": 0.2, "lookup_timeout_s": 0.5}})

    api = ControllerClient(url, timeout_s=20.0)
    try:
        wait_for(lambda: controller_healthy(url), 60, 0.1)
        with build_engine(config("a"), SMALL_LAYOUT, MODEL_ID) as a, build_engine(config("b"), SMALL_LAYOUT,
                                                                                 MODEL_ID) as b:
            writer = Workload(a, num_prompts=50)
            for i in range(50):
                tokens = writer.prompt(i)
                a.store(tokens, writer.kv_for(tokens, 0))
            wait_for(lambda: a.node.flush_reports(10), 120)
            load = Load(b, num_prompts=50, pause_s=0.02).start()
            time_until(lambda: b.stats().counters.get("hit.peer", 0) > 5, 60)

            # every instance's last heartbeat is an hour old: swept if a sweep runs before the next heartbeat
            # (then re-registered), else just refreshed; either way lookups must come back. Which one happened
            # is a race (sweeps every 1.5 s, heartbeats every 0.5 s): reported (`swept`), not asserted
            clock.set(3600)
            probe = writer.prompt(49)
            both = lambda: {i["instance_id"] for i in api.instances()} == {"a", "b"}  # noqa: E731
            forward_s = time_until(lambda: both() and b.lookup(probe) == len(probe) // 32 * 32, 120)
            swept = _num_expired(api)

            a.node.reporter.close(unregister=False)  # a dies (no goodbye) while the clock is an hour ahead
            a.node.server.close()
            clock.set(0)  # and the clock is set back: a's last stamp is an hour in the future
            back_s = time_until(lambda: all(i["instance_id"] != "a" for i in api.instances()), 60)
            load.run_for(1)
            load.stop()
    finally:
        ctl.terminate()
        ctl.wait(timeout=30)
        api.close()
    assert back_s < 10  # within about the TTL, not an hour
    assert_clean(load)
    report("controller clock +1 h, then back 1 h with a dead instance", load, recovery_s=forward_s,
           swept=swept, dead_instance_dropped_s=back_s)
