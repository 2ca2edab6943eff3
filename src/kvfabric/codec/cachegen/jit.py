"""numba set-up for the cachegen kernels: `jit(sig)` entry points compiled lazily on first call and cached on
disk, `inline` helpers, and the explicit signatures (`SIG`). Without numba the same functions run as plain Python
(slow; for portability and for tests of the fallback)."""
from __future__ import annotations

try:
    from numba import njit as _njit
    from numba import types as _t

    HAVE_NUMBA = True

    class _Lazy:
        """An entry point compiled on first call with one explicit signature ('A' layout arrays: contiguous or
        strided, read-only or not, all share one compiled body) and cached on disk: importing costs nothing,
        and a process compiles (or loads from the cache) only the kernels it uses."""

        def __init__(self, fn, sig) -> None:  # noqa: ANN001
            self.py_func, self.sig, self._fn = fn, sig, None
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

    def _arr(dtype, ndim, ro=False):  # noqa: ANN001, ANN202
        return _t.Array(dtype, ndim, "A", readonly=ro)

    _f32, _f64, _i32, _i64, _u8, _u16, _u32, _b = (_t.float32, _t.float64, _t.int32, _t.int64, _t.uint8, _t.uint16,
                                                   _t.uint32, _t.boolean)
    SIG = {
        "quantize_stats": _t.void(_arr(_f32, 3, True), _arr(_f32, 1, True), _arr(_f32, 1, True), _arr(_f32, 1, True),
                                  _arr(_f32, 1, True), _i64, _b, _arr(_f64, 2), _i64),
        "quantize": _t.void(_arr(_f32, 3, True), _arr(_f32, 1, True), _arr(_f32, 1, True), _arr(_f32, 1, True),
                            _arr(_f32, 1, True), _arr(_u8, 1, True), _i64, _b, _arr(_i32, 2), _arr(_f64, 2)),
        "encode_lossy": _i64(_arr(_i32, 2, True), _arr(_i32, 1, True), _arr(_i32, 1, True), _arr(_i32, 1, True),
                             _arr(_i32, 1, True), _i64, _b, _arr(_i64, 2, True), _arr(_f64, 2, True), _arr(_u16, 1)),
        "decode_lossy": _b(_arr(_u16, 1, True), _i64, _i64, _arr(_f32, 3), _arr(_f32, 1, True), _arr(_f32, 1, True),
                           _arr(_f32, 1, True), _arr(_f32, 1, True), _arr(_u8, 1, True), _arr(_i32, 1, True),
                           _arr(_i32, 1, True), _arr(_i32, 1, True), _arr(_i32, 1, True), _i64, _b,
                           _arr(_u32, 2, True)),
        "dequantize": _t.void(_arr(_i32, 2, True), _arr(_f32, 1, True), _arr(_f32, 1, True), _arr(_f32, 1, True),
                              _arr(_f32, 1, True), _arr(_u8, 1, True), _i64, _b, _arr(_f32, 3)),
        "encode_bytes": _i64(_arr(_u8, 1, True), _arr(_i32, 1, True), _arr(_i32, 1, True), _arr(_u16, 1)),
        "decode_bytes": _b(_arr(_u16, 1, True), _i64, _i64, _arr(_u32, 1, True), _arr(_u8, 1)),
        "chunk_stats": _t.void(_arr(_f32, 5, True), _i64, _arr(_f64, 3)),
        "mode_costs": _t.void(_arr(_f32, 5, True), _arr(_i64, 1, True), _arr(_f32, 2, True), _arr(_f32, 2, True),
                              _arr(_f32, 2, True), _arr(_f32, 2, True), _i64, _b, _arr(_f64, 2), _arr(_f64, 3), _i64),
        "encode_segments": _t.void(_arr(_f32, 5, True), _arr(_i64, 1, True), _arr(_f32, 2, True), _arr(_f32, 2, True),
                                   _arr(_f32, 2, True), _arr(_f32, 2, True), _arr(_u8, 2, True), _arr(_u8, 2),
                                   _arr(_u8, 2), _arr(_b, 1, True), _i64, _b, _arr(_i64, 2, True), _arr(_f64, 2, True),
                                   _arr(_i32, 2), _arr(_f64, 2), _arr(_u16, 2), _arr(_i64, 1)),
    }
except ImportError:  # pragma: no cover - exercised only where numba is missing
    HAVE_NUMBA = False
    SIG = {}

    def jit(sig=None):  # noqa: ANN001, ANN201
        return lambda fn: fn

    def inline(fn):  # noqa: ANN001, ANN201
        return fn
