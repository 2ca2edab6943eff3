"""Cross-size linear KV maps (droidspeak.maps) on two tiny random Qwen2-shaped models of different sizes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfabric.blend.runner import LlamaRunner, apply_rope
from kvfabric.droidspeak.maps import fit_maps, kv_features, layer_map, load_maps
from kvfabric.droidspeak.runtime import sender_prefill


def tiny_qwen(seed: int, layers: int, hidden: int, heads: int, kv_heads: int) -> LlamaRunner:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256)
    return LlamaRunner(Qwen2ForCausalLM(config).eval())


@pytest.fixture(scope="module")
def pair():
    return tiny_qwen(0, 2, 32, 4, 1), tiny_qwen(1, 3, 64, 4, 2)  # head_dim 8 (1 KV head) and 16 (2 KV heads)


def test_layer_map_keeps_relative_depth():
    assert layer_map(24, 28)[0] == 0 and layer_map(24, 28)[-1] == 23
    assert layer_map(28, 24) == tuple(round(l * 27 / 23) for l in range(24))
    assert layer_map(2, 3) == (0, 0, 1) and layer_map(5, 1) == (4,)


@torch.inference_mode()
def test_kv_features_unrotate_k(pair):
    _, runner = pair
    ids = list(range(3, 40))
    kv, _ = sender_prefill(runner, ids)
    feats = kv_features(runner, kv, len(ids))  # [L, 2, n, H*D]
    cos, sin = runner.rope(torch.arange(len(ids)))
    k = feats[:, 0].view(3, len(ids), 2, 16).transpose(1, 2).float()
    assert torch.allclose(apply_rope(k, cos, sin), kv[:, 0, :, :len(ids)], atol=1e-5)
    assert torch.equal(feats[:, 1].view(3, len(ids), 2, 16).transpose(1, 2).float(), kv[:, 1, :, :len(ids)])


@torch.inference_mode()
def test_maps_recover_an_exactly_linear_receiver_and_roundtrip(pair, tmp_path):
    """A receiver KV that is a linear function of the sender's (unrotated) KV is recovered exactly: R^2 = 1 and
    apply() rebuilds the receiver's rotated K and V."""
    sender, receiver = pair
    layers = layer_map(sender.num_layers, receiver.num_layers)
    true_w = torch.randn(3, 2, 8 + 1, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    cos_sin = {}

    def receiver_kv(xs: torch.Tensor, n: int) -> torch.Tensor:
        out = torch.empty(receiver.workspace(n).shape)
        if n not in cos_sin:
            cos_sin[n] = receiver.rope(torch.arange(n))
        for l, src in enumerate(layers):
            for kind in (0, 1):
                y = torch.cat([xs[src, kind], torch.ones(n, 1, dtype=xs.dtype)], 1) @ true_w[l, kind]
                y = y.float().view(n, 2, 16).transpose(0, 1)
                out[l, kind] = apply_rope(y, *cos_sin[n]) if kind == 0 else y
        return out

    prompts = [list(range(5 + i, 45 + i)) for i in range(3)]
    data = []
    for ids in prompts:
        kv_a, _ = sender_prefill(sender, ids)
        xs = kv_features(sender, kv_a, len(ids))
        data.append((kv_a, xs, receiver_kv(xs, len(ids))))
    maps = fit_maps(((xs, kv_features(receiver, kv_b, kv_b.shape[3])) for _, xs, kv_b in data), layers, ridge=0.0)
    assert maps.weights.shape == (3, 2, 9, 32) and np.all(maps.r2 > 0.9999)
    maps.save(tmp_path / "maps.npz")
    again = load_maps(tmp_path / "maps.npz")
    assert again.sender_layers == layers and np.array_equal(again.weights, maps.weights)
    held_out = list(range(60, 90))
    kv_a, _ = sender_prefill(sender, held_out)
    want = receiver_kv(kv_features(sender, kv_a, 30), 30)
    out = receiver.workspace(40)
    again.apply(sender, kv_a, 30, receiver, out)
    assert torch.allclose(out[:, :, :, :30], want, atol=1e-3)


def test_fit_maps_needs_data():
    with pytest.raises(ValueError, match="at least one"):
        fit_maps(iter(()), (0,))


@torch.inference_mode()
def test_bench_score_and_summary_against_a_baseline(pair):
    """bench.droidspeak's scoring: the reference scores KL 0 / top-1 1 against itself; another KV scores > 0 and its
    gap is measured against the named baseline method."""
    from types import SimpleNamespace

    from kvfabric.bench.droidspeak import score, summarize
    _, runner = pair
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))
    context, question = list(range(3, 30)), [40, 41, 42]
    rows = []
    ref = None
    for method, kv_scale in (("full", 1.0), ("half", 0.5), ("none", 0.0)):
        kv = runner.workspace(64)
        runner.forward(torch.tensor(context), kv)
        kv[:, :, :, :len(context)] *= kv_scale
        logits_q = runner.logits(runner.forward(torch.tensor(question), kv, start=len(context)))
        scored = score(runner, tok, kv, logits_q, len(context) + 3, 3, ref, 4, 6, set(), ["7"])
        ref = ref or scored
        rows.append({"q": 0, "pair": "p", "method": method, "block": None, "ttft_s": 1.0, **scored.fields,
                     "bytes_per_token": 0.0})
    assert rows[0]["kl"] == 0 and rows[0]["top1"] == 1.0 and len(ref.forced) == 4
    assert rows[2]["kl"] > 0
    summary = {s["method"]: s for s in summarize(rows, ["full", "half", "none"], baseline="none")}
    assert summary["none"]["gap_closed"] == 0 and summary["full"]["gap_closed"] == 1
    assert summary["half"]["gap_closed"] == round(1 - rows[1]["kl"] / rows[2]["kl"], 3)
