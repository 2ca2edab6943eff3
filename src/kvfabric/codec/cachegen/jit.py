"""numba set-up for the cachegen kernels: `jit(sig)` entry points compiled lazily on first call and cached on
disk, `inline` helpers, the explicit signatures (`SIG`), and two fp16 conversions numba lacks (`store`, `widen`).
Without numba the same functions run as plain Python (slow; for portability and for tests of the fallback).

Why the fp16 intrinsics: numba has no float16 type, and numpy's float32 <-> float16 casts are slow enough to
take a large share of the whole decode (docs/design/measurements.md). LLVM's fptrunc / fpext to `half` compile
to the CPU's conversion instructions (F16C), round to nearest even exactly as numpy does, and let the kernels
read and write fp16 KV directly (as uint16 bit patterns)."""
from __future__ import annotations

import numpy as np


def store(v, out):  # noqa: ANN001, ANN201
    """v (float32) as an element of `out`: itself for a float32 array, its fp16 bits (round to nearest even)
    for a uint16 array, which holds fp16 values."""
    return np.float32(v) if out.dtype == np.float32 else np.float16(v).view(np.uint16)


def widen(bits):  # noqa: ANN001, ANN201
    """The float32 value of fp16 bits (uint16); exact."""
    return np.float32(np.uint16(bits).view(np.float16))


try:
    from llvmlite import ir as _ir
    from numba import njit as _njit
    from numba import types as _t
    from numba.extending import intrinsic as _intrinsic
    from numba.extending import overload as _overload

    HAVE_NUMBA = True

    class _Lazy:
        """An entry point compiled on first call with its explicit signature(s) and cached on disk: importing
        costs nothing, and a process compiles (or loads from the cache) only the kernels it uses. Arrays are "A"
        layout (contiguous or strided, read-only or not: one compiled body), or "C" where a loop must vectorize."""

        def __init__(self, fn, sig) -> None:  # noqa: ANN001
            self.py_func, self.sig, self._fn = fn, sig, None  # sig: one signature or a list of them
            self.__name__, self.__doc__ = fn.__name__, fn.__doc__

        def compiled(self):  # noqa: ANN201
            if self._fn is None:
                self._fn = _njit(self.sig, nogil=True, cache=True)(self.py_func)
            return self._fn

        def __call__(self, *args):  # noqa: ANN001, ANN204
            return (self._fn or self.compiled())(*args)

    def jit(sig=None):  # noqa: ANN001, ANN201
        """Entry points (with a signature) compile lazily, once; helpers called from other kernels (no signature)
        are plain numba functions, compiled inside their caller's types."""
        def wrap(fn):  # noqa: ANN001, ANN202
            return _Lazy(fn, sig) if sig is not None else _njit(nogil=True, cache=True)(fn)
        return wrap

    def inline(fn):  # noqa: ANN001, ANN201
        return _njit(nogil=True, cache=True, inline="always")(fn)

    @_intrinsic
    def _f16_bits(typingctx, v):  # noqa: ANN001, ANN202
        if v != _t.float32:
            return None

        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            return builder.bitcast(builder.fptrunc(args[0], _ir.HalfType()), _ir.IntType(16))
        return _t.uint16(v), codegen

    @_intrinsic
    def _f16_value(typingctx, bits):  # noqa: ANN001, ANN202
        if bits != _t.uint16:
            return None

        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            return builder.fpext(builder.bitcast(args[0], _ir.HalfType()), _ir.FloatType())
        return _t.float32(bits), codegen

    @_overload(store, inline="always")
    def _store(v, out):  # noqa: ANN001, ANN202
        if out.dtype == _t.float32:
            return lambda v, out: v
        if out.dtype == _t.uint16:
            return lambda v, out: _f16_bits(v)
        return None

    @_overload(widen, inline="always")
    def _widen(bits):  # noqa: ANN001, ANN202
        return lambda bits: _f16_value(bits)

    def _arr(dtype, ndim, ro=False):  # noqa: ANN001, ANN202
        return _t.Array(dtype, ndim, "A", readonly=ro)

    def _carr(dtype, ndim, ro=False):  # noqa: ANN001, ANN202
        return _t.Array(dtype, ndim, "C", readonly=ro)

    _f32, _f64, _i32, _i64, _u8, _u16, _u32, _b = (_t.float32, _t.float64, _t.int32, _t.int64, _t.uint8, _t.uint16,
                                                   _t.uint32, _t.boolean)
    SIG = {
        "decode_lossy": [_b(_arr(_u16, 1, True), _i64, _i64, _arr(out, 3), _arr(_f32, 1, True), _arr(_f32, 1, True),
                            _arr(_f32, 1, True), _arr(_f32, 1, True), _arr(_u8, 1, True), _arr(_i32, 1, True),
                            _arr(_i32, 1, True), _arr(_i32, 1, True), _arr(_i32, 1, True), _i64, _b,
                            _arr(_u32, 2, True)) for out in (_f32, _u16)],  # out: float32, or fp16 bits
        "dequantize": _t.void(_arr(_i32, 2, True), _arr(_f32, 1, True), _arr(_f32, 1, True), _arr(_f32, 1, True),
                              _arr(_f32, 1, True), _arr(_u8, 1, True), _i64, _b, _arr(_f32, 3)),
        "encode_bytes": _i64(_arr(_u8, 1, True), _arr(_i32, 1, True), _arr(_i32, 1, True), _arr(_u16, 1)),
        "decode_bytes": _b(_arr(_u16, 1, True), _i64, _i64, _arr(_u32, 1, True), _arr(_u8, 1)),
        "chunk_stats": _t.void(_carr(_f32, 5, True), _i64, _arr(_f64, 3)),
        "widen_f16": _t.void(_arr(_u16, 4, True), _arr(_f32, 4)),
        "mode_costs": _t.void(_arr(_f32, 5, True), _arr(_i64, 1, True), _arr(_f32, 2, True), _arr(_f32, 2, True),
                              _arr(_f32, 2, True), _arr(_f32, 2, True), _i64, _b, _arr(_f64, 2), _arr(_f64, 3), _i64),
        # the chunk, its per-channel parameters and the residual buffer C-contiguous: the quantize loop vectorizes
        "encode_segments": _t.void(_carr(_f32, 5, True), _arr(_i64, 1, True), _carr(_f32, 2, True),
                                   _carr(_f32, 2, True), _carr(_f32, 2, True), _carr(_f32, 2, True),
                                   _carr(_u8, 2, True), _arr(_u8, 2), _arr(_u8, 2), _arr(_b, 1, True), _i64, _b,
                                   _arr(_i64, 2, True), _arr(_f64, 2, True), _carr(_i32, 2), _arr(_f64, 2),
                                   _arr(_u16, 2), _arr(_i64, 1)),
    }
except ImportError:  # pragma: no cover - exercised only where numba is missing
    HAVE_NUMBA = False
    SIG = {}

    def jit(sig=None):  # noqa: ANN001, ANN201
        return lambda fn: fn

    def inline(fn):  # noqa: ANN001, ANN201
        return fn
