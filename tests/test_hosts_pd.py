"""P/D across emulated hosts (kvfabric.bench.hosts_pd): a prefill and a decode `vllm serve` on two hosts of the test
bed, the controller, the proxy and the client on a third, the KV over kvfabric's P2P protocol on a shaped link.

Needs vllm (the .venv-vllm venv; skips otherwise), root and iproute2 (skips with one line otherwise), and the
SmolLM2 model (ensure_model).
"""
from __future__ import annotations

import os

import pytest

from kvfabric.bench.hosts import namespaces
from tests.host_fixtures import need_bed

pytest.importorskip("vllm")


@pytest.mark.slow
def test_the_pair_across_hosts_moves_the_kv_over_the_shaped_link_and_answers_as_colocated():
    need_bed()
    from kvfabric.bench.hosts_pd import run
    rows = run([512], [1], (1000, 10000), as_json=True)
    (colocated,) = [r for r in rows if r["path"] == "colocated"]
    slow, fast = sorted((r for r in rows if r["path"] == "p2p"), key=lambda r: r["rate_mbit"])
    kv_bytes = 512 * 30 * 2 * 3 * 64 * 4  # SmolLM2's KV of the prompt (fp32): the decode instance loaded all of it
    for pair in (slow, fast):  # a pair per rate, each counted from its own start
        assert pair["same_output"] is True  # greedy text equal to the colocated instance's, prompt by prompt
        assert pair["bytes_per_request"] >= kv_bytes and min(pair["transfer_samples"]) > 0, pair
    assert slow["rate_mbit"] == 1000 and 700 <= slow["link_mbit"] <= 1050
    # the KV crossed the 1 Gbit link: it cannot arrive sooner than the link carries its bytes
    assert slow["transfer_s"] >= 0.9 * slow["link_s"] > 0.15
    assert fast["transfer_s"] < slow["transfer_s"]
    assert colocated["transfer_s"] is None and colocated["ttft_mean_s"] > 0
    assert not [n for n in namespaces() if n.startswith(f"kvf-{os.getpid()}-")]  # the bed's hosts are gone
