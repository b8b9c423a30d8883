"""Q/K/V, and gate/up, as one matrix product each: fewer, larger products for the same weights.

A transformer layer multiplies the same input by several weights in a row: ``q_proj``, ``k_proj``
and ``v_proj`` read the attention's input, ``gate_proj`` and ``up_proj`` the MLP's. At decode, a
product has a few dozen rows, so each of the 7 calls per layer pays its own fixed costs (dispatch,
packing the input, a pass over a small output) and runs at the low efficiency of a narrow matrix.
vLLM loads such weights into one matrix (``QKVParallelLinear``, ``MergedColumnParallelLinear``) and
splits the product's columns. Here the model stays transformers' own: :func:`merge_projections`
concatenates each group's weights into one tensor, makes each layer's ``weight`` (and ``bias``) a
view of its rows (no extra memory; the state dict is unchanged), and replaces the layers by
:class:`MergedMember` modules. The first member called with an input computes the whole product
and keeps the other members' column slices for that same input; each later member called with the
*same tensor object* takes its slice, so the model's code runs unchanged with one product per
group.

Invariants: a member called with any other input (another tensor, or the same one after the group
was already consumed) computes the whole product again, so results never depend on call order; the
slices handed out are exactly the columns of the merged product. Merging is done only where that
product equals the separate products (computed the same way) bit for bit on probe inputs (checked per group
shape and dtype when merging), so merging changes no number. bfloat16 and float32 products on a
CPU use the merged weight packed for oneDNN (:mod:`.packed_linear`; in float32 a few ulps from
MKL's unpacked ``F.linear``, as vLLM's products are), repacked when
the weights change. With autograd on, every member is an ordinary ``F.linear`` on its view.
:func:`unmerge_projections` gives each layer back an independent ``nn.Linear``: call it before
``save_pretrained`` (safetensors refuses parameters that share one storage).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import invariant, opaque
from .packed_linear import (
    PACKED_DTYPES,
    PackedLinear,
    RowKernel,
    one_row,
    pack_weight,
    packed_product,
    packing_available,
    prepare_rows,
    profiled,
    replace_layers,
    weight_state,
)

#: The groups merged, by attribute names of one parent module (transformers' Llama-family names).
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class MergedProduct:
    """One group's merged weight and the latest product's column slices, waiting to be taken."""

    def __init__(self, layers: list[torch.nn.Linear], rows: RowKernel | None = None) -> None:
        self.layers = layers
        self.rows = rows  # tried first on every product it applies to (None: always the packed product)
        self.gemv = False  # one float32 row through F.linear (packed_linear.one_row), before the row kernel
        self.sizes = [layer.out_features for layer in layers]
        self.pack = False
        self.weight = self.bias = self.packed = None  # type: torch.Tensor | None
        self.prepared: object | None = None  # what rows keeps for the merged weight
        self.state: tuple[object, ...] = ()
        self._input: torch.Tensor | None = None
        self._slices: list[torch.Tensor | None] = []
        self.rebuild()
        self.handle = opaque.register(self)  # what a compiled graph calls (see .opaque)

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.handle = opaque.register(self)  # a copy is another group: a handle of its own

    def _state(self) -> tuple[object, ...]:
        """What identifies the members' values: each parameter, its storage and its version."""
        params = [p for layer in self.layers for p in (layer.weight, layer.bias) if p is not None]
        return tuple(weight_state(p) for p in params)

    def rebuild(self) -> None:
        """Concatenate the members' current parameters and make each one a view of its rows."""
        with torch.no_grad():
            self.weight, self.bias = _concatenated(self.layers)
            start = 0
            for layer, size in zip(self.layers, self.sizes, strict=True):
                rows = slice(start, start + size)
                layer.weight.data = self.weight[rows]  # the same Parameter, now a view: no extra memory
                if layer.bias is not None:
                    layer.bias.data = self.bias[rows]
                start += size
        weight = self.weight
        self.pack = weight.dtype in PACKED_DTYPES and weight.device.type == "cpu" and packing_available()
        self.packed = pack_weight(weight) if self.pack else None  # after .to(...), per the new device
        self.prepared = prepare_rows(self.rows, weight, self.packed, self.bias)
        self.state = self._state()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` for the whole group, from the packed weight where one is kept."""
        if self._state() != self.state:
            self.rebuild()  # a parameter was replaced or changed in place
        with profiled():
            return invariant.product(self._multiply, x, self._whole)  # the mode: fixed chunks, or whole

    def _whole(self, x: torch.Tensor) -> torch.Tensor | None:
        """The row kernel's batch-invariant product of ``x`` (``None``: no kernel kept, or it has none)."""
        whole = getattr(self.rows, "invariant", None)
        return None if whole is None or self.prepared is None else whole(x, self.prepared, self.bias)

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and (out := one_row(x, self.weight, self.bias)) is not None:
            return out
        if self.prepared is not None and invariant.active_rows() is None:  # (autograd never gets here)
            out = self.rows(x, self.prepared, self.bias)
            if out is not None:
                return out
        if self.packed is not None and x.dtype == self.weight.dtype:
            return packed_product(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output for ``x``: its slice of the product, computed at most once
        per input object for the whole group."""
        if x is not self._input or self._slices[index] is None:
            self._slices = list(self.product(x).split(self.sizes, dim=-1))
            self._input = x
        out, self._slices[index] = self._slices[index], None
        if all(s is None for s in self._slices):
            self._input = None  # every member took its slice: hold nothing between layers
        assert out is not None
        return out


class MergedMember(torch.nn.Linear):
    """One layer of a merged group: an ``nn.Linear`` keeping its own parameters (the same objects,
    their data now views of the group's rows), whose output is its slice of the group's product."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.index = 0
        self.group: MergedProduct | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group
        if torch.is_grad_enabled() or group is None:
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():  # traced: every member the same opaque call, kept once
            return opaque.multiply(x, group.handle, sum(group.sizes)).split(group.sizes, dim=-1)[self.index]
        return group.take(self.index, x)

    def unmerged(self) -> torch.nn.Linear:
        """An ordinary ``nn.Linear`` holding the same parameters, given storage of their own."""
        linear = torch.nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device="meta"
        )
        with torch.no_grad():
            for p in (self.weight, self.bias):
                if p is not None:
                    p.data = p.data.clone()
        linear.weight, linear.bias = self.weight, self.bias
        return linear


def merge_projections(model: torch.nn.Module, rows: RowKernel | None = None) -> int:
    """Merge every group of :data:`GROUPS` in ``model`` whose layers are plain ``nn.Linear`` on one
    device and dtype, reading the same number of features, and whose merged product agrees with the
    separate ones bit for bit; in place (each group trying ``rows`` first on every product, as
    :class:`.packed_linear.PackedLinear` does). Returns how many groups were merged."""
    merged = 0
    verdicts: dict[tuple[object, ...], bool] = {}
    with torch.no_grad():
        for parent in list(model.modules()):
            for names in GROUPS:
                layers = [getattr(parent, name, None) for name in names]
                if not _mergeable(layers):
                    continue
                linears: list[torch.nn.Linear] = layers  # type: ignore[assignment]
                first = linears[0]
                key = (
                    first.weight.dtype,
                    first.weight.device,
                    first.in_features,
                    tuple(layer.out_features for layer in linears),
                )
                if key not in verdicts:
                    verdicts[key] = _agrees(linears)
                if not verdicts[key]:
                    continue
                members = [MergedMember(linear) for linear in linears]
                group = MergedProduct(members, rows)  # type: ignore[arg-type]
                for index, (name, member) in enumerate(zip(names, members, strict=True)):
                    member.group, member.index = group, index
                    setattr(parent, name, member)
                merged += 1
    return merged


def unmerge_projections(model: torch.nn.Module) -> int:
    """Undo :func:`merge_projections`: each member back to an independent ``nn.Linear`` (copies of
    its parameters). Returns how many layers were unmerged."""
    return replace_layers(model, MergedMember, lambda member: member.unmerged())


def _mergeable(layers: list[object]) -> bool:
    if not all(type(layer) is torch.nn.Linear for layer in layers):
        return False
    linears: list[torch.nn.Linear] = layers  # type: ignore[assignment]
    first = linears[0].weight
    return all(
        layer.in_features == linears[0].in_features
        and layer.weight.dtype == first.dtype
        and layer.weight.device == first.device
        and not layer.weight.is_meta
        and not layer.weight.is_inference()  # its data cannot be re-pointed outside inference mode
        for layer in linears
    )


def _concatenated(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layers' weights stacked by rows, and their biases (zeros for a layer without one)."""
    weight = torch.cat([layer.weight.detach() for layer in linears])
    if all(layer.bias is None for layer in linears):
        return weight, None
    biases = [
        weight.new_zeros(layer.out_features) if layer.bias is None else layer.bias.detach()
        for layer in linears
    ]
    return weight, torch.cat(biases)


def _agrees(linears: list[torch.nn.Linear]) -> bool:
    """One product of the concatenated weights, split, equals the separate products exactly, at
    the row counts of a decode step and of a prompt (with weights packed for oneDNN where the
    separate layers would be packed)."""
    weight, bias = _concatenated(linears)
    pack = weight.dtype in PACKED_DTYPES and weight.device.type == "cpu" and packing_available()

    def product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return packed_product(x, pack_weight(w), b) if pack else F.linear(x, w, b)

    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 7, 64):
            probe = torch.randn(rows, weight.shape[1], generator=generator).to(weight)
            pieces = product(probe, weight, bias).split([layer.out_features for layer in linears], dim=-1)
            for layer, piece in zip(linears, pieces, strict=True):
                if not torch.equal(piece, product(probe, layer.weight, layer.bias)):
                    return False
    return True


def product_owners(model: torch.nn.Module) -> list[PackedLinear | MergedProduct]:
    """What multiplies in ``model``, each once, as the engine calls it: every packed layer and every
    merged group (not its members); each has ``product(x)``, ``weight`` (``[out, in]``), ``rows`` (its
    row kernel), ``prepared`` (what that kernel keeps, ``None``: none) and ``gemv`` (one float32 row
    through ``F.linear``: :func:`.packed_linear.one_row`)."""
    owners: dict[int, PackedLinear | MergedProduct] = {}
    for module in model.modules():
        if isinstance(module, MergedMember) and module.group is not None:
            owners.setdefault(id(module.group), module.group)
        elif isinstance(module, PackedLinear):
            owners.setdefault(id(module), module)
    return list(owners.values())
