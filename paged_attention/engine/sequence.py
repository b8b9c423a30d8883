"""A sequence: one prompt and the tokens generated for it so far, plus where it is in its life.

A request starts as one sequence. With ``n`` samples (or a beam search) it *forks* into more after
its prompt is computed: the children share the parent's KV blocks (see
:mod:`paged_attention.memory.page_table`). Each sequence moves through

    WAITING --admitted--> RUNNING --finished--> FINISHED (stop token | length | stop string | aborted)
                  ^            |
                  +-preempted--+   (PREEMPTED: recompute later, or SWAPPED: its pages wait in CPU memory)

The scheduler moves it and alone finishes it (:meth:`Scheduler.update_from_output
<.scheduler.Scheduler.update_from_output>`, :meth:`Scheduler.finish <.scheduler.Scheduler.finish>`);
the cache manager owns its pages (the sequence only knows how many of its tokens are in the
cache, ``num_computed_tokens``). Chunked prefill is simply a sequence whose
``num_computed_tokens`` is still below ``len(prompt)`` after a step, and a prefix-cache hit is a
sequence admitted with ``num_computed_tokens`` already above zero.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from .params import SamplingParams

if TYPE_CHECKING:  # the bookkeeping here needs no torch (the lab's scheduling exercise runs without it)
    import torch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # pages freed; will recompute its tokens when readmitted
    SWAPPED = "swapped"  # pages copied to CPU memory; will copy them back when readmitted
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a sequence ended (``.value`` is what vLLM reports: ``"stop"``, ``"length"``, ``"abort"``)."""

    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens reached, or the model's maximum length
    ABORTED = "abort"


@dataclass(eq=False)  # identity, not field-by-field equality: queues look sequences up with `in`
class Sequence:
    """The state of one sequence; ``tokens`` is the prompt followed by the output so far."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    sample_index: int = 0
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    finish_time: float | None = None
    output_text: str = ""  # decoded up to read_offset (:mod:`.detokenizer`)
    prefix_offset: int = 0  # the detokenizer's window into output_token_ids starts here
    read_offset: int = 0  # output tokens already in output_text
    # -- what is reported beside the tokens (:mod:`.logprobs`) --
    cumulative_logprob: float = 0.0  # the sum of its output tokens' log-probabilities, if tracked
    logprobs: list[dict] = field(default_factory=list)  # one entry per output token, if asked for
    prompt_logprobs: list[dict] = field(default_factory=list)  # prompt tokens 1.., if asked for
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache when first admitted
    # -- sharing (prefix caching, parallel sampling, beam search) --
    cache_salt: str | None = None  # extra key of the first block's hash: only equal salts share a cache
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of its full blocks (prefix_cache.py)
    group_id: int = -1  # the request's first sequence id, shared by its forks (-1: its own seq_id)
    pending_forks: int = 0  # children it will fork into after prefill (n - 1, or beam_width - 1)
    # -- speculative decoding: tokens guessed to follow its last one, verified in its next step --
    draft_token_ids: list[int] = field(default_factory=list)  # replaced, never appended to
    # -- structured outputs: its grammar's matcher, in step with output_token_ids (structured_output/) --
    grammar: Any = None
    _saved: tuple | None = field(default=None, init=False, repr=False)  # the open step's undo

    #: What a step may change, and how a rollback puts it back: values are restored, the
    #: append-only lists cut back to their length. Every other field is fixed for the sequence's
    #: life; its generator's state is the sampler's to restore (it saves what it draws from).
    #: ``tests/test_rollback_state.py`` checks that the three lists name every field.
    MUTABLE = ("status", "finish_reason", "stop_reason", "num_computed_tokens", "num_preemptions",
               "finish_time", "output_text", "prefix_offset", "read_offset", "pending_forks",
               "cumulative_logprob", "num_cached_tokens", "draft_token_ids")  # fmt: skip
    APPEND_ONLY = ("output_token_ids", "block_hashes", "logprobs", "prompt_logprobs")
    FIXED = ("seq_id", "request_id", "prompt_token_ids", "params", "arrival_time", "sample_index",
             "generator", "cache_salt", "group_id", "grammar")  # fmt: skip
    _MUTABLE_OF, _LISTS_OF = itemgetter(*MUTABLE), itemgetter(*APPEND_ONLY)  # one C call each, per step

    def __post_init__(self) -> None:
        self._saved = None  # an attribute of its own from the start (the class default is not)
        if self.group_id < 0:
            self.group_id = self.seq_id

    @property
    def num_seats(self) -> int:
        """Places it takes in the scheduler's ``max_num_seqs``: itself and the forks it will make."""
        return 1 + self.pending_forks

    @property
    def order_key(self) -> tuple[float, int, int]:
        """Running sequences are kept in this order: by arrival, a request's forks right behind it."""
        return (self.arrival_time, self.group_id, self.seq_id)

    @property
    def prompt_logit_positions(self) -> range:
        """Positions whose logits still give a prompt log-probability (position ``p`` predicts
        prompt token ``p + 1``); empty unless the request asked for ``prompt_logprobs``."""
        if self.params.prompt_logprobs is None or self.sample_index:
            return range(0)
        return range(len(self.prompt_logprobs), len(self.prompt_token_ids) - 1)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without building the whole list (a decode step reads one token)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - prompt_len)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the next steps must run through the model before this sequence can sample."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold: prompt + max_tokens."""
        return len(self.prompt_token_ids) + (self.params.max_tokens or 0)

    @property
    def max_kv_tokens(self) -> int:
        """The most tokens whose K/V this sequence will store: its last sampled token is never fed
        back through the model, so prompt + max_tokens - 1."""
        return self.max_total_tokens - 1

    # -- a step is a transaction (:mod:`.transaction`): O(1), whatever the sequence holds ---------
    def begin(self) -> None:
        fields = self.__dict__  # (every name above is a field: the rollback test walks them all)
        lists = self._LISTS_OF(fields)
        self._saved = (self._MUTABLE_OF(fields), lists, tuple(map(len, lists)))
        if self.grammar is not None:
            self.grammar.begin()

    def commit(self) -> None:
        self._saved = None
        if self.grammar is not None:
            self.grammar.commit()

    def rollback(self) -> None:
        if self._saved is None:
            return  # made during the step: its request forgets it
        values, lists, lengths = self._saved
        self.__dict__.update(zip(self.MUTABLE, values, strict=True))
        for name, lst, length in zip(self.APPEND_ONLY, lists, lengths, strict=True):
            del lst[length:]
            setattr(self, name, lst)  # (a fork gives a child a new list: the old one comes back)
        if self.grammar is not None:
            self.grammar.rollback()
        self._saved = None

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, prompt={len(self.prompt_token_ids)}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )
