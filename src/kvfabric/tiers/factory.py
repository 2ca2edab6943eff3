"""The one place where local tiers are built from config: tier name -> its config section and constructor.

Contract:
- `build_tiers(config, names=None)`: the tiers `names` (default: `config.tiers`), in that order, each built from
  its own config section. Only local tiers are built here: "peer" (a cluster membership, not a store) is
  composed by the engine with a cluster node; asking for it, or an unknown name, raises ConfigError.
- `codec_spec(config, name)`: the codec spec of tier `name`'s section ("" = the engine's codec; also for tiers
  without a section, such as the peer tier). The engine encodes each chunk once per distinct codec.
Heavy dependencies (redis-py, the shm pool) are imported only when such a tier is built.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvfabric.config import Config, ConfigError
from kvfabric.tiers.base import Tier


def _cpu(section: Any) -> Tier:
    from kvfabric.tiers.cpu import CpuTier
    return CpuTier(section.capacity)


def _disk(section: Any) -> Tier:
    from kvfabric.tiers.disk import DiskTier
    return DiskTier(section.resolved_path(), section.capacity, fsync=section.fsync)


def _shm(section: Any) -> Tier:
    from kvfabric.tiers.shm import ShmTier
    return ShmTier.from_config(section)


def _redis(section: Any) -> Tier:
    from kvfabric.tiers.redis import RedisTier
    return RedisTier(section.url, is_cluster=section.is_cluster, ttl_s=section.ttl_s, timeout_s=section.timeout_s,
                     capacity_bytes=section.capacity, breaker_failures=section.breaker_failures,
                     backoff_max_s=section.backoff_max_s)


@dataclass(frozen=True, slots=True)
class TierBuilder:
    section: Callable[[Config], Any]  # the tier's config section (it has a `codec` field)
    build: Callable[[Any], Tier]  # section -> tier


BUILDERS: dict[str, TierBuilder] = {
    "cpu": TierBuilder(lambda config: config.cpu, _cpu),
    "disk": TierBuilder(lambda config: config.disk, _disk),
    "shm": TierBuilder(lambda config: config.shm, _shm),
    "redis": TierBuilder(lambda config: config.redis, _redis),
}


def build_tiers(config: Config, names: Sequence[str] | None = None) -> list[Tier]:
    tiers: list[Tier] = []
    try:
        for name in config.tiers if names is None else names:
            builder = BUILDERS.get(name)
            if builder is None:
                raise ConfigError(f"tiers: {name!r} is not a local tier; local tiers: {', '.join(BUILDERS)}")
            tiers.append(builder.build(builder.section(config)))
    except BaseException:
        for tier in tiers:  # a later tier failed (e.g. no room in /dev/shm): release what was built
            tier.close()
        raise
    return tiers


def codec_spec(config: Config, name: str) -> str:
    builder = BUILDERS.get(name)
    return builder.section(config).codec if builder is not None else ""
