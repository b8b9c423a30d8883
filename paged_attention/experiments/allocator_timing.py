"""How fast is the block allocator, and does its cost stay flat as the cache grows? (``bench allocator``)

A scheduler calls the allocator for every block of every sequence, so it must be cheap and, above
all, O(1): the time of one allocate/free pair must not depend on whether the cache holds a thousand
blocks or a million. Two workloads run at each size:

* ``ordered``: allocate one block, free it, with half the blocks in use and the free queue in
  allocation order. Only the algorithm is measured here: the cost must be flat.
* ``scrambled``: the same pairs after the free queue was shuffled (half the blocks freed in random
  order), as after hours of serving. Consecutive queue entries now lie far apart in memory, so with
  a million blocks (about 100 MB of block objects, more than a laptop's L3 cache) each operation
  waits on cache misses: same operation count, slower memory. vLLM's Python allocator has the same
  property; an array-of-ints layout halves the memory but is slower at every size we measured.
* ``mixed``: a fork-heavy trace on the scrambled queue: allocate a block, share it (a forked
  sequence), allocate another, then free all three references in a random order.

Numbers are allocate-or-share + free *pairs* per second, best of ``repeats`` runs.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from ..memory.allocator import BlockAllocator


@dataclass(frozen=True)
class AllocatorResult:
    num_blocks: int
    workload: str
    pairs_per_second: float

    @property
    def ns_per_pair(self) -> float:
        return 1e9 / self.pairs_per_second


def _half_used_allocator(num_blocks: int, rng: random.Random | None) -> BlockAllocator:
    """An allocator with half its blocks in use; the free queue shuffled when ``rng`` is given."""
    alloc = BlockAllocator(num_blocks)
    every = alloc.allocate_many(num_blocks)
    if rng is not None:
        rng.shuffle(every)
    for block_id in every[: num_blocks - num_blocks // 2]:
        alloc.free(block_id)
    return alloc


def _time_pairs(alloc: BlockAllocator, num_pairs: int) -> float:
    allocate, free = alloc.allocate, alloc.free
    start = time.perf_counter()
    for _ in range(num_pairs):
        free(allocate())
    return num_pairs / (time.perf_counter() - start)


def _time_mixed(alloc: BlockAllocator, num_rounds: int, rng: random.Random) -> float:
    # Per round: allocate a, share a, allocate b -> 3 references, then 3 frees in one of the 3
    # orders below. Pairs per round: 3 (two allocates and one share, each matched by a free).
    orders = [rng.randrange(3) for _ in range(num_rounds)]
    allocate, share, free = alloc.allocate, alloc.share, alloc.free
    start = time.perf_counter()
    for order in orders:
        a = allocate()
        share(a)
        b = allocate()
        if order == 0:
            free(a), free(b), free(a)
        elif order == 1:
            free(b), free(a), free(a)
        else:
            free(a), free(a), free(b)
    return 3 * num_rounds / (time.perf_counter() - start)


def run(
    sizes: tuple[int, ...] = (1_000, 1_000_000), num_pairs: int = 300_000, repeats: int = 3, seed: int = 0
) -> list[AllocatorResult]:
    results = []
    for num_blocks in sizes:
        rng = random.Random(seed)
        ordered = _half_used_allocator(num_blocks, None)
        results.append(
            AllocatorResult(num_blocks, "ordered", _best(repeats, _time_pairs, ordered, num_pairs))
        )
        del ordered
        scrambled = _half_used_allocator(num_blocks, rng)
        results.append(
            AllocatorResult(num_blocks, "scrambled", _best(repeats, _time_pairs, scrambled, num_pairs))
        )
        results.append(
            AllocatorResult(num_blocks, "mixed", _best(repeats, _time_mixed, scrambled, num_pairs // 3, rng))
        )
    return results


def _best(repeats: int, timer, *args) -> float:
    return max(timer(*args) for _ in range(repeats))
