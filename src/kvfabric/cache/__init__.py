"""The cache: the protocol every engine integration uses, the two caches that meet it, and the builder.

    protocol.py   KVCache (PrefixCache + ChunkStore), TierAdmin; the values crossing it; shared argument checks
    sources.py    what a chunk read gives: TokenSource / BlockSource (verified, context managers) or ChunkMiss
    engine.py     CacheEngine, the in-process cache, composed of:
      core.py       shared state; the one "drop a damaged chunk" step
      reads.py      read_into / read_chunk / open_chunk / read_many
      ranged.py     a rank's rows of a stored chunk, read and checked alone (the chunk's head table)
      retrieve.py   retrieve with read-ahead
      writes.py     store / new_payload / store_chunks / premap / paused
    placer.py     the compiled copy of a block-layout chunk into a paged cache, hashed in the same pass
    remote/       RemoteCache: the same protocol over the host's `kvfabric server`
    builder.py    build_engine(config, layout, model_id): the one place a cache is composed
"""
