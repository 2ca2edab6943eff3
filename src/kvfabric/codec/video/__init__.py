"""The video codec: KV chunks as video frames coded by a real video codec (PyAV / FFmpeg), restored frame by frame.

PyAV is imported when a VideoCodec is made, not here: `import kvfabric` works without it, and making the codec
without it raises VideoUnavailable (an ImportError) that names the package.
"""
from kvfabric.codec.video.backends import BACKENDS, VideoUnavailable
from kvfabric.codec.video.codec import CODEC_ID, DEFAULT_LEVEL, MAX_LEVEL, VideoCodec

__all__ = ["BACKENDS", "CODEC_ID", "DEFAULT_LEVEL", "MAX_LEVEL", "VideoCodec", "VideoUnavailable"]
