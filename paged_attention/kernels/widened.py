"""bfloat16 products of many rows on a CPU without bfloat16 arithmetic: the weights widened a slice at a time.

A CPU with AVX512-BF16 or AMX multiplies bfloat16 pairs in one instruction, and oneDNN's packed
product (:mod:`..models.packed_linear`) uses it. A CPU with AVX-512 but neither (an Ice Lake Xeon,
say) still packs bfloat16 for oneDNN, which then emulates the arithmetic, and slowly: on such a
2-core Xeon, one thread, a pass over SmolLM2-135M's 121 products took 0.19 s at 16 rows, 0.60 s at
64 and 2.3 s at 256 (10.8 ms a prompt token), against 0.13, 0.26 and 0.67 s this way. A prompt is
hundreds of rows, so a bfloat16 engine there spent most of its time prefilling.

This way (:func:`linear`): a slice of the weight, as many rows as fit 1 MiB of float32
(:data:`SLICE`, within a core's L2 cache), is widened to float32 (exact: a bfloat16 is the top half
of a float32; :func:`.loop_rows.widened`, the pass that reads the weights from memory), multiplied
with the float32 rows by torch's float32 product (MKL), the next slice reusing the same buffer; the
float32 sums get the bias, then are rounded to bfloat16 once, as oneDNN's are. At most
:data:`BLOCK` rows at a time. The sums are in
another order than oneDNN's: results within one rounding of its, not its bits. Fewer rows than
:data:`WIDE_ROWS` stay oneDNN's (at 4 rows it was 0.07 s against 0.13 this way: widening every
weight costs a pass of ~30 ms whatever the rows).

Where it is used: the engine's bfloat16 row kernel (:class:`.rows.Streamed`) takes products of at
least :data:`WIDE_ROWS` rows this way where :func:`needed` (an AVX-512 CPU without either
instruction); never in batch-invariant mode, whose products keep oneDNN's fixed chunks (the packed
and merged layers try no row kernel while the mode is on).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from . import compiled
from .arrays import as_numpy

#: The fewest rows multiplied this way (fewer: oneDNN's product, or the row loop).
WIDE_ROWS = 16
#: float32 elements of one widened slice of the weight (1 MiB): it stays in the L2 cache for the
#: product that reads it.
SLICE = 1 << 18
#: Rows multiplied together at most: more (a long prompt's logprobs over the vocabulary) are taken
#: a block at a time, each widening the weights again (~30 ms a pass for SmolLM2, a few percent of
#: a block's product), so that the float32 sums never exceed ``BLOCK`` rows of outputs.
BLOCK = 256

_buffers = threading.local()  # one slice buffer per thread (an engine's products run in one)


@functools.cache
def needed() -> bool:
    """Whether this CPU has AVX-512 but no bfloat16 arithmetic (neither AVX512-BF16 nor AMX-BF16,
    as LLVM reads the host), so that oneDNN's packed bfloat16 products emulate it. ``False`` where
    LLVM is missing, and on a CPU without AVX-512 (oneDNN does not pack bfloat16 there, and this
    was not measured there)."""
    try:
        from llvmlite import binding
    except ImportError:
        return False
    features = binding.get_host_cpu_features()  # (every feature LLVM knows, each True or False)
    avx512 = features.get("avx512f", False)  # where oneDNN packs bfloat16 and this was measured
    return avx512 and not (features.get("avx512bf16", False) or features.get("amx-bf16", False))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """``F.linear(x, weight, bias)`` for a bfloat16 ``x[..., K]`` of at least :data:`WIDE_ROWS` rows,
    a contiguous bfloat16 ``weight[N, K]`` and a bfloat16 ``bias[N]`` (or none), computed in float32
    from widened slices of the weight and rounded once (see the module docstring). ``None`` where it
    does not apply (fewer rows, another dtype, shape or device, autograd, Numba unavailable): the
    caller multiplies as before."""
    k_in = weight.shape[-1] if weight.dim() == 2 else 0
    rows = x.numel() // max(1, k_in)
    if rows < WIDE_ROWS or k_in == 0 or x.shape[-1] != k_in or torch.is_grad_enabled():
        return None
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if not all(t.dtype == torch.bfloat16 and t.is_cpu for t in tensors) or not compiled.available():
        return None
    n_out = weight.shape[0]
    if not weight.is_contiguous() or (bias is not None and bias.shape != (n_out,)):
        return None
    flat = x.detach().reshape(rows, k_in)
    out = torch.empty(rows, n_out, dtype=torch.bfloat16)
    step = max(1, SLICE // k_in)
    buffer = _buffer(step * k_in)
    bits, wide = as_numpy(weight.detach()).reshape(-1), as_numpy(buffer)
    bias32 = None if bias is None else bias.detach().to(torch.float32)[:, None]
    try:
        loop = _loop()
        for first in range(0, rows, BLOCK):  # (the float32 sums of a block of rows at a time)
            inputs = flat[first : first + BLOCK].to(torch.float32).t()  # [K, M]: the right side
            sums = torch.empty(n_out, inputs.shape[1], dtype=torch.float32)  # transposed: slices fill rows
            for start in range(0, n_out, step):
                stop = min(n_out, start + step)
                size = (stop - start) * k_in
                loop(bits[start * k_in : stop * k_in], wide[:size])
                torch.mm(buffer[:size].view(stop - start, k_in), inputs, out=sums[start:stop])
            if bias32 is not None:
                sums += bias32
            out[first : first + BLOCK].copy_(sums.t())  # (rounded once, to nearest even)
    except Exception as error:  # (Numba could not compile the loop: the caller's product instead)
        compiled.give_up(error)
        return None
    return out.view(*x.shape[:-1], n_out)


def _buffer(size: int) -> Tensor:
    """This thread's float32 slice buffer, at least ``size`` elements."""
    kept = getattr(_buffers, "tensor", None)
    if kept is None or kept.numel() < size:
        kept = _buffers.tensor = torch.empty(max(size, SLICE), dtype=torch.float32)
    return kept


@functools.cache
def _loop() -> Callable[[np.ndarray, np.ndarray], None]:
    from .loop_rows import widened  # imported late: importing Numba costs half a second

    return widened
