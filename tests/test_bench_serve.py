"""`kvfabric bench serve` without servers: its workloads (real tokenizer, the real Mooncake trace) and the
statistics it reports. The benchmark itself runs real `vllm serve` processes (not in the test suite)."""
from __future__ import annotations

import pytest

from kvfabric.bench.serve import Timing, percentile, summarize
from kvfabric.bench.workloads import BLOCK_TOKENS, _sessions, chat_sessions, default_trace, doc_qa


@pytest.fixture(scope="module")
def model() -> str:
    from kvfabric.engines.model import installed_builtin

    found = installed_builtin("smollm2-135m-instruct")
    if found is None:
        pytest.skip("SmolLM2 not set up (kvfabric setup-model)")
    return str(found)


def test_doc_qa_repeats_each_document_across_users(model):
    workload = doc_qa(model, docs=3, doc_tokens=200, questions=2, users=2)
    requests = [r for user in workload.users for r in user]
    assert workload.num_requests == 6 and workload.working_set == 600
    by_doc: dict[str, list[list[int]]] = {}
    for r in requests:
        by_doc.setdefault(r.name.split("-")[0], []).append(r.prompt)
    for prompts in by_doc.values():  # the same document, then different questions
        assert len(prompts) == 2 and prompts[0][:200] == prompts[1][:200] and prompts[0][200:] != prompts[1][200:]
    assert doc_qa(model, 3, 200, 2, 2) == workload  # deterministic


def test_sessions_chain_requests_that_extend_earlier_ones():
    rows = [{"hash_ids": [1, 2, 3]}, {"hash_ids": [7, 8]}, {"hash_ids": [1, 2, 3, 4, 5]}, {"hash_ids": [1, 9]},
            {"hash_ids": [1, 2, 3, 4, 5, 6]}]
    assert _sessions(rows) == [[0, 2, 4], [1], [3]]  # [1, 9] shares one block only: a new session


def test_chat_sessions_from_the_trace_keep_prefixes(model):
    try:
        default_trace()
    except FileNotFoundError:
        pytest.skip("no ../shared/data trace")
    workload = chat_sessions(model, None, sessions=3, users=2, max_prompt=2000)
    assert workload.num_requests >= 6 and len(workload.users) == 2
    rounds: dict[str, list[list[int]]] = {}
    for user in workload.users:
        for r in user:
            rounds.setdefault(r.name.split("-")[0], []).append(r.prompt)
            assert 0 < len(r.prompt) <= 2000
    for prompts in rounds.values():  # a later round starts with the earlier round's blocks
        assert len(prompts) >= 2
        assert prompts[1][:2 * BLOCK_TOKENS] == prompts[0][:2 * BLOCK_TOKENS]  # sessions share >= 2 blocks


def test_workloads_scale_to_100_requests(model):
    """`bench serve --requests 100`: 4 documents x 25 questions of the default document size fit the text, and
    chat takes sessions from further into the trace until they hold 100 rounds."""
    workload = doc_qa(model, docs=4, doc_tokens=1800, questions=25, users=2)
    assert workload.num_requests == 100 and len({tuple(r.prompt) for u in workload.users for r in u}) == 100
    try:
        default_trace()
    except FileNotFoundError:
        pytest.skip("no ../shared/data trace")
    chat = chat_sessions(model, None, sessions=6, users=2, max_prompt=4032, scan=20000, min_requests=100)
    assert chat.num_requests >= 100
    with pytest.raises(ValueError, match="multi-round sessions"):
        chat_sessions(model, None, sessions=6, users=2, max_prompt=4032, scan=50, min_requests=100)


def test_a_workload_that_cannot_be_built_is_one_line(model, capsys):
    from kvfabric.bench.serve import main

    missing = "/nonexistent/trace.jsonl"
    assert main(["--workloads", "chat", "--model", model, "--trace", missing, "--requests", "100"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvfabric bench serve:") and missing in err and "\n" not in err


def test_summary_fields():
    from kvfabric.bench.workloads import Request, Workload

    workload = Workload("w", [[Request("a", [1] * 10, 4)], [Request("b", [2] * 20, 4)]], 30)
    timings = [Timing("a", 0.0, 0.5, (0.1, 0.1, 0.1), 4, 0, 10), Timing("b", 0.0, 1.5, (0.2, 0.2, 0.2), 4, 16, 20)]
    row = summarize("kvfabric", workload, timings, wall=2.0)
    for field in ("system", "workload", "requests", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "throughput_rps",
                  "hit_tokens"):
        assert field in row
    assert row["requests"] == 2 and row["throughput_rps"] == 1.0 and row["hit_tokens"] == 16
    assert row["ttft_mean_s"] == 1.0 and row["ttft_p99_s"] == 1.5 and row["tokens_per_s"] == 4.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_per_request_lines(tmp_path):
    """`--per-request FILE`: one JSON line per request, appended per (system, workload)."""
    import json

    from kvfabric.bench.serve import write_per_request

    path = tmp_path / "requests.jsonl"
    timings = [Timing("s1-r0", 0.0, 0.5, (), 1, 0, 10), Timing("s1-r1", 0.9, 0.25, (0.1,), 2, 256, 300)]
    write_per_request(path, "kvfabric", "chat", timings)
    write_per_request(path, "lmcache", "chat", timings[:1])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["system"], r["request"]) for r in lines] == [("kvfabric", "s1-r0"), ("kvfabric", "s1-r1"),
                                                           ("lmcache", "s1-r0")]
    assert lines[1] == {"system": "kvfabric", "workload": "chat", "request": "s1-r1", "sent_s": 0.9, "ttft_s": 0.25,
                        "hit_tokens": 256, "prompt_tokens": 300, "num_output": 2}


def test_a_per_request_file_that_cannot_be_written_is_one_line_before_any_run(tmp_path, capsys):
    from kvfabric.bench.serve import main

    missing = tmp_path / "no-such-dir" / "requests.jsonl"
    assert main(["--per-request", str(missing), "--systems", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvfabric bench serve: --per-request") and str(missing) in err and "\n" not in err
