"""kvfabric: a persistent, shareable KV cache for LLM inference.

Public names: `CacheEngine` (lookup / store / retrieve KV by token prefix), `Config` (typed configuration),
`KVLayout` (a model's KV shape and dtype). They are imported on first use, so that entry points can set the
OpenMP environment before torch loads (see kvfabric.apps.cli).
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CacheEngine", "Config", "KVLayout"]
__version__ = "0.1.0"
_HOMES = {"CacheEngine": "kvfabric.cache.engine", "Config": "kvfabric.config", "KVLayout": "kvfabric.kv.layout"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'kvfabric' has no attribute {name!r}")
