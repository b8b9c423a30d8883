"""A request, and the small interface through which the engine's step drives it.

The step never asks what kind of request it holds. For each request, every step:

1. :meth:`Request.drawers`, for each of its sequences that reached its last token: which
   sequences draw a token from that sequence's logits row. A sampling request answers with the
   sequence itself (plus, on its first token, the samples it forks into); a beam search keeps the
   row's best candidates and answers with none.
2. :meth:`Request.decide`, once the tokens are drawn: what the step's end must do for it, written
   into the step's :class:`~.scheduler.StepUpdate` (tokens to append, children to fork, beams to
   drop). A request changes only its own bookkeeping here; the scheduler applies the update
   (:meth:`Scheduler.update_from_output <.scheduler.Scheduler.update_from_output>`).
3. :meth:`Request.output`: what ``step()`` reports for it now, if anything.

New sequences (samples, beams) come from a :class:`SequencePool`, which gives them fresh ids and
their own generators.
"""

from __future__ import annotations

from typing import Any

import torch

from .core.scheduler import Scheduler, StepUpdate
from .detokenizer import Detokenizer
from .outputs import RequestMetrics, RequestOutput
from .sample.sampling import SamplingParams, sample_generator
from .sequence import FinishReason, Sequence


class SequencePool:
    """Makes sequences, with fresh ids and their own generators (a transactional part: a rolled-back
    step gives its ids out again)."""

    def __init__(self) -> None:
        self.next_seq_id = 0
        self._saved: int | None = None

    def new(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        sample_index: int = 0,
        cache_salt: str | None = None,
        grammar: Any = None,
    ) -> Sequence:
        generator = sample_generator(params, sample_index)
        return Sequence(self._new_id(), request_id, list(prompt_token_ids), params, arrival_time,
                        sample_index, generator, cache_salt=cache_salt, grammar=grammar)  # fmt: skip

    def copy(self, parent: Sequence, sample_index: int) -> Sequence:
        """A new sequence with ``parent``'s tokens and text, holding no memory yet (the step's end
        gives it the parent's computed count when it forks the parent's pages)."""
        return Sequence(
            self._new_id(), parent.request_id, parent.prompt_token_ids, parent.params,
            parent.arrival_time, sample_index, sample_generator(parent.params, sample_index),
            output_token_ids=list(parent.output_token_ids),
            cache_salt=parent.cache_salt, group_id=parent.group_id, output_text=parent.output_text,
            prefix_offset=parent.prefix_offset, read_offset=parent.read_offset,
            cumulative_logprob=parent.cumulative_logprob, logprobs=list(parent.logprobs),
            num_cached_tokens=parent.num_cached_tokens,
            grammar=parent.grammar.fork() if parent.grammar is not None else None,
        )  # fmt: skip

    def _new_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id - 1

    def begin(self) -> None:
        self._saved = self.next_seq_id

    def commit(self) -> None:
        self._saved = None

    def rollback(self) -> None:
        if self._saved is not None:
            self.next_seq_id = self._saved
        self._saved = None


class Request:
    """One request: its prompt, its live sequences, its metrics (see the module docstring)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        seqs: list[Sequence],
        arrival_time: float,
        detokenizer: Detokenizer,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.seqs = seqs  # samples in index order; for a beam search, the live beams, best first
        self.first_seq = seqs[0]  # the one admitted first: what the prompt's reports come from
        self.metrics = RequestMetrics(arrival_time)
        self.detokenizer = detokenizer
        self._saved: tuple | None = None

    @property
    def finished(self) -> bool:
        raise NotImplementedError

    def drawers(self, seq: Sequence, logits: torch.Tensor, pool: SequencePool) -> list[Sequence]:
        """The sequences that draw a token from ``logits``, the row of ``seq``'s last token."""
        raise NotImplementedError

    def decide(
        self,
        drawn: list[tuple[Sequence, list[int]]],
        update: StepUpdate,
        computed: dict[int, int],
        now: float,
    ) -> None:
        """Write what this step's end must do for the request into ``update``. ``drawn``: the
        drawers and their tokens; ``computed``: tokens each scheduled sequence computes this step
        (by seq id), so that a request can tell which sequences are fully computed after it."""
        raise NotImplementedError

    def output(self) -> RequestOutput | None:
        """What ``step()`` reports for this request after a step that gave it tokens (``None``: nothing)."""
        raise NotImplementedError

    def abort(self, now: float, scheduler: Scheduler) -> None:
        """Finish every live sequence with reason ``abort`` (its memory goes back)."""
        for seq in self.seqs:
            if not seq.is_finished:
                scheduler.finish(seq, FinishReason.ABORTED, now)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose K/V came from the prefix cache when the request was first admitted."""
        return max(0, self.first_seq.num_cached_tokens)

    def _mark_first_token(self, now: float) -> None:
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now

    # -- a step is a transaction (:mod:`.transaction`) -------------------------------------------
    def begin(self) -> None:
        """Keep the list of sequences (it may grow or be replaced), the metrics, and begin every
        sequence; a subclass adds its own state."""
        self._saved = (self.seqs, len(self.seqs), self.metrics.copy())
        for seq in self.seqs:
            seq.begin()

    def commit(self) -> None:
        for seq in self.seqs:
            seq.commit()
        saved, self._saved = self._saved, None
        if saved is not None and saved[0] is not self.seqs:
            for seq in saved[0]:  # sequences the step replaced (beams) are no longer held
                seq.commit()

    def rollback(self) -> None:
        if self._saved is None:
            return
        seqs, length, self.metrics = self._saved
        del seqs[length:]
        self.seqs = seqs
        for seq in seqs:
            seq.rollback()
        self._saved = None
