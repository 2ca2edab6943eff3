"""The cluster across emulated hosts (kvfabric.bench.hosts): the controller in one host, two kvfabric nodes
(CacheEngine with the cpu and peer tiers, kvfabric.bench.hosts_cluster) in two others, and one node's link
partitioned. Real processes in separate network namespaces: slow.

Asserted: every lookup + retrieve on either node returns within the deadline its ClusterConfig gives (DEADLINE_S), no chunk read back differs from what was stored, the cut node's
chunks are misses on the other node while the cut lasts, the cut node registers again after the heal and its
chunks are served again, and no process or namespace is left. The figures: one `RELIABILITY {json}` line."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from kvfabric.bench import hosts_cluster
from kvfabric.bench.hosts import HostBed, LinkShape, read_line
from kvfabric.config import ClusterConfig
from tests.host_fixtures import host_bed
from tests.reliability.harness import report, time_until

pytestmark = pytest.mark.slow
TOKEN = "hosts-cluster-token"
PORT = 8470  # the controller's, in a namespace of its own
INSTANCE_TTL_S = 3.0
A_PROMPTS, B_PROMPTS = [0, 20], [20, 40]  # the workload's prompts each node stores (no chunk in common)
SETTINGS = ClusterConfig(token=TOKEN, report_interval_s=0.1, heartbeat_interval_s=0.5, lookup_ttl_s=0.2,
                         lookup_timeout_s=0.5, connect_timeout_s=0.5, fetch_timeout_s=2.0, keep_fetched=False,
                         insecure=True)
# a call's worst case: the engine's lookup and the retrieve's own each ask the controller (lookup_timeout_s), then
# the chunks are fetched from the peer the (possibly stale) answer names: a connect and a fetch; + 1 s of slack
DEADLINE_S = 2 * SETTINGS.lookup_timeout_s + SETTINGS.connect_timeout_s + SETTINGS.fetch_timeout_s + 1.0


@pytest.fixture
def bed():
    yield from host_bed(3)


def config(bed: HostBed, host: int, name: str) -> dict:
    cluster = {"controller_url": f"http://{bed.address(0)}:{PORT}", "token": TOKEN, "instance_id": name,
               "p2p_host": bed.address(host), "report_interval_s": SETTINGS.report_interval_s,
               "heartbeat_interval_s": SETTINGS.heartbeat_interval_s, "lookup_ttl_s": SETTINGS.lookup_ttl_s,
               "lookup_timeout_s": SETTINGS.lookup_timeout_s, "connect_timeout_s": SETTINGS.connect_timeout_s,
               "fetch_timeout_s": SETTINGS.fetch_timeout_s, "keep_fetched": False, "insecure": True}
    return {"chunk_size": 32, "tiers": ["cpu", "peer"], "cpu": {"capacity": "64MiB"}, "cluster": cluster}


def start_node(bed: HostBed, host: int, name: str, prompts: list[int]) -> subprocess.Popen:
    node = bed.python(host, hosts_cluster.MODULE, "node", "--config", json.dumps(config(bed, host, name)),
                      "--prompts", f"{prompts[0]}:{prompts[1]}", stdin=subprocess.PIPE)
    ready = json.loads(read_line(node, 180))
    assert ready == {"ready": True, "reported": True, "instance_id": name}, ready
    return node


def call(node: subprocess.Popen, request: dict) -> dict:
    assert node.stdin is not None
    node.stdin.write(json.dumps(request).encode() + b"\n")
    node.stdin.flush()
    return json.loads(read_line(node, 120))


def retrieve(node: subprocess.Popen, prompts: list[int]) -> dict:
    """A retrieve of each prompt, checked: nothing wrong, nothing raised, no call past the deadline."""
    got = call(node, {"op": "retrieve", "prompts": prompts})
    assert got["wrong"] == 0 and got["errors"] == 0 and got["checked"] == got["hit_chunks"], got
    assert got["max_call_s"] <= DEADLINE_S, got
    return got


def start_cluster(bed: HostBed, tmp_path: Path) -> tuple[subprocess.Popen, subprocess.Popen, subprocess.Popen]:
    """1 Gbit links; the controller in host 0, node a (A_PROMPTS stored) in host 1, node b (B_PROMPTS) in host 2."""
    for host in range(3):
        bed.reshape(host, LinkShape(1000))
    (tmp_path / "token").write_text(TOKEN)
    controller = bed.python(0, "kvfabric.cluster.controller", "--host", bed.address(0), "--port", str(PORT),
                            "--token-file", str(tmp_path / "token"), "--instance-ttl", str(INSTANCE_TTL_S),
                            "--insecure", "--log-level", "error", stdout=subprocess.DEVNULL)
    a = start_node(bed, 1, "a", A_PROMPTS)
    b = start_node(bed, 2, "b", B_PROMPTS)
    return controller, a, b


def test_a_node_cut_off_misses_on_the_other_and_is_served_again_after_the_heal(bed: HostBed, tmp_path: Path):
    controller, a, b = start_cluster(bed, tmp_path)
    before = retrieve(b, A_PROMPTS)  # a's chunks, fetched peer to peer through the controller's index
    assert before["hit_chunks"] == before["chunks"] > 0, before
    assert retrieve(a, B_PROMPTS)["hit_chunks"] > 0

    bed.partition(1)  # a's cable pulled: cut off from the controller (and from b)
    cut = time.monotonic()
    rounds, num_prompts, dropped_s = 0, 0, None
    max_call_cut = 0.0
    while dropped_s is None or time.monotonic() - cut < dropped_s + 1.0:  # until the controller has dropped a
        of_a_on_b, of_b_on_b = retrieve(b, A_PROMPTS), retrieve(b, B_PROMPTS)
        of_b_on_a, of_a_on_a = retrieve(a, B_PROMPTS), retrieve(a, A_PROMPTS)
        assert of_a_on_b["hit_chunks"] == 0, of_a_on_b  # a cannot be reached: misses (recomputed), not wrong
        assert of_b_on_b["hit_chunks"] == of_b_on_b["chunks"]  # b's own chunks: served as ever
        assert of_b_on_a["hit_chunks"] == 0  # the controller cannot be reached from a: misses
        assert of_a_on_a["hit_chunks"] == of_a_on_a["chunks"]  # a's own chunks stay a's
        rounds += 1
        num_prompts += sum(r["prompts"] for r in (of_a_on_b, of_b_on_b, of_b_on_a, of_a_on_a))
        max_call_cut = max([max_call_cut] + [r["max_call_s"] for r in (of_a_on_b, of_b_on_b, of_b_on_a, of_a_on_a)])
        seen = call(b, {"op": "instances"})
        if dropped_s is None and seen["error"] is None and "a" not in seen["instances"]:
            dropped_s = time.monotonic() - cut
        assert time.monotonic() - cut < 60, "the controller never dropped the cut node"

    bed.heal(1)
    reregistered_s = time_until(lambda: "a" in call(b, {"op": "instances"})["instances"], 60)
    served_s = time_until(lambda: retrieve(b, A_PROMPTS)["hit_chunks"] == before["chunks"], 60)
    # a's own lookups through the controller: after its breaker's backoff (at most 10 s)
    a_served_s = time_until(lambda: retrieve(a, B_PROMPTS)["hit_chunks"] > 0, 60)
    report("controller cut off from one node: its link partitioned (3 emulated hosts: controller, node a, node b; "
           "1 Gbit)", wrong=0, hangs=0, rounds_during_cut=rounds, prompts_during_cut=num_prompts,
           max_call_during_cut_s=max_call_cut, deadline_s=DEADLINE_S, controller_dropped_a_s=dropped_s,
           instance_ttl_s=INSTANCE_TTL_S, reregistered_s=reregistered_s,
           recovery_s=reregistered_s + served_s, a_lookups_again_s=reregistered_s + served_s + a_served_s,
           note="recovery: from the heal until b is served a's chunks again")

    bed.close()
    assert all(proc.poll() is not None for proc in (controller, a, b))
    assert bed.owned() == []


def test_the_controller_cut_off_from_one_node_only_while_the_nodes_still_reach_each_other(bed: HostBed,
                                                                                           tmp_path: Path):
    """`cut(controller, a)`: a firewall between the controller and node a only. Each node's own chunks are served
    throughout; a's chunks reach b peer to peer where a location still names a; the controller drops a after its
    instance TTL and lists it again after the mend; nothing wrong, no call past the deadline."""
    controller, a, b = start_cluster(bed, tmp_path)
    before = retrieve(b, A_PROMPTS)
    assert before["hit_chunks"] == before["chunks"] > 0, before

    bed.cut(0, 1)
    cut = time.monotonic()
    rounds, num_prompts, dropped_s, max_call_cut, a_hits_on_b = 0, 0, None, 0.0, 0
    while dropped_s is None or time.monotonic() - cut < dropped_s + 1.0:
        got = [retrieve(b, A_PROMPTS), retrieve(b, B_PROMPTS), retrieve(a, B_PROMPTS), retrieve(a, A_PROMPTS)]
        assert got[1]["hit_chunks"] == got[1]["chunks"] and got[3]["hit_chunks"] == got[3]["chunks"], got
        # a's chunks on b: fetched from a (which b still reaches) while a location names it, checked like any
        # other; counted, not required either way
        a_hits_on_b += got[0]["hit_chunks"]
        rounds += 1
        num_prompts += sum(r["prompts"] for r in got)
        max_call_cut = max([max_call_cut] + [r["max_call_s"] for r in got])
        seen = call(b, {"op": "instances"})
        if dropped_s is None and seen["error"] is None and "a" not in seen["instances"]:
            dropped_s = time.monotonic() - cut
        assert time.monotonic() - cut < 60, "the controller never dropped the node cut off from it"

    bed.mend(0, 1)
    reregistered_s = time_until(lambda: "a" in call(b, {"op": "instances"})["instances"], 60)
    served_s = time_until(lambda: retrieve(b, A_PROMPTS)["hit_chunks"] == before["chunks"], 60)
    report("controller cut off from one node only (a firewall between them; the nodes still reach each other; "
           "3 emulated hosts, 1 Gbit)", wrong=0, hangs=0, rounds_during_cut=rounds, prompts_during_cut=num_prompts,
           max_call_during_cut_s=max_call_cut, deadline_s=DEADLINE_S, controller_dropped_a_s=dropped_s,
           a_chunks_served_to_b_during_cut=a_hits_on_b, reregistered_s=reregistered_s,
           recovery_s=reregistered_s + served_s, note="recovery: from the mend until b is served a's chunks again")
    bed.close()
    assert all(proc.poll() is not None for proc in (controller, a, b))
    assert bed.owned() == []
