"""paged-attention: an educational reference implementation of PagedAttention (vLLM's KV-cache manager)."""

from . import _triton_env  # noqa: F401  (must run before anything imports triton; see kernels/__init__.py)

__version__ = "0.1.0"
