"""Beam search: keep the ``beam_width`` most likely partial outputs, and share their pages.

Greedy decoding keeps one sequence and takes the most likely token at each step. Beam search keeps
``k`` of them (the *beams*). At each step every beam proposes its most likely next tokens, all the
proposals are ranked by the log-probability of the whole sequence, and the best ``k`` become the
next beams. A beam that proposes nothing good dies; a strong one may leave two or three children.
With ``k = 1`` it is greedy decoding.

**Why it is the best case for paging.** The children of a beam share everything their parent had,
and beams that split long ago still share the prompt and their common beginning. So each step
*forks* the page table of a beam that has several children and *frees* the table of a beam that
has none: the blocks before the split are shared (reference counts), and only the partly filled
last block is copied when a child writes into it (copy-on-write). The PagedAttention paper measures
37-55% less KV memory for beam search this way; ``bench sharing`` measures it here.

**Which rules.** The interface is vLLM's (``LLM.beam_search(prompts, BeamSearchParams(...))``
returning :class:`BeamSearchOutput` with ``.sequences``). The ranking and stopping rules are
transformers' (``generate(num_beams=k, do_sample=False)``, ``early_stopping=False``), so the two can
be compared token for token:

1. Each step takes the ``2k`` best continuations over all beams (``(1 + number of EOS tokens) * k``,
   so that ``k`` of them always continue even if the best all end here).
2. The best ``k`` continuations that do *not* end become the next beams.
3. A continuation that ends (EOS, or ``max_tokens`` reached) joins the finished list, with score
   ``cumulative logprob / generated_length ** length_penalty``, only if it ranks among the best
   ``k`` continuations; the finished list keeps the ``k`` best.
4. The search stops when every continuation ends, or when the finished list is full and the best
   running beam, scored at its current length, cannot beat the worst finished one.

vLLM runs a similar loop but scores by the whole length (prompt included) and never stops early;
with ``length_penalty=0`` and ``ignore_eos=True`` the two agree.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from .._checks import cdiv
from ..memory.manager import KVCacheManager
from .core.scheduler import StepUpdate
from .detokenizer import Detokenizer
from .outputs import CompletionOutput, RequestOutput
from .request import Request, SequencePool
from .sample.sampling import BeamSearchParams
from .sequence import Sequence, SequenceStatus


@dataclass
class BeamSearchSequence:
    """One finished beam (vLLM's ``BeamSearchSequence``): ``tokens`` include the prompt."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float = 0.0  # cum_logprob / generated_length ** length_penalty: how beams are ranked


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first (vLLM's ``BeamSearchOutput``)."""

    sequences: list[BeamSearchSequence]


@dataclass(frozen=True)
class Continuation:
    """A live beam (``parent``, an index into the current beams) extended by ``token``."""

    parent: int
    token: int
    cum_logprob: float


@dataclass
class Hypothesis:
    """A finished continuation: its generated tokens, its score and why it ended."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class BeamSearch:
    """The ranking state of one request's beam search; it knows tokens and scores, not memory.

    :class:`BeamSearchRequest` calls :meth:`step` with each live beam's best next tokens and gets
    back the next beams as :class:`Continuation` s, which it turns into forked and freed page tables.
    """

    params: BeamSearchParams
    eos_token_ids: Collection[int]
    num_generated: int = 0
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True  # transformers' early-stopping heuristic has not fired yet
    done: bool = False

    def __post_init__(self) -> None:
        self.eos_token_ids = frozenset() if self.params.ignore_eos else frozenset(self.eos_token_ids)

    @property
    def num_candidates(self) -> int:
        """Continuations ranked per step: enough that ``beam_width`` survive even if the best all end."""
        return max(2, 1 + len(self.eos_token_ids)) * self.params.beam_width

    def top_candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A beam's ``num_candidates`` best next tokens: ``(log-probabilities, token ids)`` in float32.

        The best continuations over all beams are always among each beam's own best
        ``num_candidates``, so that is all a beam must keep while it waits for its siblings.
        """
        log_probs = torch.log_softmax(logits.to(torch.float32), dim=-1)
        values, tokens = torch.topk(log_probs, min(self.num_candidates, log_probs.shape[-1]))
        return values, tokens

    def step(
        self,
        cum_logprobs: list[float],
        candidates: list[tuple[torch.Tensor, torch.Tensor]],
        outputs: list[list[int]],
    ) -> list[Continuation]:
        """Rank every beam's candidates; return the next beams, best first (empty once done).

        ``cum_logprobs[i]``, ``candidates[i]`` (from :meth:`top_candidates`) and ``outputs[i]`` (its
        generated tokens so far) describe live beam ``i``.
        """
        if self.done:
            raise RuntimeError("this beam search is already done")
        width, penalty = self.params.beam_width, self.params.length_penalty
        # Accumulate in float32, exactly as transformers does, so that near-ties break the same way.
        scores = torch.cat(
            [
                v + torch.tensor(c, dtype=torch.float32)
                for c, (v, _) in zip(cum_logprobs, candidates, strict=True)
            ]
        )
        tokens = torch.cat([t for _, t in candidates])
        parents = torch.cat([torch.full_like(t, i) for i, (_, t) in enumerate(candidates)])
        best, order = torch.topk(scores, min(self.num_candidates, scores.numel()))
        length = self.num_generated + 1  # every continuation's generated length
        ranked = []
        for rank, (score, index) in enumerate(zip(best.tolist(), order.tolist(), strict=True)):
            token = int(tokens[index])
            ends = token in self.eos_token_ids or length >= self.params.max_tokens
            ranked.append((Continuation(int(parents[index]), token, score), ends))
            if ends and rank < width and self.improvable:
                reason = "stop" if token in self.eos_token_ids else "length"
                output = [*outputs[int(parents[index])], token]
                self.finished.append(
                    Hypothesis(output, score, penalized_score(score, length, penalty), reason)
                )
        self.finished.sort(key=lambda h: -h.score)  # stable: on a tie the earlier hypothesis stays first
        del self.finished[width:]
        self.num_generated = length
        running = [c for c, ends in ranked if not ends][:width]
        if running and len(self.finished) == width:
            best_possible = penalized_score(running[0].cum_logprob, length, penalty)
            self.improvable = best_possible > self.finished[-1].score
        self.done = not running or not self.improvable
        return [] if self.done else running


def penalized_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """``cum_logprob / length ** length_penalty``, rounded to float32 as transformers computes it."""
    return float(torch.tensor(cum_logprob, dtype=torch.float32) / length**length_penalty)


class BeamSearchRequest(Request):
    """A request whose beams fork and free page tables at every step (see the module docstring).

    Each step, every live beam that reaches its last token leaves its best candidates
    (:meth:`BeamSearch.top_candidates`) and is then *parked* by the scheduler (nothing left to
    compute) until all its siblings have theirs. Then :meth:`decide` ranks them all: the beams
    that continue more than once fork, those that do not continue are dropped, and each new beam
    gets its token (the scheduler applies it all at the step's end). A beam search reports once,
    when it ends: until then a later step may still drop any beam, so there is no partial text to
    stream.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        seq: Sequence,
        arrival_time: float,
        detokenizer: Detokenizer,
        eos_token_ids: Collection[int],
        pool: SequencePool,
    ) -> None:
        super().__init__(request_id, prompt, prompt_token_ids, [seq], arrival_time, detokenizer)
        self.search = BeamSearch(params, eos_token_ids)
        self.pool = pool
        self.cum_logprobs = [0.0]  # one per live beam
        self._candidates: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq_id -> its best next tokens
        self._saved_search: tuple | None = None

    @property
    def finished(self) -> bool:
        return self.search.done

    def drawers(self, seq: Sequence, logits: torch.Tensor, pool: SequencePool) -> list[Sequence]:
        self._candidates[seq.seq_id] = self.search.top_candidates(logits)
        return []

    def decide(
        self,
        drawn: list[tuple[Sequence, list[int]]],
        update: StepUpdate,
        computed: dict[int, int],
        now: float,
    ) -> None:
        beams = self.seqs
        if self.search.done or not all(self._ready(b, computed) for b in beams):
            return
        chosen = self.search.step(
            self.cum_logprobs,
            [self._candidates[b.seq_id] for b in beams],
            [b.output_token_ids for b in beams],
        )
        self._candidates = {}
        beams[0].pending_forks = 0  # its seats are the new beams' now
        new_beams, continued = [], set()
        for c in chosen:  # forks first: a child copies its parent before the parent grows
            parent = beams[c.parent]
            if c.parent in continued:
                child = self.pool.copy(parent, 0)
                update.forks.append((parent, child))
                new_beams.append(child)
            else:
                continued.add(c.parent)
                new_beams.append(parent)
        # A dead end's blocks go back (or to its siblings); vLLM v0 marked it FINISHED_ABORTED too.
        update.dropped += [beam for index, beam in enumerate(beams) if index not in continued]
        update.tokens += [(beam, [c.token]) for beam, c in zip(new_beams, chosen, strict=True)]
        self._mark_first_token(now)  # the first tokens were chosen (or the search ended) now
        self.seqs, self.cum_logprobs = new_beams, [c.cum_logprob for c in chosen]

    def output(self) -> RequestOutput | None:
        """Once done: one output per best beam, best first (as vLLM's server returns a beam search)."""
        if not self.search.done:
            return None
        outputs = []
        for i, h in enumerate(self.search.finished):
            text = self.detokenizer.decode(h.token_ids)
            outputs.append(CompletionOutput(i, text, list(h.token_ids), h.finish_reason, None, h.cum_logprob))
        self.metrics.finished_time = time.monotonic()
        self.metrics.num_output_tokens = max((len(o.token_ids) for o in outputs), default=0)
        metrics = dataclasses.replace(self.metrics)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, True, metrics,
                             None, self.num_cached_tokens)  # fmt: skip

    def _ready(self, beam: Sequence, computed: dict[int, int]) -> bool:
        """Its candidates are known and still hold: it has not been preempted to recompute since,
        and once this step's tokens are computed it has nothing left to compute."""
        return (
            beam.seq_id in self._candidates
            and beam.status is SequenceStatus.RUNNING
            and beam.num_computed_tokens + computed.get(beam.seq_id, 0) == beam.num_tokens
        )

    # -- a step is a transaction: the ranking state, the scores and the candidates ----------------
    def begin(self) -> None:
        super().begin()
        search = self.search
        self._saved_search = (self.cum_logprobs, self._candidates.copy(), search.num_generated,
                              list(search.finished), search.improvable, search.done)  # fmt: skip

    def commit(self) -> None:
        super().commit()
        self._saved_search = None

    def rollback(self) -> None:
        super().rollback()
        if self._saved_search is not None:
            search = self.search
            (self.cum_logprobs, self._candidates, search.num_generated, search.finished,
             search.improvable, search.done) = self._saved_search  # fmt: skip
        self._saved_search = None


def check_beams_fit(cache: KVCacheManager, request_id: str, seq: Sequence, width: int) -> None:
    """Beams wait for each other at every step, so all of them must fit at once even unshared
    (each with one spare block); otherwise a beam could wait forever for memory its siblings hold."""
    needed = width * (cdiv(seq.max_total_tokens, cache.block_size) + 1)
    available = cache.num_blocks - cache.watermark_blocks
    if needed > available:
        raise ValueError(
            f"request {request_id!r}: {width} beams of up to {seq.max_total_tokens} tokens may need "
            f"{needed} blocks, more than the {available} the cache can give; "
            "lower beam_width or max_tokens, or give the cache more blocks"
        )
