"""The cachegen codec's compiled kernels in one namespace (`from kvfabric.codec.cachegen import kernels as K`):
the 4-lane rANS coder of quantized residuals (rans.py: its stream format, robustness contract and encoder;
rans_decode.py: its decoder), the lossless byte-plane coder (planes.py), quantization and whole-chunk kernels
(quant.py), numba set-up (jit.py)."""
from __future__ import annotations

from kvfabric.codec.cachegen.jit import HAVE_NUMBA
from kvfabric.codec.cachegen.planes import (
    decode_bytes,
    encode_bytes,
    slots_for,
    table_from_counts,
)
from kvfabric.codec.cachegen.quant import (
    POW8,
    chunk_stats,
    dequantize,
    encode_segments,
    mode_costs,
    quantize,
    quantize_stats,
    steps_from_exponents,
    widen_f16,
)
from kvfabric.codec.cachegen.rans import MASK, PB, QMAX, RL, encode_lossy
from kvfabric.codec.cachegen.rans_decode import decode_lossy

__all__ = ["HAVE_NUMBA", "MASK", "PB", "POW8", "QMAX", "RL", "chunk_stats", "decode_bytes", "decode_lossy",
           "dequantize", "encode_bytes", "encode_lossy", "encode_segments", "mode_costs", "quantize",
           "quantize_stats", "slots_for", "steps_from_exponents", "table_from_counts", "widen_f16"]
