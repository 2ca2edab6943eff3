"""Per-step batch composition of vLLM's scheduler, for `kvfabric bench serve --step-trace`: which requests share
each forward, how many tokens each, how long the step took, and what each request had computed (its own prefix
cache plus any connector's load) when it was first scheduled. The same probe for every system (vLLM alone,
kvfabric, LMCache), since it sits in vLLM's scheduler, not in a connector.

How it gets there: `bench serve` starts `vllm serve` with a folder on PYTHONPATH whose `sitecustomize.py`
(`site_dir`) calls `arm(path)` when KVFABRIC_STEP_TRACE is set. `arm` adds an import hook that, once vLLM's
scheduler module has loaded in any process (the engine core's included), wraps `Scheduler.schedule` and
`Scheduler.update_from_output`; nothing else of vLLM changes. Each process writes `<path>.<pid>.jsonl`:

    {"t": start, "reqs": [[req_id, scheduled, computed_before, prompt_tokens, arrival], ...], "waiting": N}
    {"done": end}                      (after the step's forward, when vLLM takes its output)

`per_request(lines, ids)` turns a trace into per-request figures keyed by the bench's names (the bench sends each
request's name as X-Request-Id, which vLLM puts in its request id): `queue_s` (arrival to first scheduled),
`computed_tokens` (what the first step started from), `prefill_steps`, `prefill_s` (first scheduled to the end of
the step that finished its prompt), `prefill_batch_tokens` and `prefill_peers` (means over those steps: tokens in
the forward, other requests in it), `prefill_step_s` (their mean duration).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

SCHEDULER = "vllm.v1.core.sched.scheduler"
SITE = """import os
if os.environ.get("KVFABRIC_STEP_TRACE"):
    from kvfabric.bench.step_trace import arm
    arm(os.environ["KVFABRIC_STEP_TRACE"])
"""


def site_dir(work: Path) -> Path:
    """A folder holding the sitecustomize.py that arms the trace (put it first on the server's PYTHONPATH)."""
    folder = work / "step-trace-site"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITE)
    return folder


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, path: str, module: str) -> None:
        self.path, self.module = path, module

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: object = None):  # noqa: ANN201
        if fullname != self.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run, trace = spec.loader.exec_module, self.path

        def exec_module(module: Any) -> None:  # noqa: ANN401
            run(module)
            wrap(module.Scheduler, trace)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def arm(path: str, module: str = SCHEDULER) -> None:
    """Wrap the scheduler of `module` (vLLM's) once it is imported in this process."""
    sys.meta_path.insert(0, _Hook(path, module))


def wrap(scheduler: type, path: str) -> None:
    schedule, update = scheduler.schedule, scheduler.update_from_output  # type: ignore[attr-defined]
    out = open(f"{path}.{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def traced_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        started = time.time()
        output = schedule(self, *args, **kwargs)
        before = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        reqs = []
        for req_id, num in output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            reqs.append([req_id, num, before.get(req_id, -1), getattr(request, "num_prompt_tokens", -1),
                         getattr(request, "arrival_time", 0.0)])
        if reqs:
            out.write(json.dumps({"t": started, "reqs": reqs, "waiting": len(self.waiting)}) + "\n")
        return output

    def traced_update(self: Any, output: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        result = update(self, output, *args, **kwargs)
        if output.num_scheduled_tokens:
            out.write(json.dumps({"done": time.time()}) + "\n")
        return result

    scheduler.schedule = traced_schedule  # type: ignore[attr-defined]
    scheduler.update_from_output = traced_update  # type: ignore[attr-defined]


def read(prefix: Path) -> list[dict[str, Any]]:
    """Every line the processes of one server wrote (`<prefix>.<pid>.jsonl`), in order per process."""
    lines: list[dict[str, Any]] = []
    for path in sorted(prefix.parent.glob(prefix.name + ".*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines


def per_request(lines: Iterable[dict[str, Any]], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The figures of the module doc for each name whose request (a vLLM id holding `cmpl-<name>-`) the trace saw."""
    steps: list[tuple[dict[str, Any], float | None]] = []
    for line in lines:  # pair each step with the end of its forward
        if "reqs" in line:
            steps.append((line, None))
        elif "done" in line and steps and steps[-1][1] is None:
            steps[-1] = (steps[-1][0], line["done"])
    figures: dict[str, dict[str, Any]] = {}
    for name in names:
        tag = f"cmpl-{name}-"
        mine = [(step, done, row) for step, done in steps for row in step["reqs"] if tag in row[0]]
        if not mine:
            continue
        first, _, row = mine[0]
        prompt = row[3]
        prefill = [(step, done, r) for step, done, r in mine if r[2] < prompt]
        end = next((done for _, done, r in prefill if r[2] + r[1] >= prompt and done is not None), None)
        durations = [done - step["t"] for step, done, _ in prefill if done is not None]
        figures[name] = {
            "queue_s": round(first["t"] - row[4], 4), "computed_tokens": row[2], "prefill_steps": len(prefill),
            "prefill_s": None if end is None else round(end - first["t"], 4),
            "prefill_batch_tokens": _mean(sum(r[1] for r in step["reqs"]) for step, _, _ in prefill),
            "prefill_peers": _mean(len(step["reqs"]) - 1 for step, _, _ in prefill),
            "prefill_step_s": _mean(durations, 4)}
    return figures


def _mean(values: Iterable[float], digits: int = 1) -> float | None:
    values = list(values)
    return round(statistics.fmean(values), digits) if values else None
