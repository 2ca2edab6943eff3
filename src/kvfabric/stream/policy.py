"""Per-chunk choice of how to send a prompt's KV: raw, a cachegen level, or tokens to recompute.

`AdaptivePolicy` (CacheGen's streaming adaptation): before chunk i it knows the time left to the TTFT target
(less `finish_s`, the first decode step, times `headroom`) and the link throughput measured on the chunks
already sent (bytes over seconds of sending, which includes any back-pressure from a receiver that decodes
slower than the link). It picks the highest-quality option whose bytes for *all* remaining chunks would still
arrive in time; when even the most compressed level would miss, the chunk goes as tokens, provided the
receiver's recompute queue (chunks already chosen for recompute, at `recompute_s` each; recompute overlaps the
transfer of later chunks) still fits in the time left, or recomputing a chunk is faster than sending it;
otherwise the most compressed level is sent (the fastest way left). Before any measurement, `initial_bps` is
the estimate (None: the first chunk goes at the middle option and is measured).

`FixedPolicy(option)`: every chunk the same way (the raw-transfer and full-recompute baselines).
"""
from __future__ import annotations

from dataclasses import dataclass, field

RAW = "raw"
RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Option:
    """How one chunk is sent: name "raw", "L<level>" (cachegen) or "recompute"."""

    name: str

    @property
    def level(self) -> int | None:
        return int(self.name[1:]) if self.name.startswith("L") else None


@dataclass
class Choice:
    option: str
    estimate_bps: float | None
    time_left_s: float


@dataclass
class AdaptivePolicy:
    ttft_target_s: float
    options: list[str]  # by decreasing quality, e.g. ["raw", "L3", "L5", "L7", "L9"]
    recompute_s: float = float("inf")  # receiver's time to recompute one chunk
    finish_s: float = 0.0  # reserved after the last chunk (the first decode step)
    initial_bps: float | None = None
    window: int = 4  # chunks in the throughput estimate
    headroom: float = 0.9  # plan to use this share of the time left (estimates and decode jitter)
    _sent: list[tuple[int, float]] = field(default_factory=list)
    _recompute_queue_s: float = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        self._sent.append((nbytes, max(seconds, 1e-6)))

    def estimate_bps(self) -> float | None:
        recent = self._sent[-self.window:]
        if not recent:
            return self.initial_bps
        return sum(b for b, _ in recent) / sum(s for _, s in recent)

    def choose(self, remaining_sizes: dict[str, list[int]], elapsed_s: float) -> Choice:
        """remaining_sizes[option] = wire bytes of chunks i, i+1, ... at that option."""
        left = (self.ttft_target_s - self.finish_s - elapsed_s) * self.headroom
        bps = self.estimate_bps()
        if bps is None:  # no estimate yet: the middle of the options
            pick = self.options[len(self.options) // 2]
            return Choice(pick, None, left)
        for name in self.options:
            if sum(remaining_sizes[name]) / bps <= left:
                return Choice(name, bps, left)
        smallest = self.options[-1]
        if self._recompute_queue_s + self.recompute_s <= left or \
                self.recompute_s < remaining_sizes[smallest][0] / bps:
            self._recompute_queue_s += self.recompute_s
            return Choice(RECOMPUTE, bps, left)
        return Choice(smallest, bps, left)


@dataclass
class FixedPolicy:
    option: str

    def observe(self, nbytes: int, seconds: float) -> None:
        return None

    def choose(self, remaining_sizes: dict[str, list[int]], elapsed_s: float) -> Choice:
        return Choice(self.option, None, 0.0)
