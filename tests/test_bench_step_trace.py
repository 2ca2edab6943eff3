"""kvfabric.bench.step_trace: the scheduler probe behind `bench serve --per-request`'s step fields. Fast: the import
hook arms a scheduler module as vLLM's would be (a stand-in with vLLM's attribute names, since vLLM is not in this
venv) and the per-request figures come out of a trace by hand. Slow: a real `vllm serve` run of the benchmark,
whose per-request lines carry what vLLM's own scheduler did."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from kvfabric.bench import step_trace

SCHEDULER = '''
from types import SimpleNamespace

class Scheduler:
    def __init__(self):
        self.requests = {"cmpl-chat.s1-r0-0": SimpleNamespace(num_prompt_tokens=300, arrival_time=1.0)}
        self.waiting = [1, 2]

    def schedule(self):
        cached = SimpleNamespace(req_ids=[], num_computed_tokens=[])
        new = [SimpleNamespace(req_id="cmpl-chat.s1-r0-0", num_computed_tokens=256)]
        return SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                               num_scheduled_tokens={"cmpl-chat.s1-r0-0": 44})

    def update_from_output(self, output):
        return "updated"
'''


def test_the_hook_wraps_the_scheduler_once_its_module_loads(tmp_path, monkeypatch):
    (tmp_path / "fake_vllm_scheduler.py").write_text(textwrap.dedent(SCHEDULER))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    prefix = tmp_path / "steps"
    step_trace.arm(str(prefix), "fake_vllm_scheduler")
    try:
        import fake_vllm_scheduler  # noqa: PLC0415 - imported after arming, as vLLM's engine core does
        scheduler = fake_vllm_scheduler.Scheduler()
        output = scheduler.schedule()
        assert scheduler.update_from_output(output) == "updated"  # vLLM's own results pass through
    finally:
        sys.modules.pop("fake_vllm_scheduler", None)
    lines = step_trace.read(prefix)
    assert lines[0]["reqs"] == [["cmpl-chat.s1-r0-0", 44, 256, 300, 1.0]] and lines[0]["waiting"] == 2
    assert "done" in lines[1] and lines[1]["done"] >= lines[0]["t"]
    figures = step_trace.per_request(lines, ["chat.s1-r0"])["chat.s1-r0"]
    assert figures["computed_tokens"] == 256 and figures["prefill_steps"] == 1 and figures["prefill_peers"] == 0


def test_per_request_figures_from_a_trace():
    """a: 1000 prompt tokens, 256 of them a prefix hit, prefilled in two steps (the first beside b's decode);
    b: decoding throughout; c: never scheduled."""
    lines = [
        {"t": 10.0, "reqs": [["cmpl-x.a-0", 500, 256, 1000, 9.5], ["cmpl-x.b-0", 1, 800, 799, 1.0]], "waiting": 0},
        {"done": 10.4},
        {"t": 10.5, "reqs": [["cmpl-x.a-0", 244, 756, 1000, 9.5]], "waiting": 1},
        {"done": 10.7},
        {"t": 10.8, "reqs": [["cmpl-x.a-0", 1, 1000, 1000, 9.5], ["cmpl-x.b-0", 1, 801, 799, 1.0]], "waiting": 0},
        {"done": 10.9},
    ]
    figures = step_trace.per_request(lines, ["x.a", "x.b", "x.c"])
    assert set(figures) == {"x.a", "x.b"}
    a = figures["x.a"]
    assert a == {"queue_s": 0.5, "computed_tokens": 256, "prefill_steps": 2, "prefill_s": 0.7,
                 "prefill_batch_tokens": (501 + 244) / 2, "prefill_peers": 0.5, "prefill_step_s": 0.3}
    assert figures["x.b"]["prefill_steps"] == 0 and figures["x.b"]["prefill_s"] is None


@pytest.mark.slow
def test_bench_serve_per_request_lines_carry_the_scheduler_steps(tmp_path):
    """A real `vllm serve` (SmolLM2): one user asks two questions about one document; the second question's first
    step starts from the document's blocks in vLLM's prefix cache."""
    from kvfabric.bench.serve import main
    from kvfabric.engines.model import installed_builtin

    if installed_builtin("smollm2-135m-instruct") is None:
        pytest.skip("SmolLM2 not set up (kvfabric setup-model)")
    path = tmp_path / "requests.jsonl"
    assert main(["--systems", "vllm", "--workloads", "docqa", "--docs", "1", "--doc-tokens", "600", "--questions",
                 "2", "--users", "1", "--per-request", str(path), "--workdir", str(tmp_path / "work"),
                 "--json"]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["prefill_steps"] >= 1 and row["queue_s"] >= 0 and row["prefill_batch_tokens"] > 0
        assert row["prefill_s"] is not None and 0 < row["prefill_s"] <= row["ttft_s"] + 1.0
    first, second = rows
    assert first["computed_tokens"] == 0 and second["computed_tokens"] >= 512  # whole blocks of the document
    assert second["computed_tokens"] == second["hit_tokens"]  # what the scheduler started from is what is reported


def test_site_dir_arms_only_when_asked(tmp_path, monkeypatch):
    code = (step_trace.site_dir(tmp_path) / "sitecustomize.py").read_text()
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delenv("KVFABRIC_STEP_TRACE", raising=False)
    exec(code, {})  # noqa: S102 - the file vLLM's processes run at start-up
    assert not any(isinstance(f, step_trace._Hook) for f in sys.meta_path)
    monkeypatch.setenv("KVFABRIC_STEP_TRACE", str(tmp_path / "steps"))
    exec(code, {})  # noqa: S102
    assert any(isinstance(f, step_trace._Hook) for f in sys.meta_path)
