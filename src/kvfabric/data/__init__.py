"""Package data: the demo document (original text, CC0), read by the demo and, without ../shared, the benchmarks."""
from __future__ import annotations

from importlib import resources


def demo_document() -> str:
    return resources.files("kvfabric").joinpath("data/demo_document.txt").read_text()
