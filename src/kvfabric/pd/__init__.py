"""Prefill/decode disaggregation: `proxy` (the OpenAI-compatible front of a prefill + decode pair of vLLM
instances whose connectors share KV through kvfabric's tiers: the prefill one with kv_role kv_producer, the decode
one kv_consumer)."""
