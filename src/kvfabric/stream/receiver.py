"""Receiving end: KV chunks decoded straight into the caller's buffer while the next one is on the wire; token
chunks recomputed, in order, by a callback.

`Receiver(layout, model_id, buf, recompute)`: buf [L, 2, H, >= prompt, D] (any float dtype; the engine's fp32
workspace), recompute(tokens, start, end, buf) fills buf[..., start:end, :] given buf[..., :start, :].
`receive(conn)` handles one prompt and returns a ReceiveResult once every chunk is in buf. A chunk that fails
its checks (wrong key, corrupt blob) is recomputed instead: a bad peer costs time, never wrong KV.
When the HELLO asks ("report_work"), the worker tells the sender what each chunk cost it (a DONE frame, sent from
the worker as it finishes the chunk): decode costs measured alone understate them while the same cores receive.
"""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kvfabric.codec.base import Decoders
from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, parse
from kvfabric.kv.layout import KVLayout
from kvfabric.stream import protocol as W
from kvfabric.stream.sender import prompt_keys

Recompute = Callable[[list[int], int, int, torch.Tensor], None]


@dataclass
class ChunkLog:
    index: int
    kind: str  # "kv" or "tokens"
    level: int
    codec_id: int
    nbytes: int
    arrived_s: float
    done_s: float = 0.0
    recomputed: bool = False  # tokens, or a KV chunk that failed its checks
    work_s: float = 0.0  # the worker's seconds on it (decode, or recompute)


@dataclass
class ReceiveResult:
    tokens: list[int]
    chunks: list[ChunkLog] = field(default_factory=list)
    done_s: float = 0.0  # all chunks in buf, seconds after t0

    @property
    def wire_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


class Receiver:
    def __init__(self, layout: KVLayout, model_id: str, buf: torch.Tensor, recompute: Recompute | None) -> None:
        self.layout = layout
        self.model_id = model_id
        self.buf = buf
        self.recompute = recompute
        self.decoders = Decoders()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfabric-stream-rx")

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def receive(self, conn: socket.socket, t0: float | None = None) -> ReceiveResult:
        t0 = time.perf_counter() if t0 is None else t0
        head = W.recv_header(conn)
        if head.kind != W.HELLO or head.length > W.MAX_HELLO:
            raise W.ProtocolError("stream must start with a HELLO of sane size")
        meta = W.parse_hello(bytes(W.recv_exact(conn, head.length)))
        lay = meta["layout"]
        if lay.get("fingerprint") != self.layout.fingerprint.hex() or meta["model_id"] != self.model_id:
            raise W.ProtocolError("stream is for another model or layout")
        tokens, cs = meta["tokens"], meta["chunk_size"]
        n = len(tokens)
        if self.buf.shape[3] < n:
            raise W.ProtocolError(f"prompt of {n} tokens does not fit the buffer ({self.buf.shape[3]})")
        keys = prompt_keys(tokens, self.layout, self.model_id, cs)
        max_kv = HEADER_BYTES + 2 * self.layout.num_bytes(cs) + (1 << 20)
        result = ReceiveResult(tokens)
        done = _Reporter(conn if meta.get("report_work") else None)
        pending: list[Future] = []
        expect = 0
        while True:
            fr = W.recv_header(conn)
            if fr.kind == W.END:
                if fr.index != len(keys) or expect != len(keys) or fr.length:
                    raise W.ProtocolError("END before every chunk")
                break
            if fr.index != expect or expect >= len(keys):
                raise W.ProtocolError(f"chunk {fr.index} out of order (expected {expect})")
            s, e = fr.index * cs, min((fr.index + 1) * cs, n)
            if fr.kind == W.TOKENS:
                if fr.length != 4 * (e - s):
                    raise W.ProtocolError("TOKENS frame of the wrong length")
                body = np.frombuffer(W.recv_exact(conn, fr.length), dtype="<u4")
                if body.tolist() != tokens[s:e]:
                    raise W.ProtocolError("TOKENS frame does not match the prompt")
                log = ChunkLog(fr.index, "tokens", 0, -1, W.FRAME.size + fr.length, time.perf_counter() - t0,
                               recomputed=True)
                pending.append(self._worker.submit(done.timed, log, self._recompute, tokens, s, e, log, t0))
            elif fr.kind == W.KV:
                if fr.length > max_kv:
                    raise W.ProtocolError(f"KV frame of {fr.length} bytes exceeds {max_kv}")
                blob = W.recv_exact(conn, fr.length)
                log = ChunkLog(fr.index, "kv", fr.level, -1, W.FRAME.size + fr.length, time.perf_counter() - t0)
                pending.append(self._worker.submit(done.timed, log, self._decode, blob, keys[fr.index], tokens, s, e,
                                                   log, t0))
            else:
                raise W.ProtocolError(f"unexpected frame kind {fr.kind}")
            result.chunks.append(log)
            expect += 1
        for f in pending:
            f.result()
        result.done_s = time.perf_counter() - t0
        return result

    def _decode(self, blob: bytearray, key: bytes, tokens: list[int], s: int, e: int, log: ChunkLog,
                t0: float) -> None:
        try:
            header = parse(blob, key)
            log.codec_id = header.codec_id
            self.decoders.decode(header, blob, self.layout, self.buf[:, :, :, s:e, :])
        except ChunkFormatError:
            log.recomputed = True
            self._recompute(tokens, s, e, log, t0)
            return
        log.done_s = time.perf_counter() - t0

    def _recompute(self, tokens: list[int], s: int, e: int, log: ChunkLog, t0: float) -> None:
        if self.recompute is None:
            raise W.ProtocolError("chunk needs recompute but the receiver has no model")
        self.recompute(tokens, s, e, self.buf)
        log.done_s = time.perf_counter() - t0


class _Reporter:
    """Runs a chunk's work on the worker and, where the sender asked, sends it the seconds that took (DONE)."""

    def __init__(self, conn: socket.socket | None) -> None:
        self.conn = conn

    def timed(self, log: ChunkLog, work: Callable[..., None], *args: object) -> None:
        start = time.perf_counter()
        work(*args)
        log.work_s = time.perf_counter() - start
        if self.conn is None:
            return
        frame = W.pack(W.DONE, log.index, W.DONE_BODY.size) + W.DONE_BODY.pack(int(log.work_s * 1e9))
        try:  # never blocks: a sender that does not read its reports must not stall the worker (and the stream)
            is_sent = self.conn.send(frame, socket.MSG_DONTWAIT) == len(frame)
        except OSError:  # gone, or its buffer full: reports are advisory
            is_sent = False
        if not is_sent:
            self.conn = None  # a frame cut short ends the sender's reading of reports, nothing else
