"""The `kvfabric` command line: info, cache management, set-up, the demo, the servers, the profilers; the
benchmarks (`bench`) are defined in kvfabric.bench.commands and registered here.

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
from kvfabric.bench.commands import bench  # noqa: E402
from kvfabric.config import Config, ConfigError  # noqa: E402
from kvfabric.data.genres import CALIBRATION_GENRES  # noqa: E402
from kvfabric.host.extras import missing_extra  # noqa: E402


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
    models = sys.modules.get("kvfabric.engines.gguf")  # not imported: the error cannot be one of its (ModelError)
    if models is not None and isinstance(exc, models.ModelError):
        return str(exc)
    tls = sys.modules.get("kvfabric.net.tls")  # a missing or unreadable certificate, plain text beyond loopback
    if tls is not None and isinstance(exc, tls.TLSConfigError):
        return f"TLS: {exc}"
    permissions = sys.modules.get("kvfabric.host.permissions")  # strict_permissions met a folder others may read
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
        from kvfabric.apps.demo_rag import run as run_rag
        run_rag()
        return
    from kvfabric.apps.demo import run
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
    from kvfabric.cache.remote.pool import PoolError
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
    from kvfabric.apps.node import run_node
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

    from kvfabric.apps import statsview
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


main.add_command(bench)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
