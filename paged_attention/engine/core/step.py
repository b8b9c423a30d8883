"""The records a step passes along: what the scheduler chose, and what the requests decided.

* :class:`ScheduledSequence` / :class:`SchedulerOutput`: the scheduler's choice for one step (which
  tokens of which sequences run, blocks to copy or swap, who was preempted), read by the model
  runner and the engine;
* :class:`StepUpdate` (with :class:`DrawnLogprob`): what the requests decided from the step's logits,
  applied by :meth:`Scheduler.update_from_output <.scheduler.Scheduler.update_from_output>`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ...memory.page_table import BlockCopy
from ..sequence import Sequence

if TYPE_CHECKING:  # annotations only: the scheduler's bookkeeping imports no torch
    from ..sample.logprobs import Logprob


class ScheduledSequence(NamedTuple):
    """One sequence's share of a step: tokens ``start .. start + num_new_tokens - 1``.

    ``needs_logits`` says whether this step reaches the sequence's last token, so that its logits pick
    the next one (false for all but the last chunk of a chunked prefill). ``prompt_positions``: the
    positions of this chunk whose logits give prompt log-probabilities (``prompt_logprobs``).
    ``drafts``: drafted tokens (speculative decoding) that follow the sequence's last token in this
    step; they are the last ``len(drafts)`` of the ``num_new_tokens``, and each brings a row of
    logits, so that the target model verifies them all in one forward.

    Immutable, as a frozen dataclass would be, but a tuple: built in 0.5 us instead of 2.6 (the
    scheduler builds one per running sequence per step; a trace replay, hundreds of thousands).
    """

    seq: Sequence
    num_new_tokens: int
    slot_mapping: list[int]
    start: int
    needs_logits: bool
    prompt_positions: range = range(0)
    drafts: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, seq: Sequence, num_new_tokens: int, slot_mapping: list[int], drafts: tuple[int, ...] = ()
    ) -> ScheduledSequence:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens - len(drafts)
        wanted = seq.prompt_logit_positions
        prompt = range(max(wanted.start, start), min(wanted.stop, end)) if wanted else wanted
        return cls(seq, num_new_tokens, slot_mapping, start, end == seq.num_tokens, prompt, drafts)

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes: the sequence's own, then the drafts."""
        own = self.start + self.num_new_tokens - len(self.drafts)
        return [*self.seq.token_slice(self.start, own), *self.drafts]

    @property
    def decoding(self) -> bool:
        """Whether this step's tokens come after the prompt (a decode step's one and any drafts):
        attention then takes the decode path for them, as for every generated token, whatever their
        count (:func:`...kernels.paged_prefill`'s ``decoding``)."""
        return self.start >= len(self.seq.prompt_token_ids)

    @property
    def logit_positions(self) -> list[int]:
        """The positions whose logits the model runner returns, in order: the prompt ones, then
        the last token's if it samples, and each draft's."""
        end = self.start + self.num_new_tokens
        last = list(range(end - 1 - len(self.drafts), end)) if self.needs_logits else []
        return [*self.prompt_positions, *last]


@dataclass
class SchedulerOutput:
    """Everything the model runner and the engine must do for one step."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class DrawnLogprob:
    """A drawn token's log-probability (``None`` if its request reports none: nothing computed),
    and its vLLM entry if the request asked for one."""

    logprob: float | None
    entry: dict[int, Logprob] | None = None


@dataclass
class StepUpdate:
    """What the requests decided from one step's logits, for :meth:`Scheduler.update_from_output`.

    * ``forks``: ``(parent, child)`` pairs; the child is a fresh copy of the parent (same tokens,
      no memory yet) that will share the parent's pages;
    * ``tokens``: ``(sequence, new tokens)`` pairs, in order; one token per sequence for ordinary
      sampling (several would be appended one by one, stopping at the first stop);
    * ``dropped``: sequences that end without a token (beams that did not survive);
    * ``logprobs``: for a sequence's tokens, each one's log-probability (added to the sequence's
      ``cumulative_logprob``) and, if its request asked for ``logprobs``, its entry (kept in
      ``seq.logprobs``): kept, like the token, only up to a stop;
    * ``prompt_logprobs``: entries of prompt tokens this step's chunk predicted (``prompt_logprobs``);
    * ``rejected``: for a sequence that verified drafts, how many the target rejected: their K/V,
      written this step, is forgotten (the computed count stops before them).
    """

    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    tokens: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    dropped: list[Sequence] = field(default_factory=list)
    logprobs: dict[int, list[DrawnLogprob]] = field(default_factory=dict)  # seq_id -> one per token
    prompt_logprobs: list[tuple[Sequence, list[dict[int, Logprob]]]] = field(default_factory=list)
    rejected: dict[int, int] = field(default_factory=dict)  # seq_id -> drafts the target rejected

    @classmethod
    def scripted(cls, out: SchedulerOutput, token: int = 0) -> StepUpdate:
        """A model stand-in: every sequence that reached its last token samples ``token`` (the
        trace replay and the tests' scripted model)."""
        return cls(tokens=[(s.seq, [token]) for s in out.scheduled if s.needs_logits])
