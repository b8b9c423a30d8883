"""What compiling fuses, counted: the calls of one forward pass, eager and compiled (notebook 07).

Eager, transformers' module code issues every operation from Python: each is a dispatch and a
pass over memory. Compiled (``compilation_config=3``, :mod:`..models.compilation`), inductor
writes a Python wrapper that calls three kinds of things: its own fused C++ loops (named after the
operations each one fuses), the matrix products (the engine's packed and merged layers, one opaque
operation each, :mod:`..models.opaque`; or inductor's own calls of oneDNN for layers the engine did
not pack) and our attention operation. :func:`forward_calls` counts the first; :func:`compiled_calls`
reads the second from the code inductor generated (:func:`compile_and_read`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

T = TypeVar("T")

#: The kinds of call in a compiled graph, and how each appears in inductor's wrapper code.
KINDS = {
    "fused loops": re.compile(r"^cpp_fused_\w+\("),
    "matrix products": re.compile(
        r"^(\w+ = torch\.ops\.paged_attention_linear\.multiply|\w+ = torch\.ops\.mkldnn\._linear_pointwise"
        r"|\w+ = torch\.ops\.mkl\._mkl_linear"
        r"|extern_kernels\.(mm|addmm|bmm)\()"
    ),
    "attention": re.compile(r"^\w+ = torch\.ops\.paged_attention\.attend"),
}


def compile_and_read(build: Callable[[], T]) -> tuple[T, str]:
    """Run ``build`` (something that compiles a model, e.g. ``lambda: LLM(compilation_config=3)``);
    returns its result and the wrapper code inductor generated for the last graph it compiled."""
    from torch._inductor.utils import run_and_get_code

    result, codes = run_and_get_code(build)
    if not codes:
        raise ValueError("build compiled nothing: pass compilation_config=3 to the engine")
    return result, codes[-1]


def compiled_calls(code: str) -> Counter[str]:
    """The calls one pass of the compiled graph makes, by kind (:data:`KINDS`)."""
    body = code[code.index("def call(") :]
    counts: Counter[str] = Counter()
    for line in body.splitlines():
        line = line.strip()
        for kind, pattern in KINDS.items():
            if pattern.match(line):
                counts[kind] += 1
    return counts


def fused_loops(code: str) -> list[str]:
    """The names of the fused loops inductor wrote (each lists the operations it fuses)."""
    return re.findall(r"^(cpp_fused_\w+) = async_compile", code, flags=re.MULTILINE)


class _Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.inside = 0  # products entered and not yet left: their own calls are not counted

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.inside:
            self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def forward_calls(module: torch.nn.Module, run: Callable[[], Any]) -> Counter[str]:
    """The torch operations Python issues inside ``module``'s forward passes while ``run()`` runs
    (an eager model: each is one dispatch), by name. A linear layer of the engine (packed, or a
    member of a merged group) counts as one ``linear``, as transformers' own ``nn.Linear`` does,
    whichever kernel multiplies inside it (oneDNN's, or a row loop that this CPU measured faster:
    their own calls would make the count depend on the machine)."""
    from ..models.merged_projections import MergedMember
    from ..models.packed_linear import PackedLinear

    mode = _Counting()

    def enter(*args: Any) -> None:  # (a pre-hook that returned something would replace the inputs)
        mode.__enter__()

    def leave(*args: Any) -> None:
        mode.__exit__(None, None, None)

    def product(*args: Any) -> None:
        if not mode.inside:
            mode.calls["linear"] += 1
        mode.inside += 1

    def done(*args: Any) -> None:
        mode.inside -= 1

    hooks = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
    for layer in module.modules():
        if isinstance(layer, (PackedLinear, MergedMember)):
            hooks.append(layer.register_forward_pre_hook(product))
            hooks.append(layer.register_forward_hook(done, always_call=True))
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return mode.calls
