"""The engine: requests in, one model step at a time, streamed outputs out.

:class:`LLMEngine` is the loop every serving system has at its core::

    add_request(...)            # tokenize, validate, queue (a bad request is rejected alone)
    while has_unfinished_requests():
        step()                  # schedule -> execute -> sample -> post-process; streams outputs

``step()`` is schedule -> execute -> sample -> update: the scheduler picks the work, the model
runner computes logits, each request decides from them (its tokens, forks, dropped beams), and
:meth:`Scheduler.update_from_output <.scheduler.Scheduler.update_from_output>`, the one owner of the
end of a step, applies it all in a documented order. It returns a :class:`~.outputs.RequestOutput`
for every request that produced tokens in that step, ``finished=False`` until the step that ends
it (vLLM's semantics; ``SamplingParams.output_kind`` says what each holds; ``FINAL_ONLY`` and beam
searches report once, at the end); an aborted request reports nothing more. :class:`~.llm.LLM`
wraps the engine as vLLM's ``LLM`` does.

The engine chooses nothing about memory or batching policy: it is handed a cache-manager factory
(paged by default; the baselines bring their own) and a :class:`~.scheduler.SchedulingPolicy`.
A request's use of its logits (sample, fork ``n``, beam search) lives in :mod:`.parallel_sampling`
and :mod:`.beam_search`; drafts in :mod:`.speculation`.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .._checks import check_int, check_positive_int
from ..memory.manager import KVCacheManager
from ..models import eos_token_ids, resolve_model, serving_length
from ..models.compilation import CompilationConfig
from .core.capacity import check_memory_args, fit_max_model_len, manager_builder, size_kv_cache
from .core.scheduler import Scheduler, SchedulerOutput, SchedulingPolicy, StepUpdate
from .core.transaction import StepTransaction
from .detokenizer import Detokenizer
from .engine_args import EngineArgs
from .generation_config import check_generation_config, sampling_defaults
from .inputs import Prompt
from .intake import build_request
from .metrics import EngineMetrics, Metric
from .outputs import RequestOutput, StepStats
from .request import Request, SequencePool
from .sample.logprobs import prompt_entries
from .sample.sampling import BeamSearchParams, Sampler, SamplingParams, seed_everything
from .sequence import Sequence
from .spec_decode.speculation import Speculator
from .spec_decode.speculative import SpeculativeConfig
from .stop_rules import StopRules
from .structured_output.grammar import StructuredOutputManager
from .worker.kv_cache import KVCache, KVCacheSpec
from .worker.model_runner import ModelRunner

#: Builds the cache manager from ``(num_blocks, block_size, max_model_len)``, the budget the engine
#: sized; the KV tensors take the manager's own geometry. The paged manager's settings (``watermark``,
#: ``num_cpu_blocks``, ``enable_prefix_caching``) go only to the default, paged manager.
CacheManagerFactory = Callable[[int, int, int], KVCacheManager]


class LLMEngine:
    """A continuous-batching engine over a KV-cache manager, driving a transformers causal LM.

    One request of ``max_model_len`` tokens must fit the KV cache (:mod:`.capacity`): a
    ``max_model_len`` that does not is refused here, with what the cache holds and what to change;
    without one, the model's length is lowered to the longest request the cache holds
    (``self.max_model_len`` says which).
    """

    def __init__(
        self,
        model: str | os.PathLike | PreTrainedModel | None = None,
        tokenizer: str | os.PathLike | PreTrainedTokenizerBase | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        attention_backend: str = "auto",
        batch_invariant: bool | None = None,
        preemption_mode: str = "recompute",
        num_cpu_blocks: int | None = None,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
        seed: int | None = 0,
        max_logprobs: int = 20,
        logprobs_mode: str = "raw_logprobs",
        generation_config: str = "auto",
        hf_overrides: dict | Callable | None = None,
        speculative_config: dict | SpeculativeConfig | None = None,
        compilation_config: int | dict | CompilationConfig | None = None,
        enforce_eager: bool = False,
        cache_manager_factory: CacheManagerFactory | None = None,
        scheduling_policy: SchedulingPolicy | None = None,
    ) -> None:
        check_positive_int("block_size", block_size)
        speculation = SpeculativeConfig.from_dict(speculative_config)
        compiling = CompilationConfig.from_value(compilation_config, enforce_eager)
        check_memory_args(gpu_memory_utilization, cache_manager_factory)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model, self.tokenizer = resolve_model(model, tokenizer, dtype, device, hf_overrides)
        self.max_model_len = serving_length(self.model.config, max_model_len)
        self.spec = KVCacheSpec.from_config(self.model.config, self.model.dtype, kv_cache_dtype)
        num_blocks = size_kv_cache(self.spec, device, block_size, num_kv_blocks, kv_cache_memory,
                                   gpu_memory_utilization)  # fmt: skip
        build = manager_builder(num_blocks, block_size, cache_manager_factory, watermark, num_cpu_blocks,
                                preemption_mode, enable_prefix_caching)  # fmt: skip
        # One request of max_model_len must fit: refused if max_model_len was given, else lowered.
        self.cache_manager, self.max_model_len = fit_max_model_len(
            build, self.max_model_len, max_model_len is not None
        )
        manager = self.cache_manager
        self.kv_cache = KVCache(
            self.spec, manager.num_blocks, manager.block_size, device, calculate_kv_scales
        )
        cpu_blocks = manager.num_cpu_blocks
        self.cpu_cache = KVCache(self.spec, cpu_blocks, manager.block_size, "cpu") if cpu_blocks else None
        budget = max(2048, self.max_model_len) if max_num_batched_tokens is None else max_num_batched_tokens
        self.stop_rules = StopRules(eos_token_ids(self.model, self.tokenizer), self.max_model_len)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.scheduler = Scheduler(manager, max_num_seqs, budget, preemption_mode, scheduling_policy,
                                   self.stop_rules, self.detokenizer)  # fmt: skip
        self.runner = ModelRunner(self.model, self.kv_cache, attention_backend, batch_invariant, compiling)
        self.sampler = Sampler(None if seed is None else check_int("seed", seed), logprobs_mode)
        if seed is not None:  # as vLLM's worker does: the process's own generators too
            seed_everything(seed)
        self.max_logprobs = check_int("max_logprobs", max_logprobs, minimum=-1)
        #: SamplingParams keywords from the model's generation config (:mod:`.generation_config`).
        self.sampling_defaults = sampling_defaults(self.model, check_generation_config(generation_config))
        self.pool = SequencePool()
        #: n-gram speculative decoding (:mod:`.speculation`), or None.
        self.speculator = Speculator(speculation, self.max_model_len) if speculation else None
        #: Structured outputs (:mod:`.structured_output`): its grammar compiler is built on first use.
        eos = self.stop_rules.eos_token_ids
        self.structured_output = StructuredOutputManager(self.tokenizer, self.model.config.vocab_size, eos)
        self.metrics = EngineMetrics()
        self._requests: dict[str, Request] = {}
        self._request_ids = itertools.count()
        self.last_step: StepStats | None = None
        self._saved: tuple | None = None  # the open step's undo
        self._undelivered: list[RequestOutput] = []  # outputs of a step interrupted while committing

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **objects: object) -> LLMEngine:
        """vLLM's way to build an engine; ``objects``: ``cache_manager_factory``, ``scheduling_policy``."""
        if not isinstance(engine_args, EngineArgs):
            raise TypeError(f"engine_args must be an EngineArgs, got {type(engine_args).__name__}")
        return cls(**engine_args.engine_kwargs(), **objects)  # type: ignore[arg-type]

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams | BeamSearchParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate, tokenize and queue one request; raises ``ValueError``/``TypeError`` (and queues
        nothing) if it is malformed or could never fit. Returns its request id.

        ``params`` may be :class:`BeamSearchParams` for a beam search. A dict prompt may carry a
        ``"cache_salt"``: only requests with the same salt share prefix-cache blocks.
        """
        if request_id is None:
            request_id = self._next_request_id()
        elif not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            raise TypeError(f"request_id must be a str (or an int, or None for a new id), got {request_id!r}")
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request, seqs = build_request(self, request_id, prompt, params, arrival_time)
        try:  # queued and known together, or neither (a Ctrl-C here must not leave a stray sequence)
            self._requests[request_id] = request
            for seq in seqs:
                self.scheduler.add(seq)
        except BaseException:
            self._requests.pop(request_id, None)
            waiting = self.scheduler.waiting
            self.scheduler.waiting = type(waiting)(s for s in waiting if s not in seqs)
            raise
        return request_id

    def _next_request_id(self) -> str:
        """A fresh id: the next number no unfinished request uses (ids a user chose are skipped)."""
        while (candidate := str(next(self._request_ids))) in self._requests:
            pass
        return candidate

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop a request (or each of several) now: its sequences finish with reason ``abort``,
        free their blocks, and the request is forgotten (nothing more is reported for it, not even
        an output of an interrupted step; its id may be used again). An unknown id raises
        ``ValueError``, before any request is aborted."""
        ids = [request_id] if isinstance(request_id, (str, int)) else list(request_id)
        ids = [str(i) for i in ids]  # an int id was stored as its string (add_request's rule)
        missing = [i for i in ids if i not in self._requests]
        if missing:
            raise ValueError(f"no request with id {', '.join(map(repr, missing))} is unfinished")
        now = time.monotonic()
        for i in ids:
            self._requests.pop(i).abort(now, self.scheduler)
            self.metrics.record_abort()
        gone = set(ids)
        self._undelivered = [o for o in self._undelivered if o.request_id not in gone]

    def get_metrics(self) -> list[Metric]:
        """vLLM's metrics of this engine so far (:mod:`.metrics`): counters, gauges, histograms."""
        spec = self.metrics.speculative(self.speculator.stats) if self.speculator is not None else []
        return self.metrics.read(self.scheduler, self.cache_manager) + spec

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- public views ---------------------------------------------------------------------------
    @property
    def request_ids(self) -> list[str]:
        """The requests not yet finished (or aborted), in the order they were added."""
        return list(self._requests)

    def sequences(self, request_id: str) -> tuple[Sequence, ...]:
        """The sequences of an unfinished request (all its samples, finished ones included, or its
        current beams): read them, do not change them. ``cache_manager.block_table(seq.seq_id)``
        gives each one's pages."""
        if request_id not in self._requests:
            raise ValueError(f"no unfinished request with id {request_id!r}")
        return tuple(self._requests[request_id].seqs)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block that no sequence holds (e.g. between benchmark runs); with
        ``reset_running_requests``, first send the running requests back to be recomputed, so that
        nothing cached stays. Returns whether the whole cache was forgotten (vLLM's answer)."""
        if not isinstance(reset_running_requests, bool):
            raise TypeError(f"reset_running_requests must be True or False, got {reset_running_requests!r}")
        if reset_running_requests:
            self.scheduler.preempt_running()
        self.cache_manager.reset_prefix_cache()
        return not self.scheduler.running

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, sample, update; the outputs of the requests that moved on.

        A step is a transaction (:mod:`.transaction`): if anything raises inside it (Ctrl-C, out
        of memory, a bad value found mid-step), everything it changed is rolled back (page tables,
        allocator, prefix cache, queues, counters, random generators, the K/V of blocks it took from
        others) and the exception reaches the caller. The engine is then exactly as before the
        step: the next ``step()`` produces the tokens an uninterrupted run would.
        """
        parts = [self, self.scheduler, self.pool, self.sampler, self.runner, self.metrics]
        transaction = StepTransaction(
            parts + ([self.speculator] if self.speculator is not None else []),
            self.cache_manager, (self.kv_cache, self.cpu_cache),
        )  # fmt: skip
        try:
            transaction.begin()
            outputs = self._undelivered + self._step(transaction)
            self._undelivered = []
        except BaseException:
            transaction.rollback()
            raise
        try:
            transaction.commit()  # outside the first try: once the results stand, nothing is undone
        except BaseException:  # interrupted while committing: the step stands, its outputs come next
            self._undelivered = outputs
            raise
        return outputs

    def _step(self, transaction: StepTransaction) -> list[RequestOutput]:
        start, started = time.perf_counter(), time.monotonic()
        out = self.scheduler.schedule()
        transaction.protect()  # before the step writes any K/V
        scheduled_at = time.perf_counter()
        logits = self._execute(out)
        update, computed = StepUpdate(), {s.seq.seq_id: s.num_new_tokens for s in out.scheduled}
        drawn = self._sample(out, logits, update)
        for s in out.scheduled:  # the queued interval ends when a request is first scheduled
            metrics = self._requests[s.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = started
        now = time.monotonic()
        for request_id, request in self._requests.items():  # every request: a beam search may be
            request.decide(drawn.get(request_id, []), update, computed, now)  # ready without a row
        self.scheduler.update_from_output(out, update, now)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self._requests)
        self.metrics.record_step(out, update)
        outputs = self._outputs(drawn)
        if out.is_empty and self.scheduler.has_unfinished() and not (out.preempted or out.swap_in):
            raise RuntimeError("the scheduler made no progress: nothing fits")  # pragma: no cover
        self.last_step = StepStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped), num_scheduled_seqs=len(out.scheduled),
            num_scheduled_tokens=out.num_tokens, num_preempted=len(out.preempted),
            kv_usage=self.cache_manager.usage, seconds=time.perf_counter() - start,
            schedule_seconds=scheduled_at - start, prepare_seconds=self.runner.last_prepare_seconds,
            forward_seconds=self.runner.last_forward_seconds,
        )  # fmt: skip
        return outputs

    def _execute(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Move the blocks the scheduler asked for, then run the model: one logits row per
        sequence that reaches its last token (``None`` if nothing was scheduled)."""
        if out.swap_out:
            assert self.cpu_cache is not None
            self.kv_cache.copy_blocks_to(self.cpu_cache, out.swap_out)
        if out.swap_in:
            assert self.cpu_cache is not None
            self.cpu_cache.copy_blocks_to(self.kv_cache, out.swap_in)
        self.kv_cache.copy_blocks(out.block_copies)  # before the step's writes: order matters
        self.runner.last_prepare_seconds = self.runner.last_forward_seconds = 0.0
        if out.is_empty:
            return None
        tables = [self.cache_manager.block_table(s.seq.seq_id) for s in out.scheduled]
        return self.runner.execute(out.scheduled, tables)

    def _sample(
        self, out: SchedulerOutput, logits: torch.Tensor | None, update: StepUpdate
    ) -> dict[str, list[tuple[Sequence, list[int]]]]:
        """Each request's drawers and their tokens, one batched sampler call for the whole step
        (a sequence that verifies drafts keeps one or more: :mod:`.speculation`); the tokens'
        log-probabilities (and any prompt log-probabilities) go into ``update``."""
        drawn: dict[str, list[tuple[Sequence, list[int]]]] = {}
        rows, drawers, row = [], [], 0  # type: tuple[list[int], list[Sequence], int]
        for s in out.scheduled:
            if s.prompt_positions:
                assert logits is not None
                n = len(s.prompt_positions)
                entries = prompt_entries(
                    logits[row : row + n], s.seq, s.prompt_positions, self.detokenizer.token_text
                )
                update.prompt_logprobs.append((s.seq, entries))
                row += n
            if s.needs_logits and s.drafts:
                assert logits is not None and self.speculator is not None
                metrics = self._requests[s.seq.request_id].metrics
                rows_of, row = logits[row : row + len(s.drafts) + 1], row + len(s.drafts) + 1
                tokens = self.speculator.verify(s, rows_of, self.sampler, self.stop_rules, update, metrics)
                drawn.setdefault(s.seq.request_id, []).append((s.seq, tokens))
            elif s.needs_logits:
                assert logits is not None
                seq = s.seq
                drawn.setdefault(seq.request_id, [])
                for drawer in self._requests[seq.request_id].drawers(seq, logits[row], self.pool):
                    rows.append(row)
                    drawers.append(drawer)
                row += 1
        if drawers:
            assert logits is not None
            banned = [self.stop_rules.banned(s) for s in drawers]
            picked = logits if rows == list(range(len(logits))) else logits[rows]  # (no copy if all)
            tokens, logprobs = self.sampler.draw(picked, drawers, banned, self.detokenizer.token_text)
            for seq, token, logprob in zip(drawers, tokens, logprobs, strict=True):
                drawn[seq.request_id].append((seq, [token]))
                update.logprobs[seq.seq_id] = [logprob]
        return drawn

    def _outputs(self, drawn: dict[str, list[tuple[Sequence, list[int]]]]) -> list[RequestOutput]:
        """Report the requests that drew tokens or finished; forget the finished."""
        outputs = []
        for request_id, request in list(self._requests.items()):
            output = request.output() if drawn.get(request_id) or request.finished else None
            if output is not None:
                outputs.append(output)
            if request.finished:
                del self._requests[request_id]
                if output is not None:
                    self.metrics.record_finished(output)
        return outputs

    # -- a step is a transaction (:mod:`.transaction`): the request map, and every request -------
    def begin(self) -> None:
        self._saved = (dict(self._requests), self.last_step, self._undelivered)
        for request in self._requests.values():
            request.begin()

    def commit(self) -> None:
        if self._saved is not None:
            for request in self._saved[0].values():  # finished ones included
                request.commit()
        self._saved = None

    def rollback(self) -> None:
        if self._saved is None:
            return
        self._requests, self.last_step, self._undelivered = self._saved
        self._saved = None
        for request in self._requests.values():
            request.rollback()
