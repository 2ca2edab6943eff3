"""File modes of what kvfabric keeps on this host: a cached chunk is the prompt in another form.

Contract:
- `parse_mode(value)`: a directory mode from config ("0700", "700", "0o750", or an int), owner rwx required, no
  bits beyond 0o777 and none for "others" unless the value says so; raises ValueError naming the value.
- `file_mode(dir_mode)`: the mode of the files in such a directory (no execute bits): 0700 -> 0600, 0770 -> 0660.
- `make_private_dir(path, mode)`: the directory and its missing parents; the directories made here get `mode`
  exactly, whatever the umask (parents that exist already are left alone).
- `check_mode(path, mode, what, strict)`: a path that grants more than `mode` is one logged warning naming it, its
  mode and the fix, or `PermissionsError` (the same line) with `strict`. A path that is not there is fine.
- `create_file(path, mode)`: an exclusive create with exactly `mode` (umask aside); returns the open fd.
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


class PermissionsError(PermissionError):
    """A cache path readable beyond what the configuration allows, with `strict_permissions` on."""


def parse_mode(value: str | int) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        text = str(value).strip().lower().removeprefix("0o")
        if not text or any(c not in "01234567" for c in text) or len(text) > 4:
            raise ValueError(f"{value!r} is not an octal mode like 0700")
        mode = int(text, 8)
    if mode & ~0o777 or mode & 0o700 != 0o700:
        raise ValueError(f"{value!r}: a cache directory mode must give its owner rwx (0700) and nothing beyond 0777")
    return mode


def file_mode(dir_mode: int) -> int:
    return dir_mode & 0o666


def make_private_dir(path: Path, mode: int = PRIVATE_DIR) -> None:
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:  # made by another process meanwhile: its mode is checked by the caller
            continue
        os.chmod(directory, mode)  # the umask may have taken bits `mode` asks for


def check_mode(path: Path, mode: int, what: str, strict: bool = False) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    extra = stat.S_IMODE(st.st_mode) & ~mode & 0o777
    if not extra:
        return
    fix = f"chmod {mode:o} {path}" if stat.S_ISDIR(st.st_mode) else f"chmod {file_mode(mode):o} {path}"
    message = (f"{what} {path} is mode {stat.S_IMODE(st.st_mode):04o}: other users can read cached prompts "
               f"through it; {fix}")
    if strict:
        raise PermissionsError(message)
    log.warning("kvfabric: %s (strict_permissions: true makes this an error)", message)


def create_file(path: Path | str, mode: int = PRIVATE_FILE, flags: int = 0) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | flags, mode)
    if mode & 0o077:  # group bits asked for: the umask (022 usually) may have taken some
        os.fchmod(fd, mode)
    return fd
