"""`kvfabric bench codec`: size, quality and speed of every codec on the real model, held-out text.

`--model` picks the model (default SmolLM2-135M; Gemma 3, Qwen2 builtins or a local folder); each row names it
and whether cachegen found a shipped profile for its layout (`profile`: false means the codec ran on statistics
measured per chunk only, with no per-model tables).

Quality: for each document, the context's KV (prefilled once, fp32) is stored through a codec in 256-token
chunks and decoded back; the next 64 tokens of the document are then run teacher-forced on top of it. Against
the uncompressed cache (fp16, what the raw codec stores) it reports top-1 agreement of the next-token
distributions and their mean KL(reference || codec), over all positions of all documents.

Held-out text (`--text`, kvfabric.data.genres, never used by `kvfabric profile cachegen`): `musique` =
MuSiQue passages from ../shared/data/musique_s.json, questions 100.. (profiles calibrate on questions 0-23);
`prose` = the language reference's prose (pydoc_data/topics.py); `code` = stdlib modules (argparse, typing,
_pydecimal, inspect); `mix` = the three in turn. Without the MuSiQue file, `musique` falls back to the demo
document, and the rows say `held_out: false`. `--only cachegen:4-8` measures one codec's levels.

Size: `ratio` = fp16 bytes / coded bytes (whole blobs: chunk header, model side info and all); `bits` per value.
Speed: encode (fp32 KV as the engine holds it -> blob) and decode (blob -> fp32 buffer) in MB/s of fp16 KV, wall
clock with the codec's threads, and per CPU-second (what one core does, robust to a busy machine). The "naive"
baseline is the same codec with the reference coder (kvfabric.research.cachegen_reference: constriction, one call
per channel group) and numpy quantization; `lib_*` is constriction's best case (one bulk call, one model, one
thread). The cachegen level the codec uses for this model when none is given (profile.default_level) is marked
`default: true`.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from kvfabric.bench.common import emit, save_figure, subplots, threads_note
from kvfabric.data import genres
from kvfabric.engines.model import DEFAULT_MODEL
from kvfabric.engines.runtime import layout_for, load_for_inference, next_logprobs, prefill

MUSIQUE = Path(__file__).resolve().parents[4] / "shared" / "data" / "musique_s.json"
CHUNK = 256


# ---- text and quality (also used by bench.stream) ----------------------------------------------------------
def held_out_texts(tok, num_docs: int, num_tokens: int, first: int = 100, text: str = "musique"  # noqa: ANN001
                   ) -> tuple[list[list[int]], bool]:
    """Token ids of `num_docs` held-out documents of `num_tokens` tokens (kvfabric.data.genres: `text` is
    musique, prose, code or mix); musique without its file: the demo document (not held out)."""
    path = Path(os.environ.get("KVFABRIC_MUSIQUE", MUSIQUE))
    musique = path if path.is_file() else None
    if text != "musique" or musique is not None:
        return genres.held_out(lambda s: tok(s)["input_ids"], text, num_docs, num_tokens, musique, first), True
    from kvfabric.data import demo_document
    ids = tok(demo_document())["input_ids"]
    while len(ids) < num_tokens * num_docs:
        ids += ids
    return [ids[i * num_tokens:(i + 1) * num_tokens] for i in range(num_docs)], False


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(ref || got) and whether the argmax agrees."""
    kl = (ref.exp() * (ref - got)).sum(-1).clamp_min(0.0)
    return kl, (ref.argmax(-1) == got.argmax(-1)).float()


# ---- codecs under test ------------------------------------------------------------------------------------------
def codecs(quick: bool, only: str | None = None, default_level: int | None = None
           ) -> list[tuple[str, int, Callable[[], object]]]:
    """Every codec of the registry at every level (quick: its lowest, default and highest), then two cachegen
    variants that show what the profile and the token groups are worth; `only` "name:3-7": one codec's levels."""
    from kvfabric.codec import registry
    from kvfabric.codec.cachegen import CacheGenCodec
    out: list[tuple[str, int, Callable[[], object]]] = [
        (entry.name, lvl, partial(entry.make, lvl)) for entry in registry.CODECS for lvl in entry.levels
        if not quick or lvl in (entry.min_level, entry.default_level, entry.max_level)
        or (entry.name == "cachegen" and lvl == default_level)]
    if only:
        name, _, span = only.partition(":")
        lo, _, hi = span.partition("-")
        keep = range(int(lo), int(hi or lo) + 1) if lo else range(0, 1 << 8)
        return [c for c in out if c[0] == name and c[1] in keep]
    if not quick:
        out += [("cachegen-noprofile", 5, lambda: CacheGenCodec(5, use_profile=False)),
                ("cachegen-G1", 5, lambda: CacheGenCodec(5, group_size=1, use_profile=False))]
    return out


def _chunks(kv: torch.Tensor, n: int) -> list[torch.Tensor]:
    return [kv[:, :, :, s:min(s + CHUNK, n), :] for s in range(0, n, CHUNK)]


def _speed(codec, layout, chunks: list[torch.Tensor], repeats: int) -> dict:  # noqa: ANN001
    """Encode / decode MB/s (fp16 bytes) of all chunks, fp16 in and fp16 out as an engine stores and loads them:
    best of `repeats`, wall and per CPU-second."""
    from kvfabric.codec.format import parse
    key = bytes(32)
    blobs = [codec.encode(c, key, layout) for c in chunks]  # warm-up (kernels compiled, scratch allocated)
    headers = [parse(b) for b in blobs]
    outs = [torch.empty(c.shape, dtype=layout.torch_dtype) for c in chunks]
    fp16 = sum(c.numel() * 2 for c in chunks)
    res = {}
    for name, fn in (("enc", lambda: [codec.encode(c, key, layout) for c in chunks]),
                     ("dec", lambda: [codec.decode(h, memoryview(b), layout, o)
                                      for h, b, o in zip(headers, blobs, outs)])):
        wall, cpu = [], []
        for _ in range(repeats):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
        res[f"{name}_mbps"] = round(fp16 / min(wall) / 1e6, 1)
        res[f"{name}_cpu_mbps"] = round(fp16 / min(cpu) / 1e6, 1)
    return res


def constriction_ceiling(num_symbols: int = 1 << 21) -> dict:
    """The pure library's best case, as MB/s of fp16 KV (one value = one symbol = 2 bytes): one bulk call
    coding symbols drawn from one typical model of the family (sigma 4, ~3.5 bits a symbol) on one thread."""
    import constriction

    from kvfabric.codec.cachegen.family import PROB_SCALE, family
    probs = family().freqs[24] / PROB_SCALE
    sym = np.random.default_rng(0).choice(len(probs), size=num_symbols, p=probs).astype(np.int32)
    model = constriction.stream.model.Categorical(probs, perfect=False)
    w0 = time.perf_counter()
    enc = constriction.stream.queue.RangeEncoder()
    enc.encode(sym, model)
    words = enc.get_compressed()
    w1 = time.perf_counter()
    constriction.stream.queue.RangeDecoder(words).decode(model, num_symbols)
    w2 = time.perf_counter()
    return {"enc_mbps": round(2 * num_symbols / (w1 - w0) / 1e6, 1), "dec_mbps": round(2 * num_symbols / (w2 - w1) / 1e6, 1)}


def run(as_json: bool = False, plot: str | None = None, num_docs: int = 8, ctx_tokens: int = 2048,
        next_tokens: int = 64, quick: bool = False, repeats: int = 3, quality: bool = True,
        model_name: str = DEFAULT_MODEL, text: str = "musique", only: str | None = None) -> list[dict]:
    """quality=False: sizes and speeds only (one document's KV, no teacher-forced evaluation)."""
    from kvfabric.codec.cachegen import CacheGenCodec
    from kvfabric.codec.cachegen import profile as cachegen_profile
    from kvfabric.codec.format import parse
    from kvfabric.research import cachegen_reference
    if quick:
        num_docs, ctx_tokens = min(num_docs, 2), min(ctx_tokens, 1024)
    if not quality:
        num_docs = 1
    model, tok = load_for_inference(model_name)
    layout = layout_for(model.config, "float16")
    has_profile = cachegen_profile.for_layout(layout) is not None
    default_level = cachegen_profile.default_level(layout)
    docs, held_out = held_out_texts(tok, num_docs, ctx_tokens + next_tokens, text=text)
    cands = codecs(quick, only, default_level)
    stats: dict[tuple[str, int], dict] = {(n, lvl): {"kl": [], "top1": [], "bytes": 0, "fp16": 0} for n, lvl, _ in cands}
    speed_chunks: list[torch.Tensor] = []
    key = bytes(32)
    for d, ids in enumerate(docs):
        buf = prefill(model, ids[:ctx_tokens], ctx_tokens)
        ref_kv = buf.half().float()  # the uncompressed cache: what the raw codec stores
        ref = next_logprobs(model, ref_kv, ids, ctx_tokens) if quality else None
        if d == 0:
            speed_chunks = _chunks(buf.to(layout.torch_dtype), ctx_tokens)
        for name, lvl, make in cands:
            codec = make()
            out = torch.empty_like(buf)
            for s, chunk in zip(range(0, ctx_tokens, CHUNK), _chunks(buf, ctx_tokens)):
                blob = codec.encode(chunk, key, layout)
                header = parse(blob, key)
                codec.decode(header, memoryview(blob), layout, out[:, :, :, s:s + chunk.shape[3], :])
                st = stats[(name, lvl)]
                st["bytes"] += len(blob)
                st["fp16"] += chunk.numel() * 2
            if name == "raw" or ref is None:
                kl, top1 = torch.zeros(next_tokens), torch.ones(next_tokens)
            else:
                kl, top1 = compare(ref, next_logprobs(model, out, ids, ctx_tokens))
            stats[(name, lvl)]["kl"].append(kl)
            stats[(name, lvl)]["top1"].append(top1)
    rows = []
    for name, lvl, make in cands:
        st = stats[(name, lvl)]
        kl, top1 = torch.cat(st["kl"]), torch.cat(st["top1"])
        row = {"codec": name, "level": lvl, "ratio": round(st["fp16"] / st["bytes"], 3),
               "bits": round(16 * st["bytes"] / st["fp16"], 3), "top1": round(float(top1.mean()), 4),
               "kl_mean": round(float(kl.mean()), 5), "kl_p99": round(float(kl.quantile(0.99)), 4),
               "positions": int(kl.numel()) if quality else 0, "held_out": held_out, "text": text, "model": model_name,
               "profile": has_profile}
        if not quality:
            row.update(top1=None, kl_mean=None, kl_p99=None)
        row.update(_speed(make(), layout, speed_chunks, repeats))
        rows.append(row)
    naive = _speed(CacheGenCodec(default_level, coder=cachegen_reference), layout, speed_chunks[:2], 1)
    lib = constriction_ceiling()
    for row in rows:
        if row["codec"] == "cachegen" and row["level"] == default_level:
            row["default"] = True
            row["naive_enc_mbps"], row["naive_dec_mbps"] = naive["enc_mbps"], naive["dec_mbps"]
            row["lib_enc_mbps"], row["lib_dec_mbps"] = lib["enc_mbps"], lib["dec_mbps"]
            row["x_lib_dec"] = round(row["dec_mbps"] / max(lib["dec_mbps"], 1e-9), 1)
            row["x_lib_enc"] = round(row["enc_mbps"] / max(lib["enc_mbps"], 1e-9), 1)
    emit(rows, as_json, f"codecs on {model_name} (cachegen profile: {has_profile}), {text}: {len(docs)} docs x "
         f"{ctx_tokens} tokens, next {next_tokens} "
         f"teacher-forced ({threads_note()})",
         ["codec", "level", "ratio", "bits", "top1", "kl_mean", "kl_p99", "enc_mbps", "dec_mbps", "enc_cpu_mbps",
          "dec_cpu_mbps"])
    if plot and quality:
        write_plot(rows, plot)
    return rows


def write_plot(rows: list[dict], path: str) -> None:
    fig, axes = subplots(1, 3, figsize=(15, 4.5))
    for name, marker in (("cachegen", "o-"), ("int8", "s"), ("cachegen-noprofile", "^"), ("cachegen-G1", "v")):
        sel = [r for r in rows if r["codec"] == name]
        if not sel:
            continue
        x = [r["ratio"] for r in sel]
        axes[0].plot(x, [max(r["kl_mean"], 1e-6) for r in sel], marker, label=name)
        axes[1].plot(x, [100 * r["top1"] for r in sel], marker, label=name)
        for r in sel:
            axes[0].annotate(f"{r['level']}", (r["ratio"], max(r["kl_mean"], 1e-6)), fontsize=7)
    axes[0].set_yscale("log")
    axes[0].axhline(0.005, color="grey", ls=":", lw=1)
    axes[1].axhline(99, color="grey", ls=":", lw=1)
    for ax, yl in ((axes[0], "mean KL vs fp16 cache"), (axes[1], "top-1 agreement (%)")):
        ax.set_xlabel("size ratio vs fp16")
        ax.set_ylabel(yl)
        ax.axvline(3.5, color="grey", ls=":", lw=1)
        ax.legend(fontsize=8)
    sel = [r for r in rows if r["codec"] in ("cachegen", "int8", "raw")]
    labels = [f"{r['codec'][:2]}{r['level']}" for r in sel]
    xs = np.arange(len(sel))
    axes[2].bar(xs - 0.2, [r["enc_mbps"] for r in sel], 0.4, label="encode")
    axes[2].bar(xs + 0.2, [r["dec_mbps"] for r in sel], 0.4, label="decode")
    axes[2].set_xticks(xs, labels, rotation=60, fontsize=7)
    axes[2].set_yscale("log")
    axes[2].set_ylabel("MB/s of fp16 KV (wall)")
    axes[2].legend(fontsize=8)
    fig.suptitle("kvfabric codecs on SmolLM2-135M (held-out text)")
    save_figure(fig, path, 110)
