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
- `read_chunk(key, out=None)`: one chunk by key, a `ChunkHit` (KV, serving tier, bytes read) or a `ChunkMiss`
  (missing, corrupt, wrong_layout); a chunk that fails its checks is discarded and counted, as in `retrieve`.
- `new_payload()` then `store_chunk(key, payload)`: the caller lays a chunk's KV out in the payload (raw codec:
  the payload region of the very blob that will be stored, no encode copy); a chunk already held is skipped.
- `delete(tokens)` removes a prompt's chunks from every tier; `tier_keys`, `tier_usage`, `clear_tier` address one
  tier by name; `stats()` is an `EngineStats` snapshot.
- Nothing here raises for a damaged or missing cache entry; errors are raised only for bad arguments. Counters
  are thread-safe; `read_chunk` and `store_chunk` may run on different threads (the vLLM connector's step and saver).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from kvfabric.codec.base import Codec, Decoders, WrongLayoutError
from kvfabric.codec.format import ChunkFormatError
from kvfabric.codec.raw import RawCodec, new_payload, seal
from kvfabric.codec.registry import CodecChoice, parse_codec
from kvfabric.config import Config
from kvfabric.counters import Counters, merged
from kvfabric.hashing import ChunkKey, chunk_keys, root_key
from kvfabric.layout import KVLayout
from kvfabric.tiers.base import Blob, Scratch, Tier, TierUsage
from kvfabric.tiers.factory import build_tiers, codec_spec
from kvfabric.tiers.stack import StackHit, TierStack

log = logging.getLogger(__name__)

Tokens = Sequence[int] | np.ndarray | torch.Tensor
MissReason = Literal["missing", "corrupt", "wrong_layout"]


@dataclass(frozen=True, slots=True)
class ChunkHit:
    kv: torch.Tensor  # [L, 2, H, T, D]: the caller's `out`, or a view / new tensor (see CacheEngine.read_chunk)
    tier: str  # the tier that served it ("pending": a write still queued)
    num_bytes: int  # bytes of the blob read


@dataclass(frozen=True, slots=True)
class ChunkMiss:
    reason: MissReason  # missing: no tier holds a valid blob; corrupt / wrong_layout: found, failed, discarded


@dataclass(frozen=True, slots=True)
class ChunkPayload:
    kv: torch.Tensor  # [L, 2, H, T, D] in the layout dtype: the caller writes the chunk's KV here
    blob: memoryview | None  # raw codec: the blob around `kv`, sealed by store_chunk; None: `kv` is encoded


@dataclass(frozen=True, slots=True)
class EngineStats:
    counters: dict[str, int]  # the engine's and its tier stack's counters, summed
    tiers: tuple[TierUsage, ...]  # fastest first


_MISSING = ChunkMiss("missing")


class CacheEngine:
    def __init__(self, config: Config | None, layout: KVLayout, model_id: str,
                 tiers: Sequence[Tier] | None = None) -> None:
        self.config = config or Config()
        self.layout = layout
        self.model_id = model_id
        self.chunk_size = self.config.chunk_size
        self.codec = parse_codec(self.config.codec).make()
        self._decoders = Decoders()
        self._root = root_key(model_id, layout, self.chunk_size, self.config.salt, self.config.hash)
        self.node = None  # the cluster node this engine made for tier "peer"; closed with the engine
        self.stack = TierStack(tiers if tiers is not None else self._build_tiers(), self.config.write_queue_chunks)
        self._counters = Counters()
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
        self._counters.add("lookups")
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
            self._put_chunk(keys[i], kv[:, :, :, s - start:e - start, :])
            num_stored += 1
        self._counters.add("chunks_stored", num_stored)
        return num_stored

    def _put_chunk(self, key: bytes, kv: torch.Tensor, blob: Blob | None = None) -> None:
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

    def new_payload(self, num_tokens: int | None = None) -> ChunkPayload:
        """Where the caller lays out one chunk's KV [L, 2, H, T, D] (T = num_tokens, default chunk_size) for
        `store_chunk`: with the raw codec, the payload region of the blob that will be stored (uninitialized)."""
        num_tokens = num_tokens or self.chunk_size
        if self.codec.codec_id == RawCodec.codec_id:
            blob, kv = new_payload(self.layout, num_tokens)
            return ChunkPayload(kv, blob)
        return ChunkPayload(torch.empty(self.layout.shape(num_tokens), dtype=self.layout.torch_dtype), None)

    def store_chunk(self, key: bytes, payload: ChunkPayload) -> bool:
        """Store a chunk laid out in `new_payload()` under `key`; False when a writable tier already holds it.
        The payload belongs to the engine from here on: the caller must not write into it again."""
        if self.stack.contains_many([key], writable_only=True)[0]:
            return False
        if payload.blob is not None:
            seal(payload.blob, key, self.layout)
        self._put_chunk(key, payload.kv, payload.blob)
        self._counters.add("chunks_stored")
        return True

    def read_chunk(self, key: bytes, out: torch.Tensor | None = None, *, num_tokens: int | None = None,
                   scratch: Scratch | None = None) -> ChunkHit | ChunkMiss:
        """One chunk by key. With `out` [L, 2, H, T, D] (any float dtype, T the chunk's tokens) it is decoded
        into `out`. Without, `kv` holds num_tokens (default chunk_size) tokens in the layout dtype: a raw chunk
        is a zero-copy view, over `scratch` when the first tier reads into it (valid until the caller reuses
        `scratch`) or over the stored blob (read it, never write it); other codecs decode into a new tensor."""
        num_tokens = out.shape[3] if out is not None else num_tokens or self.chunk_size
        return self._take(key, self.stack.get(key, scratch), num_tokens, out)

    def _take(self, key: bytes, found: StackHit | None, num_tokens: int,
              out: torch.Tensor | None) -> ChunkHit | ChunkMiss:
        """The checked, decoded chunk of a stack read, or a miss; a chunk that fails its checks is discarded."""
        if found is None:
            return _MISSING
        try:
            if out is None:
                kv = self._decoders.view(found.header, found.blob, self.layout, num_tokens)
            else:
                self._decoders.decode(found.header, found.blob, self.layout, out)
                kv = out
        except ChunkFormatError as exc:
            log.warning("dropping undecodable chunk %s from tier %s: %s", key.hex()[:16], found.tier, exc)
            self.stack.discard(key)
            return ChunkMiss("wrong_layout" if isinstance(exc, WrongLayoutError) else "corrupt")
        return ChunkHit(kv, found.tier, len(found.blob))

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
                s, e = self._span(i, num_tokens)
                if isinstance(self._take(keys[i], found, e - s, out[:, :, :, s:e, :]), ChunkMiss):
                    break
                num_done = e
        self._counters.add("retrieves")
        self._counters.add("tokens_retrieved", num_done)
        self._counters.add("retrieve_ns", int((time.perf_counter() - started) * 1e9))
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

    def delete(self, tokens: Tokens) -> int:
        """Remove the chunks of `tokens` from every tier; returns how many chunks some tier held."""
        self.stack.flush()  # a queued write must not land after the delete
        return sum(any(tier.delete(key) for tier in self.stack.tiers) for key in self.keys(tokens))

    def flush(self) -> None:
        self.stack.flush()

    def _tier(self, name: str) -> Tier:
        for tier in self.stack.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier {name!r} in this engine ({', '.join(t.name for t in self.stack.tiers)})")

    def tier_keys(self, name: str) -> list[bytes]:
        """The keys the tier called `name` holds (e.g. the process-memory tier, mirrored by the vLLM scheduler)."""
        return self._tier(name).keys()

    def tier_usage(self, name: str) -> TierUsage:
        return self._tier(name).usage()

    def clear_tier(self, name: str) -> None:
        """Empty one tier (e.g. process memory, so that the next read is served by a slower tier)."""
        self._tier(name).clear()

    def stats(self) -> EngineStats:
        return EngineStats(merged(self._counters, self.stack.counters), tuple(t.usage() for t in self.stack.tiers))

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        if self.node is not None:
            self.node.close()  # stop serving and reporting first: the stack then closes the tiers
        self.stack.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
