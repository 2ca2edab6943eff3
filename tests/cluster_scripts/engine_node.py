"""One kvfabric engine instance in the cluster, for tests/test_cluster_e2e.py: the reference engine (real model)
over cpu + disk tiers + the peer tier (built from config: build_engine makes its ClusterNode), driven by JSON
commands on stdin, one JSON reply per line on stdout.

    python engine_node.py --controller URL --token-file F --id NAME --cache DIR [--chunk 16]

Replies start with {"ready": true, "port": P2P_PORT} once the model is loaded. Commands:
  {"cmd": "generate", "ids": [...], "max_new": 4}   cached generate + a full prefill of the same prompt without
                                                    the cache; reply: hit_tokens, tokens, ref_tokens,
                                                    max_diff (logits vs the full prefill), peer counters
  {"cmd": "flush"}                                  writes landed and the controller up to date
  {"cmd": "stall", "after": N, "marker": PATH}      serve N more chunk reads to peers, then create PATH and block
                                                    every further read (a peer stuck mid-transfer)
  {"cmd": "exit"}
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--controller", required=True)
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--id", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--chunk", type=int, default=16)
    args = parser.parse_args()

    import torch

    from kvfabric import Config
    from kvfabric.cache.builder import build_engine
    from kvfabric.config import ClusterConfig, CpuTierConfig, DiskTierConfig
    from kvfabric.engines.hf import HFEngine
    from kvfabric.engines.model import ensure_model, load_model
    from kvfabric.engines.runtime import layout_for

    torch.set_num_threads(1)  # two engines share two cores
    token = Path(args.token_file).read_text().strip()
    path = ensure_model()
    model, tokenizer = load_model(str(path), dtype=torch.float32)
    cluster = ClusterConfig(controller_url=args.controller, token=token, instance_id=args.id, report_interval_s=0.1,
                            heartbeat_interval_s=0.5, lookup_timeout_s=2.0, fetch_timeout_s=5.0)
    config = Config(chunk_size=args.chunk, tiers=("cpu", "disk", "peer"), cpu=CpuTierConfig(capacity=1 << 28),
                    disk=DiskTierConfig(path=args.cache, capacity=1 << 29), cluster=cluster)
    cache = build_engine(config, layout_for(model.config, "float32"), "smollm2-135m-instruct")
    node = cache.node
    engine = HFEngine(path, model=model, tokenizer=tokenizer, cache=cache, kv_dtype="float32", num_threads=1)
    node.flush_reports(30)
    reply({"ready": True, "port": node.server.port})

    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg.get("cmd")
        if cmd == "generate":
            ids = msg["ids"]
            started = time.perf_counter()
            res = engine.generate(ids, msg.get("max_new", 4))
            seconds = time.perf_counter() - started
            ref = engine.generate(ids, msg.get("max_new", 4), use_cache=False)  # a full prefill, no cache
            with torch.inference_mode():
                plain = model(torch.tensor([ids])).logits[0, -1].float()  # plain HF forward, no kvfabric
            reply({"hit_tokens": res.hit_tokens, "prompt_tokens": res.prompt_tokens, "tokens": res.token_ids,
                   "ref_tokens": ref.token_ids, "stored_chunks": res.stored_chunks, "seconds": seconds,
                   "max_diff": float((res.logits - ref.logits).abs().max()),
                   "max_diff_plain": float((res.logits - plain).abs().max()),
                   "peer": node.peer.counters.snapshot(), "counters": cache.stats().counters})
        elif cmd == "flush":
            cache.flush()
            reply({"ok": node.flush_reports(30)})
        elif cmd == "stall":
            budget = [int(msg["after"])]
            lock, never = threading.Lock(), threading.Event()
            for tier in node.served.values():
                def stalled_get(key, _get=tier.inner.get, _marker=msg["marker"], **kwargs):  # kwargs: meta
                    with lock:
                        budget[0] -= 1
                        stall = budget[0] < 0
                    if stall:
                        Path(_marker).touch()
                        never.wait()  # until the test kills this process
                    return _get(key, **kwargs)

                tier.inner.get = stalled_get  # the peer server reads through the observed tiers
            reply({"ok": True})
        elif cmd == "exit":
            reply({"ok": True})
            break
    engine.close()
    cache.close()


if __name__ == "__main__":
    main()
