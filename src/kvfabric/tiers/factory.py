"""The one place where local tiers are built from config: tier name -> its config section and constructor.

Contract:
- `build_tiers(config, names=None)`: the tiers `names` (default: `config.tiers`), in that order, each built from
  its own config section. Only local tiers are built here: "peer" (a cluster membership, not a store) is
  composed by the engine with a cluster node; asking for it, or an unknown name, raises ConfigError.
- With `seal.keys` set, the tiers named in `seal.tiers` are built wrapped in a SealedTier (tiers/sealed.py): their
  chunks are stored sealed. A key that is not usable is a ConfigError, one line.
- `codec_spec(config, name)`: the codec spec of tier `name`'s section ("" = the engine's codec; also for tiers
  without a section, such as the peer tier). The engine encodes each chunk once per distinct codec.
Heavy dependencies (redis-py, the shm pool, the Mooncake client) are imported only when such a tier is built.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvfabric.config import Config, ConfigError
from kvfabric.tiers.base import Tier


def _cpu(config: Config) -> Tier:
    from kvfabric.tiers.cpu import CpuTier
    c = config.cpu
    return CpuTier(c.capacity, eviction=c.eviction, admission=c.admission, premap_bytes=c.premap)


def _disk(config: Config) -> Tier:
    from kvfabric.tiers.disk import DiskTier
    c = config.disk
    return DiskTier(c.resolved_path(), c.capacity, fsync=c.fsync, eviction=c.eviction, admission=c.admission,
                    mode=c.dir_mode, strict=config.strict_permissions)


def _shm(config: Config) -> Tier:
    from kvfabric.tiers.shm import ShmTier
    return ShmTier.from_config(config.shm, strict_permissions=config.strict_permissions)


def _redis(config: Config) -> Tier:
    from kvfabric.tiers.redis import RedisTier
    c = config.redis
    return RedisTier(c.url, is_cluster=c.is_cluster, ttl_s=c.ttl_s, timeout_s=c.timeout_s, capacity_bytes=c.capacity,
                     breaker_failures=c.breaker_failures, backoff_max_s=c.backoff_max_s)


def _mooncake(config: Config) -> Tier:
    from kvfabric.tiers.mooncake import MooncakeTier
    return MooncakeTier.from_config(config.mooncake)


# name -> (the tier's config section, which has a `codec` field; the tier built from the config)
BUILDERS: dict[str, tuple[Callable[[Config], Any], Callable[[Config], Tier]]] = {
    "cpu": (lambda config: config.cpu, _cpu),
    "disk": (lambda config: config.disk, _disk),
    "shm": (lambda config: config.shm, _shm),
    "redis": (lambda config: config.redis, _redis),
    "mooncake": (lambda config: config.mooncake, _mooncake),
}


def _sealer(config: Config) -> Any:
    if not config.seal.keys:
        return None
    try:
        from kvfabric.tiers.seal import Sealer, SealKeyError, parse_keys
    except ModuleNotFoundError as exc:
        from kvfabric.host.extras import missing_extra
        found = missing_extra(exc)
        if found is None:
            raise
        raise ConfigError(f"seal.keys: {found}") from None
    try:
        return Sealer(parse_keys(config.seal.keys))
    except SealKeyError as exc:
        raise ConfigError(str(exc)) from None


def build_tiers(config: Config, names: Sequence[str] | None = None) -> list[Tier]:
    tiers: list[Tier] = []
    sealer = _sealer(config)
    try:
        for name in config.tiers if names is None else names:
            if name not in BUILDERS:
                raise ConfigError(f"tiers: {name!r} is not a local tier; local tiers: {', '.join(BUILDERS)}")
            tier = BUILDERS[name][1](config)
            if sealer is not None and name in config.seal.tiers:
                from kvfabric.tiers.sealed import SealedTier
                tier = SealedTier(tier, sealer)
            tiers.append(tier)
    except BaseException:
        for tier in tiers:  # a later tier failed (e.g. no room in /dev/shm): release what was built
            tier.close()
        raise
    return tiers


def codec_spec(config: Config, name: str) -> str:
    return BUILDERS[name][0](config).codec if name in BUILDERS else ""
