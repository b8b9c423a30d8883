"""Static batching: the scheduling policy of ``model.generate`` on a fixed batch.

A batch is formed from the requests waiting when nothing runs, and nobody joins until its last
member ends, however many seats its finished members left empty. It is the baseline that
continuous batching (Orca, vLLM) improves on; chapter 04 draws both side by side.

A batch stays open only while it fills up over several steps because the token budget
(``max_num_batched_tokens``) stopped admission; a request that arrived after the batch formed
waits for the next batch.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..engine.core.scheduler import SchedulingPolicy
from ..engine.sequence import Sequence


class StaticBatching(SchedulingPolicy):
    """Fixed batches run to the end (see the module docstring)."""

    def __init__(self) -> None:
        self._members: set[int] = set()  # who may join the current batch: those waiting when it formed
        self._open = True  # may the current batch still take them?

    def opens_admission(self, running: list[Sequence], waiting: Iterable[Sequence]) -> bool:
        if running:
            return self._open
        self._members = {s.seq_id for s in waiting}  # nothing runs: a new batch forms
        return True

    def may_admit(self, seq: Sequence) -> bool:
        return seq.seq_id in self._members

    def admission_ended(self, stopped_by_budget: bool) -> None:
        self._open = stopped_by_budget
