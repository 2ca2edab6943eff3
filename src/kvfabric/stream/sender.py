"""Sending end: a prompt's chunks, pre-encoded at every option, sent one by one as the policy decides.

`prepare(...)` encodes every chunk with the raw codec, at each cachegen level ("L<level>") and at each video
level ("V<level>"), as a store that keeps chunks at several levels would (CacheGen stores each chunk at every
level): the send loop only picks and sends bytes, so its timing is the link's. With `time_decode`, it also
measures what one chunk of each option costs the receiver to decode (ResolutionPolicy needs it).
`send_prompt(sock, prompt, policy)` sends HELLO, then each chunk as KV or TOKENS, then END, feeding the policy each
chunk's seconds on the link: its bytes at the rate the kernel saw acknowledged (stream/meter.py), or, where TCP_INFO
is not available, the seconds its send took. It asks the receiver to report each chunk's work (DONE frames) and
hands those to the policy (`observe_work`) as they arrive (`WorkReports`): on a connection of its own, after END it
also reads those still on their way, until every chunk is reported, the receiver closed, or `report_wait_s` passed;
on a connection that carries several streams (`reports=` the connection's), nothing waits: a stream's late reports
reach its policy while the next one is sent.
"""
from __future__ import annotations

import select
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvfabric.codec.base import LatentCodecError, check_codec
from kvfabric.codec.cachegen import CacheGenCodec
from kvfabric.codec.format import parse
from kvfabric.codec.raw import RawCodec
from kvfabric.codec.registry import parse_codec
from kvfabric.kv.hashing import KeySpace
from kvfabric.kv.layout import KVLayout
from kvfabric.stream import protocol as W
from kvfabric.stream.meter import LinkMeter
from kvfabric.stream.policy import RAW, RECOMPUTE, Choice


@dataclass
class PreparedPrompt:
    tokens: list[int]
    layout: KVLayout
    chunk_size: int
    model_id: str
    keys: list[bytes]
    blobs: dict[str, list[bytes]]  # option -> blob of each chunk
    encode_s: dict[str, float] = field(default_factory=dict)  # option -> seconds to encode every chunk
    decode_s: dict[str, float] = field(default_factory=dict)  # option -> mean seconds to decode one chunk

    @property
    def num_chunks(self) -> int:
        return len(self.keys)

    def span(self, i: int) -> tuple[int, int]:
        return i * self.chunk_size, min((i + 1) * self.chunk_size, len(self.tokens))

    def wire_sizes(self, option: str) -> list[int]:
        if option == RECOMPUTE:
            return [W.FRAME.size + 4 * (e - s) for s, e in map(self.span, range(self.num_chunks))]
        return [W.FRAME.size + len(b) for b in self.blobs[option]]


def prompt_keys(tokens: Sequence[int], layout: KVLayout, model_id: str, chunk_size: int) -> list[bytes]:
    return [bytes(k) for k in KeySpace.of(model_id, layout, chunk_size, include_partial=True).keys(tokens)]


def prepare(tokens: Sequence[int], kv: torch.Tensor, layout: KVLayout, model_id: str, chunk_size: int,
            levels: Sequence[int] = (1, 3, 5, 7, 9), threads: int | None = None, video_levels: Sequence[int] = (),
            time_decode: bool = False) -> PreparedPrompt:
    """kv [L, 2, H, >= len(tokens), D]: the prompt's KV. Encodes every chunk raw, at each cachegen level and at each
    video level (PyAV needed only for those). A latent (MLA) layout streams raw only: cachegen and video code K
    and V (ValueError for levels of theirs)."""
    for name in [name for name, wanted in (("cachegen", levels), ("video", video_levels)) if wanted]:
        try:  # the registry says which codecs code latents
            check_codec(parse_codec(name), layout)
        except LatentCodecError:
            raise ValueError("a latent (MLA) prompt streams raw: pass levels=() and no video_levels") from None
    tokens = [int(t) for t in tokens]
    keys = prompt_keys(tokens, layout, model_id, chunk_size)
    codecs: dict[str, object] = {RAW: RawCodec()}
    codecs.update({f"L{lvl}": CacheGenCodec(lvl, threads=threads) for lvl in levels})
    if video_levels:
        from kvfabric.codec.video import VideoCodec
        codecs.update({f"V{lvl}": VideoCodec(lvl) for lvl in video_levels})
    blobs: dict[str, list[bytes]] = {}
    encode_s: dict[str, float] = {}
    decode_s: dict[str, float] = {}
    for name, codec in codecs.items():
        start = time.perf_counter()
        blobs[name] = [bytes(codec.encode(kv[:, :, :, i * chunk_size:min((i + 1) * chunk_size, len(tokens)), :],  # type: ignore[attr-defined]
                                          key, layout)) for i, key in enumerate(keys)]
        encode_s[name] = time.perf_counter() - start
        if time_decode:
            decode_s[name] = _decode_seconds(codec, blobs[name], layout)
    return PreparedPrompt(tokens, layout, chunk_size, model_id, keys, blobs, encode_s, decode_s)


def _decode_seconds(codec, blobs: list[bytes], layout: KVLayout) -> float:  # noqa: ANN001
    """Mean seconds to decode one of `blobs` into a float32 buffer whose pages are already mapped, as the
    receiver's is (after a warm-up)."""
    headers = [parse(b) for b in blobs]
    out = torch.zeros(headers[0].shape)
    codec.decode(headers[0], memoryview(blobs[0]), layout, out)
    start = time.perf_counter()
    for h, b in zip(headers, blobs):
        codec.decode(h, memoryview(b), layout, out[:, :, :, :h.num_tokens])
    return (time.perf_counter() - start) / len(blobs)


@dataclass
class SendReport:
    choices: list[Choice]
    wire_bytes: list[int]
    send_s: list[float]
    total_s: float
    work_s: dict[int, float] = field(default_factory=dict)  # chunk index -> the receiver's report (on a shared
    # connection, reports that come after the stream ended are added as they are read)


def send_prompt(sock: socket.socket, prompt: PreparedPrompt, policy, t0: float | None = None,  # noqa: ANN001
                reports: WorkReports | None = None, report_wait_s: float = 1.0) -> SendReport:
    """Send `prompt` over `sock` (e.g. a ThrottledSocket). t0: the request's start (perf_counter) for the
    policy's time budget; default now. reports: the connection's, where it carries several streams (their
    reports then reach each stream's policy as they come, and nothing waits for them); without, this stream's
    own, read until every chunk is reported (or report_wait_s)."""
    t0 = time.perf_counter() if t0 is None else t0
    W.send_frame(sock, W.HELLO, 0, W.hello_body(prompt.tokens, prompt.chunk_size, prompt.model_id, prompt.layout,
                                                report_work=True))
    options = [o for o in prompt.blobs] + [RECOMPUTE]
    sizes = {o: prompt.wire_sizes(o) for o in options}
    choices, wire, secs = [], [], []
    meter, rate = LinkMeter(sock), None  # the link's pace, not the send calls' (stream/meter.py says why)
    is_own = reports is None
    reports = WorkReports(sock) if reports is None else reports
    work_s: dict[int, float] = {}
    for i in range(prompt.num_chunks):
        reports.poll(0.0)
        choice = policy.choose({o: sizes[o][i:] for o in options}, time.perf_counter() - t0, meter.queued_bytes())
        start = time.perf_counter()
        if choice.option == RECOMPUTE:
            s, e = prompt.span(i)
            body = np.asarray(prompt.tokens[s:e], dtype="<u4").tobytes()
            n = W.send_frame(sock, W.TOKENS, i, body)
        else:
            blob = prompt.blobs[choice.option][i]
            level = 0 if choice.option == RAW else int(choice.option[1:])
            n = W.send_frame(sock, W.KV, i, blob, level)
        took = time.perf_counter() - start
        reports.sent(i, choice.option, policy, work_s)
        if choice.option != RECOMPUTE:
            rate = meter.rate_bps() or rate  # a reading too soon after the last one keeps the last rate
            if not rate and meter.is_available:  # no reading yet: the policy's prior, never the send call's time
                rate = getattr(policy, "estimate_bps", lambda: None)()
            policy.observe(n, n / rate if rate else took)
        choices.append(choice)
        wire.append(n)
        secs.append(took)
    W.send_frame(sock, W.END, prompt.num_chunks)
    total_s = time.perf_counter() - t0
    until = time.monotonic() + report_wait_s
    while is_own and reports.num_pending and time.monotonic() < until:
        reports.poll(until - time.monotonic())
    return SendReport(choices, wire, secs, total_s, work_s)


class WorkReports:
    """The receiver's DONE frames on a sender's connection, read without blocking the send loop (`poll(0)`) and
    handed to the policy of the chunk each one reports, as (the option it went as, seconds). One per connection:
    a receiver reports chunks in the order it got them (one worker), so the reports of a stream that has ended
    still reach its policy while the next stream on the connection is sent. Anything else from the receiver ends
    the reading: reports are advisory, and a receiver that misbehaves loses its say, not the stream."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._pending: deque[tuple[int, str, object, dict]] = deque()  # (index, option, policy, its stream's
        # work_s) of each chunk sent and not reported yet
        self._buf = bytearray()
        self._is_open = True

    def sent(self, index: int, option: str, policy, work_s: dict[int, float]) -> None:  # noqa: ANN001
        if self._is_open:
            self._pending.append((index, option, policy, work_s))

    @property
    def num_pending(self) -> int:
        return len(self._pending) if self._is_open else 0

    def poll(self, timeout_s: float) -> None:
        """Hand on what has arrived, waiting up to timeout_s for it."""
        try:
            if not self._is_open or not select.select([self.sock], [], [], max(0.0, timeout_s))[0]:
                return
            data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ValueError):  # reset, or closed under us
            data = b""
        self._is_open = bool(data)
        self._buf += data
        size = W.FRAME.size + W.DONE_BODY.size
        while self._is_open and len(self._buf) >= size:
            magic, kind, _, _, index, length = W.FRAME.unpack_from(self._buf)
            self._is_open = magic == W.MAGIC and kind == W.DONE and length == W.DONE_BODY.size \
                and bool(self._pending) and self._pending[0][0] == index
            if self._is_open:
                seconds = W.DONE_BODY.unpack_from(self._buf, W.FRAME.size)[0] / 1e9
                del self._buf[:size]
                _, option, policy, work_s = self._pending.popleft()
                work_s[index] = seconds
                policy.observe_work(option, seconds)  # type: ignore[attr-defined]
