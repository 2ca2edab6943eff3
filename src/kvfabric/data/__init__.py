"""Package data: the demo document (original text, CC0), read by the demo and, without ../shared, the benchmarks;
and where files of the shared data folder are found (never shipped: ../shared/data is read-only input)."""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

MUSIQUE_NAME = "musique_s.json"


def demo_document() -> str:
    return resources.files("kvfabric").joinpath("data/demo_document.txt").read_text()


def find_shared_data(name: str, env: str = "KVFABRIC_DATA_DIR") -> Path:
    """``$<env>/name``, else ``../shared/data/name`` next to the working directory, the checkout, or the project
    of a worktree checked out under <project>/wt/<name>."""
    repo = Path(__file__).resolve().parents[3]
    folders = [Path(os.environ[env])] if os.environ.get(env) else []
    folders += [Path.cwd() / ".." / "shared" / "data", repo / ".." / "shared" / "data",
                repo / ".." / ".." / "shared" / "data"]
    for folder in folders:
        if (folder / name).is_file():
            return (folder / name).resolve()
    raise FileNotFoundError(f"{name} not found in {', '.join(map(str, folders))}; set {env}")


def find_musique(path: str | os.PathLike | None = None) -> Path:
    """The MuSiQue file: ``path`` if given, else ``find_shared_data("musique_s.json")``."""
    return Path(path) if path else find_shared_data(MUSIQUE_NAME)
