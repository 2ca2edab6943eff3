"""Loading controller: pick the recompute ratio from the measured load speed of the tier.

Loading layer i+1 overlaps computing layer i, so a layer costs about max(load, recompute). Recomputing more tokens
is free while it takes no longer than the load; the controller picks the ratio that makes the two equal:

    load_s      = bytes_per_layer / load_bandwidth
    compute_s   = (fixed_tokens + ratio * reused_tokens) / tokens_per_s_per_layer
    ratio       = clamp((load_s * tokens_per_s_per_layer - fixed_tokens) / reused_tokens, min_ratio, max_ratio)

so slow tiers (disk, network) get more recompute (better quality at no latency cost) and fast ones less, never
below ``min_ratio`` (the quality floor) nor above ``max_ratio``. Measurements are exponential moving averages
of what the blender observes (``observe_load``, ``observe_compute``); before the first of each, ``default`` is used.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class LoadController:
    min_ratio: float = 0.15
    max_ratio: float = 0.5
    default: float = 0.15
    smoothing: float = 0.5  # weight of a new measurement in the moving averages
    load_bytes_per_s: float | None = None
    tokens_per_s_per_layer: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_ratio <= self.max_ratio <= 1.0:
            raise ValueError(f"need 0 <= min_ratio <= max_ratio <= 1, got {self.min_ratio}, {self.max_ratio}")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        self.default = min(max(self.default, self.min_ratio), self.max_ratio)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe_load(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            with self._lock:
                self.load_bytes_per_s = self._ema(self.load_bytes_per_s, num_bytes / seconds)

    def observe_compute(self, token_layers: int, seconds: float) -> None:
        """``token_layers`` = sum over recomputed layers of the tokens run in them, in ``seconds``."""
        if token_layers > 0 and seconds > 0:
            with self._lock:
                self.tokens_per_s_per_layer = self._ema(self.tokens_per_s_per_layer, token_layers / seconds)

    def choose(self, reused_tokens: int, bytes_per_layer: int, fixed_tokens: int = 0) -> float:
        """The recompute ratio for a prompt with ``reused_tokens`` cached tokens (``bytes_per_layer`` of KV to load
        per layer) and ``fixed_tokens`` always computed (suffix, uncached text)."""
        with self._lock:
            bw, thr = self.load_bytes_per_s, self.tokens_per_s_per_layer
        if reused_tokens <= 0:
            return self.default
        if bw is None or thr is None:
            return self.default
        load_s = bytes_per_layer / bw
        ratio = (load_s * thr - fixed_tokens) / reused_tokens
        return min(max(ratio, self.min_ratio), self.max_ratio)
