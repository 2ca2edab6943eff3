"""Adaptive KV streaming over loopback TCP: throttle accuracy, end-to-end delivery (raw, cachegen, recompute,
adaptive), the policy's choices, and a receiver that survives hostile frames."""
from __future__ import annotations

import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvfabric.codec.format import HEADER_BYTES
from kvfabric.kv.layout import KVLayout
from kvfabric.stream import (
    AdaptivePolicy,
    FixedPolicy,
    Receiver,
    ThrottledSocket,
    TokenBucket,
    loopback_pair,
    prepare,
    send_prompt,
    throttle,
)
from kvfabric.stream import protocol as W
from kvfabric.stream.policy import RECOMPUTE

LAYOUT = KVLayout(2, 2, 16, "float16")
MODEL = "test-model"
CHUNK = 64


def make_kv(num_tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYOUT.shape(num_tokens), generator=g) * (torch.rand(2, 2, 2, 1, 16, generator=g) + 0.1)
    return kv.half()


def run_stream(prompt, policy, kv: torch.Tensor, rate: float | None = None):  # noqa: ANN001, ANN201
    """Send `prompt` through a loopback pair; the receiver's recompute copies from `kv` (a stand-in model)."""
    buf = torch.full(LAYOUT.shape(len(prompt.tokens)), float("nan"))
    recomputed = []

    def recompute(tokens, s, e, out):  # noqa: ANN001, ANN202
        recomputed.append((s, e))
        out[:, :, :, s:e, :] = kv[:, :, :, s:e, :].float()

    rx = Receiver(LAYOUT, MODEL, buf, recompute)
    cli, conn = loopback_pair()
    with ThreadPoolExecutor(1) as pool:
        t0 = time.perf_counter()
        received = pool.submit(rx.receive, conn, t0)
        report = send_prompt(ThrottledSocket(cli, TokenBucket(rate, 2048)), prompt, policy, t0)
        result = received.result(timeout=60)  # the receiver is done once every chunk is in buf
    cli.close()
    conn.close()
    rx.close()
    return report, result, buf, recomputed


class FakeClock:
    """Stands in for the `time` module of kvfabric.stream.throttle: a sleep advances the clock by what was asked
    plus 1 ns (a real sleep never returns early, and a clock that advances by less than its float resolution
    would never let the bucket's credit reach the asked amount)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.num_sleeps = 0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds + 1e-9
        self.num_sleeps += 1


def test_token_bucket_holds_the_rate(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(throttle, "time", clock)
    bucket = TokenBucket(10e6, 16 * 1024)
    for _ in range(61):  # 999,424 bytes in bursts; the first burst is free credit
        bucket.take(16 * 1024)
    assert clock.now == pytest.approx((61 - 1) * 16 * 1024 / 10e6, abs=1e-6)  # 1 MB at 10 MB/s: ~0.1 s
    assert clock.num_sleeps == 60
    unlimited = TokenBucket(None)
    unlimited.take(10**9)
    assert clock.num_sleeps == 60


def test_throttled_socket_delivers_every_byte_no_faster_than_the_rate():
    cli, conn = loopback_pair()
    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(W.recv_exact, conn, 1_000_000)
        start = time.perf_counter()
        ThrottledSocket(cli, TokenBucket(10e6, 16 * 1024)).sendall(b"x" * 1_000_000)
        took = time.perf_counter() - start
        assert bytes(received.result(timeout=60)) == b"x" * 1_000_000
    cli.close()
    conn.close()
    assert took >= (1_000_000 - 16 * 1024) / 10e6  # a lower bound: a busy machine only makes it slower


@pytest.fixture(scope="module")
def prompt_and_kv():
    kv = make_kv(300)
    tokens = list(range(1000, 1300))
    return prepare(tokens, kv, LAYOUT, MODEL, CHUNK, levels=(3, 9), threads=1), kv


def test_raw_stream_is_exact(prompt_and_kv):
    prompt, kv = prompt_and_kv
    report, rx, buf, recomputed = run_stream(prompt, FixedPolicy("raw"), kv)
    assert torch.equal(buf, kv.float()) and not recomputed
    assert [c.kind for c in rx.chunks] == ["kv"] * 5 and rx.wire_bytes == sum(report.wire_bytes)


def test_cachegen_stream_is_close_and_smaller(prompt_and_kv):
    prompt, kv = prompt_and_kv
    report, rx, buf, _ = run_stream(prompt, FixedPolicy("L9"), kv)
    assert torch.isfinite(buf).all() and (buf - kv.float()).abs().max() < 1.0
    assert sum(report.wire_bytes) < 0.5 * sum(prompt.wire_sizes("raw"))


def test_recompute_stream_sends_tokens(prompt_and_kv):
    prompt, kv = prompt_and_kv
    report, rx, buf, recomputed = run_stream(prompt, FixedPolicy(RECOMPUTE), kv)
    assert recomputed == [(0, 64), (64, 128), (128, 192), (192, 256), (256, 300)]
    assert torch.equal(buf, kv.float()) and sum(report.wire_bytes) < 2000


def test_adaptive_stream_mixes_options_under_a_slow_link(prompt_and_kv):
    prompt, kv = prompt_and_kv
    raw_bytes = sum(prompt.wire_sizes("raw"))
    rate = raw_bytes / 0.6  # raw alone would take 0.6 s; the target is 0.3 s
    policy = AdaptivePolicy(0.3, ["raw", "L3", "L9"], recompute_s=0.01, initial_bps=rate)
    report, rx, buf, _ = run_stream(prompt, policy, kv, rate=rate)
    picked = [c.option for c in report.choices]
    assert "raw" not in picked[:2], picked
    assert len(rx.chunks) == 5 and torch.isfinite(buf).all()
    assert (buf - kv.float()).abs().max() < 1.0  # every chunk arrived as KV or was recomputed, none is garbage


def test_policy_choices():
    sizes = {"raw": [100, 100], "L5": [30, 30], "L9": [10, 10], RECOMPUTE: [5, 5]}
    fast = AdaptivePolicy(1.0, ["raw", "L5", "L9"], initial_bps=1000.0)
    assert fast.choose(sizes, 0.0).option == "raw"
    mid = AdaptivePolicy(1.0, ["raw", "L5", "L9"], initial_bps=100.0)
    assert mid.choose(sizes, 0.0).option == "L5"
    slow = AdaptivePolicy(1.0, ["raw", "L5", "L9"], initial_bps=10.0, recompute_s=0.45)
    assert [slow.choose(sizes, 0.0).option for _ in range(3)] == [RECOMPUTE] * 3  # faster than the link
    costly = AdaptivePolicy(1.0, ["raw", "L5", "L9"], initial_bps=10.0, recompute_s=0.8)
    assert [costly.choose(sizes, 0.0).option for _ in range(2)] == [RECOMPUTE, RECOMPUTE]  # 2nd: 0.8 < 1.0 s
    too_slow = AdaptivePolicy(1.0, ["raw", "L5", "L9"], initial_bps=10.0, recompute_s=1.5)
    assert too_slow.choose(sizes, 0.0).option == "L9"  # the fastest way left
    hopeless = AdaptivePolicy(1.0, ["raw", "L9"], initial_bps=1.0, recompute_s=50.0)
    assert hopeless.choose(sizes, 0.0).option == "L9"
    adapt = AdaptivePolicy(1.0, ["raw", "L5", "L9"], initial_bps=1000.0)
    adapt.observe(10, 1.0)  # measured: 10 B/s
    assert adapt.choose(sizes, 0.0).option in ("L9", RECOMPUTE)


def hostile(frames: bytes) -> Exception | None:
    """Feed raw bytes to a receiver; return what it raised."""
    cli, conn = loopback_pair()
    cli.sendall(frames)
    cli.shutdown(socket.SHUT_WR)
    rx = Receiver(LAYOUT, MODEL, torch.zeros(LAYOUT.shape(300)), None)
    try:
        rx.receive(conn)
    except Exception as exc:  # noqa: BLE001
        return exc
    finally:
        rx.close()
        cli.close()
        conn.close()
    return None


def test_receiver_rejects_hostile_streams(prompt_and_kv):
    prompt, _ = prompt_and_kv
    hello = W.hello_body(prompt.tokens, CHUNK, MODEL, LAYOUT)
    good_hello = W.pack(W.HELLO, 0, len(hello)) + hello
    cases = [
        b"",  # nothing
        b"GARBAGE-GARBAGE-GARBAGE",  # bad magic
        W.pack(W.HELLO, 0, 1 << 40),  # absurd HELLO length: refused before any read
        W.pack(W.HELLO, 0, 5) + b"{bad}",  # malformed JSON
        good_hello + W.pack(W.KV, 0, 1 << 40),  # absurd KV length
        good_hello + W.pack(W.KV, 3, 10) + b"x" * 10,  # out of order
        good_hello + W.pack(W.TOKENS, 0, 8) + b"\0" * 8,  # wrong token count
        good_hello + W.pack(W.END, 5, 0),  # END before the chunks
        good_hello + W.pack(9, 0, 0),  # unknown kind
        good_hello + W.pack(W.KV, 0, 100) + b"x" * 10,  # closed mid-frame
        W.pack(W.HELLO, 0, len(hello)) + hello.replace(MODEL.encode(), b"other-model"),
    ]
    for frames in cases:
        exc = hostile(frames)
        assert isinstance(exc, W.ProtocolError), (frames[:40], exc)


def test_corrupt_chunk_is_recomputed_not_used(prompt_and_kv):
    prompt, kv = prompt_and_kv
    bad = bytearray(prompt.blobs["L3"][1])
    bad[HEADER_BYTES + 40] ^= 0xFF  # breaks the payload checksum
    damaged = type(prompt)(prompt.tokens, prompt.layout, prompt.chunk_size, prompt.model_id, prompt.keys,
                           {**prompt.blobs, "L3": [prompt.blobs["L3"][0], bytes(bad)] + prompt.blobs["L3"][2:]})
    report, rx, buf, recomputed = run_stream(damaged, FixedPolicy("L3"), kv)
    assert recomputed == [(64, 128)] and rx.chunks[1].recomputed
    assert torch.equal(buf[:, :, :, 64:128], kv[:, :, :, 64:128].float())


def test_frame_header_layout():
    assert W.FRAME.size == 20 and struct.unpack("<4s", W.pack(W.KV, 1, 2)[:4])[0] == b"KVST"
