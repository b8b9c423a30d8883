"""bfloat16 products on a CPU without bfloat16 arithmetic: the weights widened to float32 in registers.

A CPU with AVX512-BF16 or AMX multiplies bfloat16 pairs in one instruction, and oneDNN's packed
product (:mod:`..models.packed_linear`) uses it. A CPU with AVX-512 but neither (an Ice Lake Xeon,
say) still packs bfloat16 for oneDNN, which then emulates the arithmetic, and slowly: on such a
2-core Xeon, one thread, a pass over SmolLM2-135M's 121 products took 72-81 ms at 4 rows, 110-120
at 8, 180-186 at 16, 590 at 64 and 2.3 s at 256 (10.8 ms a prompt token). A prompt is hundreds of
rows, so a bfloat16 engine there spent most of its time prefilling.

This way (:func:`linear`, the loop :func:`.loop_rows.linear_quads`): the inputs are widened to
float32 once; each 64 bytes of a weight (32 bfloat16) are widened in registers (exact: a bfloat16
is the top half of a float32; one mask and one shift) and multiplied with four rows at once, 16
sums held in registers; a block of weight rows stays in the L2 cache while every four rows pass
over it, so the weights come from memory once. The same pass took 27 ms at 4 rows, 45 at 8, 65 at
16, 190 at 64, 0.72 s at 256: about one 512-bit multiply-add a cycle, the pace of MKL's float32
product on that core. (The way before it widened a slice of the weight into a float32 buffer and
called MKL: 137, 163 and 286 ms at 16, 32 and 64 rows, 0.89 s at 256.)

Each output is summed in the order of :func:`.loop_rows.linear_rows` (its bits, on such a CPU: a
row gets the same bits whether it is multiplied alone or beside others), then the bias, rounded
once: within one rounding of oneDNN's results, not its bits.

Where it is used: the engine's bfloat16 row kernel (:class:`.rows.Streamed`) takes products of at
least :data:`WIDE_ROWS` rows this way where :func:`needed` (an AVX-512 CPU without either
instruction), and in batch-invariant mode every product, whole (:meth:`.rows.Streamed.invariant`:
its bits are each row's own, the mode's contract, where oneDNN would need fixed chunks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from . import compiled
from .arrays import as_numpy

#: The fewest rows multiplied this way (fewer: the row loop, each row alone, which re-reads each
#: weight from the L1 cache: 25 against 29 ms a pass at 2 rows, 32 against 27 at 4).
WIDE_ROWS = 4


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
    a contiguous bfloat16 ``weight[N, K]`` and a bfloat16 ``bias[N]`` (or none), summed in float32
    as the module says and rounded once. ``None`` where it does not apply (fewer rows, another
    dtype, shape or device, autograd, Numba unavailable): the caller multiplies as before.
    :class:`.rows.Streamed` calls the loop by address instead (no views made per call)."""
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
    flat = x.detach().reshape(rows, k_in).contiguous()
    out = torch.empty(rows, n_out, dtype=torch.bfloat16)
    added = as_numpy(bias.detach().contiguous()) if bias is not None else np.zeros(0, np.uint16)
    try:
        _loop()(as_numpy(flat), as_numpy(weight.detach()), added, as_numpy(out))
    except Exception as error:  # (Numba could not compile the loop: the caller's product instead)
        compiled.give_up(error)
        return None
    return out.view(*x.shape[:-1], n_out)


@functools.cache
def _loop() -> Callable[..., None]:
    from .loop_rows import linear_quads  # imported late: importing Numba costs half a second

    return linear_quads
