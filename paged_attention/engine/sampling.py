"""Sampling: how each request turns its next-token logits into a token, batched.

The :class:`Sampler` handles a whole step at once: one row of logits per sequence, each row with
its own settings (:class:`~.params.SamplingParams`, re-exported here): first the logits processing
of :mod:`.logits` (allowed tokens, bad words, bias, penalties), then greedy argmax, or temperature,
min-p, top-k and top-p and a draw. It also reports each drawn token's log-probability
(:mod:`.logprobs`).

Reproducibility is per request, not per batch: a request with a ``seed`` owns a
``torch.Generator`` seeded once, and draws exactly one random number per generated token from it.
Which other requests share the batch, how the scheduler packs them, and whether the request was
preempted and recomputed change nothing about its random draws. With ``n`` samples, sample ``i``
draws from its own generator seeded ``seed + i``, so it equals a lone request with seed ``seed + i``
(the samples share their prompt's KV blocks, which changes memory, not tokens). Requests without
a seed draw from one engine-wide generator seeded by ``LLMEngine(seed=0)``, so they are reproducible
only as a whole run. (vLLM v1 also seeds its global generator with 0 by default; v0 left it unseeded,
so its unseeded samples differed from run to run.)

One caveat belongs to floating point, not to this design: a batch of another shape rounds the
model's matrix products differently (in float32, about one part in a million), and a sampled token
can move when its draw falls right on a boundary between two tokens. Tests that compare samples
across batches run the model in float64; bit-identical results in float32 need batch-invariant
kernels.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .logits import History, needs_history, process
from .logprobs import LOGPROBS_MODES
from .logprobs import entries as logprob_entries
from .params import SEED_RANGE, BeamSearchParams, RequestOutputKind, SamplingParams
from .sequence import Sequence as Seq
from .step import DrawnLogprob

__all__ = ["SEED_RANGE", "BeamSearchParams", "RequestOutputKind", "Sampler", "SamplerOutput",
           "SamplingParams", "sample_generator", "seed_everything"]  # fmt: skip


@dataclass
class SamplerOutput:
    """One step's draws: a token per row, its log-probability (in the engine's ``logprobs_mode``),
    and for the rows whose request asked for ``logprobs``, the whole distribution (``[vocab]``
    log-probabilities) their top tokens are read from."""

    tokens: list[int]
    logprobs: list[float]
    distributions: dict[int, torch.Tensor] = field(default_factory=dict)


def sample_generator(params: SamplingParams, sample_index: int) -> torch.Generator | None:
    """Sample ``i`` of a seeded request draws from its own generator, seeded ``seed + i``."""
    if params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed + sample_index)


class Sampler:
    """Turns one step's logits ``[num_seqs, vocab]`` into one token per row."""

    def __init__(self, seed: int | None = 0, logprobs_mode: str = "raw_logprobs") -> None:
        """``seed``: of the generator that requests without their own seed share (``None``: a
        random one, so that such runs differ, as vLLM's ``seed=None``). ``logprobs_mode``: which
        distribution the reported log-probabilities come from (:mod:`.logprobs`)."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.shared_generator = torch.Generator()
        if seed is None:
            self.shared_generator.seed()
        else:
            self.shared_generator.manual_seed(seed)
        self._saved: dict[int, tuple[torch.Generator, torch.Tensor]] | None = None

    # -- a step is a transaction (:mod:`.transaction`): the generators it draws from -------------
    def begin(self) -> None:
        """Generators are saved when first drawn from in the step (its own and the sequences'),
        O(draws), not O(seeded sequences held)."""
        self._saved = {}

    def commit(self) -> None:
        self._saved = None

    def rollback(self) -> None:
        for generator, state in (self._saved or {}).values():
            generator.set_state(state)
        self._saved = None

    def _draw_from(self, generator: torch.Generator) -> torch.Generator:
        if self._saved is not None and id(generator) not in self._saved:
            self._saved[id(generator)] = (generator, generator.get_state())
        return generator

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        banned: Sequence[Sequence[int]] | None = None,
        histories: Sequence[History | None] | None = None,
    ) -> SamplerOutput:
        """Draw a token per row. ``banned[i]``: ids row ``i`` may not produce (min_tokens);
        ``histories[i]``: its past tokens, for penalties and bad words (:mod:`.logits`)."""
        raw = logits.to("cpu", torch.float32)
        work = process(raw.clone(), params, banned, histories)  # a copy: the raw logits stay
        tokens = work.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        probs = None
        if sampled_rows:
            probs = self._probabilities(work[sampled_rows], [params[i] for i in sampled_rows])
            for j, row in enumerate(sampled_rows):
                generator = self._draw_from(generators[row] or self.shared_generator)
                # Inverse-CDF sampling with one uniform draw per token: a request's stream of draws
                # depends on nothing but its own generator.
                u = torch.rand((), generator=generator)
                cdf = probs[j].cumsum(0)
                tokens[row] = torch.searchsorted(cdf, u * cdf[-1]).clamp(max=cdf.numel() - 1)
        if self.logprobs_mode == "raw_logprobs":
            chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1) - raw.logsumexp(dim=-1)
            wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
            distributions = dict(zip(wanted, raw[wanted].log_softmax(dim=-1), strict=True))
        else:  # the distribution each token was drawn from: filtered, after temperature
            processed = work.log_softmax(dim=-1)
            if probs is not None:
                processed[sampled_rows] = (probs / probs.sum(dim=-1, keepdim=True)).log()
            chosen = processed.gather(1, tokens.unsqueeze(1)).squeeze(1)
            distributions = {i: processed[i] for i, p in enumerate(params) if p.logprobs is not None}
        return SamplerOutput(tokens.tolist(), chosen.tolist(), distributions)

    def targets(
        self, logits: torch.Tensor, seqs: Sequence[Seq], banned: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What speculative decoding verifies drafts against, row by row (:mod:`.speculation`):
        the raw logits (float32), the processed ones (logits processing applied, as :meth:`draw`
        does; their argmax is the greedy token) and, if the rows sample, the weights drawn from
        (temperature, min-p, top-k, top-p applied; rows need not sum to 1, as in :meth:`__call__`).
        All rows share one sequence's settings; row ``i`` sees ``seqs[i]``'s history."""
        raw = logits.to("cpu", torch.float32)
        params = [s.params for s in seqs]
        histories = [History(s.prompt_token_ids, s.output_token_ids) if needs_history(s.params) else None
                     for s in seqs]  # fmt: skip
        work = process(raw.clone(), params, banned, histories)
        if params[0].greedy:
            return raw, work, None
        return raw, work, self._probabilities(work, params)

    def draw_from_row(self, weights: torch.Tensor, generator: torch.Generator) -> int:
        """One token from a row of weights with one uniform draw, exactly as :meth:`__call__` draws
        (inverse CDF), so that a request's stream of draws is the same with or without drafts."""
        u = torch.rand((), generator=generator)
        cdf = weights.cumsum(0)
        return int(torch.searchsorted(cdf, u * cdf[-1]).clamp(max=cdf.numel() - 1))

    def generator_of(self, seq: Seq) -> torch.Generator:
        """The generator ``seq`` draws from (its own if seeded, else the shared one), saved for the
        step's rollback before any draw."""
        return self._draw_from(seq.generator or self.shared_generator)

    def draw(
        self,
        logits: torch.Tensor,
        seqs: Sequence[Seq],
        banned: Sequence[Sequence[int]],
        decode: Callable[[int], str],
    ) -> tuple[list[int], list[DrawnLogprob]]:
        """One token per sequence from its row of ``logits`` (its settings, its generator, its past
        tokens where penalties or bad words need them), with each token's log-probability and, if
        its request asked for ``logprobs``, its entry (``decode``: a token's text)."""
        histories = [History(s.prompt_token_ids, s.output_token_ids) if needs_history(s.params) else None
                     for s in seqs]  # fmt: skip
        out = self(logits, [s.params for s in seqs], [s.generator for s in seqs], banned, histories)
        drawn = []
        for i, (seq, token) in enumerate(zip(seqs, out.tokens, strict=True)):
            entry = None
            if i in out.distributions:
                text = decode if seq.params.detokenize else None
                row, k = out.distributions[i].unsqueeze(0), seq.params.logprobs or 0
                entry = logprob_entries(row, torch.tensor([token]), k, text)[0]
            drawn.append(DrawnLogprob(out.logprobs[i], entry))
        return out.tokens, drawn

    @staticmethod
    def _probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Temperature, then min-p, then top-k, then top-p (vLLM v1's order); rows need not sum to 1."""
        temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        probs = (logits / temperature).softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        vocab = probs.shape[1]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
        sorted_probs = sorted_probs.masked_fill(torch.arange(vocab).unsqueeze(0) >= top_k, 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
        # Keep a token if the mass strictly before it is < top_p (so the most likely token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (vLLM's ``set_random_seed``), so that a
    program's own random draws after building an engine repeat from run to run too."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        pass
