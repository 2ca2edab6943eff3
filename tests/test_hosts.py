"""The host test bed (kvfabric.bench.hosts): namespaces joined through a switch namespace, shaped links, cleanup.

Each test skips with one line where the bed cannot be built (not root, no iproute2). Tests that start processes
inside the hosts carry the slow marker; the cleanup tests (namespaces only, or one process) run by default.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvfabric.bench import hosts_probe
from kvfabric.bench.hosts import HostBed, HostBedError, LinkShape, check_available, namespaces, read_line, sweep_stale
from kvfabric.bench.hosts_netns import inside
from tests.host_fixtures import host_bed, need_bed


@pytest.fixture
def bed():
    yield from host_bed(3)


def _probe(bed: HostBed, server: int, client: int, num_bytes: int = 1000, timeout_s: float = 30) -> dict:
    """Raw TCP from host `client` to a probe server on host `server`: the probe's JSON result."""
    srv = bed.python(server, "kvfabric.bench.hosts_probe", "serve", bed.address(server))
    port = json.loads(read_line(srv, 60))["port"]
    cli = bed.python(client, "kvfabric.bench.hosts_probe", "measure", bed.address(server), str(port),
                     "--bytes", str(num_bytes), "--pings", "5", "--timeout", str(timeout_s))
    return json.loads(read_line(cli, 60 + timeout_s))


def _ours(run_id: str) -> list[str]:
    return [n for n in namespaces() if n.startswith(run_id)]


# ---- cleanup (default run) ----------------------------------------------------------------------------------
def test_without_root_the_error_is_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(HostBedError) as info:
        check_available()
    assert "\n" not in str(info.value) and "root" in str(info.value)


def test_a_bed_leaves_nothing_after_its_exit_and_after_an_exception():
    need_bed()
    links_before = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.count("\n")
    with HostBed(2) as bed:
        assert sorted(bed.owned()) == sorted([bed.namespace(0), bed.namespace(1), bed.switch])
        sleeper = bed.run(1, ["sleep", "60"])
    assert _ours(bed.run_id) == [] and sleeper.poll() is not None
    with pytest.raises(RuntimeError, match="inside"):
        with HostBed(2) as failing:
            assert len(failing.owned()) == 3
            raise RuntimeError("inside the bed")
    assert _ours(failing.run_id) == []
    assert subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.count("\n") == links_before


def test_sweep_stale_removes_the_namespaces_of_a_dead_pid_only():
    need_bed()
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is free now
    stale, live = f"kvf-{dead.pid}-abc123-h0", f"kvf-{os.getpid()}-abc123-h0"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert stale in sweep_stale()
        assert stale not in namespaces() and live in namespaces()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_sigterm_cleans_up_the_bed_of_the_killed_process():
    need_bed()
    code = ("import sys; from kvfabric.bench.hosts import HostBed; bed = HostBed(2).__enter__(); "
            "p = bed.run(0, ['sleep', '60']); print(bed.run_id, p.pid, flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    run_id, sleeper = read_line(proc, 60).split()
    assert len(_ours(run_id)) == 3
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    assert _ours(run_id) == []
    with pytest.raises(ProcessLookupError):
        os.kill(int(sleeper), 0)


def test_a_removed_host_is_gone_with_its_processes_and_the_others_stay(bed):
    sleeper = bed.run(2, ["sleep", "60"])
    bed.remove(2)
    assert sleeper.poll() is not None and bed.namespace(2) not in namespaces()
    assert sorted(bed.owned()) == sorted([bed.namespace(0), bed.namespace(1), bed.switch])
    with pytest.raises(HostBedError, match="no host 2"):
        bed.address(2)
    links = subprocess.run(["ip", "-n", bed.switch, "-o", "link"], capture_output=True, text=True).stdout
    assert " v0@" in links and " v2@" not in links  # its link went with it


def test_delay_without_netem_fails_with_one_line_and_loss_does_not(bed, monkeypatch):
    if bed.is_netem:
        bed.reshape(0, LinkShape(100, 1.0, 0.0))  # accepted where the kernel has sch_netem
        return
    with pytest.raises(HostBedError, match="sch_netem") as info:
        bed.reshape(0, LinkShape(100, 0.25))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError):
        LinkShape(100, 0, 101)
    if shutil.which("nft") is None:
        pytest.skip("nft not found (the nftables package): loss cannot be shaped without sch_netem")
    bed.reshape(0, LinkShape(100, 0, 1.0))  # loss alone: nftables
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(HostBedError, match="nftables package") as info:
        bed.reshape(1, LinkShape(100, 0, 1.0))
    assert "\n" not in str(info.value)
    bed.reshape(1, LinkShape(100))  # no loss asked: nft not needed


SO_RCVBUFFORCE = 33  # Linux; not in Python's socket module: a buffer past rmem_max (root)


def _datagrams_through(bed: HostBed, sender: int, receiver: int, count: int = 4000) -> int:
    """UDP datagrams sent from one host to the other (sockets made inside them): how many distinct ones arrive."""
    def sink() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 32 << 20)  # all of them fit: only the link drops
        sock.bind((bed.address(receiver), 0))
        return sock
    rx = inside(bed.namespace(receiver), sink)
    tx = inside(bed.namespace(sender), lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    seen: set[int] = set()
    with rx, tx:
        for i in range(count):
            tx.sendto(i.to_bytes(4, "little"), rx.getsockname())
        rx.settimeout(0.5)  # the end: half a second without a datagram
        try:
            while len(seen) < count:
                seen.add(int.from_bytes(rx.recv(4), "little"))
        except TimeoutError:
            pass
    return len(seen)


def test_a_lossy_link_drops_its_share_each_way_and_loss_0_drops_none(bed):
    if not bed.is_netem and shutil.which("nft") is None:
        pytest.skip("nft not found (the nftables package): loss cannot be shaped without sch_netem")
    bed.reshape(0, LinkShape(0, 0, 30.0))
    assert 0.25 <= 1 - _datagrams_through(bed, 1, 0) / 4000 <= 0.35
    for host in (0, 1):
        bed.reshape(host, LinkShape(0, 0, 5.0))  # replaces host 0's rule
    lost = [1 - _datagrams_through(bed, a, b) / 4000 for a, b in ((0, 1), (1, 0))]
    assert all(0.03 <= share <= 0.08 for share in lost), lost
    if not bed.is_netem:  # the rule's counters: what arrived at host 0, and what it dropped of it
        arrived, dropped = bed.input_counts(0)
        assert arrived >= 4000 and abs(dropped - round(lost[1] * 4000)) <= 5, (arrived, dropped, lost)
    for host in (0, 1):
        bed.reshape(host, LinkShape(0))
    assert _datagrams_through(bed, 0, 1) == _datagrams_through(bed, 1, 0) == 4000
    if not bed.is_netem:  # the rule is gone, not set to 0
        assert bed.input_counts(0) is None
        rules = subprocess.run(["ip", "netns", "exec", bed.namespace(0), "nft", "list", "ruleset"],
                               capture_output=True, text=True)
        assert "kvf" not in rules.stdout


# ---- links (processes inside the hosts: slow) ---------------------------------------------------------------
@pytest.mark.slow
def test_two_hosts_reach_each_other_and_nothing_else(bed):
    assert _probe(bed, 0, 1)["bytes"] == 1000
    for i in range(3):  # each host's one route is the bed's subnet: no way out
        routes = subprocess.run(["ip", "-n", bed.namespace(i), "-4", "route"], capture_output=True, text=True)
        assert routes.stdout.split()[:3] == ["10.213.0.0/24", "dev", "eth0"] and routes.stdout.count("\n") == 1
    srv = bed.python(2, "kvfabric.bench.hosts_probe", "serve", bed.address(2))
    port = json.loads(read_line(srv, 60))["port"]
    with pytest.raises(OSError):  # the root namespace has no link to the bed
        hosts_probe.measure(bed.address(2), port, 10, 1, timeout_s=1.0)


@pytest.mark.slow
def test_a_shaped_link_gives_its_rate(bed):
    for i in range(3):
        bed.reshape(i, LinkShape(100))
    result = _probe(bed, 0, 1, num_bytes=12_500_000)  # 1 s at 100 Mbit
    assert 80 <= result["mbit"] <= 105, result
    bed.reshape(0, LinkShape(0))
    bed.reshape(1, LinkShape(0))
    assert _probe(bed, 0, 1, num_bytes=50_000_000)["mbit"] > 200  # unshaped: far above


@pytest.mark.slow
def test_a_delayed_link_gives_twice_its_delay_as_rtt(bed):
    if not bed.is_netem:
        pytest.skip("this kernel has no sch_netem: delay cannot be shaped")
    for i in range(3):
        bed.reshape(i, LinkShape(1000, 5.0))
    rtt = _probe(bed, 0, 1)["rtt_ms"]
    assert 9.5 <= rtt <= 13, rtt


@pytest.mark.slow
def test_a_partitioned_host_is_unreachable_until_healed(bed):
    bed.reshape(0, LinkShape(1000))
    srv = bed.python(0, "kvfabric.bench.hosts_probe", "serve", bed.address(0))
    port = json.loads(read_line(srv, 60))["port"]
    measure = ("kvfabric.bench.hosts_probe", "measure", bed.address(0), str(port), "--pings", "1", "--timeout")
    bed.partition(0)
    started = time.monotonic()
    assert "error" in json.loads(read_line(bed.python(1, *measure, "1"), 60))
    assert time.monotonic() - started < 20
    bed.heal(0)
    assert json.loads(read_line(bed.python(1, *measure, "10"), 60))["bytes"] > 0
    qdisc = subprocess.run(["tc", "-n", bed.switch, "qdisc", "show", "dev", "v0"], capture_output=True, text=True)
    assert "tbf" in qdisc.stdout and "1Gbit" in qdisc.stdout  # the shaping survives the partition


@pytest.mark.slow
def test_two_hosts_cut_apart_still_reach_the_third_until_mended(bed):
    srv = bed.python(0, "kvfabric.bench.hosts_probe", "serve", bed.address(0))
    port = json.loads(read_line(srv, 60))["port"]
    measure = ("kvfabric.bench.hosts_probe", "measure", bed.address(0), str(port), "--pings", "1", "--timeout")
    bed.cut(0, 1)
    assert "error" in json.loads(read_line(bed.python(1, *measure, "1"), 60))  # 1 cannot reach 0
    assert json.loads(read_line(bed.python(2, *measure, "10"), 60))["bytes"] > 0  # 2 still can
    bed.mend(1, 0)
    assert json.loads(read_line(bed.python(1, *measure, "10"), 60))["bytes"] > 0
