"""CacheGen: KV compression for transport (token locality, layer sensitivity, per-channel entropy coding)."""
from kvfabric.codec.cachegen.codec import CacheGenCodec
from kvfabric.codec.cachegen.wire import SegmentCoder

__all__ = ["CacheGenCodec", "SegmentCoder"]
