"""Who may join a step, and who steps back: the two choices of continuous batching, as hooks.

The scheduler (:mod:`.scheduler`) asks its policy; continuous batching is the default, and the
static batching baseline (:mod:`paged_attention.baselines.static_batching`) is another policy, not a
flag. A policy may keep state between steps: it is then part of the step's transaction
(:mod:`.transaction`), and the default :meth:`SchedulingPolicy.begin` keeps its attributes (the
lists, dicts and sets among them copied), which is enough for state kept in attributes and flat
containers; a policy with deeper state overrides ``begin``/``rollback``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from ...memory.manager import KVCacheManager
from ..sequence import Sequence

_CONTAINERS = (list, dict, set, deque)


class SchedulingPolicy:
    """Continuous batching's two choices, who may join and who steps back, as hooks a baseline (or a
    student) may override. A policy may keep state: give each scheduler its own instance.

    * :meth:`opens_admission` is asked once per step, before anyone waiting is admitted: may the
      queue be admitted from at all this step? :meth:`may_admit` is then asked for the sequence at
      the head of the queue; admission stops at the first "no" (first come, first served).
      :meth:`admits` then says whether memory allows it (the cache manager's rule by default).
      :meth:`admission_ended` hears whether only the token budget stopped admission.
    * :meth:`victim` picks whom to preempt when memory runs out: the latest arrival, so that the
      oldest sequence always makes progress (the no-deadlock argument above relies on it).
    """

    def opens_admission(self, running: list[Sequence], waiting: Iterable[Sequence]) -> bool:
        return True

    def may_admit(self, seq: Sequence) -> bool:
        return True

    def admits(self, seq: Sequence, num_new_tokens: int, cache_manager: KVCacheManager) -> bool:
        """Memory admission: may ``seq`` start now, with ``num_new_tokens`` tokens to compute after
        its first ``seq.num_computed_tokens`` (a prefix-cache hit)? ``num_new_tokens`` is all it
        must compute before it samples (its whole prompt, or whole recompute), even when the token
        budget lets this step compute only a first chunk: a sequence admitted for its first chunk
        alone would preempt itself on the next. The manager's own rule by default: for the paged
        manager, the blocks it needs must leave ``watermark_blocks`` free."""
        return cache_manager.can_admit(seq, num_new_tokens)

    def admission_ended(self, stopped_by_budget: bool) -> None:
        return None

    def victim(self, running: list[Sequence]) -> Sequence:
        """The sequence to preempt; ``running`` is in arrival order (forks behind their parent)."""
        return running[-1]

    # -- a step is a transaction (:mod:`.transaction`) -------------------------------------------
    def begin(self) -> None:
        state = {
            k: v.copy() if isinstance(v, _CONTAINERS) else v for k, v in vars(self).items() if k != "_saved"
        }
        self._saved: dict[str, Any] = state  # held only while a step is open

    def commit(self) -> None:
        vars(self).pop("_saved", None)

    def rollback(self) -> None:
        saved = vars(self).pop("_saved", None)
        if saved is not None:
            vars(self).clear()
            vars(self).update(saved)
