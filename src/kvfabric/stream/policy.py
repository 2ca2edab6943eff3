"""Per-chunk choice of how to send a prompt's KV: raw, a cachegen level, a video level, or tokens to recompute.

`AdaptivePolicy` (CacheGen's streaming adaptation): before chunk i it knows the time left to the TTFT target
(less `finish_s`, the first decode step, times `headroom`) and the link throughput measured on the chunks
already sent (bytes over seconds of sending, which includes any back-pressure from a receiver that decodes
slower than the link). It picks the highest-quality option whose bytes for *all* remaining chunks would still
arrive in time; when even the most compressed level would miss, the chunk goes as tokens, provided the
receiver's recompute queue (chunks already chosen for recompute, at `recompute_s` each; recompute overlaps the
transfer of later chunks) still fits in the time left, or recomputing a chunk is faster than sending it;
otherwise the most compressed level is sent (the fastest way left). Before any measurement, `initial_bps` is
the estimate (None: the first chunk goes at the middle option and is measured).

`ResolutionPolicy` (KVFetcher's resolution adaptation, for fluctuating links): before each chunk, among the options
the caller allows (the quality floor: e.g. raw and the video levels whose top-1 agreement is >= 99 %) and
recompute, the one with which the prompt's remaining chunks are predicted to be in the receiver's buffer soonest.
The link's rate is the previous chunk's alone (on a link whose rate jumps, older measurements describe another
link), with the risk of a jump during the send priced in (`send_s`); the receiver's work is each option's measured decode time (recompute: `recompute_s`), queued behind the
work already sent, since the receiver has one worker that decodes while later chunks are on the wire. The chunks
after this one are planned as the best mix of two options (`plan_s`), so the choice weighs what an option costs
the link against what it costs the worker: a slow link gets the smallest frames; a fast one, where decoding is the
bottleneck, gets cheap-to-decode chunks (raw) in between, which keeps both busy. The decode times (`WorkCosts`)
start as measured alone and follow what the receiver reports (`observe_work`): a decoder that shares its cores with
the receiving thread costs more than alone, and the policy must see that to know when raw is the faster way. A
sender keeps one WorkCosts per receiver across its streams.

`FixedPolicy(option)`: every chunk the same way (the raw-transfer and full-recompute baselines, fixed levels).
"""
from __future__ import annotations

import time
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

    def observe_work(self, option: str, seconds: float) -> None:
        return None  # the time budget is the link's: the receiver's reports are not used

    def estimate_bps(self) -> float | None:
        recent = self._sent[-self.window:]
        if not recent:
            return self.initial_bps
        return sum(b for b, _ in recent) / sum(s for _, s in recent)

    def choose(self, remaining_sizes: dict[str, list[int]], elapsed_s: float, queued_bytes: int = 0) -> Choice:
        """remaining_sizes[option] = wire bytes of chunks i, i+1, ... at that option (queued_bytes: not used)."""
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
class WorkCosts:
    """Seconds one chunk of each option costs a receiver's worker. Starts from `alone_s` (measured with nothing
    else running: prepare(time_decode=True)); each report moves the option's cost `weight` of the way toward it,
    so one slow chunk does not flip a policy and a steady change does within a few. An option not reported yet
    costs its alone time times the receiver's slowdown seen so far (reports over alone times, over every option):
    otherwise the options a policy avoids would look cheap only because the ones it used were measured under load."""

    alone_s: dict[str, float]
    weight: float = 0.25
    _learned: dict[str, float] = field(default_factory=dict)
    _slowdown: float = 1.0

    def observe(self, option: str, seconds: float) -> None:
        alone = self.alone_s.get(option, 0.0)
        if alone > 0:
            self._slowdown += self.weight * (seconds / alone - self._slowdown)
        old = self._learned.get(option, seconds)
        self._learned[option] = old + self.weight * (seconds - old)

    def get(self, option: str) -> float:
        if option in self._learned:
            return self._learned[option]
        return self.alone_s.get(option, 0.0) * self._slowdown


@dataclass
class ResolutionPolicy:
    options: list[str]  # the allowed options by decreasing quality, e.g. ["raw", "V0", "V5", "V7"]
    decode_s: WorkCosts | dict[str, float]  # the receiver's costs, or seconds per chunk measured alone (its prior)
    recompute_s: float = float("inf")  # receiver's seconds to recompute one chunk (it shares the decode worker)
    initial_bps: float | None = None
    window_s: float = 10.0  # how far back the link's rate changes are counted
    _last_bps: float | None = None
    _rates: list[tuple[float, float]] = field(default_factory=list)  # (perf_counter, bytes/s) of recent chunks
    _decoder_free: float = 0.0  # predicted perf_counter time at which the receiver's worker is idle again
    _pending: tuple[str, float] | None = None  # (option, decode seconds) chosen, not yet observed

    def observe(self, nbytes: int, seconds: float) -> None:
        """The chunk just sent took `seconds` on the wire: the link's rate now, and the worker's new backlog."""
        now = time.perf_counter()
        self._last_bps = nbytes / max(seconds, 1e-6)
        self._rates = [(t, r) for t, r in self._rates if t >= now - self.window_s] + [(now, self._last_bps)]
        if self._pending is not None:
            self._decoder_free = max(time.perf_counter(), self._decoder_free) + self._pending[1]
            self._pending = None

    def __post_init__(self) -> None:
        if not isinstance(self.decode_s, WorkCosts):
            self.decode_s = WorkCosts(dict(self.decode_s))

    @property
    def costs(self) -> WorkCosts:
        assert isinstance(self.decode_s, WorkCosts)  # __post_init__
        return self.decode_s

    def observe_work(self, option: str, seconds: float) -> None:
        """The receiver reports that a chunk sent as `option` took its worker `seconds` (recompute: its own cost,
        a forward on every core, not a decode)."""
        if option != RECOMPUTE:
            self.costs.observe(option, seconds)
        elif self.recompute_s == float("inf"):
            self.recompute_s = seconds
        else:
            self.recompute_s += self.costs.weight * (seconds - self.recompute_s)

    def estimate_bps(self) -> float | None:
        return self._last_bps if self._last_bps is not None else self.initial_bps

    def send_s(self, nbytes: int, bps: float) -> float:
        """Expected seconds on the link: at the last chunk's rate, unless the rate jumps meanwhile. Jumps (4x or
        more between consecutive chunks) seen over the last `window_s` give a rate per second; a jump during
        the send is costed at the slowest rate of that window. A big chunk sent just before the link slows down
        costs more than its frames would have: on a jumpy link, that risk is part of its price."""
        t = nbytes / bps
        rates = self._rates
        span = rates[-1][0] - rates[0][0] if len(rates) > 1 else 0.0
        jumps = sum(max(a, b) >= 4 * min(a, b) for (_, a), (_, b) in zip(rates, rates[1:]))
        if not jumps or span <= 0:
            return t
        p = min(1.0, jumps / span * t)
        return (1 - p) * t + p * max(t, nbytes / min(r for _, r in rates))

    def choose(self, remaining_sizes: dict[str, list[int]], elapsed_s: float, queued_bytes: int = 0) -> Choice:
        """remaining_sizes[option] = wire bytes of chunks i, i+1, ... at that option; queued_bytes: what the
        sender's socket still holds of the chunks already sent (the link is busy with them first)."""
        bps = self.estimate_bps()
        if bps is None:  # nothing measured yet: the middle of the options
            pick = self.options[len(self.options) // 2]
            self._pending = (pick, self.costs.get(pick))
            return Choice(pick, None, 0.0)
        now = time.perf_counter()
        # per option: (seconds on the link, seconds of the receiver's worker) for one chunk like this one
        cost = {o: (self.send_s(remaining_sizes[o][0], bps), self.costs.get(o)) for o in self.options}
        if self.recompute_s < float("inf"):
            cost[RECOMPUTE] = (self.send_s(remaining_sizes[RECOMPUTE][0], bps), self.recompute_s)
        later = len(remaining_sizes[self.options[0]]) - 1
        score = {}
        backlog_s = queued_bytes / bps
        for o, (send, work) in cost.items():
            link_free = now + backlog_s + send
            done = max(link_free, self._decoder_free) + work  # this chunk in the buffer
            score[o] = (plan_s(link_free, done, later, list(cost.values())), done)
        pick = min(score, key=score.__getitem__)  # full ties: the first listed, i.e. the higher quality
        if pick == RECOMPUTE:  # not observed by the sender (tokens are tiny): book the worker's time now
            self._decoder_free = max(now, self._decoder_free) + self.recompute_s
        else:
            self._pending = (pick, self.costs.get(pick))
        return Choice(pick, bps, score[pick][1] - now)


def plan_s(link_free: float, worker_free: float, chunks: int, costs: list[tuple[float, float]]) -> float:
    """When `chunks` more chunks could all be in the buffer, link and worker free at the given times, each chunk
    sent as the best mix of at most two options of `costs` ((link s, worker s) a chunk): the fluid bound
    max(link_free + chunks * link, worker_free + chunks * work), minimised over the mixes (two resources: an
    optimal mix never needs a third option)."""
    if chunks <= 0:
        return worker_free
    best = float("inf")
    for i, (la, wa) in enumerate(costs):
        for lb, wb in costs[i:]:
            fractions = [0.0, 1.0]
            slope = (la - lb) - (wa - wb)  # where the two bounds cross: link(f) = work(f)
            if slope:
                fractions.append(min(1.0, max(0.0, ((worker_free - link_free) / chunks + wb - lb) / slope)))
            for f in fractions:
                best = min(best, max(link_free + chunks * (f * la + (1 - f) * lb),
                                     worker_free + chunks * (f * wa + (1 - f) * wb)))
    return best


@dataclass
class FixedPolicy:
    option: str

    def observe(self, nbytes: int, seconds: float) -> None:
        return None

    def observe_work(self, option: str, seconds: float) -> None:
        return None

    def choose(self, remaining_sizes: dict[str, list[int]], elapsed_s: float, queued_bytes: int = 0) -> Choice:
        return Choice(self.option, None, 0.0)
