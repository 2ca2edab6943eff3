"""Config: defaults, YAML, environment (wins), and errors that name the key."""
from __future__ import annotations

import pytest

from kvfabric.config import Config, ConfigError
from kvfabric.config_types import parse_bytes


def test_defaults():
    cfg = Config()
    assert cfg.tiers == ("cpu", "disk") and cfg.chunk_size == 256 and cfg.cpu.capacity == 4 * 2**30


def test_yaml_then_env_wins(tmp_path):
    path = tmp_path / "kvfabric.yaml"
    path.write_text("chunk_size: 128\ntiers: [cpu]\ndisk:\n  capacity: 2GiB\n  fsync: true\n")
    cfg = Config.load(path, environ={"KVFABRIC_CHUNK_SIZE": "64", "KVFABRIC_DISK__PATH": "/x"})
    assert cfg.chunk_size == 64 and cfg.tiers == ("cpu",)
    assert cfg.disk.capacity == 2 * 2**30 and cfg.disk.fsync is True and cfg.disk.path == "/x"
    assert Config.from_yaml(path).chunk_size == 128


def test_env_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("salt: tenant-1\n")
    assert Config.load(environ={"KVFABRIC_CONFIG": str(path), "KVFABRIC_HOME": "/tmp/x"}).salt == "tenant-1"


@pytest.mark.parametrize("data, message", [
    ({"chunk_sise": 3}, "unknown config key 'chunk_sise'; allowed here: chunk_size"),
    ({"disk": {"fsink": True}}, "unknown config key 'disk.fsink'"),
    ({"hash": "md5"}, "hash: 'md5' is not one of sha256, blake3"),
    ({"tiers": ["cpu", "tape"]}, "unknown tier 'tape'; allowed: cpu, shm, disk, redis"),
    ({"chunk_size": "many"}, "chunk_size: expected an integer"),
    ({"chunk_size": 0}, "chunk_size: must be positive"),
    ({"disk": {"capacity": "lots"}}, "disk.capacity: expected a byte size"),
    ({"disk": {"fsync": "maybe"}}, "disk.fsync: expected true or false"),
    ({"disk": 3}, "disk: expected a mapping"),
    ({"codec": "zstd"}, "codec: unknown codec 'zstd'; allowed: raw, int8, cachegen"),
    ({"codec": "cachegen:10"}, "codec: level of cachegen must be an integer in 0..9, got '10'"),
    ({"codec": "raw:1"}, "codec: level of raw must be an integer in 0..0"),
    ({"redis": {"codec": "int8:x"}}, "redis.codec: level of int8 must be an integer in 0..1"),
])
def test_errors_name_the_key(data, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Config.from_dict(data)


def test_unknown_env_variable_is_an_error():
    with pytest.raises(ConfigError, match="unknown config key 'chunk_sizze'"):
        Config.load(environ={"KVFABRIC_CHUNK_SIZZE": "1"})


@pytest.mark.parametrize("text, value", [("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1.5KiB", 1536), (7, 7)])
def test_byte_sizes(text, value):
    assert parse_bytes(text, "x") == value


def test_harness_variables_are_not_config():
    assert Config.load(environ={"KVFABRIC_TEST_MODEL_DIR": "/x", "KVFABRIC_BENCH_DIR": "/y"}) == Config()


def test_codec_specs_per_tier():
    config = Config.load(environ={"KVFABRIC_CODEC": "int8", "KVFABRIC_REDIS__CODEC": "cachegen:7"})
    assert (config.codec, config.redis.codec, config.disk.codec) == ("int8", "cachegen:7", "")
