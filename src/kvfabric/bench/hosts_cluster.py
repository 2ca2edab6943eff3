"""A kvfabric cluster node inside an emulated host (kvfabric.bench.hosts), driven over its stdin: for the fault tests
of the cluster across hosts (the controller runs as `python -m kvfabric.cluster.controller` in a host of its own).

`python -m kvfabric.bench.hosts_cluster node --config JSON --prompts A:B`: a CacheEngine built from the Config
(JSON; with tier "peer": a cluster member whose P2P server binds the host's address) over the synthetic layout,
which stores the synthetic Workload's prompts A..B-1 (the KV of each chunk a function of its key, so any chunk read
back is checked byte for byte, whoever stored it) and waits (60 s at most) until the controller knows them. Writes
`{"ready": true, "reported": bool, "instance_id"}`, then answers each JSON line read from stdin with one line:
- `{"op": "retrieve", "prompts": [A, B]}`: for each prompt A..B-1, lookup then retrieve of what the lookup found
  (nothing stored on a miss); `{"prompts", "chunks", "hit_chunks", "checked", "wrong", "errors", "max_call_s",
  "ended"}`: the chunks asked and loaded, those compared with the expected bytes and those that differed, calls
  that raised, the slowest call (lookup + retrieve, seconds), time.monotonic() at the end;
- `{"op": "instances"}`: `{"instances": [ids], "error": null}`, the controller's live instances as this host
  sees them (`error`: why not, within the lookup deadline).
Runs until its stdin closes, then closes the engine.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from kvfabric.cache.builder import build_engine
from kvfabric.cluster.client import ControllerClient, ControllerError
from kvfabric.config import Config
from kvfabric.engines.synthetic import MODEL_ID, SMALL_LAYOUT, Workload

MODULE = "kvfabric.bench.hosts_cluster"
NUM_PROMPTS = 50  # the workload's prompts 0..49 share no chunk (one base each)


def retrieve(engine, workload: Workload, first: int, end: int) -> dict:
    chunks = hit = checked = wrong = errors = 0
    max_call = 0.0
    for i in range(first, end):
        tokens = workload.prompt(i)
        chunks += len(tokens) // workload.chunk_size
        started = time.monotonic()
        try:
            found = engine.lookup(tokens)
            kv = engine.retrieve(tokens[:found]) if found else None
        except Exception:  # noqa: BLE001 - the engine must not raise for cache faults: counted, asserted 0
            errors += 1
            continue
        finally:
            max_call = max(max_call, time.monotonic() - started)
        if kv is not None:
            num, bad = workload.check(tokens, kv)
            hit, checked, wrong = hit + kv.shape[3] // workload.chunk_size, checked + num, wrong + bad
    return {"prompts": end - first, "chunks": chunks, "hit_chunks": hit, "checked": checked, "wrong": wrong,
            "errors": errors, "max_call_s": max_call, "ended": time.monotonic()}


def instances(config: Config) -> dict:
    client = ControllerClient(config.cluster.controller_url, config.cluster.token or None,
                              config.cluster.lookup_timeout_s)
    try:
        return {"instances": [i["instance_id"] for i in client.instances()], "error": None}
    except ControllerError as exc:
        return {"instances": [], "error": str(exc)}
    finally:
        client.close()


def node(config: Config, first: int, end: int) -> None:
    logging.getLogger("kvfabric").setLevel(logging.ERROR)  # the insecure bind's warning: a private bed link
    with build_engine(config, SMALL_LAYOUT, MODEL_ID) as engine:
        workload = Workload(engine, num_prompts=NUM_PROMPTS)
        for i in range(first, end):
            tokens = workload.prompt(i)
            engine.store(tokens, workload.kv_for(tokens, 0))
        engine.flush()
        reported, deadline = False, time.monotonic() + 60
        while engine.node is not None and not reported and time.monotonic() < deadline:
            reported = engine.node.flush_reports(10)  # False at once while the controller is still starting
            if not reported:
                time.sleep(0.1)  # a retry's pace
        instance_id = engine.node.instance_id if engine.node is not None else None
        print(json.dumps({"ready": True, "reported": reported, "instance_id": instance_id}), flush=True)
        for line in sys.stdin:
            request = json.loads(line)
            if request["op"] == "retrieve":
                reply = retrieve(engine, workload, *request["prompts"])
            else:
                reply = instances(config)
            print(json.dumps(reply), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    sub = parser.add_subparsers(dest="verb", required=True)
    n = sub.add_parser("node")
    n.add_argument("--config", required=True, help="a Config as JSON")
    n.add_argument("--prompts", default="0:0", help="A:B, the workload's prompts this node stores")
    args = parser.parse_args(argv)
    first, end = (int(x) for x in args.prompts.split(":"))
    node(Config.from_dict(json.loads(args.config)), first, end)


if __name__ == "__main__":
    main()
