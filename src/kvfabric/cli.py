"""The `kvfabric` command line: info, cache management, set-up, the demo and the benchmarks.

Every command reads the same configuration as the library (`--config FILE`, $KVFABRIC_CONFIG, KVFABRIC_* env).
Heavy imports (torch models, vLLM) happen inside the commands that need them, so `kvfabric --version` is instant.
"""
from __future__ import annotations

import os

# Before torch loads: with the default (active) wait policy, OpenMP threads spin at every barrier, and on a
# small machine whose other cores are busy a decode step runs many times slower (docs/design/measurements.md).
# Passive waiting costs a wake-up per parallel region when the machine is idle. A user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import dataclasses  # noqa: E402
import errno  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import click  # noqa: E402

from kvfabric import __version__  # noqa: E402
from kvfabric.config import Config, ConfigError  # noqa: E402
from kvfabric.data.genres import CALIBRATION_GENRES, TEXTS  # noqa: E402
from kvfabric.extras import missing_extra  # noqa: E402


def _load(config_path: str | None) -> Config:
    return Config.load(config_path)  # a ConfigError ends the command in one line (`_Main`)


config_option = click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
                             help="YAML config file (default: $KVFABRIC_CONFIG, then built-in defaults).")


def user_error(exc: BaseException) -> str | None:
    """The one line for a user's mistake (a bad config, an unknown model, a folder kvfabric may not write), or
    None for anything else (a bug keeps its traceback)."""
    if isinstance(exc, ConfigError):
        return f"configuration: {exc}"
    missing = missing_extra(exc)
    if missing is not None:
        return str(missing)
    model = sys.modules.get("kvfabric.engines.model")  # not imported: the error cannot be one of its
    if model is not None and isinstance(exc, model.ModelError):
        return str(exc)
    tls = sys.modules.get("kvfabric.tls")  # a missing or unreadable certificate, plain text beyond loopback
    if tls is not None and isinstance(exc, tls.TLSConfigError):
        return f"TLS: {exc}"
    permissions = sys.modules.get("kvfabric.permissions")  # strict_permissions met a folder others may read
    if permissions is not None and isinstance(exc, permissions.PermissionsError):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.ENOTDIR) \
            and exc.filename:
        return (f"{exc.strerror}: {exc.filename} (point KVFABRIC_HOME, or the tier's path in the config, at a "
                "folder this user can write)")
    return None


class _Main(click.Group):
    """The command group; a user's mistake ends a command with one line and exit code 2, not a traceback."""

    def invoke(self, ctx: click.Context):  # noqa: ANN201
        try:
            return super().invoke(ctx)
        except Exception as exc:
            line = user_error(exc)
            if line is None:
                raise
            click.echo(f"kvfabric: {line}", err=True)
            ctx.exit(2)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvfabric")
def main() -> None:
    """kvfabric: a persistent, shareable KV cache for LLM inference."""


@main.command()
@config_option
def info(config_path: str | None) -> None:
    """Show the configuration in effect and each tier's usage."""
    from kvfabric.tiers.factory import build_tiers
    config = _load(config_path)
    out: dict = {"version": __version__, "config": dataclasses.asdict(config)}
    if "disk" in config.tiers:  # in the JSON too: the output stays one JSON document
        (disk,) = build_tiers(config, ["disk"])
        out["disk"] = {"path": str(disk.root), **dataclasses.asdict(disk.usage())}
        disk.close()
    click.echo(json.dumps(out, indent=2))


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
    gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b), a fine-tuned sibling (smollm2-135m-musique, built
    here), a local HF folder, or a hub id."""
    from kvfabric.engines.model import setup_model
    from kvfabric.research.finetune import DERIVED, ensure_finetuned
    if name_or_path.strip().lower() in DERIVED:
        ensure_finetuned(name_or_path)  # built here, once
    setup_model(name_or_path)  # an unknown model or no network: one line (`_Main`)


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


@main.command("server")
@config_option
@click.option("--socket", "socket_path", default=None, metavar="PATH",
              help="Control socket (default: config server.socket, else $KVFABRIC_HOME/server.sock).")
@click.option("--cpus", default=None, metavar="LIST", help="Cores to pin the server to, e.g. 1 or 2-3 (default: config "
              "server.cpus, else not pinned); its threads are sized to them.")
@click.option("--metrics-port", type=int, default=None, help="Prometheus metrics on 127.0.0.1:PORT (default: config "
              "server.metrics_port; 0 = off).")
def server_cmd(config_path: str | None, socket_path: str | None, cpus: str | None, metrics_port: int | None) -> None:
    """Run the host's cache process: tiers, codecs and streaming receives for every engine with `mode: server`."""
    from kvfabric.remote.pool import PoolError
    from kvfabric.server import serve
    from kvfabric.server.listener import ServerError
    config = _load(config_path)
    try:
        serve(config, socket_path, cpus, metrics_port, ready=click.echo)
    except (ValueError, OSError, ServerError, PoolError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command("pd-proxy")
@click.option("--prefill", "prefill_url", required=True, metavar="URL", help="The prefill vLLM (kv_role kv_producer).")
@click.option("--decode", "decode_url", required=True, metavar="URL", help="The decode vLLM (kv_role kv_consumer).")
@click.option("--port", default=8000, show_default=True, help="Listen on 127.0.0.1:PORT.")
def pd_proxy(prefill_url: str, decode_url: str, port: int) -> None:
    """OpenAI-compatible proxy for prefill/decode disaggregation: prefill with max_tokens=1, then decode."""
    from kvfabric.pd.proxy import serve
    serve(prefill_url, decode_url, port)


@main.command()
@config_option
@click.option("--load", "load_ops", default=0.0, show_default=True,
              help="Run the synthetic workload at about this many operations per second (0: serve only).")
@click.option("--duration", default=0.0, show_default=True, help="Stop after this many seconds (0: at SIGINT/SIGTERM).")
@click.option("--seed", default=0, show_default=True)
def node(config_path: str | None, load_ops: float, duration: float, seed: int) -> None:
    """Run a cache instance: the configured tiers, /metrics (metrics.port), KV events (kv_events), the cluster
    (tier peer); --load drives a synthetic workload on it (a demo instance for dashboards)."""
    from kvfabric.node import run_node
    totals = run_node(_load(config_path), load_ops=load_ops, duration_s=duration, seed=seed,
                      on_ready=lambda line: click.echo(line, err=True))
    click.echo(json.dumps(totals))


@main.command()
@click.argument("urls", nargs=-1)
@config_option
@click.option("--watch", is_flag=True, help="Refresh until interrupted.")
@click.option("--interval", default=2.0, show_default=True, help="Seconds between refreshes with --watch.")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False),
              help="Bearer token for a controller's /metrics (default: $KVFABRIC_CLUSTER__TOKEN).")
@click.option("--iterations", default=0, hidden=True, help="With --watch: stop after N refreshes (tests).")
def stats(urls: tuple[str, ...], config_path: str | None, watch: bool, interval: float, token_file: str | None,
          iterations: int) -> None:
    """A live view of kvfabric instances' /metrics: hit rate, tokens saved, tier usage, latency percentiles.
    URLs default to this config's metrics endpoint (metrics.port)."""
    from rich.console import Console

    from kvfabric import statsview
    if not urls:
        config = _load(config_path)
        if not config.metrics.port:
            raise click.UsageError("give the URLs of /metrics endpoints, or set metrics.port in the config")
        urls = (f"http://{config.metrics.host}:{config.metrics.port}/metrics",)
    token = os.environ.get("KVFABRIC_CLUSTER__TOKEN") or None
    if token_file:
        with open(token_file) as f:
            token = f.read().strip() or None
    console = Console()
    if watch:
        try:
            statsview.watch(urls, token, interval, console, iterations)
        except KeyboardInterrupt:
            pass
        return
    found = [statsview.scrape(url, token) for url in urls]
    console.print(statsview.render(found))
    if all(s.error for s in found):
        sys.exit(1)


@main.group()
def profile() -> None:
    """Offline calibration of a model's codec tables (runs the model)."""


@profile.command("cachegen")
@click.option("--texts", default=None, type=click.Path(exists=True, dir_okay=False),
              help="MuSiQue-style JSON for the retrieval genre (default: ../shared/data/musique_s.json if present).")
@click.option("--model", "model_name", default="smollm2-135m-instruct", show_default=True)
@click.option("--genres", default=",".join(CALIBRATION_GENRES), show_default=True,
              help="Calibration genres (kvfabric.data.genres), each weighing the same.")
@click.option("--per-genre", default=12, show_default=True, help="Contexts per genre.")
@click.option("--ctx-tokens", default=1536, show_default=True, help="Tokens per context.")
@click.option("--shrink", default=1.0, show_default=True, help="Pull channel sensitivities toward their mean.")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Write here (with the Fisher diagonal beside it) instead of over the shipped table.")
def profile_cachegen(texts: str | None, model_name: str, genres: str, per_genre: int, ctx_tokens: int,
                     shrink: float, out: str | None) -> None:
    """Rebuild cachegen's per-model profile from the Fisher information of the KV channels (minutes on a CPU)."""
    from pathlib import Path

    from kvfabric.data import find_musique
    from kvfabric.research.calibrate import calibrate
    if texts is None:
        try:
            texts = str(find_musique())
        except FileNotFoundError:
            click.echo("no MuSiQue file: calibrating without the retrieval genre", err=True)
    path, prof = calibrate(Path(texts) if texts else None, model_name=model_name, per_genre=per_genre,
                           genres=tuple(g for g in genres.split(",") if g), ctx_tokens=ctx_tokens, shrink=shrink,
                           out=Path(out) if out else None)
    click.echo(f"{path}: profile {prof.id:#018x}, delta channels {int(prof.dflag.sum())}/{prof.dflag.size}, "
               f"contexts {prof.meta['genres']}")


@profile.command("cachegen-default")
@click.argument("table", type=click.Path(exists=True, dir_okay=False))
@click.argument("level", type=click.IntRange(1, 9))
def profile_cachegen_default(table: str, level: int) -> None:
    """Store LEVEL as the default cachegen level of the model whose profile TABLE is (its id is unchanged)."""
    from pathlib import Path

    from kvfabric.codec.cachegen import profile as P
    prof = P.with_default_level(P.load(Path(table)), level)
    P.save(prof, Path(table))
    click.echo(f"{table}: profile {prof.id:#018x} ({prof.meta.get('model')}), default level {level}")


@profile.command("flexicache")
@click.option("--model", "model_name", default="smollm2-135m-instruct", show_default=True)
@click.option("--data", default=None, help="MuSiQue-style JSON (default: ../shared/data/musique_s.json).")
@click.option("--steps", default=256, show_default=True, help="Greedy decode steps per prompt.")
@click.option("--threshold", default=None, type=float, help="Stability below which a head is unstable.")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Write here instead of over the shipped table.")
@click.option("--json", "as_json", is_flag=True, help="Print the study's figures as one JSON object.")
def profile_flexicache(model_name: str, data: str | None, steps: int, threshold: float | None, out: str | None,
                       as_json: bool) -> None:
    """Rebuild FlexiCache's head table: top-K page overlap between decode steps t and t+16 per (layer, KV head),
    on the demo document and MuSiQue prompts (tens of minutes on a CPU)."""
    from pathlib import Path

    from kvfabric.bench.common import emit_summary
    from kvfabric.research.head_stability import DEFAULT_THRESHOLD, profile, report
    path, table = profile(model_name, DEFAULT_THRESHOLD if threshold is None else threshold,
                          Path(out) if out else None, data=data, steps=steps,
                          progress=lambda m: click.echo(m, err=True))
    emit_summary(report(table), as_json, f"head table {path}")


@main.group()
def droidspeak() -> None:
    """DroidSpeak: reuse a sibling model's KV cache (same family, tokenizer and layout)."""


@droidspeak.command("profile")
@click.argument("sender")
@click.argument("receiver")
@click.option("--prompts", default=3, show_default=True, help="Profiling prompts (MuSiQue questions).")
@click.option("--first", default=100, show_default=True, help="First question (0-99 trained the fine-tuned sibling).")
@click.option("--passages", default=3, show_default=True, help="Passages per profiling prompt.")
@click.option("--threshold", default=0.9, show_default=True, help="Share of the reuse KL gap the block must close.")
@click.option("--stride", default=1, show_default=True, help="Score only blocks whose ends are multiples of this.")
@click.option("--data", default=None, help="MuSiQue-style JSON (default: ../shared/data/musique_s.json).")
def droidspeak_profile(sender: str, receiver: str, prompts: int, first: int, passages: int, threshold: float,
                       stride: int, data: str | None) -> None:
    """Quality of RECEIVER reusing SENDER's KV for every contiguous recompute block; saves the pair's table."""
    from kvfabric.research.droidspeak_profile import profile_pair
    try:
        table, path = profile_pair(sender, receiver, num_prompts=prompts, first=first, passages=passages,
                                   stride=stride, data=data, log=click.echo)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    block = table.choose(threshold)
    closed = table.gap_closed(block)
    click.echo(f"{path}: reuse KL {table.kl[0][0]:.4f} (answer rows {table.kl_ans[0][0]:.4f}); chosen block "
               f"[{block.start}, {block.stop}) of {table.num_layers} layers closes {closed[0]:.1%} / {closed[1]:.1%}")


@main.group()
def bench() -> None:
    """Benchmarks: each speed is printed beside a baseline measured in the same run."""


@bench.command("tiers")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--repeats", default=5, show_default=True, help="Samples per figure (their median).")
@click.option("--quick", is_flag=True, help="Fewer chunks (a smoke run).")
@click.option("--redis-url", default=None, help="Also measure the redis tier against raw redis-py on this server.")
@click.option("--mooncake", is_flag=True, help="Also measure the mooncake tier against raw Mooncake and a loopback "
              "socket (starts a private mooncake_master and a storage process on loopback).")
@click.option("--seal", is_flag=True, help="With --redis-url: also the sealed redis tier (AES-256-GCM) vs the plain.")
def bench_tiers(as_json: bool, repeats: int, quick: bool, redis_url: str | None, mooncake: bool, seal: bool) -> None:
    """Tier store/retrieve throughput vs raw copy / file I/O of the same bytes."""
    from kvfabric.bench.tiers import run
    if seal and not redis_url:
        raise click.UsageError("--seal measures the sealed redis tier: give --redis-url too")
    run(as_json=as_json, repeats=repeats, quick=quick, redis_url=redis_url, mooncake=mooncake, seal=seal)


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
def bench_p2p(as_json: bool, repeats: int, quick: bool, tls: bool) -> None:
    """Peer-to-peer fetch vs a raw loopback socket of the same bytes; a `move` of a 4k-token prompt."""
    from kvfabric.bench.cluster import run
    run(as_json=as_json, repeats=repeats, quick=quick, tls=tls)


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
def bench_pd(as_json: bool, sizes: str, concurrency: str, python: str | None, redis_url: str | None) -> None:
    """P/D disaggregation: TTFT of a prefill+decode vLLM pair over the shm pool (and Redis) vs one colocated
    instance."""
    from kvfabric.bench.pd import run
    run([int(s) for s in sizes.split(",")], [int(c) for c in concurrency.split(",")], as_json=as_json, python=python,
        redis_url=redis_url)


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
@click.option("--model", default="smollm2-135m-instruct", show_default=True,
              help="Builtin Llama-family model (qwen2.5-coder-0.5b / -1.5b, ...) or a local folder; "
                   "sliding-window models (Gemma 3) are refused at start-up.")
def bench_blend(as_json: bool, limit: int, start: int, stride: int, check_layers: str | None, passages: int,
                data: str | None, auto: bool, oracle: bool, report_path: str | None, model: str) -> None:
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
    from kvfabric.blend.runner import UnsupportedModel
    try:
        blend.run(as_json=as_json, limit=limit, start=start, stride=stride, check_layers=layers, passages=passages,
                  data=data, auto=auto, oracle=oracle, model=model)
    except UnsupportedModel as exc:  # e.g. Gemma 3's sliding windows: say so, never compute wrong KV
        raise click.ClickException(f"bench blend on {model}: {exc}") from None


@bench.command("droidspeak")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per question and method, then summaries.")
@click.option("--pair", default="finetuned", type=click.Choice(["finetuned", "qwen-0.5b-1.5b", "qwen-1.5b-0.5b"]),
              show_default=True, help="finetuned: a block recomputed (DroidSpeak); qwen-*: linear KV maps across sizes.")
@click.option("--questions", "limit", default=3, show_default=True, help="MuSiQue questions to run.")
@click.option("--start", default=110, show_default=True, help="First question (held out from training/profiling).")
@click.option("--passages", default=None, type=int, help="Passages per question [default: 10; 2 for qwen-*].")
@click.option("--data", default=None, help="MuSiQue-style JSON (default: ../shared/data/musique_s.json).")
def bench_droidspeak(as_json: bool, pair: str, limit: int, start: int, passages: int | None, data: str | None) -> None:
    """A receiver reusing a sibling's KV: full prefill vs naive reuse vs DroidSpeak at three budgets (finetuned), or
    linear KV maps across model sizes with the first layers recomputed (qwen-*)."""
    if pair.startswith("qwen-"):
        from kvfabric.bench.droidspeak_size import run as run_size
        run_size(pair, as_json=as_json, limit=limit, start=start, passages=passages or 2, data=data)
        return
    from kvfabric.bench.droidspeak import run
    run(pair=pair, as_json=as_json, limit=limit, start=start, passages=passages or 10, data=data)


@bench.command("flexicache")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per (method, budget), then a summary.")
@click.option("--plot", default=None, metavar="PNG", help="Write agreement and KL vs resident fraction.")
@click.option("--data", default=None, help="MuSiQue-style JSON (default: ../shared/data/musique_s.json).")
@click.option("--steps", default=256, show_default=True, help="Teacher-forced decode steps per prompt.")
@click.option("--budgets", default="10,20,30,50", show_default=True, help="Resident KV budgets, in percent.")
@click.option("--methods", default="flexicache,quest,streaming,h2o,shuffled", show_default=True)
@click.option("--musique", "num_musique", default=2, show_default=True, help="MuSiQue prompts (besides the document).")
@click.option("--prompt", "only", multiple=True, help="Run only these prompts (doc:q2, musique:100, ...); repeatable.")
@click.option("--study", "run_study", is_flag=True, help="Run the head-stability study instead.")
@config_option
def bench_flexicache(as_json: bool, plot: str | None, data: str | None, steps: int, budgets: str, methods: str,
                     num_musique: int, only: tuple[str, ...], run_study: bool, config_path: str | None) -> None:
    """FlexiCache decode KV memory vs dense KV, quest, streaming, h2o and a shuffled-split control (the config's
    flexicache section sets page size, re-rank interval, slow pool ...; its kv_budget is ignored)."""
    from kvfabric.bench import flexicache
    if run_study:
        flexicache.study(as_json=as_json, data=data, steps=steps)
        return
    try:
        fractions = tuple(float(b) / 100 for b in budgets.split(","))
    except ValueError:
        raise click.BadParameter(f"{budgets!r}: expected percentages like 10,20,30", param_hint="--budgets") from None
    chosen = tuple(m.strip() for m in methods.split(",") if m.strip())
    unknown = set(chosen) - set(flexicache.METHODS)
    if unknown or any(not 0 < f <= 1 for f in fractions):
        raise click.BadParameter(f"methods from {', '.join(flexicache.METHODS)}, budgets in (0, 100]",
                                 param_hint="--methods/--budgets")
    flexicache.run(as_json=as_json, plot=plot, data=data, steps=steps, budgets=fractions, methods=chosen,
                   num_musique=num_musique, only=only, config=_load(config_path).flexicache)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
