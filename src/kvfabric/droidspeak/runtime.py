"""DroidSpeak runtime over the layer-by-layer runner: a sender prefill that keeps hidden states, and a receiver
prefill that reuses the sender's KV outside a contiguous block of layers and recomputes the block.

Contract
--------
* :func:`sender_prefill` (model A): KV ``[L, 2, H, n, D]`` of ``ids`` and A's hidden states ``{l: [n, E]}`` at the
  *input* of each layer in ``capture`` (layer 0's input is the embedding).
* :func:`recompute_block` (model B): given a workspace ``kv`` whose slots ``[0, n)`` hold A's KV and A's hidden
  state at the input of layer ``block.start`` (B's own embedding when ``block.start == 0``), run B's layers
  ``[start, stop)`` over all ``n`` tokens, overwriting exactly those layers' KV. Layers outside the block keep A's.
  An empty block changes nothing (a plain cache hit of A's KV); the block ``[0, L)`` is B's own prefill, bit for bit
  the same as the runner's forward.
* :func:`droid_prefill` is the receiver's whole prefill from a :class:`~kvfabric.droidspeak.family.DroidStore`: the
  loads of A's KV run on a thread while the block is recomputed (into a second workspace: the block never waits for
  a load, and the load never overwrites a recomputed layer), then the block's layers are copied over. Any miss (KV or
  hidden state) returns ``None``: the caller does a full prefill.
* :class:`Block` is a frozen ``[start, stop)`` layer range; ``Block(0, 0)`` is the empty block.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvfabric.blend.runner import LlamaRunner
from kvfabric.droidspeak.family import DroidStore


@dataclass(frozen=True, slots=True)
class Block:
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"a block is 0 <= start <= stop, got [{self.start}, {self.stop})")

    @property
    def num_layers(self) -> int:
        return self.stop - self.start

    @property
    def needs_hidden(self) -> bool:  # layer 0's input is the receiver's own embedding
        return self.num_layers > 0 and self.start > 0


@torch.inference_mode()
def sender_prefill(runner: LlamaRunner, ids: Sequence[int], capture: Iterable[int] = ()
                   ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """(KV [L, 2, H, n, D], {layer: hidden [n, E] at that layer's input}) of a prefill of ``ids``."""
    wanted = set(capture)
    n = len(ids)
    kv = runner.workspace(n)
    tokens = runner.tokens(torch.arange(n), n)
    hidden = runner.embed(torch.tensor(ids))
    captured: dict[int, torch.Tensor] = {}
    for l in range(runner.num_layers):
        if l in wanted:
            captured[l] = hidden[0].clone()
        hidden = runner.layer(l, hidden, kv, tokens)
    return kv, captured


@torch.inference_mode()
def recompute_block(runner: LlamaRunner, ids: Sequence[int], kv: torch.Tensor, block: Block,
                    hidden: torch.Tensor | None) -> None:
    """Overwrite layers [block.start, block.stop) of ``kv`` (slots [0, n)) with B's own KV (see contract)."""
    if block.num_layers == 0:
        return
    if block.stop > runner.num_layers:
        raise ValueError(f"block [{block.start}, {block.stop}) beyond the model's {runner.num_layers} layers")
    n = len(ids)
    tokens = runner.tokens(torch.arange(n), n)
    if block.start == 0:
        h = runner.embed(torch.tensor(ids))
    elif hidden is None:
        raise ValueError(f"block [{block.start}, {block.stop}) needs the sender's hidden state")
    else:
        h = hidden.to(runner.dtype).view(1, n, -1)
    for l in range(block.start, block.stop):
        h = runner.layer(l, h, kv, tokens)


def _load_kv(store: DroidStore, ids: Sequence[int], kv: torch.Tensor) -> bool:
    with torch.inference_mode():  # on the loader thread: kv is an inference tensor (inference mode is per thread)
        return store.load_kv(ids, kv)


@dataclass(frozen=True, slots=True)
class DroidPrefill:
    kv: torch.Tensor  # [L, 2, H, capacity, D]: slots [0, n) hold the mixed KV
    num_bytes: int  # bytes fetched (KV + hidden state)


@torch.inference_mode()
def droid_prefill(runner: LlamaRunner, store: DroidStore, ids: Sequence[int], block: Block, capacity: int,
                  loader: ThreadPoolExecutor) -> DroidPrefill | None:
    """The receiver's prefill of ``ids`` from the sender's chunks (see contract); None on any miss."""
    n = len(ids)
    kv = runner.workspace(capacity)
    hidden = None
    if block.needs_hidden:
        hidden = torch.empty(n, runner.config.hidden_size, dtype=runner.dtype)
        if not store.load_hidden(ids, block.start, hidden):
            return None
    loading = loader.submit(_load_kv, store, ids, kv)
    if block.num_layers:
        fresh = runner.workspace(n)
        recompute_block(runner, ids, fresh, block, hidden)
    if not loading.result():
        return None
    if block.num_layers:
        kv[block.start:block.stop, :, :, :n].copy_(fresh[block.start:block.stop])
    return DroidPrefill(kv, store.fetched_bytes(n, block.needs_hidden))
