"""paged-attention: an educational reference implementation of PagedAttention (vLLM's KV-cache manager).

``from paged_attention import LLM, SamplingParams`` is the vLLM-compatible offline API. The folders
are the layers: ``memory`` (bookkeeping: blocks, page tables, the cache manager), ``kernels``
(Triton and PyTorch attention; tensors only), ``models`` (where the weights come from), ``engine``
(scheduler, model runner, ``LLMEngine``, ``LLM``), and around them ``baselines``, ``experiments``,
``viz``, ``lab`` and ``cli``.
"""

from . import _triton_env  # noqa: F401  (must run before anything imports triton; see kernels/__init__.py)

__version__ = "0.1.0"

# Lazy: `import paged_attention` stays light (no transformers) for the allocator and kernels.
_PUBLIC = {
    "LLM": "llm",
    "cleanup_dist_env_and_memory": "llm",
    "LLMEngine": "llm_engine",
    "EngineArgs": "engine_args",
    "TextPrompt": "inputs",
    "TokensPrompt": "inputs",
    "Logprob": "sample.logprobs",
    "Metric": "metrics",
    "Counter": "metrics",
    "Gauge": "metrics",
    "Histogram": "metrics",
    "Vector": "metrics",
    "RequestOutput": "outputs",
    "CompletionOutput": "outputs",
    "SamplingParams": "sample.sampling",
    "BeamSearchParams": "sample.sampling",
    "RequestOutputKind": "sample.sampling",
    "StructuredOutputsParams": "structured_output.params",
    "explain_dtype": "worker.tuning",  # models.explain_dtype, with the engine's bfloat16 loops registered
}


def __getattr__(name: str) -> object:
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(f".engine.{_PUBLIC[name]}", __name__), name)
    raise AttributeError(f"module 'paged_attention' has no attribute {name!r}")


__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "Counter",
    "EngineArgs",
    "Gauge",
    "Histogram",
    "LLMEngine",
    "Logprob",
    "Metric",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "Vector",
    "cleanup_dist_env_and_memory",
    "explain_dtype",
]
