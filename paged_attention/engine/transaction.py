"""A step is a transaction: what it changes is committed when it ends, or rolled back if it raises.

**Why.** A step changes a lot before the model has even run: the scheduler hands out KV slots,
forks and copies blocks, preempts and swaps sequences, enters blocks in the prefix cache; sampling
then advances random generators, and post-processing appends tokens, forks samples and finishes
sequences. If anything raises in between (Ctrl-C in a notebook, out of memory, a bad value found
mid-step), a half-applied step leaves page tables one step ahead of the computed-token counts, and
the engine is wedged. So :meth:`LLMEngine.step <.llm_engine.LLMEngine.step>` runs inside a
:class:`StepTransaction`:

1. **begin**: snapshot the small bookkeeping (the engine's request map, every live request and
   sequence, the scheduler's queues and counters, the policy's attributes, the sequence-id counter,
   the random generators of the sampler and of every seeded sequence), and open the cache
   manager's undo log (``begin_step``: page tables, the allocator's free queue and reference
   counts, the prefix-cache map and its statistics).
2. **protect**, after scheduling and before anything is written: copy the K/V of the blocks this
   step took that held data when it began (freed by a preemption, or an evicted prefix-cache
   block), as the manager's ``reused_blocks`` reports. No other block needs saving: every other
   block the step writes was free and uncached, or is written past what its owner has computed.
3. **commit** when the step's results are applied, or **rollback** on any exception
   (``BaseException``: ``KeyboardInterrupt`` included): every snapshot and saved block is put back,
   and the exception goes on to the caller unchanged.

The invariant: after a rollback the engine is exactly as it was before the step, so the next step
redoes the same work and draws the same tokens (seeded generators are restored too). The cost is
list copies in the number of live sequences and blocks held, per step; the KV cache is never
copied, only the few blocks a step takes from someone else.

Snapshots are shallow, one level deep: an object's attributes are kept, and the lists, dicts,
sets and deques among them are copied. Whatever a step changes deeper down must be listed as an
object of its own (see :meth:`Request.mutable_parts <.request.Request.mutable_parts>`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from ..memory.kv_cache import KVCache
from ..memory.manager import KVCacheManager

_CONTAINERS = (list, dict, set, deque)


def snapshot(obj: object) -> dict[str, Any]:
    """``obj``'s attributes, its containers copied (one level deep)."""
    return {k: v.copy() if isinstance(v, _CONTAINERS) else v for k, v in vars(obj).items()}


def restore(obj: object, state: dict[str, Any]) -> None:
    """Give ``obj`` back the attributes :func:`snapshot` took (attributes added since are dropped)."""
    attributes = vars(obj)
    attributes.clear()
    attributes.update(state)


class StepTransaction:
    """One step's undo record (see the module docstring): ``begin`` it, ``protect`` the reused
    blocks once the step is scheduled, then ``commit`` or ``rollback``."""

    def __init__(
        self,
        objects: Iterable[object],
        generators: Iterable[torch.Generator],
        cache_manager: KVCacheManager,
        kv_cache: KVCache,
        cpu_cache: KVCache | None,
    ) -> None:
        self._objects = [(obj, snapshot(obj)) for obj in objects if hasattr(obj, "__dict__")]
        self._generators = [(g, g.get_state()) for g in generators]
        self._manager = cache_manager
        self._caches = (kv_cache, cpu_cache)
        self._saved_blocks: list[tuple[KVCache, list[int], torch.Tensor]] = []
        cache_manager.begin_step()  # last: nothing is logged unless the snapshots above were taken

    def protect(self) -> None:
        """Save the K/V of the blocks the step reuses (call after scheduling, before any write)."""
        for cache, block_ids in zip(self._caches, self._manager.reused_blocks(), strict=True):
            if cache is not None and block_ids:
                self._saved_blocks.append((cache, block_ids, cache.read_blocks(block_ids)))

    def commit(self) -> None:
        self._manager.commit_step()
        self._saved_blocks.clear()

    def rollback(self) -> None:
        """Undo the step: memory bookkeeping, saved K/V, then every object and generator."""
        self._manager.rollback_step()
        for cache, block_ids, saved in self._saved_blocks:
            cache.write_blocks(block_ids, saved)
        for obj, state in self._objects:
            restore(obj, state)
        for generator, state in self._generators:
            generator.set_state(state)
