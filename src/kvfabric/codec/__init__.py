"""kvfabric.codec."""
