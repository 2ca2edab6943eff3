"""The compiled half of stream_copy.py: `stream_rows(dst, src)` copies uint8 rows [A, B, C, n] with non-temporal
stores (x86 MOVNTI, then SFENCE), compiled by numba once and cached on disk.

Imported only on the first streamed copy (stream_copy._kernel), never when kvfabric is imported: numba/llvmlite
loaded at start-up break hosts that walk every loaded module's attributes (vLLM's CPU worker does, to rebind
Triton kernels, and fails on llvmlite's ffi objects).
"""
from __future__ import annotations

import platform

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
def stream_rows(dst, src):  # noqa: ANN001, ANN202
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
