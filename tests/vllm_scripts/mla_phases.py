"""Subprocess driver for tests/test_vllm_mla.py: one vLLM engine on a DeepSeek-V2-architecture model (multi-head
latent attention) per invocation, results as JSON.

    python mla_phases.py PHASE --model DIR --cache DIR --out FILE [--prompts FILE] [--names p1,p2]

The model is small and made here (`model`: transformers' DeepseekV2ForCausalLM from a config, weights drawn with
a fixed seed, saved as safetensors), since no MLA model ships as a PyPI package: what these phases check is that
vLLM's MLA latent cache (CPU_MLA backend: one 576-wide latent per token and layer, kv_lora_rank 512 + rope 64)
moves through kvfabric exactly, which any weights show; they make no claim about answer quality.
Phases (engine phases share connector_phases' serving and shutdown):
  model     write the model (config, safetensors) to --model (no vLLM engine)
  prompts   test prompts (token ids, seeded): p1 600 tokens (2 whole 256-token chunks and a partial one), p2 512
            (2 whole chunks), p1x = p1 with its first 256 tokens replaced (same suffix)
  baseline  engine without any connector: greedy outputs
  store     engine with KVFabricConnector, cold: serves the prompts, waits for their chunk files
  load      fresh engine, same disk cache: serves them again (asynchronous loads)
  layerwise the same with load_mode "layerwise"
  chunks    the stored chunks of p1, read by a CacheEngine under the latent layout (no vLLM engine)
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import connector_phases as base  # noqa: E402  (sets vLLM's environment defaults)

CHUNK = base.CHUNK
MODEL_ID = "kvfabric-test-mla"
KV_BYTES = 64 << 20  # ~28k bf16 tokens of this model's latents
CONFIG = {  # DeepSeek-V2's attention (no q LoRA, as V2-Lite), dense MLP layers only, a small vocabulary
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 1024, "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "first_k_dense_replace": 2, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32, "max_position_embeddings": 4096,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "topk_method": "greedy", "n_group": 1,
    "topk_group": 1, "scoring_func": "softmax", "routed_scaling_factor": 1.0, "norm_topk_prob": False,
    "attention_bias": False,
}


def make_model(path: str) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG), dtype=torch.bfloat16)
    model.save_pretrained(path)
    return {"parameters": sum(p.numel() for p in model.parameters())}


def make_prompts() -> dict[str, list[int]]:
    rng = random.Random(0)
    p1 = [rng.randrange(2, CONFIG["vocab_size"]) for _ in range(600)]
    p2 = [rng.randrange(2, CONFIG["vocab_size"]) for _ in range(512)]
    head = [rng.randrange(2, CONFIG["vocab_size"]) for _ in range(CHUNK)]
    return {"p1": p1, "p2": p2, "p1x": head + p1[CHUNK:]}


def make_llm(model: str, cache: str | None, phase: str):
    from vllm import LLM

    # CPU_MLA by name: on a CPU with AMX tiles vLLM prefers its AMX_MLA backend, whose kernels take 16-bit weights
    # only (float32 here: an exact comparison with the run without kvfabric)
    kwargs = dict(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=2048,
                  max_num_seqs=4, kv_cache_memory_bytes=KV_BYTES, seed=0, attention_backend="CPU_MLA")
    if cache is not None:
        from kvfabric.connectors.vllm import kv_transfer_config

        kwargs["kv_transfer_config"] = kv_transfer_config(base.extra_config(cache, phase, MODEL_ID))
    return LLM(**kwargs)


def stored_chunks(cache: str, tokens: list[int]) -> dict:
    """p1's chunks as a CacheEngine with the latent layout reads them: [L, 1, 1, T, 576] each."""
    import torch

    from kvfabric import CacheEngine, Config, KVLayout
    from kvfabric.config import DiskTierConfig

    layout = KVLayout(CONFIG["num_hidden_layers"], 1, CONFIG["kv_lora_rank"] + CONFIG["qk_rope_head_dim"],
                      "float32", is_latent=True)
    with CacheEngine(Config(chunk_size=CHUNK, tiers=("disk",), disk=DiskTierConfig(path=cache)), layout,
                     MODEL_ID) as engine:
        kv = engine.retrieve(tokens)
    return {"shape": list(kv.shape), "is_finite": bool(torch.isfinite(kv).all()),
            "nonzero_share": float((kv != 0).float().mean())}


def main() -> None:
    args, names = base.parse_args(["model", "prompts", "baseline", "store", "load", "layerwise", "chunks"])
    out: dict = {"phase": args.phase}
    if args.phase not in ("model", "prompts"):
        prompts = json.loads(Path(args.prompts).read_text())["prompts"]
    if args.phase == "model":
        out["model"] = make_model(args.model)
    elif args.phase == "prompts":
        out["prompts"] = make_prompts()
    elif args.phase == "chunks":
        out["chunks"] = stored_chunks(args.cache, prompts[names[0]])
    else:
        started = time.perf_counter()
        llm = make_llm(args.model, None if args.phase == "baseline" else args.cache, args.phase)
        out["startup_s"] = round(time.perf_counter() - started, 1)
        out["results"] = base.serve(llm, prompts, names)
        if args.phase == "store":
            out["chunk_files"] = base.wait_for_chunks(args.cache, sum(base.num_chunk_files(len(prompts[n]))
                                                                      for n in names))
        out["worker_stats"] = base.shutdown(llm, args.cache, args.phase)
    base.write_and_exit(args.out, out)


if __name__ == "__main__":
    main()
