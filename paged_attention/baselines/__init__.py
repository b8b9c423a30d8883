"""Contiguous KV-cache baselines: what paging is measured against.

contiguous       ContiguousKVCacheManager: one reserved range per request, same protocol as paged
reservation      how much to reserve: Max, Pow2, Oracle (the paper's section 6.1)
placement        where the range goes: a buddy allocator, or first fit with hole merging
static_batching  the scheduling policy of model.generate: fixed batches run to the end
engines          engines for the experiments: baseline_engine(kv_manager=..., static_batching=...)
                 (imported on its own: it brings the engine and transformers)
"""

from .contiguous import ContiguousKVCacheManager
from .placement import PLACEMENTS, BuddyAllocator, FirstFitAllocator, make_placement, next_power_of_two
from .reservation import POLICIES, reservation_slots
from .static_batching import StaticBatching

__all__ = [
    "PLACEMENTS",
    "POLICIES",
    "BuddyAllocator",
    "ContiguousKVCacheManager",
    "FirstFitAllocator",
    "StaticBatching",
    "make_placement",
    "next_power_of_two",
    "reservation_slots",
]
