"""A CPU stand-in for SGLang's HiCache host pool (tests/test_sglang_backend.py).

SGLang 0.5.23's `MHATokenToKVPoolHost` cannot be imported on this machine (its module pulls in transformers, a
CUDA-only torchvision and sgl_kernel), and its buffers are allocated for CUDA/ROCm/XPU. A storage backend only
uses its page methods; these are SGLang's own, reproduced for the two MHA layouts (`layer_first`, `page_first`):
the K and V buffers as one tensor [2, layers, tokens, heads, head_dim] or [2, tokens, layers, heads, head_dim],
`get_data_page(index, flat)`, `get_dummy_flat_data_page()`, `set_from_flat_data_page(index, page)`.
"""
from __future__ import annotations

import torch


class MHATokenToKVPoolHost:
    def __init__(self, layout: str = "layer_first", layer_num: int = 3, head_num: int = 2, head_dim: int = 8,
                 page_size: int = 4, num_pages: int = 32, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        self.layout, self.layer_num, self.head_num, self.head_dim = layout, layer_num, head_num, head_dim
        self.page_size, self.dtype, self.size = page_size, dtype, page_size * num_pages
        if layout == "layer_first":
            dims = (2, layer_num, self.size, head_num, head_dim)
        elif layout == "page_first":
            dims = (2, self.size, layer_num, head_num, head_dim)
        else:
            raise ValueError(f"unsupported layout {layout}")
        self.kv_buffer = torch.randn(dims, generator=torch.Generator().manual_seed(seed)).to(dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, :, index:index + self.page_size, :, :]
        else:
            data_page = self.kv_buffer[:, index:index + self.page_size, :, :, :]
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + self.page_size, :, :] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        else:
            self.kv_buffer[:, index:index + self.page_size, :, :, :] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)

    def page(self, i: int) -> torch.Tensor:
        """Test helper: page i's data, flat (a copy)."""
        return self.get_data_page(i * self.page_size).clone()

    def indices(self, pages: list[int]) -> torch.Tensor:
        """Test helper: the host token indices of these pages, as SGLang passes them (page_size per page)."""
        return torch.tensor([p * self.page_size + t for p in pages for t in range(self.page_size)], dtype=torch.int64)
