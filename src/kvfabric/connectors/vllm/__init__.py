"""kvfabric as a vLLM V1 KV connector: ``KVFabricConnector`` (``KVConnectorBase_V1``). This package holds the only
kvfabric modules that import vLLM (``kvfabric.connectors.paged``, its copy helpers, does not).

Use::

    from kvfabric.connectors.vllm import kv_transfer_config
    LLM(model, kv_transfer_config=kv_transfer_config({"tiers": ["cpu", "disk"], "disk": {"path": "/tmp/kv"}}))

which is ``{"kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric.connectors.vllm",
"kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}``: vLLM imports
this package and takes ``KVFabricConnector`` from it, so both names must keep resolving here.

Configuration: ``kv_connector_extra_config`` holds kvfabric config keys (``Config``: chunk_size, tiers, disk.path,
...) plus the connector options (model_id, config_file, load_failure_policy, stats_path, save_queue_bytes,
key_mode, load_mode, load_threads); precedence and meaning in ``kvfabric.connectors.vllm.config``.

Per request, ``SamplingParams(extra_args={"kv_transfer_params": {"kvfabric": {"load": False, "store": False}}})``
turns loading or storing off. Each finished request's output carries ``kv_transfer_params["kvfabric"]``: external
and local hit tokens, tokens and bytes loaded per tier, failed tokens, tokens saved.

Design (vLLM 0.32, CPU backend; LLM, scheduler (EngineCore) and worker are three processes), one module per concept:

    config     kv_transfer_config, connector options, layout and model id from vLLM's config, CPU KV layout probe
    metadata   what crosses the process boundary each step: loads and saves down, per-request stats back
    scheduler  lookups by key (asking the worker's cache: ../lookup.py), per-request state, the per-step loads
               and saves
    worker     the step on the worker: starts loads, per-layer gather for saves, load errors for recompute
    loads      background loads: chunks opened in the cache (KVCache.open_chunk / read_chunk: verified sources) and
               copied into the paged cache; asynchronous (WAITING_FOR_REMOTE_KVS) or layer-wise within a step
    saver      gathered chunk payloads -> KVCache.store_chunks on a background thread: the step never waits
               for checksums, disk or network
    connector  KVFabricConnector: vLLM's hooks, delegated to the scheduler or worker side

Stored chunks are true [layers, 2, heads, tokens, head_dim] KV, equal to transformers' K/V
(tests/test_vllm_connector.py), so they are shared with kvfabric's other engines.
"""
from kvfabric.connectors.vllm.config import kv_transfer_config
from kvfabric.connectors.vllm.connector import KVFabricConnector

__all__ = ["KVFabricConnector", "kv_transfer_config"]
