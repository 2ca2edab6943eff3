"""`kvfabric bench ...`: the benchmark commands (registered by kvfabric.apps.cli).

Each prints a table by default and one JSON object per line with `--json`; every speed is reported beside a
baseline measured in the same run. Heavy imports (models, vLLM, Redis) happen inside each command.
"""
from __future__ import annotations

import os
import sys

import click

from kvfabric.bench.commands_research import RESEARCH_COMMANDS
from kvfabric.config import ConfigError
from kvfabric.data.genres import TEXTS


@click.group()
def bench() -> None:
    """Benchmarks: each speed is printed beside a baseline measured in the same run."""


def link_rates(rates: str) -> tuple[float, ...]:
    """`--rates` of a `--hosts` run: positive Mbit/s, comma-separated (a mistake is one line)."""
    try:
        mbits = tuple(float(x) for x in rates.split(","))
        if not all(r > 0 for r in mbits):
            raise ValueError("rates are positive Mbit/s")
    except ValueError as e:
        raise click.BadParameter(f"{rates!r}: {e}", param_hint="--rates") from None
    return mbits


def on_hosts(run, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
    """A `--hosts` run: the bed's own refusals (not root, no iproute2 or nft) are one line."""
    from kvfabric.bench.hosts import HostBedError
    try:
        run(*args, **kwargs)
    except HostBedError as e:
        raise click.ClickException(str(e)) from None


@bench.command("tiers")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--repeats", default=5, show_default=True, help="Samples per figure (their median).")
@click.option("--quick", is_flag=True, help="Fewer chunks (a smoke run).")
@click.option("--redis-url", default=None, help="Also measure the redis tier against raw redis-py on this server.")
@click.option("--mooncake", is_flag=True, help="Also measure the mooncake tier against raw Mooncake and a loopback "
              "socket (starts a private mooncake_master and a storage process on loopback).")
@click.option("--seal", is_flag=True, help="With --redis-url: also the sealed redis tier (AES-256-GCM) vs the plain.")
@click.option("--shm-root", default="/dev/shm", show_default=True,
              help="The tmpfs that holds the shm rows' pool (shm.root; e.g. one mounted with huge=within_size).")
def bench_tiers(as_json: bool, repeats: int, quick: bool, redis_url: str | None, mooncake: bool, seal: bool,
                shm_root: str) -> None:
    """Tier store/retrieve throughput vs raw copy / file I/O of the same bytes."""
    from kvfabric.bench.tiers import run
    if seal and not redis_url:
        raise click.UsageError("--seal measures the sealed redis tier: give --redis-url too")
    if not os.path.isdir(shm_root) or not os.access(shm_root, os.W_OK):
        raise ConfigError(f"--shm-root {shm_root}: not a writable directory")  # one line (apps/cli.py)
    run(as_json=as_json, repeats=repeats, quick=quick, redis_url=redis_url, mooncake=mooncake, seal=seal,
        shm_root=shm_root)


@bench.command("trace")
@click.option("--trace", "traces", multiple=True, metavar="NAME|FILE",
              help="conversation, synthetic (../shared/data) or a JSONL path; repeatable (default: both).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per (trace, tiers, capacity, policy).")
@click.option("--plot", default=None, metavar="PNG", help="Hit ratio and TTFT vs capacity per policy.")
@click.option("--capacities", default="0.01,0.03,0.1,0.3", show_default=True,
              help="Fast-tier capacities as shares of the distinct blocks.")
@click.option("--policies", default=None, help="One-tier policies, EVICTION[+ADMISSION] or shm, comma-separated.")
@click.option("--tiers", default="1,2", show_default=True, help="Set-ups to run: 1, 2 or both.")
@click.option("--limit", default=None, type=int, help="Only the first N requests of each trace.")
@click.option("--bounds", is_flag=True, help="Also oracle-informed policies (simulated: what the future is worth).")
@click.option("--sim", "is_sim", is_flag=True, help="Simulator only (bookkeeping, no real tiers): the fast path.")
@click.option("--replay-dir", default=None, help="Where the replay's disk tier and files go (default /dev/shm).")
@click.option("--quick", is_flag=True, help="First 1000 requests, capacities 3 and 10 %, short measurements.")
@click.option("--model-defaults", is_flag=True, help="Skip measuring: the TTFT model's placeholder figures.")
def bench_trace(traces: tuple[str, ...], as_json: bool, plot: str | None, capacities: str, policies: str | None,
                tiers: str, limit: int | None, bounds: bool, is_sim: bool, replay_dir: str | None, quick: bool,
                model_defaults: bool) -> None:
    """Cache policies and placement over the Mooncake traces, replayed through the real tiers: prefix hit ratio
    and modelled TTFT (tier throughputs and prefill rate measured in the same run) vs LRU and Belady."""
    from kvfabric.bench import trace
    from kvfabric.bench.trace_sim import TTFTModel
    try:
        fracs = tuple(float(x) for x in capacities.split(","))
        tier_set = tuple(int(x) for x in tiers.split(","))
    except ValueError:
        raise click.BadParameter("comma-separated numbers expected") from None
    if not all(0 < f <= 1 for f in fracs) or not set(tier_set) <= {1, 2}:
        raise click.BadParameter("capacities must be in (0, 1] and tiers 1 and/or 2")
    try:
        trace.run(traces=traces or tuple(trace.TRACE_FILES), capacities=(0.03, 0.1) if quick else fracs,
                  policies=tuple(policies.split(",")) if policies else trace.ONE_TIER, tiers=tier_set,
                  as_json=as_json, plot=plot, limit=1000 if quick else limit, bounds=bounds,
                  model=TTFTModel() if model_defaults else None, is_sim=is_sim, replay_dir=replay_dir, quick=quick)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


@bench.command("soak")
@click.option("--duration", default=600.0, show_default=True, help="Seconds of load.")
@click.option("--threads", "num_threads", default=3, show_default=True, help="Load threads in each of the two processes.")
@click.option("--json", "as_json", is_flag=True, help="One final JSON object.")
@click.option("--plot", default=None, metavar="PNG", help="RSS, fds, threads, shm, Redis memory, hit ratio over time.")
@click.option("--redis-url", default=None, help="Use this Redis (default: a private redis-server with maxmemory).")
def bench_soak(duration: float, num_threads: int, as_json: bool, plot: str | None, redis_url: str | None) -> None:
    """Sustained mixed load over cpu + shm + disk + redis from two processes: bounded resources, no wrong bytes,
    no hangs, a stable hit ratio (exit status 1 if any of that fails)."""
    from kvfabric.bench.soak import run
    if not run(duration_s=duration, num_threads=num_threads, as_json=as_json, plot=plot, redis_url=redis_url).ok:
        sys.exit(1)


@bench.command("p2p")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--repeats", default=5, show_default=True)
@click.option("--quick", is_flag=True, help="Fewer chunks (a smoke run).")
@click.option("--tls", is_flag=True, help="Also fetch over TLS (a throw-away certificate), vs plain P2P.")
@click.option("--hosts", "is_hosts", is_flag=True, help="Instead: between two emulated hosts (network namespaces, "
              "shaped veth links; root), vs raw TCP on the same link.")
@click.option("--rates", default="1000,10000", show_default=True, help="With --hosts: link rates in Mbit/s.")
@click.option("--delay-ms", default=0.25, show_default=True, help="With --hosts: one-way delay (needs sch_netem).")
def bench_p2p(as_json: bool, repeats: int, quick: bool, tls: bool, is_hosts: bool, rates: str,
              delay_ms: float) -> None:
    """Peer-to-peer fetch vs a raw loopback socket of the same bytes; a `move` of a 4k-token prompt."""
    if is_hosts:
        from kvfabric.bench.hosts_p2p import run as run_hosts
        if tls or delay_ms < 0 or repeats < 1:
            raise click.UsageError("--hosts: --delay-ms >= 0, --repeats >= 1, and no --tls (plain P2P only)")
        on_hosts(run_hosts, as_json=as_json, repeats=repeats, quick=quick, rates=link_rates(rates), delay_ms=delay_ms)
        return
    from kvfabric.bench.cluster import run
    run(as_json=as_json, repeats=repeats, quick=quick, tls=tls)


@bench.command("lookup")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--tp", "tps", default="1,2,4,8", show_default=True, help="Tensor-parallel sizes (comma-separated).")
@click.option("--tokens", default=8000, show_default=True, help="Prompt length.")
@click.option("--samples", default=200, show_default=True, help="Lookups per figure (their median).")
def bench_lookup(as_json: bool, tps: str, tokens: int, samples: int) -> None:
    """A parallel engine's scheduler lookups, by authority (every rank's cache, one server) and TP, vs a raw
    Unix-socket round trip."""
    from kvfabric.bench.lookup import run
    try:
        sizes = tuple(int(t) for t in tps.split(","))
    except ValueError:
        raise click.UsageError(f"--tp: expected comma-separated integers, got {tps!r}") from None
    if any(t not in (1, 2, 4, 8) for t in sizes):
        raise click.UsageError("--tp: each of 1, 2, 4, 8 (the bench model's 8 KV heads split evenly)")
    run(sizes, tokens, samples, as_json)


@bench.command("vllm", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                         "help_option_names": []})
@click.pass_context
def bench_vllm(ctx: click.Context) -> None:
    """TTFT through a real vLLM: no connector, kvfabric cold, vLLM's own hit, kvfabric hit in a fresh engine."""
    from kvfabric.bench.vllm import main as vllm_main
    sys.exit(vllm_main(ctx.args))


@bench.command("pd")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--sizes", default="1024,4096", show_default=True, help="Prompt sizes in tokens, comma-separated.")
@click.option("--concurrency", default="1,4", show_default=True, help="Concurrent requests, comma-separated.")
@click.option("--python", default=None, help="A Python with vllm (default: this one, else .venv-vllm).")
@click.option("--redis-url", default=None, help="Also the P/D pair over this Redis server (chunks are stored there).")
@click.option("--prefill-tp", default=1, show_default=True, type=int,
              help="Tensor parallel size of the prefill instance (2: Qwen2.5-Coder-0.5B; the decode instance at 1).")
@click.option("--hosts", "is_hosts", is_flag=True,
              help="The prefill and decode instances on two emulated hosts, KV over P2P on tc-shaped links at each of "
                   "--rates (root; see docs/testbed.md).")
@click.option("--rates", default="1000,10000", show_default=True, metavar="MBIT,..", help="With --hosts: link rates.")
def bench_pd(as_json: bool, sizes: str, concurrency: str, python: str | None, redis_url: str | None,
             prefill_tp: int, is_hosts: bool, rates: str) -> None:
    """P/D disaggregation: TTFT of a prefill+decode vLLM pair over the shm pool (and Redis) vs one colocated
    instance; with --hosts, the pair on two emulated hosts over P2P."""
    size_list, concurrency_list = [int(s) for s in sizes.split(",")], [int(c) for c in concurrency.split(",")]
    if is_hosts:
        from kvfabric.bench.hosts_pd import run as run_hosts
        if redis_url or prefill_tp != 1:
            raise click.UsageError("--hosts runs the P2P pair at TP=1 (no --redis-url, no --prefill-tp)")
        on_hosts(run_hosts, size_list, concurrency_list, link_rates(rates), as_json, python=python)
        return
    from kvfabric.bench.pd import run
    run(size_list, concurrency_list, as_json=as_json, python=python, redis_url=redis_url, prefill_tp=prefill_tp)


@bench.command("interference")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per (setup, link), then the sharing and copy rows.")
@click.option("--steps", default=256, show_default=True, help="Decode steps of request A.")
@click.option("--tokens", "b_tokens", default=4096, show_default=True, help="Prompt tokens of the fetched request B.")
@click.option("--links", default="100,1000", show_default=True, help="Link rates in Mbit/s.")
@click.option("--engine-cpu", default=0, show_default=True, help="The engine's core.")
@click.option("--server-cpu", default=1, show_default=True, help="The server's core (set-up c).")
@click.option("--vllm", "with_vllm", is_flag=True, help="Also the vLLM connector's miss-path overhead with mode: "
              "server (paired runs; needs .venv-vllm or --vllm-python).")
@click.option("--vllm-python", default=None, help="Python with vLLM installed (default: .venv-vllm).")
def bench_interference(as_json: bool, steps: int, b_tokens: int, links: str, engine_cpu: int, server_cpu: int,
                       with_vllm: bool, vllm_python: str | None) -> None:
    """TPOT of a decoding request while another's prompt KV is fetched and decoded: none / in-process / in
    `kvfabric server` on its own core; B's TTFT; two engines sharing a server; retrieve vs memcpy."""
    from kvfabric.bench.interference import run
    try:
        rates = tuple(int(x) for x in links.split(","))
    except ValueError:
        raise click.BadParameter(f"{links!r}: comma-separated Mbit/s", param_hint="--links") from None
    run(as_json=as_json, steps=steps, b_tokens=b_tokens, links=rates, engine_cpu=engine_cpu, server_cpu=server_cpu)
    if with_vllm:
        from kvfabric.bench.common import emit
        from kvfabric.bench.interference_vllm import run as run_vllm
        row = run_vllm(vllm_python, num_tokens=b_tokens, engine_cpu=engine_cpu, server_cpu=server_cpu)
        emit([row], as_json, "vLLM connector, mode: server: miss-path overhead (paired cold runs)",
             ["tokens", "num_pairs", "off_s", "ttft_s", "miss_overhead_paired", "target_met"])


@bench.command("serve", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                         "help_option_names": []})
@click.pass_context
def bench_serve(ctx: click.Context) -> None:
    """Serving workloads (long-document QA, multi-round chat) against vllm serve: vLLM alone, + kvfabric, + LMCache."""
    from kvfabric.bench.serve import main as serve_main
    sys.exit(serve_main(ctx.args))


@bench.command("long-doc-qa")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per request, then a summary object.")
@click.option("--docs", "num_docs", default=3, show_default=True)
@click.option("--length", "doc_tokens", default=4096, show_default=True, help="Tokens per document.")
@click.option("--question", "question_tokens", default=64, show_default=True, help="Tokens per question.")
@click.option("--seed", default=0, show_default=True)
@click.option("--model", default="smollm2-135m-instruct", show_default=True,
              help="Builtin model (gemma3-270m, qwen2.5-coder-0.5b, ...) or a local HF folder.")
@click.option("--kv-dtype", type=click.Choice(["float16", "bfloat16", "float32"]), default="float16",
              show_default=True, help="Stored KV dtype; float32 for the exactness figure.")
def bench_long_doc_qa(as_json: bool, num_docs: int, doc_tokens: int, question_tokens: int, seed: int, model: str,
                      kv_dtype: str) -> None:
    """TTFT of cache misses and hits on the real model, with the physical-limit decomposition and hit exactness."""
    from kvfabric.bench.long_doc_qa import run
    run(num_docs, doc_tokens, question_tokens, seed, as_json, model, kv_dtype)



@bench.command("codec")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--plot", default=None, metavar="PNG", help="Write the level table as a plot.")
@click.option("--docs", "num_docs", default=8, show_default=True, help="Held-out documents.")
@click.option("--length", "ctx_tokens", default=2048, show_default=True, help="Context tokens per document.")
@click.option("--repeats", default=3, show_default=True)
@click.option("--quick", is_flag=True, help="Fewer documents and codecs (a smoke run).")
@click.option("--model", "model_name", default="smollm2-135m-instruct", show_default=True,
              help="Builtin model (gemma3-270m, qwen2.5-coder-0.5b, ...) or a local HF folder.")
@click.option("--text", default="musique", show_default=True, type=click.Choice(TEXTS),
              help="Held-out text (kvfabric.data.genres): MuSiQue passages, Python-docs prose, stdlib code, or a mix.")
@click.option("--only", default=None, metavar="CODEC[:LO-HI]", help="One codec's levels only, e.g. cachegen:4-8.")
def bench_codec(as_json: bool, plot: str | None, num_docs: int, ctx_tokens: int, repeats: int, quick: bool,
                model_name: str, text: str, only: str | None) -> None:
    """Codec levels on the real model: size ratio vs fp16, top-1 and KL of the next 64 tokens, encode/decode MB/s."""
    from kvfabric.bench.codec import run
    run(as_json=as_json, plot=plot, num_docs=num_docs, ctx_tokens=ctx_tokens, repeats=repeats, quick=quick,
        model_name=model_name, text=text, only=only)


@bench.command("stream")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--plot", default=None, metavar="PNG", help="Write the TTFT table as a plot.")
@click.option("--tokens", "prompt_tokens", default=2048, show_default=True, help="Prompt tokens to send.")
@click.option("--target", "ttft_target_s", default=1.0, show_default=True, help="TTFT target of the adaptive sender.")
@click.option("--quick", is_flag=True, help="A shorter prompt (a smoke run).")
@click.option("--trace/--no-trace", default=True, show_default=True,
              help="Also run the fluctuating link (1 Gbit/s and 100 Mbit/s, a second each): adaptive resolution vs "
                   "every fixed setting.")
@click.option("--trace-only", is_flag=True, help="Only the fluctuating link.")
@click.option("--trace-seconds", "trace_s", default=10.0, show_default=True, help="Duration of each trace run.")
@click.option("--ladder", default="0,5,6", show_default=True, metavar="L1,L2,..",
              help="Video levels on the trace (each within the quality floor), beside raw.")
@click.option("--hosts", "is_hosts", is_flag=True,
              help="From another emulated host over tc-shaped kernel links (root; see docs/testbed.md) instead of "
                   "a token bucket on loopback: adaptive vs every fixed choice at each of --rates.")
@click.option("--rates", default="500,1000,2000,5000,10000", show_default=True, metavar="MBIT,..",
              help="With --hosts: the link rates in Mbit/s.")
@click.option("--repeats", default=5, show_default=True, help="With --hosts: requests per strategy and rate.")
def bench_stream(as_json: bool, plot: str | None, prompt_tokens: int, ttft_target_s: float, quick: bool,
                 trace: bool, trace_only: bool, trace_s: float, ladder: str, is_hosts: bool, rates: str,
                 repeats: int) -> None:
    """KV streaming over a throttled loopback link: raw vs adaptive cachegen vs recompute, at 100 Mbit/s, 1 Gbit/s
    and unthrottled; then adaptive resolution (video levels) vs fixed settings on a fluctuating link. With
    --hosts, between two emulated hosts over shaped kernel links."""
    from kvfabric.bench.stream import run
    try:
        levels = tuple(int(x) for x in ladder.split(","))
        if not all(0 <= lvl <= 9 for lvl in levels):
            raise ValueError("levels are 0..9")
    except ValueError as e:
        raise click.BadParameter(f"{ladder!r}: {e}", param_hint="--ladder") from None
    if is_hosts:
        from kvfabric.bench.hosts_stream import run as run_hosts
        on_hosts(run_hosts, as_json, link_rates(rates), max(1, repeats),
                 min(prompt_tokens, 1024) if quick else prompt_tokens, ttft_target_s)
        return
    run(as_json=as_json, plot=plot, prompt_tokens=prompt_tokens, ttft_target_s=ttft_target_s, quick=quick,
        trace=trace or trace_only, trace_only=trace_only, ladder=levels, trace_s=trace_s)


@bench.command("video")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--docs", "num_docs", default=8, show_default=True, help="Held-out documents.")
@click.option("--length", "ctx_tokens", default=2048, show_default=True, help="Context tokens per document.")
@click.option("--context", "context_tokens", default=8192, show_default=True,
              help="Tokens of the context whose peak decode memory is measured.")
@click.option("--repeats", default=3, show_default=True)
@click.option("--quick", is_flag=True, help="Fewer documents, settings and tokens (a smoke run).")
def bench_video(as_json: bool, num_docs: int, ctx_tokens: int, context_tokens: int, repeats: int,
                quick: bool) -> None:
    """The video codec's modes beside cachegen levels and int8: size, top-1 / KL of the next 64 tokens, encode /
    decode MB/s (and on one thread), peak decode memory of an 8k-token context."""
    from kvfabric.bench.video import run
    run(as_json=as_json, num_docs=num_docs, ctx_tokens=ctx_tokens, context_tokens=context_tokens, repeats=repeats,
        quick=quick)


for _command in RESEARCH_COMMANDS:  # kvfabric.bench.commands_research: CacheBlend, DroidSpeak, FlexiCache
    bench.add_command(_command)
