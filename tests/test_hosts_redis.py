"""One Redis Cluster node partitioned, and every link lossy, across emulated hosts (kvfabric.bench.hosts): three
redis-server cluster nodes (masters, `cluster-require-full-coverage no`) in three hosts, a redis tier
(kvfabric.bench.hosts_redis) in a fourth. Real processes: slow.

Asserted: while one node's link is cut, every put and get answers within the tier's timeout (timeout_s, + slack),
the keys of that node miss (gets) or are refused (puts), nothing read back differs from what was stored; after the
heal the node's keys are served again; no process or namespace is left; the other nodes' keys are all served.
Over 1 % and 5 % loss on every link: nothing wrong, no call past the timeout, most keys served, all once the loss
stops."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from kvfabric.bench import hosts_redis
from kvfabric.bench.hosts import HostBed, LinkShape, read_line
from kvfabric.config import RedisTierConfig
from tests.host_fixtures import host_bed
from tests.redis_fixtures import HAVE_REDIS
from tests.reliability.harness import report, time_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAVE_REDIS, reason="redis-server is not installed")]
SETTINGS = RedisTierConfig()
SLACK_S = 1.0
STORED = (0, 90)  # keys stored before the cut, ~30 a node
NEW_PER_ROUND = 30  # keys put (and read back) in each round of the cut
CUT_S = 4.0  # past the cluster's node timeout (2 s): the other nodes then mark the cut one failed


@pytest.fixture
def bed():
    yield from host_bed(4)


def call(client: subprocess.Popen, op: str, keys: tuple[int, int]) -> dict:
    """Each key's put or get, per node; nothing wrong, no call past the tier's timeout."""
    assert client.stdin is not None
    client.stdin.write(json.dumps({"op": op, "keys": keys}).encode() + b"\n")
    client.stdin.flush()
    got = json.loads(read_line(client, 300))
    for row in got["nodes"].values():
        assert row["wrong"] == 0, got
        assert row["max_s"] <= SETTINGS.timeout_s + SLACK_S, got
    return got


def start_cluster(bed: HostBed, tmp_path: Path, shape: LinkShape) -> tuple[list, subprocess.Popen, list[str]]:
    """Three cluster nodes in hosts 0-2 and the tier's client in host 3, every link of `shape`."""
    for host in range(4):
        bed.reshape(host, shape)
    servers = []
    for host in range(3):
        (tmp_path / f"node{host}").mkdir()
        servers.append(bed.run(host, hosts_redis.server_argv(bed.address(host), str(tmp_path / f"node{host}")),
                               stdout=subprocess.DEVNULL))
    addresses = [bed.address(host) for host in range(3)]
    client = bed.python(3, hosts_redis.MODULE, "client", *addresses, "--timeout", str(SETTINGS.timeout_s),
                        "--breaker-failures", str(SETTINGS.breaker_failures), stdin=subprocess.PIPE)
    ready = json.loads(read_line(client, 120))
    assert ready["ready"] and ready["nodes"] == sorted(addresses), ready
    return servers, client, addresses


def cut_one_node(bed: HostBed, tmp_path: Path) -> dict:
    """The scenario, its safety asserted; the figures, with how the other nodes' keys fared during the cut."""
    servers, client, addresses = start_cluster(bed, tmp_path, LinkShape(1000))
    cut, others = addresses[2], addresses[:2]
    assert all(row["failed"] == 0 for row in call(client, "put", STORED)["nodes"].values())
    assert all(row["failed"] == 0 for row in call(client, "get", STORED)["nodes"].values())

    bed.partition(2)
    started, rounds = time.monotonic(), 0
    figures = {"cut_missed": 0, "other_served": 0, "other_missed": 0, "max_call_s": 0.0}
    while time.monotonic() - started < CUT_S:
        new = (1000 + rounds * NEW_PER_ROUND, 1000 + (rounds + 1) * NEW_PER_ROUND)
        for op, keys in (("put", new), ("get", new), ("get", STORED)):
            nodes = call(client, op, keys)["nodes"]
            figures["max_call_s"] = max([figures["max_call_s"]] + [row["max_s"] for row in nodes.values()])
            assert nodes.get(cut, {"ok": 0})["ok"] == 0, nodes  # unreachable: refused, missed
            figures["cut_missed"] += nodes.get(cut, {"failed": 0})["failed"]
            figures["other_served"] += sum(nodes[n]["ok"] for n in others if n in nodes)
            figures["other_missed"] += sum(nodes[n]["failed"] for n in others if n in nodes)
        rounds += 1

    bed.heal(2)  # then what the cut node held is served again
    recovery_s = time_until(lambda: call(client, "get", STORED)["nodes"][cut]["ok"] > 0, 60)
    after = call(client, "put", (5000, 5000 + NEW_PER_ROUND))
    assert all(row["failed"] == 0 for row in after["nodes"].values()), after
    bed.close()
    assert all(proc.poll() is not None for proc in (*servers, client))
    assert bed.owned() == []
    return {"rounds": rounds, **figures, "breaker_opened": after["breaker_opened"], "recovery_s": recovery_s}


def test_one_redis_cluster_node_partitioned_misses_within_the_timeout_and_serves_again(bed: HostBed,
                                                                                      tmp_path: Path):
    figures = cut_one_node(bed, tmp_path)
    assert figures["cut_missed"] > 0
    share = figures["other_served"] / (figures["other_served"] + figures["other_missed"])
    report(f"one Redis Cluster node partitioned for {CUT_S:g} s (3 masters, cluster-require-full-coverage no; "
           "4 emulated hosts, 1 Gbit)", wrong=0, hangs=0, deadline_s=SETTINGS.timeout_s, **figures,
           other_nodes_served_share=share, note="recovery: from the heal until a get of the cut node's keys hits")


def test_while_one_redis_cluster_node_is_cut_the_others_keys_are_served(bed: HostBed, tmp_path: Path):
    figures = cut_one_node(bed, tmp_path)
    assert figures["other_missed"] == 0, figures


@pytest.mark.parametrize("loss_pct", [1.0, 5.0])
def test_a_redis_cluster_over_lossy_links_serves_every_key_within_the_timeout(bed: HostBed, tmp_path: Path,
                                                                             loss_pct: float):
    """Every host's link drops loss_pct of the frames it receives: TCP retransmits, and a call that waits past the
    tier's timeout is a miss, never a hang or wrong bytes. Most keys are still served, all of them once the loss
    stops."""
    servers, client, addresses = start_cluster(bed, tmp_path, LinkShape(1000))
    assert all(row["failed"] == 0 for row in call(client, "put", STORED)["nodes"].values())
    for host in range(4):
        bed.reshape(host, LinkShape(1000, loss_pct=loss_pct))
    served = missed = 0
    max_call_s = 0.0
    for rounds in range(6):
        new = (1000 + rounds * NEW_PER_ROUND, 1000 + (rounds + 1) * NEW_PER_ROUND)
        for op, keys in (("put", new), ("get", new), ("get", STORED)):
            nodes = call(client, op, keys)["nodes"]  # asserts: nothing wrong, no call past the timeout
            served += sum(row["ok"] for row in nodes.values())
            missed += sum(row["failed"] for row in nodes.values())
            max_call_s = max([max_call_s] + [row["max_s"] for row in nodes.values()])
    counts = [bed.input_counts(host) for host in range(4)]  # (in, dropped) by nftables; None under netem
    arrived, dropped = (sum(c[i] for c in counts if c) for i in (0, 1))
    if any(counts):  # the loss was there, frame by frame
        assert arrived > 1000 and loss_pct / 2 <= 100 * dropped / arrived <= loss_pct * 2, counts
    for host in range(4):
        bed.reshape(host, LinkShape(1000))
    recovery_s = time_until(lambda: all(row["failed"] == 0 for row in call(client, "get", STORED)["nodes"].values()),
                            60)
    assert served >= 0.5 * (served + missed), (served, missed)
    bed.close()
    assert all(proc.poll() is not None for proc in (*servers, client))
    assert bed.owned() == []
    report(f"a Redis Cluster (3 masters in 3 emulated hosts, the tier in a fourth) at {loss_pct:g} % loss on every "
           "link, 1 Gbit", wrong=0, hangs=0, deadline_s=SETTINGS.timeout_s, served=served, missed=missed,
           max_call_s=max_call_s, recovery_s=recovery_s, packets_in_dropped=[arrived, dropped],
           note="recovery: from the end of the loss until every stored key is served")
