"""Smoke run of the P2P benchmark (kvfabric.bench.cluster) at a tiny size: it runs and reports sane rows."""
from __future__ import annotations

from kvfabric.bench.cluster import run


def test_bench_p2p_smoke(capsys):
    rows = run(as_json=True, repeats=1, quick=True, num_chunks=2, move_tokens=512)
    ops = [row["op"] for row in rows]
    assert ops == ["fetch", "fetch", "fetch (disk tier)", "fetch+verify", "move a/cpu->b/cpu", "move a/cpu->b/disk"]
    assert all(row["gbps"] > 0 and row["baseline_gbps"] > 0 for row in rows)
    assert rows[-1]["chunks"] == 2 and rows[-1]["bytes"] > 0
    assert capsys.readouterr().out.count("\n") == len(rows)  # one JSON object per line
