"""Bad input at the system level (the per-format fuzzers live beside their code: tests/test_chunk_format.py,
test_codec_contract.py, test_cluster_p2p.py, and schemathesis over the controller's OpenAPI in
test_cluster_controller.py):
- a vandal overwriting stored chunks (bit flips, truncation, garbage) in disk files and Redis values while an engine
  runs its load: no wrong chunk, every damaged one counted and dropped;
- a storm of random frames at a peer server while a real client fetches from it: every fetch exact;
- CacheGen payloads with hostile length fields and random bit flips (checksums made valid, so the decoder itself
  sees them), decoded in a fresh process: refused or harmless, and the process's peak RSS stays within the stated
  bound (HOSTILE_RSS_BOUND_MB over a valid decode) however large a length the stream claims."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvfabric.cache.builder import build_engine
from kvfabric.cluster import protocol as p
from kvfabric.cluster.p2p_client import PeerClient
from kvfabric.cluster.p2p_server import PeerServer
from kvfabric.config import Config
from kvfabric.engines.synthetic import MODEL_ID, SMALL_LAYOUT
from kvfabric.tiers.cpu import CpuTier
from tests.cluster_scripts.helpers import key, make_blob
from tests.redis_fixtures import needs_redis, redis_server  # noqa: F401 - fixtures
from tests.reliability.harness import Load, assert_clean, report, time_until

pytestmark = pytest.mark.slow
HOSTILE_RSS_BOUND_MB = 64


def vandalize(blob: bytes, rng: random.Random) -> bytes:
    kind = rng.choice(["flip", "truncate", "garbage", "zero_tail", "extend"])
    data = bytearray(blob)
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del data[rng.randrange(len(data)):]
    elif kind == "garbage":
        data = bytearray(rng.randbytes(rng.randint(0, len(data))))
    elif kind == "zero_tail":
        at = rng.randrange(len(data))
        data[at:] = bytes(len(data) - at)
    else:
        data += rng.randbytes(rng.randint(1, 64))
    return bytes(data)


@needs_redis
def test_vandal_damaging_stored_chunks_under_load(tmp_path, redis_server):  # noqa: F811
    config = Config.from_dict({"chunk_size": 32, "tiers": ["cpu", "disk", "redis"], "cpu": {"capacity": 256 * 1024},
                               "disk": {"path": str(tmp_path / "chunks"), "capacity": "4MiB"},
                               "redis": {"url": redis_server.url}})
    client = redis_server.client()
    rng = random.Random(0)
    damaged = 0
    with build_engine(config, SMALL_LAYOUT, MODEL_ID) as engine:
        load = Load(engine).start()
        time_until(lambda: engine.stats().counters.get("hit.disk", 0) > 10, 120)
        end = time.monotonic() + 8
        while time.monotonic() < end:
            files = list((tmp_path / "chunks").glob("*/*.kvc"))
            for path in rng.sample(files, min(5, len(files))):
                try:
                    path.write_bytes(vandalize(path.read_bytes(), rng))
                    damaged += 1
                except OSError:
                    pass  # evicted meanwhile
            for name in rng.sample(list(client.scan_iter(match=b"kvf:*", count=500)), 5):
                value = client.get(name)
                if value:
                    client.set(name, vandalize(value, rng))
                    damaged += 1
            time.sleep(0.1)
        load.stop()
        corrupt = sum(v for k, v in engine.stats().counters.items() if k.startswith("corrupt."))
    assert corrupt > 0  # the load did read damaged chunks, and refused them
    assert_clean(load)
    report("vandal damaging stored chunks (disk files, Redis values) under load", load, damaged_writes=damaged,
           corrupt_refused=corrupt, recovery_s=0.0)


def test_random_frame_storm_at_a_peer_server_while_a_client_fetches():
    cpu = CpuTier(1 << 24)
    keys = [key(i) for i in range(16)]
    blobs = {k: make_blob(k, seed=i) for i, k in enumerate(keys)}
    for k, blob in blobs.items():
        cpu.put(k, blob)
    server = PeerServer([cpu], token="t", io_timeout_s=0.5, idle_timeout_s=0.5).start()
    stop = threading.Event()
    sent = [0]

    def storm(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            frame = rng.choice([
                lambda: rng.randbytes(rng.randint(0, 64)),
                lambda: p.pack_header(rng.choice(list(p.FrameType)), rng.randint(0, 1 << 40)) + rng.randbytes(8),
                lambda: p.pack_header(p.FrameType.GET, 40) + rng.randbytes(40),
                lambda: p.pack_header(p.FrameType.CONTROL, 30) + b"\x01\x00t" + rng.randbytes(27)])()
            try:
                with socket.create_connection((server.host, server.port), timeout=1) as s:
                    s.sendall(frame)
                    s.settimeout(0.5)
                    try:
                        s.recv(64)
                    except OSError:
                        pass
                sent[0] += 1
            except OSError:
                pass

    threads = [threading.Thread(target=storm, args=(i,), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    client = PeerClient(server.host, server.port, "t", io_timeout_s=5.0)
    fetches = wrong = 0
    try:
        end = time.monotonic() + 6
        while time.monotonic() < end:
            got = client.fetch_all(keys)
            wrong += sum(bytes(got[k]) != blobs[k] for k in keys)
            fetches += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
        client.close()
        server.close()
    assert wrong == 0 and fetches > 10 and sent[0] > 50
    report("random frames at a peer server while a client fetches", None, hostile_connections=sent[0],
           fetches=fetches, wrong=0, hangs=0, recovery_s=0.0)


HOSTILE_SCRIPT = r"""
import json, resource, struct, sys, random
import torch
from kvfabric.codec.cachegen import CacheGenCodec
from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader, parse, write_blob
from kvfabric.kv.layout import KVLayout

layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16")
key = bytes(range(32))
kv = (torch.randn(layout.shape(64), generator=torch.Generator().manual_seed(0)) * 2).half()
out = torch.empty(layout.shape(64), dtype=torch.float16)

def rewrap(blob, payload):
    h = parse(blob, key)
    header = ChunkHeader(h.codec_id, h.dtype_code, h.level, h.fingerprint, h.shape, h.key, len(payload))
    data = bytearray(HEADER_BYTES + len(payload))
    data[HEADER_BYTES:] = payload
    write_blob(header, data)
    return data

def decode(codec, data):
    try:
        codec.decode(parse(data, key), memoryview(data), layout, out)
        return "decoded"
    except ChunkFormatError:
        return "refused"

counts = {"refused": 0, "decoded": 0}
rng = random.Random(0)
for level in (0, 6):
    codec = CacheGenCodec(level)
    blob = bytes(codec.encode(kv, key, layout))
    decode(codec, bytearray(blob))  # warm up: jit compile, tables
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    payload = blob[HEADER_BYTES:]
    spots = list(range(0, min(len(payload) - 4, 512), 4))  # the prelude and first segment headers: all
    spots += rng.sample(range(512, len(payload) - 4, 4), 200)  # the rest: a sample
    for at in spots:  # aligned u32 fields made hostile
        for value in (0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, len(payload) + 1, 1 << 24):
            p = bytearray(payload); struct.pack_into("<I", p, at, value)
            counts[decode(codec, rewrap(blob, p))] += 1
    for at in range(0, min(len(payload) - 8, 512), 8):  # u64 fields in the prelude
        p = bytearray(payload); struct.pack_into("<Q", p, at, (1 << 63) + at)
        counts[decode(codec, rewrap(blob, p))] += 1
    for _ in range(500):  # random bit flips
        p = bytearray(payload)
        for _ in range(rng.randint(1, 16)):
            i = rng.randrange(len(p)); p[i] ^= 1 << rng.randrange(8)
        counts[decode(codec, rewrap(blob, p))] += 1
    counts[f"rss_growth_kb_level{level}"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(json.dumps(counts))
"""


def test_cachegen_hostile_lengths_and_bit_flips_within_a_memory_bound():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", HOSTILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    growth_mb = max(counts["rss_growth_kb_level0"], counts["rss_growth_kb_level6"]) / 1024
    assert counts["refused"] > 1000
    assert growth_mb <= HOSTILE_RSS_BOUND_MB, f"decoding hostile streams grew the RSS by {growth_mb:.1f} MB"
    report("CacheGen streams: hostile length fields and random bit flips (levels 0 and 6)", None,
           inputs=counts["refused"] + counts["decoded"], refused=counts["refused"], decoded_harmless=counts["decoded"],
           peak_rss_growth_mb=growth_mb, bound_mb=HOSTILE_RSS_BOUND_MB, wrong=0, hangs=0, recovery_s=0.0)
