"""paged-attention: an educational reference implementation of PagedAttention (vLLM's KV-cache manager).

``from paged_attention import LLM, SamplingParams`` is the vLLM-compatible offline API.
"""

from . import _triton_env  # noqa: F401  (must run before anything imports triton; see kernels/__init__.py)

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Lazy: `import paged_attention` stays light (no transformers) for the allocator and kernels.
    if name in ("LLM", "LLMEngine", "RequestOutput", "CompletionOutput"):
        from . import engine

        return getattr(engine, name)
    if name in ("SamplingParams", "BeamSearchParams"):
        from . import sampling

        return getattr(sampling, name)
    raise AttributeError(f"module 'paged_attention' has no attribute {name!r}")


__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]
