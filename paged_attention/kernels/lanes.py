"""Sixteen float32 lanes (one AVX-512 register) as a Numba value, for code that works on 16
columns at once (:mod:`.column_softmax`).

Numba leaves vectorizing to LLVM, which vectorizes a loop only when it can prove its arrays do not
overlap. A loop over 16 columns inside a loop over 32 positions is unrolled first, and then stays
scalar: 16 times the instructions (measured: a chunk's softmax 1.1 us instead of 0.19). These
intrinsics say the vector code outright: ``Lanes`` is LLVM's ``<16 x float>``, held in a register,
and every operation is one vector instruction (or a short fixed sequence of them).

* :func:`load`, :func:`store`: the 64 bytes of an array from element ``offset`` (16 float32, or as bits);
* :func:`splat`: one float32 in every lane; ``+``, ``-`` and ``*`` lane by lane; :func:`maximum`;
* :func:`power2`: ``2**x`` on [-126, 0] (softmax weights, as ``2**((s - max) log2(e))``);
* :func:`rounded`: to bfloat16's precision, nearest even (finite values);
* :func:`keep`: ``x`` where ``t < limits[c]`` (``limits``: 16 ``int32``), ``fill`` elsewhere;
* :func:`fma`: ``a * b + c`` rounded once; :func:`total`: the sum of the 16 lanes, in a fixed order;
* :func:`dot`: ``acc`` plus the pairwise products of 32 bfloat16 in two values of bits;
  :func:`odd`, :func:`even`: the two halves of such a value, widened (``dot``'s two steps, apart);
  :func:`pair`: one bfloat16 pair in every lane; :func:`narrowed`, :func:`put`: to bfloat16, stored;
* :func:`aligned`: scratch arrays that start on a 64-byte line;
* ``prefetch``, ``prefetch_l2``: ask for a cache line ahead (into the L1, into the L2); :func:`address`:
  a tensor's ``data_ptr()`` as a pointer (the loops of :mod:`.loop_nest` and its siblings use them).

No instruction may be reordered or fused (:data:`_EXACT`), even inside a fast-math function, so
the same code gives the same bits wherever it is inlined.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic, models, overload, register_model

#: Lanes in one value: float32 columns in a 512-bit register.
LANES = 16

_FLOAT, _WORD = ir.FloatType(), ir.IntType(32)
_VECTOR, _WORDS = ir.VectorType(_FLOAT, LANES), ir.VectorType(_WORD, LANES)


class Lanes(types.Type):
    """The Numba type of 16 float32 lanes."""

    def __init__(self) -> None:
        super().__init__(name="Lanes")


lanes = Lanes()


@register_model(Lanes)
class _Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VECTOR)


def _pointer(context, builder, signature, args, kind):
    """``&array[offset]`` (flat, C order) as a pointer to ``kind``, for an intrinsic's first two
    arguments ``(array, offset)``."""
    data = context.make_array(signature.args[0])(context, builder, args[0]).data
    offset = context.cast(builder, args[1], signature.args[1], types.intp)
    return builder.bitcast(builder.gep(data, [offset]), kind.as_pointer())


def _splat(value, kind=_VECTOR):
    return ir.Constant(kind, [value] * LANES)


@intrinsic
def load(typingctx, array, offset):
    """Lanes from the 64 bytes that start at element ``offset`` of ``array`` (16 float32; of an
    array of another kind, its bits: 32 ``uint16`` or 16 ``uint32``)."""

    def codegen(context, builder, signature, args):
        return builder.load(_pointer(context, builder, signature, args, _VECTOR), align=1)

    return lanes(array, offset), codegen


@intrinsic
def store(typingctx, array, offset, x):
    """``x`` into the 64 bytes that start at element ``offset`` of ``array`` (as :func:`load`)."""

    def codegen(context, builder, signature, args):
        builder.store(args[2], _pointer(context, builder, signature, args, _VECTOR), align=1)
        return context.get_dummy_value()

    return types.void(array, offset, lanes), codegen


@intrinsic
def splat(typingctx, value):
    """``value`` (float32) in every lane."""

    def codegen(context, builder, signature, args):
        scalar = context.cast(builder, args[0], signature.args[0], types.float32)
        one = builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), scalar, _WORD(0))
        return builder.shuffle_vector(one, one, _splat(0, _WORDS))

    if isinstance(value, (types.Float, types.Integer)):
        return lanes(value), codegen


def _binary(name: str):
    @intrinsic
    def apply(typingctx, a, b):
        def codegen(context, builder, signature, args):
            return _op(builder, name, *args)

        return lanes(lanes, lanes), codegen

    return apply


_add, _sub, _mul = _binary("fadd"), _binary("fsub"), _binary("fmul")


def _operator(op, function):
    @overload(op)
    def lanewise(a, b):
        if isinstance(a, Lanes) and isinstance(b, Lanes):
            return lambda a, b: function(a, b)


for _python, _lanewise in ((operator.add, _add), (operator.sub, _sub), (operator.mul, _mul)):
    _operator(_python, _lanewise)


#: Every float instruction here carries this flag (signed zeros may be ignored: no value here
#: depends on a zero's sign), so that Numba's fast-math pass, which flags only instructions that
#: have none, leaves them as written: no reordering, no fused multiply-adds. (The calls of LLVM's
#: ``fma`` and ``rint`` in :func:`power2` carry none: that pass flags only calls that return one
#: float or double, never a vector.)
_EXACT = ("nsz",)


def _op(builder, name: str, a, b):
    """``builder.<name>(a, b)`` (``fadd``, ``fsub``, ``fmul``) with :data:`_EXACT`."""
    return getattr(builder, name)(a, b, flags=_EXACT)


def _max(builder, a, b):
    return builder.select(builder.fcmp_ordered(">", a, b, flags=_EXACT), a, b)


def _min(builder, a, b):
    return builder.select(builder.fcmp_ordered("<", a, b, flags=_EXACT), a, b)


@intrinsic
def maximum(typingctx, a, b):
    """The larger of ``a`` and ``b`` in each lane."""

    def codegen(context, builder, signature, args):
        return _max(builder, *args)

    return lanes(lanes, lanes), codegen


#: ``2**f = e**(f ln 2)``'s Taylor coefficients ``(ln 2)**k / k!``, highest first: on ``|f| <= 1/2``
#: the first term left out is below ``1.3e-7``, float32's own precision.
_POWER2 = tuple(math.log(2) ** k / math.factorial(k) for k in range(6, -1, -1))


def _call(builder, name: str, *args):
    """LLVM's ``name`` intrinsic on 16 float32 lanes (``llvm.fma``, ``llvm.rint``)."""
    kind = ir.FunctionType(_VECTOR, [_VECTOR] * len(args))
    return builder.call(cgutils.get_or_insert_function(builder.module, kind, name + ".v16f32"), args)


@intrinsic
def power2(typingctx, x):
    """``2**x`` in each lane, ``x`` clamped to [-126, 0] (-126: the least normal float32):
    ``x = n + f`` with ``n`` the nearest integer and ``|f| <= 1/2``; ``2**f`` by :data:`_POWER2`'s
    polynomial in fused multiply-adds, ``2**n`` written into the exponent's bits."""

    def codegen(context, builder, signature, args):
        x = _min(builder, _max(builder, args[0], _splat(-126.0)), _splat(0.0))  # (masked lanes: anything)
        n = _call(builder, "llvm.rint", x)
        f = _op(builder, "fsub", x, n)
        p = _splat(_POWER2[0])
        for c in _POWER2[1:]:
            p = _call(builder, "llvm.fma", p, f, _splat(c))
        power = builder.shl(builder.add(builder.fptosi(n, _WORDS), _splat(127, _WORDS)), _splat(23, _WORDS))
        return _op(builder, "fmul", p, builder.bitcast(power, _VECTOR))

    return lanes(lanes), codegen


@intrinsic
def rounded(typingctx, x):
    """Each lane rounded to bfloat16's precision (its low 16 bits cleared), to nearest, ties to even."""

    def codegen(context, builder, signature, args):
        bits = builder.bitcast(args[0], _WORDS)
        odd = builder.and_(builder.lshr(bits, _splat(16, _WORDS)), _splat(1, _WORDS))
        bits = builder.add(builder.add(bits, odd), _splat(0x7FFF, _WORDS))
        return builder.bitcast(builder.and_(bits, _splat(-0x10000, _WORDS)), _VECTOR)

    return lanes(lanes), codegen


@intrinsic
def keep(typingctx, x, limits, t, fill):
    """``x`` in the lanes ``c`` where ``t < limits[c]`` (``limits``: 16 ``int32``), ``fill`` elsewhere."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[1])(context, builder, args[1]).data
        bounds = builder.load(builder.bitcast(data, _WORDS.as_pointer()), align=4)
        at = builder.trunc(context.cast(builder, args[2], signature.args[2], types.int64), _WORD)
        one = builder.insert_element(ir.Constant(_WORDS, ir.Undefined), at, _WORD(0))
        below = builder.icmp_signed("<", builder.shuffle_vector(one, one, _splat(0, _WORDS)), bounds)
        return builder.select(below, args[0], args[3])

    if isinstance(limits, types.Array) and limits.dtype == types.int32:
        return lanes(lanes, limits, t, lanes), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` in each lane with one rounding (LLVM's ``fma``: one instruction where the CPU
    has it, the same bits everywhere)."""

    def codegen(context, builder, signature, args):
        return _call(builder, "llvm.fma", *args)

    return lanes(lanes, lanes, lanes), codegen


@intrinsic
def total(typingctx, x):
    """The sum of the 16 lanes as one float32: halves added lane by lane (0-7 + 8-15, then 0-3 +
    4-7, ...), always in this order."""

    def codegen(context, builder, signature, args):
        v, n = args[0], LANES
        while n > 1:
            n //= 2
            low = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_WORD, n), list(range(n))))
            high = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_WORD, n), list(range(n, 2 * n))))
            v = builder.fadd(low, high, flags=_EXACT)
        return builder.extract_element(v, _WORD(0))

    return types.float32(lanes), codegen


@intrinsic
def narrowed(typingctx, x):
    """Each lane's bfloat16 bits (nearest, ties to even; NaN as ``0x7FC0``, as
    :func:`.loop_nest.narrow_bits`) in the high half of its 32 bits, the low half zero."""

    def codegen(context, builder, signature, args):
        bits, word = builder.bitcast(args[0], _WORDS), functools.partial(_splat, kind=_WORDS)
        odd = builder.and_(builder.lshr(bits, word(16)), word(1))
        near = builder.and_(builder.add(builder.add(bits, odd), word(0x7FFF)), word(-0x10000))
        nan = builder.icmp_unsigned(">", builder.and_(bits, word(0x7FFFFFFF)), word(0x7F800000))
        return builder.bitcast(builder.select(nan, word(0x7FC00000), near), _VECTOR)

    return lanes(lanes), codegen


@intrinsic
def pair(typingctx, array, offset):
    """The 32 bits at element ``offset`` of a ``uint16`` array (one bfloat16 pair) in every lane."""

    def codegen(context, builder, signature, args):
        word = builder.load(_pointer(context, builder, signature, args, _WORD), align=1)
        one = builder.insert_element(ir.Constant(_WORDS, ir.Undefined), word, _WORD(0))
        return builder.bitcast(builder.shuffle_vector(one, one, _splat(0, _WORDS)), _VECTOR)

    return lanes(array, offset), codegen


@intrinsic
def put(typingctx, array, offset, bits):
    """Store the high halves of ``bits``' lanes (:func:`narrowed`'s bfloat16 bits) as 16 ``uint16``
    from element ``offset``."""

    def codegen(context, builder, signature, args):
        halves = ir.VectorType(ir.IntType(16), LANES)
        high = builder.trunc(builder.lshr(builder.bitcast(args[2], _WORDS), _splat(16, _WORDS)), halves)
        builder.store(high, _pointer(context, builder, signature, args, halves), align=1)
        return context.get_dummy_value()

    return types.void(array, offset, bits), codegen


def _widened(builder, bits, odd: bool):
    """The even (low) or odd (high) bfloat16 of each 32-bit lane of ``bits``, as float32."""
    if odd:
        return builder.bitcast(builder.and_(bits, _splat(-0x10000, _WORDS)), _VECTOR)
    return builder.bitcast(builder.shl(bits, _splat(16, _WORDS)), _VECTOR)


@intrinsic
def odd(typingctx, bits):
    """The odd (high) bfloat16 of each 32-bit lane of ``bits`` (loaded from a ``uint16`` array),
    as float32: ``bits[2j + 1]`` in lane ``j`` (exact)."""

    def codegen(context, builder, signature, args):
        return _widened(builder, builder.bitcast(args[0], _WORDS), True)

    return lanes(lanes), codegen


@intrinsic
def even(typingctx, bits):
    """The even (low) bfloat16 of each 32-bit lane of ``bits``, as float32: ``bits[2j]`` in lane ``j``."""

    def codegen(context, builder, signature, args):
        return _widened(builder, builder.bitcast(args[0], _WORDS), False)

    return lanes(lanes), codegen


@functools.cache
def paired() -> bool:
    """Whether the code Numba makes may multiply pairs of bfloat16 in one instruction (AVX512-BF16's
    ``vdpbf16ps``), which :func:`dot` then uses: this CPU has it and Numba compiles for this CPU
    (``NUMBA_CPU_NAME``, ``NUMBA_CPU_FEATURES`` or ``NUMBA_ENABLE_AVX=0`` name another target, for
    which LLVM could not emit it)."""
    if config.CPU_NAME or config.CPU_FEATURES or not config.ENABLE_AVX:
        return False
    return bool(binding.get_host_cpu_features().get("avx512bf16", False))


@intrinsic
def dot(typingctx, acc, a, b):
    """``acc`` plus the products of the 32 bfloat16 pairs that ``a`` and ``b`` hold as bits (loaded
    from ``uint16`` arrays): lane ``j`` gets ``a[2j+1] b[2j+1]``, then ``a[2j] b[2j]``, each step a
    fused multiply-add (a product past float32's range is not infinity on its own). One
    ``vdpbf16ps`` where the code may use it (:func:`paired`), else the same two steps in fused
    multiply-adds: the same bits, except near float32's least normal number (1.2e-38), since the
    instruction treats subnormal inputs, accumulators and results as zero (tests/test_lanes.py)."""

    def codegen(context, builder, signature, args):
        acc, x, y = args
        x, y = builder.bitcast(x, _WORDS), builder.bitcast(y, _WORDS)
        if paired():  # (LLVM reads this older <16 x i32> form of the intrinsic, upgrading it)
            kind = ir.FunctionType(_VECTOR, [_VECTOR, _WORDS, _WORDS])
            name = "llvm.x86.avx512bf16.dpbf16ps.512"
            return builder.call(cgutils.get_or_insert_function(builder.module, kind, name), [acc, x, y])
        for odd in (True, False):
            acc = _call(builder, "llvm.fma", _widened(builder, x, odd), _widened(builder, y, odd), acc)
        return acc

    return lanes(lanes, lanes, lanes), codegen


@njit(inline="always")
def aligned(shape, kind):
    """Zeros of ``shape`` (a tuple) and element type ``kind``, starting on a 64-byte line: Numba's
    own arrays start 32 bytes into one, so every 64-byte vector or tile row read from them would
    span two lines."""
    size = 1
    for n in shape:
        size *= n
    width = np.empty(0, kind).itemsize
    raw = np.zeros(size * width + 64, np.uint8)
    skip = (-raw.ctypes.data) % 64
    return raw[skip : skip + size * width].view(kind).reshape(shape)


def _prefetcher(locality: int):  # type: ignore[no-untyped-def]
    @intrinsic
    def prefetch(typingctx, array, offset):
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
            word = ir.IntType(32)  # (the arguments: read, locality, data)
            kind = ir.FunctionType(ir.VoidType(), [address.type, word, word, word])
            call = builder.module.declare_intrinsic("llvm.prefetch", [address.type], kind)
            builder.call(call, [address, word(0), word(locality), word(1)])
            return context.get_dummy_value()

        return types.void(array, offset), codegen

    return prefetch


#: ``prefetch(array, offset)``: ask for the line of element ``offset`` (flat), a hint that never faults
#: (``prefetcht0``); ``prefetch_l2`` into the L2 (``prefetcht1``), whose queue of misses is deeper.
prefetch, prefetch_l2 = _prefetcher(3), _prefetcher(2)


@intrinsic
def address(typingctx, value):
    """The integer ``value`` (a tensor's ``data_ptr()``) as a pointer, for ``numba.carray``: a
    caller that passes addresses makes no NumPy views (each costs about a microsecond in Python)."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.intp), codegen
