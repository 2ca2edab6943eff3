"""Package data: the demo document (original text, CC0), read by the demo and, without ../shared, the benchmarks;
and where files of the shared data folder are found (never shipped: ../shared/data is read-only input)."""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

MUSIQUE_NAME = "musique_s.json"


def demo_document() -> str:
    return resources.files("kvfabric").joinpath("data/demo_document.txt").read_text()


def find_shared_data(name: str) -> Path:
    """``$KVFABRIC_DATA_DIR/name``, else ``../shared/data/name`` next to the working directory or the checkout."""
    env = os.environ.get("KVFABRIC_DATA_DIR")
    folders = [Path(env)] if env else []
    folders += [Path.cwd() / ".." / "shared" / "data", Path(__file__).resolve().parents[3] / ".." / "shared" / "data"]
    for folder in folders:
        if (folder / name).is_file():
            return (folder / name).resolve()
    raise FileNotFoundError(f"{name} not found in {', '.join(map(str, folders))}; set KVFABRIC_DATA_DIR")


def find_musique(path: str | os.PathLike | None = None) -> Path:
    """The MuSiQue file: ``path`` if given, else ``find_shared_data("musique_s.json")``."""
    return Path(path) if path else find_shared_data(MUSIQUE_NAME)
