"""RemoteCache's reads by key: one chunk from the server's pool slot into the caller's tensor (`read_into`), viewed
in its slot as a source leased until the source's exit (`read_chunk`), or copied into the caller's buffers
(`read_many`); and `holds`. The server verified every chunk it answers with, so a source has nothing left to check;
it is token-major, every layer (the server stores token-major chunks). A server that is down is a miss.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfabric.cache.protocol import ChunkHit, ChunkMiss, TokenSource
from kvfabric.cache.remote import wire as P
from kvfabric.cache.remote.sessions import Down, Sessions
from kvfabric.cache.sources import Hooks
from kvfabric.host.pages import Scratch
from kvfabric.kv.layout import KVLayout

_MISSING = ChunkMiss("missing")


class RemoteReads:
    def __init__(self, sessions: Sessions, layout: KVLayout) -> None:
        self.sessions = sessions
        self.layout = layout

    def slot(self, slot: int, num_tokens: int) -> torch.Tensor:
        """A pool slot's KV [L, 2, H, num_tokens, D] (a view of the server's pool)."""
        assert self.sessions.pool is not None
        return self.sessions.pool.tensor(slot, self.layout, num_tokens)

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the server holds each chunk; none when it is down."""
        try:
            with self.sessions.session() as conn:
                reply = conn.call(P.HOLDS, {"keys": list(keys)})
        except Down:
            return [False] * len(keys)
        present = reply.get("held")
        return [bool(v) for v in present] if isinstance(present, list) and len(present) == len(keys) else \
            [False] * len(keys)

    def read_into(self, key: bytes, out: torch.Tensor) -> ChunkHit | ChunkMiss:
        """The chunk copied from its slot into out [L, 2, H, T, D] (any float dtype); the slot let go at once."""
        answer: dict = {}
        try:
            with self.sessions.session() as conn:
                reply = conn.call(P.RETRIEVE, {"keys": [key], "tokens": [out.shape[3]]}, answer.update)
                if not answer:
                    return _miss(reply)
                slot = P.int_of(answer, "slot")
                try:
                    out.copy_(self.slot(slot, out.shape[3]))
                finally:
                    conn.release([slot])
                    conn.flush_releases()
        except Down:
            return _MISSING
        return ChunkHit(str(answer.get("tier", "server")), int(answer.get("bytes", 0)))

    def read_chunk(self, key: bytes, num_tokens: int, scratch: Scratch | None) -> TokenSource | ChunkMiss:
        """A TokenSource of every layer viewing the chunk's pool slot, leased until the source's exit (copied into
        `scratch` and let go at once where this client holds its slot cap). `blocks` and `layers` are moot: the
        server stores token-major chunks, and verified this one."""
        answer: dict = {}
        try:
            with self.sessions.session() as conn:
                keep = Sessions.room(conn) > 1
                reply = conn.call(P.RETRIEVE, {"keys": [key], "tokens": [num_tokens]}, answer.update)
                if not answer:
                    return _miss(reply)
                slot = P.int_of(answer, "slot")
                view = self.slot(slot, num_tokens)
                if keep:
                    hooks = Hooks(release=lambda: self.sessions.orphan(conn, slot))
                    return TokenSource(view, str(answer.get("tier", "server")), int(answer.get("bytes", 0)), hooks)
                kv = _copy_out(view, scratch)
                conn.release([slot])
                conn.flush_releases()
        except Down:
            return _MISSING
        return TokenSource(kv, str(answer.get("tier", "server")), int(answer.get("bytes", 0)))

    def read_many(self, keys: Sequence[bytes], scratches: Sequence[Scratch],
                  num_tokens: int) -> list[TokenSource | ChunkMiss]:
        """Whole chunks, each copied into its scratch (a view of it in the source)."""
        results: list[TokenSource | ChunkMiss] = []
        for key, scratch in zip(keys, scratches, strict=True):
            got = self.read_chunk(key, num_tokens, None)
            if isinstance(got, TokenSource):
                with got:
                    kv = _copy_out(got.kv, scratch)
                results.append(TokenSource(kv, got.tier, got.num_bytes))
            else:
                results.append(got)
        return results


def _miss(reply: dict) -> ChunkMiss:
    """The server's reason for not sending a chunk, as a miss."""
    reason = reply.get("miss")
    return ChunkMiss(reason if reason in ("corrupt", "wrong_layout") else "missing")


def _copy_out(view: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
    """A slot's KV copied into scratch (or a new tensor), so that the slot can go at once."""
    if scratch is None:
        return view.clone()
    flat = torch.frombuffer(scratch.view(view.numel() * view.element_size()), dtype=view.dtype)
    return flat.view(view.shape).copy_(view)
