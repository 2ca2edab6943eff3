"""The fluctuating-link part of `kvfabric bench stream`: adaptive resolution (kvfabric.stream.policy.ResolutionPolicy)
against every fixed setting, on a link that alternates between two rates (1 Gbit/s and 100 Mbit/s, a second each).

The options are raw and the video codec's levels in `ladder`, all of them within the quality floor (top-1 >= 99 %
in `kvfabric bench video`); recompute is the policy's fallback. For each setting a fresh trace starts and the
prompt's KV is sent again and again, request after request on one throttled loopback connection, for
`duration_s`. The receiver is another process (as a remote sender would be: no GIL shared with the decoder); it
decodes each chunk into its buffer while later chunks are on the wire, and reports when each request's last chunk
was in the buffer. `mean_chunk_ms` = (last chunk in the buffer - first chunk sent) / chunks. Quality (top-1 and KL
of the next 64 tokens against the fp16 cache) is computed afterwards, off the clock, from the options each
request actually used. Each setting runs `repeats` times, interleaved with the others; the row has the median.
"""
from __future__ import annotations

import multiprocessing
import socket
import statistics
import time
from collections import Counter

import torch

from kvfabric.stream.throttle import TokenBucket

TRACE = ((1e9 / 8, 1.0), (100e6 / 8, 1.0))  # (bytes/s, seconds), repeated


class TraceBucket(TokenBucket):
    """A token bucket whose rate follows `trace` (repeated) from its creation."""

    def __init__(self, trace: tuple[tuple[float, float], ...], burst_bytes: int) -> None:
        super().__init__(trace[0][0], burst_bytes)
        self.trace, self.t0 = trace, time.perf_counter()
        self.period = sum(s for _, s in trace)

    def rate_at(self, now: float) -> float:
        x = (now - self.t0) % self.period
        for rate, seconds in self.trace:
            if x < seconds:
                return rate
            x -= seconds
        return self.trace[-1][0]

    def take(self, n: int) -> None:
        self.rate = self.rate_at(time.perf_counter())
        super().take(n)


def run_trace(model, layout, ids: list[int], kv: torch.Tensor, recompute, recompute_s: float,  # noqa: ANN001
              ladder: tuple[int, ...], duration_s: float, model_id: str, chunk: int, repeats: int = 3) -> list[dict]:
    """ids: the prompt and the tokens that follow it (the quality check); kv: the prompt's KV [L, 2, H, n, D]."""
    from kvfabric.bench.codec import compare
    from kvfabric.codec.base import codec_for_id
    from kvfabric.codec.format import parse
    from kvfabric.engines.runtime import next_logprobs
    from kvfabric.stream import FixedPolicy, prepare
    from kvfabric.stream.policy import RAW, RECOMPUTE, ResolutionPolicy
    n = kv.shape[3]
    prompt = prepare(ids[:n], kv, layout, model_id, chunk, levels=(), video_levels=ladder, time_decode=True)
    options = [RAW] + [f"V{lvl}" for lvl in ladder]
    ref = next_logprobs(model, kv.half().float(), ids, n)

    def quality(picks: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.empty_like(kv)
        for i, option in enumerate(picks):
            s, e = prompt.span(i)
            if option == RECOMPUTE:
                buf[:, :, :, s:e] = kv[:, :, :, s:e].half().float()  # the model's own KV
                continue
            blob = prompt.blobs[option][i]
            header = parse(blob)
            codec_for_id(header.codec_id).decode(header, memoryview(blob), layout, buf[:, :, :, s:e])
        return compare(ref, next_logprobs(model, buf, ids, n))

    settings = [None] + options
    runs: dict[str | None, list[tuple[float, list[list[str]]]]] = {o: [] for o in settings}
    for r in range(repeats):  # each setting once a round, the order reversed every other round (load drifts)
        for option in settings if r % 2 == 0 else settings[::-1]:
            policy = ResolutionPolicy(options, dict(prompt.decode_s), recompute_s) if option is None \
                else FixedPolicy(option)
            start, last_done, requests = _stream(prompt, policy, layout, model_id, recompute, duration_s)
            runs[option].append(((last_done - start) / sum(len(q) for q in requests), requests))
    rows = []
    for option in settings:
        requests = [q for _, reqs in runs[option] for q in reqs]
        chunks = sum(len(q) for q in requests)
        picks = Counter(o for q in requests for o in q)
        kls, top1s = zip(*(quality(q) for q in (requests if option is None else requests[:1])))
        per_run = [round(1000 * t, 1) for t, _ in runs[option]]
        rows.append({"link": "trace 1G/100M per 1s", "strategy": "adaptive" if option is None else "fixed",
                     "option": option or "per chunk", "mean_chunk_ms": statistics.median(per_run),
                     "runs_ms": per_run, "chunks": chunks, "requests": len(requests),
                     "options": " ".join(f"{o}x{c}" for o, c in picks.items()),
                     "top1": round(float(torch.cat(top1s).mean()), 4),
                     "kl_mean": round(float(torch.cat(kls).mean()), 5),
                     "decode_ms": {o: round(1000 * s, 1) for o, s in prompt.decode_s.items()},
                     "recompute_chunk_ms": round(1000 * recompute_s, 1), "tokens": n})
    best = min((r for r in rows if r["strategy"] == "fixed"), key=lambda r: r["mean_chunk_ms"])
    for r in rows:
        r["best_fixed"] = best["option"]
        r["vs_best_fixed"] = round(1 - r["mean_chunk_ms"] / best["mean_chunk_ms"], 3)  # > 0: faster than it
    return rows


def _stream(prompt, policy, layout, model_id: str, recompute, duration_s: float  # noqa: ANN001
            ) -> tuple[float, float, list[list[str]]]:
    """Requests of `prompt`, back to back on one connection through a fresh trace, for duration_s; the receiver
    in a forked process. Returns (first send, last chunk in the receiver's buffer, options of each request)."""
    from kvfabric.stream import ThrottledSocket, send_prompt
    from kvfabric.stream.sender import WorkReports
    ctx = multiprocessing.get_context("fork")  # the child inherits the model (recompute) without pickling
    reports, child_end = ctx.Pipe(duplex=False)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    proc = ctx.Process(target=_receive_all, args=(srv, layout, model_id, len(prompt.tokens), recompute, child_end),
                       daemon=True)
    proc.start()
    child_end.close()  # the child's end lives in the child only: if it dies, recv below ends instead of waiting
    cli = socket.create_connection(srv.getsockname())
    cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bucket = TraceBucket(TRACE, 256 * 1024)
    requests = []
    work = WorkReports(cli)  # the connection's: requests go back to back, each one's reports come during the next
    while time.perf_counter() - bucket.t0 < duration_s:
        report = send_prompt(ThrottledSocket(cli, bucket), prompt, policy, reports=work)
        requests.append([c.option for c in report.choices])
    until = time.monotonic() + 60  # the last request's reports: closing before them would reset the receiver's
    while work.num_pending and time.monotonic() < until:  # socket while it still reports (ECONNRESET, not EOF)
        work.poll(until - time.monotonic())
    cli.close()  # the receiver sees the end of the stream
    done = [reports.recv() for _ in requests]
    proc.join(60)
    srv.close()
    return bucket.t0, max(done), requests


def _receive_all(srv: socket.socket, layout, model_id: str, num_tokens: int, recompute, reports) -> None:  # noqa: ANN001
    """The receiving process: every request on the connection into one buffer; reports each request's end time
    (perf_counter: the same monotonic clock in both processes)."""
    from kvfabric.stream import Receiver
    from kvfabric.stream.protocol import ProtocolError
    torch.set_num_threads(1)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rx = Receiver(layout, model_id, torch.zeros(layout.shape(num_tokens)), recompute)
    try:
        while True:
            result = rx.receive(conn, 0.0)  # t0 = 0: done_s is the perf_counter time itself
            reports.send(result.done_s)
    except (ProtocolError, OSError):  # the sender closed the connection (or reset it): no more requests
        pass
    finally:
        rx.close()
        conn.close()
