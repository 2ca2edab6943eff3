"""Sealed chunks (kvfabric.tiers.seal, tiers/sealed.py): the tier contract on sealed disk and Redis tiers; what is stored
is not the chunk; a flipped byte, a truncated blob, a blob moved to another key and one sealed with an unknown key
are misses, never served; key rotation; the configuration's one-line errors."""
from __future__ import annotations

import base64
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric.config import Config, ConfigError
from kvfabric.host.pages import Scratch
from kvfabric.tiers.disk import DiskTier
from kvfabric.tiers.factory import build_tiers
from kvfabric.tiers.seal import OVERHEAD, Sealer, SealError, parse_keys
from kvfabric.tiers.sealed import SealedTier
from kvfabric.tiers.stack import TierStack
from tests.redis_fixtures import needs_redis, redis_server  # noqa: F401 - fixtures are used by name
from tests.tier_contract import BLOB_BYTES, TierContract, key, make_blob

KEY_A, KEY_B = os.urandom(32), os.urandom(32)


def b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


class TestSealedDiskContract(TierContract):
    """The wrapped tier's budget counts what it stores: sealed blobs, OVERHEAD bytes longer than the chunks; the
    contract's capacities are in chunks, so the budget given here is scaled to hold the same number of them."""
    declared = dict(is_trusted=False, is_read_only=False, is_persistent=True, is_shared=True, honors_capacity=True,
                    honors_pins=True, is_zero_copy=False)

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path):
        self.root = tmp_path / "sealed"

    def make_tier(self, capacity_bytes):
        return SealedTier(DiskTier(self.root, capacity_bytes * (BLOB_BYTES + OVERHEAD) // BLOB_BYTES),
                          Sealer([KEY_A]))

    def reopen(self, tier):
        return SealedTier(DiskTier(self.root, tier.capacity_bytes), Sealer([KEY_A]))


@needs_redis
class TestSealedRedisContract(TierContract):
    declared = dict(is_trusted=False, is_read_only=False, is_persistent=True, is_shared=True, honors_capacity=False,
                    honors_pins=False, is_zero_copy=False)

    @pytest.fixture(autouse=True)
    def _server(self, redis_server):
        self.url = redis_server.url

    def make_tier(self, capacity_bytes):
        from kvfabric.tiers.redis import RedisTier
        return SealedTier(RedisTier(self.url, capacity_bytes=capacity_bytes), Sealer([KEY_A]))

    def reopen(self, tier):
        from kvfabric.tiers.redis import RedisTier
        return SealedTier(RedisTier(self.url, capacity_bytes=tier.capacity_bytes), Sealer([KEY_A]))


def sealed(chunk_key: bytes, blob: bytes, keys=(KEY_A,)) -> bytes:
    out = memoryview(bytearray(len(blob) + OVERHEAD))
    return bytes(Sealer(list(keys)).seal_into(chunk_key, blob, out))


def opens(chunk_key: bytes, stored: bytes, keys=(KEY_A,)) -> bytes:
    out = memoryview(bytearray(max(0, len(stored) - OVERHEAD)))
    return bytes(Sealer(list(keys)).open_into(chunk_key, stored, out))


def test_what_is_stored_is_not_the_chunk_and_opens_to_it(tmp_path):
    blob = make_blob(key(1), seed=1)
    tier = SealedTier(DiskTier(tmp_path, 1 << 24), Sealer([KEY_A]))
    assert tier.put(key(1), blob)
    on_disk = tier.inner.path(key(1)).read_bytes()
    assert len(on_disk) == len(blob) + OVERHEAD and blob[64:128] not in on_disk  # no run of the payload in clear
    assert bytes(tier.get(key(1))) == blob and opens(key(1), on_disk) == blob


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.integers(0, 10**9), bit=st.integers(0, 7), cut=st.integers(0, 10**9))
def test_a_flipped_byte_or_a_truncated_blob_never_opens(where, bit, cut):
    blob = make_blob(key(2), seed=2)
    stored = bytearray(sealed(key(2), blob))
    flipped = bytearray(stored)
    flipped[where % len(stored)] ^= 1 << bit
    with pytest.raises(SealError):
        opens(key(2), bytes(flipped))
    with pytest.raises(SealError):
        opens(key(2), bytes(stored[:cut % len(stored)]))


def test_a_blob_moved_to_another_key_or_sealed_with_an_unknown_key_never_opens():
    blob = make_blob(key(3), seed=3)
    with pytest.raises(SealError, match="another chunk key"):
        opens(key(4), sealed(key(3), blob))  # the chunk key is associated data
    with pytest.raises(SealError, match="unknown key"):
        opens(key(3), sealed(key(3), blob, keys=(KEY_B,)))
    assert opens(key(3), sealed(key(3), blob, keys=(KEY_B,)), keys=(KEY_A, KEY_B)) == blob  # rotation: all open


def test_sealed_tier_misses_drops_damage_and_keeps_foreign_blobs(tmp_path):
    inner = DiskTier(tmp_path, 1 << 24)
    tier = SealedTier(inner, Sealer([KEY_A]))
    stack = TierStack([tier])
    for i in (5, 6):
        assert tier.put(key(i), make_blob(key(i), seed=i))
    damaged = bytearray(inner.path(key(5)).read_bytes())
    damaged[-20] ^= 0xFF
    inner.path(key(5)).write_bytes(bytes(damaged))
    inner.put(key(7), sealed(key(7), make_blob(key(7)), keys=(KEY_B,)))  # another deployment's key
    inner.put(key(8), sealed(key(6), make_blob(key(6), seed=6)))  # copied under another key
    assert stack.get(key(5)) is None and not inner.contains_many([key(5)])[0]  # damaged: dropped
    assert stack.get(key(7)) is None and inner.contains_many([key(7)])[0]  # unknown key: a miss, kept
    assert stack.get(key(8)) is None
    got = stack.get_many([key(6), key(5)], [Scratch(), Scratch()])
    assert bytes(got[0].blob) == make_blob(key(6), seed=6) and got[1] is None
    assert tier.counters["seal_failed"] == 3
    stack.close()


def test_config_builds_sealed_tiers_and_refuses_bad_keys_in_one_line(tmp_path):
    base = {"tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path / "d")}}
    tiers = build_tiers(Config.from_dict({**base, "seal": {"keys": f"{b64(KEY_A)},{b64(KEY_B)}", "tiers": ["disk"]}}))
    assert [type(t).__name__ for t in tiers] == ["CpuTier", "SealedTier"]
    assert [type(t).__name__ for t in build_tiers(Config.from_dict(base))] == ["CpuTier", "DiskTier"]  # no key: off
    for bad, message in (("not base64!", "not base64"), (b64(b"short"), "5 bytes, not 32")):
        with pytest.raises(ConfigError, match=message) as refused:
            build_tiers(Config.from_dict({**base, "seal": {"keys": bad, "tiers": ["disk"]}}))
        assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="cannot be sealed"):
        Config.from_dict({"seal": {"tiers": ["cpu"]}})
    assert parse_keys(f" {b64(KEY_A)} ,") == [KEY_A]
