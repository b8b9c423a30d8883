"""How big the KV cache is, and does one request of ``max_model_len`` tokens fit it? Settled when
the engine is built.

:func:`manager_builder`: how the cache manager is made for a given ``max_model_len``.
:func:`size_kv_cache`: the blocks a cache gets (``num_kv_blocks``, or what a byte budget buys),
refused before anything is allocated if the device cannot hold them.

A request may grow to ``max_model_len`` tokens, and ``max_tokens=None`` asks for exactly that, so a
cache that cannot hold one such request would reject requests one by one at run time. The engine
settles it once, when it is built (vLLM's rule):

* ``max_model_len`` given: if one request of that length cannot fit (in the cache manager's own
  terms: the paged manager's blocks beside its watermark, a contiguous manager's reservation), the
  engine is refused, with what the cache holds and what to change.
* ``max_model_len`` not given: the model's length, lowered to the longest request the cache can
  hold (vLLM's ``max_model_len="auto"``); ``LLMEngine.max_model_len`` says what it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..._checks import check_int, check_positive_int
from ...memory.manager import KVCacheManager
from ...memory.paged_manager import PagedKVCacheManager
from ..params import SamplingParams
from ..sequence import Sequence
from ..worker.kv_cache import KVCacheSpec, check_kv_fits, default_kv_cache_memory


def longest_request(length: int) -> Sequence:
    """A stand-in request of ``length`` tokens in all (its last token's K/V is never stored)."""
    return Sequence(-1, "max_model_len", [0] * max(1, length - 1), SamplingParams(max_tokens=1), 0.0)


def check_memory_args(gpu_memory_utilization: object, factory: object) -> None:
    """Check ``gpu_memory_utilization`` (in (0, 1]) and ``cache_manager_factory`` (a callable or None)."""
    if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    if factory is not None and not callable(factory):
        raise TypeError(f"cache_manager_factory must be a callable, got {type(factory).__name__}")


def manager_builder(
    num_blocks: int,
    block_size: int,
    factory: Callable[[int, int, int], KVCacheManager] | None,
    watermark: float,
    num_cpu_blocks: int | None,
    preemption_mode: str,
    enable_prefix_caching: bool,
) -> Callable[[int], KVCacheManager]:
    """``build(max_model_len)`` for :func:`fit_max_model_len`: the engine's ``cache_manager_factory``
    given the sized budget, or by default one paged manager (whatever the length; its own settings
    are ``watermark``, the CPU blocks of swap preemption, which default to as many as the GPU's, and
    prefix caching)."""
    if factory is not None:
        return lambda length: factory(num_blocks, block_size, length)
    cpu_blocks = num_blocks if num_cpu_blocks is None and preemption_mode == "swap" else num_cpu_blocks
    paged = PagedKVCacheManager(num_blocks, block_size, watermark, cpu_blocks or 0, enable_prefix_caching)
    return lambda _length: paged


def fit_max_model_len(
    build: Callable[[int], KVCacheManager], model_len: int, explicit: bool
) -> tuple[KVCacheManager, int]:
    """The cache manager and the ``max_model_len`` to serve (see the module docstring).

    ``build(max_model_len)`` makes the manager (a contiguous one sizes its reservations by it);
    ``model_len`` is the length asked for, or the model's own when ``explicit`` is false.
    """
    manager = build(model_len)
    if manager.fits_at_all(longest_request(model_len)):
        return manager, model_len
    low, high = 1, model_len - 1  # the longest length that fits, by bisection (monotone in length)
    while low < high:
        middle = (low + high + 1) // 2
        if build(middle).fits_at_all(longest_request(middle)):
            low = middle
        else:
            high = middle - 1
    fitting = low if build(low).fits_at_all(longest_request(low)) else 0
    if explicit or fitting < 2:
        slots = manager.num_blocks * manager.block_size
        holds = f"the cache holds {slots} token slots ({manager.num_blocks} blocks of {manager.block_size})"
        change = f"pass max_model_len <= {fitting}, or " if fitting >= 2 else ""
        raise ValueError(
            f"max_model_len={model_len} does not fit the KV cache: {holds}, and one request of "
            f"{model_len} tokens cannot fit ({manager.unfit_reason(longest_request(model_len))}); "
            f"{change}give the cache more memory (num_kv_blocks or kv_cache_memory)"
        )
    return build(fitting), fitting


def size_kv_cache(
    spec: KVCacheSpec, device: torch.device, block_size: int, num_kv_blocks: int | None,
    kv_cache_memory: int | None, gpu_memory_utilization: float,
) -> int:  # fmt: skip
    """How many blocks the KV cache gets: ``num_kv_blocks`` if given, else what ``kv_cache_memory``
    bytes (default: :func:`~.kv_cache.default_kv_cache_memory`) buy; refused if the device cannot
    hold them."""
    if num_kv_blocks is not None:
        num_blocks = check_positive_int("num_kv_blocks", num_kv_blocks)
    else:
        default = default_kv_cache_memory(device, gpu_memory_utilization)
        memory = kv_cache_memory if kv_cache_memory is not None else default
        check_int("kv_cache_memory", memory, minimum=1)
        num_blocks = spec.num_blocks_for_budget(memory, block_size)
    block_bytes = spec.bytes_per_block(block_size)
    what = f"a KV cache of {num_blocks} blocks of {block_size} tokens ({block_bytes} bytes each)"
    check_kv_fits(num_blocks * block_bytes, device, what)
    return num_blocks
