"""Contiguous KV-cache baselines: what paging is measured against (see ``contiguous.py``)."""

from .contiguous import ContiguousKVCacheManager
from .placement import PLACEMENTS, BuddyAllocator, FirstFitAllocator, make_placement, next_power_of_two
from .reservation import POLICIES, reservation_slots

__all__ = [
    "PLACEMENTS",
    "POLICIES",
    "BuddyAllocator",
    "ContiguousKVCacheManager",
    "FirstFitAllocator",
    "make_placement",
    "next_power_of_two",
    "reservation_slots",
]
