"""CacheEngine: the public entry point. Token ids in, KV tensors in and out; chunking, keys and tiers inside.

Contract:
- `lookup(tokens)`: the longest prefix, in tokens, whose chunks are all cached (chunk-aligned, or the whole
  prompt when its partial last chunk is cached with `save_partial_chunk`). It does not read chunk data.
- `store(tokens, kv, start=0)`: kv [L, 2, H, T, D] holds the KV of tokens[start:start+T] (start chunk-aligned);
  every whole chunk in that range not yet cached is encoded and stored. Returns the number of chunks stored.
  It returns once the fastest tier holds the chunks; slower tiers are written in the background (`flush`).
- `retrieve(tokens, out=None)`: KV of the longest retrievable prefix of `tokens`, [L, 2, H, m, D] with m <= the
  lookup; a chunk that vanished or fails its checks ends the prefix there (a miss), is counted and removed, and is
  never returned. With `out` ([L, 2, H, >= len(tokens), D], any float dtype), chunks are copied into place and
  `out[..., :m, :]` is returned: the fast path (no allocation, one copy per chunk).
- `delete(tokens)` removes a prompt's chunks from every tier.
- Nothing here raises for a damaged or missing cache entry; errors are raised only for bad arguments.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvfabric.codec.base import Codec, Decoders
from kvfabric.codec.format import ChunkFormatError
from kvfabric.codec.registry import CodecChoice, parse_codec
from kvfabric.config import Config
from kvfabric.counters import Counters, merged
from kvfabric.hashing import ChunkKey, chunk_keys, root_key
from kvfabric.layout import KVLayout
from kvfabric.tiers.base import Blob, Scratch, Tier
from kvfabric.tiers.factory import build_tiers, codec_spec
from kvfabric.tiers.stack import StackHit, TierStack

Tokens = Sequence[int] | np.ndarray | torch.Tensor


class CacheEngine:
    def __init__(self, config: Config | None, layout: KVLayout, model_id: str,
                 tiers: Sequence[Tier] | None = None) -> None:
        self.config = config or Config()
        self.layout = layout
        self.model_id = model_id
        self.chunk_size = self.config.chunk_size
        self.codec = parse_codec(self.config.codec).make()
        self.decoders = Decoders()
        self._root = root_key(model_id, layout, self.chunk_size, self.config.salt, self.config.hash)
        self.node = None  # the cluster node this engine made for tier "peer"; closed with the engine
        self.stack = TierStack(tiers if tiers is not None else self._build_tiers(), self.config.write_queue_chunks)
        self.counters = Counters()
        # Tiers whose config names another codec get their own encoding of each chunk (e.g. raw in process
        # memory, cachegen on the network tiers); blobs are self-describing, so reads never need to know.
        self._tier_codecs: dict[int, Codec] = {}  # stack level -> its codec, where not the engine's
        codecs: dict[CodecChoice, Codec] = {parse_codec(self.config.codec): self.codec}
        for level, tier in enumerate(self.stack.tiers):
            spec = codec_spec(self.config, tier.name)
            if not spec:
                continue
            parsed = parse_codec(spec)
            if parsed not in codecs:
                codecs[parsed] = parsed.make()
            if codecs[parsed] is not self.codec:
                self._tier_codecs[level] = codecs[parsed]
        # One reader thread fetches chunk i+1 (file or network I/O, checksum) while chunk i is decoded:
        # both release the GIL, so a load costs about max(I/O, copy) rather than their sum.
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfabric-reader")
        self._scratch = threading.local()

    def _build_tiers(self) -> list[Tier]:
        """The configured local tiers; with tier "peer", composed with a cluster node that serves them, reports
        them under this engine's key namespace and adds the peer tier last."""
        config = self.config
        local = build_tiers(config, [name for name in config.tiers if name != "peer"])
        if "peer" not in config.tiers:
            return local
        from kvfabric.cluster.index import Namespace
        from kvfabric.cluster.worker import ClusterNode
        namespace = Namespace(self.model_id, self._root.hex(), self.chunk_size, config.hash, config.save_partial_chunk)
        self.node = ClusterNode(local, config.cluster, [namespace])
        return self.node.tiers

    # ---- keys --------------------------------------------------------------------------------------------
    def keys(self, tokens: Tokens) -> list[ChunkKey]:
        return chunk_keys(tokens, self._root, self.chunk_size, self.config.save_partial_chunk, self.config.hash)

    def _span(self, i: int, num_tokens: int) -> tuple[int, int]:
        return i * self.chunk_size, min((i + 1) * self.chunk_size, num_tokens)

    # ---- API ---------------------------------------------------------------------------------------------
    def lookup(self, tokens: Tokens) -> int:
        keys = self.keys(tokens)
        num_hit = self.stack.prefix_length(keys)
        self.counters.add("lookups")
        return self._span(num_hit - 1, len(tokens))[1] if num_hit else 0

    def store(self, tokens: Tokens, kv: torch.Tensor, start: int = 0) -> int:
        num_tokens = len(tokens)
        if start % self.chunk_size or not 0 <= start <= num_tokens:
            raise ValueError(f"start must be a multiple of chunk_size={self.chunk_size} within the prompt, got {start}")
        self.layout.check(kv)
        end = start + kv.shape[3]
        if end > num_tokens:
            raise ValueError(f"kv holds {kv.shape[3]} tokens from {start}, beyond the prompt's {num_tokens} tokens")
        keys = self.keys(tokens)
        first = start // self.chunk_size
        wanted = [i for i in range(first, len(keys)) if self._span(i, num_tokens)[1] <= end]
        present = self.stack.contains_many([keys[i] for i in wanted], writable_only=True)
        num_stored = 0
        for i, is_present in zip(wanted, present):
            if is_present:
                continue
            s, e = self._span(i, num_tokens)
            self.put_chunk(keys[i], kv[:, :, :, s - start:e - start, :])
            num_stored += 1
        self.counters.add("chunks_stored", num_stored)
        return num_stored

    def put_chunk(self, key: bytes, kv: torch.Tensor, blob: Blob | None = None) -> None:
        """Store one chunk's KV [L, 2, H, C, D] under `key`: encoded once with the engine's codec (or `blob`, that
        encoding made by the caller) and once more for each other codec a tier asks for."""
        if blob is None:
            blob = self.codec.encode(kv, key, self.layout)
        encoded: dict[int, Blob] = {}  # id(codec) -> blob: tiers sharing a codec share one encoding
        per_level: dict[int, Blob] = {}
        for level, codec in self._tier_codecs.items():
            if id(codec) not in encoded:
                encoded[id(codec)] = codec.encode(kv, key, self.layout)
            per_level[level] = encoded[id(codec)]
        self.stack.put(key, blob, per_level)

    def retrieve(self, tokens: Tokens, out: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens = len(tokens)
        keys = self.keys(tokens)
        if out is None:
            out = torch.empty(self.layout.shape(num_tokens), dtype=self.layout.torch_dtype)
        elif out.dim() != 5 or out.shape[3] < num_tokens or tuple(out.shape[:3]) + (out.shape[4],) != \
                self.layout.shape(0)[:3] + (self.layout.head_dim,):
            raise ValueError(f"out must be {self.layout.shape(num_tokens)} or longer in dim 3, got {tuple(out.shape)}")
        num_done = 0
        started = time.perf_counter()
        with self.stack.pinned(keys):
            self.stack.prefetch(keys)
            for i, found in enumerate(self._fetch_ahead(keys)):
                if found is None or not self._decode_chunk(keys[i], found, i, num_tokens, out):
                    break
                num_done = self._span(i, num_tokens)[1]
        self.counters.add("retrieves")
        self.counters.add("tokens_retrieved", num_done)
        self.counters.add("retrieve_ns", int((time.perf_counter() - started) * 1e9))
        return out[:, :, :, :num_done, :]

    def _fetch_ahead(self, keys: Sequence[bytes]) -> Iterator[StackHit | None]:
        """Yield stack.get(key) for each key in order. A chunk not in process memory is read one step ahead by
        the reader thread (file or network I/O and its checksum overlap the decoding of the previous chunk);
        two scratch buffers alternate, so the one being decoded is never the one being filled. Chunks in
        memory are taken directly: a thread hand-off would cost more than the dict lookup."""
        if not hasattr(self._scratch, "pair"):
            self._scratch.pair = (Scratch(), Scratch())
        pair = self._scratch.pair
        ahead: Future | None = None
        try:
            for i, key in enumerate(keys):
                current = ahead.result() if ahead is not None else self.stack.get(key, pair[i % 2])
                ahead = None
                if current is None:
                    yield None
                    return
                if i + 1 < len(keys) and not self.stack.is_in_memory(keys[i + 1]):
                    ahead = self._reader.submit(self.stack.get, keys[i + 1], pair[(i + 1) % 2])
                yield current
        finally:
            if ahead is not None:
                ahead.result()  # never leave a read in flight into a buffer the next call reuses

    def _decode_chunk(self, key: bytes, found: StackHit, i: int, num_tokens: int,
                      out: torch.Tensor) -> bool:
        blob, header = found.blob, found.header
        s, e = self._span(i, num_tokens)
        try:
            if header.fingerprint != self.layout.fingerprint or header.shape != self.layout.shape(e - s):
                raise ChunkFormatError(f"chunk made for another layout {header.shape}")
            self.decoders[header.codec_id].decode(header, memoryview(blob), self.layout, out[:, :, :, s:e, :])
        except ChunkFormatError:
            self.stack.discard(key)
            return False
        return True

    def delete(self, tokens: Tokens) -> int:
        """Remove the chunks of `tokens` from every tier; returns how many chunks some tier held."""
        self.stack.flush()  # a queued write must not land after the delete
        return sum(any(tier.delete(key) for tier in self.stack.tiers) for key in self.keys(tokens))

    def flush(self) -> None:
        self.stack.flush()

    def stats(self) -> dict[str, object]:
        return {"counters": merged(self.counters, self.stack.counters),
                "tiers": [tier.usage() for tier in self.stack.tiers]}

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        if self.node is not None:
            self.node.close()  # stop serving and reporting first: the stack then closes the tiers
        self.stack.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
