"""KV streaming between emulated hosts (kvfabric.bench.hosts_stream): sockets made inside a host's namespace,
and `bench stream --hosts` end to end. Each test skips with one line where the bed cannot be built."""
from __future__ import annotations

import json
import socket
import time

import pytest
from click.testing import CliRunner

from kvfabric.bench.hosts import HostBed, LinkShape
from kvfabric.bench.hosts_netns import inside, link_mbit
from kvfabric.stream.meter import LinkMeter
from tests.host_fixtures import host_bed, need_bed


@pytest.fixture
def bed():
    yield from host_bed(2)


def test_a_socket_made_inside_a_host_lives_there_and_this_thread_does_not_move(bed: HostBed):
    srv = inside(bed.namespace(1), lambda: _listen(bed.address(1)))
    with srv:
        cli = inside(bed.namespace(0), lambda: socket.create_connection(srv.getsockname(), timeout=5))
        conn, (peer, _) = srv.accept()
        with cli, conn:
            assert peer == bed.address(0)  # host 0 reached host 1 over the bridge
            cli.sendall(b"ping")
            assert conn.recv(4) == b"ping"
    with pytest.raises(OSError):  # this thread is still in the root namespace: host 1's address is not here
        _listen(bed.address(1))
    with pytest.raises(OSError):  # and a host cannot reach the root namespace's loopback
        root = _listen("127.0.0.1")
        with root:
            inside(bed.namespace(0), lambda: socket.create_connection(root.getsockname(), timeout=1))


def test_inside_hands_the_error_of_a_missing_namespace_to_the_caller():
    need_bed()
    with pytest.raises(FileNotFoundError):
        inside("kvf-0-000000-h9", lambda: None)


@pytest.mark.slow
def test_the_link_baseline_follows_the_shaped_rate(bed: HostBed):
    for host in (0, 1):
        bed.reshape(host, LinkShape(200))
    assert 150 <= link_mbit(bed, 8 << 20) <= 210
    for host in (0, 1):
        bed.reshape(host, LinkShape(1000))
    assert 750 <= link_mbit(bed, 16 << 20) <= 1050


@pytest.mark.slow
def test_bench_stream_across_hosts_reports_every_strategy_at_each_rate():
    need_bed()
    from kvfabric.apps.cli import main
    res = CliRunner().invoke(main, ["bench", "stream", "--hosts", "--quick", "--rates", "300,3000", "--repeats", "1",
                                    "--json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]
    strategies = {"raw", "L1", "L3", "L5", "L7", "L9", "recompute", "adaptive", "adaptive-slo"}
    for rate in (300, 3000):
        got = {r["strategy"]: r for r in rows if r["rate_mbit"] == rate}
        assert set(got) == strategies
        best = got[got["raw"]["best_fixed"]]
        assert best["vs_best_fixed"] == 1.0 and best["strategy"] not in ("adaptive", "adaptive-slo")
        assert all(r["ttft_s"] > 0 and len(r["ttft_samples"]) == 1 and r["same_first"] is not None
                   for r in got.values())
        assert got["recompute"]["options"] == "recomputex4" and got["raw"]["options"] == "rawx4"
        assert got["L9"]["work_ms"] > 0 and got["L9"]["work_alone_ms"] > 0 and got["adaptive"]["work_alone_ms"] is None
        assert 0.5 * rate <= got["raw"]["link_mbit"] <= 1.1 * rate
    slow_raw = next(r for r in rows if r["rate_mbit"] == 300 and r["strategy"] == "raw")
    fast_raw = next(r for r in rows if r["rate_mbit"] == 3000 and r["strategy"] == "raw")
    assert slow_raw["ttft_s"] > fast_raw["ttft_s"]  # 12 MB raw at 300 Mbit takes 0.3 s more than at 3 Gbit
    assert slow_raw["kl_first"] == 0.0


def _listen(address: str) -> socket.socket:
    srv = socket.socket()
    srv.bind((address, 0))
    srv.listen(1)
    return srv


def test_a_send_that_fits_the_buffer_is_timed_by_the_meter_at_the_links_pace(bed: HostBed):
    """On a 100 Mbit link a 1 MB send returns at once (the socket's buffer takes it); the kernel's count of what
    was acknowledged moves at 12.5 MB/s, and that is what the meter reads (stream/meter.py)."""
    for host in (0, 1):
        bed.reshape(host, LinkShape(100))
    srv = inside(bed.namespace(1), lambda: _listen(bed.address(1)))
    with srv:
        cli = inside(bed.namespace(0), lambda: socket.create_connection(srv.getsockname(), timeout=5))
        conn, _ = srv.accept()
        with cli, conn:
            cli.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            meter = LinkMeter(cli, min_window_s=0.02)
            started = time.perf_counter()
            cli.sendall(bytes(1 << 20))
            send_s = time.perf_counter() - started
            got = 0
            while got < 1 << 19:  # half of it delivered: the link has been busy for ~40 ms
                got += len(conn.recv(1 << 20))
            rate = meter.rate_bps()
    assert (1 << 20) / send_s > 50e6  # the send call alone would say > 400 Mbit
    assert rate is not None and 5e6 < rate < 16e6, rate  # the meter: the link's 12.5 MB/s
