"""kvfabric.tiers."""
