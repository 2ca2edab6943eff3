"""A cache instance in its own process for the reliability tests (killed with SIGKILL by them): a CacheEngine over
`--tiers` (with "peer": a cluster member) that stores the Workload's first `--prompts` prompts, prints "ready",
then serves (or, with --write-forever, keeps storing new prompts) until killed. `--layout big` makes 512 KiB chunks, so that transfers take long enough to be cut."""
from __future__ import annotations

import argparse
import sys
import threading

from kvfabric.cache.builder import build_engine
from kvfabric.config import Config
from kvfabric.engines.synthetic import MODEL_ID, SMALL_LAYOUT, Workload
from kvfabric.kv.layout import KVLayout

BIG_LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="float16")  # 512 KiB per 64-token chunk


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="a Config as JSON")
    parser.add_argument("--layout", default="small", choices=["small", "big"])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--write-forever", action="store_true", help="after 'ready', keep storing new prompts")
    args = parser.parse_args()
    import json
    config = Config.from_dict(json.loads(args.config))
    layout = BIG_LAYOUT if args.layout == "big" else SMALL_LAYOUT
    engine = build_engine(config, layout, MODEL_ID)
    workload = Workload(engine, num_prompts=max(args.prompts, 1))
    for i in range(args.prompts):
        tokens = workload.prompt(i)
        engine.store(tokens, workload.kv_for(tokens, 0))
    engine.flush()
    if engine.node is not None:
        engine.node.flush_reports(30)
    print("ready", flush=True)
    i = args.prompts
    while args.write_forever:  # until killed, most likely in the middle of a write
        tokens = workload.prompt(i)
        engine.store(tokens, workload.kv_for(tokens, 0))
        i += 1
    threading.Event().wait()  # until killed


if __name__ == "__main__":
    sys.exit(main())
