"""Sampling: how each request turns its next-token logits into a token, batched.

:class:`SamplingParams` follows vLLM's names and rules, so code written for vLLM runs here. The
:class:`Sampler` handles a whole step at once: one row of logits per sequence, each row with its
own temperature, top-k, top-p and min-p.

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

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What ``LLMEngine.step()`` reports for a request (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = 0  # every step that adds tokens: all the text and tokens so far
    DELTA = 1  # every step that adds tokens: only what this step added
    FINAL_ONLY = 2  # once, when the request ends (what ``LLM.generate`` asks for)


SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts: [low, high)


@dataclass
class SamplingParams:
    """How to sample one request's output tokens (vLLM-compatible subset).

    * ``n``: samples per prompt (parallel sampling); with a ``seed``, sample ``i`` draws from ``seed + i``.
    * ``temperature``: 0 means greedy (argmax); higher flattens the distribution.
    * ``top_p``: keep the smallest set of tokens whose probability adds up to ``top_p`` (0, 1].
    * ``top_k``: keep the ``k`` most likely tokens; 0 or -1 keeps all (vLLM's convention).
    * ``min_p``: drop tokens less likely than ``min_p`` times the most likely one.
    * ``max_tokens`` / ``min_tokens``: output length bounds; before ``min_tokens`` the stop tokens
      cannot end the request.
    * ``seed``: per-request random seed (see the module docstring).
    * ``stop_token_ids``: extra token ids that end the request; ``ignore_eos`` keeps going past EOS.
    * ``stop``: strings that end the request when they appear in its text (the text is cut there).
    * ``output_kind``: what ``LLMEngine.step()`` streams (:class:`RequestOutputKind`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_numbers()
        stop = self.stop
        if not (stop is None or isinstance(stop, (str, list, tuple))):
            raise TypeError(f"stop must be a string, a list of strings or None, got {type(stop).__name__}")
        self.stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise TypeError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        ids = self.stop_token_ids
        if not (ids is None or isinstance(ids, (list, tuple))):
            raise TypeError(f"stop_token_ids must be a list of token ids (ints >= 0) or None, got {ids!r}")
        self.stop_token_ids = list(ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise TypeError(f"stop_token_ids must be a list of token ids (ints >= 0), got {ids!r}")

    def clone(self) -> SamplingParams:
        """A checked copy: every field validated again (after any change made to this object since
        it was built), and later changes to this object do not reach the copy. The engine keeps a
        clone of what it is given."""
        return dataclasses.replace(self)

    def _check_numbers(self) -> None:
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_number(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        for name in ("n", "top_k", "min_tokens"):
            if not is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an int, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p"):
            if not is_number(getattr(self, name)):
                raise TypeError(f"{name} must be a number, got {getattr(self, name)!r}")
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (all tokens) or a positive int, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            if not is_int(self.max_tokens):
                raise TypeError(f"max_tokens must be an int or None, got {self.max_tokens!r}")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
        if self.seed is not None:
            if not is_int(self.seed):
                raise TypeError(f"seed must be an int or None, got {self.seed!r}")
            # Sample i draws from torch.Generator().manual_seed(seed + i), which takes [-2**63, 2**64).
            low, high = SEED_RANGE
            if not low <= self.seed <= high - self.n:
                raise ValueError(
                    f"seed must be in [{low}, {high - self.n}] so that every sample's seed, seed + i for "
                    f"i < n={self.n}, fits a torch.Generator ([{low}, {high - 1}]); got {self.seed}"
                )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS


@dataclass(frozen=True)
class BeamSearchParams:
    """How to run a beam search (vLLM's ``BeamSearchParams``; see :mod:`paged_attention.engine.beam_search`).

    * ``beam_width``: how many partial sequences (beams) are kept at each step.
    * ``max_tokens``: the most tokens a beam may generate.
    * ``ignore_eos``: if true, EOS does not end a beam.
    * ``length_penalty``: a finished beam scores ``cumulative logprob / generated_length ** length_penalty``
      (transformers' rule); above 0 favours longer outputs, 0 compares raw log-probabilities.
    * ``temperature``: accepted for vLLM compatibility; beam search here is deterministic, so it
      must be 0.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.temperature != 0:
            raise ValueError(
                f"beam search here is deterministic: temperature must be 0.0, got {self.temperature}"
            )


def sample_generator(params: SamplingParams, sample_index: int) -> torch.Generator | None:
    """Sample ``i`` of a seeded request draws from its own generator, seeded ``seed + i``."""
    if params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed + sample_index)


class Sampler:
    """Turns one step's logits ``[num_seqs, vocab]`` into one token per row."""

    def __init__(self, seed: int = 0) -> None:
        self.shared_generator = torch.Generator().manual_seed(seed)
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
    ) -> list[int]:
        """Sample a token per row. ``banned[i]`` are token ids row ``i`` may not produce (min_tokens)."""
        logits = logits.to("cpu", torch.float32).clone()  # a normal tensor: we edit it in place
        if banned is not None:
            for row, ids in enumerate(banned):
                if ids:
                    logits[row, list(ids)] = float("-inf")
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            probs = self._probabilities(logits[sampled_rows], [params[i] for i in sampled_rows])
            for j, row in enumerate(sampled_rows):
                generator = self._draw_from(generators[row] or self.shared_generator)
                # Inverse-CDF sampling with one uniform draw per token: a request's stream of draws
                # depends on nothing but its own generator.
                u = torch.rand((), generator=generator)
                cdf = probs[j].cumsum(0)
                tokens[row] = torch.searchsorted(cdf, u * cdf[-1]).clamp(max=cdf.numel() - 1)
        return tokens.tolist()

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
