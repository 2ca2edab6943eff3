"""FETCH_STREAM: the server receives a prompt's KV stream (kvfabric.stream) from a sender, decodes it into its pool
and stores it; the engine then retrieves it, and so does every other engine. A broken stream is a refusal that
leaves the client's connection usable. Server parts in a thread, a real sender on a loopback TCP socket."""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from kvfabric.cache.remote import RemoteCache
from kvfabric.stream import FixedPolicy, prepare, send_prompt
from kvfabric.stream import protocol as W
from tests.server_fixtures import CHUNK, LAYOUT, client_config, random_kv, server_config, server_in_thread, tokens_of

MODEL = "model-a"


@contextmanager
def _sender(send: Callable[[socket.socket], None]) -> Iterator[int]:
    """A one-shot sender on 127.0.0.1: its port; `send` writes the stream to the connection."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            send(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        thread.join(10)


def test_a_streamed_prompt_is_decoded_into_the_pool_and_served_to_every_engine(tmp_path) -> None:
    data = server_config(tmp_path)
    tokens, kv = tokens_of(2 * CHUNK + 100, 7), random_kv(2 * CHUNK + 100, 7)
    prompt = prepare(tokens, kv, LAYOUT, MODEL, CHUNK, levels=())
    with server_in_thread(tmp_path, data) as service, \
            RemoteCache(client_config(data), LAYOUT, MODEL, name="a") as a, \
            RemoteCache(client_config(data), LAYOUT, MODEL, name="b") as b:
        with _sender(lambda conn: send_prompt(conn, prompt, FixedPolicy("raw"))) as port:
            got = a.fetch_stream("127.0.0.1", port, timeout_s=30)
        assert got is not None and (got.num_chunks, got.num_tokens) == (3, len(tokens))
        assert got.wire_bytes > kv.numel() * 2  # raw chunks: the payload plus headers and frames
        whole = kv[:, :, :, :2 * CHUNK]  # without save_partial_chunk an engine reads whole chunks only
        assert torch.equal(a.retrieve(tokens), whole)
        assert torch.equal(b.retrieve(tokens), whole)  # another engine hits the same chunks
        assert service.counters.snapshot().get("stream_chunks") == 3


def test_a_broken_stream_is_a_refusal_and_the_connection_stays(tmp_path) -> None:
    data = server_config(tmp_path)
    tokens, kv = tokens_of(2 * CHUNK, 8), random_kv(2 * CHUNK, 8)
    prompt = prepare(tokens, kv, LAYOUT, MODEL, CHUNK, levels=())

    def half(conn: socket.socket) -> None:  # HELLO and chunk 0, then the sender dies
        W.send_frame(conn, W.HELLO, 0, W.hello_body(prompt.tokens, CHUNK, MODEL, LAYOUT))
        W.send_frame(conn, W.KV, 0, prompt.blobs["raw"][0], 0)

    with server_in_thread(tmp_path, data) as service, RemoteCache(client_config(data), LAYOUT, MODEL) as a:
        with _sender(half) as port:
            assert a.fetch_stream("127.0.0.1", port, timeout_s=30) is None
        with _sender(lambda conn: conn.sendall(b"not a stream at all")) as port:
            assert a.fetch_stream("127.0.0.1", port, timeout_s=30) is None
        assert a.is_connected()  # a refusal, not a dead server: no retry back-off either
        assert a.stats().counters.get("server_errors", 0) == 0
        with _sender(lambda conn: send_prompt(conn, prompt, FixedPolicy("raw"))) as port:
            assert a.fetch_stream("127.0.0.1", port, timeout_s=30).num_chunks == 2
        assert torch.equal(a.retrieve(tokens), kv)
        assert service.counters.snapshot().get("stream_failed") == 2


def test_an_mla_latent_stream_lands_in_its_own_namespace(tmp_path) -> None:
    """The stream's HELLO names a latent layout (MLA): the server receives it into the latent client's namespace,
    exactly; a K|V client of the same model and size finds nothing."""
    from kvfabric.kv.layout import KVLayout

    data = server_config(tmp_path)
    latent = KVLayout(LAYOUT.num_layers, 1, 2 * LAYOUT.head_dim * LAYOUT.num_kv_heads, LAYOUT.dtype, is_latent=True)
    tokens = tokens_of(2 * CHUNK, 9)
    kv = torch.randn(latent.shape(2 * CHUNK), generator=torch.Generator().manual_seed(9)).to(latent.torch_dtype)
    with pytest.raises(ValueError, match="streams raw"):
        prepare(tokens, kv, latent, MODEL, CHUNK)  # cachegen levels by default
    prompt = prepare(tokens, kv, latent, MODEL, CHUNK, levels=())
    with server_in_thread(tmp_path, data), RemoteCache(client_config(data), latent, MODEL, name="m") as mla, \
            RemoteCache(client_config(data), LAYOUT, MODEL, name="plain") as plain:
        with _sender(lambda conn: send_prompt(conn, prompt, FixedPolicy("raw"))) as port:
            got = mla.fetch_stream("127.0.0.1", port, timeout_s=30)
        assert got is not None and got.num_chunks == 2
        assert torch.equal(mla.retrieve(tokens), kv) and plain.lookup(tokens) == 0
