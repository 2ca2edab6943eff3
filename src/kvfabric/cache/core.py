"""The in-process engine's shared state and the steps every part of it takes (kvfabric.cache.engine composes the
parts: lookups, writes, the retrieve read-ahead, chunk reads).

Contract:
- `EngineCore` holds what the parts share: layout, chunk size, the chunk shape (kvfabric.kv.shapes), the tier stack,
  decoders, counters and histograms. It is made once per engine; its fields never change.
- `drop(key, tier, exc, is_damaged)` is the one "log, discard, count, answer a miss" step: a chunk that fails its checks above
  the stack is removed from every tier and counted (`corrupt.<tier>`, `discarded`); the miss names why.
- `decode(key, hit, out, layout)` decodes a checked stack hit into out (or, without out, gives its KV as a view of
  the blob for a raw payload); a chunk that does not decode is dropped.
- `meta(i, n, start, end)` is what the tiers' policies learn of chunk i of a prompt of n chunks.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from kvfabric.cache.sources import ChunkMiss
from kvfabric.codec.base import Decoders, WrongLayoutError
from kvfabric.codec.format import ChunkFormatError, check_payload
from kvfabric.codec.registry import CODECS
from kvfabric.config import Config
from kvfabric.host.pages import Scratch
from kvfabric.kv.layout import KVLayout
from kvfabric.kv.shapes import ChunkShape
from kvfabric.observe.counters import Counters
from kvfabric.observe.metrics import Histograms
from kvfabric.tiers.policies import AccessMeta, prefill_cost_s
from kvfabric.tiers.stack import StackHit, TierStack

log = logging.getLogger("kvfabric.cache.engine")

MISSING = ChunkMiss("missing")
_CODEC_NAMES = {entry.codec_id: entry.name for entry in CODECS}


@dataclass(frozen=True, slots=True)
class EngineCore:
    config: Config
    layout: KVLayout
    shape: ChunkShape
    stack: TierStack
    counters: Counters = field(default_factory=Counters)
    histograms: Histograms = field(default_factory=Histograms)
    decoders: Decoders = field(default_factory=Decoders)
    local: threading.local = field(default_factory=threading.local)  # per thread: its read buffers

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    def span(self, i: int, num_tokens: int) -> tuple[int, int]:
        """Tokens [start, end) of chunk i of a prompt of num_tokens."""
        return i * self.chunk_size, min((i + 1) * self.chunk_size, num_tokens)

    @staticmethod
    def meta(i: int, num_chunks: int, start: int, end: int) -> AccessMeta:
        """What the tiers' policies learn about chunk i (tokens [start, end)) of a prompt of num_chunks chunks."""
        return AccessMeta(i, num_chunks, end - start, prefill_cost_s(start, end))

    def scratch(self) -> Scratch:
        """This thread's read buffer, for a read whose caller gives none (reused by its next such read)."""
        own = getattr(self.local, "scratch", None)
        if own is None:
            own = self.local.scratch = Scratch()
        return own

    def drop(self, key: bytes, tier: str, exc: Exception | str, is_damaged: bool = False) -> ChunkMiss:
        """`is_damaged`: its payload failed its checksum (also counted as `corrupt.<tier>`); else it did not decode."""
        log.warning("dropping %s chunk %s from tier %s: %s", "damaged" if is_damaged else "undecodable",
                    key.hex()[:16], tier, exc)
        self.stack.discard(key, damaged_in=tier if is_damaged else None)
        return ChunkMiss("wrong_layout" if isinstance(exc, WrongLayoutError) else "corrupt")

    def checked(self, key: bytes, found: StackHit) -> StackHit | ChunkMiss:
        """found, its payload verified now where the read left that for later; a miss (dropped) when it fails. A
        view of shared memory that fails while a writer is reusing it was not damaged: a torn read."""
        if found.is_verified:
            return found
        try:
            check_payload(found.blob, found.header)
        except ChunkFormatError as exc:
            if found.view is not None and not found.view.is_current():
                self.counters.add("torn_reads")
                return ChunkMiss("torn")
            return self.drop(key, found.tier, exc, is_damaged=True)
        return found

    def decode(self, key: bytes, found: StackHit, num_tokens: int, out: torch.Tensor | None,
               layout: KVLayout | None = None) -> torch.Tensor | ChunkMiss:
        """The checked hit's KV in `layout` (default the engine's): decoded into out, or without out a view of a raw
        payload (valid while the blob is) or a new tensor. A chunk that does not decode is dropped."""
        layout = layout or self.layout
        started = time.perf_counter()
        try:
            if out is None:
                kv = self.decoders.view(found.header, found.blob, layout, num_tokens)
            else:
                self.decoders.decode(found.header, found.blob, layout, out)
                kv = out
        except ChunkFormatError as exc:
            return self.drop(key, found.tier, exc)
        self.histograms.observe("kvfabric_codec_decode_seconds", time.perf_counter() - started,
                                _CODEC_NAMES.get(found.header.codec_id, str(found.header.codec_id)))
        return kv
