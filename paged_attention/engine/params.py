"""What a request asks for: vLLM's ``SamplingParams`` and ``BeamSearchParams``, checked at the door.

The names, defaults and rules are vLLM's, so that code written for vLLM runs here; every bad value
raises a ``TypeError``/``ValueError`` naming the field and what is allowed. What the fields *do*
lives where it happens: the sampler (:mod:`.sampling`, :mod:`.logits`, :mod:`.logprobs`), the stop
rules (:mod:`.stop_rules`) and the detokenizer (:mod:`.detokenizer`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from .structured_output.params import StructuredOutputsParams

_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2  # vLLM raises a temperature in (0, 0.01) to 0.01 (smaller ones overflow)


class RequestOutputKind(enum.Enum):
    """What ``LLMEngine.step()`` reports for a request (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = 0  # every step that adds tokens: all the text and tokens so far
    DELTA = 1  # every step that adds tokens: only what this step added
    FINAL_ONLY = 2  # once, when the request ends (what ``LLM.generate`` asks for)


SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts: [low, high)

#: The processing fields and their neutral values: a request that keeps them all pays nothing.
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _token_ids(name: str, value: object) -> list[int] | None:
    """``None``, or a list of token ids (ints >= 0)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or any(not _is_int(t) or t < 0 for t in value):
        raise TypeError(f"{name} must be a list of token ids (ints >= 0) or None, got {value!r}")
    return list(value)


@dataclass
class SamplingParams:
    """How to sample one request's output tokens (vLLM's ``SamplingParams``; the subset of its fields
    that mean something for one device's offline text generation).

    Choosing a token, in vLLM v1's order (:mod:`.logits`, then :class:`~.sampling.Sampler`):

    * ``allowed_token_ids``: only these may be produced; ``bad_words``: words (strings) whose
      last token is banned wherever the output already ends with the word's other tokens;
      ``logit_bias``: ``{token_id: bias}`` added to the logits; before ``min_tokens`` outputs the
      stop tokens are banned;
    * ``repetition_penalty`` (> 0, 1 = off): a token already in the prompt or the output has its
      logit divided by it if positive, multiplied if negative (transformers' and vLLM's rule);
      ``frequency_penalty`` / ``presence_penalty`` (in [-2, 2], 0 = off): minus ``frequency x count``
      and ``presence x (count > 0)`` for tokens in the *output* (OpenAI's definition);
    * ``temperature``: 0 means greedy (argmax of the processed logits); higher flattens;
      then ``min_p`` (drop tokens below ``min_p`` x the most likely), ``top_k`` (keep ``k``; 0 or -1
      keeps all) and ``top_p`` (the smallest set whose probability adds up to ``top_p``);
    * ``n``: samples per prompt; ``seed``: per-request random seed (sample ``i`` draws from ``seed + i``);
      ``best_of`` (vLLM v0's; v1 dropped it): draw that many samples, report the ``n`` whose
      ``cumulative_logprob`` is highest.

    What is reported: ``logprobs`` (``k``: the ``k`` most likely tokens at each output position,
    plus the sampled one; 0: only the sampled one; -1: the whole vocabulary), ``prompt_logprobs``
    (the same for every prompt token after the first), from the raw logits unless the engine's
    ``logprobs_mode`` says ``"processed_logprobs"``; ``detokenize`` (false: token ids only, no
    text); ``skip_special_tokens``; ``output_kind`` (:class:`RequestOutputKind`).

    When it ends: ``max_tokens`` / ``min_tokens``; ``stop_token_ids`` and EOS (unless
    ``ignore_eos``); ``stop`` strings (the text is cut where one starts). A stop string's or stop
    token's text is left out of the output unless ``include_stop_str_in_output`` (vLLM v1's rule).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: What the output must match (a JSON schema, regex, choice or grammar): :mod:`.structured_output`.
    structured_outputs: StructuredOutputsParams | None = None
    #: vLLM's fields for features this engine does not have: accepted at their neutral value only.
    watermarking: bool | None = None
    thinking_token_budget: int | None = None
    #: Free-form arguments for custom logits processors (vLLM's ``extra_args``): kept, not read.
    extra_args: dict[str, Any] | None = None
    stop_strings: list[str] = field(init=False, repr=False)
    #: ``bad_words`` as token-id sequences, set by the engine from its tokenizer (``[]`` until then).
    bad_words_token_ids: list[list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._normalise()
        self._check_numbers()
        self._check_flags()
        if self.greedy:  # after the checks, as vLLM: a greedy request's filters cannot change its argmax
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        stop = self.stop
        if not (stop is None or isinstance(stop, (str, list, tuple))):
            raise TypeError(f"stop must be a string, a list of strings or None, got {type(stop).__name__}")
        self.stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise TypeError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        self.stop = list(self.stop_strings)  # vLLM keeps a list, [] for none
        if self.stop_strings and not self.detokenize:
            raise ValueError("stop strings need text: they are only supported with detokenize=True")
        self.stop_token_ids = list(dict.fromkeys(_token_ids("stop_token_ids", self.stop_token_ids) or []))
        self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        words = self.bad_words
        if words is not None and (
            not isinstance(words, (list, tuple)) or any(not isinstance(w, str) or not w for w in words)
        ):
            raise TypeError(f"bad_words must be a list of non-empty strings or None, got {words!r}")
        self.bad_words = list(dict.fromkeys(words or []))
        self.bad_words_token_ids = []
        self.logit_bias = self._checked_bias(self.logit_bias)

    def _normalise(self) -> None:
        """vLLM's conveniences, applied before the checks: ``seed=-1`` means none, ``logprobs=True``
        means 1, a temperature in (0, 0.01) is raised to 0.01 (so only 0 is greedy; a greedy request
        then drops its filters, top-p 1, top-k 0, min-p 0, once they are checked)."""
        if self.seed == -1 and not isinstance(self.seed, bool):
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:
                setattr(self, name, 1)
        t = self.temperature
        if _is_number(t) and 0 < t < _MIN_TEMPERATURE:
            warnings.warn(f"temperature {t} is below {_MIN_TEMPERATURE} and may overflow; it is raised to "
                          f"{_MIN_TEMPERATURE} (as vLLM does)", stacklevel=4)  # fmt: skip
            self.temperature = _MIN_TEMPERATURE
        for name in ("watermarking", "thinking_token_budget"):
            neutral = getattr(self, name) is None or (name == "watermarking" and self.watermarking is False)
            if not neutral:
                raise ValueError(f"{name} is a vLLM feature this engine does not have: only None is accepted")
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise TypeError(
                    f"structured_outputs must be a StructuredOutputsParams or None, got {type(so).__name__}"
                )
            self.structured_outputs = dataclasses.replace(so)  # checked again, and ours
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise TypeError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")

    def __repr__(self) -> str:
        """vLLM's text, field for field (``best_of``, which v1 does not have, only when set)."""
        names = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                 "watermarking", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "bad_words",
                 "thinking_token_budget", "include_stop_str_in_output", "ignore_eos", "max_tokens",
                 "min_tokens", "logprobs", "prompt_logprobs", "skip_special_tokens",
                 "spaces_between_special_tokens", "structured_outputs", "extra_args")  # fmt: skip
        fields = [f"{name}={getattr(self, name)}" for name in names]
        if self.best_of is not None:
            fields.insert(1, f"best_of={self.best_of}")
        return f"SamplingParams({', '.join(fields)})"

    def clone(self) -> SamplingParams:
        """A checked copy: every field validated again (after any change made to this object since
        it was built), and later changes to this object do not reach the copy. The engine keeps a
        clone of what it is given."""
        return dataclasses.replace(self)

    def _check_numbers(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an int, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", *NEUTRAL):
            if not _is_number(getattr(self, name)):
                raise TypeError(f"{name} must be a number, got {getattr(self, name)!r}")
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of is not None:
            if not _is_int(self.best_of):
                raise TypeError(f"best_of must be an int or None, got {self.best_of!r}")
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n={self.n}, got {self.best_of}")
            if self.best_of > 1 and self.temperature < _EPS:
                raise ValueError(
                    "best_of > 1 draws several samples: it needs temperature > 0 (greedy gives one)"
                )
            if self.best_of > self.n and self.output_kind is RequestOutputKind.DELTA:
                raise ValueError(
                    "best_of > n chooses its n samples as they go: it cannot stream DELTA outputs"
                )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (all tokens) or a positive int, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 means none), got {self.repetition_penalty}")
        if self.max_tokens is not None:
            if not _is_int(self.max_tokens):
                raise TypeError(f"max_tokens must be an int or None, got {self.max_tokens!r}")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise TypeError(f"{name} must be an int or None, got {value!r}")
            if value is not None and value < -1:
                raise ValueError(f"{name} must be >= 0, or -1 for the whole vocabulary, got {value}")
        if self.seed is not None:
            if not _is_int(self.seed):
                raise TypeError(f"seed must be an int or None, got {self.seed!r}")
            # Sample i draws from torch.Generator().manual_seed(seed + i), which takes [-2**63, 2**64).
            low, high = SEED_RANGE
            width = self.num_samples
            if not low <= self.seed <= high - width:
                raise ValueError(
                    f"seed must be in [{low}, {high - width}] so that every sample's seed, seed + i for "
                    f"i < {'n' if self.best_of is None else 'best_of'}={width}, fits a torch.Generator "
                    f"([{low}, {high - 1}]); got {self.seed}"
                )

    def _check_flags(self) -> None:
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @staticmethod
    def _checked_bias(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise TypeError(
                f"logit_bias must be a dict {{token_id: bias}} or None, not {type(bias).__name__}"
            )
        checked = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.isdigit() else key  # JSON keys are strings
            if not _is_int(token) or token < 0 or not _is_number(value) or not math.isfinite(value):
                raise TypeError(
                    f"logit_bias must map token ids (ints >= 0) to finite numbers, got {key!r}: {value!r}"
                )
            checked[token] = float(value)
        return checked

    @property
    def num_samples(self) -> int:
        """How many samples are drawn: ``best_of`` if set, else ``n``."""
        return self.best_of or self.n

    @property
    def tracks_logprob(self) -> bool:
        """Does the sampler compute its tokens' log-probabilities: for ``logprobs`` (which also makes
        ``cumulative_logprob`` a number, vLLM v1's rule), or for ``best_of`` to rank samples by?"""
        return self.logprobs is not None or self.num_samples > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def penalized(self) -> bool:
        """Does any penalty change the logits (so that the sampler must count past tokens)?"""
        return any(getattr(self, name) != value for name, value in NEUTRAL.items())


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
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.temperature != 0:
            raise ValueError(
                f"beam search here is deterministic: temperature must be 0.0, got {self.temperature}"
            )
