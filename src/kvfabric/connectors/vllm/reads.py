"""Chunk reads for the worker's loads: key -> verified KV tensor [L, 2, H, C, D], held until the step ends.

Contract:
- `read(key, stats)` returns the chunk's KV, or None for a counted miss: missing (``load_missing_chunks``), or
  damaged (``load_corrupt_chunks``, and the chunk is removed from every tier). Nothing here raises for a bad
  cache entry, and nothing can crash the process: files are read with plain reads into process memory (a
  memory-mapped chunk file truncated by another process would raise SIGBUS on access instead).
- Verification is the tier stack's: blobs from untrusted tiers (disk, shm, redis) have their checksums checked
  there, and a damaged blob is deleted and the next tier tried. Here: the header must match this layout.
- Raw-codec chunks in the layout's dtype are returned as zero-copy views of the blob (the scatter copies each
  layer once, straight into the paged cache); other codecs are decoded into a fresh tensor.
- Buffers: a chunk read from the first tier (when that tier supports ``get_into``, e.g. disk or shm first) lands
  in a reusable ``Scratch`` buffer instead of a fresh allocation (fresh large allocations cost page faults at
  ~1 GB/s on small machines). Every chunk of a step is held until its last layer is scattered, so each held
  chunk gets its own buffer: the pool grows to the most chunks loaded in one step and is reused from
  `new_step()` on, which the worker calls only once the previous step's views are dropped. Chunks served from a
  slower tier come back in a fresh buffer (the stack promotes them, so they must outlive the step).
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger

from kvfabric.codec.format import ChunkFormatError
from kvfabric.codec.raw import RawCodec, payload_view
from kvfabric.counters import Counters
from kvfabric.engine import CacheEngine
from kvfabric.tiers.base import Scratch

logger = init_logger(__name__)


class ChunkReader:
    def __init__(self, engine: CacheEngine, counters: Counters) -> None:
        self.engine = engine
        self.layout = engine.layout
        self.chunk_size = engine.chunk_size
        self.counters = counters  # the worker's connector counters
        self._pool: list[Scratch] = []  # pool[i]: the buffer of the i-th chunk held in the current step
        self._held = 0

    def new_step(self) -> None:
        """The views handed out so far are no longer used: their buffers may be read into again."""
        self._held = 0

    def read(self, key: bytes, stats: dict[str, Any]) -> torch.Tensor | None:
        """The chunk's KV [L, 2, H, C, D], or None (a counted miss); adds the bytes read to stats["bytes"]."""
        layout, cs = self.layout, self.chunk_size
        if self._held == len(self._pool):
            self._pool.append(Scratch())  # empty until a tier reads into it
        # checksums verified for untrusted tiers; a bad blob is deleted
        found = self.engine.stack.get(key, self._pool[self._held])
        if found is None:
            self.counters.add("load_missing_chunks")
            return None
        blob, header, tier = found.blob, found.header, found.tier
        try:
            if header.fingerprint != layout.fingerprint or header.shape != layout.shape(cs):
                raise ChunkFormatError(f"chunk made for another layout {header.shape}")
            if (header.codec_id == RawCodec.codec_id and header.dtype_code == layout.dtype_code
                    and header.payload_len == layout.num_bytes(cs)):
                kv = payload_view(blob, layout.torch_dtype, header.shape)  # zero copy: scattered per layer
                self._held += 1  # the view may live in this buffer: the next chunk takes the next one
            else:
                kv = torch.empty(layout.shape(cs), dtype=layout.torch_dtype)
                self.engine.decoders[header.codec_id].decode(header, memoryview(blob), layout, kv)
        except ChunkFormatError as exc:
            logger.warning("kvfabric: dropping undecodable chunk %s: %s", key.hex()[:16], exc)
            self.engine.stack.discard(key)
            self.counters.add("load_corrupt_chunks")
            return None
        by_tier = stats.setdefault("bytes", {})
        by_tier[tier] = by_tier.get(tier, 0) + len(blob)
        self.counters.add(f"bytes_loaded.{tier}", len(blob))
        return kv
