"""kvfabric.blend: CacheBlend, reuse of cached passage KV anywhere in a prompt with selective recompute.

Modules: ``runner`` (layer-by-layer Llama-family forward over HF weights, any token subset per layer; RoPE
re-rotation), ``store`` (passage KV in a CacheEngine namespace, one entry per layer group), ``matcher`` (rolling-hash
search for cached passages in a flat token list), ``controller`` (recompute ratio from the measured load speed) and
``fusion`` (the :class:`Blender`: selective recompute with gradual filtering, pipelined loads, correctness gate).
"""
from kvfabric.blend.controller import LoadController
from kvfabric.blend.fusion import Blender
from kvfabric.blend.matcher import Match, PassageMatcher
from kvfabric.blend.runner import LlamaRunner, UnsupportedModel, rotate
from kvfabric.blend.store import PassageStore, passage_digest
from kvfabric.blend.values import BlendConfig, BlendResult, Ranker

__all__ = ["BlendConfig", "BlendResult", "Blender", "LlamaRunner", "LoadController", "Match", "PassageMatcher",
           "PassageStore", "Ranker", "UnsupportedModel", "passage_digest", "rotate"]
