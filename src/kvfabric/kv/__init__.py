"""The KV data model and its keys: what a chunk of KV is, whatever stores it.

    layout.py    KVLayout: layers, KV heads, head_dim, dtype, layer groups; byte sizes, fingerprint, part layouts
    blocks.py    BlockLayout: a paged engine's block of KV; the one block <-> token-major conversion
    hashing.py   tokens -> prefix-chained chunk keys (KeySpace: model, layout, chunk size, salt)
    shapes.py    ChunkShape: how a chunk is stored (whole, or split into parts under derived keys)

Imports nothing of kvfabric above it.
"""
