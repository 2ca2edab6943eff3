"""The host test bed: N emulated hosts on one machine, joined by real, shaped kernel links.

Contract:
- `HostBed(num_hosts, shape)`, a context manager: host i is the network namespace `kvf-<pid>-<run>-h<i>` (loopback
  up, `eth0` at `<subnet>.<i + 1>/24`), joined by a veth pair to one bridge that lives in a namespace of its own
  (`kvf-<pid>-<run>-sw`, the switch). Nothing is added to the root namespace: it cannot reach the hosts, nor they it.
- `LinkShape(rate_mbit, delay_ms, loss_pct)`: the rate caps both directions of a host's link (tbf at both ends).
  Where the kernel has sch_netem (`is_netem`), delay and loss apply to what the host sends (netem on its end).
  Without it, loss applies to what the host receives on eth0 instead (an nftables rule in the host's namespace,
  `table inet kvf`: `numgen random` drops that share of the input, frame by frame, the switch's end segmenting
  what it sends a lossy host (gso_max_segs 1); replaced on reshape, deleted at loss 0; needs
  `nft`, the nftables package; `input_counts(host)`: packets in and dropped), and delay cannot be shaped
  (HostBedError). Either way two hosts of one shape see an RTT of 2 x delay_ms and loss_pct each way.
- `run(host, argv)` / `python(host, module, *args)`: a process inside the host's namespace (`ip netns exec`), in a
  process group of its own, the environment carried (`python`: this kvfabric's source on PYTHONPATH).
  `partition(host)` takes the switch's end of the host's link down (a pulled cable: the host keeps its address,
  its packets go nowhere); `heal(host)` brings it back, shaping kept. `cut(a, b)` drops what the switch forwards between two hosts
  (nftables in the switch, `nft` needed; each still reaches the others), `mend(a, b)` ends it. `reshape`, `remove(host)` (its processes
  killed, its namespace deleted), `address(host)`.
- Cleanup: on exit (normal or by an exception), at interpreter exit and on SIGTERM, every process in the bed's
  namespaces is killed and every namespace deleted (veth pairs and bridge go with them). `sweep_stale()` (also run
  on entry) does the same for beds whose owning pid is gone, so a killed run leaves nothing for the next.
- Needs root and iproute2 (`ip`, `tc`), and `nft` for loss without sch_netem: without them HostBedError, whose
  message is one line.
"""
from __future__ import annotations

import atexit
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import kvfabric
from kvfabric.bench.hosts_shape import HostBedError, LinkShape, drop_between, drop_input, input_counts, shape_qdisc
from kvfabric.bench.hosts_shape import cmd as _cmd

PREFIX = "kvf-"
NAME = re.compile(r"^kvf-(\d+)-([0-9a-f]+)-(sw|h\d+)$")
GSO_MAX_SEGS = 65535  # the kernel's default for a veth


def check_available() -> None:
    """Raise HostBedError (one line) unless this process can build a bed."""
    if os.geteuid() != 0:
        raise HostBedError("the host test bed needs root (network namespaces, veth links and tc)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise HostBedError(f"the host test bed needs iproute2: {', '.join(missing)} not found")


def namespaces() -> list[str]:
    """The names of every named network namespace (`ip netns list`)."""
    return [line.split()[0] for line in _cmd("ip", "netns", "list").splitlines() if line.strip()]


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete_namespace(name: str) -> None:
    """Kill every process inside the namespace, then delete it (a host's veth end, and so the pair, goes too)."""
    for pid in _cmd("ip", "netns", "pids", name, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _cmd("ip", "netns", "del", name, check=False)


def sweep_stale() -> list[str]:
    """Delete the namespaces of beds whose owning process is gone; return their names."""
    stale = [n for n in namespaces() if (m := NAME.match(n)) and not _is_alive(int(m.group(1)))]
    for name in sorted(stale, key=lambda n: n.endswith("-sw")):  # hosts first, the switch last
        delete_namespace(name)
    return stale


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next line the process writes to its stdout (a pipe), waiting at most timeout_s."""
    assert proc.stdout is not None
    fd, line, deadline = proc.stdout.fileno(), bytearray(), time.monotonic() + timeout_s
    what = " ".join(map(str, proc.args[3:] if isinstance(proc.args, list) else [proc.args]))
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise HostBedError(f"no line from `{what}` within {timeout_s:.0f} s")
        byte = os.read(fd, 1)
        if not byte:
            raise HostBedError(f"`{what}` ended (exit {proc.wait(5)}) before writing a line")
        line += byte
    return line.decode()


class HostBed:
    def __init__(self, num_hosts: int, shape: LinkShape = LinkShape(), *, subnet: str = "10.213.0") -> None:
        if not 1 <= num_hosts <= 250:
            raise ValueError(f"num_hosts must be in 1..250, got {num_hosts}")
        self.num_hosts, self.shape, self.subnet = num_hosts, shape, subnet
        self.run_id = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.run_id}-sw"
        self.is_netem = False
        self._lossy: set[int] = set()  # hosts with an nftables loss rule (no netem)
        self._cuts: set[tuple[int, int]] = set()  # pairs of hosts cut apart (cut / mend)
        self._procs: dict[int, list[subprocess.Popen]] = {}
        self._removed: set[int] = set()
        self._previous_sigterm: Any = None
        self._is_closed = False

    def namespace(self, host: int) -> str:
        return f"{self.run_id}-h{host}"

    def address(self, host: int) -> str:
        self._check(host)
        return f"{self.subnet}.{host + 1}"

    def owned(self) -> list[str]:
        """The namespaces of this bed that exist now."""
        return [n for n in namespaces() if n.startswith(f"{self.run_id}-")]

    # ---- making and ending -----------------------------------------------------------------------------------
    def __enter__(self) -> HostBed:
        check_available()
        sweep_stale()
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        sw = ("ip", "-n", self.switch)
        _cmd("ip", "netns", "add", self.switch)
        _cmd(*sw, "link", "add", "br0", "type", "bridge")
        _cmd(*sw, "link", "set", "br0", "up")
        probe = subprocess.run(["tc", "-n", self.switch, "qdisc", "add", "dev", "br0", "root", "netem"],
                               capture_output=True)
        self.is_netem = probe.returncode == 0
        _cmd("tc", "-n", self.switch, "qdisc", "del", "dev", "br0", "root", check=False)
        for i in range(self.num_hosts):
            ns = self.namespace(i)
            _cmd("ip", "netns", "add", ns)
            _cmd(*sw, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _cmd(*sw, "link", "set", f"v{i}", "master", "br0", "up")
            _cmd("ip", "-n", ns, "addr", "add", f"{self.subnet}.{i + 1}/24", "dev", "eth0")
            _cmd("ip", "-n", ns, "link", "set", "eth0", "up")
            _cmd("ip", "-n", ns, "link", "set", "lo", "up")
            self.reshape(i, self.shape)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        previous = self._previous_sigterm
        self.close()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def close(self) -> None:
        """Kill every process of the bed and delete every namespace it made. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        for host in list(self._procs):
            self._stop(host)
        for name in sorted(self.owned(), key=lambda n: n.endswith("-sw")):
            delete_namespace(name)
        atexit.unregister(self.close)
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_sigterm)

    # ---- verbs -----------------------------------------------------------------------------------------------
    def _check(self, host: int) -> None:
        if not 0 <= host < self.num_hosts or host in self._removed:
            raise HostBedError(f"no host {host} in this bed (hosts 0..{self.num_hosts - 1}, removed {self._removed})")

    def run(self, host: int, argv: list[str], **popen: Any) -> subprocess.Popen:
        """Start argv inside the host's namespace, in a process group of its own."""
        self._check(host)
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], start_new_session=True,
                                **popen)
        self._procs.setdefault(host, []).append(proc)
        return proc

    def python(self, host: int, module: str, *args: str, **popen: Any) -> subprocess.Popen:
        """`python -m module args` inside the host, importing this kvfabric; stdout a pipe unless given."""
        src = str(Path(kvfabric.__file__).resolve().parents[1])
        env = dict(popen.pop("env", os.environ))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        popen.setdefault("stdout", subprocess.PIPE)
        return self.run(host, [sys.executable, "-m", module, *args], env=env, **popen)

    def reshape(self, host: int, shape: LinkShape) -> None:
        self._check(host)
        if shape.delay_ms and not self.is_netem:
            raise HostBedError(f"{shape}: delay needs the kernel's sch_netem qdisc, which this kernel lacks (rate is "
                               "shaped with tbf, loss with nftables)")
        if shape.loss_pct and not self.is_netem and shutil.which("nft") is None:
            raise HostBedError(f"{shape}: loss without the kernel's sch_netem needs nftables (`nft` not found: "
                               "install the nftables package)")
        ns = self.namespace(host)
        if self.is_netem:
            shape_qdisc(ns, "eth0", shape)
        else:
            shape_qdisc(ns, "eth0", LinkShape(shape.rate_mbit))
            if shape.loss_pct or host in self._lossy:  # made, replaced, or deleted at 0
                drop_input(ns, shape.loss_pct)
                # the switch's end then segments what it sends the host (GSO in software), so the rule drops
                # single frames as a lossy wire would, not 64 KB bursts of segments
                _cmd("ip", "-n", self.switch, "link", "set", f"v{host}", "gso_max_segs",
                     "1" if shape.loss_pct else str(GSO_MAX_SEGS))
            if shape.loss_pct:
                self._lossy.add(host)
            else:
                self._lossy.discard(host)
        shape_qdisc(self.switch, f"v{host}", LinkShape(shape.rate_mbit))

    def input_counts(self, host: int) -> tuple[int, int] | None:
        """(packets in, packets dropped) by the host's nftables loss rule since it was made; None without one."""
        self._check(host)
        return input_counts(self.namespace(host)) if host in self._lossy else None

    def partition(self, host: int) -> None:
        self._check(host)
        _cmd("ip", "-n", self.switch, "link", "set", f"v{host}", "down")

    def heal(self, host: int) -> None:
        self._check(host)
        _cmd("ip", "-n", self.switch, "link", "set", f"v{host}", "up")

    def cut(self, a: int, b: int) -> None:
        """Hosts a and b no longer reach each other (both still reach every other host): `mend` ends it."""
        self._check(a)
        self._check(b)
        if shutil.which("nft") is None:
            raise HostBedError("cutting two hosts apart needs nftables (`nft` not found: install the nftables package)")
        self._cuts.add((min(a, b), max(a, b)))
        drop_between(self.switch, [(self.address(x), self.address(y)) for x, y in sorted(self._cuts)])

    def mend(self, a: int, b: int) -> None:
        self._cuts.discard((min(a, b), max(a, b)))
        drop_between(self.switch, [(self.address(x), self.address(y)) for x, y in sorted(self._cuts)])

    def remove(self, host: int) -> None:
        """The host is gone: its processes killed, its namespace (and link) deleted."""
        self._check(host)
        self._stop(host)
        _cmd("ip", "-n", self.switch, "link", "del", f"v{host}", check=False)  # now: a namespace's end is async
        delete_namespace(self.namespace(host))
        self._removed.add(host)

    def _stop(self, host: int, grace_s: float = 2.0) -> None:
        procs = self._procs.pop(host, [])
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(5)
