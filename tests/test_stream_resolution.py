"""Resolution adaptation (kvfabric.stream.policy.ResolutionPolicy) and video chunks over the stream: the policy's
choices on a simulated clock, the fluctuating trace's bucket, and an end-to-end stream of video levels."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kvfabric.codec.video import VideoCodec
from kvfabric.kv.layout import KVLayout
from kvfabric.stream import Receiver, ThrottledSocket, TokenBucket, loopback_pair, prepare, send_prompt
from kvfabric.stream import policy as policy_module
from kvfabric.stream.policy import RAW, RECOMPUTE, ResolutionPolicy, WorkCosts

RAW_BYTES, V7_BYTES = 5_900_000, 1_550_000
DECODE = {RAW: 0.005, "V0": 0.030, "V7": 0.040}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def simulate(monkeypatch, policy: ResolutionPolicy, bps: float, chunks: int) -> tuple[list[str], float]:
    """Send `chunks` chunks at `bps` on a simulated clock; returns the choices and the time the receiver's worker
    finishes (one worker, decoding in order while later chunks are on the wire)."""
    clock = Clock()
    monkeypatch.setattr(policy_module, "time", clock)
    sizes = {RAW: [RAW_BYTES] * chunks, "V0": [int(RAW_BYTES / 1.17)] * chunks, "V7": [V7_BYTES] * chunks,
             RECOMPUTE: [1024] * chunks}
    picks, worker_free = [], clock.now
    for i in range(chunks):
        choice = policy.choose({o: s[i:] for o, s in sizes.items()}, 0.0)
        send = sizes[choice.option][i] / bps
        clock.now += send
        work = policy.recompute_s if choice.option == RECOMPUTE else DECODE[choice.option]
        worker_free = max(clock.now, worker_free) + work
        if choice.option != RECOMPUTE:
            policy.observe(sizes[choice.option][i], send)
        picks.append(choice.option)
    return picks, worker_free - 100.0


def test_slow_link_gets_the_smallest_frames(monkeypatch):
    policy = ResolutionPolicy([RAW, "V0", "V7"], DECODE, initial_bps=12.5e6)
    picks, _ = simulate(monkeypatch, policy, 12.5e6, 12)
    assert picks == ["V7"] * 12


def test_fast_link_with_a_busy_decoder_mixes_raw_and_frames(monkeypatch):
    """At 1 Gbit/s raw is link-bound (47 ms) and V7 decode-bound (40 ms): alternating keeps both busy."""
    policy = ResolutionPolicy([RAW, "V0", "V7"], DECODE, initial_bps=125e6)
    picks, mixed = simulate(monkeypatch, policy, 125e6, 40)
    assert {RAW, "V7"} <= set(picks) and 0.2 <= picks.count(RAW) / 40 <= 0.6
    _, v7_only = simulate(monkeypatch, ResolutionPolicy(["V7"], DECODE, initial_bps=125e6), 125e6, 40)
    _, raw_only = simulate(monkeypatch, ResolutionPolicy([RAW], DECODE, initial_bps=125e6), 125e6, 40)
    assert mixed < 0.85 * min(v7_only, raw_only), (mixed, v7_only, raw_only)


def test_only_the_previous_chunk_counts_and_recompute_is_the_fallback(monkeypatch):
    policy = ResolutionPolicy([RAW, "V7"], DECODE, recompute_s=0.3)
    assert policy.choose({RAW: [RAW_BYTES], "V7": [V7_BYTES], RECOMPUTE: [1024]}, 0.0).option == "V7"  # no estimate
    policy.observe(10_000_000, 0.08)  # 125 MB/s
    policy.observe(100_000, 0.1)  # then the link all but stopped: 1 MB/s
    assert policy.estimate_bps() == pytest.approx(1e6)
    assert policy.choose({RAW: [RAW_BYTES], "V7": [V7_BYTES], RECOMPUTE: [1024]}, 0.0).option == RECOMPUTE


def test_trace_bucket_follows_its_trace():
    from kvfabric.bench.stream_trace import TraceBucket
    bucket = TraceBucket(((1000.0, 1.0), (10.0, 0.5)), 64)
    t0 = bucket.t0
    assert [bucket.rate_at(t0 + x) for x in (0.0, 0.99, 1.01, 1.49, 1.51, 4.25)] == [1000, 1000, 10, 10, 1000, 10]


def test_video_levels_stream_end_to_end():
    """A prompt prepared with video levels travels chunk by chunk under the resolution policy; the receiver decodes
    codec id 3 into its buffer, every value within its chunk's stated bound (exact for the lossless level)."""
    layout = KVLayout(2, 2, 16, "float16")
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(layout.shape(200), generator=g) + torch.randn(2, 2, 2, 1, 16, generator=g)).half()
    prompt = prepare(list(range(200)), kv, layout, "m", 64, levels=(), video_levels=(0, 7), time_decode=True)
    assert set(prompt.blobs) == {RAW, "V0", "V7"} and all(s > 0 for s in prompt.decode_s.values())
    assert sum(map(len, prompt.blobs["V7"])) < 0.6 * sum(map(len, prompt.blobs[RAW]))
    policy = ResolutionPolicy([RAW, "V0", "V7"], prompt.decode_s, initial_bps=2e6)
    buf = torch.full(layout.shape(200), float("nan"))
    rx = Receiver(layout, "m", buf, None)
    cli, conn = loopback_pair()
    box = {}
    t0 = time.perf_counter()
    th = threading.Thread(target=lambda: box.setdefault("rx", rx.receive(conn, t0)))
    th.start()
    report = send_prompt(ThrottledSocket(cli, TokenBucket(2e6, 16 * 1024)), prompt, policy, t0)
    th.join(30)
    for closeable in (cli, conn, rx):
        closeable.close()
    picks = [c.option for c in report.choices]
    assert "V7" in picks and all(c.codec_id in (0, 3) for c in box["rx"].chunks)
    for i, option in enumerate(picks):
        s, e = prompt.span(i)
        got, want = buf[:, :, :, s:e], kv[:, :, :, s:e]
        if option == "V7":
            bound = VideoCodec(7).error_bound(want, prompt.blobs["V7"][i], layout)
            assert bool(((got - want.float()).abs() <= bound).all())
        else:
            assert torch.equal(got, want.float())


def test_bench_stream_rejects_a_bad_ladder():
    from click.testing import CliRunner

    from kvfabric.apps.cli import main
    for ladder in ("0,x", "0,12"):
        result = CliRunner().invoke(main, ["bench", "stream", "--trace-only", "--ladder", ladder])
        assert result.exit_code == 2 and "--ladder" in result.output, result.output


@pytest.mark.slow
def test_bench_stream_trace_smoke():
    """The fluctuating trace on the real model, briefly: adaptive and every fixed setting run and are compared."""
    import json

    from click.testing import CliRunner

    from kvfabric.apps.cli import main
    result = CliRunner().invoke(main, ["bench", "stream", "--json", "--trace-only", "--quick", "--trace-seconds", "2",
                                       "--tokens", "512"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(r["strategy"], r["option"]) for r in rows] == [("adaptive", "per chunk"), ("fixed", "raw"),
                                                            ("fixed", "V0"), ("fixed", "V5"), ("fixed", "V6")]
    assert all(r["mean_chunk_ms"] > 0 and r["chunks"] >= 2 for r in rows)
    fixed = {r["option"]: r for r in rows if r["strategy"] == "fixed"}
    assert fixed["raw"]["kl_mean"] == 0.0 and fixed["V0"]["kl_mean"] == 0.0 and fixed["V6"]["kl_mean"] > 0
    assert rows[0]["best_fixed"] in fixed and rows[0]["vs_best_fixed"] < 1


def test_a_jumpy_link_prices_in_the_risk_of_big_chunks(monkeypatch):
    """After rate jumps between 125 and 12.5 MB/s, a raw chunk's expected send time includes the chance of a
    drop mid-send; on a steady link it is bytes / rate."""
    clock = Clock()
    monkeypatch.setattr(policy_module, "time", clock)
    steady, jumpy = ResolutionPolicy([RAW, "V7"], DECODE), ResolutionPolicy([RAW, "V7"], DECODE)
    for i in range(10):
        clock.now += 0.5
        steady.observe(V7_BYTES, V7_BYTES / 125e6)
        jumpy.observe(V7_BYTES, V7_BYTES / (125e6 if i % 2 else 12.5e6))
    assert steady.send_s(RAW_BYTES, 125e6) == pytest.approx(RAW_BYTES / 125e6)
    risky = jumpy.send_s(RAW_BYTES, 125e6)
    assert RAW_BYTES / 125e6 * 1.2 < risky < RAW_BYTES / 12.5e6
    assert jumpy.send_s(V7_BYTES, 125e6) / (V7_BYTES / 125e6) < risky / (RAW_BYTES / 125e6)  # small chunks: less


def _busy_worker_policy() -> ResolutionPolicy:
    """A 2 Gbit/s link (250 MB/s) and a receiver whose worker has ~30 ms of L9 chunks queued."""
    policy = ResolutionPolicy(["raw", "L9"], {"raw": 0.001, "L9": 0.006}, initial_bps=250e6)
    for _ in range(5):
        # chunks whose raw form would take the link 0.2 s: L9 each time, and the worker's queue grows
        assert policy.choose({"raw": [50_000_000] * 3, "L9": [600_000] * 3}, 0.0).option == "L9"
        policy.observe(600_000, 600_000 / 250e6)
    return policy


def test_a_link_still_busy_with_queued_bytes_is_not_taken_for_a_free_one():
    last = {"raw": [5_900_000], "L9": [600_000]}
    # the link free now, the worker busy: the last chunk goes raw (on the wire while the worker catches up)
    assert _busy_worker_policy().choose(last, 0.0).option == "raw"
    # 10 MB still in the sender's socket (40 ms of this link): raw would wait behind them, L9 is sooner
    assert _busy_worker_policy().choose(last, 0.0, queued_bytes=10_000_000).option == "L9"


def test_reported_decode_costs_turn_a_fast_link_to_raw(monkeypatch):
    """At 10 Gbit/s (1.25 GB/s) a raw chunk is 4.7 ms on the link: with L9 decoding in 1.5 ms (measured alone) L9 is
    sooner for most chunks; once the receiver reports 12 ms per L9 chunk (its cores also receive), raw is."""
    sizes = {RAW: [RAW_BYTES] * 8, "L9": [600_000] * 8}
    alone = ResolutionPolicy([RAW, "L9"], {RAW: 0.001, "L9": 0.0015}, initial_bps=1.25e9)
    assert simulate_picks(monkeypatch, alone, sizes).count("L9") >= 6
    learned = WorkCosts({RAW: 0.001, "L9": 0.0015})  # one per receiver, across streams
    taught = ResolutionPolicy([RAW, "L9"], learned, initial_bps=1.25e9)
    for _ in range(8):
        taught.observe_work("L9", 0.012)
    assert learned.get("L9") == pytest.approx(0.012, rel=0.15)  # the sender's next stream starts here
    assert simulate_picks(monkeypatch, ResolutionPolicy([RAW, "L9"], learned, initial_bps=1.25e9), sizes) \
        .count(RAW) >= 6
    taught.observe_work(RECOMPUTE, 0.2)  # recompute reports move recompute_s, not a decode cost
    assert taught.recompute_s == 0.2 and learned.get(RECOMPUTE) == 0.0


def test_options_not_reported_yet_share_the_receivers_slowdown():
    """Reports that L9 costs 3x its alone time make L5 (never sent) cost 3x too: the avoided option must not look
    cheap only because the used one was measured under load; L5's own reports then take over."""
    costs = WorkCosts({RAW: 0.001, "L5": 0.006, "L9": 0.005})
    for _ in range(12):
        costs.observe("L9", 0.015)
    assert costs.get("L9") == pytest.approx(0.015, rel=0.05) and costs.get("L5") == pytest.approx(0.018, rel=0.1)
    for _ in range(12):
        costs.observe("L5", 0.007)
    assert costs.get("L5") == pytest.approx(0.007, rel=0.05)


def simulate_picks(monkeypatch, policy: ResolutionPolicy, sizes: dict[str, list[int]]) -> list[str]:
    clock = Clock()
    monkeypatch.setattr(policy_module, "time", clock)
    picks = []
    for i in range(len(sizes[RAW])):
        option = policy.choose({o: s[i:] for o, s in sizes.items()}, 0.0).option
        clock.now += sizes[option][i] / 1.25e9
        policy.observe(sizes[option][i], sizes[option][i] / 1.25e9)
        picks.append(option)
    return picks


class Recorder:
    """A fixed policy that records the receiver's reports it is handed."""

    def __init__(self, option: str) -> None:
        self.option, self.reports = option, []

    def choose(self, remaining, elapsed_s, queued_bytes=0):
        return policy_module.Choice(self.option, None, 0.0)

    def observe(self, nbytes, seconds):
        return None

    def observe_work(self, option, seconds):
        self.reports.append((option, seconds))


def _stream(prompt, policy, layout, num_tokens, reply=None):
    """Send `prompt` to a Receiver over loopback; `reply`: bytes the receiving side writes back first instead."""
    buf = torch.zeros(layout.shape(num_tokens))
    rx = Receiver(layout, "m", buf, None)
    cli, conn = loopback_pair()
    box = {}
    if reply is not None:
        conn.sendall(reply)
    th = threading.Thread(target=lambda: box.setdefault("rx", rx.receive(conn)))
    th.start()
    report = send_prompt(cli, prompt, policy, report_wait_s=10.0)
    th.join(30)
    for closeable in (cli, conn, rx):
        closeable.close()
    return report, box["rx"], buf


def test_the_receiver_reports_each_chunks_work_to_the_sender():
    layout = KVLayout(2, 2, 16, "float16")
    kv = torch.randn(layout.shape(200), generator=torch.Generator().manual_seed(1)).half()
    prompt = prepare(list(range(200)), kv, layout, "m", 64, levels=(9,))
    policy = Recorder("L9")
    report, rx, _ = _stream(prompt, policy, layout, 200)
    assert len(rx.chunks) == 4 and sorted(report.work_s) == [0, 1, 2, 3]  # every chunk, after END too
    assert [o for o, _ in policy.reports] == ["L9"] * 4
    assert [s for _, s in policy.reports] == [report.work_s[i] for i in range(4)] and min(report.work_s.values()) > 0


def test_a_receiver_that_writes_garbage_loses_its_say_not_the_stream():
    layout = KVLayout(2, 2, 16, "float16")
    kv = torch.randn(layout.shape(130), generator=torch.Generator().manual_seed(2)).half()
    prompt = prepare(list(range(130)), kv, layout, "m", 64, levels=())
    policy = Recorder(RAW)
    report, rx, buf = _stream(prompt, policy, layout, 130, reply=b"HTTP/1.1 200 OK\r\n" * 4)
    assert policy.reports == [] and report.work_s == {}
    assert torch.equal(buf, kv.float())  # every chunk arrived intact all the same


def test_streams_sharing_a_connection_hand_each_report_to_its_own_stream():
    """Two prompts back to back on one connection, one WorkReports for it: the first stream's late reports reach
    its policy (and its SendReport) while the second is sent, nothing waits for them, and none is mixed up."""
    from kvfabric.stream.sender import WorkReports
    layout = KVLayout(2, 2, 16, "float16")
    kv = torch.randn(layout.shape(200), generator=torch.Generator().manual_seed(3)).half()
    prompt = prepare(list(range(200)), kv, layout, "m", 64, levels=(9,))
    rx = Receiver(layout, "m", torch.zeros(layout.shape(200)), None)
    cli, conn = loopback_pair()
    th = threading.Thread(target=lambda: [rx.receive(conn) for _ in range(2)])
    th.start()
    shared = WorkReports(cli)
    first, second = Recorder("L9"), Recorder(RAW)
    reports = [send_prompt(cli, prompt, p, reports=shared) for p in (first, second)]
    th.join(30)
    deadline = time.monotonic() + 10
    while shared.num_pending and time.monotonic() < deadline:
        shared.poll(0.5)
    for closeable in (cli, conn, rx):
        closeable.close()
    assert [o for o, _ in first.reports] == ["L9"] * 4 and [o for o, _ in second.reports] == [RAW] * 4
    assert [sorted(r.work_s) for r in reports] == [[0, 1, 2, 3]] * 2
