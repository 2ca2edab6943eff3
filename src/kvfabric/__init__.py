"""kvfabric: a persistent, shareable KV cache for LLM inference.

Public names: `CacheEngine` (lookup / store / retrieve KV by token prefix), `Config` (typed configuration),
`KVLayout` (a model's KV shape and dtype).
"""
from kvfabric.config import Config
from kvfabric.engine import CacheEngine
from kvfabric.layout import KVLayout

__all__ = ["CacheEngine", "Config", "KVLayout"]
__version__ = "0.1.0"
