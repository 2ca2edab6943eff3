"""File modes of what kvfabric keeps on the host: one test per file kind, checked with os.stat, whatever the umask.

The second-user test (slow) needs root to run commands as the two test users that `scripts/setup.sh --test` makes;
it shows that another local user cannot read a cache or a pool.
"""
from __future__ import annotations

import logging
import os
import stat
import uuid
from pathlib import Path

import pytest

from kvfabric.host.permissions import PermissionsError, check_mode, create_file, file_mode, make_private_dir, parse_mode
from kvfabric.tiers.disk import DiskTier
from kvfabric.tiers.shm import ShmTier
from tests.tier_contract import key, make_blob


def mode_of(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def loose_umask():
    old = os.umask(0o002)  # a umask that would leave group-writable, world-readable files
    yield
    os.umask(old)


def test_parse_mode_takes_octal_text_and_refuses_what_is_not_a_directory_mode():
    assert [parse_mode(v) for v in ("0700", "700", "0o750", 0o770, "0770")] == [0o700, 0o700, 0o750, 0o770, 0o770]
    for bad in ("rwx", "0600", "08", "17777", 0o1700, ""):
        with pytest.raises(ValueError):
            parse_mode(bad)
    assert file_mode(0o700) == 0o600 and file_mode(0o750) == 0o640 and file_mode(0o770) == 0o660


def test_private_dirs_and_files_get_exactly_their_mode(tmp_path, loose_umask):
    make_private_dir(tmp_path / "a" / "b", 0o700)
    assert mode_of(tmp_path / "a") == mode_of(tmp_path / "a" / "b") == 0o700
    make_private_dir(tmp_path / "g", 0o770)  # the umask would drop group write
    assert mode_of(tmp_path / "g") == 0o770
    os.close(create_file(tmp_path / "f", 0o600))
    os.close(create_file(tmp_path / "g" / "f", 0o660))
    assert mode_of(tmp_path / "f") == 0o600 and mode_of(tmp_path / "g" / "f") == 0o660


def test_disk_tier_directories_and_chunk_files_are_private(tmp_path, loose_umask):
    tier = DiskTier(tmp_path / "chunks", 1 << 24)
    assert tier.put(key(1), make_blob(key(1)))
    assert mode_of(tmp_path / "chunks") == mode_of(tmp_path / "chunks" / "tmp") == 0o700
    assert mode_of(tier.path(key(1)).parent) == 0o700 and mode_of(tier.path(key(1))) == 0o600


def test_disk_mode_shares_a_cache_with_a_group(tmp_path, loose_umask):
    tier = DiskTier(tmp_path / "shared", 1 << 24, mode=0o770)
    assert tier.put(key(2), make_blob(key(2)))
    assert mode_of(tmp_path / "shared") == mode_of(tier.path(key(2)).parent) == 0o770
    assert mode_of(tier.path(key(2))) == 0o660


def test_a_wide_cache_directory_is_one_warning_or_with_strict_an_error(tmp_path, caplog):
    root = tmp_path / "old"
    root.mkdir()
    root.chmod(0o755)  # as kvfabric made it before
    with caplog.at_level(logging.WARNING, logger="kvfabric.host.permissions"):
        DiskTier(root, 1 << 20)
    (record,) = caplog.records
    assert str(root) in record.getMessage() and "0755" in record.getMessage() and f"chmod 700 {root}" in \
        record.getMessage() and record.exc_info is None
    with pytest.raises(PermissionsError, match="0755"):
        DiskTier(root, 1 << 20, strict=True)
    root.chmod(0o700)
    DiskTier(root, 1 << 20, strict=True)  # fixed: no error
    check_mode(tmp_path / "missing", 0o700, "nothing", strict=True)  # not there: fine


def test_shm_pool_and_lock_file_are_0600_and_a_wide_pool_is_refused_with_strict(tmp_path, loose_umask):
    name = f"perm-{uuid.uuid4().hex[:8]}"
    tier = ShmTier(name, 1 << 20, root=tmp_path)
    try:
        assert mode_of(tmp_path / f"kvfabric-{name}") == mode_of(tmp_path / f"kvfabric-{name}.lock") == 0o600
    finally:
        tier.close()
    os.chmod(tmp_path / f"kvfabric-{name}", 0o644)
    with pytest.raises(PermissionsError, match="shm pool"):
        ShmTier(name, 1 << 20, root=tmp_path, strict_permissions=True)
    ShmTier(name, 1 << 20, root=tmp_path).close()  # without strict: a warning, and it serves
