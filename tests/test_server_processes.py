"""`kvfabric server` in its own process with engines in theirs: hits across engine processes, kill -9 of an engine
mid-store and of the server mid-retrieve, fuzzed control frames, refused clients."""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric.cache.remote import RemoteCache
from kvfabric.cache.remote import wire as P
from kvfabric.cache.remote.pool import SlotPool
from tests.server_fixtures import (
    CHUNK,
    LAYOUT,
    ROOT,
    ServerProcess,
    client_config,
    random_kv,
    server_config,
    start_server,
    tokens_of,
)

pytestmark = pytest.mark.slow


def _child(action: str, data: dict, seed: int, num_tokens: int, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    config = json.dumps({**data, "mode": "server"})
    return subprocess.Popen([sys.executable, "-m", "tests.server_child", action, config, str(seed), str(num_tokens)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, **kwargs)


def _run_child(action: str, data: dict, seed: int, num_tokens: int) -> str:
    proc = _child(action, data, seed, num_tokens)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    return out.strip()


def _wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def server(tmp_path):
    proc = start_server(tmp_path, server_config(tmp_path))
    yield proc
    proc.kill()


def test_two_engine_processes_share_one_server(server: ServerProcess) -> None:
    data = server.config
    assert _run_child("store", data, seed=11, num_tokens=1100) == "4"
    first = json.loads(_run_child("check", data, seed=11, num_tokens=1100))
    assert first == {"hit_tokens": 4 * CHUNK, "exact": True}  # another process's stores, bit for bit
    other = json.loads(_run_child("check", data, seed=12, num_tokens=600))
    assert other == {"hit_tokens": 0, "exact": True}  # a prompt nobody stored: a miss
    assert server.stop() == 0  # SIGTERM: a clean shutdown removes the socket and the pool
    assert not server.socket.exists()


def test_kill9_of_an_engine_mid_store_reclaims_its_slot_and_publishes_nothing(server: ServerProcess) -> None:
    data = server.config
    writer = _child("half-store", data, seed=13, num_tokens=CHUNK)
    assert writer.stdout.readline().strip() == "leased"
    with RemoteCache(client_config(data), LAYOUT, "model-a") as watcher:
        assert watcher.stats().counters["server.pool.referenced"] == 1  # the writer's lease
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
        assert _wait_for(lambda: watcher.stats().counters["server.pool.referenced"] == 0)
        tokens = tokens_of(CHUNK, 13)
        assert watcher.lookup(tokens) == 0  # the half-written chunk was never published ...
        assert watcher.retrieve(tokens).shape[3] == 0  # ... nor served
        assert watcher.stats().counters["server.slots_reclaimed"] == 1
        kv = random_kv(CHUNK, 13)  # and the slot is reusable: the full chunk stores and reads back exactly
        assert watcher.store(tokens, kv) == 1 and torch.equal(watcher.retrieve(tokens), kv)


def test_kill9_of_the_server_mid_retrieve_is_a_shorter_prefix_then_a_reconnect(tmp_path, monkeypatch) -> None:
    data = server_config(tmp_path, max_slots_per_client=2)  # a retrieve of 4 chunks takes two round trips
    tokens, kv = tokens_of(4 * CHUNK, 14), random_kv(4 * CHUNK, 14)
    server = start_server(tmp_path, data)
    cache = RemoteCache(client_config(data), LAYOUT, "model-a")
    try:
        assert cache.store(tokens, kv) == 4
        cache.flush()
        real = SlotPool.tensor
        calls = []

        def kill_after_first_chunk(pool, slot, layout, num_tokens):  # the server dies while chunk 0 is copied:
            # its answer for chunk 1 (and the end of the first batch) may or may not be sent by then
            calls.append(slot)
            if len(calls) == 1:
                server.kill()
            return real(pool, slot, layout, num_tokens)

        monkeypatch.setattr(SlotPool, "tensor", kill_after_first_chunk)
        started = time.monotonic()
        got = cache.retrieve(tokens)
        assert time.monotonic() - started < 5.0
        # what arrived, exact: chunk 0, and chunk 1 when its answer beat the kill (never the second batch)
        assert got.shape[3] in (CHUNK, 2 * CHUNK) and torch.equal(got, kv[:, :, :, :got.shape[3]])
        monkeypatch.setattr(SlotPool, "tensor", real)
        assert cache.lookup(tokens) == 0 and cache.store(tokens, kv) == 0  # down: misses, no errors
        server = start_server(tmp_path, data)  # restarted: the disk tier still holds the chunks
        assert _wait_for(cache.is_connected)
        assert torch.equal(cache.retrieve(tokens), kv)
    finally:
        cache.close()
        server.kill()


def test_a_wrong_token_is_refused(tmp_path) -> None:
    """Clients of another user cannot connect: the socket is 0600 (checked here; this machine has no second
    user to try it) and the server checks the peer's uid. With a token, same-user clients must also present it."""
    data = server_config(tmp_path, token="s3cret")
    server = start_server(tmp_path, data)
    try:
        assert stat.S_IMODE(os.stat(server.socket).st_mode) == 0o600
        wrong = {**data, "server": {**data["server"], "token": "nope"}}
        assert _run_child("store", wrong, seed=15, num_tokens=CHUNK) == "0"
        assert _run_child("store", data, seed=15, num_tokens=CHUNK) == "1"
        assert json.loads(_run_child("check", wrong, seed=15, num_tokens=CHUNK))["hit_tokens"] == 0
        assert server.proc.poll() is None
    finally:
        server.kill()


# ---- fuzzed control frames -----------------------------------------------------------------------------
FIELDS = ["keys", "tokens", "slots", "release", "host", "port", "timeout_ms", "layout", "model_id", "chunk_size",
          "token", "name", "hash", "salt"]
values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.binary(max_size=40)
                      | st.text(max_size=20), lambda inner: st.lists(inner, max_size=6), max_leaves=12)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=5)
frames = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda op, flags, budget, body: P.HEADER.pack(P.MAGIC, P.VERSION, op, flags, 1, budget, len(body)) + body,
              st.integers(0, 255), st.integers(0, 3), st.integers(0, 2**32 - 1),
              bodies.map(lambda b: msgpack.packb(b, use_bin_type=True))),
    st.builds(lambda n: P.HEADER.pack(P.MAGIC, P.VERSION, P.LOOKUP, 0, 1, 0, n), st.integers(0, 2**32 - 1)),
)
HELLO = P.pack(P.HELLO, 1, {"model_id": "model-a", "chunk_size": CHUNK, "layout": [2, 2, 16, "float16"]})


def test_fuzzed_frames_never_crash_the_server(tmp_path) -> None:
    data = server_config(tmp_path, timeout_s=0.5)
    server = start_server(tmp_path, data)
    tokens, kv = tokens_of(512, 16), random_kv(512, 16)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.booleans(), st.lists(frames, min_size=1, max_size=3))
    def attack(with_hello: bool, payloads: list[bytes]) -> None:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(2)
            sock.connect(str(server.socket))
            try:
                if with_hello:
                    sock.sendall(HELLO)
                for payload in payloads:
                    sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):  # whatever comes back, until the server closes or answers all
                    pass
            except OSError:
                pass  # closed on us mid-send: fine

    try:
        with RemoteCache(client_config(data), LAYOUT, "model-a") as good:
            assert good.store(tokens, kv) == 2
            attack()
            assert server.proc.poll() is None
            assert _wait_for(good.is_connected)
            assert torch.equal(good.retrieve(tokens), kv)
            assert _wait_for(lambda: good.stats().counters["server.pool.referenced"] == 0)
            assert good.stats().counters.get("server.handler_errors", 0) == 0  # no bug was hit, only bad input
    finally:
        assert server.stop() == 0


def test_an_hf_engine_recomputes_when_the_server_dies_mid_retrieve(tmp_path, monkeypatch) -> None:
    """The reference engine in `mode: server`: a server killed mid-retrieve costs a recompute of the rest (same
    logits as without a cache), never an error; after a restart the engine reconnects and hits again."""
    from kvfabric.config import Config
    from kvfabric.engines.hf import HFEngine
    from kvfabric.engines.model import ensure_model, load_model
    from kvfabric.engines.runtime import layout_for
    path = ensure_model()
    model, tok = load_model(path)
    layout = layout_for(model.config, "float32")
    data = server_config(tmp_path, max_slots_per_client=2, slot_bytes=layout.num_bytes(64), pool_capacity="64MiB")
    data["chunk_size"] = 64
    server = start_server(tmp_path, data)
    prompt = " ".join(f"Line {i}: the lighthouse keeper counted {i * 7} gulls before dawn." for i in range(30))
    engine = HFEngine(path, model=model, tokenizer=tok, config=Config.from_dict({**data, "mode": "server"}),
                      kv_dtype="float32")
    try:
        cold = engine.generate(prompt, max_new_tokens=8, use_cache=False)
        first = engine.generate(prompt, max_new_tokens=8)  # stores through the server
        assert first.hit_tokens == 0 and first.stored_chunks == first.prompt_tokens // 64
        engine.cache.flush()
        real = SlotPool.tensor
        calls = []

        def kill_during_first_batch(pool, slot, layout, num_tokens):
            calls.append(slot)
            if len(calls) == 1:
                server.kill()
            return real(pool, slot, layout, num_tokens)

        monkeypatch.setattr(SlotPool, "tensor", kill_during_first_batch)
        broken = engine.generate(prompt, max_new_tokens=8)
        monkeypatch.setattr(SlotPool, "tensor", real)
        # chunk 0 arrived, and chunk 1 when its answer beat the kill: either way the rest is recomputed
        assert broken.hit_tokens in (64, 2 * 64)
        assert broken.text == cold.text and torch.allclose(broken.logits, cold.logits, atol=1e-3)
        server = start_server(tmp_path, data)  # a fresh server: its pool and cpu tier are empty, the disk is not
        assert _wait_for(engine.cache.is_connected)
        again = engine.generate(prompt, max_new_tokens=8)
        assert again.hit_tokens == (again.prompt_tokens // 64) * 64 and again.text == cold.text
    finally:
        engine.close()
        server.kill()
