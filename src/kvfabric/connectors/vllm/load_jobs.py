"""What a load is, on any device: a load's job (its chunks' spans, claims and failures), its outcome, and the
`Loads` protocol the worker side asks of its loaders (connectors.vllm.loads: the CPU backend's `Loader`;
connectors.vllm.device: `DeviceLoads`, GPU backends and MLA latents).

Contract:
- `LoadState(spec, chunk_size)` (a load's job): chunk i of the load holds `chunk_tokens(i)` tokens (a prompt's partial last chunk
  fewer) from its first token; `chunk_span(i)` is its part of the load's tokens. `first_bad` is the first chunk that
  failed: the load's `outcome` ends there, and the blocks from there to the load's end are `bad_blocks` (vLLM
  recomputes them).
- `Claims`: who loads which chunk of the started async loads (the policy: connectors.vllm.loads' module doc).
  Each call is made under the loader's lock.
- `LayeredStep`: one step's layer-wise loads, their chunks' sources (held open until every layer is placed) and an
  event per layer.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvfabric.cache.protocol import BlockSource, TokenSource
from kvfabric.connectors.paged import blocks_of
from kvfabric.connectors.vllm.metadata import LoadSpec, RequestStats
from kvfabric.observe.counters import Counters


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    req_id: str
    end: int  # tokens [spec.start, end) are in place
    bad_blocks: tuple[int, ...]  # blocks holding tokens [end, spec.end): to recompute
    stats: RequestStats


class Loads(Protocol):
    """What the worker side asks of its loads, on any device: this module's `Loader` (vLLM's CPU backend) and
    connectors.vllm.device's `DeviceLoads` (GPU backends, MLA latents). Each binds to the KV cache its own way."""
    counters: Counters

    def start_async(self, spec: LoadSpec) -> None: ...
    def set_forward(self, is_running: bool) -> None: ...
    def help(self, budget_s: float) -> int: ...
    def wait_finished(self, timeout: float) -> None: ...
    def take_finished(self) -> list[LoadOutcome]: ...
    def start_layered(self, specs: Sequence[LoadSpec]) -> None: ...
    def wait_layer(self, index: int) -> None: ...
    def finish_layered(self) -> list[LoadOutcome]: ...
    def stop(self) -> None: ...


@dataclass
class LoadState:
    spec: LoadSpec
    chunk_size: int
    started: float = field(default_factory=time.perf_counter)
    num_left: int = 0
    num_claimed: int = 0  # chunks [0, num_claimed) taken by a thread (`Claims`)
    first_bad: int | None = None  # index of the first chunk that failed
    by_tier: dict[str, int] = field(default_factory=dict)

    def chunk_span(self, i: int) -> tuple[int, int, int]:
        """(first token of chunk i, lo, hi): chunk i's part [lo, hi) of the load's tokens."""
        first = (self.spec.start // self.chunk_size + i) * self.chunk_size
        return first, max(self.spec.start, first), min(self.spec.end, first + self.chunk_size)

    def chunk_tokens(self, i: int) -> int:
        """Tokens chunk i holds: chunk_size, or fewer for a partial last chunk (it ends at the keys' end)."""
        first = (self.spec.start // self.chunk_size + i) * self.chunk_size
        end = self.spec.keys_end or first + self.chunk_size
        return max(1, min(self.chunk_size, end - first))

    def outcome(self, block_size: int) -> LoadOutcome:
        spec = self.spec
        end = spec.end if self.first_bad is None else self.chunk_span(self.first_bad)[1]
        bad = blocks_of(spec.block_ids, block_size, end, spec.end)
        stats = RequestStats(loaded_tokens=end - spec.start, failed_tokens=spec.end - end,
                             load_read_s=time.perf_counter() - self.started,
                             bytes_loaded=tuple(sorted(self.by_tier.items())))
        return LoadOutcome(spec.req_id, end, tuple(bad), stats)


class Claims:
    """The async loads with unclaimed chunks, oldest first; each load's chunks are claimed in order, one at a time.
    The worker's `help` (`me` None) and, on a step without a forward, every load thread claim; beside a forward only
    one load thread does (the leader: the first to claim), until it finds none left."""

    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self.active: list[LoadState] = []
        self.is_forward = False
        self.leader: int | None = None  # the leading load thread's ident

    def add(self, job: LoadState) -> None:
        self.active.append(job)

    def set_forward(self, is_running: bool) -> int:
        """This step's kind; the number of load threads to wake: those that stopped beside the forward that ended."""
        was_running, self.is_forward = self.is_forward, is_running
        return self.num_threads - 1 if was_running and not is_running and self.active else 0

    def pick(self, me: int | None) -> tuple[LoadState, int] | None:
        """(job, index of its chunk now this thread's to load), or None: the thread stops (a leader then leads no
        more: the decision and the hand-over are made together, so no chunk is left unclaimed)."""
        if not self.active or (me is not None and self.is_forward and self.leader not in (None, me)):
            if me is not None and self.leader == me:
                self.leader = None
            return None
        if me is not None and self.is_forward:
            self.leader = me
        job = self.active[0]
        job.num_claimed += 1
        if job.num_claimed == len(job.spec.keys):
            self.active.remove(job)
        return job, job.num_claimed - 1


class LayeredStep:
    """One step's synchronous loads, scattered layer by layer."""

    def __init__(self, jobs: list[LoadState], num_layers: int) -> None:
        self.jobs = jobs
        self.chunks: list[list[TokenSource | BlockSource]] = [[] for _ in jobs]  # per job: its good chunks
        self.layer_done = [threading.Event() for _ in range(num_layers)]
        self.done = threading.Event()
