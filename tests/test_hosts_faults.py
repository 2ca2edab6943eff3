"""Faults over the host test bed (kvfabric.bench.hosts), each with real processes in separate network namespaces:
P2P fetches over lossy links, a host removed while it serves. (The cluster's faults: test_hosts_cluster.py.)

Each asserts that every request is answered (all its chunks, or an error that makes the rest misses) within the
deadlines a peer tier uses (ClusterConfig), that every chunk that arrives is intact and equal to the stored bytes,
that no process or namespace is left, and prints its figures as one `RELIABILITY {json}` line (pytest -s)."""
from __future__ import annotations

import json
import statistics
import subprocess
import time

import pytest

from kvfabric.bench.hosts import HostBed, LinkShape, read_line
from kvfabric.config import ClusterConfig
from tests.host_fixtures import ask, host_bed, start_pair
from tests.reliability.harness import report

pytestmark = pytest.mark.slow
SLACK_S = 1.0  # scheduling on a shared machine, beyond a deadline


@pytest.fixture
def bed():
    yield from host_bed(2)


def answer(client: subprocess.Popen, timeout_s: float = 120) -> dict:
    """The result of one fetch (the `first` event skipped)."""
    got = json.loads(read_line(client, timeout_s))
    return json.loads(read_line(client, timeout_s)) if got == {"event": "first"} else got


def assert_answered(got: dict, num_chunks: int, settings: ClusterConfig) -> None:
    """All chunks intact, or an error (the rest are misses); no answer waited past the peer tier's deadline."""
    assert got["is_correct"], got
    assert got["received"] == num_chunks or got["error"], got
    assert got["max_wait_s"] <= settings.fetch_timeout_s + settings.connect_timeout_s + SLACK_S, got


def assert_nothing_left(bed: HostBed, *procs: subprocess.Popen) -> None:
    bed.close()
    assert all(proc.poll() is not None for proc in procs)
    assert bed.owned() == []


@pytest.mark.parametrize("loss_pct", [1.0, 5.0])
def test_p2p_fetches_over_a_lossy_link_arrive_intact_or_miss_within_the_deadline(bed: HostBed, loss_pct: float):
    settings, num_chunks, num_fetches = ClusterConfig(), 8, 6  # the default deadlines; 47 MB a fetch
    for host in (0, 1):
        bed.reshape(host, LinkShape(1000, 0, loss_pct))  # loss each way (netem, or nftables on each input)
    server, client = start_pair(bed, settings, num_chunks)
    results = []
    for _ in range(num_fetches):
        ask(client)
        results.append(answer(client))
        assert_answered(results[-1], num_chunks, settings)
    counts = [bed.input_counts(host) for host in (0, 1)]  # (in, dropped) by nftables; None under netem
    for arrived, dropped in filter(None, counts):  # the loss was there, frame by frame
        assert arrived > 10_000 and loss_pct / 2 <= 100 * dropped / arrived <= loss_pct * 2, counts
    for host in (0, 1):
        bed.reshape(host, LinkShape(1000))
    ask(client)
    clean = answer(client)
    assert clean["error"] is None and clean["received"] == num_chunks and clean["is_correct"], clean
    full = [r for r in results if r["received"] == num_chunks]
    assert full, results  # TCP retransmits: at these rates of loss, fetches do complete
    report(f"P2P fetches over {loss_pct:g} % loss each way across emulated hosts (1 Gbit, 8 chunks of 5.9 MB)",
           wrong=0, fetches=num_fetches, full_fetches=len(full),
           chunk_hit_share=sum(r["received"] for r in results) / (num_fetches * num_chunks),
           median_fetch_s=statistics.median(r["ended"] - r["started"] for r in full),
           max_fetch_s=max(r["ended"] - r["started"] for r in results),
           max_wait_s=max(r["max_wait_s"] for r in results), deadline_s=settings.fetch_timeout_s,
           lossless_fetch_s=clean["ended"] - clean["started"], packets_in_dropped=counts)
    assert_nothing_left(bed, server, client)


def test_a_host_removed_while_it_serves_ends_the_fetch_within_the_deadline(bed: HostBed):
    settings, num_chunks = ClusterConfig(fetch_timeout_s=1.0, connect_timeout_s=0.5), 8
    for host in (0, 1):
        bed.reshape(host, LinkShape(100))  # 47 MB: 3.8 s, so the removal lands mid-transfer
    server, client = start_pair(bed, settings, num_chunks)
    ask(client)
    assert json.loads(read_line(client, 30)) == {"event": "first"}
    bed.remove(0)  # host A gone: its processes killed, its namespace and link deleted
    gone = time.monotonic()
    assert server.poll() is not None
    cut = json.loads(read_line(client, 30))
    assert cut["error"] and 0 < cut["received"] < num_chunks and cut["is_correct"], cut
    assert cut["ended"] - gone <= settings.fetch_timeout_s + SLACK_S, cut["ended"] - gone

    asked = time.monotonic()
    ask(client)  # to the gone host's address: nobody answers, within the connect deadline
    refused = answer(client, 30)
    assert refused["error"] and refused["received"] == 0 and refused["is_correct"], refused
    assert refused["ended"] - asked <= settings.connect_timeout_s + SLACK_S, refused["ended"] - asked
    report("host removed (namespace deleted) while serving a P2P fetch (100 Mbit, 8 chunks of 5.9 MB)", wrong=0,
           received_before_removal=cut["received"], removal_to_miss_s=cut["ended"] - gone,
           deadline_s=settings.fetch_timeout_s, fetch_to_gone_host_s=refused["ended"] - asked,
           connect_deadline_s=settings.connect_timeout_s)
    assert_nothing_left(bed, server, client)
