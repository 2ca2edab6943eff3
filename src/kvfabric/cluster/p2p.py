"""Peer-to-peer chunk transfer over kvfabric's framed protocol: the stable import path for both sides.

The code lives in `p2p_server` (`PeerServer`, which serves chunks from local tiers, and `is_loopback`) and
`p2p_client` (`PeerClient`, `PeerError`, `new_buffer`); this module re-exports them so existing imports
(`from kvfabric.cluster.p2p import ...`) keep working. The server still logs as "kvfabric.cluster.p2p".
"""
from __future__ import annotations

from kvfabric.cluster.p2p_client import PeerClient, PeerError, new_buffer
from kvfabric.cluster.p2p_server import PeerServer, is_loopback

__all__ = ["PeerClient", "PeerError", "PeerServer", "is_loopback", "new_buffer"]
