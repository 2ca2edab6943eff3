"""`kvfabric bench stream --hosts`: TTFT of loading a prompt's KV from another emulated host over a real, shaped
kernel link (bench/hosts.py), the adaptive choices against every fixed one, at each link rate.

Two hosts. The sender is a process of its own in host A (forked from the bench with the prompt pre-encoded raw
and at each cachegen level; it joins A's network namespace and listens on A's address); the receiver (the model,
the decoder, the recompute) runs in the bench process over a socket made in host B's namespace. So every byte
crosses A's veth link, the bridge and B's link, each shaped with tbf at the row's rate: TCP's own congestion
control, the kernel's queues and the receiver's back-pressure are what the policy measures, not a token bucket.

Per link rate, each strategy `repeats` times, the strategies' order rotated from repeat to repeat:
- fixed: `raw`, each cachegen level `L<n>`, `recompute` (tokens only; the receiver prefills);
- `adaptive`: kvfabric.stream.policy.ResolutionPolicy over raw, the levels and recompute: before each chunk, the
  option with which the prompt is predicted to be in the receiver's buffer soonest, from the link rate measured
  on the previous chunk and each option's decode time: measured alone at first, then as the receiver reports it
  (DONE frames: what a chunk cost its worker while it also received);
  the sender keeps the rate the last adaptive request measured as the next one's first estimate, and the costs the
  receiver reported to the adaptive requests so far (a sender that serves one receiver again knows its link and
  its decoder; the first request at a new rate starts from the old one's rate; fixed requests teach it nothing);
- `adaptive-slo`: CacheGen's AdaptivePolicy toward `--target` (the best quality whose bytes still arrive in time),
  for reference: it trades time for quality by design.
Rows: `rate_mbit`, `strategy`, `ttft_s` (median) and `ttft_samples`, `best_fixed` and `vs_best_fixed` (TTFT over
the best fixed strategy's median on the same link), `link_mbit` (raw TCP between the two hosts on the same link,
measured in the run: the baseline), `wire_mb`, `options` (what the chunks went as), `work_ms` (the receiver's
worker seconds per chunk, median over the strategy's chunks: what it reports to the sender) and `work_alone_ms`
(the same option decoded with nothing else running, the policy's starting point), `kl_first` / `same_first`
(first-token quality against raw). Target: adaptive within 1.1x of the best fixed choice at every rate, and
faster than raw at the slowest.
"""
from __future__ import annotations

import json
import multiprocessing
import socket
import statistics
import time
from collections import Counter
from typing import Any

from kvfabric.bench.common import emit, threads_note
from kvfabric.bench.hosts import HostBed, LinkShape
from kvfabric.bench.hosts_netns import inside, join_namespace, link_mbit
from kvfabric.bench.stream import StreamRig, make_rig, quality, receive_ttft
from kvfabric.stream.policy import RAW, RECOMPUTE, AdaptivePolicy, FixedPolicy, ResolutionPolicy, WorkCosts
from kvfabric.stream.sender import PreparedPrompt, send_prompt

RATES_MBIT = (500, 1000, 2000, 5000, 10000)


def _policy(spec: dict, last_bps: float | None, learned: dict) -> Any:
    if spec["policy"] == "fixed":
        return FixedPolicy(spec["option"])
    if spec["policy"] == "adaptive":
        if not learned:  # the first adaptive stream starts from the costs measured alone
            learned.update(decode_s=WorkCosts(dict(spec["decode_s"])), recompute_s=spec["recompute_s"])
        return ResolutionPolicy(spec["options"], learned["decode_s"], recompute_s=learned["recompute_s"],
                                initial_bps=last_bps)
    return AdaptivePolicy(spec["target_s"], spec["options"], recompute_s=spec["recompute_s"],
                          finish_s=spec["finish_s"], initial_bps=last_bps)


def _serve(namespace: str, address: str, prompt: PreparedPrompt, ready: Any) -> None:
    """The sender process: in host A, one request per connection (a JSON line naming the policy), the prompt sent
    with it; until a connection asks to stop."""
    join_namespace(namespace)
    srv = socket.socket()
    srv.bind((address, 0))
    srv.listen(4)
    ready.send(srv.getsockname()[1])
    last_bps: float | None = None  # the link rate the last adaptive request measured (the receiver is the same)
    learned: dict = {}  # the receiver's costs as its reports to adaptive streams left them (decode_s, recompute_s)
    while True:
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            spec = json.loads(conn.makefile("rb").readline())
            if spec.get("policy") == "stop":
                return
            policy = _policy(spec, last_bps, learned)
            send_prompt(conn, prompt, policy)
            if not isinstance(policy, FixedPolicy):
                last_bps = policy.estimate_bps() or last_bps
            if isinstance(policy, ResolutionPolicy):
                learned["recompute_s"] = policy.recompute_s  # decode_s: the same WorkCosts, updated in place


def _request(bed: HostBed, port: int, rig: StreamRig, spec: dict) -> tuple[float, Any, Any]:
    """One prompt requested from host 1 (the bench's socket in its namespace) from the sender in host 0."""
    conn = inside(bed.namespace(1), lambda: socket.create_connection((bed.address(0), port), timeout=60))
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        conn.sendall(json.dumps(spec).encode() + b"\n")
        return receive_ttft(rig, conn, t0)


def run(as_json: bool = False, rates_mbit: tuple[int, ...] = RATES_MBIT, repeats: int = 5, prompt_tokens: int = 2048,
        ttft_target_s: float = 1.0, levels: tuple[int, ...] = (1, 3, 5, 7, 9)) -> list[dict]:
    rig, _, _ = make_rig(prompt_tokens, levels, time_decode=True)
    options = [RAW] + [f"L{lvl}" for lvl in levels]
    specs = {o: {"policy": "fixed", "option": o} for o in [*options, RECOMPUTE]}
    specs["adaptive"] = {"policy": "adaptive", "options": options, "decode_s": rig.prompt.decode_s,
                         "recompute_s": rig.recompute_s}
    specs["adaptive-slo"] = {"policy": "adaptive-slo", "options": options, "target_s": ttft_target_s,
                             "recompute_s": rig.recompute_s, "finish_s": rig.finish_s}
    names = list(specs)
    rows: list[dict] = []
    ctx = multiprocessing.get_context("fork")  # the sender inherits the encoded prompt: nothing pickled
    with HostBed(2) as bed:
        ready, child_end = ctx.Pipe(duplex=False)
        port = 0
        sender = ctx.Process(target=_serve, args=(bed.namespace(0), bed.address(0), rig.prompt, child_end),
                             daemon=True)
        sender.start()
        try:
            if not ready.poll(60):
                raise RuntimeError("the sender in host 0 did not start")
            port = ready.recv()
            for rate in rates_mbit:
                for host in (0, 1):
                    bed.reshape(host, LinkShape(rate))
                link = statistics.median(link_mbit(bed) for _ in range(3))
                samples: dict[str, list[tuple[float, Any, Any]]] = {n: [] for n in names}
                for r in range(repeats):
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        samples[name].append(_request(bed, port, rig, specs[name]))
                rows += _rows(rate, link, samples, rig, ttft_target_s)
        finally:
            if sender.is_alive():
                try:
                    _request_stop(bed, port)
                except OSError:
                    pass
                sender.join(5)
                if sender.is_alive():
                    sender.kill()
                    sender.join(5)
    quality(rows)
    emit(rows, as_json, f"TTFT of a {rig.num_tokens}-token prompt's KV from another emulated host, tbf-shaped links "
         f"(medians of {repeats}; recompute {rig.recompute_s * 1000:.0f} ms/chunk; {threads_note()})",
         ["rate_mbit", "strategy", "ttft_s", "vs_best_fixed", "best_fixed", "link_mbit", "wire_mb", "options",
          "work_ms", "work_alone_ms", "kl_first", "same_first"])
    return rows


def _request_stop(bed: HostBed, port: int) -> None:
    if port:
        conn = inside(bed.namespace(1), lambda: socket.create_connection((bed.address(0), port), timeout=5))
        with conn:
            conn.sendall(b'{"policy": "stop"}\n')


def _rows(rate: int, link_mbit: float, samples: dict[str, list[tuple[float, Any, Any]]], rig: StreamRig,
          target_s: float) -> list[dict]:
    medians = {name: statistics.median(s[0] for s in got) for name, got in samples.items()}
    fixed = {name: t for name, t in medians.items() if not name.startswith("adaptive")}
    best = min(fixed, key=fixed.__getitem__)
    alone = {**rig.prompt.decode_s, RECOMPUTE: rig.recompute_s}
    rows = []
    for name, got in samples.items():
        typical = min(got, key=lambda s: abs(s[0] - medians[name]))  # the sample at the median: its options
        picks: Counter[str] = Counter()
        for chunk in typical[1].chunks:
            picks[_option(chunk)] += 1
        work = [c.work_s for s in got for c in s[1].chunks]
        rows.append({"rate_mbit": rate, "strategy": name, "ttft_s": round(medians[name], 3),
                     "ttft_samples": [round(s[0], 3) for s in got], "best_fixed": best,
                     "vs_best_fixed": round(medians[name] / fixed[best], 3), "link_mbit": round(link_mbit),
                     "wire_mb": round(typical[1].wire_bytes / 1e6, 2),
                     "options": " ".join(f"{o}x{n}" for o, n in picks.items()),
                     "work_ms": round(1000 * statistics.median(work), 2),
                     "work_alone_ms": round(1000 * alone[name], 2) if name in alone else None,
                     "target_s": target_s if name == "adaptive-slo" else None, "tokens": rig.num_tokens,
                     "held_out": rig.held_out, "_lp": typical[2]})
    return rows


def _option(chunk: Any) -> str:
    return RECOMPUTE if chunk.kind == "tokens" else (RAW if chunk.level == 0 else f"L{chunk.level}")
