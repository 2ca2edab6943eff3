"""P2P between emulated hosts (kvfabric.bench.hosts_p2p): the benchmark's rows, and a partition in the middle of a
transfer. Real processes in separate network namespaces over shaped veth links: slow."""
from __future__ import annotations

import json
import time

import pytest

from kvfabric.bench import hosts_p2p
from kvfabric.bench.hosts import HostBed, LinkShape, read_line
from kvfabric.config import ClusterConfig
from tests.host_fixtures import ask, host_bed, need_bed, start_pair
from tests.reliability.harness import report

pytestmark = pytest.mark.slow
NUM_CHUNKS = 8  # 47 MB: 3.8 s at 100 Mbit, so a partition after the first chunk lands mid-transfer


@pytest.fixture
def bed():
    yield from host_bed(2)


def test_bench_p2p_across_hosts_reports_sane_rows(capsys):
    need_bed()
    rows = hosts_p2p.run(as_json=True, repeats=1, num_chunks=2, rates=(1000.0,))
    (row,) = rows
    assert row["rate_mbit"] == 1000.0 and row["mb"] > 10 and row["target"] == 0.9
    assert 0.05 < row["baseline_gbps"] <= 0.13, row  # 1 Gbit = 0.125 GB/s: the link, not loopback
    assert 0.5 < row["ratio"] < 1.5, row
    assert capsys.readouterr().out.count("\n") == 1


def test_a_partition_mid_transfer_is_a_miss_within_the_deadline_and_heal_serves_again(bed: HostBed):
    settings = ClusterConfig(fetch_timeout_s=1.0, connect_timeout_s=0.5)  # the deadlines a peer tier would use
    for host in (0, 1):
        bed.reshape(host, LinkShape(100))
    server, client = start_pair(bed, settings, NUM_CHUNKS)

    ask(client)
    assert json.loads(read_line(client, 30)) == {"event": "first"}
    bed.partition(0)  # host A's cable pulled while B is fetching
    cut = time.monotonic()
    cut_off = json.loads(read_line(client, 30))
    assert cut_off["error"] and 0 < cut_off["received"] < NUM_CHUNKS, cut_off  # the rest are misses
    assert cut_off["is_correct"], cut_off  # what did arrive is intact and equal to what A stores
    assert cut_off["ended"] - cut <= settings.fetch_timeout_s + 1.0, cut_off["ended"] - cut

    asked = time.monotonic()
    ask(client)  # still partitioned: nothing arrives, within the connect deadline
    refused = json.loads(read_line(client, 30))
    assert refused["error"] and refused["received"] == 0 and refused["is_correct"], refused
    assert refused["ended"] - asked <= settings.connect_timeout_s + 1.0

    bed.heal(0)
    for host in (0, 1):
        bed.reshape(host, LinkShape(1000))
    healed, healed_at = None, time.monotonic()
    while healed is None and time.monotonic() - healed_at < 10:
        # A's ARP entry for B failed during the partition and is retried once a second (neigh retrans_time), as on
        # a real network: the first fetches after the heal may still miss, each within its deadline
        ask(client)
        answer = json.loads(read_line(client, 30))
        if answer == {"event": "first"}:
            healed = json.loads(read_line(client, 30))
        else:
            assert answer["error"] and answer["received"] == 0 and answer["is_correct"], answer
    assert healed is not None and healed["error"] is None and healed["received"] == NUM_CHUNKS, healed
    assert healed["is_correct"], healed
    report("P2P fetch partitioned mid-transfer across emulated hosts (100 Mbit, 8 chunks of 5.9 MB)", wrong=0,
           received_before_cut=cut_off["received"], cut_to_miss_s=cut_off["ended"] - cut,
           deadline_s=settings.fetch_timeout_s, partitioned_fetch_s=refused["ended"] - asked,
           recovery_s=healed["ended"] - healed_at)

    bed.close()
    assert server.poll() is not None and client.poll() is not None
    assert bed.owned() == []
