"""The compiled half of stream_copy.py: `stream_rows(dst, src)` copies uint8 rows [A, B, C, n] with non-temporal
stores, a whole 64-byte line per store (one AVX-512 VMOVNTDQ or two AVX2 ones; whole lines come closer to a
contiguous memcpy than 8-byte MOVNTI stores did: docs/design/measurements.md), then SFENCE, compiled by numba once
and cached on disk.

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


_LINE = ir.VectorType(ir.IntType(64), 8)  # one 64-byte cache line


@intrinsic
def _stream_line_at(typingctx, dst, src):  # noqa: ANN001, ANN202
    """The 64 bytes at address src to address dst (64-byte aligned) with one non-temporal line store."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        line = builder.load(builder.inttoptr(args[1], _LINE.as_pointer()), align=1)
        store = builder.store(line, builder.inttoptr(args[0], _LINE.as_pointer()), align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return nbt.void(dst, src), codegen


@intrinsic
def _copy_byte_at(typingctx, dst, src):  # noqa: ANN001, ANN202
    """The byte at address src to address dst (through the cache)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        byte = ir.IntType(8).as_pointer()
        builder.store(builder.load(builder.inttoptr(args[1], byte)), builder.inttoptr(args[0], byte))
        return context.get_dummy_value()
    return nbt.void(dst, src), codegen


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
    for a in range(dst.shape[0]):
        for b in range(dst.shape[1]):
            for c in range(dst.shape[2]):
                d, s = dst[a, b, c], src[a, b, c]
                j = min(n, -d.ctypes.data % 64)  # bytes before d's first whole line: copied through the cache
                d[:j] = s[:j]
                for k in range(j, n - (n - j) % 64, 64):  # whole lines, each one vector store (AVX-512 / 2x AVX2)
                    _stream_line_at(d.ctypes.data + k, s.ctypes.data + k)
                k = n - (n - j) % 64
                d[k:] = s[k:]
    _store_fence()


@njit(nogil=True, cache=True)
def stream_chunks(src, offsets, dsts, runs):  # noqa: ANN001, ANN202
    """Cut several chunks out of one KV tensor's uint8 rows src [A, B, C, n]: chunk k is bytes [offsets[k],
    offsets[k] + runs[k]) of every row, copied to address dsts[k] + r * runs[k] for the r-th row (C order), i.e. a
    contiguous [A, B, C, runs[k]] there. Row by row across the chunks, so the source is read in address order
    (chunk by chunk it is read in runs a whole row apart, which the hardware prefetcher follows less well:
    docs/design/measurements.md). A destination's bytes before its first whole line and after its last go through
    the cache, as in stream_rows."""
    r = 0
    for a in range(src.shape[0]):
        for b in range(src.shape[1]):
            for c in range(src.shape[2]):
                row = src[a, b, c].ctypes.data
                for k in range(dsts.shape[0]):
                    n, d, s = runs[k], dsts[k] + r * runs[k], row + offsets[k]
                    head = min(n, -d % 64)
                    tail = n - (n - head) % 64
                    for j in range(head):
                        _copy_byte_at(d + j, s + j)
                    for j in range(head, tail, 64):
                        _stream_line_at(d + j, s + j)
                    for j in range(tail, n):
                        _copy_byte_at(d + j, s + j)
                r += 1
    _store_fence()


@njit(nogil=True, inline="always")
def stream_lines(dst, src, n):  # noqa: ANN001, ANN202
    """Copy the whole 64-byte lines of n bytes from address src to address dst with non-temporal stores; dst must
    be 64-byte aligned. Bytes copied (n rounded down to lines: the caller copies the rest through the cache and
    calls store_fence before it publishes the copy)."""
    whole = n - n % 64
    for k in range(0, whole, 64):
        _stream_line_at(dst + k, src + k)
    return whole


@njit(nogil=True, inline="always")
def store_fence():  # noqa: ANN202
    """Order every non-temporal store before the stores that follow (e.g. the flag that says a copy is done)."""
    _store_fence()
