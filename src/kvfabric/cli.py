"""The `kvfabric` command line: info, cache management, set-up, the demo and the benchmarks.

Every command reads the same configuration as the library (`--config FILE`, $KVFABRIC_CONFIG, KVFABRIC_* env).
Heavy imports (torch models, vLLM) happen inside the commands that need them, so `kvfabric --version` is instant.
"""
from __future__ import annotations

import os

# Before torch loads: with the default (active) wait policy, OpenMP threads spin at every barrier, and on a
# small machine whose other cores are busy a decode step measured 30-60x slower. Passive waiting costs a wake-up
# per parallel region when the machine is idle. A user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import click  # noqa: E402

from kvfabric import __version__  # noqa: E402
from kvfabric.config import Config, ConfigError  # noqa: E402


def _load(config_path: str | None) -> Config:
    try:
        return Config.load(config_path)
    except ConfigError as exc:
        raise click.UsageError(f"configuration: {exc}") from None


config_option = click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
                             help="YAML config file (default: $KVFABRIC_CONFIG, then built-in defaults).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvfabric")
def main() -> None:
    """kvfabric: a persistent, shareable KV cache for LLM inference."""


@main.command()
@config_option
def info(config_path: str | None) -> None:
    """Show the configuration in effect and each tier's usage."""
    from kvfabric.tiers.factory import build_tiers
    config = _load(config_path)
    click.echo(json.dumps({"version": __version__, "config": dataclasses.asdict(config)}, indent=2))
    if "disk" in config.tiers:
        (disk,) = build_tiers(config, ["disk"])
        usage = disk.usage()
        click.echo(f"disk tier at {disk.root}: {usage.num_chunks} chunks, {usage.num_bytes / 1e6:.1f} MB "
                   f"of {usage.capacity_bytes / 1e9:.1f} GB")


@main.group()
def cache() -> None:
    """Inspect or clear the configured disk cache directory."""


def _disk(config_path: str | None):
    from kvfabric.tiers.factory import build_tiers
    (disk,) = build_tiers(_load(config_path), ["disk"])
    return disk


@cache.command("stats")
@config_option
def cache_stats(config_path: str | None) -> None:
    """Chunk count and bytes of the disk cache."""
    usage = _disk(config_path).usage()
    click.echo(json.dumps(dataclasses.asdict(usage)))


@cache.command("ls")
@config_option
@click.option("--limit", default=50, show_default=True, help="Show at most this many chunks (oldest first).")
def cache_ls(config_path: str | None, limit: int) -> None:
    """List chunks of the disk cache: key, size, and the layout/codec from each header."""
    from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, parse
    disk = _disk(config_path)
    for key in disk.keys()[:limit]:
        path = disk.path(key)
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER_BYTES)
            header = parse(head + bytes(max(0, path.stat().st_size - HEADER_BYTES)), key, verify_payload=False)
            detail = f"tokens={header.num_tokens} shape={list(header.shape)} codec={header.codec_id}"
        except (OSError, ChunkFormatError) as exc:
            detail = f"unreadable: {exc}"
        click.echo(f"{key.hex()}  {path.stat().st_size if path.exists() else 0:>12}  {detail}")


@cache.command("clear")
@config_option
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def cache_clear(config_path: str | None, yes: bool) -> None:
    """Delete every chunk in the disk cache directory."""
    disk = _disk(config_path)
    if not yes:
        click.confirm(f"Delete {disk.usage().num_chunks} chunks under {disk.root}?", abort=True)
    disk.clear()
    click.echo("cleared")


@main.command("setup-model")
@click.argument("name_or_path", default="smollm2-135m-instruct")
def setup_model_cmd(name_or_path: str) -> None:
    """Fetch, verify (sha256) and convert a model once: a builtin name (smollm2-135m-instruct, the demo's;
    gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b), a local HF folder, or a hub id."""
    from kvfabric.engines.model import ModelError, setup_model
    try:
        setup_model(name_or_path)
    except ModelError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--keep-cache", is_flag=True, help="Do not remove the document's chunks first.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Also write TTFT vs context length (miss vs hit) to this PNG.")
@click.option("--rag", is_flag=True, help="The RAG variant: the document's passages cached once, reused in a new order "
                                         "per question (CacheBlend), each answer also from a full prefill.")
def demo(keep_cache: bool, plot: str | None, rag: bool) -> None:
    """Ask questions about a long document: cold, warm from cpu, then warm from disk in a fresh process."""
    if rag:
        if keep_cache or plot:
            raise click.UsageError("--rag takes neither --keep-cache nor --plot")
        from kvfabric.demo_rag import run as run_rag
        run_rag()
        return
    from kvfabric.demo import run
    run(keep_cache=keep_cache, plot=plot)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.pass_context
def controller(ctx: click.Context) -> None:
    """Run the cluster controller (global chunk index, management API, /metrics). --help lists its options."""
    from kvfabric.cluster.controller import main as controller_main
    sys.exit(controller_main(ctx.args))


@main.group()
def profile() -> None:
    """Offline calibration of a model's codec tables (runs the model)."""


@profile.command("cachegen")
@click.option("--texts", required=True, type=click.Path(exists=True, dir_okay=False),
              help="MuSiQue-style JSON: questions with passages (e.g. ../shared/data/musique_s.json).")
@click.option("--model", "model_name", default="smollm2-135m-instruct", show_default=True)
@click.option("--first", default=0, show_default=True, help="First question.")
@click.option("--count", default=24, show_default=True, help="Calibration contexts from the questions.")
@click.option("--ctx-tokens", default=1536, show_default=True, help="Tokens per context.")
@click.option("--extra-text", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A plain-text file whose runs are added as contexts (repeatable).")
@click.option("--shrink", default=1.0, show_default=True, help="Pull channel sensitivities toward their mean.")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Write here (with the Fisher diagonal beside it) instead of over the shipped table.")
def profile_cachegen(texts: str, model_name: str, first: int, count: int, ctx_tokens: int,
                     extra_text: tuple[str, ...], shrink: float, out: str | None) -> None:
    """Rebuild cachegen's per-model profile from the Fisher information of the KV channels (minutes on a CPU)."""
    from pathlib import Path

    from kvfabric.engines.calibrate import calibrate
    path, prof = calibrate(Path(texts), model_name=model_name, first=first, count=count, ctx_tokens=ctx_tokens,
                           extra_texts=tuple(map(Path, extra_text)), shrink=shrink, out=Path(out) if out else None)
    click.echo(f"{path}: profile {prof.id:#018x}, delta channels {int(prof.dflag.sum())}/{prof.dflag.size}")


@main.group()
def bench() -> None:
    """Benchmarks: each speed is printed beside a baseline measured in the same run."""


@bench.command("tiers")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--repeats", default=3, show_default=True)
@click.option("--quick", is_flag=True, help="Fewer chunks (a smoke run).")
@click.option("--redis-url", default=None, help="Also measure the redis tier against raw redis-py on this server.")
@click.option("--mooncake", is_flag=True, help="Also measure the mooncake tier against raw Mooncake and a loopback "
              "socket (starts a private mooncake_master and a storage process on loopback).")
def bench_tiers(as_json: bool, repeats: int, quick: bool, redis_url: str | None, mooncake: bool) -> None:
    """Tier store/retrieve throughput vs raw copy / file I/O of the same bytes."""
    from kvfabric.bench.tiers import run
    run(as_json=as_json, repeats=repeats, quick=quick, redis_url=redis_url, mooncake=mooncake)


@bench.command("trace")
@click.option("--trace", "traces", multiple=True, metavar="NAME|FILE",
              help="conversation, synthetic (../shared/data) or a JSONL path; repeatable (default: both).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per (trace, tiers, capacity, policy).")
@click.option("--plot", default=None, metavar="PNG", help="Hit ratio and TTFT vs capacity per policy.")
@click.option("--capacities", default="0.01,0.03,0.1,0.3", show_default=True,
              help="Fast-tier capacities as shares of the distinct blocks.")
@click.option("--policies", default=None, help="One-tier policies, EVICTION[+ADMISSION] comma-separated.")
@click.option("--tiers", default="1,2", show_default=True, help="Set-ups to run: 1, 2 or both.")
@click.option("--limit", default=None, type=int, help="Only the first N requests of each trace.")
@click.option("--bounds", is_flag=True, help="Also run oracle-informed policies (what knowing the future is worth).")
@click.option("--quick", is_flag=True, help="First 2000 requests, capacities 3 and 10 % (a smoke run).")
@click.option("--prefill-tps", default=2000.0, show_default=True, help="TTFT model: prefill tokens/s at empty context.")
@click.option("--fast-gbps", default=5.0, show_default=True, help="TTFT model: fast tier read GB/s.")
@click.option("--slow-gbps", default=1.0, show_default=True, help="TTFT model: slow tier read GB/s.")
def bench_trace(traces: tuple[str, ...], as_json: bool, plot: str | None, capacities: str, policies: str | None,
                tiers: str, limit: int | None, bounds: bool, quick: bool, prefill_tps: float, fast_gbps: float,
                slow_gbps: float) -> None:
    """Cache policies over the Mooncake traces: prefix hit ratio and modelled TTFT vs LRU and Belady."""
    from kvfabric.bench import trace
    from kvfabric.bench.trace_sim import TTFTModel
    try:
        fracs = tuple(float(x) for x in capacities.split(","))
        tier_set = tuple(int(x) for x in tiers.split(","))
    except ValueError:
        raise click.BadParameter("comma-separated numbers expected") from None
    if not all(0 < f <= 1 for f in fracs) or not set(tier_set) <= {1, 2}:
        raise click.BadParameter("capacities must be in (0, 1] and tiers 1 and/or 2")
    model = TTFTModel(fast_bytes_per_s=fast_gbps * 1e9, slow_bytes_per_s=slow_gbps * 1e9,
                      prefill_tokens_per_s=prefill_tps)
    try:
        trace.run(traces=traces or tuple(trace.TRACE_FILES), capacities=(0.03, 0.1) if quick else fracs,
                  policies=tuple(policies.split(",")) if policies else trace.ONE_TIER, tiers=tier_set,
                  as_json=as_json, plot=plot, limit=2000 if quick else limit, bounds=bounds, model=model)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


@bench.command("p2p")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--repeats", default=5, show_default=True)
@click.option("--quick", is_flag=True, help="Fewer chunks (a smoke run).")
def bench_p2p(as_json: bool, repeats: int, quick: bool) -> None:
    """Peer-to-peer fetch vs a raw loopback socket of the same bytes; a `move` of a 4k-token prompt."""
    from kvfabric.bench.cluster import run
    run(as_json=as_json, repeats=repeats, quick=quick)


@bench.command("vllm", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                         "help_option_names": []})
@click.pass_context
def bench_vllm(ctx: click.Context) -> None:
    """TTFT through a real vLLM: no connector, kvfabric cold, vLLM's own hit, kvfabric hit in a fresh engine."""
    from kvfabric.bench.vllm import main as vllm_main
    sys.exit(vllm_main(ctx.args))


@bench.command("long-doc-qa")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per request, then a summary object.")
@click.option("--docs", "num_docs", default=3, show_default=True)
@click.option("--length", "doc_tokens", default=4096, show_default=True, help="Tokens per document.")
@click.option("--question", "question_tokens", default=64, show_default=True, help="Tokens per question.")
@click.option("--seed", default=0, show_default=True)
def bench_long_doc_qa(as_json: bool, num_docs: int, doc_tokens: int, question_tokens: int, seed: int) -> None:
    """TTFT of cache misses and hits on the real model, with the physical-limit decomposition."""
    from kvfabric.bench.long_doc_qa import run
    run(num_docs, doc_tokens, question_tokens, seed, as_json)



@bench.command("codec")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--plot", default=None, metavar="PNG", help="Write the level table as a plot.")
@click.option("--docs", "num_docs", default=8, show_default=True, help="Held-out documents.")
@click.option("--length", "ctx_tokens", default=2048, show_default=True, help="Context tokens per document.")
@click.option("--repeats", default=3, show_default=True)
@click.option("--quick", is_flag=True, help="Fewer documents and codecs (a smoke run).")
def bench_codec(as_json: bool, plot: str | None, num_docs: int, ctx_tokens: int, repeats: int, quick: bool) -> None:
    """Codec levels on the real model: size ratio vs fp16, top-1 and KL of the next 64 tokens, encode/decode MB/s."""
    from kvfabric.bench.codec import run
    run(as_json=as_json, plot=plot, num_docs=num_docs, ctx_tokens=ctx_tokens, repeats=repeats, quick=quick)


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
def bench_stream(as_json: bool, plot: str | None, prompt_tokens: int, ttft_target_s: float, quick: bool,
                 trace: bool, trace_only: bool, trace_s: float, ladder: str) -> None:
    """KV streaming over a throttled loopback link: raw vs adaptive cachegen vs recompute, at 100 Mbit/s, 1 Gbit/s
    and unthrottled; then adaptive resolution (video levels) vs fixed settings on a fluctuating link."""
    from kvfabric.bench.stream import run
    try:
        levels = tuple(int(x) for x in ladder.split(","))
        if not all(0 <= lvl <= 9 for lvl in levels):
            raise ValueError("levels are 0..9")
    except ValueError as e:
        raise click.BadParameter(f"{ladder!r}: {e}", param_hint="--ladder") from None
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


@bench.command("blend")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per question and setting, then summaries.")
@click.option("--questions", "limit", default=150, show_default=True, help="MuSiQue questions to run.")
@click.option("--start", default=0, show_default=True, help="First question.")
@click.option("--stride", default=1, show_default=True, help="Take every STRIDE-th question (a spread sample).")
@click.option("--check-layers", "check_layers", default=None, metavar="L1,L2,..",
              help="BlendConfig.check_layers (default: the config's).")
@click.option("--passages", default=10, show_default=True, help="Passages per question.")
@click.option("--data", default=None, help="MuSiQue-style JSON (default: ../shared/data/musique_s.json).")
@click.option("--auto", is_flag=True, help="Also run the load controller's own choice of ratio.")
@click.option("--oracle", is_flag=True,
              help="Also run the 25.5 % compute with tokens ranked from a full prefill (a study: one more prefill "
                   "per question).")
@click.option("--report", "report_path", default=None, metavar="JSONL",
              help="Only summarise the JSON lines of an earlier (possibly unfinished) --json run.")
def bench_blend(as_json: bool, limit: int, start: int, stride: int, check_layers: str | None, passages: int,
                data: str | None, auto: bool, oracle: bool, report_path: str | None) -> None:
    """CacheBlend on the real model: full prefill vs full reuse vs blend recomputing 15/25.5/41% vs random."""
    from kvfabric.bench import blend
    if report_path:
        blend.report(report_path, as_json)
        return
    if stride < 1:
        raise click.BadParameter("must be >= 1", param_hint="--stride")
    layers = None
    if check_layers:
        from kvfabric.blend import BlendConfig
        try:
            layers = tuple(int(x) for x in check_layers.split(","))
            BlendConfig(check_layers=layers)
        except ValueError as e:
            raise click.BadParameter(f"{check_layers!r}: {e}", param_hint="--check-layers") from None
    blend.run(as_json=as_json, limit=limit, start=start, stride=stride, check_layers=layers, passages=passages,
              data=data, auto=auto, oracle=oracle)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
