"""The video codec beyond the shared contract (tests/test_codec_contract.py runs that): frame geometry, frame-wise
restore, the memory bound on a long context, token-0 exceptions, profile steps, hardware-decoder selection, and
clear errors without PyAV or without a backend's FFmpeg codec."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch

from kvfabric.codec.format import ChunkFormatError, parse
from kvfabric.codec.video import VideoCodec, VideoUnavailable
from kvfabric.codec.video import backends as B
from kvfabric.codec.video.frames import Geometry, balanced_tile
from kvfabric.kv.layout import KVLayout

KEY = bytes(range(32))


def kv_like(layout: KVLayout, num_tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    L, _, H, T, D = layout.shape(num_tokens)
    base = torch.randn(L, 2, H, 1, D, generator=g) * 2
    drift = torch.cumsum(torch.randn(L, 2, H, T, D, generator=g) * 0.1, dim=3)  # token locality
    return (base + drift + 0.3 * torch.randn(L, 2, H, T, D, generator=g)).to(layout.torch_dtype)


def round_trip(codec: VideoCodec, kv: torch.Tensor, layout: KVLayout, out: torch.Tensor) -> bytearray:
    blob = codec.encode(kv, KEY, layout)
    codec.decode(parse(blob, KEY), memoryview(blob), layout, out)
    return blob


def test_geometry_tiles_long_contexts_into_bounded_frames():
    g = Geometry(8, 3, 64, 5000, balanced_tile(5000, 1024), 3, False)
    assert g.tile == 1000 and g.num_tiles == 5 and g.num_frames == 40 and (g.rows, g.width) == (64, 1000)
    spans = [g.frame(i) for i in range(g.num_frames)]
    assert spans[0] == (0, 0, 1000) and spans[8] == (0, 1000, 2000) and spans[-1] == (7, 4000, 5000)
    odd = Geometry(2, 3, 5, 7, 7, 1, True)  # x264: even frame sizes, padded
    assert (odd.rows, odd.width) == (16, 8)


def test_frames_are_restored_one_at_a_time(monkeypatch):
    """When the decoder hands over frame i + 1, frame i is already in `out` (and nothing later is)."""
    layout = KVLayout(3, 2, 8, "float16")
    kv = kv_like(layout, 40)
    codec = VideoCodec(0, tile=16)
    blob = codec.encode(kv, KEY, layout)
    header = parse(blob, KEY)
    out = torch.full(layout.shape(40), float("nan"), dtype=torch.float16)
    g = Geometry(6, 2, 8, 40, balanced_tile(40, 16), 3, False)
    real = B.decode_frames
    seen = []

    def watching(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        for i, planes in enumerate(real(*args, **kwargs)):
            if i:
                s, a, b = g.frame(i - 1)
                assert torch.equal(out[s // 2, s % 2, :, a:b], kv[s // 2, s % 2, :, a:b]), f"frame {i - 1} not restored"
                s, a, b = g.frame(i)
                assert out[s // 2, s % 2, :, a:b].isnan().all(), f"frame {i} written before it was decoded"
            seen.append(i)
            yield planes
    monkeypatch.setattr(B, "decode_frames", watching)
    codec.decode(header, memoryview(blob), layout, out)
    assert seen == list(range(g.num_frames)) and torch.equal(out, kv)


@pytest.mark.parametrize("level", [0, 6])
def test_long_context_decodes_within_the_stated_memory_bound(level, tmp_path):
    """A 32k-token chunk (34 MB of fp16 KV) decodes with a few frames of extra memory: tracemalloc in this process,
    the resident set's high-water mark in a fresh one (FFmpeg's own buffers included)."""
    layout = KVLayout(2, 2, 64, "float16")
    T = 32768
    kv = kv_like(layout, T, seed=1)
    kv_bytes = kv.numel() * 2
    codec = VideoCodec(level)
    blob = codec.encode(kv, KEY, layout)
    bound = codec.decode_scratch_bytes(kv.shape)
    assert bound < kv_bytes / 5
    out = torch.zeros(kv.shape, dtype=torch.float16)
    tracemalloc.start()
    codec.decode(parse(blob, KEY), memoryview(blob), layout, out)
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert traced <= bound, f"decode allocated {traced / 1e6:.1f} MB, stated bound {bound / 1e6:.1f} MB"
    err = (out.float() - kv.float()).abs()
    assert torch.equal(out, kv) if level == 0 else bool((err <= codec.error_bound(kv, blob, layout)).all())
    (tmp_path / "long").write_bytes(blob)
    (tmp_path / "warm").write_bytes(codec.encode(kv[:, :, :, :256], KEY, layout))
    code = ("import json, sys; from kvfabric.bench.video import probe_memory; "
            "print(json.dumps(probe_memory(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])))")
    setting = json.dumps({"codec": "video", "level": level, "backend": "utvideo", "bits": 8})
    done = subprocess.run([sys.executable, "-c", code, setting, str(tmp_path / "long"), str(tmp_path / "warm")],
                          capture_output=True, text=True, check=True)
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    slack_mb = 8  # the allocator's arenas and FFmpeg's per-context buffers, independent of the context length
    assert probe["rss_mb"] <= bound / 1e6 + slack_mb, probe
    assert probe["traced_mb"] <= bound / 1e6, probe


def test_sink_token_is_kept_exact_without_widening_its_channels():
    layout = KVLayout(2, 2, 16, "float16")
    kv = kv_like(layout, 64, seed=4)
    sunk = kv.clone()
    sunk[:, :, :, 0, :5] = 300.0  # an attention sink: token 0 far outside its channels' range
    codec = VideoCodec(5, use_profile=False)
    out = torch.empty(kv.shape)
    blob = round_trip(codec, sunk, layout, out)
    assert torch.equal(out[:, :, :, 0], sunk[:, :, :, 0].float())  # token 0: exact
    assert bool(((out - sunk.float()).abs() <= codec.error_bound(sunk, blob, layout)).all())
    plain = codec.encode(kv, KEY, layout)
    assert len(blob) < len(plain) * 1.1, "the sink should not cost the whole chunk precision"
    bound = codec.error_bound(sunk, blob, layout)[:, :, :, 1:]
    assert float(bound.max()) < 1.0, "steps were widened to the sink's range"


def test_non_finite_segments_are_stored_raw():
    layout = KVLayout(2, 1, 8, "float16")
    kv = kv_like(layout, 30)
    kv[1, 0, 0, 5, 3] = float("inf")
    kv[0, 1, 0, 9, 1] = float("nan")
    out = torch.empty(kv.shape)
    round_trip(VideoCodec(5), kv, layout, out)
    assert torch.equal(out[1, 0], kv[1, 0].float()) and torch.isnan(out[0, 1, 0, 9, 1])
    assert (out[0, 0] - kv[0, 0].float()).abs().max() < 1.0


def test_profile_steps_travel_as_the_raised_ones_only(monkeypatch):
    """With the shipped SmolLM2 profile the stream names it and carries only the channels whose step had to grow;
    a decoder without that profile refuses the chunk (a miss), never guesses."""
    from kvfabric.codec.cachegen import profile as CP
    layout = KVLayout(30, 3, 64, "float16")
    assert CP.for_layout(layout) is not None
    kv = kv_like(layout, 32, seed=2)
    with_profile, without = VideoCodec(6), VideoCodec(6, use_profile=False)
    blob = with_profile.encode(kv, KEY, layout)
    assert len(blob) < len(without.encode(kv, KEY, layout)) + 60 * 192 // 2  # no dense exponent table
    out = torch.empty(kv.shape)
    with_profile.decode(parse(blob, KEY), memoryview(blob), layout, out)
    assert bool(((out - kv.float()).abs() <= with_profile.error_bound(kv, blob, layout)).all())
    monkeypatch.setattr(CP, "by_id", lambda pid: None)
    with pytest.raises(ChunkFormatError, match="profile"):
        with_profile.decode(parse(blob, KEY), memoryview(blob), layout, out)


def test_levels_trade_size_for_error():
    layout = KVLayout(4, 2, 32, "float16")
    kv = kv_like(layout, 256, seed=7)
    sizes, errors = [], []
    for level in (0, 1, 4, 7, 9):
        out = torch.empty(kv.shape)
        sizes.append(len(round_trip(VideoCodec(level), kv, layout, out)))
        errors.append(float((out - kv.float()).abs().mean()))
    assert sizes == sorted(sizes, reverse=True) and errors == sorted(errors)
    assert sizes[0] < kv.numel() * 2 and errors[0] == 0.0


def test_hardware_decoder_selection():
    opened = []

    def probe(ok):  # noqa: ANN001, ANN202
        def fn(device: str) -> None:
            opened.append(device)
            if device not in ok:
                raise RuntimeError("no such device")
        return fn
    assert B.select_hwaccel(B.X264, "auto", ["cuda", "vaapi"], probe({"cuda"})) == "cuda"
    assert B.select_hwaccel(B.X264, "auto", ["cuda", "vaapi"], probe({"vaapi"})) == "vaapi"
    assert B.select_hwaccel(B.X264, "auto", ["vaapi", "qsv"], probe({"qsv"})) is None  # only NVDEC / VAAPI
    assert B.select_hwaccel(B.X264, "auto", [], probe({"cuda"})) is None
    opened.clear()
    assert B.select_hwaccel(B.X264, "cpu", ["cuda"], probe({"cuda"})) is None and not opened
    assert B.select_hwaccel(B.X264, "vaapi", ["cuda", "vaapi"], probe({"cuda", "vaapi"})) == "vaapi"
    assert B.select_hwaccel(B.UTVIDEO, "auto") is None  # Ut Video has no hardware decoder anywhere
    assert VideoCodec(6).hardware_decoder() is None  # and this machine has no device: the CPU, the default


def test_a_backend_missing_from_ffmpeg_is_a_clear_error(monkeypatch):
    broken = dataclasses.replace(B.UTVIDEO, encoder="no-such-encoder")
    monkeypatch.setitem(B.BACKENDS, "utvideo", broken)
    with pytest.raises(VideoUnavailable, match="no-such-encoder.*pip install"):
        VideoCodec(6)


def test_without_pyav_import_works_and_the_codec_names_the_package():
    code = """
import sys
sys.modules["av"] = None  # makes `import av` fail, as on a machine without PyAV
import kvfabric
from kvfabric.codec.format import ChunkFormatError
from kvfabric.codec.registry import codec_for_id, parse_codec
from kvfabric.config import Config
Config(codec="video:6")
parse_codec("cachegen").make()
try:
    parse_codec("video").make()  # chosen in config: an ImportError naming the package
except ImportError as exc:
    print("ERR", exc)
try:
    codec_for_id(3)  # a stored video chunk read here: a miss for the caller, with the same reason
except ChunkFormatError as exc:
    print("MISS", exc)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ERR", "MISS"))]
    assert [line.split()[0] for line in lines] == ["ERR", "MISS"], done.stdout
    assert all("PyAV" in line and "pip install" in line for line in lines), done.stdout


def test_engine_stores_and_serves_video_chunks(tmp_path):
    from kvfabric import CacheEngine, Config
    from kvfabric.config import DiskTierConfig
    layout = KVLayout(2, 2, 16, "float16")
    tokens, kv = list(range(96)), kv_like(layout, 96, seed=5)
    config = Config(chunk_size=32, tiers=("disk",), codec="video:0", disk=DiskTierConfig(path=str(tmp_path)))
    with CacheEngine(config, layout, "m") as engine:
        assert engine.store(tokens, kv) == 3
        engine.flush()
    with CacheEngine(config, layout, "m") as engine:
        assert torch.equal(engine.retrieve(tokens), kv)


def test_frames_of_another_size_or_count_are_refused():
    """H.264 carries its frame size: packets of 24-token frames in a stream that says 20 are refused, as are
    fewer frames than the stream says."""
    frames = [[np.full((16, 24), 100 + i, np.uint8)] for i in range(3)]
    extradata, packets = B.encode_frames(B.X264, False, 8, 24, 16, frames)
    decoded = list(B.decode_frames(B.X264, 8, 24, 16, extradata, packets, 3))
    assert len(decoded) == 3
    with pytest.raises(ChunkFormatError, match="not the stream's"):
        list(B.decode_frames(B.X264, 8, 20, 16, extradata, packets, 3))
    with pytest.raises(ChunkFormatError, match="expected 4"):
        list(B.decode_frames(B.X264, 8, 24, 16, extradata, packets, 4))


@pytest.mark.slow
def test_bench_video_smoke():
    """`kvfabric bench video --quick --docs 1 --json` on the real model: every setting has the issue's fields, the
    lossless modes are exact, and the video modes decode a 2k-token context with a small share of its size."""
    from click.testing import CliRunner

    from kvfabric.apps.cli import main
    result = CliRunner().invoke(main, ["bench", "video", "--quick", "--docs", "1", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    fields = {"codec", "mode", "ratio", "top1", "kl_mean", "enc_mbps", "dec_mbps", "dec_mbps_1t", "peak_mem_mb",
              "context_tokens", "exact"}
    assert rows and all(fields <= set(r) for r in rows)
    assert {r["codec"] for r in rows} == {"video", "cachegen", "int8", "raw"}
    lossless = [r for r in rows if r["mode"].startswith("lossless") or r["codec"] == "raw"]
    assert len(lossless) == 3 and all(r["exact"] and r["kl_mean"] == 0.0 for r in lossless)
    video = [r for r in rows if r["codec"] == "video"]
    assert all(r["ratio"] > 1 and r["peak_mem_share"] < 0.25 for r in video)
