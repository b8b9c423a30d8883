"""Batch-invariant matrix products: a row's result that does not depend on what shares its batch.

A linear layer multiplies every token of a step at once: ``[rows, in] @ [in, out]``. The math of
one row does not involve the others, but the *rounding* does: the library picks its kernel, its
blocking and the order of the sums by the number of rows (oneDNN and MKL both do), so a token's
output can differ in the last bit between a step of 1 row and a step of 9 (measured on this
package's CPU: SmolLM2's ``down_proj`` in bfloat16 at 1, 3, 17 or 64 rows against 16 differed in 3
of 80 rows; float32 products in half of them). In bfloat16 a flipped last bit is 1/256 of the value,
and a few such flips can change a greedy answer: the reason two runs of the same prompts that batch
requests differently (paged against contiguous memory, or a decode step against a step that
verifies drafts) may write different text.

The cure, as vLLM's ``VLLM_BATCH_INVARIANT=1`` does on GPUs with kernels of fixed tiling: make every
product the *same* product. Inside :func:`batch_invariant`, each linear layer of the package
(:class:`~.packed_linear.PackedLinear`, the merged groups of :mod:`.merged_projections`, and
:class:`InvariantLinear` for any other) multiplies in chunks of exactly :data:`ROWS` rows, the last
chunk padded with zero rows. Every chunk then runs the one kernel with the one order of sums, and a
row's result depends only on the row (checked: within a 16-row product a row's position does not
change its bits; ``tests/test_batch_invariant.py``). The price: padding (a decode step of 1 sequence
computes 16 rows) and a product per 16 rows instead of one large one. Where the layer's row kernel
sums each output alone in one order whatever the rows (bfloat16 on a CPU without bfloat16
arithmetic, or with AVX512-BF16's pair instructions and no AMX tiles,
:meth:`..kernels.rows.Streamed.invariant`, about as fast as oneDNN's product there), it takes the
whole product instead, unpadded.

The contract: inside the context, ``layer(x)[i]`` is bit for bit ``layer(x[i:i+1])[0]`` for every row
``i`` and any batch ``x`` of the same dtype, on the same machine and thread count; outside it,
nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

#: Rows per product in batch-invariant mode: the row count the packed bfloat16 weights are laid out
#: for (:func:`~.packed_linear.pack_weight`), and a typical continuous batch.
ROWS = 16

_rows: contextvars.ContextVar[int | None] = contextvars.ContextVar("invariant_rows", default=None)


@contextlib.contextmanager
def batch_invariant(rows: int = ROWS) -> Iterator[None]:
    """Within this context every linear layer of the package multiplies in fixed chunks of ``rows``."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive int, got {rows!r}")
    token = _rows.set(rows)
    try:
        yield
    finally:
        _rows.reset(token)


def active_rows() -> int | None:
    """The chunk size of the batch-invariant mode in force, or ``None`` outside it."""
    return _rows.get()


def product(
    multiply: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    whole: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """``multiply(x)`` (a product over ``x``'s last dimension, any leading dims), in chunks of the
    mode's fixed row count when the mode is on; ``multiply(x)`` itself when it is off. ``whole``: a
    product that gives each row the bits it gets alone, whatever the rows beside it (a row kernel's
    ``invariant``: each output summed alone, in one order), tried first in the mode, unchunked;
    its ``None`` (it does not apply to ``x``, whatever its rows) leaves the chunks."""
    rows = _rows.get()
    if rows is None:
        return multiply(x)
    if whole is not None and (out := whole(x)) is not None:
        return out
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    padded = -(-n // rows) * rows
    if padded != n or n == 0:
        flat = torch.cat([flat, flat.new_zeros(max(padded, rows) - n, flat.shape[1])])
    out = torch.cat([multiply(chunk) for chunk in flat.split(rows)])[:n]
    return out.reshape(*x.shape[:-1], out.shape[-1])


class InvariantLinear(torch.nn.Linear):
    """An ``nn.Linear`` (the same parameters) whose product honours :func:`batch_invariant`; for the
    layers neither packed nor merged (a float32 model's, or where oneDNN cannot pack)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: ties are kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(lambda t: F.linear(t, self.weight, self.bias), x)


def make_linear_layers_invariant(model: torch.nn.Module) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` by an :class:`InvariantLinear`, in place (the
    packed and merged layers honour the mode already); returns how many were replaced."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, InvariantLinear(child))
    return len(targets)


def requested(batch_invariant: bool | None) -> bool:
    """Whether an engine runs batch-invariant: ``batch_invariant`` if given, else vLLM's switch, the
    environment variable ``VLLM_BATCH_INVARIANT`` (``1`` on, ``0`` or unset off)."""
    if batch_invariant is None:
        value = os.environ.get("VLLM_BATCH_INVARIANT", "0").strip()
        if value not in ("0", "1", ""):
            raise ValueError(f"VLLM_BATCH_INVARIANT must be 0 or 1, got {value!r}")
        return value == "1"
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be True, False or None, got {batch_invariant!r}")
    return batch_invariant
