"""Streaming copies of KV chunks: a chunk's rows between a token slice of a KV tensor and a blob's payload.

Why: a chunk is `[L, 2, H, T, D]` tokens [s, e) of a longer KV tensor, so each copy is L*2*H runs of T*D values
(32-64 KiB), and a copy through the cache reads every destination line before writing it (read for
ownership): numpy's copy of these runs ran at 0.6-0.75 of a memcpy of the same bytes. `stream_rows` writes
with non-temporal stores (x86 MOVNTI, no read for ownership, then SFENCE so that other threads see the bytes
once they synchronize), which is what glibc's memcpy does for large contiguous copies; numba compiles it once
and caches it on disk. Without numba, or for rows that are not contiguous, `copy_rows` falls back to numpy.

Contract: `rows(x)` is a uint8 view `[A, B, C, n]` (last axis contiguous) of a `[L, 2, H, T, D]` array whose
(T, D) axes are contiguous together, or None when they are not; `copy_rows(dst, src)` copies such views of
the same shape, all bytes, in row order. Nothing here allocates.
"""
from __future__ import annotations

import platform

import numpy as np

STREAM_BYTES = 1 << 20


def rows(x: np.ndarray) -> np.ndarray | None:
    """x [L, 2, H, T, D] as uint8 rows [L, 2, H, T*D*itemsize]; None if a row is not one contiguous run."""
    if x.ndim != 5 or x.strides[4] != x.itemsize or (x.shape[3] > 1 and x.strides[3] != x.shape[4] * x.itemsize):
        return None
    L, K, H, T, D = x.shape
    return np.lib.stride_tricks.as_strided(x.view(np.uint8) if x.size else x, shape=(L, K, H, T * D * x.itemsize),
                                           strides=(*x.strides[:3], 1), writeable=x.flags.writeable)


def _copy_rows_numpy(dst: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dst, src)


try:
    from llvmlite import ir
    from numba import njit
    from numba import types as nbt
    from numba.extending import intrinsic

    _IS_X86 = platform.machine().lower() in ("x86_64", "amd64")

    def _byte_pointer(context, builder, array_type, array, offset):  # noqa: ANN001, ANN202
        data = context.make_array(array_type)(context, builder, array).data
        return builder.bitcast(builder.gep(data, [offset]), ir.IntType(64).as_pointer())

    @intrinsic
    def _load_u64(typingctx, array, offset):  # noqa: ANN001, ANN202
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            return builder.load(_byte_pointer(context, builder, signature.args[0], *args), align=1)
        return nbt.uint64(array, offset), codegen

    @intrinsic
    def _stream_u64(typingctx, array, offset, value):  # noqa: ANN001, ANN202
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            store = builder.store(args[2], _byte_pointer(context, builder, signature.args[0], args[0], args[1]),
                                  align=1)
            store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            return context.get_dummy_value()
        return nbt.void(array, offset, value), codegen

    @intrinsic
    def _store_fence(typingctx):  # noqa: ANN001, ANN202
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            if _IS_X86:  # non-temporal stores are weakly ordered: SFENCE orders them before later stores
                void = ir.FunctionType(ir.VoidType(), [])
                builder.call(builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=void), [])
            else:
                builder.fence("seq_cst")
            return context.get_dummy_value()
        return nbt.void(), codegen

    @njit(nogil=True, cache=True)
    def _stream_rows(dst, src):  # noqa: ANN001, ANN202
        n = dst.shape[3]
        n8 = n - n % 8
        for a in range(dst.shape[0]):
            for b in range(dst.shape[1]):
                for c in range(dst.shape[2]):
                    d, s = dst[a, b, c], src[a, b, c]
                    for j in range(0, n8, 8):
                        _stream_u64(d, j, _load_u64(s, j))
                    for j in range(n8, n):
                        d[j] = s[j]
        _store_fence()

    HAVE_STREAMING = True
except ImportError:  # pragma: no cover - numba is a dependency; kept for a minimal install
    HAVE_STREAMING = False


def copy_rows(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy uint8 rows [A, B, C, n] (from `rows`) of the same shape; non-temporal stores where available."""
    if dst.shape != src.shape:
        raise ValueError(f"row shapes differ: {dst.shape} vs {src.shape}")
    if HAVE_STREAMING and dst.shape[3] >= 64:
        _stream_rows(dst, src)
    else:
        _copy_rows_numpy(dst, src)


def is_streamed(num_bytes: int) -> bool:
    """Whether a copy of this size goes through `copy_rows`: below STREAM_BYTES a cached copy is as fast (the
    destination stays in cache for its reader) and building the row views would cost more than it saves."""
    return HAVE_STREAMING and num_bytes >= STREAM_BYTES
