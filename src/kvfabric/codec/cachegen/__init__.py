"""CacheGen: KV compression for transport (token locality, layer sensitivity, per-channel entropy coding)."""
from kvfabric.codec.cachegen.codec import (
    CODEC_ID,
    DEFAULT_LEVEL,
    MAX_LEVEL,
    CacheGenCodec,
)

__all__ = ["CODEC_ID", "DEFAULT_LEVEL", "MAX_LEVEL", "CacheGenCodec"]
