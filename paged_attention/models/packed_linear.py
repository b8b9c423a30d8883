"""Linear layers with their weights packed once for the CPU's matrix engine (oneDNN), bfloat16 and float32.

A ``torch.nn.Linear`` in bfloat16 on a CPU goes through oneDNN, which first reorders the weight into
the blocked layout its bfloat16 kernels (AVX512-BF16, AMX) read, on *every call*: a read and a write
of the whole weight before the product even starts. A decode step reads every weight of the model
once, so that reorder nearly doubles its memory traffic. :class:`PackedLinear` reorders once, when
the engine takes the model, and multiplies with the packed copy (torch's
``mkldnn._reorder_linear_weight`` and ``mkldnn._linear_pointwise``, the pair torch's own compiler
uses on CPUs; vLLM's CPU backend keeps prepacked oneDNN weights the same way, in both dtypes). For
contiguous bfloat16 inputs the result is bit-identical to ``F.linear`` (same kernel, same order of
sums; checked when packing; a layer given a ``rows`` product for a few rows, as the engine's are
for bfloat16, is within one rounding there), and on a 2-core Xeon with AMX the 211 linear layers
of SmolLM2-135M take ~30 ms instead of ~43 ms at 16 rows.

float32 ``F.linear`` goes to MKL instead; oneDNN's packed float32 product sums in another order (a
few ulps apart, checked when packing) and is faster from a few rows on: on this project's 2-core
AMD EPYC, 105-111 instead of 82-100 GFLOP/s for SmolLM2's layers at 64-2,048 rows, and 102 instead
of 59 for its output layer at 64 rows; the 64-request peer workload went from 117 to 136 tokens/s.
Greedy tokens stay transformers' (the tests compare them) and vLLM's, which packs float32 for
oneDNN too (the cross-check compares them). One row is the exception where the machine says so: a
layer whose ``gemv`` is set (by the engine's tuning, where it measured faster) multiplies a single
float32 row with ``F.linear`` on the original weight, MKL's matrix-vector product, which read
SmolLM2's weights at 12.3-13.1 GB/s against oneDNN's 9.7-10.5 on an Ice Lake Xeon (one thread);
from two rows on oneDNN is the faster there. Those are transformers' own bits for that row.

Invariants: the module keeps the original ``weight`` parameter (tied weights stay tied, the state
dict is unchanged) beside the packed copy, so packing costs one more copy of the weights in memory;
a weight changed afterwards is noticed (another tensor, other storage, or its version counter
moved) and repacked, except an inference tensor changed in place (it has no version counter); with
autograd on, or on anything but a CPU tensor of :data:`PACKED_DTYPES`, the layer is an ordinary
``F.linear``. The packed copy is an opaque oneDNN tensor, which ``copy.deepcopy`` and ``torch.save``
refuse: the engine packs the model it is given in place, so call :func:`unpack_linear_layers` before
saving or copying it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from . import invariant, opaque

#: The dtypes whose CPU linear layers are packed.
PACKED_DTYPES = (torch.bfloat16, torch.float32)


class RowKernel(Protocol):
    """Products of a few rows another way than the packed product (the engine passes
    a :class:`..kernels.rows.Streamed` for bfloat16, a :class:`..kernels.tiled.Tiled` for float32).
    One may also offer ``invariant(x, prepared, bias)``: the product of any rows, each row's bits
    those it gets alone (or ``None``), which the batch-invariant mode takes (:mod:`.invariant`)."""

    def prepare(
        self, weight: torch.Tensor, bias: torch.Tensor | None, product: Callable[[torch.Tensor], torch.Tensor]
    ) -> Any:
        """What the kernel keeps for ``weight`` (``None``: it does not apply to it); ``product(x)``
        is the packed product it stands in for, to check against."""

    def __call__(self, x: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``F.linear(x, weight, bias)``, or ``None`` where it does not apply (too many rows, ...)."""


def prepare_rows(
    rows: RowKernel | None, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None
) -> Any:
    """What ``rows`` keeps for ``weight``, packed as ``packed`` (or not packed: ``None``); ``None``
    where there is no kernel or it does not apply to this weight."""
    if rows is None:
        return None
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    if packed is None:
        return rows.prepare(weight, bias, lambda x: F.linear(x, weight, bias))
    return rows.prepare(weight, bias, lambda x: packed_product(x, packed, bias))


@functools.cache
def packing_available() -> bool:
    """Whether this torch, on this CPU, packs bfloat16 weights for oneDNN: x86 builds with oneDNN
    do where the CPU has AVX512 (or AVX-NE-CONVERT); checked once by packing a small weight."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or not hasattr(ops, "_linear_pointwise"):
        return False
    try:
        pack_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    except (RuntimeError, AttributeError):
        return False
    return True


def pack_weight(weight: torch.Tensor, rows: int = 16) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered into oneDNN's layout for products of about ``rows`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from the packed weight; ``x`` may have any leading dims."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for a single float32 row (torch's own product: MKL's
    matrix-vector product in x86 builds), or ``None``: more rows, another dtype, autograd on, or the
    batch-invariant mode on (its chunks are oneDNN's)."""
    if x.numel() != x.shape[-1] or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return None
    if torch.is_grad_enabled() or invariant.active_rows() is not None:
        return None
    return F.linear(x, weight, bias)


#: The profiler range around each product of a packed layer or merged group, while a profile is
#: taken (a row kernel's loop is no PyTorch operation: without it a profile would not see it).
PRODUCT_RANGE = "paged_attention::product"


def profiled() -> contextlib.AbstractContextManager:
    """:data:`PRODUCT_RANGE` as a profiler range while torch's profiler runs, else nothing (a range
    costs ~15 us even then: 121 of them would add 2 ms to each decode step of SmolLM2)."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
        return torch.profiler.record_function(PRODUCT_RANGE)
    return contextlib.nullcontext()


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` (same parameters, the same results up to the products' order of sums) that
    multiplies with a packed weight copy, trying ``rows`` first where one is given and applies."""

    def __init__(self, linear: torch.nn.Linear, rows: RowKernel | None = None) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: ties and the state dict are unchanged
        self.bias = linear.bias
        self.rows = rows  # tried first on every product it applies to (None: always the packed product)
        self.gemv = False  # one float32 row through F.linear (:func:`one_row`), before the row kernel
        self._repack()
        self.handle = opaque.register(self)  # what a compiled graph calls (see .opaque)

    def _state(self) -> tuple[int, int, int | None]:
        return weight_state(self.weight)

    def _repack(self) -> None:
        self.packed = pack_weight(self.weight)
        self.prepared = prepare_rows(self.rows, self.weight, self.packed, self.bias)  # what rows keeps
        self.packed_state = self._state()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.handle = opaque.register(self)  # a copy is another layer: a handle of its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and not torch.is_grad_enabled():  # traced: one opaque call,
            return opaque.multiply(x, self.handle, self.out_features)  # this layer's product at run time
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` (in batch-invariant mode: the row kernel's invariant product,
        or fixed row chunks): the row kernel's where it applies (its ``rows`` never while that mode is
        on), else the packed product."""
        with profiled():
            return invariant.product(self._multiply, x, self._whole)

    def _whole(self, x: torch.Tensor) -> torch.Tensor | None:
        """The row kernel's batch-invariant product of ``x`` (``None``: no kernel kept, or it has none)."""
        whole = getattr(self.rows, "invariant", None)
        if whole is None or self.prepared is None or torch.is_grad_enabled():
            return None
        if self._state() != self.packed_state:
            self._repack()  # (a weight changed in place: prepared again, so no call misses the kernel)
            if self.prepared is None:
                return None
        return whole(x, self.prepared, self.bias)

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and (out := one_row(x, self.weight, self.bias)) is not None:
            return out
        kept = self.prepared is not None and self._state() == self.packed_state  # (state: only if kept)
        if kept and (out := self._rows(x)) is not None:
            return out
        weight = self.weight
        if torch.is_grad_enabled() or x.dtype not in PACKED_DTYPES or weight.dtype != x.dtype:
            return F.linear(x, weight, self.bias)
        if x.device.type != "cpu" or weight.device.type != "cpu":
            return F.linear(x, weight, self.bias)
        if self._state() != self.packed_state:
            self._repack()  # (then the row kernel, as for any other call)
            if (out := self._rows(x)) is not None:
                return out
        return packed_product(x, self.packed, self.bias)

    def _rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """The row kernel's product of ``x``, or ``None``: no kernel kept, autograd on, the
        batch-invariant mode on (its chunks are oneDNN's), or the kernel declines ``x``."""
        if self.prepared is None or torch.is_grad_enabled() or invariant.active_rows() is not None:
            return None
        return self.rows(x, self.prepared, self.bias)

    def unpacked(self) -> torch.nn.Linear:
        """An ordinary ``nn.Linear`` holding the same parameters."""
        linear = torch.nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device="meta"
        )
        linear.weight, linear.bias = self.weight, self.bias
        return linear


def pack_linear_layers(model: torch.nn.Module, rows: RowKernel | None = None) -> int:
    """Replace every CPU ``nn.Linear`` of :data:`PACKED_DTYPES` in ``model`` by a :class:`PackedLinear`
    (trying ``rows`` first on each product), in place, after checking on the first one that the
    packed product agrees with ``F.linear``. Returns how many were packed (0 where packing is
    unavailable or does not agree)."""
    if not packing_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
        and child.weight.dtype in PACKED_DTYPES
        and child.weight.device.type == "cpu"
    ]
    if not targets or not _agrees(targets[0][2]):
        return 0
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, rows))
    return len(targets)


def unpack_linear_layers(model: torch.nn.Module) -> int:
    """Undo :func:`pack_linear_layers`: every :class:`PackedLinear` back to an ``nn.Linear`` with
    the same parameters (so the model can be copied or saved). Returns how many were unpacked."""
    return replace_layers(model, PackedLinear, lambda layer: layer.unpacked())


def weight_state(weight: torch.Tensor) -> tuple[int, int, int | None]:
    """What identifies a weight's values: the tensor, its storage, its version counter (which every
    in-place change bumps; an inference tensor has none)."""
    return id(weight), weight.data_ptr(), None if weight.is_inference() else weight._version


def replace_layers(model: torch.nn.Module, kind: type, convert: Callable[[Any], torch.nn.Module]) -> int:
    """Replace every submodule of type ``kind`` (subclasses too) by ``convert(it)``, in place;
    returns how many were replaced."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, kind)
    ]
    for parent, name, child in targets:
        setattr(parent, name, convert(child))
    return len(targets)


def _agrees(linear: torch.nn.Linear) -> bool:
    """The packed product of a probe input equals ``F.linear``'s (bfloat16: exactly; float32: within
    a few ulps, the same kernel family summing in another order) (else: do not pack)."""
    probe = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0))
    probe = probe.to(linear.weight.dtype)
    try:
        with torch.inference_mode():
            packed = packed_product(probe, pack_weight(linear.weight), linear.bias)
            expected = F.linear(probe, linear.weight, linear.bias)
    except RuntimeError:  # an op this build lacks for these shapes
        return False
    if linear.weight.dtype == torch.bfloat16:
        return bool(torch.equal(packed, expected))
    return bool(torch.allclose(packed, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())))
