"""Inference-engine connectors.

* :mod:`kvfabric.connectors.vllm` - ``KVFabricConnector``, a vLLM V1 KV connector (the only package that imports
  vLLM; import it only where vLLM is installed).
* :mod:`kvfabric.connectors.sglang` - ``KVFabricStorage``, an SGLang HiCache storage backend over a kvfabric tier
  (imports SGLang; import it only where SGLang is installed).
* :mod:`kvfabric.connectors.paged` - engine-independent helpers: copy token ranges between a paged KV cache and
  kvfabric's ``[layers, 2, kv_heads, tokens, head_dim]`` chunk tensors.
"""
