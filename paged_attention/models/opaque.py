"""The packed and merged linear layers as one opaque operation in a compiled graph.

A compiled model (:mod:`.compilation`) is one graph for every token count, so inside it a product
cannot choose its kernel by the number of rows: inductor calls oneDNN whatever the step. vLLM keeps
its CPU products out of inductor's hands the same way it keeps attention: as custom operations
(``torch.ops._C.onednn_mm`` over weights it packed itself). Here, while dynamo traces, a
:class:`~.packed_linear.PackedLinear` or a merged group (:mod:`.merged_projections`) records one call
of ``torch.ops.paged_attention_linear.multiply(x, handle, out_features)``; at run time that call is the
layer's own product, which picks the row kernels for a step of one or two rows (the weights read at
the memory's pace) and the packed product for the rest. A merged group's members record the same call
on the same input, and :class:`.shared_products.SharedProducts` (a pass over inductor's graph) keeps
one, so Q/K/V and gate/up stay one product each.

Invariants: a handle names one layer for the layer's lifetime (held weakly: a layer that is gone is an
error, never another layer's product); the operation neither reads nor writes anything but its input
and the layer's weights.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch

#: The library (namespace) of the operation.
LIBRARY = "paged_attention_linear"


class Product(Protocol):
    """A layer that multiplies: ``product(x)`` is ``F.linear(x, weight, bias)``, its own way."""

    def product(self, x: torch.Tensor) -> torch.Tensor: ...


_layers: dict[int, weakref.ref[Product]] = {}
_handles = itertools.count()


def register(layer: Product) -> int:
    """A handle for ``layer`` (held weakly), for :func:`multiply`."""
    handle = next(_handles)
    _layers[handle] = weakref.ref(layer, lambda _, h=handle: _layers.pop(h, None))
    return handle


def multiply(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """The registered layer's ``product(x)`` (``[..., out_features]``), as one operation a compiled
    graph calls and does not look into."""
    return torch.ops.paged_attention_linear.multiply(x, handle, out_features)


def _multiply(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    ref = _layers.get(handle)
    layer = ref() if ref is not None else None
    if layer is None:
        raise RuntimeError(f"linear layer {handle} is gone: the compiled model outlived its layers")
    return layer.product(x)


def _shape(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


# Registered through a library rather than ``torch.library.custom_op``, whose Python wrapper costs
# ~50 us a call (as the attention operation in the engine's model runner).
_library = torch.library.Library(LIBRARY, "FRAGMENT")
_library.define("multiply" + torch.library.infer_schema(_multiply, mutates_args=()))
_library.impl("multiply", _multiply, "CompositeExplicitAutograd")
torch.library.register_fake(f"{LIBRARY}::multiply", _shape, lib=_library)
