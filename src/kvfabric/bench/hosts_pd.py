"""`kvfabric bench pd --hosts`: prefill/decode disaggregation with the two vLLM instances on different emulated hosts
(bench/hosts.py), the KV moving over kvfabric's P2P protocol on a tc-shaped kernel link, against one colocated
instance.

Three hosts: the prefill instance (and, first, the colocated one) in host 0, the decode instance in host 1, and in
host 2 this benchmark's own side: the controller both instances report to, the pd-proxy, and the client. So the
client's requests, the controller's lookups and the KV itself all cross real links; the KV crosses host 0's and host
1's. Each instance keeps its core (prefill 0, decode 1), as in `bench pd`.

Per link rate (`rates`, Mbit/s, each host's link shaped with tbf): the P/D pair is started, the groups of
`bench pd` run (REQUESTS distinct prompts per prompt size and concurrency, TTFT on the client through the proxy,
the decode instance's KV load time per request from its connector's counters), the pair is stopped. The
baseline of a transfer is raw TCP from host 0 to host 1 on the same link, measured in the run (`link_mbit`):
`link_s` is the time the request's KV bytes take at that rate, `transfer_vs_link` the ratio. The colocated
instance runs once (its requests cross a link too, but carry only tokens); `ttft_vs_colocated` compares with it
and `same_output` checks that the pair's greedy text is the colocated instance's.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvfabric.bench.common import emit
from kvfabric.bench.hosts import HostBed, LinkShape
from kvfabric.bench.hosts_netns import inside, link_mbit
from kvfabric.bench.pd import GroupResult, Placement, Site, run_path
from kvfabric.bench.serve import percentile

RATES_MBIT = (1000, 10000)


def run(sizes: list[int], concurrencies: list[int], rates_mbit: tuple[int, ...] = RATES_MBIT,
        as_json: bool = False, max_tokens: int = 16, python: str | None = None, model: str | None = None,
        workdir: str | None = None) -> list[dict[str, Any]]:
    from kvfabric.bench.vllm import find_python
    from kvfabric.engines.model import ensure_model

    python = find_python(python)
    model = model or str(ensure_model())
    groups = [(n, c) for n in sizes for c in concurrencies]
    max_len = max(sizes) + max_tokens + 64

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with HostBed(3) as bed, tempfile.TemporaryDirectory(prefix="kvfabric-bench-pd-hosts-", dir=workdir) as tmp:
        at = Placement(Site(bed.namespace(0), bed.address(0)), Site(bed.namespace(1), bed.address(1)),
                       bed.address(2))

        def measure() -> tuple[dict, dict[int, tuple[float, dict]]]:
            """On a thread inside host 2: what it starts (threads, the vLLM processes via `ip netns exec`) and every
            socket it opens start from there."""
            colocated = run_path("colocated", python, model, Path(tmp), groups, max_tokens, max_len, log, at=at)
            by_rate = {}
            for rate in rates_mbit:
                for host in range(3):
                    bed.reshape(host, LinkShape(rate))
                link = statistics.median(link_mbit(bed) for _ in range(3))
                log(f"[bench pd --hosts] {rate} Mbit links: raw TCP host 0 -> 1 at {link:.0f} Mbit")
                work = Path(tmp) / f"{rate}mbit"  # the pair's own logs and stats files: a new pair counts from 0
                work.mkdir()
                by_rate[rate] = (link, run_path("p2p", python, model, work, groups, max_tokens, max_len, log, at=at))
            return colocated, by_rate

        colocated, by_rate = inside(bed.namespace(2), measure)
    rows = [_row("colocated", None, None, group, colocated[group], colocated[group]) for group in groups]
    for rate, (link, results) in by_rate.items():
        rows += [_row("p2p", rate, link, group, results[group], colocated[group]) for group in groups]
    emit(rows, as_json, "bench pd --hosts: prefill and decode vLLM instances on two emulated hosts, KV over P2P on a "
         "shaped link (TTFT on the client in a third host, through pd-proxy)",
         ["path", "rate_mbit", "prompt_tokens", "concurrency", "ttft_mean_s", "ttft_vs_colocated", "transfer_s",
          "link_s", "transfer_vs_link", "link_mbit", "same_output"])
    return rows


def _row(path: str, rate: int | None, link_mbit: float | None, group: tuple[int, int], got: GroupResult,
         base: GroupResult) -> dict[str, Any]:
    ttfts = [a.ttft_s for a in got.answers]
    ttft = statistics.fmean(ttfts)
    is_pd = path != "colocated"
    num_bytes = got.per_request.num_bytes
    link_s = num_bytes * 8 / (link_mbit * 1e6) if is_pd and link_mbit else None
    return {"path": path, "rate_mbit": rate, "link_mbit": round(link_mbit) if link_mbit else None,
            "prompt_tokens": group[0], "concurrency": group[1], "requests": len(ttfts),
            "ttft_mean_s": ttft, "ttft_p99_s": percentile(ttfts, 99),
            "ttft_vs_colocated": ttft / statistics.fmean(a.ttft_s for a in base.answers),
            "e2e_mean_s": statistics.fmean(a.e2e_s for a in got.answers),
            "transfer_s": got.transfer_s if is_pd else None,
            "transfer_samples": got.transfer_samples if is_pd else None,
            "bytes_per_request": num_bytes, "link_s": link_s,
            "transfer_vs_link": got.transfer_s / link_s if link_s else None,
            "same_output": [a.text for a in got.answers] == [a.text for a in base.answers] if is_pd else None}
