"""kvfabric.bench."""
