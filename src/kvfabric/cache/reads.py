"""Chunk reads by key (CacheEngine's `read_into`, `read_chunk`, `open_chunk`, `read_many`): each gives verified KV or a
miss (kvfabric.cache.sources), whatever the tier and the chunk's shape.

Contract:
- `read_into(key, out)`: the whole chunk decoded into out [L, 2, H, T, D] (any float dtype), every part of it.
- `read_chunk(key, num_tokens, blocks=, layers=, scratch=)`: verified before it returns. A chunk stored in the
  caller's block layout `blocks` (raw codec) is a `BlockSource` over its payload as it is; any other is a
  `TokenSource` (a raw payload viewed where it was read, any other codec decoded). With `layers`, a split chunk
  is read only in the parts holding them (the source's `layers` say which it holds).
- `open_chunk(...)`: the same answer, with the cache's fastest read of each tier. A chunk in shared memory is
  viewed where it lies and re-checked at exit; a block-layout chunk from a disk file is read layer by layer into
  `scratch`; a block-layout payload from an untrusted tier is hashed slab by slab as the caller copies it and
  checked at exit. No pass over memory is added for the check: the hash reads each slab while it is in cache.
- Reads by key promote a chunk from a slower tier only with `placement.promote_chunk_reads` (then `open_chunk`
  reads as `read_chunk` does: nothing unverified is promoted).
- `scratch` is where a chunk from a tier that reads into a buffer lands (default: this thread's buffer of the
  cache, reused by its next read: two sources open at once on one thread each need their own).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvfabric.cache.core import MISSING, EngineCore
from kvfabric.cache.ranged import read_piece
from kvfabric.cache.sources import BlockSource, ChunkMiss, Hooks, Payload, TokenSource
from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError
from kvfabric.codec.raw import RawCodec, payload_shape
from kvfabric.host.pages import Scratch
from kvfabric.kv.blocks import WORD_DTYPES, BlockLayout
from kvfabric.kv.shapes import ChunkPart
from kvfabric.tiers.stack import StackHit

Read = TokenSource | BlockSource | ChunkMiss


class ChunkReads:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.promotes = core.config.placement.promote_chunk_reads

    def read_into(self, key: bytes, out: torch.Tensor) -> tuple[str, int] | ChunkMiss:
        """(tier, bytes read) once every part of the chunk is in out, or a miss; a share whose own part is missing
        is put together from another way the chunk is stored (the shape's `alternatives`)."""
        c, num_tokens = self.core, out.shape[3]
        tier, num_bytes = "", 0
        for part in c.shape.parts:
            found = c.stack.get(part.key(key), c.scratch(), promote=self.promotes)
            if found is None:
                return self.from_alternatives(key, out) if c.shape.alternatives else MISSING
            target = c.shape.into(out, part)
            buffer = target if target is not None else torch.empty(part.layout.shape(num_tokens), dtype=out.dtype)
            kv = c.decode(part.key(key), found, num_tokens, buffer, part.layout)
            if isinstance(kv, ChunkMiss):
                return kv
            if target is None:
                c.shape.put(out, part, kv)
            tier, num_bytes = tier or found.tier, num_bytes + len(found.blob)
        return tier, num_bytes

    def read(self, key: bytes, num_tokens: int, blocks: BlockLayout | None, layers: Sequence[int] | None,
             scratch: Scratch | None, is_open: bool) -> Read:
        """read_chunk (is_open False) or open_chunk (True); see the module doc."""
        c = self.core
        started = time.perf_counter()
        scratch = scratch if scratch is not None else c.scratch()
        parts = c.shape.parts_for(layers)
        result: Read
        if len(parts) > 1:
            result = self._joined(key, parts, num_tokens, scratch)
        elif not c.shape.is_whole:  # one part of a split chunk (token-major)
            result = self._part(key, parts[0], num_tokens, scratch)
        else:
            result = self._whole(key, num_tokens, blocks, scratch, is_open and not self.promotes)
            if result == MISSING and c.shape.alternatives:  # a share stored another way (another parallel shape)
                result = self._assembled(key, num_tokens)
        c.histograms.observe("kvfabric_retrieve_seconds", time.perf_counter() - started, "read_chunk")
        c.counters.add("chunk_reads")
        c.counters.add("chunk_read_requests")
        if not isinstance(result, ChunkMiss):
            c.counters.add("chunk_read_hits")
        return result

    def _whole(self, key: bytes, num_tokens: int, blocks: BlockLayout | None, scratch: Scratch,
               is_deferred: bool) -> Read:
        """A chunk stored as one part (whole, or a share under its own key). is_deferred: the tier's fastest read,
        its check left to the source where it can."""
        c = self.core
        key = c.shape.parts[0].key(key)
        found = c.stack.get(key, scratch, promote=self.promotes, in_place=is_deferred, verify_payload=not is_deferred,
                            ranged=is_deferred and blocks is not None)
        if found is None:
            return MISSING
        header = found.header
        is_blocks = blocks is not None and header.blocks == blocks and header.codec_id == RawCodec.codec_id
        if found.ranged is not None and not is_blocks:  # not for a copy of blocks: read it all, checked below
            whole = _read_whole(found, scratch)
            if whole is None:
                return c.drop(key, found.tier, "truncated: the blob is shorter than its header says", is_damaged=True)
            found = whole
        if is_blocks:
            return self._blocks(key, found, num_tokens, scratch)
        checked = c.checked(key, found)
        if isinstance(checked, ChunkMiss):
            return checked
        kv = c.decode(key, checked, num_tokens, None)
        if isinstance(kv, ChunkMiss):
            return kv
        return TokenSource(kv, found.tier, len(found.blob), self._hooks(key, found))

    def _blocks(self, key: bytes, found: StackHit, num_tokens: int, scratch: Scratch) -> BlockSource | ChunkMiss:
        """A raw chunk in the caller's block layout, as it is: over its blob, or read layer by layer from a ranged
        tier; an unverified payload is hashed by the source as the caller copies it."""
        c, header, layout = self.core, found.header, self.core.layout
        try:
            if found.ranged is None:
                words = c.decoders.block_words(header, found.blob, layout, num_tokens)
                payload, size = Payload(words), len(found.blob)
            else:
                c.decoders.check_blocks(header, layout, num_tokens)
                payload, size = Payload(None, found.ranged, HEADER_BYTES), found.ranged.size
        except ChunkFormatError as exc:
            if found.ranged is not None:
                found.ranged.close()
            return c.drop(key, found.tier, exc)
        assert header.blocks is not None
        shape = payload_shape(layout, header.num_tokens, header.blocks)
        return BlockSource(header.blocks, shape, WORD_DTYPES[layout.itemsize], payload, found.tier, size,
                           self._hooks(key, found), None if found.is_verified else header.payload_sum, scratch)

    def _hooks(self, key: bytes, found: StackHit) -> Hooks:
        c, ranged, view = self.core, found.ranged, found.view
        return Hooks(release=ranged.close if ranged is not None else (lambda: None),
                     is_current=view.is_current if view is not None else None,
                     drop=lambda why: c.drop(key, found.tier, why, is_damaged=True),
                     torn=lambda: c.counters.add("torn_reads"))

    def _part(self, key: bytes, part: ChunkPart, num_tokens: int, scratch: Scratch) -> TokenSource | ChunkMiss:
        """One part of a split chunk (verified), viewed where it was read."""
        c = self.core
        found = c.stack.get(part.key(key), scratch, promote=self.promotes)
        if found is None:
            return MISSING
        kv = c.decode(part.key(key), found, num_tokens, None, part.layout)
        if isinstance(kv, ChunkMiss):
            return kv
        return TokenSource(kv, found.tier, len(found.blob), layers=part.layers)

    def _joined(self, key: bytes, parts: Sequence[ChunkPart], num_tokens: int,
                scratch: Scratch) -> TokenSource | ChunkMiss:
        """Every part of a split chunk, joined into a new tensor [L, 2, H, T, D]."""
        c = self.core
        whole = torch.empty(c.layout.shape(num_tokens), dtype=c.layout.torch_dtype)
        got = self.read_into(key, whole)
        if isinstance(got, ChunkMiss):
            return got
        return TokenSource(whole, got[0], got[1])

    def from_alternatives(self, key: bytes, out: torch.Tensor) -> tuple[str, int] | ChunkMiss:
        """out [L, S, H, T, D] put together from the first alternative whose every piece reads: a piece that is
        part of a stored part read alone, its rows checked against the head table (kvfabric.cache.ranged), any
        other stored part verified and decoded whole, the rows this shape holds copied into place."""
        c, num_tokens = self.core, out.shape[3]
        for way in c.shape.alternatives:
            tier, num_bytes = "", 0
            for piece in way:
                stored = piece.part.key(key)
                ranged = read_piece(c, stored, piece, out) if piece.is_partial and not self.promotes else None
                if isinstance(ranged, ChunkMiss):
                    break
                if ranged is not None:  # read and checked alone: this rank's rows only
                    tier, num_bytes = tier or ranged[0], num_bytes + ranged[1]
                    continue
                found = c.stack.get(stored, c.scratch(), promote=self.promotes)
                if found is None:
                    break
                buffer = torch.empty(piece.part.layout.shape(num_tokens), dtype=out.dtype)
                kv = c.decode(stored, found, num_tokens, buffer, piece.part.layout)
                if isinstance(kv, ChunkMiss):
                    break
                piece.into(out).copy_(piece.take(kv))
                tier, num_bytes = tier or found.tier, num_bytes + len(found.blob)
            else:
                c.counters.add("share_assembled_chunks")
                return tier, num_bytes
        return MISSING

    def _assembled(self, key: bytes, num_tokens: int) -> TokenSource | ChunkMiss:
        c = self.core
        out = torch.empty(c.layout.shape(num_tokens), dtype=c.layout.torch_dtype)
        got = self.from_alternatives(key, out)
        return got if isinstance(got, ChunkMiss) else TokenSource(out, *got)

    def read_many(self, keys: Sequence[bytes], scratches: Sequence[Scratch]) -> list[TokenSource | ChunkMiss]:
        c = self.core
        if not c.shape.is_whole:
            raise ValueError("read_many: this layout stores its chunks in parts (use read_chunk)")
        started = time.perf_counter()
        results: list[TokenSource | ChunkMiss] = []
        for key, found in zip(keys, c.stack.get_many(keys, scratches)):
            if found is None:
                results.append(MISSING)
                continue
            kv = c.decode(key, found, c.chunk_size, None)
            results.append(kv if isinstance(kv, ChunkMiss) else TokenSource(kv, found.tier, len(found.blob)))
        c.histograms.observe("kvfabric_retrieve_seconds", time.perf_counter() - started, "read_chunks")
        c.counters.add("chunk_reads")
        c.counters.add("chunk_read_requests", len(keys))
        c.counters.add("chunk_read_hits", sum(isinstance(r, TokenSource) for r in results))
        return results


def _read_whole(found: StackHit, scratch: Scratch) -> StackHit | None:
    """A ranged hit read whole into scratch (its payload still to be checked), or None when the read falls short."""
    ranged = found.ranged
    assert ranged is not None
    try:
        blob = scratch.view(ranged.size)
        if not ranged.read_into(0, blob):
            return None
    finally:
        ranged.close()
    return StackHit(blob, found.header, found.tier, None, False, level=found.level)

