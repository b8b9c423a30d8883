"""A sampling request: one sequence, or ``n`` parallel samples that share their prompt's pages.

(With ``best_of``, ``best_of`` samples are drawn the same way and the ``n`` most likely are reported.)

With a cache manager that can fork (the paged one), a request for ``n`` samples is one sequence
until its prompt is computed. When that sequence draws its first token, the request makes its
``n - 1`` siblings as copies of it; each draws its own first token from the same prompt logits,
and at the end of the step (``StepUpdate.forks``) they fork the parent's page table: the prompt's blocks are
shared, and only the partly filled last block is copied when a sample writes into it.

Sample ``i`` draws from its own generator seeded ``seed + i``, so its tokens are exactly those of
a lone request with ``n=1`` and seed ``seed + i``: sharing changes memory, never outputs. With a
manager that cannot fork (a contiguous baseline), the ``n`` samples are ``n`` independent
sequences from the start, with the same outputs.

(This is the paper's design and vLLM v0's. vLLM v1 has no fork: its ``ParentRequest`` turns
``n > 1`` into ``n`` child requests that share the prompt through the prefix cache.)
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .core.scheduler import StepUpdate
from .detokenizer import Detokenizer
from .outputs import CompletionOutput, RequestOutput
from .request import Request, SequencePool
from .sample.logprobs import PromptLogprobs
from .sample.sampling import RequestOutputKind, SamplingParams
from .sequence import Sequence

DELTA = RequestOutputKind.DELTA


class SamplingRequest(Request):
    """A request whose sequences sample their tokens (see the module docstring)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seqs: list[Sequence],
        arrival_time: float,
        detokenizer: Detokenizer,
    ) -> None:
        super().__init__(request_id, prompt, prompt_token_ids, seqs, arrival_time, detokenizer)
        self.params = params
        self._forks: list[tuple[Sequence, Sequence]] = []  # (parent, child) made by this step's drawers
        self._reported: dict[int, tuple[int, int]] = {}  # seq_id -> (tokens, characters) already streamed
        self._saved_reported: tuple[dict[int, tuple[int, int]], bool] | None = None
        self._prompt_reported = False  # a DELTA stream reports the prompt's log-probabilities once

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs) and not any(s.pending_forks for s in self.seqs)

    def drawers(self, seq: Sequence, logits: torch.Tensor, pool: SequencePool) -> list[Sequence]:
        if not seq.pending_forks:
            return [seq]
        first = len(self.seqs)
        children = [pool.copy(seq, first + i) for i in range(seq.pending_forks)]
        seq.pending_forks = 0
        self.seqs += children
        self._forks += [(seq, child) for child in children]
        return [seq, *children]

    def decide(
        self,
        drawn: list[tuple[Sequence, list[int]]],
        update: StepUpdate,
        computed: dict[int, int],
        now: float,
    ) -> None:
        update.forks += self._forks  # the parent's prompt is computed after this step: share its pages
        self._forks = []
        if drawn:
            self._mark_first_token(now)
        update.tokens += [(seq, list(tokens)) for seq, tokens in drawn]

    def output(self) -> RequestOutput | None:
        kind, finished = self.params.output_kind, self.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        outputs = []
        reported = self._reported_seqs()
        for position, seq in enumerate(reported):
            if seq.is_finished:
                text = seq.output_text  # complete: flushed when it finished
            else:
                self.detokenizer.update(seq)  # only the tokens since the last output
                text = self.detokenizer.stable_text(seq)
            tokens = seq.output_token_ids
            logprobs = seq.logprobs if self.params.logprobs is not None else None
            if kind is RequestOutputKind.DELTA:
                sent_tokens, sent_chars = self._reported.get(seq.seq_id, (0, 0))
                self._reported[seq.seq_id] = (len(tokens), len(text))
                text, tokens = text[sent_chars:], tokens[sent_tokens:]
                logprobs = None if logprobs is None else logprobs[sent_tokens:]
            else:
                tokens, logprobs = list(tokens), None if logprobs is None else list(logprobs)
            reason = seq.finish_reason.value if seq.finish_reason else None
            index = position if len(reported) < len(self.seqs) else seq.sample_index  # best_of: 0 .. n-1
            # vLLM v1: a number only when the request reports log-probabilities.
            cumulative = seq.cumulative_logprob if self.params.logprobs is not None else None
            outputs.append(
                CompletionOutput(index, text, tokens, reason, seq.stop_reason, cumulative, logprobs)
            )
        metrics = self.metrics
        if finished:
            metrics.finished_time = max((s.finish_time or 0.0) for s in self.seqs) or time.monotonic()
        metrics.num_preemptions = sum(s.num_preemptions for s in self.seqs)
        metrics.num_output_tokens = max(len(s.output_token_ids) for s in self.seqs)
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            finished,
            dataclasses.replace(metrics),  # each output keeps the metrics of its own step
            self._prompt_logprobs(kind),
            self.num_cached_tokens,
        )

    def _reported_seqs(self) -> list[Sequence]:
        """The ``n`` samples reported: all of them, or with ``best_of`` the ``n`` with the highest
        cumulative log-probability so far (vLLM v0's choice; ties keep the lower index), in index
        order, numbered ``0 .. n-1`` in the output."""
        n = self.params.n
        if len(self.seqs) <= n:
            return self.seqs
        best = sorted(self.seqs, key=lambda s: (-s.cumulative_logprob, s.sample_index))[:n]
        return sorted(best, key=lambda s: s.sample_index)

    def _prompt_logprobs(self, kind: RequestOutputKind) -> PromptLogprobs | None:
        """``[None, entry for prompt token 1, ...]`` once the prompt is computed; a DELTA stream
        reports them once, with its first output."""
        first = self.first_seq
        if self.params.prompt_logprobs is None or first.prompt_logit_positions:
            return None
        if kind is DELTA:
            if self._prompt_reported:
                return None
            self._prompt_reported = True
        return [None, *first.prompt_logprobs]

    # -- a step is a transaction -----------------------------------------------------------------
    def begin(self) -> None:
        super().begin()
        if self.params.output_kind is DELTA:  # what was streamed so far
            self._saved_reported = (dict(self._reported), self._prompt_reported)

    def rollback(self) -> None:
        super().rollback()
        self._forks = []
        if self._saved_reported is not None:
            self._reported, self._prompt_reported = self._saved_reported
        self._saved_reported = None

    def commit(self) -> None:
        super().commit()
        self._saved_reported = None
