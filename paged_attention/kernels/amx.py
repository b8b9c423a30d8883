"""Intel AMX from Numba: the tile instructions as intrinsics, and whether this process may use them.

AMX (Advanced Matrix Extensions, Xeon since Sapphire Rapids) adds eight *tile* registers of up
to 16 rows of 64 bytes and one instruction that multiplies them, ``tdpbf16ps``:
``C[M, N] += A[M, K] . B[K, N]`` with ``A`` and ``B`` bfloat16 and ``C`` float32, where ``B`` is
stored in pairs ("VNNI" layout): row ``r`` of the ``B`` tile holds, for each column ``n``, the two
values ``B[2r, n]`` and ``B[2r + 1, n]`` side by side (one 32-bit word). With ``K = 32`` that is
16 x 16 x 32 multiply-adds in one instruction, the work of 32 AVX-512 fused multiply-adds.

The tiles' shapes are set once per function by ``ldtilecfg`` from a 64-byte record
(:func:`config`); ``tilerelease`` gives the registers back. Linux hands the tile state to a
process only after it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``,
:func:`permitted`); without that, the first tile instruction is an illegal instruction.

The intrinsics name their tile registers by number, fixed when they are made (the instruction
encodes them): :func:`load`, :func:`store`, :func:`zero` and :func:`dot` make one intrinsic per
register (or triple). :func:`spread16` lays 16 positions' softmax weights out as ``A`` tiles that
multiply the values as they lie in the cache, :func:`transpose16` the queries' pairs of dimensions
as ``B`` tiles (:mod:`.loop_amx`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
import warnings

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_I8, _I32, _I64, _VOID = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.VoidType()
_BYTES = ir.IntType(8).as_pointer()


def _address(context, builder, array_type, array, offset):
    """The address of element ``offset`` (flat, C order) of a Numba array, as ``i8*``."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), _BYTES)


def _call(builder, name, argument_types, arguments):
    function = builder.module.declare_intrinsic(name, (), ir.FunctionType(_VOID, argument_types))
    builder.call(function, arguments)


@intrinsic
def configure(typingctx, record):
    """``ldtilecfg``: the tiles' shapes from a 64-byte ``uint8`` record (:func:`config`)."""

    def codegen(context, builder, signature, args):
        address = _address(context, builder, signature.args[0], args[0], _I64(0))
        _call(builder, "llvm.x86.ldtilecfg", [_BYTES], [address])
        return context.get_dummy_value()

    return types.void(record), codegen


@intrinsic
def release(typingctx):
    """``tilerelease``: the tile registers back to their initial state."""

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()

    return types.void(), codegen


def _memory(tile: int, name: str):
    """An intrinsic ``(array, offset, stride)`` that moves tile register ``tile`` to or from the
    rows that start at element ``offset`` of ``array``, ``stride`` bytes apart (``name``: the LLVM
    intrinsic)."""

    @intrinsic
    def move_tile(typingctx, array, offset, stride):
        def codegen(context, builder, signature, args):
            address = _address(context, builder, signature.args[0], args[0], args[1])
            _call(builder, name, [_I8, _BYTES, _I64], [_I8(tile), address, args[2]])
            return context.get_dummy_value()

        return types.void(array, types.int64, types.int64), codegen

    return move_tile


def load(tile: int):
    """An intrinsic ``(array, offset, stride)``: tile register ``tile`` from the rows that start at
    element ``offset`` of ``array``, ``stride`` bytes apart (``tileloadd``)."""
    return _memory(tile, "llvm.x86.tileloadd64")


def store(tile: int):
    """An intrinsic ``(array, offset, stride)``: tile register ``tile`` into rows of ``array``
    (``tilestored``), as :func:`load` reads them."""
    return _memory(tile, "llvm.x86.tilestored64")


def zero(tile: int):
    """An intrinsic ``()``: tile register ``tile`` set to zeros (``tilezero``)."""

    @intrinsic
    def zero_tile(typingctx):
        def codegen(context, builder, signature, args):
            _call(builder, "llvm.x86.tilezero", [_I8], [_I8(tile)])
            return context.get_dummy_value()

        return types.void(), codegen

    return zero_tile


def dot(c: int, a: int, b: int):
    """An intrinsic ``()``: ``tile[c] += tile[a] . tile[b]``, bfloat16 pairs into float32 (``tdpbf16ps``)."""

    @intrinsic
    def dot_tiles(typingctx):
        def codegen(context, builder, signature, args):
            _call(builder, "llvm.x86.tdpbf16ps", [_I8, _I8, _I8], [_I8(c), _I8(a), _I8(b)])
            return context.get_dummy_value()

        return types.void(), codegen

    return dot_tiles


def _join(builder, a, b):
    """Two vectors of one kind as one twice as long, ``a``'s elements first."""
    order = ir.Constant(ir.VectorType(_I32, 2 * a.type.count), list(range(2 * a.type.count)))
    return builder.shuffle_vector(a, b, order)


_WORDS = ir.VectorType(_I32, 16)


def _words(array: types.Type) -> bool:
    """Whether ``array`` is a Numba array of 32-bit elements (what the transpositions move)."""
    return isinstance(array, types.Array) and array.dtype.bitwidth == 32


def _columns16(context, builder, array_type, array, first):
    """The 16 columns of the 16 x 16 block of 32-bit words at ``array[first:]`` (rows 16 words
    apart), each as a vector: one transposition in vector shuffles."""
    source = context.make_array(array_type)(context, builder, array).data
    rows = []
    for t in range(16):
        address = builder.bitcast(
            builder.gep(source, [builder.add(first, _I64(16 * t))]), _WORDS.as_pointer()
        )
        rows.append(builder.load(address, align=4))
    while len(rows) > 1:
        rows = [_join(builder, rows[k], rows[k + 1]) for k in range(0, len(rows), 2)]
    order = ir.Constant(ir.VectorType(_I32, 256), [t * 16 + c for c in range(16) for t in range(16)])
    block = builder.shuffle_vector(rows[0], ir.Constant(rows[0].type, ir.Undefined), order)
    pick = [ir.Constant(_WORDS, list(range(16 * c, 16 * c + 16))) for c in range(16)]
    return [builder.shuffle_vector(block, ir.Constant(block.type, ir.Undefined), p) for p in pick]


def _store_words(context, builder, array_type, array, at, row):
    target = context.make_array(array_type)(context, builder, array).data
    builder.store(row, builder.bitcast(builder.gep(target, [at]), _WORDS.as_pointer()), align=4)


@intrinsic
def transpose16(typingctx, target, at, source, first):
    """``target[at:]`` (16 rows of 16 32-bit words, 16 apart) = the transpose of the same block at
    ``source[first:]``: rows of a tile's ``B`` operand from the rows they pair up (:mod:`.loop_amx`
    writes the queries' pairs of dimensions this way, a row per query column in, a row per pair out)."""

    def codegen(context, builder, signature, args):
        columns = _columns16(context, builder, signature.args[2], args[2], args[3])
        for c, column in enumerate(columns):
            _store_words(
                context, builder, signature.args[0], args[0], builder.add(args[1], _I64(16 * c)), column
            )
        return context.get_dummy_value()

    if _words(target) and _words(source):
        return types.void(target, types.int64, source, types.int64), codegen


@intrinsic
def spread16(typingctx, target, at, weights, first):
    """The weights of 16 positions (rows ``t`` of ``weights[first:]``: 16 float32 lanes, one per
    column, each rounded to bfloat16) as two ``A`` tiles of 16 rows, one per column, 64 bytes apart:
    ``target[at:]`` (``uint32``) holds, per column ``c``, 16 words whose low halves are the bfloat16
    bits of position ``t``'s weight (an *even* tile: the weight in slot ``2t``, zero in ``2t + 1``),
    and ``target[at + 256:]`` the same with the bits in the high halves (an *odd* tile). Multiplied
    by 16 value rows as they lie in the cache (``B``: row ``t`` holds dimensions ``2n, 2n + 1``
    in pair ``n``), the even tile sums weights times even dimensions and the odd tile times odd
    ones. One 16 x 16 transposition, in vector shuffles."""

    def codegen(context, builder, signature, args):
        columns = _columns16(context, builder, signature.args[2], args[2], args[3])
        shift = ir.Constant(_WORDS, [16] * 16)
        for c, odd in enumerate(columns):
            for offset, row in ((16 * c, builder.lshr(odd, shift)), (256 + 16 * c, odd)):
                _store_words(
                    context, builder, signature.args[0], args[0], builder.add(args[1], _I64(offset)), row
                )
        return context.get_dummy_value()

    if _words(target) and _words(weights):
        return types.void(target, types.int64, weights, types.int64), codegen


def config(shapes: dict[int, tuple[int, int]]) -> np.ndarray:
    """The 64-byte ``ldtilecfg`` record for ``{tile: (rows, bytes per row)}``: palette 1, each
    used tile's row count and row width (tiles not named stay unused)."""
    record = np.zeros(64, np.uint8)
    record[0] = 1  # palette 1: eight tiles of up to 16 rows of 64 bytes
    for tile, (rows, width) in shapes.items():
        if not (0 < rows <= 16 and 0 < width <= 64 and 0 <= tile < 8):
            raise ValueError(f"tile {tile}: {rows} rows of {width} bytes; allowed: 1-16 rows of 1-64 bytes")
        record[16 + 2 * tile : 18 + 2 * tile] = np.frombuffer(np.uint16(width).tobytes(), np.uint8)
        record[48 + tile] = rows
    return record


@functools.cache
def permitted() -> bool:
    """Whether this process may use the tiles: the processor has AMX-BF16 (as LLVM, which Numba
    compiles for, sees it), Numba targets this processor, and Linux granted the tile state
    (asked once). ``PAGED_ATTENTION_AMX=0`` in the environment says no (to compare the two paths).
    The environment is read on every call, the processor and Linux once (every attention layer of
    every step asks: the question cost ~8 us a call, ~0.25 ms a decode step of SmolLM2)."""
    if os.environ.get("PAGED_ATTENTION_AMX", "1") == "0":
        return False
    if os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES"):
        return False  # Numba compiles for another processor than this one
    return _granted()


@functools.cache
def _granted() -> bool:
    """The processor has AMX-BF16 and Linux granted this process the tile state (asked once)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features()
        if not (features.get("amx-bf16") and features.get("amx-tile")):
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): system call 158 on x86-64
        if libc.syscall(158, 0x1023, 18) == 0:
            return True
        reason = os.strerror(ctypes.get_errno())
    except (OSError, AttributeError, RuntimeError) as error:
        reason = str(error)
    warnings.warn(f"this processor has AMX but Linux did not grant its tiles ({reason}); bfloat16 attention "
                  "takes the vector loops instead", RuntimeWarning, stacklevel=3)  # fmt: skip
    return False
