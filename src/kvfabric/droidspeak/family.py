"""Model families in the key namespace, and the DroidSpeak chunk store (KV and hidden states of a sender model).

Contract
--------
* A :class:`FamilyMember` is what a model declares: its id, its family (``None``: it declares nothing), the
  fingerprint of its tokenizer and its KV layout. Two members *share* a namespace only when family, tokenizer and
  layout are all equal (:meth:`FamilyMember.shares_with`).
* :class:`DroidStore` is the chunk store of one model ``viewer`` looking at the chunks model ``owner`` stored in the
  family namespace (``hashing.family_namespace``): the owner's KV ``[L, 2, H, T, D]`` under kind ``"kv"`` and, on
  request, its hidden state ``[T, E]`` at the input of layer ``l`` under kind ``"hidden@l"``. Keys are computed from
  the *viewer's* family, tokenizer and layout, so a viewer of another family, tokenizer or layout computes other
  keys and finds nothing (and a chunk's header names its layout: a mismatch is a miss, never a wrong tensor). The
  viewer's native chunks (``CacheEngine(config, layout, model_id)``) are untouched.
* A hidden state is stored as an ordinary checked chunk: ``[T, E]`` viewed as ``[1, 2, 1, T, E/2]`` in the layout
  ``KVLayout(1, 1, E/2, hidden_dtype)``; a corrupt or truncated one is a miss like any chunk.
* Prompts are cached whole (``save_partial_chunk``): a hit covers the prompt or a chunk-aligned prefix of it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvfabric.cache.engine import CacheEngine
from kvfabric.config import Config
from kvfabric.kv.hashing import family_namespace
from kvfabric.kv.layout import KVLayout


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """16 hex digits naming a tokenizer's vocabulary and special tokens (equal vocabularies, equal fingerprints)."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    text = json.dumps([vocab, special], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class FamilyMember:
    model_id: str
    family: str | None  # None: the model declares no family and shares nothing
    tokenizer: str  # tokenizer_fingerprint
    layout: KVLayout

    def shares_with(self, other: FamilyMember) -> bool:
        return (self.family is not None and self.family == other.family and self.tokenizer == other.tokenizer
                and self.layout == other.layout)


def hidden_layout(hidden_size: int, dtype: str) -> KVLayout:
    """The chunk layout a hidden state [T, E] is stored in: [1, 2, 1, T, E/2]."""
    if hidden_size % 2:
        raise ValueError(f"hidden size must be even, got {hidden_size}")
    return KVLayout(1, 1, hidden_size // 2, dtype)


def hidden_as_chunk(hidden: torch.Tensor) -> torch.Tensor:
    """[T, E] -> [1, 2, 1, T, E/2] (a copy-free view when possible)."""
    num_tokens, size = hidden.shape
    return hidden.reshape(num_tokens, 2, size // 2).permute(1, 0, 2).unsqueeze(0).unsqueeze(2)


def chunk_as_hidden(chunk: torch.Tensor) -> torch.Tensor:
    """[1, 2, 1, T, E/2] -> [T, E]."""
    return chunk[0, :, 0].permute(1, 0, 2).reshape(chunk.shape[3], -1)


class DroidStore:
    """``viewer``'s view of the chunks ``owner`` stored in their family namespace (see module contract)."""

    def __init__(self, viewer: FamilyMember, owner: str, hidden_size: int, config: Config | None = None,
                 hidden_dtype: str = "float32") -> None:
        if viewer.family is None:
            raise ValueError(f"model {viewer.model_id!r} declares no family: it has no shared namespace")
        config = config or Config(chunk_size=256, tiers=("cpu",))
        self.config = dataclasses.replace(config, save_partial_chunk=True)
        self.viewer, self.owner = viewer, owner
        self.hidden_layout = hidden_layout(hidden_size, hidden_dtype)
        self.kv = CacheEngine(self.config, viewer.layout, self._namespace("kv"))
        self._hidden: dict[int, CacheEngine] = {}

    def _namespace(self, kind: str) -> str:
        # the KV layout is named in every kind: a hidden-state chunk (a layout of its own) is shared only by
        # models whose KV layouts match too
        assert self.viewer.family is not None
        return family_namespace(self.viewer.family, self.viewer.tokenizer, self.owner,
                                f"{kind}/{self.viewer.layout.fingerprint.hex()}")

    def hidden(self, layer: int) -> CacheEngine:
        """The engine of the owner's hidden states at the input of ``layer``."""
        if layer not in self._hidden:
            self._hidden[layer] = CacheEngine(self.config, self.hidden_layout, self._namespace(f"hidden@{layer}"))
        return self._hidden[layer]

    def store(self, tokens: Sequence[int], kv: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        """The owner stores its KV [L, 2, H, T, D] and hidden states {layer: [T, E]} of ``tokens``."""
        if self.viewer.model_id != self.owner:
            raise ValueError(f"{self.viewer.model_id!r} cannot store chunks as {self.owner!r}")
        self.kv.store(tokens, kv.to(self.viewer.layout.torch_dtype))
        for layer, h in hidden.items():
            self.hidden(layer).store(tokens, hidden_as_chunk(h.to(self.hidden_layout.torch_dtype)))

    def load_hidden(self, tokens: Sequence[int], layer: int, out: torch.Tensor) -> bool:
        """Fill ``out`` [T, E] with the owner's hidden state at ``layer``; False (out undefined) on any miss."""
        chunk = self.hidden(layer).retrieve(tokens)
        if chunk.shape[3] != len(tokens):
            return False
        out.copy_(chunk_as_hidden(chunk))
        return True

    def load_kv(self, tokens: Sequence[int], out: torch.Tensor) -> bool:
        """Fill ``out`` [L, 2, H, >= T, D] with the owner's KV of ``tokens``; False on any miss."""
        return self.kv.retrieve(tokens, out=out).shape[3] == len(tokens)

    def fetched_bytes(self, num_tokens: int, with_hidden: bool) -> int:
        """Bytes a load of ``num_tokens`` tokens reads (KV, plus one hidden state when asked)."""
        extra = self.hidden_layout.num_bytes(num_tokens) if with_hidden else 0
        return self.viewer.layout.num_bytes(num_tokens) + extra

    def close(self) -> None:
        self.kv.close()
        for engine in self._hidden.values():
            engine.close()

    def __enter__(self) -> DroidStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
