"""A step is a transaction: what it changes is committed when it ends, or rolled back if it raises.

**Why.** A step changes a lot before the model has even run: the scheduler hands out KV slots,
forks and copies blocks, preempts and swaps sequences, enters blocks in the prefix cache; sampling
then advances random generators, and the end of the step appends tokens, forks samples and
finishes sequences. If anything raises in between (Ctrl-C in a notebook, out of memory, a bad
value found mid-step), a half-applied step leaves page tables one step ahead of the computed-token
counts, and the engine is wedged. So :meth:`LLMEngine.step <.llm_engine.LLMEngine.step>` runs
inside a :class:`StepTransaction`.

**Each stateful part owns its undo** (:class:`Transactional`: ``begin``, ``commit``, ``rollback``),
and a part that holds others begins, commits and rolls back those too: the engine its requests, a
request its sequences and metrics, the scheduler its policy, the paged manager its page tables and
allocators. The engine only lists its top-level parts. Two ways of keeping an undo, each where it
is cheaper:

* **A snapshot of what can change, O(1) per object**: a sequence keeps its counters and the
  *lengths* of its append-only lists (``output_token_ids``, ``block_hashes``), which a rollback
  truncates back instead of copying; the scheduler copies its queues (references to the live
  sequences: O(sequences held), the one part that is); the sampler keeps the state of each
  generator when it first draws from it in the step.
* **An undo log, O(changes)**: the block allocator and the prefix cache write the inverse of every
  change into a journal and replay it backwards (a million free blocks cost nothing if the step
  touched ten). The KV tensors save only the blocks the step takes from someone else
  (:meth:`protect`): every other block a step writes was free and uncached, or is written past
  what its owner has computed.

Why both: a log is exact and O(changes) but every mutation must go through a logging method,
which suits the allocator's five operations and not a sequence's dozen fields that the scheduler
and the requests set directly; a snapshot is trivially complete for a small object but would be
O(blocks) for the allocator.

The invariant, tested on every part reachable from a live engine (``tests/test_rollback_state.py``
walks them all and deep-compares): after a rollback the engine is exactly as it was before the
step, so the next step redoes the same work and draws the same tokens. The exception goes on to
the caller unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from ...memory.manager import KVCacheManager
from ..worker.kv_cache import KVCache


class Transactional(Protocol):
    """A part of the engine's state that can undo one step.

    ``begin`` records what is needed to undo (cheaply: see the module docstring); ``commit`` drops
    that record; ``rollback`` restores the state ``begin`` saw and drops the record. Between steps
    no record is held.
    """

    def begin(self) -> None: ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...


class StepTransaction:
    """One step's undo: :meth:`begin` every part, :meth:`protect` the reused blocks once the step is
    scheduled, then :meth:`commit` or :meth:`rollback` (parts roll back in the reverse order of
    ``begin``, and only those that began: an interrupt during ``begin`` is undone too)."""

    def __init__(
        self,
        parts: Iterable[Transactional],
        cache_manager: KVCacheManager,
        caches: tuple[KVCache, KVCache | None],
    ) -> None:
        self._parts = [*parts, cache_manager, *(c for c in caches if c is not None)]
        self._manager = cache_manager
        self._caches = caches
        self._begun = 0

    def begin(self) -> None:
        for part in self._parts:
            part.begin()
            self._begun += 1

    def protect(self) -> None:
        """Save the K/V of the blocks the step reuses (call after scheduling, before any write)."""
        for cache, block_ids in zip(self._caches, self._manager.reused_blocks(), strict=True):
            if cache is not None:
                cache.protect(block_ids)

    def commit(self) -> None:
        """Every part drops its record, even if one raises (the first error then goes on)."""
        _each(self._parts[: self._begun], "commit")

    def rollback(self) -> None:
        """Every part that began restores itself, newest first, even if one of them raises (a second
        Ctrl-C, a device error writing K/V back): the bookkeeping is put back whatever the tensors
        do, and the first error then goes on."""
        _each(reversed(self._parts[: self._begun]), "rollback")


def _each(parts: Iterable[Transactional], method: str) -> None:
    error: BaseException | None = None
    for part in parts:
        try:
            getattr(part, method)()
        except BaseException as err:  # each part must run, whatever the others do
            error = error or err
    if error is not None:
        raise error
