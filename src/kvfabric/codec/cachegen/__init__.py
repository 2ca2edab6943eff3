"""CacheGen: KV compression for transport (token locality, layer sensitivity, per-channel entropy coding)."""
from kvfabric.codec.cachegen.codec import CacheGenCodec

__all__ = ["CacheGenCodec"]
