"""What the engine hands back: vLLM's ``RequestOutput`` / ``CompletionOutput``, plus step counters.

``LLMEngine.step()`` streams as vLLM's does: it returns a :class:`RequestOutput` for every request
that produced tokens in that step, with ``finished=False`` until the step that ends it. What each
output holds is the request's ``SamplingParams.output_kind``: everything so far (``CUMULATIVE``,
the default), only this step's tokens (``DELTA``), or nothing until the end (``FINAL_ONLY``, what
``LLM.generate`` asks for; a beam search, too, reports only when it ends). Text that a stop string
could still cut is held back until it cannot. Each output carries its own copy of the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sample.logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's ``CompletionOutput``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # the sum of its tokens' log-probabilities
    logprobs: SampleLogprobs | None = None  # one dict per token if ``SamplingParams.logprobs`` was set

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times of a request (seconds from ``time.monotonic``)."""

    arrival_time: float
    first_scheduled_time: float | None = None  # the start of the first step that computed any of it
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_output_tokens: int = 0  # so far (a DELTA output holds only this step's)
    num_draft_tokens: int = 0  # speculative decoding: tokens drafted for it, and accepted
    num_accepted_tokens: int = 0

    def copy(self) -> RequestMetrics:
        """A copy (a step's undo keeps one; the fields are numbers): 0.3 us, ``copy.copy`` 3."""
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to the first step that scheduled it (vLLM's queued interval)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_output_tokens: int) -> float | None:
        if self.finished_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)


@dataclass
class RequestOutput:
    """One request's progress or result (vLLM's ``RequestOutput``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: PromptLogprobs | None = None  # if ``SamplingParams.prompt_logprobs`` was set
    num_cached_tokens: int | None = None  # prompt tokens whose K/V came from the prefix cache

    @property
    def time_per_output_token(self) -> float | None:
        return self.metrics.time_per_output_token(self.metrics.num_output_tokens)


@dataclass
class StepStats:
    """Counters of one ``step()``, for progress bars, benchmarks and notebooks."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_scheduled_seqs: int  # the batch size of this step
    num_scheduled_tokens: int
    num_preempted: int
    kv_usage: float
    seconds: float  # the whole step
    schedule_seconds: float  # scheduler + cache manager (allocator, page tables)
    prepare_seconds: float  # packing the batch: ids, positions, slot mapping, block tables
    forward_seconds: float  # the model's forward pass (attention included)
