"""Chunk keys of a vLLM request's prompt, and which of them the worker's cache can load (the scheduler's side).

Contract:
- `ChunkLookup(config, layout, model_id, client)`: `keys(tokens, cache_salt)` the prompt's chunk keys in the
  request's namespace (a cache_salt is a tenant, see ``config``); `keys_from_block_hashes` the keys of key mode
  "vllm"; `prefix(keys, num_tokens)` the leading chunks the worker can load (one lookup, ``lookup.LookupClient`` or
  ``EveryRank``); `tail_keys` / `tail` the partial chunks, every `step` tokens, that may follow a prompt's first
  whole chunks, and the longest of them the worker can load (``Tail``: its key and where its tokens end). The
  scheduler holds no tiers: the worker's cache is the one lookup authority, and no chunk data is read here.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvfabric.cache.protocol import KeyLookup
from kvfabric.config import Config
from kvfabric.connectors.lookup import EveryRank, LookupClient
from kvfabric.kv.hashing import ChunkKey, KeySpace
from kvfabric.kv.layout import KVLayout


@dataclass(frozen=True, slots=True)
class Tail:
    """A partial chunk: its key and where its tokens end, from token 0."""
    key: ChunkKey
    end: int


class ChunkLookup:
    """Which leading chunks of a prompt the worker can load: keys here, the answer from the worker's cache."""

    def __init__(self, config: Config, layout: KVLayout, model_id: str, client: LookupClient | EveryRank) -> None:
        self.config = config
        self.chunk_size = config.chunk_size
        self.key_space = KeySpace.of(model_id, layout, config.chunk_size, config.salt, config.hash,
                                     config.save_partial_chunk)
        self._tenants: dict[str, KeySpace] = {}  # cache_salt -> its namespace
        self.client = client

    def keys(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[ChunkKey]:
        """Keys of the prompt's whole chunks, plus its trailing partial chunk with `save_partial_chunk`."""
        return self.space(cache_salt).keys(tokens)

    def space(self, cache_salt: str | None) -> KeySpace:
        """The key namespace of a request's cache_salt: kvfabric's tenant salt S (or "<config salt>/S")."""
        if not cache_salt:
            return self.key_space
        space = self._tenants.get(cache_salt)
        if space is None:
            space = self._tenants[cache_salt] = self.key_space.tenant(cache_salt)
        return space

    def keys_from_block_hashes(self, block_hashes: Sequence[bytes], num_tokens: int, block_size: int) -> list[ChunkKey]:
        """Key mode "vllm": chunk i's key names vLLM's hash of the last block of the chunk (vLLM chains its block
        hashes over the prefix and folds in LoRA, multimodal inputs and cache_salt), within our namespace."""
        per_chunk = self.chunk_size // block_size
        num = min(num_tokens // self.chunk_size, len(block_hashes) // per_chunk)
        return [ChunkKey(hashlib.sha256(self.key_space.root + b"vllm-block-hash" + bytes(block_hashes[(i + 1) * per_chunk - 1]))
                         .digest()) for i in range(num)]

    def prefix(self, keys: Sequence[bytes], num_tokens: int | None = None) -> KeyLookup:
        """The leading chunks of a prompt of num_tokens tokens (default: whole chunks) that the worker can load."""
        return self.client.lookup(keys, num_tokens)

    def tail_keys(self, tokens: Sequence[int], keys: Sequence[ChunkKey], num_chunks: int, step: int,
                  cache_salt: str | None) -> list[Tail]:
        """The partial chunks, every `step` tokens, that could follow the prompt's first num_chunks chunks."""
        first = num_chunks * self.chunk_size
        found = self.space(cache_salt).tail_keys(tokens, keys[num_chunks - 1] if num_chunks else None, first, step)
        return [Tail(key, first + (i + 1) * step) for i, key in enumerate(found)]

    def tail(self, tokens: Sequence[int], keys: Sequence[ChunkKey], num_chunks: int, step: int,
             cache_salt: str | None) -> Tail | None:
        """The longest partial chunk the worker can load after the prompt's first num_chunks chunks."""
        tails = self.tail_keys(tokens, keys, num_chunks, step, cache_salt)[::-1]  # longest first
        if not tails:
            return None
        index = self.client.find_tail(keys[:num_chunks], num_chunks * self.chunk_size,
                                      [(tail.key, tail.end) for tail in tails])
        return tails[index - 1] if index else None

    def close(self) -> None:
        self.client.close()
