"""CacheGen specifics: compiled kernels vs the numpy/constriction reference, coder efficiency, the shipped tables
and profile, level behaviour, token-locality and layer-sensitivity choices, the engine path, and the real model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfabric.codec.cachegen import CacheGenCodec
from kvfabric.codec.cachegen import family as F
from kvfabric.codec.cachegen import profile as P
from kvfabric.codec.cachegen import quant as Q
from kvfabric.codec.cachegen import wire as W
from kvfabric.codec.cachegen.rans import encode_lossy
from kvfabric.codec.cachegen.rans_decode import decode_lossy
from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, parse
from kvfabric.kv.layout import KVLayout
from kvfabric.research import cachegen_reference as R

KEY = bytes(32)


def segment(H: int = 2, T: int = 50, D: int = 8, seed: int = 0) -> dict:
    """One segment's data and parameters, with per-channel scales/offsets, an outlier and smooth channels."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((H, T, D)) * rng.uniform(0.05, 3, (H, 1, D)) + rng.uniform(-2, 2, (H, 1, D)))
    x[:, :, 0] = np.cumsum(rng.standard_normal((H, T)) * 0.05, axis=1)[:, :]  # strong token locality
    x[0, 7, 3] = 400.0
    x = x.astype(np.float32)
    Cn = H * D
    head = x[:, 0, :].reshape(Cn).astype(np.float16).astype(np.float32)
    mu = x[:, 1:].mean(1).reshape(Cn).astype(np.float16).astype(np.float32)
    maxdev = np.abs(x[:, 1:] - mu.reshape(H, 1, D)).max(1).reshape(Cn)
    e = np.maximum(np.ceil(8 * np.log2(0.1 * x.std(1).reshape(Cn) + 1e-9)),
                   np.ceil(8 * np.log2(maxdev * 2 / W.QLIMIT))).astype(np.int64)
    steps = Q.steps_from_exponents(e)
    dflag = (np.arange(Cn) % 3 == 0).astype(np.uint8)
    asteps = np.where(dflag != 0, Q.steps_from_exponents(e - 8), steps).astype(np.float32)
    return dict(x=x, head=head, mu=mu, steps=steps, asteps=asteps, dflag=dflag, e=e)


@pytest.mark.parametrize("G", [1, 3, 10])
def test_kernels_match_the_numpy_reference_bit_for_bit(G):
    s = segment(T=53)
    H, T, D = s["x"].shape
    q = np.empty((T, H * D), np.int32)
    Q.quantize(s["x"], s["head"], s["mu"], s["steps"], s["asteps"], s["dflag"], G, True, q, np.empty((H * D, 2)))
    q_ref = R.quantize_ref(s["x"], s["head"], s["mu"], s["steps"], s["asteps"], s["dflag"], G)
    assert np.array_equal(q[1:], q_ref[1:])
    ia, idx = R.fit_indices(q_ref, s["dflag"], G)
    fam = F.family()
    i_a = np.where(ia != 255, ia, idx).astype(np.int64)
    ka, kd = F.shift_of(i_a).astype(np.int32), F.shift_of(idx).astype(np.int32)
    ja, jd = F.base_of(i_a).astype(np.int32), F.base_of(idx).astype(np.int32)
    words = np.empty(2 * T * H * D + 64, np.uint16)
    start = encode_lossy(q, ja, ka, jd, kd, G, True, fam.fc, fam.rcps, words)
    code = words[start:].copy()
    out = np.full((H, T, D), np.nan, np.float32)
    assert decode_lossy(code, 0, len(code), out, s["head"], s["mu"], s["steps"], s["asteps"], s["dflag"],
                          ja, ka, jd, kd, G, True, fam.slots)
    ref = R.dequantize_ref(q_ref, s["head"], s["mu"], s["steps"], s["asteps"], s["dflag"], G, H, D)
    assert np.array_equal(out, ref)
    assert (np.abs(out - s["x"])[:, 1:] <= s["steps"].reshape(H, 1, D) / 2 * (1 + 1e-6)).all()
    # the same words decode in pure Python (the no-numba fallback) to the same values
    if hasattr(decode_lossy, "py_func") and G == 10:
        out2 = np.full_like(out, np.nan)
        assert decode_lossy.py_func(code, 0, len(code), out2, s["head"], s["mu"], s["steps"], s["asteps"],
                                      s["dflag"], ja, ka, jd, kd, G, True, fam.slots)
        assert np.array_equal(out, out2)


def test_rans_costs_close_to_the_ideal_and_to_constriction():
    s = segment(H=4, T=256, D=16, seed=1)
    H, T, D = s["x"].shape
    G = 10
    q = R.quantize_ref(s["x"], s["head"], s["mu"], s["steps"], s["asteps"], s["dflag"], G)
    ia, idx = R.fit_indices(q, s["dflag"], G)
    fam = F.family()
    # ideal code length under the same models (symbol -log2 p, plus raw bits and escapes)
    ideal = 0.0
    am = R.anchor_mask(T, G)
    for c in range(H * D):
        for rows, i in ((am, int(ia[c]) if ia[c] != 255 else int(idx[c])), (~am & (np.arange(T) > 0), int(idx[c]))):
            k, j = int(F.shift_of(i)), int(F.base_of(i))
            qs = q[rows, c].astype(np.int64)
            half = (1 << (k - 1)) if k else 0
            sym = ((qs + half) >> k) + 128
            ok = (sym >= 1) & (sym <= 255)
            ok[ok] = fam.freqs[j, sym[ok]] > 0
            p = np.where(ok, fam.freqs[j, np.clip(sym, 0, 255)], fam.freqs[j, 0]) / F.PROB_SCALE
            ideal += float(-np.log2(p).sum()) + k * ok.sum() + 16 * (~ok).sum()
    i_a = np.where(ia != 255, ia, idx).astype(np.int64)
    words = np.empty(2 * T * H * D + 64, np.uint16)
    start = encode_lossy(q, F.base_of(i_a).astype(np.int32), F.shift_of(i_a).astype(np.int32),
                           F.base_of(idx).astype(np.int32), F.shift_of(idx).astype(np.int32), G, True, fam.fc,
                           fam.rcps, words)
    rans_bits = 16 * (len(words) - start)
    ref_bits = 32 * len(R.encode_segment(s["x"], s["head"], s["mu"], s["steps"], s["asteps"], s["dflag"], ia.copy(),
                                         idx.copy(), False, G))
    assert rans_bits <= ideal * 1.01 + 256, (rans_bits, ideal)
    assert abs(rans_bits - ref_bits) <= 0.02 * ref_bits + 256, (rans_bits, ref_bits)


def test_reference_coder_stream_decodes_to_the_same_values_and_only_with_that_coder():
    layout = KVLayout(2, 2, 16, "float16")
    kv = torch.randn(layout.shape(70)).half()
    a = CacheGenCodec(5, coder="rans", use_profile=False, threads=1).encode(kv, KEY, layout)
    b = CacheGenCodec(5, coder=R, use_profile=False).encode(kv, KEY, layout)
    out_a, out_b = torch.empty(layout.shape(70)), torch.empty(layout.shape(70))
    CacheGenCodec().decode(parse(a, KEY), memoryview(a), layout, out_a)
    CacheGenCodec(coder=R).decode(parse(b, KEY), memoryview(b), layout, out_b)
    assert torch.equal(out_a, out_b)
    assert abs(len(a) - len(b)) <= 0.03 * len(a) + 64
    with pytest.raises(ChunkFormatError, match="reference coder"):  # the runtime codec has no reference coder
        CacheGenCodec().decode(parse(b, KEY), memoryview(b), layout, out_b)
    with pytest.raises(ValueError, match="coder"):
        CacheGenCodec(coder="constriction")


def test_shipped_family_is_the_generated_one():
    fam = F.family()
    assert np.array_equal(fam.freqs, F.generate().astype(np.int32))
    assert (fam.freqs.sum(1) == F.PROB_SCALE).all() and (fam.freqs[:, F.ESCAPE] > 0).all()
    # every model index maps to a base table and a raw shift that the kernels support
    idx = np.arange(F.NUM_SCALES)
    assert (F.base_of(idx) >= 0).all() and (F.base_of(idx) < F.NUM_BASE).all() and (F.shift_of(idx) <= F.MAX_SHIFT).all()
    assert np.allclose(F.sigma_of(F.base_of(idx)) * 2.0 ** F.shift_of(idx), F.sigma_of(idx))


def test_steps_are_exact_powers():
    e = np.arange(-128, 128)
    assert np.array_equal(Q.steps_from_exponents(e), np.float32(2.0) ** (e / 8.0).astype(np.float32)) or \
        np.allclose(Q.steps_from_exponents(e), 2.0 ** (e / 8.0), rtol=1e-6)
    assert Q.steps_from_exponents(np.array([8]))[0] == 2.0 and Q.steps_from_exponents(np.array([-16]))[0] == 0.25


def test_levels_trade_size_for_error():
    layout = KVLayout(3, 2, 16, "float16")
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(layout.shape(128), generator=g) * torch.rand(3, 2, 2, 1, 16, generator=g) * 3).half()
    sizes, errs = [], []
    for level in range(1, 10):
        codec = CacheGenCodec(level, use_profile=False, threads=1)
        blob = codec.encode(kv, KEY, layout)
        out = torch.empty(layout.shape(128))
        codec.decode(parse(blob, KEY), memoryview(blob), layout, out)
        sizes.append(len(blob))
        errs.append(float((out - kv.float()).pow(2).mean()))
    assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes
    assert all(a < b for a, b in zip(errs, errs[1:])), errs
    lossless = CacheGenCodec(0).encode(kv, KEY, layout)
    assert len(lossless) < kv.numel() * 2  # the exponent byte compresses


@pytest.mark.parametrize("level", [0, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_output_dtype_gets_the_float32_decode_rounded_once(dtype, level):
    """fp16 outputs are written by the decoders themselves (F16C rounding, or the fp16 bits as they are); they
    must equal the float32 decode cast by torch, bit for bit, for every layout dtype, lossy and lossless, in
    strided views too; raw (non-finite) segments included."""
    layout = KVLayout(4, 2, 16, dtype)
    g = torch.Generator().manual_seed(3)
    kv = (torch.randn(layout.shape(70), generator=g) * 40).to(layout.torch_dtype)
    kv[1, 0, 0, 5, 3] = float("inf")  # this segment is stored raw
    codec = CacheGenCodec(level, use_profile=False, threads=2)
    blob = codec.encode(kv, KEY, layout)
    header = parse(blob, KEY)
    ref = torch.empty(layout.shape(70))
    codec.decode(header, memoryview(blob), layout, ref)
    for out_dtype in (torch.float16, torch.bfloat16):
        big = torch.full((4, 2, 2, 90, 16), float("nan"), dtype=out_dtype)
        out = big[:, :, :, 10:80]  # a strided view, as the engine's paged buffers give
        codec.decode(header, memoryview(blob), layout, out)
        assert torch.equal(out, ref.to(out_dtype)), out_dtype
        assert big[:, :, :, :10].isnan().all() and big[:, :, :, 80:].isnan().all()


def test_token_locality_and_layer_sensitivity_choices():
    layout = KVLayout(6, 1, 8, "float32")
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(layout.shape(200), generator=g)
    t = torch.arange(200, dtype=torch.float32)[:, None]
    kv[:, :, :, :, :4] = 3 + torch.sin(t / 60 + torch.arange(4)) + 0.01 * torch.randn(6, 2, 1, 200, 4, generator=g)
    codec = CacheGenCodec(5, use_profile=False, threads=1)
    blob = codec.encode(kv, KEY, layout)
    pay = np.frombuffer(bytes(blob), np.uint8, offset=HEADER_BYTES)
    rd = W.Reader(pay)
    rd.take(W.PRELUDE.size)
    kinds = rd.array("u1", (12,))
    assert (kinds == W.SEG_EMBEDDED).all()
    rd.array("<u4", (12,))
    rd.take(12 * 8 * 4)
    rd.take(12 * 8 * 2)
    e = rd.array("i1", (12, 8)).astype(int)
    ia = rd.array("u1", (12, 8))
    assert (ia[:, :4] != 255).mean() >= 0.9, "smooth channels should be coded as anchor + deltas"
    assert (ia[:, 4:] == 255).mean() >= 0.9, "white-noise channels should be coded flat"
    # first third of the layers (segments 0-3): steps half the size for the same data statistics
    bound = codec.error_bound(kv, blob, layout)
    shallow, deep = bound[:2, :, :, 1:, 4:].mean(), bound[2:, :, :, 1:, 4:].mean()
    assert shallow < 0.75 * deep
    assert e.shape == (12, 8)


def test_non_finite_segments_are_stored_raw():
    layout = KVLayout(2, 1, 8, "float16")
    kv = torch.randn(layout.shape(30)).half()
    kv[1, 0, 0, 5, 3] = float("inf")
    kv[0, 1, 0, 9, 1] = float("nan")
    codec = CacheGenCodec(5, threads=1)
    blob = codec.encode(kv, KEY, layout)
    out = torch.empty(layout.shape(30))
    codec.decode(parse(blob, KEY), memoryview(blob), layout, out)
    assert torch.equal(out[1, 0], kv[1, 0].float()) and torch.isnan(out[0, 1, 0, 9, 1])
    assert (out[0, 0] - kv[0, 0].float()).abs().max() < 1.0


def test_profile_round_trip_and_missing_profile(monkeypatch, tmp_path):
    layout = KVLayout(2, 1, 8, "float16")
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(layout.shape(64), generator=g).numpy() for _ in range(3)]
    prof = P.build(layout, np.full((2, 2, 1, 8), 1e-2), chunks, meta={"test": True})
    P.save(prof, tmp_path / "p.npz")
    loaded = P.load(tmp_path / "p.npz")
    assert loaded.id == prof.id and loaded.meta == {"test": True}
    monkeypatch.setattr(P, "shipped", lambda: {layout.fingerprint: loaded})
    kv = torch.from_numpy(chunks[0]).half()
    codec = CacheGenCodec(5, threads=1)
    blob = codec.encode(kv, KEY, layout)
    header = parse(blob, KEY)
    out = torch.empty(layout.shape(64))
    codec.decode(header, memoryview(blob), layout, out)
    assert ((out - kv.float()).abs() <= codec.error_bound(kv, blob, layout)).all()
    kinds = np.frombuffer(bytes(blob), np.uint8, count=4, offset=HEADER_BYTES + W.PRELUDE.size)
    assert (kinds == W.SEG_PROFILE).all()
    monkeypatch.setattr(P, "shipped", lambda: {})
    with pytest.raises(ChunkFormatError, match="profile"):
        codec.decode(header, memoryview(blob), layout, out)


def test_shipped_profile_matches_its_layout():
    for fp, prof in P.shipped().items():
        assert prof.fingerprint == fp and prof.e_base.ndim == 2 and prof.id != 0
        assert prof.meta.get("model")


def test_engine_path_with_cachegen(tmp_path):
    from kvfabric import CacheEngine, Config
    layout = KVLayout(2, 2, 16, "float16")
    engine = CacheEngine(Config(chunk_size=32, tiers=("cpu",), codec="cachegen:5"), layout, "m")
    tokens = list(range(100))
    kv = torch.randn(layout.shape(100)) * 2
    assert engine.store(tokens, kv) == 3
    key = engine.keys(tokens)[0]
    stored = engine.stack.tiers[0].get(key)  # the configured codec encoded it
    assert parse(stored, key).codec_id == CacheGenCodec.codec_id and len(stored) < layout.num_bytes(32)
    out = torch.zeros(layout.shape(100))
    got = engine.retrieve(tokens, out=out)
    assert got.shape[3] == 96 and (got - kv[:, :, :, :96]).abs().max() < 0.5
    engine.close()


@pytest.mark.slow
def test_real_model_next_token_survives_default_level():
    from kvfabric.bench.codec import compare
    from kvfabric.engines.runtime import layout_for, load_for_inference, next_logprobs, prefill
    model, tok = load_for_inference()
    ids = tok("The lighthouse keeper climbed the stairs every night to light the lamp. " * 40)["input_ids"][:260]
    buf = prefill(model, ids[:256], 256)
    layout = layout_for(model.config)
    codec = CacheGenCodec()
    blob = codec.encode(buf, KEY, layout)
    out = torch.empty_like(buf)
    codec.decode(parse(blob, KEY), memoryview(blob), layout, out)
    ref = next_logprobs(model, buf.half().float(), ids, 256)
    kl, top1 = compare(ref, next_logprobs(model, out, ids, 256))
    assert len(blob) < buf.numel() * 2 / 2.5  # SmolLM2 default L4: ~2.8x
    assert float(kl.mean()) < 0.02 and float(top1.mean()) >= 0.75
