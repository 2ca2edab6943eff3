"""Values of the blend package: the modes, `BlendConfig` (how tokens are selected for recompute) and
`BlendResult` (the KV workspace and logits of one prefill, with what was done)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

Mode = Literal["blend", "reuse", "full"]
MODES = ("blend", "reuse", "full")
# a caller's own ranking at each check layer: (layer, positions of the reused tokens still active [r]) -> scores [r]
Ranker = Callable[[int, torch.Tensor], torch.Tensor]
SCORES = ("attn_v", "kv", "k", "v", "kv_norm")


@dataclass(frozen=True)
class BlendConfig:
    # share of the reused tokens recomputed per layer, averaged over all layers, a check layer counted with every
    # token it scores (the compute a setting is named by); the default is the first pass's "15 %" schedule
    recompute_frac: float = 0.255
    # layers where tokens are scored and the active set narrowed; spread out and ending deeper than CacheBlend's
    # (1..4): on SmolLM2 + MuSiQue this closed more of the KL gap at the same compute (bench blend; see
    # docs/design/measurements.md)
    check_layers: tuple[int, ...] = (2, 4, 6, 8)
    gradual: float = 2.0  # fraction kept at the first check layer = gradual * ratio, narrowing linearly to ratio
    # "attn_v": V deviation weighted by the attention the computed (query) tokens pay to the token; the KV
    # deviation alone ("kv": squared K and V differences; "k", "v", "kv_norm") ranks tokens nobody attends to
    score: str = "attn_v"
    gate_bound: float = 1e-2  # max relative K error of the re-rotation self-test
    self_test: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.recompute_frac <= 1.0:
            raise ValueError(f"recompute_frac must be in [0, 1], got {self.recompute_frac}")
        # layer 0 cannot be a check layer: its K/V depend on the token and its position only (nothing to detect)
        if not self.check_layers or list(self.check_layers) != sorted(set(self.check_layers)) or \
                self.check_layers[0] < 1:
            raise ValueError(f"check_layers must be increasing layer indices >= 1, got {self.check_layers}")
        if self.gradual < 1.0:
            raise ValueError(f"gradual must be >= 1, got {self.gradual}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")

    def fractions(self, ratio: float) -> list[float]:
        """Fraction of the reused tokens kept after each check layer, for a final per-layer ``ratio``."""
        k = len(self.check_layers)
        first = min(1.0, ratio * self.gradual)
        if k == 1:
            return [ratio]
        return [first + (ratio - first) * j / (k - 1) for j in range(k)]

    def layer_shares(self, ratio: float, num_layers: int) -> list[float]:
        """Share of the reused tokens each layer runs (every token up to the first check layer; a check layer
        counts the tokens it scores, before narrowing)."""
        keep = self.fractions(ratio)
        shares = []
        for layer in range(num_layers):
            done = sum(c < layer for c in self.check_layers)  # check layers passed before this one
            shares.append(1.0 if done == 0 else keep[done - 1])
        return shares

    def ratio_for(self, recompute_frac: float, num_layers: int) -> float:
        """The final per-layer ratio whose schedule recomputes ``recompute_frac`` of the reused token-layers."""
        if self.check_layers[-1] >= num_layers:
            raise ValueError(f"check layer {self.check_layers[-1]} >= {num_layers} layers")
        floor = (self.check_layers[0] + 1) / num_layers
        if not floor - 1e-9 <= recompute_frac <= 1.0:
            raise ValueError(f"recompute_frac must be in [{floor:.3f}, 1] with check layers {self.check_layers} "
                             f"(every token runs up to the first one), got {recompute_frac}")
        lo, hi = 0.0, 1.0
        for _ in range(50):  # the mean share grows monotonically with the ratio
            mid = (lo + hi) / 2
            if sum(self.layer_shares(mid, num_layers)) / num_layers < recompute_frac:
                lo = mid
            else:
                hi = mid
        return hi


@dataclass
class BlendResult:
    tokens: list[int]
    kv: torch.Tensor  # fp32 [L, 2, H, capacity, D]; slots [0, length) hold the prompt's KV
    length: int
    logits: torch.Tensor  # fp32 [length - logits_from, V]
    logits_from: int
    mode: str
    blended: bool  # cached KV was used (False: full prefill)
    reused_tokens: int
    ratio: float  # final per-layer share of the reused tokens recomputed (after the last check layer)
    tokens_per_layer: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    load_s: float = 0.0  # loader thread busy time (fetch + re-rotation), overlapped with compute
    load_wait_s: float = 0.0  # compute thread waiting for loads
    load_bytes: int = 0
    fallback: str = ""  # why a prefill fell back to full

    @property
    def recompute_frac(self) -> float:
        """Measured share of the reused tokens recomputed per layer, averaged over all layers (1.0: full prefill)."""
        if not self.blended or not self.tokens_per_layer:
            return 1.0
        fixed = self.length - self.reused_tokens
        return sum(t - fixed for t in self.tokens_per_layer) / (len(self.tokens_per_layer) * self.reused_tokens)

    @property
    def next_token(self) -> int:
        return int(torch.argmax(self.logits[-1]))
