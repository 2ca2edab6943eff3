"""The fluctuating-link part of `kvfabric bench stream`: adaptive resolution (kvfabric.stream.policy.ResolutionPolicy)
against every fixed setting, on a link that alternates between two rates (1 Gbit/s and 100 Mbit/s, a second each).

The options are raw and the video codec's levels in `ladder`, all of them within the quality floor (top-1 >= 99 %
in `kvfabric bench video`); recompute is the policy's fallback. For each setting a fresh trace starts and the
prompt's KV is requested again and again, back to back, for `duration_s`: each request is sent chunk by chunk
through the throttled loopback socket and decoded by the receiver into its buffer while later chunks are on the
wire. `mean_chunk_ms` is the time from each request's start to its last chunk in the buffer, summed over the
requests and divided by their chunks. Quality (top-1 and KL of the next 64 tokens against the fp16 cache) is
computed afterwards, off the clock, from the options each request actually used.
"""
from __future__ import annotations

import threading
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
              ladder: tuple[int, ...], duration_s: float, model_id: str, chunk: int) -> list[dict]:
    """ids: the prompt and the tokens that follow it (the quality check); kv: the prompt's KV [L, 2, H, n, D]."""
    from kvfabric.bench.codec import compare, next_logprobs
    from kvfabric.codec.base import codec_for_id
    from kvfabric.codec.format import parse
    from kvfabric.stream import FixedPolicy, Receiver, ThrottledSocket, loopback_pair, prepare, send_prompt
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

    settings = [("adaptive", None)] + [("fixed", o) for o in options]
    rows = []
    for strategy, option in settings:
        policy = ResolutionPolicy(options, dict(prompt.decode_s), recompute_s) if option is None \
            else FixedPolicy(option)
        bucket = TraceBucket(TRACE, 256 * 1024)
        loads, requests = [], []
        while time.perf_counter() - bucket.t0 < duration_s:
            buf = torch.zeros(layout.shape(n))
            rx = Receiver(layout, model_id, buf, recompute)
            cli, conn = loopback_pair()
            box: dict = {}
            t0 = time.perf_counter()
            th = threading.Thread(target=lambda: box.setdefault("result", rx.receive(conn, t0)))
            th.start()
            report = send_prompt(ThrottledSocket(cli, bucket), prompt, policy, t0)
            th.join()
            for closeable in (cli, conn, rx):
                closeable.close()
            loads.append(box["result"].done_s)
            requests.append([c.option for c in report.choices])
        chunks = sum(len(r) for r in requests)
        picks = Counter(o for r in requests for o in r)
        kls, top1s = zip(*(quality(r) for r in (requests if option is None else requests[:1])))
        rows.append({"link": "trace 1G/100M per 1s", "strategy": strategy, "option": option or "per chunk",
                     "mean_chunk_ms": round(1000 * sum(loads) / chunks, 1), "chunks": chunks,
                     "requests": len(requests), "options": " ".join(f"{o}x{c}" for o, c in picks.items()),
                     "top1": round(float(torch.cat(top1s).mean()), 4),
                     "kl_mean": round(float(torch.cat(kls).mean()), 5),
                     "decode_ms": {o: round(1000 * s, 1) for o, s in prompt.decode_s.items()},
                     "recompute_chunk_ms": round(1000 * recompute_s, 1), "tokens": n})
    fixed = [r for r in rows if r["strategy"] == "fixed"]
    best = min(fixed, key=lambda r: r["mean_chunk_ms"])
    for r in rows:
        r["best_fixed"] = best["option"]
        r["vs_best_fixed"] = round(1 - r["mean_chunk_ms"] / best["mean_chunk_ms"], 3)  # > 0: faster than it
    return rows
