"""Bandwidth-adaptive KV streaming: a prompt's KV sent chunk by chunk over TCP, each chunk at the codec level that
keeps the whole load within a TTFT target, or as tokens for the receiver to recompute when no level can.

- throttle.py: a token bucket and a socket wrapper that holds a sender to a given rate (a 1 Gbit/s link on
  loopback);
- protocol.py: the framing (bounds-checked: a frame never makes the receiver allocate more than the chunk it
  announced can need);
- policy.py: the per-chunk choice (raw, a cachegen level, or recompute) from the measured throughput;
- meter.py: that throughput as the kernel counts it (bytes the receiver acknowledged, TCP_INFO), not as long as
  send calls took (a send into a megabyte socket buffer returns at memory speed);
- sender.py / receiver.py: the two ends; the receiver decodes while the next chunk is on the wire and recomputes
  token chunks with a callback (the model), in order.
Everything listens on 127.0.0.1 only.
"""
from kvfabric.stream.policy import AdaptivePolicy, Choice, FixedPolicy, Option
from kvfabric.stream.receiver import Receiver, ReceiveResult
from kvfabric.stream.sender import PreparedPrompt, SendReport, prepare, send_prompt
from kvfabric.stream.throttle import ThrottledSocket, TokenBucket, loopback_pair

__all__ = ["AdaptivePolicy", "Choice", "FixedPolicy", "Option", "PreparedPrompt", "ReceiveResult", "Receiver",
           "SendReport", "ThrottledSocket", "TokenBucket", "loopback_pair", "prepare", "send_prompt"]
