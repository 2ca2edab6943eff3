"""Real-model tests of kvfabric.engines (SmolLM2-135M, CPU, short prompts).

The model must be set up (``ensure_model()``; CI does it). Each test uses its own cache
directory; the model is loaded once per session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvfabric import Config
from kvfabric.config import DiskTierConfig
from kvfabric.engines.gguf import ModelError
from kvfabric.engines.hf import HFEngine
from kvfabric.engines.model import ensure_model, load_model
from kvfabric.engines.runtime import BufferCache, layout_for

pytestmark = pytest.mark.slow

PROMPT = ("kvfabric keeps the attention keys and values of long shared prefixes outside the inference engine, "
          "so that a repeated document costs a load instead of a prefill. Chunks of tokens are hashed, stored in "
          "memory or on disk, and loaded back on the next request. Once upon a time, the quick brown fox jumped over")


@pytest.fixture(scope="session")
def smol() -> tuple[Path, object, object]:
    path = ensure_model()
    model, tok = load_model(path)
    return path, model, tok


def make_engine(smol: tuple[Path, object, object], cache_dir: Path, kv_dtype: str = "float32",
                chunk_size: int = 16, tiers: tuple[str, ...] = ("cpu", "disk")) -> HFEngine:
    path, model, tok = smol
    config = Config(chunk_size=chunk_size, tiers=tiers, disk=DiskTierConfig(path=str(cache_dir)))
    return HFEngine(path, model=model, tokenizer=tok, config=config, kv_dtype=kv_dtype)


def full_logits(model: object, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()  # plain HF forward, no kvfabric


def test_ensure_model_is_idempotent_and_accepts_folders(smol, tmp_path):
    path = smol[0]
    assert (path / "config.json").is_file() and list(path.glob("*.safetensors"))
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    assert ensure_model() == path
    assert ensure_model(str(path)) == path.resolve()


def test_fp32_hit_equals_full_prefill(smol, tmp_path):
    model = smol[1]
    with make_engine(smol, tmp_path) as eng:
        ids = eng.encode(PROMPT)
        n = len(ids)
        assert n % 16 != 0 and n > 32
        ref = full_logits(model, ids)
        miss = eng.generate(PROMPT, 12)
        assert miss.hit_tokens == 0 and miss.stored_chunks == n // 16 and miss.prompt_tokens == n
        hit = eng.generate(PROMPT, 12)
        assert hit.hit_tokens == (n // 16) * 16 and hit.stored_chunks == 0
        assert (miss.logits - ref).abs().max().item() < 1e-4
        assert (hit.logits - ref).abs().max().item() < 1e-4
        assert hit.token_ids == miss.token_ids and hit.text == miss.text and len(hit.token_ids) > 0
        with torch.inference_mode():  # greedy output equals transformers' own generate
            out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        assert out[0, n:].tolist() == miss.token_ids

        # a prompt sharing only part of the prefix hits only the shared whole chunks
        other = ids[:40] + eng.encode(" and then something else entirely happened")
        res = eng.generate(other, 4)
        assert res.hit_tokens == 32
        assert (res.logits - full_logits(model, other)).abs().max().item() < 1e-4


def test_full_prompt_hit_recomputes_last_token(smol, tmp_path):
    with make_engine(smol, tmp_path) as eng:
        ids = eng.encode(PROMPT)[:48]  # exactly 3 chunks
        eng.generate(ids, 0)
        res = eng.generate(ids, 3)
        assert res.hit_tokens == 48 and len(res.token_ids) == 3
        assert (res.logits - full_logits(smol[1], ids)).abs().max().item() < 1e-4


def test_tenant_mode_serves_an_engine_without_a_salt_without_the_cache(smol, tmp_path, caplog):
    path, model, tok = smol
    cache = DiskTierConfig(path=str(tmp_path))
    with HFEngine(path, model=model, tokenizer=tok, kv_dtype="float32",
                  config=Config(chunk_size=16, tiers=("cpu", "disk"), disk=cache, tenant_mode=True)) as anon:
        assert anon.is_tenantless and "no cache is used" in caplog.text
        first, again = anon.generate(PROMPT, 2), anon.generate(PROMPT, 2)
        assert first.hit_tokens == again.hit_tokens == 0 and anon.cache.lookup(anon.encode(PROMPT)) == 0
    config = Config(chunk_size=16, tiers=("cpu", "disk"), disk=cache, tenant_mode=True, salt="tenant-a")
    with HFEngine(path, model=model, tokenizer=tok, kv_dtype="float32", config=config) as tenant:
        assert not tenant.is_tenantless
        tenant.generate(PROMPT, 2)
        assert tenant.generate(PROMPT, 2).hit_tokens > 0  # a named tenant keeps its cache


def test_fp16_storage_same_greedy_text_small_kl(smol, tmp_path):
    with make_engine(smol, tmp_path, kv_dtype="float16") as eng:
        assert eng.layout.dtype == "float16"
        miss = eng.generate(PROMPT, 12)
        hit = eng.generate(PROMPT, 12)
        assert hit.hit_tokens > 0
        assert hit.text == miss.text
        p, q = torch.log_softmax(miss.logits, -1), torch.log_softmax(hit.logits, -1)
        kl = torch.sum(p.exp() * (p - q)).item()
        assert kl < 1e-4, kl


def test_seeded_sampling_is_reproducible(smol, tmp_path):
    with make_engine(smol, tmp_path) as eng:
        a = eng.generate(PROMPT, 8, temperature=0.8, seed=7)
        b = eng.generate(PROMPT, 8, temperature=0.8, seed=7)
        assert b.hit_tokens > 0 and a.token_ids == b.token_ids
        with pytest.raises(ValueError, match="seed"):
            eng.generate(PROMPT, 8, temperature=0.8)


def test_cross_process_hit_from_disk(smol, tmp_path):
    path = smol[0]
    script = textwrap.dedent(f"""
        from kvfabric import Config
        from kvfabric.config import DiskTierConfig
        from kvfabric.engines.hf import HFEngine
        cfg = Config(chunk_size=16, tiers=("disk",), disk=DiskTierConfig(path={str(tmp_path / "chunks")!r}))
        with HFEngine({str(path)!r}, config=cfg, kv_dtype="float16") as eng:
            r = eng.generate({PROMPT!r}, 4)
            print("TEXT:" + repr(r.text), r.stored_chunks)
    """)
    env = {**os.environ, "KVFABRIC_HOME": str(tmp_path / "home")}  # model given as a folder: no set-up there
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child_text = proc.stdout.split("TEXT:")[1].rsplit(" ", 1)[0]
    with make_engine(smol, tmp_path / "chunks", kv_dtype="float16", tiers=("disk",)) as eng:
        res = eng.generate(PROMPT, 4)
        n = res.prompt_tokens
        assert res.hit_tokens == (n // 16) * 16 > 0
        assert repr(res.text) == child_text
        assert eng.cache.stats().counters.get("hit.disk", 0) > 0


def test_corrupt_chunk_ends_the_hit_there(smol, tmp_path):
    with make_engine(smol, tmp_path, tiers=("disk",)) as eng:
        ids = eng.encode(PROMPT)
        eng.generate(ids, 0)
        eng.cache.flush()
        chunk = eng.cache.stack.tiers[0].path(eng.cache.keys(ids)[2])  # third chunk: tokens 32..47
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0xFF
        chunk.write_bytes(bytes(data))
        res = eng.generate(ids, 4)
        assert eng.cache.lookup(ids) == (len(ids) // 16) * 16  # re-stored: complete again
        assert res.hit_tokens == 32 and res.stored_chunks == 1
        assert (res.logits - full_logits(smol[1], ids)).abs().max().item() < 1e-4


def test_buffer_cache_writes_in_place():
    lay = layout_for(type("C", (), dict(num_hidden_layers=2, num_key_value_heads=3, head_dim=4,
                                        num_attention_heads=9, hidden_size=36))(), "float32")
    buf = torch.zeros(lay.shape(10))
    cache = BufferCache(buf, length=4)
    k, v = torch.ones(1, 3, 2, 4), torch.full((1, 3, 2, 4), 2.0)
    keys, values = cache.update(k, v, 1)
    assert keys.shape == (1, 3, 6, 4) and keys.data_ptr() == buf[1, 0].data_ptr()
    assert torch.equal(buf[1, 0, :, 4:6], k[0]) and torch.equal(buf[1, 1, :, 4:6], v[0])
    assert cache.get_seq_length(1) == 6 and cache.get_mask_sizes(1, 1) == (7, 0)
    with pytest.raises(RuntimeError, match="full"):
        cache.update(torch.ones(1, 3, 5, 4), torch.ones(1, 3, 5, 4), 1)


def test_bad_inputs(smol, tmp_path, monkeypatch):
    with make_engine(smol, tmp_path) as eng:
        for empty in ("", []):
            with pytest.raises(ValueError, match="empty prompt"):
                eng.generate(empty, 4)
        with pytest.raises(ValueError, match="context"):
            eng.generate([100] * (eng.max_positions + 1), 1)
    not_lm = tmp_path / "bert"
    not_lm.mkdir()
    (not_lm / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    for call in (ensure_model, load_model, HFEngine):
        with pytest.raises(ModelError, match="not a causal language model"):
            call(str(not_lm))
    with pytest.raises(ModelError, match="no config.json"):
        ensure_model(str(tmp_path))
    with pytest.raises(ModelError, match="not a builtin model"):
        ensure_model("./no/such/folder")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE"):
        ensure_model("someone/some-model")
