"""Connector configuration, and what the connector derives from vLLM's own config.

Contract:
- `kv_transfer_config(extra, kv_role)` is the ``kv_transfer_config`` argument of ``vllm.LLM`` for this connector; vLLM
  loads the class by module path + name, so the path is this package (``kvfabric.connectors.vllm``), never a submodule.
- `role_of(kv_role)`: what vLLM's ``kv_role`` lets the connector do (``Role``). ``kv_both`` (default): load hits and
  store every request's KV; ``kv_producer`` (a prefill instance of a P/D pair): load hits too (the shared pool
  is its prefix cache: a repeated prefix skips the prefill instance's work as well), store, and end each step
  only once its KV is stored, so a request's answer means its KV is in the shared tiers; ``kv_consumer`` (a
  decode instance): load, never store.
- `resolve_config(extra)` splits ``kv_connector_extra_config`` into (kvfabric ``Config``, connector options).
  The config keys (chunk_size, tiers, disk.path, ...) take precedence: extra config > ``KVFABRIC_*`` environment >
  YAML (``config_file`` or ``$KVFABRIC_CONFIG``) > defaults. ``KVFABRIC_*`` variables that are not config keys
  are ignored. The connector options, always present in the result with their defaults:

    model_id             key namespace (default: the ``name`` in kvfabric's model marker, else the model path)
    config_file          YAML file with kvfabric config
    load_failure_policy  "recompute" (default: a bad chunk costs a recompute, never a failed request) or "fail";
                         written into vLLM's ``kv_load_failure_policy``
    stats_path           the worker writes its counters there as JSON (after steps in which loads ended, and at
                         shutdown)
    save_queue_bytes     bound on gathered KV waiting for the background saver (default 1 GiB; beyond it, saves are
                         dropped and counted, never waited for)
    key_mode             "tokens" (default): kvfabric's chained token-id keys, shared with kvfabric's other engines;
                         a request's cache_salt S selects the key namespace of tenant salt S (kvfabric's `salt`,
                         or "<salt>/S" when the config sets one), so salted and unsalted requests never share
                         KV; requests with LoRA or multimodal inputs are not cached (token ids do not name
                         their KV). "vllm": chunk key = our namespace + vLLM's block hash of the chunk's last
                         block (which folds in LoRA, multimodal inputs, cache_salt); needs vLLM's prefix caching on
                         (the default) and chunk_size a multiple of the block size; shared only between vLLM engines
                         with the same prefix_caching_hash_algo (sha256 by default is reproducible across processes).
    load_mode            "async" (default): a request with a hit waits in vLLM's WAITING_FOR_REMOTE_KVS state while
                         background threads load its KV and the other requests keep running; "layerwise": loads
                         run within the step that computes the request, scattered one layer ahead of the forward
    load_threads         background load threads (default 2; while a forward runs, one of them claims chunks)
    load_nice            their niceness, 0-19 (default 15): the share of the cores an asynchronous load takes from
                         forwards that run meanwhile (0: an equal share, the load ends soonest, the other requests'
                         decode slows most; 19: almost none)
    pinned_bytes         on a GPU: pinned host buffers kept for reuse by the copy stream (default 1 GiB; more are
                         made when a burst needs them, then freed)
    kv_cache_layout      on a GPU: the KVCacheLayout asked of vLLM (default "BLHNC": block-outermost, a block's KV
                         of every layer one contiguous run; "" lets vLLM choose); a backend that cannot use it gets
                         vLLM's own choice, with vLLM's warning
    tail_step            a prompt's tokens past its last whole chunk are stored as a partial chunk in whole
                         steps of this many tokens, and a later prompt that goes on from them (the next turn of
                         a chat) loads them (default 64; 0: whole chunks only). Key mode
                         "tokens" only, not under the hybrid manager, not with window layers or save_partial_chunk
    hold_newcomers       true (default): while a prefill will finish within the next step (vLLM's token budget,
                         max_num_batched_tokens), a request the connector has not seen yet waits that one step
                         (the lookup answers "not yet"), so the finishing prefill's step is not lengthened by the
                         newcomer's first chunk and its first token comes sooner; false: vLLM's own order

- `layout_from_vllm` / `model_id_from_vllm`: the KVLayout (layer groups from the model config, as kvfabric's HF
  engine has them: Gemma 3's window layers, so both engines' keys agree) and key namespace; anything the connector
  cannot serve (tensor or pipeline parallel, an unsupported KV cache dtype or attention kind) raises
  NotImplementedError at start-up.
- `kv_cache_groups(kv_cache_config, layout, ...)`: which vLLM KV cache group each layer's blocks are in
  (``KVGroups``). One group (vLLM's hybrid KV cache manager off): `kv_cache_block_size`, it must hold
  full-attention blocks. Several groups (the manager on; the connector is ``SupportsHMA``): full-attention and
  sliding-window groups only, one block size dividing the chunk size, the sliding-window groups holding exactly
  the layout's window layers with its one window W (vLLM frees a window group's blocks before the window: the
  connector loads and saves window layers only where blocks exist), asynchronous loads only. Anything else
  (state-space, chunked-local, sparse MLA blocks, ...) raises NotImplementedError at start-up, never wrong KV. A
  model with MLA (`layout_from_vllm`: a latent layout) has one group of ``MLAAttentionSpec`` blocks.
- `detect_cpu_kv_layout` measures, with vLLM's CPU attention kernel itself, whether the K and V regions of a cache
  block are token-major ("td") or dim-major ("dt"); see ``kvfabric.connectors.paged``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

from kvfabric.config import ENV_PREFIX, RESERVED_ENV, Config, ConfigError
from kvfabric.connectors.paged import REGION_LAYOUTS, RegionLayout, render_region
from kvfabric.connectors.paged_views import LAYOUTS
from kvfabric.engines.runtime import layout_for
from kvfabric.kv.layout import KVLayout
from kvfabric.kv.shares import Share, rank_heads

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)

CONNECTOR_KEYS = ("model_id", "config_file", "load_failure_policy", "stats_path", "save_queue_bytes", "key_mode",
                  "load_mode", "load_threads", "load_nice", "pinned_bytes", "kv_cache_layout", "hold_newcomers",
                  "tail_step")
KEY_MODES = ("tokens", "vllm")
LOAD_MODES = ("async", "layerwise")
DEFAULT_LOAD_THREADS = 2
DEFAULT_LOAD_NICE = 15
# one tail is stored per prompt: a coarser step leaves it a prefix of a later prompt that differs within the
# last tokens more often, a finer one reuses more where prompts go on exactly (docs/design/measurements.md).
# vLLM takes a load that ends inside one of its blocks.
DEFAULT_TAIL_STEP = 64
DEFAULT_PINNED_BYTES = 1 << 30  # pinned host buffers of a GPU's copy stream, kept for reuse
DEFAULT_KV_CACHE_LAYOUT = "BLHNC"  # asked of vLLM on a GPU: block-outermost (a block's layers in one run)
PARAMS_KEY = "kvfabric"  # our entry in a request's kv_transfer_params
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
_TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclasses.dataclass(frozen=True, slots=True)
class Role:
    """What vLLM's kv_role lets the connector do (every role loads hits)."""
    can_store: bool
    is_sync_store: bool  # a step ends only once its saves are stored (a producer hands KV to another instance)


def role_of(kv_role: str | None) -> Role:
    kv_role = kv_role or "kv_both"
    if kv_role not in KV_ROLES:
        raise ConfigError(f"kv_role: {kv_role!r} is not one of {', '.join(KV_ROLES)}")
    return Role(can_store=kv_role != "kv_consumer", is_sync_store=kv_role == "kv_producer")


def kv_transfer_config(extra: dict[str, Any] | None = None, kv_role: str = "kv_both") -> dict[str, Any]:
    """The ``kv_transfer_config`` argument of ``vllm.LLM`` for this connector."""
    role_of(kv_role)
    extra = dict(extra or {})
    return {
        "kv_connector": "KVFabricConnector",
        # the package, not this module: vLLM imports the path and looks the class up there
        "kv_connector_module_path": __package__,
        "kv_role": kv_role,
        "kv_load_failure_policy": extra.get("load_failure_policy", "recompute"),
        "kv_connector_extra_config": extra,
    }


def resolve_config(extra: dict[str, Any] | None) -> tuple[Config, dict[str, Any]]:
    """Split ``kv_connector_extra_config`` into (kvfabric Config, connector options); see the module doc."""
    extra = dict(extra or {})
    options = {key: extra.pop(key) for key in CONNECTOR_KEYS if key in extra}
    policy = options.setdefault("load_failure_policy", "recompute")
    if policy not in ("recompute", "fail"):
        raise ConfigError(f"load_failure_policy: {policy!r} is not one of recompute, fail")
    if options.setdefault("key_mode", "tokens") not in KEY_MODES:
        raise ConfigError(f"key_mode: {options['key_mode']!r} is not one of {', '.join(KEY_MODES)}")
    if options.setdefault("load_mode", "async") not in LOAD_MODES:
        raise ConfigError(f"load_mode: {options['load_mode']!r} is not one of {', '.join(LOAD_MODES)}")
    threads = options.setdefault("load_threads", DEFAULT_LOAD_THREADS)
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 64:
        raise ConfigError(f"load_threads: {threads!r} is not an integer in [1, 64]")
    nice = options.setdefault("load_nice", DEFAULT_LOAD_NICE)
    if not isinstance(nice, int) or isinstance(nice, bool) or not 0 <= nice <= 19:
        raise ConfigError(f"load_nice: {nice!r} is not an integer in [0, 19]")
    pinned = options.setdefault("pinned_bytes", DEFAULT_PINNED_BYTES)
    if not isinstance(pinned, int) or isinstance(pinned, bool) or pinned < 0:
        raise ConfigError(f"pinned_bytes: {pinned!r} is not a byte count (an integer >= 0)")
    if not isinstance(options.setdefault("hold_newcomers", True), bool):
        raise ConfigError(f"hold_newcomers: {options['hold_newcomers']!r} is not true or false")
    tail_step = options.setdefault("tail_step", DEFAULT_TAIL_STEP)
    if not isinstance(tail_step, int) or isinstance(tail_step, bool) or tail_step < 0:
        raise ConfigError(f"tail_step: {tail_step!r} is not a token count (an integer >= 0)")
    options["kv_cache_layout"] = kv_cache_layout_option(options)
    base = Config.load(options.get("config_file"), environ=_config_environ())  # YAML + KVFABRIC_* env
    return base.merged(extra), options


def kv_cache_layout_option(extra: dict[str, Any] | None) -> str:
    """The ``kv_cache_layout`` the connector asks vLLM for on a GPU (a KVCacheLayout name; "" for none)."""
    name = (extra or {}).get("kv_cache_layout", DEFAULT_KV_CACHE_LAYOUT)
    if name != "" and name not in LAYOUTS:
        raise ConfigError(f"kv_cache_layout: {name!r} is not one of {', '.join(LAYOUTS)} (or \"\" for vLLM's choice)")
    return name


def _config_environ() -> dict[str, str]:
    """os.environ minus KVFABRIC_* variables that are not config keys (KVFABRIC_TEST_MODEL_DIR, ...): an engine
    must not fail to start because of an unrelated variable."""
    fields = {f.name for f in dataclasses.fields(Config)}
    out = {}
    for name, value in os.environ.items():
        if name.startswith(ENV_PREFIX) and name not in RESERVED_ENV and \
                name[len(ENV_PREFIX):].lower().split("__")[0] not in fields:
            logger.debug("kvfabric: ignoring %s (not a config key)", name)
            continue
        out[name] = value
    return out


def layout_from_vllm(vllm_config: VllmConfig) -> KVLayout:
    """The KVLayout of vLLM's whole model (every layer and KV head, whatever the parallel shape: chunk keys are
    the model's), layer groups included (``layout_for`` on the HF text config, the layout kvfabric's other engines
    use for the same model, so their chunk keys agree), cross-checked with vLLM's own totals of layers and KV heads
    and its head size. A model with multi-head latent attention (``use_mla``) gets a latent layout: vLLM's MLA
    cache holds one vector of kv_lora_rank + qk_rope_head_dim values per token and layer."""
    model = vllm_config.model_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None) and str(cache_dtype) not in _TORCH_DTYPES.values():
        raise NotImplementedError(f"KVFabricConnector does not support kv cache dtype {cache_dtype!r}")
    dtype = model.dtype if cache_dtype in ("auto", None) else getattr(torch, str(cache_dtype))
    if dtype not in _TORCH_DTYPES:
        raise NotImplementedError(f"KVFabricConnector does not support dtype {dtype}")
    if model.use_mla:  # DeepSeek-V2/V3 and kin: one latent vector per token and layer (vLLM's MLA backends)
        return KVLayout(model.get_total_num_hidden_layers(), 1, model.get_head_size(), _TORCH_DTYPES[dtype],
                        is_latent=True)
    try:
        layout = layout_for(model.hf_text_config, _TORCH_DTYPES[dtype])
    except ValueError as exc:  # attention kinds kvfabric cannot store
        raise NotImplementedError(f"KVFabricConnector: {exc}") from exc
    ours = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
    theirs = (model.get_total_num_hidden_layers(), model.get_total_num_kv_heads(), model.get_head_size())
    if ours != theirs:
        raise NotImplementedError(f"KVFabricConnector: the model config gives (layers, KV heads, head size) {ours}, "
                                  f"vLLM's model {theirs}")
    return layout


def share_from_vllm(vllm_config: VllmConfig, layout: KVLayout) -> tuple[Share | None, tuple[int, int]]:
    """(this worker's share of the model's KV, the engine's (pp_size, tp_size)): its pipeline stage's layers (vLLM's
    own partition) and its tensor rank's KV heads (kvfabric.kv.shares.rank_heads: split, or replicated with one
    writer); None with one worker. In the scheduler (rank 0) it is rank 0's."""
    parallel = vllm_config.parallel_config
    pp_size, tp_size = parallel.pipeline_parallel_size, parallel.tensor_parallel_size
    if pp_size * tp_size == 1:
        return None, (1, 1)
    layers = vllm_config.model_config.get_layers_start_end_indices(parallel)
    try:
        heads, is_writer = rank_heads(layout.num_kv_heads, parallel.rank % tp_size, tp_size)
    except ValueError as exc:
        raise NotImplementedError(f"KVFabricConnector: {exc}") from None
    share = Share((int(layers[0]), int(layers[1])), heads, is_writer)
    if layout.window_layers and not share.is_whole(layout):
        raise NotImplementedError(f"KVFabricConnector: a model with sliding-window layers is cached by whole chunks; "
                                  f"this worker holds {share.describe()} (pipeline stages, or tensor ranks that "
                                  "split its KV heads)")
    return share, (pp_size, tp_size)


def for_rank(config: Config, options: dict[str, Any], rank: int) -> tuple[Config, dict[str, Any]]:
    """Worker `rank`'s config and options: ranks past the first get a cluster member name, a P2P port (when fixed)
    and a counters file of their own (`-r{rank}`, `+rank`, `.rank{rank}`): each rank is its own cache, holding its
    share, and two members under one name would take each other's place at the controller."""
    if not rank:
        return config, options
    cluster = config.cluster
    if cluster.instance_id or cluster.p2p_port:
        cluster = dataclasses.replace(cluster, instance_id=f"{cluster.instance_id}-r{rank}" if cluster.instance_id
                                      else "", p2p_port=cluster.p2p_port + rank if cluster.p2p_port else 0)
        config = dataclasses.replace(config, cluster=cluster)
    if options.get("stats_path"):
        options = {**options, "stats_path": f"{options['stats_path']}.rank{rank}"}
    return config, options


def describe_groups(kv_cache_config: KVCacheConfig | None) -> str:
    """vLLM's KV cache groups in one line: "FullAttentionSpec x 18 layers; ..." ("none" without any)."""
    groups = list(kv_cache_config.kv_cache_groups or ()) if kv_cache_config is not None else []
    return "; ".join(f"{type(g.kv_cache_spec).__name__} x {len(g.layer_names)} layers" for g in groups) or "none"


def kv_cache_block_size(kv_cache_config: KVCacheConfig | None, default: int, is_latent: bool = False) -> int:
    """The block size of vLLM's one KV cache group (`kv_cache_groups` with one group); NotImplementedError at
    start-up for anything else.

    One block table (``block_ids[0]``) then serves every layer and every token of a chunk is read back, so the
    group must hold full-attention blocks: vLLM's hybrid KV cache manager off (``--disable-hybrid-kv-cache-manager``),
    a model with sliding-window and full layers (Gemma 3) has one ``FullAttentionSpec`` group whose window layers
    keep every token's KV in full-length blocks (the window is applied by the attention kernel). One group of
    sliding-window, chunked-local or state-space blocks (vLLM frees or overwrites what slides out) is refused;
    several groups are `kv_cache_groups`' case (the connector's SupportsHMA path). A latent layout's group holds
    MLA blocks (``MLAAttentionSpec``), and only such a layout's.
    """
    if kv_cache_config is None:
        return default
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = list(kv_cache_config.kv_cache_groups or ())
    described = describe_groups(kv_cache_config)
    if len(groups) != 1:
        raise NotImplementedError(
            f"kv_cache_block_size: one KV cache group (vLLM's hybrid KV cache manager off), got {len(groups)}: "
            f"{described}; several groups go through kv_cache_groups (the connector's SupportsHMA path)")
    spec = groups[0].kv_cache_spec
    if is_latent:
        # one latent per token: not a DeepSeek-V4 compressed cache (model_version), nor states of several tokens
        if type(spec) is not MLAAttentionSpec or spec.model_version is not None or spec.tokens_per_state != 1:
            raise NotImplementedError(f"KVFabricConnector needs MLA KV cache blocks of one latent per token for a "
                                      f"latent layout, got {described}")
    elif type(spec) is not FullAttentionSpec:  # not even its subclasses (MLA, sink, ...): other page contents
        raise NotImplementedError(f"KVFabricConnector needs full-attention KV cache blocks, got {described} (a "
                                  "sliding-window or chunked-local group frees the blocks of tokens that leave it)")
    return int(spec.block_size)


@dataclasses.dataclass(frozen=True, slots=True)
class KVGroups:
    """vLLM's KV cache groups as the connector uses them."""
    block_size: int
    num_groups: int = 1
    layer_group: dict[str, int] = dataclasses.field(default_factory=dict)  # layer name -> group (several only)
    window: int = 0  # W of the sliding-window groups (several groups only; 0: none)

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    def window_from(self, num_tokens: int) -> int:
        """First token whose window-group block vLLM still holds (allocated) once num_tokens are computed: its
        SlidingWindowManager frees (or never allocates: the null block) the blocks wholly before
        num_tokens - W + 1. 0 without window groups."""
        if not self.window:
            return 0
        return max(0, num_tokens - self.window + 1) // self.block_size * self.block_size


def kv_cache_groups(kv_cache_config: KVCacheConfig | None, layout: KVLayout, default_block_size: int,
                    chunk_size: int, load_mode: str = "async") -> KVGroups:
    """The connector's view of vLLM's KV cache groups; NotImplementedError at start-up for what it cannot serve."""
    groups = list(kv_cache_config.kv_cache_groups or ()) if kv_cache_config is not None else []
    if len(groups) <= 1:
        return KVGroups(kv_cache_block_size(kv_cache_config, default_block_size, layout.is_latent))
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    described = describe_groups(kv_cache_config)
    specs = [g.kv_cache_spec for g in groups]
    if any(type(spec) not in (FullAttentionSpec, SlidingWindowSpec) for spec in specs):
        raise NotImplementedError(f"KVFabricConnector serves vLLM's hybrid KV cache manager with full-attention and "
                                  f"sliding-window groups only, got {described}")
    block_sizes = {int(spec.block_size) for spec in specs}
    windows = {int(spec.sliding_window) for spec in specs if type(spec) is SlidingWindowSpec}
    retained = {int(getattr(spec, "extra_retained_tokens", 0)) for spec in specs if type(spec) is SlidingWindowSpec}
    layout_windows = {g.window for g in layout.window_groups}
    window_layers = sorted(extract_layer_index(name) for g in groups if type(g.kv_cache_spec) is SlidingWindowSpec
                           for name in g.layer_names)
    problems = []
    if len(block_sizes) != 1 or chunk_size % min(block_sizes):
        problems.append(f"one block size dividing chunk_size {chunk_size} (got {sorted(block_sizes)})")
    if len(windows) > 1 or windows != layout_windows or retained - {0}:
        problems.append(f"one sliding window equal to the model's {sorted(layout_windows)} (got {sorted(windows)}, "
                        f"extra retained tokens {sorted(retained)})")
    if window_layers != list(layout.window_layers):
        problems.append(f"sliding-window groups holding the model's window layers {list(layout.window_layers)} "
                        f"(got {window_layers})")
    if load_mode != "async":
        problems.append(f"load_mode async (got {load_mode!r}: vLLM cannot recompute a failed synchronous load's "
                        "blocks with several KV cache groups)")
    if problems:
        raise NotImplementedError(f"KVFabricConnector under vLLM's hybrid KV cache manager ({described}) needs "
                                  + "; ".join(problems))
    layer_group = {name: g for g, group in enumerate(groups) for name in group.layer_names}
    return KVGroups(block_sizes.pop(), len(groups), layer_group, windows.pop() if windows else 0)


def model_id_from_vllm(vllm_config: VllmConfig, options: dict[str, Any]) -> str:
    if options.get("model_id"):
        return str(options["model_id"])
    model = str(vllm_config.model_config.model)
    marker = Path(model).expanduser() / "kvfabric_model.json"
    try:
        name = json.loads(marker.read_text()).get("name")
        if name:
            return str(name)
    except (OSError, ValueError, AttributeError):
        pass
    return str(Path(model).expanduser().resolve()) if Path(model).expanduser().is_dir() else model


def detect_cpu_kv_layout(num_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                         kv_cache_dtype: str = "auto") -> tuple[RegionLayout, RegionLayout]:
    """(K, V) region layouts ("td" token-major or "dt" dim-major) of vLLM's CPU attention cache, measured by
    letting the attention kernel write known keys and values into a scratch one-block cache."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(block_size, num_heads, head_dim, generator=gen).to(dtype)  # [B, H, D]
    value = torch.randn(block_size, num_heads, head_dim, generator=gen).to(dtype)
    cache = torch.zeros(1, num_heads, block_size, 2 * head_dim, dtype=dtype)  # one block, as vLLM allocates it
    key_cache, value_cache = cache.view(1, num_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(block_size, dtype=torch.int64),
                                   isa, kv_cache_dtype=kv_cache_dtype)
    regions = cache.view(num_heads, 2, block_size * head_dim)  # per head: K region, then V region
    found: list[RegionLayout] = []
    for which, values in ((0, key), (1, value)):
        match = [layout for layout in REGION_LAYOUTS
                 if all(torch.equal(regions[h, which], render_region(values[:, h, :], layout))
                        for h in range(num_heads))]
        if not match:
            raise NotImplementedError(f"KVFabricConnector: unknown CPU KV cache layout (isa {isa!r}, {dtype}, "
                                      f"block {block_size}, head_dim {head_dim}) for {'KV'[which]}")
        found.append(match[0])
    return found[0], found[1]
