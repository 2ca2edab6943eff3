"""The `kvfabric` command line over a real disk cache in a temporary KVFABRIC_HOME."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from kvfabric import CacheEngine, Config, KVLayout, __version__
from kvfabric.apps.cli import main


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFABRIC_HOME", str(tmp_path))
    layout = KVLayout(2, 1, 4, "float16")
    with CacheEngine(Config(chunk_size=8), layout, "m") as engine:
        engine.store(list(range(24)), torch.randn(layout.shape(24)))
        engine.flush()
    return tmp_path


def test_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_info_and_stats(home):
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)  # one JSON document, the disk tier's usage in it
    assert info["config"]["chunk_size"] == 256 and info["disk"]["num_chunks"] == 3
    stats = json.loads(CliRunner().invoke(main, ["cache", "stats"]).output)
    assert stats["num_chunks"] == 3 and stats["num_bytes"] > 0


def test_ls_and_clear(home):
    listing = CliRunner().invoke(main, ["cache", "ls"]).output.strip().splitlines()
    assert len(listing) == 3 and all("tokens=8" in line for line in listing)
    assert CliRunner().invoke(main, ["cache", "clear", "--yes"]).exit_code == 0
    assert json.loads(CliRunner().invoke(main, ["cache", "stats"]).output)["num_chunks"] == 0


def test_bad_config_is_a_usage_error(home, monkeypatch):
    monkeypatch.setenv("KVFABRIC_DISK__CAPACITY", "lots")
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 2 and "disk.capacity" in result.output


@pytest.mark.parametrize("case", ["missing", "malformed", "not a mapping"])
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, monkeypatch, case):
    path = tmp_path / "kvfabric.yaml"
    if case != "missing":
        path.write_text("tiers: [cpu\n  oops" if case == "malformed" else "- cpu\n")
    monkeypatch.setenv("KVFABRIC_CONFIG", str(path))
    result = CliRunner().invoke(main, ["info"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("kvfabric: configuration: $KVFABRIC_CONFIG")
    assert str(path) in lines[0]
    assert {"missing": "no such config file", "malformed": "not valid YAML", "not a mapping": "must be a mapping"}[
        case] in lines[0]


def test_a_cache_folder_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """KVFABRIC_HOME under a file (every user, root included, is refused: not a directory)."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KVFABRIC_HOME", str(tmp_path / "file" / "home"))
    for args in (["info"], ["cache", "stats"]):
        result = CliRunner().invoke(main, args)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert lines[0].startswith("kvfabric: Not a directory:") and "KVFABRIC_HOME" in lines[0]


def test_an_unknown_model_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFABRIC_HOME", str(tmp_path))
    result = CliRunner().invoke(main, ["bench", "long-doc-qa", "--model", "nosuch"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "'nosuch' is not a builtin model" in lines[0], result.output


def test_bench_tiers_quick_json(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFABRIC_BENCH_DIR", str(tmp_path))
    result = CliRunner().invoke(main, ["bench", "tiers", "--quick", "--json", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    ops = {(r["tier"], r["op"]) for r in rows}
    assert {("cpu", "store"), ("cpu", "retrieve"), ("disk", "store"), ("disk", "retrieve"), ("cpu", "lookup")} <= ops
    assert all(r["ratio"] > 0 for r in rows if "ratio" in r)


def test_bench_tiers_shm_root(tmp_path, monkeypatch):
    """--shm-root: the shm rows' pool lives there (and is removed after); a root that is not a writable directory
    is one line."""
    monkeypatch.setenv("KVFABRIC_BENCH_DIR", str(tmp_path))
    root = tmp_path / "pool"
    root.mkdir()
    result = CliRunner().invoke(main, ["bench", "tiers", "--quick", "--json", "--repeats", "1", "--shm-root", str(root)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    shm = [r for r in rows if r.get("tier") == "shm"]
    assert {r["op"] for r in shm} == {"store", "retrieve", "retrieve-copy"} and all(r["ratio"] > 0 for r in shm)
    assert all(r["huge_pages"] == "" for r in shm)  # not a tmpfs: no huge= option to report
    assert not list(root.iterdir())
    bad = CliRunner().invoke(main, ["bench", "tiers", "--shm-root", str(tmp_path / "nosuch")])
    lines = bad.output.strip().splitlines()
    assert bad.exit_code == 2 and len(lines) == 1 and "--shm-root" in lines[0] and "not a writable directory" in lines[0], \
        bad.output


def test_bench_long_doc_qa_smoke(monkeypatch):
    """A tiny run on the real model: rows per round, hits where they must be, a summary with the ratios."""
    result = CliRunner().invoke(main, ["bench", "long-doc-qa", "--json", "--docs", "1", "--length", "256",
                                       "--question", "16"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    by_round = {r["round"]: r for r in rows if "round" in r}
    assert set(by_round) == {"nocache", "cold", "warm-cpu", "warm-disk"}
    assert by_round["nocache"]["hit_tokens"] == by_round["cold"]["hit_tokens"] == 0
    assert by_round["warm-cpu"]["hit_tokens"] == 256 and by_round["warm-cpu"]["tier"] == "cpu"
    assert by_round["warm-disk"]["hit_tokens"] == 256 and by_round["warm-disk"]["tier"] == "disk"
    assert by_round["warm-disk"]["bytes_loaded"] > 0 and by_round["warm-disk"]["limit_ratio"] > 0
    summary = rows[-1]
    assert summary["summary"] == "long-doc-qa" and "miss_overhead_pct" in summary


def test_bench_blend_report_summarises_saved_rows(tmp_path):
    """--report rebuilds the summary from a (partial) --json run: gap closed = 1 - KL / KL of full reuse, speedup
    = full TTFT / TTFT (cpu_speedup from cpu_s); a question cut off before its reuse row is left out; the issue's
    targets are judged at blend@25.5."""
    rows = []
    for q, (reuse_kl, blend_kl) in enumerate([(0.2, 0.05), (0.1, 0.03)]):
        rows += [{"q": q, "setting": "full", "ttft_s": 12.0, "cpu_s": 24.0, "kl": 0.0, "top1": 1.0, "f1": 0.5,
                  "recompute_frac": 1.0},
                 {"q": q, "setting": "reuse", "ttft_s": 0.5, "cpu_s": 1.0, "kl": reuse_kl, "top1": 0.8, "f1": 0.4,
                  "recompute_frac": 0.0},
                 {"q": q, "setting": "blend@25.5", "ttft_s": 4.0, "cpu_s": 6.0 + 4 * q, "kl": blend_kl, "top1": 0.95,
                  "f1": 0.5, "recompute_frac": 0.255}]
    rows.append({"q": 2, "setting": "full", "ttft_s": 12.0, "kl": 0.0, "top1": 1.0, "f1": 0.0, "recompute_frac": 1.0})
    path = tmp_path / "blend.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = CliRunner().invoke(main, ["bench", "blend", "--report", str(path), "--json"])
    assert result.exit_code == 0, result.output
    out = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    at = next(r for r in out if r.get("setting") == "blend@25.5")
    assert at["questions"] == 2 and at["speedup"] == 3.0 and at["cpu_speedup"] == round((4.0 + 2.4) / 2, 2)
    assert at["gap_closed"] == round(1 - 0.04 / 0.15, 3)  # mean KL over mean reuse KL
    assert at["gap_closed_q"] == round((0.75 + 0.7) / 2, 3)  # per question, then averaged
    targets = {(t["setting"], t["metric"]): t["met"] for t in out if t.get("summary") == "targets"}
    assert targets[("blend@25.5", "speedup")] == "met" and targets[("blend@25.5", "gap_closed")] == "met"
    assert targets[("blend@25.5", "gap_ans")] == "not run"  # rows without kl_ans
    assert targets[("blend@15", "speedup")] == "-"  # reported, no target


@pytest.mark.parametrize("args", [["--stride", "0"], ["--check-layers", "2,x"], ["--check-layers", "4,2"]])
def test_bench_blend_rejects_bad_sampling_and_check_layers(args):
    result = CliRunner().invoke(main, ["bench", "blend", "--questions", "1", *args])
    assert result.exit_code == 2 and "Invalid value" in result.output, result.output


def test_bench_stream_smoke():
    """A short prompt over the throttled links on the real model: each strategy at each link, raw exact."""
    result = CliRunner().invoke(main, ["bench", "stream", "--json", "--tokens", "512", "--no-trace"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"link"')]
    assert {(r["link"], r["strategy"]) for r in rows} == {(link, s) for link in ("100Mbit", "1Gbit", "unthrottled")
                                                         for s in ("raw", "adaptive", "recompute")}
    raw = [r for r in rows if r["strategy"] == "raw"]
    assert all(r["kl_first"] == 0.0 and r["same_first"] for r in raw)
    slow = {r["strategy"]: r for r in rows if r["link"] == "100Mbit"}
    assert slow["adaptive"]["wire_mb"] < slow["raw"]["wire_mb"]


def test_a_hub_model_that_cannot_be_fetched_is_one_line(tmp_path, monkeypatch):
    """No network here (or no such repository where there is one): one line naming the model, exit code 2."""
    monkeypatch.setenv("KVFABRIC_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    result = CliRunner().invoke(main, ["setup-model", "kvfabric-test/no-such-model"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("kvfabric: 'kvfabric-test/no-such-model': cannot fetch it from the Hugging Face hub")


def test_a_missing_tls_certificate_is_one_line(tmp_path, monkeypatch):
    """`kvfabric node` starting a cluster node whose cluster.tls names a certificate that is not there."""
    monkeypatch.setenv("KVFABRIC_HOME", str(tmp_path))
    config = tmp_path / "node.yaml"
    config.write_text("tiers: [cpu, peer]\ncluster:\n  controller_url: http://127.0.0.1:9\n"
                      f"  tls: {{cert: {tmp_path / 'no-cert.pem'}, key: {tmp_path / 'no-key.pem'}}}\n")
    result = CliRunner().invoke(main, ["node", "--config", str(config), "--duration", "0.1"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("kvfabric: TLS: ") and "no-cert.pem" in lines[0], lines[0]
