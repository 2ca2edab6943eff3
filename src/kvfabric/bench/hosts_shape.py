"""Shaping one end of a test-bed link (kvfabric.bench.hosts): the shape, its qdisc and its loss rule.

Contract:
- `LinkShape(rate_mbit, delay_ms, loss_pct)`, frozen: validated on creation (ValueError).
- `shape_qdisc(ns, dev, shape)` replaces dev's root qdisc in namespace ns: netem (delay, loss, rate) where the shape
  needs netem, tbf (rate) where it has a rate only, none otherwise.
- `drop_input(ns, loss_pct)` replaces, in one nftables transaction, the namespace's table `inet kvf`: a rule on the
  input hook dropping loss_pct % (in millionths, `numgen random`) of what arrives on eth0, with counters
  (`input_counts(ns)`: packets in, packets dropped); at 0 the table is deleted.
  It is how the bed shapes loss where the kernel has no sch_netem (nftables reaches the input path of a namespace;
  `tc` without netem cannot drop at random).
- `drop_between(switch_ns, pairs)` replaces, in one transaction, the switch namespace's table `bridge kvfcut`: IPv4
  packets the bridge forwards between the two addresses of each pair are dropped, both ways (a firewall between
  two hosts: each still reaches every other host); with no pair the table is deleted.
- `cmd(*argv)` runs a command, its stdout returned; a failure raises HostBedError with a one-line message.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass


class HostBedError(RuntimeError):
    """The bed cannot be made or used here (no root, no iproute2, no sch_netem or nft, a command refused)."""


@dataclass(frozen=True, slots=True)
class LinkShape:
    rate_mbit: float = 0.0  # 0: not rate-limited
    delay_ms: float = 0.0  # one way, on what the host sends (needs sch_netem)
    loss_pct: float = 0.0  # of what the host sends (netem), or receives (nftables, where the kernel lacks netem)

    def __post_init__(self) -> None:
        if self.rate_mbit < 0 or self.delay_ms < 0 or not 0 <= self.loss_pct <= 100:
            raise ValueError(f"bad link shape {self}: rate and delay >= 0, loss in [0, 100]")

    @property
    def is_netem(self) -> bool:
        return self.delay_ms > 0 or self.loss_pct > 0


def cmd(*argv: str, check: bool = True, stdin: str | None = None) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, input=stdin)
    if check and proc.returncode:
        why = "; ".join(line.strip() for line in proc.stderr.splitlines() if line.strip()) or proc.returncode
        raise HostBedError(f"`{' '.join(argv)}` failed: {why}")
    return proc.stdout


def shape_qdisc(ns: str, dev: str, shape: LinkShape) -> None:
    """Replace the root qdisc of dev: netem (delay, loss, rate) or tbf (rate), or none."""
    tc = ("tc", "-n", ns, "qdisc")
    if shape.is_netem:
        rate = ("rate", f"{shape.rate_mbit}mbit") if shape.rate_mbit else ()
        cmd(*tc, "replace", "dev", dev, "root", "netem", "delay", f"{shape.delay_ms}ms", "loss",
            f"{shape.loss_pct}%", *rate, "limit", "100000")
    elif shape.rate_mbit:
        burst = max(64 << 10, int(shape.rate_mbit * 1e6 / 8 / 1000))  # 1 ms at the rate, at least 64 KiB
        cmd(*tc, "replace", "dev", dev, "root", "tbf", "rate", f"{shape.rate_mbit}mbit", "burst", str(burst),
            "latency", "20ms")
    else:
        cmd(*tc, "del", "dev", dev, "root", check=False)


def drop_input(ns: str, loss_pct: float) -> None:
    """Replace the namespace's nftables table `inet kvf` (one transaction): drop loss_pct % of what arrives on
    eth0 (numgen random, in millionths); at 0 the table is deleted."""
    script = "table inet kvf\ndelete table inet kvf\n"  # made if absent, so the delete never fails
    if loss_pct:
        script += ("table inet kvf {\n chain inp {\n  type filter hook input priority 0; policy accept;\n"
                   '  iifname "eth0" counter\n'  # every packet in (the first rule's counter)
                   f'  iifname "eth0" numgen random mod 1000000 < {round(loss_pct * 10_000)} counter drop\n'
                   " }\n}\n")
    cmd("ip", "netns", "exec", ns, "nft", "-f", "-", stdin=script)


def drop_between(switch_ns: str, pairs: list[tuple[str, str]]) -> None:
    """Replace the switch's table `bridge kvfcut` (one transaction): drop what is bridged between each pair."""
    script = "table bridge kvfcut\ndelete table bridge kvfcut\n"  # made if absent, so the delete never fails
    if pairs:
        rules = "".join(f"  ip saddr {a} ip daddr {b} drop\n  ip saddr {b} ip daddr {a} drop\n" for a, b in pairs)
        script += ("table bridge kvfcut {\n chain cut {\n  type filter hook forward priority 0; policy accept;\n"
                   + rules + " }\n}\n")
    cmd("ip", "netns", "exec", switch_ns, "nft", "-f", "-", stdin=script)


def input_counts(ns: str) -> tuple[int, int]:
    """(packets that arrived on eth0, packets dropped) since drop_input last made the namespace's rule."""
    table = json.loads(cmd("ip", "netns", "exec", ns, "nft", "-j", "list", "table", "inet", "kvf"))
    counts = [e["counter"]["packets"] for item in table["nftables"] if "rule" in item
              for e in item["rule"]["expr"] if "counter" in e]
    return counts[0], counts[1]
