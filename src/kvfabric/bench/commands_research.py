"""`kvfabric bench blend | droidspeak | flexicache`: the research systems' benchmarks on real models (CacheBlend,
DroidSpeak, FlexiCache), added to the `kvfabric bench` group by kvfabric.bench.commands. Heavy imports happen
inside each command.
"""
from __future__ import annotations

import click

from kvfabric.config import Config

# `kvfabric --config` as the other commands take it (kvfabric.apps.cli): the same file, the same environment
config_option = click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
                             help="YAML config file (default: $KVFABRIC_CONFIG, then built-in defaults).")


@click.command("blend")
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


@click.command("droidspeak")
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


@click.command("flexicache")
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
                   num_musique=num_musique, only=only, config=Config.load(config_path).flexicache)


RESEARCH_COMMANDS = (bench_blend, bench_droidspeak, bench_flexicache)
