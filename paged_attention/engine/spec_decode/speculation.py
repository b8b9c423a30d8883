"""Speculative decoding in the engine: drafts proposed after each step, verified in the next.

The path of a draft (vLLM v1's, with n-gram drafts):

1. After a step, :meth:`Speculator.propose` gives every sequence that is decoding (its last token
   sampled, not yet computed) up to ``num_speculative_tokens`` guesses from :func:`.ngram.propose`,
   capped so that even if all are accepted ``max_tokens`` and ``max_model_len`` hold.
2. The scheduler schedules them as ordinary tokens of the next step, behind the sequence's last
   token: the token budget counts them, and the KV-cache manager gives them slots as lookahead
   tokens (:meth:`~paged_attention.memory.manager.KVCacheManager.allocate_slots`), never entered in
   the prefix cache. Drafts that do not fit are dropped, never a reason to preempt anyone.
3. The model runs them through the prefill path (several query tokens of one sequence against its
   cached context) and returns a row of logits per position; :meth:`Speculator.verify` keeps what
   the target agrees with (:mod:`.rejection`), with every sampling parameter applied at each
   position as if the drafts before it had been generated.
4. The scheduler appends the kept tokens one by one (a stop ends the run: nothing after it is
   emitted), advances the computed count past the accepted drafts only, and truncates the rest:
   blocks that only rejected drafts held go back to the free queue at once.

Sampled requests are verified by *sampling, then comparing*: at each position the target's token
is drawn exactly as without drafts (one seed from the request's generator, hashed Gumbel noise:
:mod:`.gumbel`), and a
draft is accepted when it equals that token. A draft ``x`` is then accepted with probability
``p(x)``, and a rejection yields a token from ``p`` without ``x``: for a single drafted token this is
Leviathan et al.'s rule (:func:`.rejection.verify_sampled`, notebook 10's exercise), in distribution;
and a seeded request draws the same numbers, hence (up to float rounding) the same tokens, as
without drafts, whatever shares its batch.

Not drafted: beam search (vLLM runs it outside the engine, without speculation) and requests that
ask for ``logprobs`` (their top-k entries per position are not computed here). Drafts never take
the blocks a younger running sequence may need this step (see :class:`~.scheduler.Scheduler`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..core.step import DrawnLogprob, ScheduledSequence, StepUpdate
from ..outputs import RequestMetrics
from ..parallel_sampling import SamplingRequest
from ..params import SamplingParams
from ..request import Request
from ..sample.rejection import verify_greedy
from ..sample.sampling import Sampler
from ..sequence import Sequence
from ..stop_rules import StopRules
from .ngram import propose
from .speculative import SpeculativeConfig


@dataclass
class SpecDecodingStats:
    """vLLM's speculative-decoding counters: verification steps with drafts (``num_drafts``),
    drafted and accepted tokens, and acceptances per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verification step: the accepted drafts plus the target's own token (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_position)
        )


@dataclass(frozen=True)
class _Ahead:
    """A sequence as if its first ``len(extra)`` drafts were already output: what the sampler's
    penalties and the stop rules' ``min_tokens`` see at each drafted position."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None


def may_draft(request: Request | None, seq: Sequence) -> bool:
    """Drafts for sampling requests (not beam searches) that do not ask for ``logprobs``."""
    return isinstance(request, SamplingRequest) and seq.params.logprobs is None


class Speculator:
    """Proposes and verifies n-gram drafts (see the module docstring); keeps the statistics."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self._saved: SpecDecodingStats | None = None

    def propose(self, seqs: Iterable[Sequence], requests: Mapping[str, Request]) -> None:
        """Give every decoding sequence its drafts for the next step (none to the others, nor to
        the sequences :func:`may_draft` leaves out); ``requests``: the engine's, by id."""
        config = self.config
        for seq in seqs:
            seq.draft_token_ids = []
            if seq.is_finished or seq.num_uncomputed_tokens != 1 or seq.pending_forks:
                continue
            if not may_draft(requests.get(seq.request_id), seq):
                continue
            k = min(config.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
            if seq.params.max_tokens is not None:
                k = min(k, seq.params.max_tokens - len(seq.output_token_ids) - 1)
            if k > 0:
                tokens = [*seq.prompt_token_ids, *seq.output_token_ids]
                seq.draft_token_ids = propose(tokens, config.prompt_lookup_min, config.prompt_lookup_max, k)

    def verify(
        self,
        s: ScheduledSequence,
        logits: torch.Tensor,
        sampler: Sampler,
        stop_rules: StopRules,
        update: StepUpdate,
        metrics: RequestMetrics,
    ) -> list[int]:
        """The tokens ``s``'s sequence keeps from this step (accepted drafts, then one of the
        target's own); their log-probabilities and the number of rejected drafts go into
        ``update``, the counts into the request's ``metrics``. ``logits``: one row per position,
        the last token's first."""
        seq, drafts = s.seq, list(s.drafts)
        views = [
            _Ahead(seq.prompt_token_ids, [*seq.output_token_ids, *drafts[:i]], seq.params, seq.generator)
            for i in range(len(drafts) + 1)
        ]
        masks = seq.grammar.masks_ahead(seq.output_token_ids, drafts) if seq.grammar is not None else None
        banned = [stop_rules.banned(v) for v in views]  # type: ignore[arg-type]
        raw, work, scores = sampler.targets(logits, views, banned, masks)  # type: ignore[arg-type]
        if scores is None:
            tokens, accepted = verify_greedy(drafts, work.argmax(dim=-1).tolist())
            processed = work
        else:  # sample, then compare: one draw per emitted token, as without drafts (module docstring)
            generator = sampler.generator_of(seq)
            tokens, accepted = [], 0
            for i in range(len(drafts) + 1):
                tokens.append(sampler.draw_from_row(scores[i], generator))
                if i == len(drafts) or tokens[-1] != drafts[i]:
                    break
                accepted += 1
            processed = scores
        if seq.params.tracks_logprob:
            table = (raw if sampler.logprobs_mode == "raw_logprobs" else processed).log_softmax(dim=-1)
            logprobs = [DrawnLogprob(float(table[i, token])) for i, token in enumerate(tokens)]
        else:
            logprobs = [DrawnLogprob(None) for _ in tokens]
        update.logprobs[seq.seq_id] = logprobs
        update.rejected[seq.seq_id] = len(drafts) - accepted
        metrics.num_draft_tokens += len(drafts)
        metrics.num_accepted_tokens += accepted
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += accepted
        for position in range(accepted):
            stats.accepted_per_position[position] += 1
        return tokens

    # -- a step is a transaction (:mod:`.transaction`) -------------------------------------------
    def begin(self) -> None:
        self._saved = self.stats.copy()

    def commit(self) -> None:
        self._saved = None

    def rollback(self) -> None:
        if self._saved is not None:
            self.stats = self._saved
        self._saved = None
