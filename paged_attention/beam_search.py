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

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from .sampling import BeamSearchParams


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

    The engine calls :meth:`step` with each live beam's best next tokens and gets back the next
    beams as :class:`Continuation` s; turning those into forked and freed page tables is the
    engine's job.
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
        cum_logprobs: Sequence[float],
        candidates: Sequence[tuple[torch.Tensor, torch.Tensor]],
        outputs: Sequence[Sequence[int]],
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
