"""CacheEngine.retrieve: a prompt's longest cached prefix of KV, read ahead chunk by chunk.

Contract:
- `retrieve(tokens, out)`: KV of the longest retrievable prefix, [L, 2, H, m, D] (in `out[..., :m, :]` when given:
  one copy per chunk, no allocation). A chunk that vanished or fails its checks ends the prefix there; it is dropped
  and counted (kvfabric.cache.core), never returned.
- The chunk's first part (the whole chunk, or a split chunk's full-attention part) is read ahead: one reader
  thread reads chunk i+1 (file or network I/O, then the checksum on this thread) while chunk i is decoded; chunks
  in process memory are taken directly. The other parts a prefix needs (a split chunk's window parts, only of the
  chunks a continuation still reads: kvfabric.kv.shapes) are read after, and the prefix is the longest whose
  needed parts are all there; rows no continuation reads are zeroed.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvfabric.cache.core import EngineCore
from kvfabric.cache.protocol import Tokens, retrieve_buffer
from kvfabric.cache.sources import ChunkMiss
from kvfabric.host.pages import Scratch
from kvfabric.kv.hashing import KeySpace
from kvfabric.kv.shapes import ChunkPart
from kvfabric.tiers.placement import LoadPermit
from kvfabric.tiers.policies import AccessMeta
from kvfabric.tiers.stack import StackHit

Assemble = Callable[[bytes, torch.Tensor], object]  # (chunk key, out) -> (tier, bytes) or a ChunkMiss
READ_AHEAD_BYTES = 24 << 20  # how far ahead of the decoding a retrieve asks slow tiers to start reading


class Retriever:
    def __init__(self, core: EngineCore, key_space: KeySpace, assemble: Assemble) -> None:
        """`assemble(key, out)`: a chunk read another way (a share's alternatives), for chunks past the first
        part's prefix."""
        self.core = core
        self.key_space = key_space
        self._assemble = assemble
        # One reader thread fetches chunk i+1 (file or network I/O) while chunk i is decoded: both release the
        # GIL, so a load costs about max(I/O, copy) rather than their sum.
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfabric-reader")
        self._local = threading.local()  # per calling thread: the two read buffers it alternates

    def retrieve(self, tokens: Tokens, out: torch.Tensor | None = None) -> torch.Tensor:
        c, shape = self.core, self.core.shape
        num_tokens = len(tokens)
        keys = self.key_space.keys(tokens)
        out = retrieve_buffer(c.layout, num_tokens, out)
        first, others = shape.parts[0], shape.parts[1:]
        stored = [first.key(k) for k in keys] if first.tag else keys
        num_done = num_chunks = 0
        started = time.perf_counter()
        with c.stack.pinned([k for part in shape.parts for k in map(part.key, keys)]), \
                c.stack.load_permit() as permit:
            for part in others:  # hints for the other parts a hit of the whole prompt needs
                c.stack.prefetch([part.key(k) for k in keys[shape.first_needed(part, num_tokens, c.chunk_size):]])
            # a part that cannot be decoded into out in place goes through one buffer per load
            buffer = None if shape.into(out, first) is not None else \
                torch.empty(first.layout.shape(c.chunk_size), dtype=out.dtype)
            for i, found in enumerate(self._fetch_ahead(stored, num_tokens, permit)):
                s, e = c.span(i, num_tokens)
                if found is None or not self._put(stored[i], found, first, out[:, :, :, s:e, :], buffer):
                    break
                num_done, num_chunks = e, i + 1
            while shape.alternatives and num_chunks < len(keys):  # a share stored another way: chunk by chunk
                s, e = c.span(num_chunks, num_tokens)
                if isinstance(self._assemble(keys[num_chunks], out[:, :, :, s:e, :]), ChunkMiss):
                    break
                num_done, num_chunks = e, num_chunks + 1
            if others and num_chunks:
                num_chunks = self._other_parts(keys, num_chunks, num_tokens, out, permit)
                num_done = c.span(num_chunks - 1, num_tokens)[1] if num_chunks else 0
        elapsed = time.perf_counter() - started
        c.histograms.observe("kvfabric_retrieve_seconds", elapsed, "retrieve")
        for name, n in (("retrieves", 1), ("retrieve_tokens", num_tokens), ("tokens_retrieved", num_done),
                        ("retrieve_chunks", len(keys)), ("retrieve_hit_chunks", num_chunks),
                        ("retrieve_ns", int(elapsed * 1e9))):
            c.counters.add(name, n)
        return out[:, :, :, :num_done, :]

    def _put(self, key: bytes, found: StackHit, part: ChunkPart, out: torch.Tensor,
             buffer: torch.Tensor | None) -> bool:
        """Decode a part read from the stack into its rows of out [L, 2, H, T, D] (through buffer [L', 2, H, >= T, D]
        where they are not a view); False when it fails (dropped)."""
        c, num_tokens = self.core, out.shape[3]
        target = c.shape.into(out, part) if buffer is None else buffer[:, :, :, :num_tokens]
        assert target is not None
        kv = c.decode(key, found, num_tokens, target, part.layout)
        if isinstance(kv, ChunkMiss):
            return False
        if buffer is not None:
            c.shape.put(out, part, kv)
        return True

    def _other_parts(self, keys: Sequence[bytes], num_chunks: int, num_tokens: int, out: torch.Tensor,
                     permit: LoadPermit) -> int:
        """Read the other parts a prefix of num_chunks chunks needs into out; the chunks of the prefix served (fewer
        when a needed part is missing or fails its checks). Stale rows before the live chunks are zeroed."""
        c, shape, scratch = self.core, self.core.shape, Scratch()
        buffers: dict[str, torch.Tensor] = {}
        num_read: dict[str, int] = {}

        def read(part: ChunkPart, chunks: Sequence[int]) -> list[bool]:
            if part.name not in buffers:  # one per load, as for the first part
                buffers[part.name] = torch.empty(part.layout.shape(c.chunk_size), dtype=out.dtype)
            found = []
            for i in chunks:
                s, e = c.span(i, num_tokens)
                key = part.key(keys[i])
                hit = c.stack.get(key, scratch, c.meta(i, len(keys), s, e), permit)
                found.append(hit is not None and self._put(key, hit, part, out[:, :, :, s:e, :], buffers[part.name]))
                num_read[part.name] = num_read.get(part.name, 0) + 1
            return found

        served = shape.live_prefix(num_chunks, num_tokens, c.chunk_size, read)
        shape.clear_stale_rows(out, c.span(served - 1, num_tokens)[1] if served else 0, c.chunk_size)
        for part in shape.parts[1:]:
            c.counters.add(f"{part.name}_parts_read", num_read.get(part.name, 0))
            c.counters.add(f"{part.name}_parts_skipped", max(0, served - num_read.get(part.name, 0)))
        return served

    def _fetch_ahead(self, keys: Sequence[bytes], num_tokens: int, permit: LoadPermit) -> Iterator[StackHit | None]:
        """Yield stack.get(key) for each key in order (with each chunk's AccessMeta, under the load's slow-read
        permit). A chunk not in process memory is read one step ahead by the reader thread (file or network
        I/O and its checksum overlap the decoding of the previous chunk); two scratch buffers alternate, so the
        one being decoded is never the one being filled. Chunks in memory are taken directly: a thread
        hand-off would cost more than the dict lookup. A chunk read by a slow tier is hashed here (`confirm`), after
        the next chunk's read has started: the reader thread reads back to back, the disk never waits on a hash."""
        c, stack = self.core, self.core.stack
        if not hasattr(self._local, "pair"):
            self._local.pair = (Scratch(), Scratch())
        pair = self._local.pair
        metas = [c.meta(i, len(keys), *c.span(i, num_tokens)) for i in range(len(keys))]
        ahead: Future | None = None
        # Read-ahead hints (disk: posix_fadvise) for READ_AHEAD_BYTES past the chunk being read, not for the whole
        # prompt: hinted at once, the kernel reads the files side by side and the first chunk arrives late. Small
        # chunks gain from hints; chunks as large as the window get none: a hinted read competes with the read in
        # progress (docs/benchmarks.md, bench tiers, has the figures). When hints are given, the first chunk is
        # hinted too: a peer tier's prefetch is its fetch, in the order asked (see P2P).
        num_hinted = READ_AHEAD_BYTES // max(1, c.layout.num_bytes(c.chunk_size))
        if num_hinted:
            stack.prefetch(keys[:num_hinted + 1])
        try:
            for i, key in enumerate(keys):
                if num_hinted and i + num_hinted + 1 < len(keys):
                    stack.prefetch(keys[i + num_hinted + 1:i + num_hinted + 2])
                current = ahead.result() if ahead is not None else \
                    stack.get(key, pair[i % 2], metas[i], permit, verify_payload=False)
                ahead = None
                if current is not None and i + 1 < len(keys) and not stack.is_in_memory(keys[i + 1]):
                    started = threading.Event()
                    ahead = self._reader.submit(self._read_unverified, keys[i + 1], pair[(i + 1) % 2],
                                                metas[i + 1], permit, started)
                    # the hash below holds the GIL: a reader not yet in its read would wait for it
                    started.wait()
                if current is not None and not stack.confirm(key, current, metas[i]):  # a lower tier's copy?
                    current = stack.get(key, pair[i % 2], metas[i], permit, from_level=current.level + 1)
                if current is None:
                    yield None
                    return
                yield current
        finally:
            if ahead is not None:
                ahead.result()  # never leave a read in flight into a buffer the next call reuses

    def _read_unverified(self, key: bytes, scratch: Scratch, meta: AccessMeta, permit: LoadPermit,
                         started: threading.Event) -> StackHit | None:
        started.set()
        return self.core.stack.get(key, scratch, meta, permit, verify_payload=False)

    def close(self) -> None:
        self._reader.shutdown(wait=True)
