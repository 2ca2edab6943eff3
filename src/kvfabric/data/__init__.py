"""Package data: the demo document (original text, CC0), read by the demo and, without ../shared, the benchmarks;
and where the shared MuSiQue file is found (never shipped: ../shared/data is read-only input)."""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

MUSIQUE_NAME = "musique_s.json"


def demo_document() -> str:
    return resources.files("kvfabric").joinpath("data/demo_document.txt").read_text()


def find_musique(path: str | os.PathLike | None = None) -> Path:
    """The MuSiQue file: ``path``, $KVFABRIC_BLEND_DATA, or ../shared/data/musique_s.json next to the repo/cwd."""
    if path:
        return Path(path)
    env = os.environ.get("KVFABRIC_BLEND_DATA")
    if env:
        return Path(env)
    candidates = [Path.cwd() / ".." / "shared" / "data" / MUSIQUE_NAME,
                  Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / MUSIQUE_NAME]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(f"{MUSIQUE_NAME} not found (looked at {', '.join(map(str, candidates))}); "
                            "pass data=... or set KVFABRIC_BLEND_DATA")
