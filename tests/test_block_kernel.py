"""cache/placer.py: ChunkPlacer copies runs of whole blocks, and the slots of a partial block, into every layer, from
memory or from a file, and hashes the payload in the same pass (the digest is xxh3-64 of the payload in its order)."""
from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvfabric.cache.placer import ChunkPlacer
from kvfabric.kv.blocks import BlockLayout, region_tokens

NUM_LAYERS, SLAB_BLOCKS, CACHE_BLOCKS, HEADS, BLOCK, DIM = 3, 6, 16, 2, 4, 8  # a block: [H, 2, B*D] float16
WIDTH = BLOCK * DIM
BLOCKS = BlockLayout(BLOCK, key_dt=True)  # K dim-major, V token-major: vLLM's CPU "vec" layout


def _setup(seed: int):
    rng = np.random.default_rng(seed)
    layers = [np.zeros((CACHE_BLOCKS, HEADS, 2, WIDTH), dtype=np.float16) for _ in range(NUM_LAYERS)]
    payload = rng.standard_normal((NUM_LAYERS, SLAB_BLOCKS, HEADS, 2, WIDTH)).astype(np.float16)
    staging = np.zeros(payload[0].nbytes, dtype=np.uint8)
    # (first in slab, first in cache, blocks, first and end token of a block)
    runs = np.array([[0, 9, 2, 0, BLOCK], [2, 3, 3, 0, BLOCK], [5, 0, 1, 0, BLOCK]], dtype=np.int64)
    return layers, payload, staging, runs


def _expected(layers, payload, runs) -> None:
    for layer, slab in zip(layers, payload, strict=True):
        for first, into, count, _, _ in runs:
            assert np.array_equal(layer[into:into + count], slab[first:first + count])


def test_from_memory_places_every_run_and_hashes_the_payload():
    layers, payload, staging, runs = _setup(1)
    placer = ChunkPlacer(layers, BLOCKS, staging)
    is_whole, digest = placer.place(runs, payload[0].nbytes, src=payload.reshape(-1).view(np.uint8), check=True)
    assert is_whole and digest == xxhash.xxh3_64_intdigest(payload.tobytes())
    _expected(layers, payload, runs)
    assert 0 <= placer.hash_ns <= placer.cpu_ns  # CPU time: the hash is a part of the call's
    placer.close()


def test_from_a_file_and_a_short_file_is_not_whole(tmp_path):
    layers, payload, staging, runs = _setup(2)
    path = tmp_path / "chunk"
    path.write_bytes(b"h" * 100 + payload.tobytes())
    placer = ChunkPlacer(layers, BLOCKS, staging)
    with open(path, "rb") as f:
        is_whole, digest = placer.place(runs, payload[0].nbytes, fd=f.fileno(), file_offset=100, check=True)
    assert is_whole and digest == xxhash.xxh3_64_intdigest(payload.tobytes())
    _expected(layers, payload, runs)
    path.write_bytes(b"h" * 100 + payload.tobytes()[:-1])  # torn: the last layer's slab is short
    with open(path, "rb") as f:
        assert placer.place(runs, payload[0].nbytes, fd=f.fileno(), file_offset=100, check=False) == (False, None)
    placer.close()


def test_a_source_shorter_than_its_slabs_is_refused():
    layers, payload, staging, runs = _setup(3)
    placer = ChunkPlacer(layers, BLOCKS, staging)
    with pytest.raises(ValueError, match="slabs"):
        placer.place(runs, payload[0].nbytes, src=payload.reshape(-1).view(np.uint8)[:-2], check=True)
    placer.close()


@pytest.mark.parametrize("misalign", [2, 8, 40, 62])
def test_destinations_off_a_cache_line_are_copied_exactly(misalign):
    # the copies stream whole 64-byte lines of the destination: the bytes before its first line and after its
    # last go through the cache
    layers, payload, staging, runs = _setup(4)
    nbytes = layers[0].nbytes
    raw = [np.zeros(nbytes + 128, dtype=np.uint8) for _ in layers]
    starts = [(-r.ctypes.data % 64) + misalign for r in raw]
    layers = [r[at:at + nbytes].view(np.float16).reshape(layers[0].shape) for r, at in zip(raw, starts)]
    placer = ChunkPlacer(layers, BLOCKS, staging)
    is_whole, _ = placer.place(runs, payload[0].nbytes, src=payload.reshape(-1).view(np.uint8), check=False)
    assert is_whole
    _expected(layers, payload, runs)
    for r, at in zip(raw, starts):  # nothing written outside the layer
        assert not r[:at].any() and not r[at + nbytes:].any()
    placer.close()


@pytest.mark.parametrize(("key_dt", "value_dt"), [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize(("lo", "hi"), [(0, 3), (1, 4), (2, 3)])
def test_a_partial_block_gets_its_tokens_slots_and_no_other(key_dt, value_dt, lo, hi):
    """A run with token offsets (a prompt's last block): only tokens [lo, hi) of that block are written, in either
    region layout; the run of whole blocks beside it is copied whole, and the hash still covers the payload."""
    layers, payload, staging, _ = _setup(5)
    layers = [np.full_like(layer, 7.0) for layer in layers]
    runs = np.array([[0, 4, 2, 0, BLOCK], [2, 11, 1, lo, hi]], dtype=np.int64)
    placer = ChunkPlacer(layers, BlockLayout(BLOCK, key_dt, value_dt), staging)
    is_whole, digest = placer.place(runs, payload[0].nbytes, src=payload.reshape(-1).view(np.uint8), check=True)
    assert is_whole and digest == xxhash.xxh3_64_intdigest(payload.tobytes())
    for layer, slab in zip(layers, payload, strict=True):
        assert np.array_equal(layer[4:6], slab[0:2])
        for which, is_dt in enumerate((key_dt, value_dt)):
            got = region_tokens(layer[11, :, which], BLOCK, is_dt)  # [H, B, D]
            want = region_tokens(slab[2, :, which], BLOCK, is_dt)
            assert np.array_equal(got[:, lo:hi], want[:, lo:hi])
            assert (got[:, :lo] == 7.0).all() and (got[:, hi:] == 7.0).all()
        untouched = np.ones(CACHE_BLOCKS, dtype=bool)
        untouched[[4, 5, 11]] = False
        assert (layer[untouched] == 7.0).all()
    placer.close()


def test_runs_of_another_shape_are_refused():
    layers, payload, staging, runs = _setup(6)
    placer = ChunkPlacer(layers, BLOCKS, staging)
    with pytest.raises(ValueError, match="runs"):
        placer.place(runs[:, :3].copy(), payload[0].nbytes, src=payload.reshape(-1).view(np.uint8), check=True)
    placer.close()
