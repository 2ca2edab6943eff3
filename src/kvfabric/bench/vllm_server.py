"""A `vllm serve` (or any HTTP server) process for benchmarks and tests: start on 127.0.0.1, wait until it answers, stop.

`VllmServer(argv, env, log)` runs `argv` (a full `vllm serve ...` command, or a shell script that execs one) in its
own process group; `wait_ready(timeout)` polls GET /health until it answers 200 (or the process dies: its log is
in the error); `stop()` sends SIGINT (vLLM shuts down gracefully: the connector flushes its saves), then SIGKILL
after a grace period. Also a context manager.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


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


class VllmServer:
    def __init__(self, argv: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> None:
        self.port = port
        self.log = log
        self._log_file = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.5
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log.read_text()[-5000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as reply:
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

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
