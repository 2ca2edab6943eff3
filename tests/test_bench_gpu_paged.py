"""The GPU check's script (kvfabric.bench.gpu_paged) runs here on the CPU path (CpuCopyStream): every layout, K|V
and MLA latent content, a prompt of whole and partial chunks, saved into the cpu and disk tiers and loaded back
exactly; the JSON rows carry the fields the device script reports."""
from __future__ import annotations

import json

from kvfabric.bench import gpu_paged
from kvfabric.connectors.paged_views import LAYOUTS


def test_the_gpu_check_runs_on_cpu_and_every_row_is_exact(capsys):
    assert gpu_paged.main(["--device", "cpu", "--sizes", "300", "--layers", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(row["layout"], row["content"], row["op"]) for row in rows} == {
        (name, content, op) for name in LAYOUTS for content in ("kv", "latent")
        for op in ("save", "load_cpu", "load_disk")}
    for row in rows:
        assert row["exact"] is True and row["tokens"] == 300 and row["gbps"] > 0 and row["baseline_gbps"] > 0
        assert row["ratio_vs_pinned_copy"] > 0 and row["default_stream_blocked_ms"] is None  # no CUDA stream here


def test_a_mistyped_device_or_layout_is_one_line_and_exit_2(capsys):
    import pytest

    for argv, says in ((["--device", "meta"], "--device must be cpu or cuda"),
                       (["--device", "cpu", "--layouts", "NCHW"], "unknown KV cache layout 'NCHW'"),
                       (["--device", "cpu", "--contents", "kv,mla"], "--contents: kv and/or latent")):
        with pytest.raises(SystemExit) as exit_info:
            gpu_paged.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and says in err and "Traceback" not in err
