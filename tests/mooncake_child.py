"""Another process using the same Mooncake Store (tests/test_mooncake_tier.py): a CacheEngine over tier "mooncake".

    python -m tests.mooncake_child MASTER METADATA_URL METRICS_URL store|check SEED

`store` stores a seeded prompt's KV, prints "stored N" and keeps its client (and the segment holding the objects)
alive until a line arrives on stdin. `check` retrieves the same prompt and prints "hit N equal" or "hit N differ".
"""
from __future__ import annotations

import os
import sys

import torch

from kvfabric import Config, KVLayout
from kvfabric.cache.builder import build_engine
from kvfabric.config import MooncakeTierConfig

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
NUM_TOKENS = 100


def prompt(seed: int) -> tuple[list[int], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (NUM_TOKENS,), generator=gen).tolist()
    return tokens, torch.randn(LAYOUT.shape(NUM_TOKENS), generator=gen).to(torch.float16)


def main() -> None:
    master, metadata_url, metrics_url, mode, seed = sys.argv[1:6]
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    section = MooncakeTierConfig(master=master, metadata_url=metadata_url, metrics_url=metrics_url,
                                 segment=64 * 2**20, buffer=16 * 2**20, timeout_s=5.0)
    tokens, kv = prompt(int(seed))
    with build_engine(Config(chunk_size=16, tiers=("mooncake",), mooncake=section), LAYOUT, "shared") as engine:
        if mode == "store":
            num = engine.store(tokens, kv)
            engine.flush()
            print(f"stored {num}", flush=True)
            sys.stdin.readline()
        else:
            got = engine.retrieve(tokens)
            same = torch.equal(got, kv[:, :, :, :got.shape[3]])
            print(f"hit {got.shape[3]} {'equal' if same else 'differ'}", flush=True)


if __name__ == "__main__":
    main()
