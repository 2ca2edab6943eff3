"""kvfabric.host.pages (and connectors.paged.populate over it): memory mapped before a hot path writes it."""
from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from kvfabric.connectors import paged
from kvfabric.host import pages


def _resident_pages(address: int, length: int) -> int:
    mmap_module = mmap
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * (length // mmap_module.PAGESIZE))()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("advice", ["populate", "fallback"])
def test_populate_maps_every_page_and_changes_no_value(monkeypatch, advice):
    """vLLM allocates its CPU KV cache untouched; populate faults it in at attach (MADV_POPULATE_WRITE, or a
    write per page of the byte it holds where the kernel lacks it), values unchanged."""
    mmap_module = mmap
    if advice == "fallback":
        monkeypatch.setattr(pages, "MADV_POPULATE_WRITE", 0x7FFF)  # unknown advice: EINVAL, as on Linux < 5.14
    num_pages = 256
    region = mmap_module.mmap(-1, num_pages * mmap_module.PAGESIZE)  # fresh anonymous pages: none resident
    whole = torch.frombuffer(region, dtype=torch.uint8)
    address = whole.data_ptr()
    assert _resident_pages(address, len(region)) == 0
    whole[5 * mmap_module.PAGESIZE + 7] = 42  # one page already written
    layers = [whole[100:].view(-1), whole[100:]]  # a view off the page start; the same storage twice
    assert paged.populate(layers) == len(region)
    assert _resident_pages(address, len(region)) == num_pages
    expected = torch.zeros(len(region), dtype=torch.uint8)
    expected[5 * mmap_module.PAGESIZE + 7] = 42
    assert torch.equal(whole, expected)
    del whole, layers
    region.close()


def test_populated_empty_is_resident_before_its_first_write():
    array = pages.populated_empty(64 * mmap.PAGESIZE + 5)
    first = array.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
    length = -(-(array.ctypes.data + array.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE - first
    assert _resident_pages(first, length) == length // mmap.PAGESIZE


def test_map_file_maps_the_range_read_only_or_says_the_file_is_short(tmp_path):
    import os

    import numpy as np

    data = np.random.default_rng(0).integers(0, 255, 3 * 4096 + 77, dtype=np.uint8)
    path = tmp_path / "f"
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = pages.map_file(fd, 128, data.size - 128)  # an offset inside a page, as a chunk's payload has
        assert mapping is not None and np.array_equal(mapping.array, data[128:])
        with pytest.raises(ValueError):
            mapping.array[0] = 1  # read-only
        mapping.close()
        assert mapping.array is None
        assert pages.map_file(fd, 128, data.size - 127) is None  # one byte past the end: not mapped
        assert pages.map_file(fd, 0, 0) is None
    finally:
        os.close(fd)
