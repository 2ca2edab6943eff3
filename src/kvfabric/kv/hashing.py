"""Chunk keys: pure functions from token ids to prefix-chained, namespaced chunk keys.

Contract:
- A prompt is split into chunks of `chunk_size` tokens; chunk i covers tokens [i*chunk_size, (i+1)*chunk_size).
- key_0 = H(root || tokens of chunk 0), key_i = H(key_{i-1} || tokens of chunk i), where H is sha256 or blake3
  (32-byte digests) and tokens are little-endian uint32. So a chunk's key names its whole prefix: keys of a prefix
  are a prefix of the keys, and any token change changes that chunk's key and every later one.
- base = H(b"kvfabric/keys/v1" || model id || layout fingerprint || chunk size || hash name); a tenant's root is
  H(b"kvfabric/tenant/v1" || parent root || tenant salt), its parent the base (or a configured salt's root, for
  "<salt>/<tenant>"): caches of other models, layouts, chunk sizes or tenants never share a key. A tenant root is
  derived from the parent's root alone, so whoever holds a namespace's wire form (the controller) can key a
  tenant's prompts in it without the layout; the salt is not secret, the bearer token scopes who may ask.
- Model families (DroidSpeak): `family_namespace(family, tokenizer, owner, kind)` is the model id of a namespace
  shared by every model that declares the same family and tokenizer (the layout still goes into the root): the
  chunks of kind `kind` that model `owner` stored there. It starts with a NUL byte, which no model name contains,
  so it never equals a native namespace; models that declare no family keep only their native one.
- Keys depend only on these inputs: never on Python's `hash()`, PYTHONHASHSEED, the process or the machine.
- A trailing partial chunk gets a key only when asked (`include_partial`); its key differs from any full chunk's
  because the hashed input is shorter. `KeySpace.tail_keys` gives the keys of a chunk's leading parts (every
  `step` tokens): the key a partial chunk of an earlier, shorter prompt was stored under, hashed the same way.
- `KeySpace` is the one value every part of kvfabric derives keys from (the engine, the remote client, the vLLM
  scheduler, the server's namespaces, the controller, the stream sender): root, chunk size, hash and the
  partial-chunk rule; `KeySpace.of(model id, layout, ...)` builds it, `tenant(salt)` is a tenant's namespace
  (the tenant salt, or "<salt>/<tenant>" under a configured salt), `keys(tokens)` the chunk keys. Nothing else
  calls `root_key` or `chunk_keys` (a test checks). The cluster's `Namespace` is its wire form.
"""
from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NewType

import blake3
import numpy as np
import torch

from kvfabric.kv.layout import KVLayout

ChunkKey = NewType("ChunkKey", bytes)
HashName = Literal["sha256", "blake3"]
HASH_NAMES: tuple[str, ...] = ("sha256", "blake3")
KEY_BYTES = 32


def _hasher(name: str):
    if name == "sha256":
        return hashlib.sha256
    if name == "blake3":
        return blake3.blake3
    raise ValueError(f"hash must be one of {HASH_NAMES}, got {name!r}")


def token_bytes(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> memoryview:
    """Token ids as little-endian uint32 bytes. Raises ValueError for ids outside [0, 2**32)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"token ids must be 1-D, got shape {tokens.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
            raise ValueError("token ids must lie in [0, 2**32)")
        data = np.ascontiguousarray(tokens, dtype="<u4").tobytes()
        return memoryview(data)
    try:
        # array('I') converts a Python list faster than numpy does, and rejects negatives/overflow itself.
        arr = array.array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    if arr.itemsize != 4:  # pragma: no cover - exotic platforms
        arr = array.array("L", tokens)
        return token_bytes(np.asarray(arr, dtype=np.uint64))
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return memoryview(arr.tobytes())


def _digest(hash_name: str, *parts: bytes) -> bytes:
    h = _hasher(hash_name)()
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))  # length-prefixed: no ambiguity between fields
        h.update(part)
    return h.digest()


def root_key(model_id: str, layout: KVLayout, chunk_size: int, salt: str = "", hash_name: str = "sha256") -> bytes:
    """The namespace seed every chain starts from: the base, or the tenant `salt`'s root under it."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    # b"" where the salt was once hashed in: the unsalted keys of caches written before tenant roots stay valid
    base = _digest(hash_name, b"kvfabric/keys/v1", model_id.encode(), layout.fingerprint, str(chunk_size).encode(),
                   b"", hash_name.encode())
    return tenant_root(base, salt, hash_name) if salt else base


def tenant_root(parent: bytes, tenant: str, hash_name: str = "sha256") -> bytes:
    """The root of tenant `tenant` inside the namespace rooted at `parent` (see the module contract)."""
    if not tenant:
        raise ValueError("a tenant needs a non-empty name")
    return _digest(hash_name, b"kvfabric/tenant/v1", parent, tenant.encode())


def family_namespace(family: str, tokenizer: str, owner: str, kind: str) -> str:
    """The model id of ``owner``'s chunks of ``kind`` (``"kv"``, ``"hidden@<layer>"``) in a family namespace."""
    for name, value in (("family", family), ("tokenizer", tokenizer), ("owner", owner), ("kind", kind)):
        if not value or "\x00" in value:
            raise ValueError(f"family namespace: {name} must be a non-empty string without NUL, got {value!r}")
    return "\x00".join(("", "family/v1", family, tokenizer, owner, kind))


def num_chunks(num_tokens: int, chunk_size: int, include_partial: bool = False) -> int:
    full, rest = divmod(num_tokens, chunk_size)
    return full + (1 if include_partial and rest else 0)


def chunk_keys(tokens: Sequence[int] | np.ndarray | torch.Tensor, root: bytes, chunk_size: int,
               include_partial: bool = False, hash_name: str = "sha256") -> list[ChunkKey]:
    """Keys of the chunks of `tokens`, in order (see module contract)."""
    data = token_bytes(tokens)
    num_tokens = len(data) // 4
    step = chunk_size * 4
    new = _hasher(hash_name)
    keys: list[ChunkKey] = []
    parent = root
    for i in range(num_chunks(num_tokens, chunk_size, include_partial)):
        h = new(parent)
        h.update(data[i * step:(i + 1) * step])
        parent = h.digest()
        keys.append(ChunkKey(parent))
    return keys


@dataclass(frozen=True, slots=True)
class KeySpace:
    """One key namespace (see the module contract). `model_id`, `layout` and `salt` describe it; a space rebuilt
    from its wire form (a root alone) has no layout, and its tenants are the same as the original's."""
    root: bytes
    chunk_size: int
    hash_name: str = "sha256"
    include_partial: bool = False
    model_id: str = ""
    layout: KVLayout | None = None
    salt: str = ""

    @classmethod
    def of(cls, model_id: str, layout: KVLayout, chunk_size: int, salt: str = "", hash_name: str = "sha256",
           include_partial: bool = False) -> KeySpace:
        return cls(root_key(model_id, layout, chunk_size, salt, hash_name), chunk_size, hash_name, include_partial,
                   model_id, layout, salt)

    def keys(self, tokens: Sequence[int] | np.ndarray | torch.Tensor) -> list[ChunkKey]:
        return chunk_keys(tokens, self.root, self.chunk_size, self.include_partial, self.hash_name)

    def tail_keys(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, parent: bytes | None, first: int,
                  step: int) -> list[ChunkKey]:
        """Keys of tokens [first, first + m) as a partial chunk chained after `parent` (None: the root), for
        m = step, 2 * step, ... below chunk_size and within `tokens`: one hash pass, a digest at each step."""
        data = token_bytes(tokens[first:first + self.chunk_size - 1])
        num = len(data) // 4 // step  # data holds at most chunk_size - 1 tokens
        h = _hasher(self.hash_name)(self.root if parent is None else parent)
        keys: list[ChunkKey] = []
        for i in range(num):
            h.update(data[i * step * 4:(i + 1) * step * 4])
            keys.append(ChunkKey(h.copy().digest()))
        return keys

    def tenant(self, tenant: str) -> KeySpace:
        """The namespace of a tenant (a vLLM request's cache_salt): never shares a key with this one."""
        salt = f"{self.salt}/{tenant}" if self.salt else tenant
        return KeySpace(tenant_root(self.root, tenant, self.hash_name), self.chunk_size, self.hash_name,
                        self.include_partial, self.model_id, self.layout, salt)
