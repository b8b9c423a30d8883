"""A request, and the small interface through which the engine's step drives it.

The step never asks what kind of request it holds. It calls, for each request that had a
sequence reach its last token this step:

1. :meth:`Request.drawers`: which sequences draw a token from this sequence's logits row. A
   sampling request answers with the sequence itself (plus, on its first token, the samples it
   forks into); a beam search keeps the row's best candidates and answers with none.
2. :meth:`Request.postprocess`, once the step's K/V are recorded as computed: share pages with
   new samples, append the drawn tokens, finish what ended, or advance the beams.
3. :meth:`Request.output`: what ``step()`` reports for it now, if anything.

Requests change memory only through a :class:`SequencePool`, which makes sequences and hands
forks and finished sequences to the scheduler and the cache manager.
"""

from __future__ import annotations

import torch

from ..memory.manager import KVCacheManager
from .outputs import RequestMetrics, RequestOutput
from .sampling import SamplingParams, sample_generator
from .scheduler import Scheduler
from .sequence import FinishReason, Sequence


class SequencePool:
    """Makes sequences (with fresh ids and their own generators), forks them, and releases them."""

    def __init__(self, scheduler: Scheduler, cache_manager: KVCacheManager) -> None:
        self.scheduler = scheduler
        self.cache_manager = cache_manager
        self.next_seq_id = 0  # a plain number, so that a rolled-back step gives its ids out again

    def new(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        sample_index: int = 0,
        cache_salt: str | None = None,
    ) -> Sequence:
        generator = sample_generator(params, sample_index)
        return Sequence(self._new_id(), request_id, list(prompt_token_ids), params, arrival_time,
                        sample_index, generator, cache_salt=cache_salt)  # fmt: skip

    def copy(self, parent: Sequence, sample_index: int) -> Sequence:
        """A new sequence with ``parent``'s tokens and computed count, holding no memory yet."""
        return Sequence(
            self._new_id(), parent.request_id, parent.prompt_token_ids, parent.params,
            parent.arrival_time, sample_index, sample_generator(parent.params, sample_index),
            output_token_ids=list(parent.output_token_ids), num_computed_tokens=parent.num_computed_tokens,
            cache_salt=parent.cache_salt, group_id=parent.group_id,
        )  # fmt: skip

    def _new_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id - 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares ``parent``'s pages and joins the running set at once."""
        self.cache_manager.fork(parent, child)
        self.scheduler.add_forked(child)

    def release(self, seq: Sequence) -> None:
        """A finished sequence leaves every queue; its blocks go back (or stay with their other owners)."""
        self.scheduler.finish(seq)


class Request:
    """One request: its prompt, its live sequences, its metrics (see the module docstring)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        seqs: list[Sequence],
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.seqs = seqs  # samples in index order; for a beam search, the live beams, best first
        self.metrics = RequestMetrics(arrival_time)

    @property
    def finished(self) -> bool:
        raise NotImplementedError

    def drawers(self, seq: Sequence, logits: torch.Tensor, pool: SequencePool) -> list[Sequence]:
        """The sequences that draw a token from ``logits``, the row of ``seq``'s last token."""
        raise NotImplementedError

    def postprocess(self, drawn: list[tuple[Sequence, int]], now: float, pool: SequencePool) -> None:
        """Apply this step's tokens (``drawn``: the drawers and their tokens) once its K/V are computed."""
        raise NotImplementedError

    def output(self) -> RequestOutput | None:
        """What ``step()`` reports for this request after a step that gave it tokens (``None``: nothing)."""
        raise NotImplementedError

    def mutable_parts(self) -> list[object]:
        """Every object of this request that a step may change in place (the request itself, its
        metrics, its live sequences): what a step's transaction snapshots (:mod:`.transaction`)."""
        return [self, self.metrics, *self.seqs]

    def abort(self, now: float, pool: SequencePool) -> None:
        """Finish every live sequence with reason ``abort`` and release its memory."""
        for seq in self.seqs:
            if not seq.is_finished:
                seq.finish(FinishReason.ABORTED, now)
                pool.release(seq)

    def _mark_first_token(self, now: float) -> None:
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
