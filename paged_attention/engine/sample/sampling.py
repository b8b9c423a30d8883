"""Sampling: how each request turns its next-token logits into a token, batched.

The :class:`Sampler` handles a whole step at once: one row of logits per sequence, each row with
its own settings (:class:`~.params.SamplingParams`, re-exported here): first the logits processing
of :mod:`.logits` (allowed tokens, bad words, bias, penalties), then greedy argmax, or temperature,
min-p, top-k and top-p and a draw. It also reports each drawn token's log-probability
(:mod:`.logprobs`) when its request reports them (``logprobs`` set, or ``best_of`` to choose by).

The draw is vLLM's CPU sampler's (:mod:`.gumbel`): the filtered logits plus Gumbel noise hashed
from one 31-bit seed, argmax. So a seeded request draws the very tokens vLLM draws for it, given the
same logits (``make crosscheck`` compares them with the real vLLM).

Reproducibility is per request, not per batch: a request with a ``seed`` owns a
``torch.Generator`` seeded once, and draws exactly one random number (the noise's seed) per
generated token from it. Which other requests share the batch, how the scheduler packs them, and
whether the request was preempted and recomputed change nothing about its random draws. With
``n`` samples, sample ``i`` draws from its own generator seeded ``seed + i``, so it equals a lone
request with seed ``seed + i`` (the samples share their prompt's KV blocks, which changes memory,
not tokens). Requests without a seed draw from one engine-wide generator seeded by
``LLMEngine(seed=0)``, so they are reproducible only as a whole run. (vLLM v1 also seeds its global
generator with 0 by default; v0 left it unseeded, so its unseeded samples differed from run to run.)

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

from ...kernels.rows import greedy_argmax
from ..core.step import DrawnLogprob
from ..params import SEED_RANGE, BeamSearchParams, RequestOutputKind, SamplingParams
from ..sequence import Sequence as Seq
from .gumbel import draw_seed, gumbel_argmax
from .logits import History, changes, needs_history, process
from .logprobs import LOGPROBS_MODES
from .logprobs import entries as logprob_entries

__all__ = ["SEED_RANGE", "BeamSearchParams", "RequestOutputKind", "Sampler", "SamplerOutput",
           "SamplingParams", "sample_generator", "seed_everything"]  # fmt: skip


@dataclass
class SamplerOutput:
    """One step's draws: a token per row, its log-probability (in the engine's ``logprobs_mode``),
    and for the rows whose request asked for ``logprobs``, the whole distribution (``[vocab]``
    log-probabilities) their top tokens are read from."""

    tokens: list[int]
    logprobs: list[float | None]  # None where the row's request reports no log-probabilities
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
        masks: Sequence[torch.Tensor | None] | None = None,
    ) -> SamplerOutput:
        """Draw a token per row. ``banned[i]``: ids row ``i`` may not produce (min_tokens);
        ``histories[i]``: its past tokens, for penalties and bad words; ``masks[i]``: the tokens its
        grammar allows (:mod:`.logits`). Log-probabilities are computed only for the rows whose
        request reports them."""
        masks = masks if masks is not None and any(m is not None for m in masks) else None
        if (
            masks is None
            and all(p.greedy and not p.tracks_logprob for p in params)
            and not any(changes(p, banned[i] if banned is not None else ()) for i, p in enumerate(params))
        ):  # plain greedy rows: the argmax of the logits as they are (no float32 copy)
            return SamplerOutput(greedy_argmax(logits.cpu()).tolist(), [None] * len(params), {})
        raw = logits.to("cpu", torch.float32)
        tracked = [i for i, p in enumerate(params) if p.tracks_logprob]
        keep_raw = raw is logits or (tracked and self.logprobs_mode == "raw_logprobs")
        work = process(raw.clone() if keep_raw else raw, params, banned, histories, masks)
        tokens = work.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        scores = None
        if sampled_rows:
            scores = filtered_scores(work[sampled_rows], [params[i] for i in sampled_rows])
            seeds = [draw_seed(self._draw_from(generators[i] or self.shared_generator)) for i in sampled_rows]
            tokens[sampled_rows] = gumbel_argmax(scores, torch.tensor(seeds, dtype=torch.int64))
        chosen: list[float | None] = [None] * len(params)
        distributions: dict[int, torch.Tensor] = {}
        if tracked:
            if self.logprobs_mode == "raw_logprobs":
                table = raw[tracked].log_softmax(dim=-1)
            else:  # the distribution each token was drawn from: processed, filtered, after temperature
                position = {row: j for j, row in enumerate(sampled_rows)}
                assert scores is not None or not position
                rows = [scores[position[i]] if i in position else work[i] for i in tracked]  # type: ignore[index]
                table = torch.stack(rows).log_softmax(dim=-1)
            values = table.gather(1, tokens[tracked].unsqueeze(1)).squeeze(1).tolist()
            for j, i in enumerate(tracked):
                chosen[i] = values[j]
                if params[i].logprobs is not None:
                    distributions[i] = table[j]
        return SamplerOutput(tokens.tolist(), chosen, distributions)

    def targets(
        self,
        logits: torch.Tensor,
        seqs: Sequence[Seq],
        banned: Sequence[Sequence[int]],
        masks: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What speculative decoding verifies drafts against, row by row (:mod:`.speculation`):
        the raw logits (float32), the processed ones (logits processing applied, as :meth:`draw`
        does; their argmax is the greedy token) and, if the rows sample, the scores drawn from
        (:func:`filtered_scores`: temperature, min-p, top-k, top-p applied).
        All rows share one sequence's settings; row ``i`` sees ``seqs[i]``'s history and grammar
        mask ``masks[i]``."""
        raw = logits.to("cpu", torch.float32)
        params = [s.params for s in seqs]
        histories = [History(s.prompt_token_ids, s.output_token_ids) if needs_history(s.params) else None
                     for s in seqs]  # fmt: skip
        work = process(raw.clone(), params, banned, histories, masks)
        if params[0].greedy:
            return raw, work, None
        return raw, work, filtered_scores(work.clone(), params)

    def draw_from_row(self, scores: torch.Tensor, generator: torch.Generator) -> int:
        """One token from a row of :func:`filtered_scores` with one seed drawn from ``generator``,
        exactly as :meth:`__call__` draws, so that a request's stream of draws is the same with or
        without drafts."""
        seed = torch.tensor([draw_seed(self._draw_from(generator))], dtype=torch.int64)
        return int(gumbel_argmax(scores.unsqueeze(0), seed)[0])

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
        masks = [s.grammar.mask(s.output_token_ids) if s.grammar is not None else None for s in seqs]
        out = self(logits, [s.params for s in seqs], [s.generator for s in seqs], banned, histories, masks)
        drawn = []
        for i, (seq, token) in enumerate(zip(seqs, out.tokens, strict=True)):
            entry = None
            if i in out.distributions:
                text = decode if seq.params.detokenize else None
                row, k = out.distributions[i].unsqueeze(0), seq.params.logprobs or 0
                entry = logprob_entries(row, torch.tensor([token]), k, text)[0]
            drawn.append(DrawnLogprob(out.logprobs[i], entry))
        return out.tokens, drawn


def filtered_scores(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The logits a sampled row draws from, vLLM v1's way (in place on ``logits`` ``[rows, vocab]``,
    float32, returned): divided by the temperature, then min-p, top-k and top-p set the tokens they
    drop to ``-inf``. The draw is a softmax of what is left (:func:`.gumbel.gumbel_argmax`).

    * min-p drops a token whose probability is below ``min_p`` x the largest;
    * top-k keeps the tokens at least as large as the ``k``-th largest logit (ties all stay);
    * top-p sorts the logits ascending and drops a token while the probability of it and every
      smaller one adds up to at most ``1 - top_p``: what is kept is the smallest set of the most
      likely tokens whose mass exceeds ``top_p`` less those below, and never nothing.
    """
    vocab = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    logits.div_(temperature.unsqueeze(1))
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * torch.tensor([p.min_p for p in params]).unsqueeze(1)
        logits.masked_fill_(probs < floor, float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if all(p == 1.0 for p in top_p):
        if all(k == vocab for k in top_k):
            return logits
        # Top-k alone: the k-th largest logit of each row is its threshold (no sort of the vocabulary).
        k = torch.tensor(top_k)
        threshold = logits.topk(int(k.max()), dim=1).values.gather(1, (k - 1).unsqueeze(1))
        threshold.masked_fill_((k == vocab).unsqueeze(1), float("-inf"))
        return logits.masked_fill_(logits < threshold, float("-inf"))
    ascending, order = logits.sort(dim=-1)
    if any(k < vocab for k in top_k):
        threshold = ascending.gather(1, (vocab - torch.tensor(top_k)).unsqueeze(1))
        ascending.masked_fill_(ascending < threshold, float("-inf"))
    mass = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = mass <= 1 - torch.tensor(top_p, dtype=torch.float32).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    ascending.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, order, ascending)


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
