"""The shm rows' `huge_pages` field: read from the mount table, innermost tmpfs mount wins."""
from kvfabric.bench.tiers_shared import tmpfs_huge_option

MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,relatime,size=24683784k 0 0
tmpfs /dev/shm/huge tmpfs rw,relatime,huge=within_size 0 0
tmpfs /run tmpfs rw,nosuid,huge=always 0 0
"""


def test_huge_option_of_the_innermost_tmpfs(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS)
    (tmp_path / "pool").mkdir()
    assert tmpfs_huge_option("/dev/shm", str(mounts)) == "never"  # tmpfs without the option
    assert tmpfs_huge_option("/dev/shm/huge/pools", str(mounts)) == "within_size"
    assert tmpfs_huge_option("/run/x", str(mounts)) == "always"
    assert tmpfs_huge_option("/dev/shmother", str(mounts)) == ""  # a prefix of a name is not a parent: ext4 /
    assert tmpfs_huge_option("/dev/shm", str(tmp_path / "missing")) == ""
