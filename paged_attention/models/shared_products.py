"""A pass over a compiled model's graph: one call of the engine's product per input and layer.

Each member of a merged group (:mod:`.merged_projections`) records the group's whole product while
dynamo traces (:mod:`.opaque`), so a traced layer holds three identical Q/K/V calls and two gate/up
calls. Inductor's ``freezing`` removed such duplicates with everything else it folds, but a frozen
graph never enters AOTAutograd's cache on disk (:mod:`.compilation` no longer freezes); without
freezing nothing removes them, and each duplicate multiplies again at run time (SmolLM2's compiled
steps were 1.5x slower so on an Ice Lake Xeon). :class:`SharedProducts` runs first among inductor's
post-grad passes (``post_grad_custom_pre_pass``) and keeps the first of each set of identical calls.
Imported only when compiling: importing inductor costs about two seconds.

Invariant: only ``paged_attention_linear.multiply`` calls are touched; the operation is pure (it reads
its input and the layer's weights, writes nothing), so dropping a repeat changes no result.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import opaque


class SharedProducts(CustomGraphPass):
    """Keep one product call per (input, layer) in a graph, in place. Its ``uuid`` is this file's
    hash, so that inductor's caches key on it: a change here compiles again."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        target = getattr(torch.ops, opaque.LIBRARY).multiply.default
        first: dict[tuple[object, ...], torch.fx.Node] = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not target:
                continue
            key = (node.args, tuple(sorted(node.kwargs.items())))
            if key in first:
                node.replace_all_uses_with(first[key])
                graph.erase_node(node)
            else:
                first[key] = node

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
