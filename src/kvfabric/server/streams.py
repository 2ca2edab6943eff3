"""FETCH_STREAM: the server receives a prompt's KV stream (kvfabric.stream: HELLO, KV or TOKENS per chunk, END) from
a sender and decodes each chunk straight into a pool slot while the next one is on the wire.

Contract:
- The server connects to host:port (the sender listens; host an IP address: name resolution cannot be bounded by
  a deadline) and reads the stream under the request's deadline. The
  stream must be for the client's namespace (model, layout, chunk size; stream keys use the default hash and no
  salt). Every KV chunk is checked (key, checksums) on a decode worker, decoded into a slot that becomes READY
  (an unleased cached chunk: the client's `retrieve` then leases it) and stored as received in the tiers, so
  other engines hit it too. A TOKENS chunk (the sender chose recompute) or a chunk that fails its checks is left
  out: the client's retrieve stops there and its engine recomputes.
- The answer: how many leading chunks are ready, the prompt's tokens, wire bytes, decode and total seconds. A
  stream that breaks or violates the protocol is a Refusal (an ERROR answer): it never closes the client's
  connection, and chunks decoded before the break stay cached.
"""
from __future__ import annotations

import ipaddress
import socket
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvfabric.cache.remote import wire as P
from kvfabric.codec.format import ChunkFormatError, parse
from kvfabric.kv.layout import KVLayout
from kvfabric.net.framing import ProtocolError, recv_exact
from kvfabric.stream import protocol as W
from kvfabric.stream.sender import prompt_keys

if TYPE_CHECKING:
    from kvfabric.server.namespaces import Namespace
    from kvfabric.server.service import Client, Service


def fetch_stream(service: Service, client: Client, body: dict[str, Any], deadline: float) -> dict[str, Any]:
    from kvfabric.server.service import Refusal
    host = P.text_of(body, "host")
    port = P.int_of(body, "port", upper=1 << 16)
    try:
        ipaddress.ip_address(host)  # no name resolution on the data plane: it cannot be bounded by a deadline
    except ValueError:
        raise Refusal(f"host must be an IP address, got {host!r}") from None
    until = min(deadline, time.monotonic() + P.int_of(body, "timeout_ms", 60_000) / 1000)
    space = client.space
    if space.ident.hash != "sha256" or space.ident.salt:
        raise Refusal("streamed chunks carry keys with the default hash and no salt; this namespace differs")
    started = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=max(0.01, until - time.monotonic())) as sock:
            return _receive(service, space, sock, until, started)
    except (OSError, ProtocolError) as exc:
        service.counters.add("stream_failed")
        raise Refusal(f"stream from {host}:{port} failed: {exc}") from None


def _receive(service: Service, space: Namespace, sock: socket.socket, until: float, started: float) -> dict:
    def frame() -> W.Frame:
        sock.settimeout(max(0.001, until - time.monotonic()))
        return W.recv_header(sock)

    head = frame()
    if head.kind != W.HELLO or head.length > W.MAX_HELLO:
        raise ProtocolError("stream must start with a HELLO of sane size")
    meta = W.parse_hello(bytes(recv_exact(sock, head.length)))
    lay = meta["layout"]
    try:
        layout = KVLayout(lay["num_layers"], lay["num_kv_heads"], lay["head_dim"], lay["dtype"],
                          is_latent=lay.get("is_latent", False) is True)
    except (KeyError, TypeError, ValueError):
        raise ProtocolError("stream HELLO has a bad layout") from None
    cs = meta["chunk_size"]
    if layout != space.layout or meta["model_id"] != space.ident.model_id or cs != space.ident.chunk_size:
        raise ProtocolError("stream is for another model, layout or chunk size than this client's")
    tokens = meta["tokens"]
    keys = prompt_keys(tokens, layout, space.ident.model_id, cs)
    max_kv = 2 * layout.num_bytes(cs) + (1 << 20)
    jobs: list[Future | None] = []
    wire = W.FRAME.size + head.length
    while (fr := frame()).kind != W.END:
        if fr.index != len(jobs) or fr.index >= len(keys):
            raise ProtocolError(f"chunk {fr.index} out of order")
        s, e = fr.index * cs, min((fr.index + 1) * cs, len(tokens))
        if fr.kind == W.TOKENS and fr.length == 4 * (e - s):
            recv_exact(sock, fr.length)
            jobs.append(None)
        elif fr.kind == W.KV and fr.length <= max_kv:
            blob = recv_exact(sock, fr.length)
            jobs.append(service.decoder.submit(_take_chunk, service, space, keys[fr.index], blob, e - s))
        else:
            raise ProtocolError(f"bad frame (kind {fr.kind}, {fr.length} bytes)")
        wire += W.FRAME.size + fr.length
    if fr.index != len(keys) or len(jobs) != len(keys):
        raise ProtocolError("END before every chunk")
    service.metrics.fetch_seconds.labels("stream").observe(time.perf_counter() - started)
    decode_s, num_ready = 0.0, 0
    for job in jobs:
        took = job.result() if job is not None else None
        if took is None:
            break
        decode_s += took
        num_ready += 1
    service.counters.add("stream_chunks", num_ready)
    return {"chunks": num_ready, "tokens": len(tokens), "wire_bytes": wire, "decode_s": decode_s,
            "seconds": time.perf_counter() - started}


def _take_chunk(service: Service, space: Namespace, key: bytes, blob: bytearray, num_tokens: int) -> float | None:
    """Check one received chunk, decode it into a READY pool slot and store it in the tiers: the decode seconds,
    or None when it failed its checks or no slot was free."""
    try:
        header = parse(blob, key)
    except ChunkFormatError:
        service.counters.add("stream_corrupt")
        return None
    slot = service.slots.allocate(None)
    if slot is None:
        service.counters.add("pool_full")
        return None
    try:
        with service.cpu:
            started = time.perf_counter()
            space.decoders.decode(header, blob, space.layout, service.pool.tensor(slot, space.layout, num_tokens))
            took = time.perf_counter() - started
        service.metrics.decode_seconds.observe(took)
        service.slots.publish(slot, key)
    except ChunkFormatError:
        service.counters.add("stream_corrupt")
        return None
    finally:
        service.slots.unhold(slot)
    space.engine.store_blob(key, blob)
    return took
