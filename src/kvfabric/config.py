"""Configuration: one typed, validated dataclass tree, loadable from YAML and KVFABRIC_* environment variables.

Contract:
- `Config()` is the embedded default: cpu + disk tiers, chunk_size 256, sha256 keys, raw codec.
- Codecs are `name` or `name:level`, checked against the codec registry (codec.registry: raw | int8 | cachegen:0-9);
  each tier section may set its own `codec`.
- `Config.load(path)` reads YAML (or $KVFABRIC_CONFIG), then applies environment variables, which win.
  Env names are `KVFABRIC_<FIELD>` and `KVFABRIC_<SECTION>__<FIELD>`, e.g. KVFABRIC_CHUNK_SIZE=128,
  KVFABRIC_DISK__CAPACITY=20GiB, KVFABRIC_TIERS=cpu,disk. KVFABRIC_HOME, KVFABRIC_CONFIG and the prefixes
  KVFABRIC_TEST_* and KVFABRIC_BENCH_* are not config keys; any other unknown KVFABRIC_* name is an error.
- An unknown key, a wrong type or a value outside its choices raises ConfigError naming the key and what is
  allowed. Byte sizes accept ints or strings such as "512MiB", "4GiB", "1.5GB".
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from kvfabric.codec.registry import CodecSpecError, parse_codec
from kvfabric.config_types import ByteSize, ByteSizeOrZero, ConfigError, build, env_overrides, merge
from kvfabric.host.permissions import parse_mode

ENV_PREFIX = "KVFABRIC_"
RESERVED_ENV = {"KVFABRIC_HOME", "KVFABRIC_CONFIG"}
RESERVED_ENV_PREFIXES = ("KVFABRIC_TEST_", "KVFABRIC_BENCH_")  # for test and benchmark harnesses, never config
TIER_NAMES = ("cpu", "shm", "disk", "redis", "mooncake", "peer")
# Cache policies of the cpu and disk tiers (kvfabric.tiers.policies builds them by these names; a test checks
# that both lists agree). "heat" is kvfabric's prefix- and cost-aware policy.
EvictionName = Literal["heat", "lru", "lfu", "s3fifo", "arc"]
AdmissionName = Literal["always", "second", "tinylfu"]
PlacementMode = Literal["write-through", "exclusive"]


def kvfabric_home() -> Path:
    """Root for kvfabric's own files: $KVFABRIC_HOME or ~/.cache/kvfabric."""
    return Path(os.environ.get("KVFABRIC_HOME") or "~/.cache/kvfabric").expanduser()


def _check_codec(spec: str, key: str) -> None:
    try:
        parse_codec(spec)
    except CodecSpecError as exc:
        raise ConfigError(f"{key}: {exc}") from None


class _TierSection:
    """Base of the tier sections: a section's `codec` ("" = the engine's codec) must name a registered codec.
    The section's key is its class name's prefix (CpuTierConfig -> "cpu")."""
    __slots__ = ()

    def __post_init__(self) -> None:
        if self.codec:
            _check_codec(self.codec, f"{type(self).__name__.removesuffix('TierConfig').lower()}.codec")


@dataclass(frozen=True, slots=True)
class CpuTierConfig(_TierSection):
    capacity: ByteSize = 4 * 2**30  # bytes of chunks this process keeps in memory; least useful ones leave first
    codec: str = ""  # "" = the top-level codec; e.g. "cachegen:6" keeps this tier's copy compressed
    eviction: EvictionName = "lru"  # which chunk leaves when the tier is full (heat: the most prefix hits on the
    # Mooncake traces, but its bookkeeping costs more per access than LRU's: docs/design/measurements.md)
    admission: AdmissionName = "always"  # whether a new chunk is stored at all ("second": on its second miss)
    premap: ByteSizeOrZero = 512 * 2**20  # free chunk buffers a background thread keeps mapped ahead of the saves of
    # the vLLM worker, between steps (0: none): a save into fresh memory faults every page in on the engine thread


@dataclass(frozen=True, slots=True)
class DiskTierConfig(_TierSection):
    path: str = ""  # empty: <KVFABRIC_HOME>/chunks
    capacity: ByteSize = 50 * 2**30  # bytes of chunk files kept in the folder (shared by every process using it)
    fsync: bool = False  # atomic rename + checksums already make a crash a clean miss
    codec: str = ""  # "" = the top-level codec
    eviction: EvictionName = "lru"  # which chunk file goes when the folder is full (as cpu.eviction)
    admission: AdmissionName = "always"  # whether a new chunk is written at all (as cpu.admission)
    mode: str = "0700"  # the folders' mode (files: the same without x); "0770": a group of service users shares it

    def __post_init__(self) -> None:
        _TierSection.__post_init__(self)  # (no zero-argument super() in a slotted dataclass)
        try:
            parse_mode(self.mode)
        except ValueError as exc:
            raise ConfigError(f"disk.mode: {exc} (in YAML, quote it: mode: \"0700\")") from None

    @property
    def dir_mode(self) -> int:
        return parse_mode(self.mode)

    def resolved_path(self) -> Path:
        return Path(self.path).expanduser() if self.path else kvfabric_home() / "chunks"


@dataclass(frozen=True, slots=True)
class ShmTierConfig(_TierSection):
    name: str = "kvfabric"  # pool file /dev/shm/kvfabric-<name>; every process using the same name shares it
    capacity: ByteSize = 2**30  # reserved in /dev/shm at creation (containers often give /dev/shm only 64 MB)
    lock_timeout_s: float = 2.0  # a writer waits at most this long for the pool lock, then drops the put
    codec: str = ""  # "" = the top-level codec
    coherent: bool = True  # False: memory not coherent across hosts (CXL): flush before publish, invalidate before read
    root: str = "/dev/shm"  # the pool's folder: any mmap-able file system (a DAX mount, a CXL-backed tmpfs)


@dataclass(frozen=True, slots=True)
class RedisTierConfig(_TierSection):
    url: str = "redis://127.0.0.1:6379/0"  # redis://, rediss://, unix:///path.sock
    is_cluster: bool = False  # a Redis Cluster (keys spread over its nodes) rather than one server
    ttl_s: int = 0  # 0: no expiry; the server's maxmemory policy evicts
    timeout_s: float = 0.5  # deadline of every call; a dead server = misses within it
    capacity: ByteSize = 2**40  # informational: the server's maxmemory is the real bound
    breaker_failures: int = 3  # consecutive failures that open the circuit
    backoff_max_s: float = 30.0  # the open circuit's longest wait before it tries the server again
    codec: str = ""  # "" = the top-level codec; "cachegen" sends several times fewer bytes over the network


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """How the tiers of the stack share chunks (tiers/stack.py)."""
    mode: PlacementMode = "write-through"  # write-through: every store goes to every writable tier;
    # exclusive: a store goes to the first tier, and what a tier evicts is demoted to the next one
    promote_after: int = 1  # a chunk read from a slower tier is copied up on its k-th read there
    max_slow_reads: int = 0  # reads in flight from the tiers below the first; 0 = no cap
    slow_read_wait_s: float = 0.0  # a read waits this long for a slot, then is a miss (recompute)
    # off by default: a connector copies what it reads by key into its engine's own cache, which then holds it
    promote_chunk_reads: bool = False  # reads by key (read_chunk, open_chunk, read_many) promote too, as retrieve does

    def __post_init__(self) -> None:
        if self.promote_after < 1:
            raise ConfigError(f"placement.promote_after: must be >= 1, got {self.promote_after}")
        if self.max_slow_reads < 0 or self.slow_read_wait_s < 0:
            raise ConfigError("placement.max_slow_reads and placement.slow_read_wait_s: must be >= 0, got "
                              f"{self.max_slow_reads} and {self.slow_read_wait_s}")


@dataclass(frozen=True, slots=True)
class MooncakeTierConfig(_TierSection):
    master: str = "127.0.0.1:50051"  # mooncake_master's RPC address
    metadata_url: str = "http://127.0.0.1:8080/metadata"  # the transfer engine's metadata server (the master's HTTP one)
    metrics_url: str = ""  # the master's admin HTTP server, for keys() and usage(); "" = http://<master host>:9003
    protocol: Literal["tcp", "rdma"] = "tcp"  # the transfer engine's transport
    rdma_devices: str = ""  # with rdma: e.g. "mlx5_0"
    local_host: str = "127.0.0.1"  # this client's address (hostname <local_host>:<free port>, MC_TCP_BIND_ADDRESS)
    segment: ByteSizeOrZero = 2**30  # memory this client lends the store (its objects leave with it); 0: none
    buffer: ByteSize = 64 * 2**20  # the client's own transfer buffer
    timeout_s: float = 1.0  # deadline of every call, set-up included; a dead master = misses within it
    capacity: ByteSize = 2**40  # informational: the master evicts by its own watermark
    breaker_failures: int = 3  # consecutive failures that open the circuit
    backoff_max_s: float = 30.0  # the open circuit's longest wait before it tries the store again
    codec: str = ""  # "" = the top-level codec

    def __post_init__(self) -> None:
        _TierSection.__post_init__(self)  # (no zero-argument super() in a slotted dataclass)
        if self.timeout_s <= 0:
            raise ConfigError(f"mooncake.timeout_s: must be positive, got {self.timeout_s}")


SEALABLE_TIERS = ("redis", "mooncake", "disk", "shm")


@dataclass(frozen=True, slots=True)
class SealConfig:
    """Chunks sealed (AES-256-GCM, the chunk key as associated data: kvfabric.tiers.seal) before they reach the tiers
    named here; off while no key is set. Needs the `security` extra."""
    keys: str = ""  # base64 32-byte keys, comma-separated: the first seals, all open (set it: KVFABRIC_SEAL__KEYS)
    tiers: tuple[str, ...] = ("redis", "mooncake")  # the tiers that store sealed chunks (of redis, mooncake, disk, shm)

    def __post_init__(self) -> None:
        for name in self.tiers:
            if name not in SEALABLE_TIERS:
                raise ConfigError(f"seal.tiers: {name!r} cannot be sealed; allowed: {', '.join(SEALABLE_TIERS)}")


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """TLS of the P2P server and its clients and of the calls to the controller (kvfabric.net.tls); no cert: plain."""
    cert: str = ""  # PEM certificate this instance presents (as a P2P server, and as a client where mTLS is on)
    key: str = ""  # its private key (PEM)
    ca: str = ""  # PEM CA bundle that peers' and the controller's certificates are checked against ("" = system's)
    require_client_cert: bool = False  # mTLS: the P2P server serves only clients with a certificate the CA signed


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """This instance's membership in a fleet (tier "peer"): report to the controller, serve chunks to peers."""
    controller_url: str = ""  # e.g. http://127.0.0.1:8470; required with tier "peer"
    token: str = ""  # bearer token for the controller and the P2P server; required when either binds beyond loopback
    instance_id: str = ""  # "" = host-pid
    p2p_host: str = "127.0.0.1"  # where this instance's P2P server listens (beyond loopback: set a token)
    p2p_port: int = 0  # 0 = any free port
    advertise_host: str = ""  # address peers use to reach us ("" = p2p_host)
    serve_tiers: tuple[str, ...] = ("cpu", "disk")  # the local tiers peers may read from (and the controller learns)
    keep_fetched: bool = True  # keep a local copy of chunks fetched from peers
    report_interval_s: float = 0.25  # how often new and evicted chunks are reported to the controller
    heartbeat_interval_s: float = 2.0  # how often this instance tells the controller it is alive
    reconcile_interval_s: float = 10.0  # how often the full key set is compared with the controller's view
    lookup_timeout_s: float = 0.5  # deadline of a controller lookup; past it the chunks are misses
    lookup_ttl_s: float = 2.0  # how long a lookup answer is reused for the same chunks
    connect_timeout_s: float = 0.5  # deadline to connect to a peer's P2P server
    fetch_timeout_s: float = 5.0  # deadline of a chunk fetch from a peer; past it the rest is recomputed
    tls: TLSConfig = field(default_factory=TLSConfig)
    insecure: bool = False  # allow the P2P server beyond loopback without TLS (token and chunks in clear; logged)


@dataclass(frozen=True, slots=True)
class FlexiCacheConfig:
    """Head-aware decode KV memory of the reference engine (engines.flexicache); off while kv_budget is 0."""
    kv_budget: float = 0.0  # fraction of the decode KV held in the fast pool; 0 = off (dense KV), 1 = all of it
    page_size: int = 16  # tokens per KV page (per layer and KV head)
    rerank_interval: int = 16  # stable heads re-rank their resident pages every N steps; unstable ones every step
    recent_pages: int = 2  # the newest pages of every paged head stay resident (the one being written and before)
    max_full_share: float = 0.25  # heads kept whole take at most this share of the budget
    head_order: Literal["retention", "stability"] = "retention"  # which heads are kept whole first (heads.py)
    radar_margin: float = 0.0  # between re-ranks, promote a page whose radar score beats the K-th resident by this
    radar_promotions: int = 3  # ... at most this many per head and step (the best first)
    radar_score: Literal["mid", "bound"] = "mid"  # pages rank by (bound + centroid) / 2, or Quest's bound alone
    slow_pool: Literal["memory", "shm"] = "memory"  # where offloaded pages live: process memory or /dev/shm
    head_table: str = ""  # a head table file; "" = the one shipped for the model (kvfabric profile flexicache)

    def __post_init__(self) -> None:
        if not 0.0 <= self.kv_budget <= 1.0:
            raise ConfigError(f"flexicache.kv_budget: expected a fraction in [0, 1], got {self.kv_budget}")
        for name in ("page_size", "rerank_interval", "recent_pages", "radar_promotions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"flexicache.{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.max_full_share <= 1.0:
            raise ConfigError(f"flexicache.max_full_share: expected a fraction in (0, 1], got {self.max_full_share}")
        if self.radar_margin < 0.0:
            raise ConfigError(f"flexicache.radar_margin: must be >= 0, got {self.radar_margin}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """`kvfabric server` (one cache process per host) and the engines that use it with `mode: server`."""
    socket: str = ""  # the control socket (mode 0600); "" = <KVFABRIC_HOME>/server.sock
    token: str = ""  # shared secret every client must present; "" = the socket's file mode alone guards it
    cpus: str = ""  # the server's cores, e.g. "1" or "2-3,6" ("" = not pinned); its threads are sized to them
    pool_capacity: ByteSize = 512 * 2**20  # the data-plane pool in /dev/shm (slots of decoded KV), reserved at start
    slot_bytes: ByteSize = 8 * 2**20  # one slot holds one chunk's KV in the layout dtype
    max_slots_per_client: int = 8  # slots one client may lease at a time (reads in flight, stores being written)
    max_store_queue: int = 16  # per client: committed chunks waiting to be encoded and persisted
    max_clients: int = 64  # engines connected at once; more are refused
    timeout_s: float = 2.0  # client: deadline of each request; past it the request is a miss
    retry_s: float = 1.0  # client: after the server failed, answer misses this long before reconnecting
    metrics_port: int = 0  # Prometheus metrics on 127.0.0.1:<port>; 0 = off

    def __post_init__(self) -> None:
        if self.max_slots_per_client <= 0 or self.max_clients <= 0 or self.max_store_queue <= 0:
            raise ConfigError("server.max_slots_per_client, max_clients and max_store_queue must be positive")
        if self.timeout_s <= 0 or self.retry_s < 0:
            raise ConfigError("server.timeout_s must be positive and server.retry_s 0 or more")
        if self.slot_bytes > self.pool_capacity:
            raise ConfigError(f"server.slot_bytes ({self.slot_bytes}) exceeds server.pool_capacity")

    def resolved_socket(self) -> Path:
        return Path(self.socket).expanduser() if self.socket else kvfabric_home() / "server.sock"


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """Prometheus metrics of this process (kvfabric.observe.metrics): off unless a port is set."""
    port: int = 0  # 0 = no endpoint; e.g. 9464 serves http://127.0.0.1:9464/metrics
    host: str = "127.0.0.1"  # the endpoint's address (beyond loopback: anyone on the network reads the metrics)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"metrics.port: must be 0 (off) or a TCP port, got {self.port}")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Chunk stored / removed events for KV-aware routers, in vLLM's wire format (kvfabric.observe.events)."""
    enabled: bool = False  # track stored / removed chunks and publish them
    endpoint: str = "tcp://127.0.0.1:5557"  # ZMQ PUB; "" = collect only (the vLLM connector hands them to vLLM)
    replay_endpoint: str = ""  # ZMQ ROUTER answering replay requests from a sequence number
    topic: str = "kvfabric"  # the ZMQ topic of every published batch
    buffer_steps: int = 10_000  # batches kept for replay
    interval_s: float = 0.5  # how often queued events are published and vanished chunks looked for
    max_tracked: int = 1_000_000  # chunks remembered for removal events (oldest forgotten first)


@dataclass(frozen=True, slots=True)
class Config:
    chunk_size: int = 256  # tokens per chunk: the unit that is hashed, stored and loaded
    hash: Literal["sha256", "blake3"] = "sha256"  # the chunk-key hash (keys differ between the two)
    salt: str = ""  # tenant salt: separates key namespaces
    tenant_mode: bool = False  # every request names its tenant (vLLM cache_salt; the engine's salt), else no cache
    save_partial_chunk: bool = False  # also store a prompt's trailing partial chunk (hit only by the same prompt)
    codec: str = "raw"  # raw | int8 | cachegen, optionally with a level ("cachegen:6"); tiers may override
    tiers: tuple[str, ...] = ("cpu", "disk")  # fastest first, from cpu, shm, disk, redis, mooncake, peer
    write_queue_chunks: int = 64  # chunks waiting to be written to the slower tiers; more are dropped
    cpu: CpuTierConfig = field(default_factory=CpuTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    shm: ShmTierConfig = field(default_factory=ShmTierConfig)
    redis: RedisTierConfig = field(default_factory=RedisTierConfig)
    mooncake: MooncakeTierConfig = field(default_factory=MooncakeTierConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    flexicache: FlexiCacheConfig = field(default_factory=FlexiCacheConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    strict_permissions: bool = False  # a cache folder or pool readable by others: an error (default: a warning)
    seal: SealConfig = field(default_factory=SealConfig)
    mode: Literal["inproc", "server"] = "inproc"  # server: engines use `kvfabric server` (section `server`)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ConfigError(f"chunk_size: must be positive, got {self.chunk_size}")
        _check_codec(self.codec, "codec")
        if self.write_queue_chunks <= 0:
            raise ConfigError(f"write_queue_chunks: must be positive, got {self.write_queue_chunks}")
        if not self.tiers or len(set(self.tiers)) != len(self.tiers):
            raise ConfigError(f"tiers: need one or more distinct tiers from {TIER_NAMES}, got {self.tiers}")
        for name in self.tiers:
            if name not in TIER_NAMES:
                raise ConfigError(f"tiers: unknown tier {name!r}; allowed: {', '.join(TIER_NAMES)}")
        if "peer" in self.tiers:
            if self.tiers[-1] != "peer" or len(self.tiers) == 1:
                raise ConfigError("tiers: 'peer' must come last, after at least one local tier")
            if not self.cluster.controller_url:
                raise ConfigError("cluster.controller_url: required when tiers include 'peer'")

    # ---- loading -----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        return build(cls, data, "")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> Config:
        return cls.load(path, environ={})

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, environ: dict[str, str] | None = None) -> Config:
        environ = dict(os.environ if environ is None else environ)
        path = path or environ.get("KVFABRIC_CONFIG")
        data: dict[str, Any] = {}
        if path:
            source = "$KVFABRIC_CONFIG " if path == environ.get("KVFABRIC_CONFIG") else ""
            try:
                data = yaml.safe_load(Path(path).read_text()) or {}
            except FileNotFoundError:
                raise ConfigError(f"{source}{path}: no such config file") from None
            except OSError as exc:
                raise ConfigError(f"{source}{path}: cannot be read ({exc.strerror})") from None
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
                problem = getattr(exc, "problem", None) or "malformed"
                raise ConfigError(f"{source}{path}: not valid YAML: {problem}{where}") from None
            if not isinstance(data, dict):
                raise ConfigError(f"{source}{path}: the top level must be a mapping")
        return cls.from_dict(merge(data, env_overrides(environ, ENV_PREFIX, RESERVED_ENV, RESERVED_ENV_PREFIXES)))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def merged(self, data: dict[str, Any]) -> Config:
        """This config with the keys of `data` (nested sections merged key by key) set on top, checked as usual."""
        return Config.from_dict(merge(self.to_dict(), data))
