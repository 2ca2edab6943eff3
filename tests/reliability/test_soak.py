"""The soak benchmark as CI runs it: `kvfabric bench soak --duration 60 --json` (two processes, threads, cpu + shm +
disk + redis): no wrong chunk, no hang, no error, every sampled resource within its stated bound, the hit ratio
stable. The bench itself exits 1 if any of that fails; the figures are reported for the README."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.artifacts import keep_artifact
from tests.redis_fixtures import needs_redis
from tests.reliability.harness import report

DURATION_S = int(os.environ.get("KVFABRIC_TEST_SOAK_S", "60"))


@pytest.mark.slow
@needs_redis
def test_soak(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    plot = tmp_path / "soak.png"
    done = subprocess.run([sys.executable, "-m", "kvfabric.apps.cli", "bench", "soak", "--duration", str(DURATION_S),
                           "--json", "--plot", str(plot)], env=env, capture_output=True, text=True,
                          timeout=DURATION_S + 600)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("duration_s", "ops", "wrong", "hangs", "rss_start_mb", "rss_max_mb", "rss_end_mb", "fds_max",
                 "threads_max"):
        assert name in result
    print(f"soak plot: {keep_artifact(plot)}")
    report(f"soak {DURATION_S} s: two processes x 3 threads over cpu + shm + disk + redis", None,
           **{k: v for k, v in result.items() if k not in ("bounds", "within_bounds")},
           bounds=result["bounds"])
    assert result["wrong"] == 0 and result["hangs"] == 0 and result["errors"] == 0
    assert all(result["within_bounds"].values()), result["within_bounds"]
    assert done.returncode == 0 and result["ok"]
