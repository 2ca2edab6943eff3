"""`kvfabric bench interference`: does fetching and decoding KV slow the model down, and does `kvfabric server` on a
core of its own stop that (ShadowServe's claim, on a CPU)?

The reference model (SmolLM2-135M, one torch thread, pinned to one core) decodes request A for 256 steps; TPOT is
timed per step. Meanwhile request B's 4k-token prompt is fetched back to back over a throttled loopback link
(100 Mbit/s and 1 Gbit/s: kvfabric.stream's token bucket) as CacheGen chunks (level 6, the default) and decoded:
- `none`:   no fetch (the baseline TPOT);
- `inproc`: received and decoded on threads of the engine's process (kvfabric.stream.Receiver), on its core;
- `server`: `kvfabric server`, pinned to the other core, receives and decodes into its pool (FETCH_STREAM); the
            engine then copies B's KV out of the pool (`retrieve`).
B's TTFT runs from the fetch's start to B's first token (run by the engine between two steps of A; not in A's
TPOT samples). Reported per (setup, link): TPOT mean and p99 and their ratios to `none` of the same link, B's
TTFT (median over the fetches), kvfabric's CPU time per step in the engine process and in the server, the load
average. Then: two engine processes sharing the server (the second's hit tokens), and retrieve through the
server (pool slot to the engine's buffer) vs a plain copy of the same bytes. The sender lives in this process,
on the server's core (it stands in for a remote host); each engine is a fresh process
(kvfabric.bench.interference_engine). Absolute times on a busy machine are noise: compare within a run.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import yaml

from kvfabric.bench.common import emit

LINKS_MBPS = (100, 1000)
SETUPS = ("none", "inproc", "server")
MODEL_ID = "smollm2-135m-instruct"


class Sender:
    """Sends B's prepared prompt to each connection, at `rate_mbps`, every chunk at one CacheGen level."""

    def __init__(self, prompt, option: str) -> None:  # noqa: ANN001
        self.prompt, self.option, self.rate_mbps = prompt, option, 100.0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._send, args=(conn,), daemon=True).start()

    def _send(self, conn: socket.socket) -> None:
        from kvfabric.stream import FixedPolicy, ThrottledSocket, TokenBucket, send_prompt
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                send_prompt(ThrottledSocket(conn, TokenBucket(self.rate_mbps * 1e6 / 8, 256 * 1024)), self.prompt,
                            FixedPolicy(self.option))
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


def _engine(mode: str, params: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run([sys.executable, "-m", "kvfabric.bench.interference_engine", mode, json.dumps(params)],
                          capture_output=True, text=True, env=env, timeout=1800)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise RuntimeError(f"engine process ({mode}) failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc; its engine run includes the warm fetch)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(config: dict[str, Any], path: Path, cpu: int | None) -> subprocess.Popen:
    """A `kvfabric server` process on `config` (written to `path`), pinned to `cpu` when given, once it is ready."""
    path.write_text(yaml.safe_dump(config))
    pinned = ["--cpus", str(cpu)] if cpu is not None else []
    proc = subprocess.Popen([sys.executable, "-m", "kvfabric.apps.cli", "server", "--config", str(path), *pinned],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"kvfabric server did not start: {line}{proc.stderr.read() if proc.stderr else ''}")
    return proc


def run(as_json: bool = False, steps: int = 256, b_tokens: int = 4096, a_tokens: int = 512, level: int = 6,
        links: tuple[int, ...] = LINKS_MBPS, engine_cpu: int = 0, server_cpu: int = 1) -> list[dict]:
    from kvfabric.bench.codec import held_out_texts
    from kvfabric.engines.runtime import layout_for, load_for_inference, prefill
    from kvfabric.stream import prepare
    if server_cpu not in os.sched_getaffinity(0):
        server_cpu = engine_cpu  # one core: the set-ups still run, but (c) cannot separate anything
    model, tok = load_for_inference()
    docs, held_out = held_out_texts(tok, 3, b_tokens)
    a_ids, b_ids, c_ids = docs[0][:a_tokens], docs[1], docs[2][:b_tokens // 2]
    prompt = prepare(b_ids, prefill(model, b_ids, len(b_ids)), layout_for(model.config, "float16"), MODEL_ID, 256,
                     levels=(level,))
    wire_mb = sum(len(b) for b in prompt.blobs[f"L{level}"]) / 1e6
    del model
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {server_cpu})  # the sender stands in for a remote host: never on the engine's core
    sender = Sender(prompt, f"L{level}")  # (its threads inherit this thread's affinity)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvfabric-interference-") as tmp:
        server_config = {"tiers": ["cpu"], "chunk_size": 256, "server": {
            "socket": f"{tmp}/server.sock", "pool_capacity": "384MiB", "slot_bytes": "6MiB",
            "max_slots_per_client": 16, "timeout_s": 60.0}}
        server = start_server(server_config, Path(tmp) / "server.yaml", server_cpu)
        client = {**server_config, "mode": "server"}
        try:
            for link in links:
                sender.rate_mbps = link
                for setup in SETUPS:
                    cpu0 = _cpu_seconds(server.pid)
                    rows.append(_engine("decode", {"setup": setup, "link_mbps": link, "steps": steps,
                                                   "a_ids": a_ids, "b_ids": b_ids, "cpu": engine_cpu,
                                                   "sender_port": sender.port, "config": client}))
                    rows[-1]["server_cpu_ms_per_step"] = 1000 * (_cpu_seconds(server.pid) - cpu0) / steps
            first = _engine("share", {"config": client, "ids": c_ids, "cpu": engine_cpu})
            second = _engine("share", {"config": client, "ids": c_ids, "cpu": engine_cpu})
            copied = _engine("copy", {"config": client, "tokens": b_tokens, "repeats": 7, "cpu": engine_cpu})
        finally:
            sender.close()
            server.terminate()
            server.wait(60)
            os.sched_setaffinity(0, affinity)
    for row in rows:
        if row["setup"] != "none" and not row.get("num_fetches"):  # the engine raises first; never print such a row
            raise RuntimeError(f"set-up {row['setup']} at {row['link_mbps']} Mbit/s fetched nothing")
        base = next(r for r in rows if r["setup"] == "none" and r["link_mbps"] == row["link_mbps"])
        row["tpot_vs_none"] = row["tpot_mean_s"] / base["tpot_mean_s"]
        row["p99_vs_none"] = row["tpot_p99_s"] / base["tpot_p99_s"]
        row.update(b_wire_mb=round(wire_mb, 2), codec=f"cachegen:{level}", engine_cpu=engine_cpu,
                   server_cpu=server_cpu, held_out=held_out)
        if row["setup"] == "server":
            inproc = next(r for r in rows if r["setup"] == "inproc" and r["link_mbps"] == row["link_mbps"])
            row["tpot_target_met"] = row["tpot_vs_none"] <= 1.10
            row["ttft_vs_inproc"] = row["ttft_s"] / inproc["ttft_s"] if row["ttft_s"] and inproc["ttft_s"] else None
            row["ttft_target_met"] = row["ttft_vs_inproc"] is not None and row["ttft_vs_inproc"] <= 1.0
    emit(rows, as_json, f"Request A's TPOT while request B's {b_tokens}-token prompt is fetched and decoded "
         f"(cachegen:{level}, {wire_mb:.1f} MB a fetch; engine on core {engine_cpu}, server on core {server_cpu}; "
         f"load average {os.getloadavg()[0]:.1f})",
         ["setup", "link_mbps", "tpot_mean_s", "tpot_p99_s", "tpot_vs_none", "p99_vs_none", "ttft_s", "num_fetches",
          "kvfabric_cpu_ms_per_step", "server_cpu_ms_per_step", "load_avg"])
    shared = {"setup": "share", "link_mbps": None, "ttft_s": second["ttft_s"], "first_hit_tokens":
              first["hit_tokens"], "hit_tokens": second["hit_tokens"], "prompt_tokens": second["prompt_tokens"],
              "first_ttft_s": first["ttft_s"]}
    copy_row = {"setup": "copy", "link_mbps": None, **copied, "target_met": copied["retrieve_vs_memcpy"] >= 0.7}
    emit([shared], as_json, "Two engine processes, one server: the second one's hits",
         ["prompt_tokens", "first_hit_tokens", "first_ttft_s", "hit_tokens", "ttft_s"])
    emit([copy_row], as_json, "Retrieve through the server (pool slot -> engine buffer) vs a plain copy",
         ["bytes", "retrieve_s", "memcpy_s", "retrieve_vs_memcpy", "exact", "target_met"])
    return rows + [shared, copy_row]
