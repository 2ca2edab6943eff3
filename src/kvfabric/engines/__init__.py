"""Inference-engine integrations.

* :mod:`kvfabric.engines.model` - resolve (builtin name, local folder, hub id) and load the reference model.
* :mod:`kvfabric.engines.gguf` - the builtin models: GGUF files in PyPI wheels, verified and converted once.
* :mod:`kvfabric.engines.runtime` - model runtime helpers: in-place KV buffer cache, fast attention, layouts.
* :mod:`kvfabric.engines.hf` - reference runner over a HF causal LM using the cache.
"""

from __future__ import annotations

from typing import Any

from kvfabric.engines.gguf import ModelError
from kvfabric.engines.model import DEFAULT_MODEL, ensure_model, load_model, setup_model

__all__ = ["DEFAULT_MODEL", "ModelError", "ensure_model", "load_model", "setup_model", "HFEngine", "GenerationResult"]


def __getattr__(name: str) -> Any:  # lazy: the HF runner pulls in the cache core
    if name in ("HFEngine", "GenerationResult"):
        from kvfabric.engines import hf

        return getattr(hf, name)
    raise AttributeError(name)
