"""Cross-size KV reuse: per-layer linear maps from a sender model's KV to a receiver's of another size (one family,
one tokenizer: Qwen2.5-Coder 0.5B and 1.5B), fitted once by least squares on profiling prompts.

Contract
--------
* :func:`layer_map` pairs receiver layer ``l`` with sender layer ``round(l (La - 1) / (Lb - 1))`` (same relative
  depth).
* :func:`kv_features` turns a runner's KV ``[L, 2, H, n, D]`` into per-layer features ``[L, 2, n, H*D]``: K *before*
  RoPE (un-rotated at its positions) and V. A linear map cannot follow RoPE's position-dependent rotation, and the
  two models rotate different head dims, so K is mapped unrotated and rotated again with the receiver's RoPE.
* :func:`fit_maps` solves, for each receiver layer and K/V, ``W = argmin ||[x, 1] W - y||^2 + ridge ||W||^2`` over
  the profiling tokens (float64 normal equations, the bias row not regularised): a :class:`KVMaps`.
* :meth:`KVMaps.apply` writes the receiver's KV for slots ``[0, n)`` of a receiver workspace from the sender's KV:
  mapped V, mapped K rotated at positions ``0..n-1``. :meth:`KVMaps.save` / :func:`load_maps`: npz, no pickle.
* ``KVMaps.r2``: the share of each receiver layer's K / V variance the map explains on the profiling tokens.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvfabric.blend.runner import LlamaRunner, apply_rope


def layer_map(num_sender: int, num_receiver: int) -> tuple[int, ...]:
    if num_receiver == 1:
        return (num_sender - 1,)
    return tuple(round(l * (num_sender - 1) / (num_receiver - 1)) for l in range(num_receiver))


def kv_features(runner: LlamaRunner, kv: torch.Tensor, n: int) -> torch.Tensor:
    """kv [L, 2, H, >= n, D] (K after RoPE at positions 0..n-1) -> [L, 2, n, H*D] float64, K unrotated."""
    cos, sin = runner.rope(torch.arange(n))
    k = apply_rope(kv[:, 0, :, :n].double(), cos.double(), -sin.double()) / runner.rope_scale ** 2
    v = kv[:, 1, :, :n].double()
    layers, heads, _, dim = k.shape
    return torch.stack([k, v], 1).permute(0, 1, 3, 2, 4).reshape(layers, 2, n, heads * dim)


@dataclass(frozen=True, eq=False)
class KVMaps:
    sender_layers: tuple[int, ...]  # for each receiver layer, the sender layer it reads
    weights: np.ndarray  # float32 [Lb, 2, Fa + 1, Fb]: [x, 1] @ W ~ the receiver's K (unrotated) / V
    r2: np.ndarray  # float64 [Lb, 2]: variance explained on the profiling tokens

    def apply(self, sender: LlamaRunner, sender_kv: torch.Tensor, n: int, receiver: LlamaRunner,
              out: torch.Tensor) -> None:
        """Receiver KV for slots [0, n) of out [Lb, 2, Hb, T, Db] from the sender's KV [La, 2, Ha, >= n, Da]."""
        x = kv_features(sender, sender_kv, n).float()  # [La, 2, n, Fa]
        ones = torch.ones(n, 1)
        w = torch.from_numpy(self.weights)
        cos, sin = receiver.rope(torch.arange(n))
        heads, dim = receiver.num_kv_heads, receiver.head_dim
        for l, src in enumerate(self.sender_layers):
            for kind in (0, 1):
                y = torch.cat([x[src, kind], ones], 1) @ w[l, kind]  # [n, Fb]
                y = y.view(n, heads, dim).transpose(0, 1)  # [Hb, n, Db]
                out[l, kind, :, :n] = apply_rope(y, cos, sin) if kind == 0 else y

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, sender_layers=np.array(self.sender_layers), weights=self.weights, r2=self.r2)
        tmp.replace(path)


def load_maps(path: Path) -> KVMaps:
    with np.load(path, allow_pickle=False) as z:
        return KVMaps(tuple(int(i) for i in z["sender_layers"]), z["weights"].astype(np.float32), z["r2"])


def fit_maps(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], sender_layers: tuple[int, ...],
             ridge: float = 1e-3) -> KVMaps:
    """Maps from (sender features [La, 2, n, Fa], receiver features [Lb, 2, n, Fb]) of each profiling prompt."""
    xtx = xty = yty = ysum = None
    count = 0
    for xs, ys in pairs:
        xs = xs[list(sender_layers)]
        xs = torch.cat([xs, xs.new_ones(*xs.shape[:-1], 1)], -1)  # [Lb, 2, n, Fa + 1]
        a, b, c = xs.transpose(2, 3) @ xs, xs.transpose(2, 3) @ ys, (ys * ys).sum(2)
        xtx, xty, yty = (a, b, c) if xtx is None else (xtx + a, xty + b, yty + c)
        ysum = ys.sum(2) if ysum is None else ysum + ys.sum(2)
        count += ys.shape[2]
    if xtx is None:
        raise ValueError("fit_maps needs at least one profiling prompt")
    size = xtx.shape[-1]
    reg = torch.eye(size, dtype=xtx.dtype) * ridge * xtx.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True)[..., None]
    reg[..., -1, -1] = 0.0  # the bias is not regularised
    # numpy's solver: torch's batched float64 LU failed here inside MKL (DLASWP parameter errors) at Fa = 256
    w = torch.from_numpy(np.linalg.solve((xtx + reg).numpy(), xty.numpy()))  # [Lb, 2, Fa + 1, Fb]
    # R^2 = 1 - residual / total, from the same sums: ||XW - Y||^2 = Y'Y - 2 W'X'Y + W'X'XW
    residual = yty.sum(-1) - 2 * (w * xty).sum((-2, -1)) + (w * (xtx @ w)).sum((-2, -1))
    total = yty.sum(-1) - (ysum * ysum).sum(-1) / count
    return KVMaps(tuple(sender_layers), w.float().numpy(), (1 - residual / total).numpy())
