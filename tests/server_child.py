"""An engine process for the server tests: `python -m tests.server_child ACTION CONFIG_JSON SEED NUM_TOKENS`.

    store        store the prompt's KV (random, from SEED) and print the chunks stored
    check        retrieve the prompt and print JSON {hit_tokens, exact}: exact = the values equal the seeded KV
    half-store   lease a slot, write half of chunk 0's KV into it, print "leased", then wait to be killed
"""
from __future__ import annotations

import json
import sys
import time

import torch

from kvfabric.cache.remote import RemoteCache
from kvfabric.config import Config
from tests.server_fixtures import LAYOUT, random_kv, tokens_of


def main(action: str, config_json: str, seed: int, num_tokens: int) -> None:
    cache = RemoteCache(Config.from_dict(json.loads(config_json)), LAYOUT, "model-a", name=f"child-{action}")
    tokens, kv = tokens_of(num_tokens, seed), random_kv(num_tokens, seed)
    if action == "store":
        print(cache.store(tokens, kv), flush=True)
        cache.flush()
    elif action == "check":
        got = cache.retrieve(tokens)
        exact = bool(torch.equal(got, kv[:, :, :, :got.shape[3]]))
        print(json.dumps({"hit_tokens": int(got.shape[3]), "exact": exact}), flush=True)
    elif action == "half-store":
        payload = cache.new_payload()
        half = payload.kv.shape[3] // 2
        payload.kv[:, :, :, :half].copy_(kv[:, :, :, :half])
        print("leased", flush=True)
        time.sleep(600)  # killed here: the slot is leased, half written, never committed
    cache.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
