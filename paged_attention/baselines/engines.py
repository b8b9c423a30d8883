"""Engines for the experiments: paged or contiguous memory, continuous or static batching.

The engine itself chooses nothing about either: it takes a cache-manager factory and a scheduling
policy. This module is where the experiments' names become those two objects, so that a benchmark
can say ``baseline_engine(kv_manager="max", static_batching=True)``:

* ``kv_manager="paged"`` (the engine's default), or ``"max"`` / ``"pow2"`` / ``"oracle"``: a
  contiguous cache of the same bytes, one range reserved per request (:mod:`.reservation`), placed
  by ``placement="buddy"`` or ``"first-fit"`` (:mod:`.placement`);
* ``static_batching=True``: fixed batches run to the end (:mod:`.static_batching`).
"""

from __future__ import annotations

from typing import Any

from ..engine.llm_engine import CacheManagerFactory, LLMEngine
from .contiguous import ContiguousKVCacheManager
from .placement import PLACEMENTS
from .reservation import POLICIES
from .static_batching import StaticBatching

KV_MANAGERS = ("paged", *POLICIES)


def contiguous_cache(policy: str, placement: str = "buddy") -> CacheManagerFactory:
    """A factory for ``LLMEngine(cache_manager_factory=...)`` (or ``LLM``): a contiguous arena holding the
    same bytes as the paged cache would (``num_blocks * block_size`` token slots)."""
    if policy not in POLICIES:
        raise ValueError(f"kv_manager must be 'paged' or one of {POLICIES}, got {policy!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")

    def build(num_blocks: int, block_size: int, max_model_len: int) -> ContiguousKVCacheManager:
        return ContiguousKVCacheManager(num_blocks * block_size, max_model_len, policy, placement)

    return build


def baseline_engine(
    model: Any = None,
    tokenizer: Any = None,
    *,
    kv_manager: str = "paged",
    placement: str = "buddy",
    static_batching: bool = False,
    **engine_kwargs: Any,
) -> LLMEngine:
    """An :class:`LLMEngine` with the memory manager and batching policy the experiments name
    (see the module docstring); other keyword arguments go to the engine."""
    if kv_manager not in KV_MANAGERS:
        raise ValueError(f"kv_manager must be 'paged' or one of {POLICIES}, got {kv_manager!r}")
    if not isinstance(static_batching, bool):
        raise TypeError(f"static_batching must be a bool, got {static_batching!r}")
    if kv_manager != "paged":
        engine_kwargs["cache_manager_factory"] = contiguous_cache(kv_manager, placement)
    elif placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if static_batching:
        engine_kwargs["scheduling_policy"] = StaticBatching()
    return LLMEngine(model, tokenizer, **engine_kwargs)
