"""The engine and the vLLM-compatible offline API: ``LLM(...).generate(prompts, SamplingParams(...))``.

:class:`LLMEngine` is the loop every serving system has at its core::

    add_request(...)            # tokenize, validate, queue (a bad request is rejected alone)
    while has_unfinished_requests():
        step()                  # schedule -> copy blocks -> run the model -> sample -> finish -> free

:class:`LLM` wraps it the way vLLM's ``LLM`` does, so a program written for vLLM's offline API runs
here with only its import line (and the model name) changed.

**Sharing.** With the paged cache manager, a request for ``n`` samples is one sequence until its
prompt is computed; then it forks into ``n`` sequences that share the prompt's blocks. Sample ``i``
draws its tokens from its own generator seeded ``seed + i`` (the first token too, from the shared
prompt logits), so its tokens are exactly those of a lone request with ``n=1`` and seed ``seed + i``:
sharing changes memory, never outputs. Beam search (``add_request`` with :class:`BeamSearchParams`,
or :meth:`LLM.beam_search`) forks and frees the beams' page tables at every step
(:mod:`.beam_search`). Prefix caching (``enable_prefix_caching``, on by default as in vLLM v1) lets
any request reuse the blocks of any earlier one with the same beginning.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ._checks import cdiv, check_int, check_positive_int
from .baseline import POLICIES, ContiguousKVCacheManager
from .beam_search import BeamSearch, BeamSearchOutput, BeamSearchSequence, penalized_score
from .cache_manager import PagedKVCacheManager
from .kv_cache import KVCache, KVCacheSpec
from .model_runner import ModelRunner, attention_window, check_supported
from .models import load_model, load_tokenizer, resolve_dtype
from .sampling import BeamSearchParams, Sampler, SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import FinishReason, SequenceStatus
from .sequence import Sequence as Seq

DEFAULT_CPU_KV_CACHE_MEMORY = 512 * 1024**2  # bytes; on CUDA gpu_memory_utilization decides


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's ``CompletionOutput``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: None = None  # vLLM's field; this package does not compute log-probabilities

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times of a request (seconds from ``time.monotonic``)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_output_tokens: int) -> float | None:
        if self.finished_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)


@dataclass
class RequestOutput:
    """What ``generate`` returns per prompt (vLLM's ``RequestOutput``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics

    @property
    def time_per_output_token(self) -> float | None:
        return self.metrics.time_per_output_token(max((len(o.token_ids) for o in self.outputs), default=0))


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Seq]  # its samples; for a beam search, the live beams, best first
    metrics: RequestMetrics
    stop_token_ids: set[int] = field(default_factory=set)
    beam: BeamSearch | None = None
    beam_logprobs: list[float] = field(default_factory=list)  # cumulative, one per live beam
    candidates: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # seq_id ->


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


class LLMEngine:
    """A continuous-batching engine over paged KV memory, driving a transformers causal LM.

    The baselines of the experiments run through this very engine: ``kv_manager="max"``,
    ``"pow2"`` or ``"oracle"`` swaps the paged cache for a contiguous one of the same bytes (one
    range reserved per request, placed by ``placement="buddy"`` or ``"first-fit"``; see
    :mod:`paged_attention.baseline`), and ``static_batching=True`` runs fixed batches to the end
    as ``model.generate`` does.
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
        preemption_mode: str = "recompute",
        num_cpu_blocks: int | None = None,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        kv_manager: str = "paged",
        placement: str = "buddy",
        static_batching: bool = False,
    ) -> None:
        check_positive_int("block_size", block_size)
        if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model, self.tokenizer = _resolve_model(model, tokenizer, dtype, device)
        config = self.model.config
        check_supported(config)
        model_max = getattr(config, "max_position_embeddings", None) or 2048
        window = attention_window(config)
        if window is not None and window < model_max:
            # Our kernels attend to the whole context. Within the window that is exactly what a
            # sliding-window model does, so serve sequences only up to the window's length.
            if max_model_len is not None and max_model_len > window:
                raise ValueError(
                    f"max_model_len={max_model_len} exceeds the model's sliding window of {window} tokens, "
                    "which paged_attention does not implement"
                )
            model_max = window
        self.max_model_len = check_positive_int(
            "max_model_len", model_max if max_model_len is None else max_model_len
        )
        if self.max_model_len > model_max:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's {model_max} positions")
        self.spec = KVCacheSpec.from_config(config, next(self.model.parameters()).dtype)
        num_blocks = self._num_kv_blocks(
            num_kv_blocks, kv_cache_memory, gpu_memory_utilization, block_size, device
        )
        if num_cpu_blocks is None:
            num_cpu_blocks = num_blocks if preemption_mode == "swap" and kv_manager == "paged" else 0
        self.cache_manager: PagedKVCacheManager | ContiguousKVCacheManager
        if kv_manager == "paged":
            self.cache_manager = PagedKVCacheManager(
                num_blocks, block_size, watermark, num_cpu_blocks, enable_prefix_caching
            )
            self.kv_cache = KVCache(self.spec, num_blocks, block_size, device)
        elif kv_manager in POLICIES:
            # The same bytes as the paged cache, as one arena of token slots (see baseline/contiguous.py).
            slots = num_blocks * block_size
            self.cache_manager = ContiguousKVCacheManager(slots, self.max_model_len, kv_manager, placement)
            self.kv_cache = KVCache(self.spec, slots, 1, device)
        else:
            raise ValueError(f"kv_manager must be 'paged' or one of {POLICIES}, got {kv_manager!r}")
        # n > 1 and beams share pages; a contiguous cache serves n samples as n independent sequences.
        self.can_fork = isinstance(self.cache_manager, PagedKVCacheManager)
        self.cpu_cache = KVCache(self.spec, num_cpu_blocks, block_size, "cpu") if num_cpu_blocks else None
        self.scheduler = Scheduler(
            self.cache_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(2048, self.max_model_len)
            if max_num_batched_tokens is None
            else max_num_batched_tokens,
            preemption_mode=preemption_mode,
            static_batching=static_batching,
        )
        self.runner = ModelRunner(self.model, self.kv_cache, attention_backend)
        self.sampler = Sampler(check_int("seed", seed))
        self.requests: dict[str, _Request] = {}
        self.beam_requests: dict[str, _Request] = {}  # the beam searches still running
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        self.last_step: StepStats | None = None

    # -- sizing ---------------------------------------------------------------------------------
    def _num_kv_blocks(
        self, num_kv_blocks: int | None, kv_cache_memory: int | None, utilization: float, block_size: int,
        device: torch.device,
    ) -> int:  # fmt: skip
        if num_kv_blocks is not None:
            return check_positive_int("num_kv_blocks", num_kv_blocks)
        if kv_cache_memory is None:
            if device.type == "cuda":
                free, total = torch.cuda.mem_get_info(device)
                used_by_others = total - free
                # Leave room for activations: a tenth of what remains, as a simple stand-in for profiling.
                kv_cache_memory = int(max(0, utilization * total - used_by_others) * 0.9)
            else:
                kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY
        check_int("kv_cache_memory", kv_cache_memory, minimum=1)
        return self.spec.num_blocks_for_budget(kv_cache_memory, block_size)

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | BeamSearchParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate, tokenize and queue one request; raises ``ValueError``/``TypeError`` (and queues
        nothing) if it is malformed or could never fit. Returns its request id.

        ``params`` may be :class:`BeamSearchParams` for a beam search. A dict prompt may carry a
        ``"cache_salt"``: only requests with the same salt share prefix-cache blocks.
        """
        params = params or SamplingParams()
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise TypeError(
                f"params must be a SamplingParams or BeamSearchParams, got {type(params).__name__}"
            )
        beam_params = params if isinstance(params, BeamSearchParams) else None
        if beam_params is not None:
            params = SamplingParams(
                temperature=0.0, max_tokens=beam_params.max_tokens, ignore_eos=beam_params.ignore_eos
            )
        assert isinstance(params, SamplingParams)
        request_id = str(next(self._request_ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty: a request needs at least one prompt token")
        vocab = self.model.config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got one out of range")
        if any(t >= vocab for t in params.stop_token_ids or []):
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {params.stop_token_ids}")
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens leaves no room to generate "
                f"(max_model_len={self.max_model_len})"
            )
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=room)  # vLLM: up to the model's length
        elif params.max_tokens > room:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}"
            )
        width = beam_params.beam_width if beam_params else params.n
        if beam_params is not None and not self.can_fork:
            raise ValueError("beam search forks page tables: it needs the paged KV cache manager")
        forks = width > 1 and self.can_fork  # else: n independent sequences (same outputs, no sharing)
        now = time.monotonic() if arrival_time is None else arrival_time
        seqs = []
        for i in range(1 if forks else width):
            seqs.append(
                Seq(next(self._seq_ids), request_id, list(token_ids), params, now, i,
                    self._generator(params, i), cache_salt=cache_salt)
            )  # fmt: skip
        seqs[0].pending_forks = width - 1 if forks else 0
        for seq in seqs:
            self._check_fits(request_id, seq)
        if beam_params is not None:
            self._check_beams_fit(request_id, seqs[0], width)
        for seq in seqs:
            self.scheduler.add(seq)
        stop_ids = set(params.stop_token_ids or [])
        request = _Request(request_id, text, list(token_ids), params, seqs, RequestMetrics(now), stop_ids)
        self.requests[request_id] = request
        if beam_params is not None:
            request.beam = BeamSearch(beam_params, self.eos_token_ids)
            request.beam_logprobs = [0.0]
            self.beam_requests[request_id] = request
        return request_id

    @staticmethod
    def _generator(params: SamplingParams, sample_index: int) -> torch.Generator | None:
        """Sample ``i`` of a seeded request draws from its own generator, seeded ``seed + i``."""
        if params.seed is None:
            return None
        return torch.Generator().manual_seed(params.seed + sample_index)

    def _check_fits(self, request_id: str, seq: Seq) -> None:
        if not self.cache_manager.fits_at_all(seq):
            manager = self.cache_manager
            kept = getattr(manager, "watermark_blocks", 0)
            raise ValueError(
                f"request {request_id!r} needs up to {seq.max_total_tokens} tokens of KV cache "
                f"(prompt + max_tokens) but the cache holds {manager.num_blocks * manager.block_size} "
                + (
                    f"(of which {kept} blocks stay free for running sequences)"
                    if kept
                    else "(as one contiguous range, after the reservation policy's rounding)"
                )
            )

    def _check_beams_fit(self, request_id: str, seq: Seq, width: int) -> None:
        """Beams wait for each other at every step, so all of them must fit at once even unshared
        (each with one spare block); otherwise a beam could wait forever for memory its siblings hold."""
        cache = self.cache_manager
        needed = width * (cdiv(seq.max_total_tokens, cache.block_size) + 1)
        available = cache.num_blocks - cache.watermark_blocks
        if needed > available:
            raise ValueError(
                f"request {request_id!r}: {width} beams of up to {seq.max_total_tokens} tokens may need "
                f"{needed} blocks, more than the {available} the cache can give; "
                "lower beam_width or max_tokens, or give the cache more blocks"
            )

    def _tokenize(self, prompt: str | list[int] | dict[str, Any]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise TypeError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, str):
            if not prompt:
                return prompt, []  # rejected by the caller, even if the tokenizer would add a BOS
            return prompt, list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def abort_request(self, request_id: str) -> None:
        """Stop a request now: its sequences finish with reason ``abort``, free their blocks, and the
        request is forgotten (no output is returned for it; its id may be used again)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            raise ValueError(f"no request with id {request_id!r}")
        self.beam_requests.pop(request_id, None)
        now = time.monotonic()
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish(FinishReason.ABORTED, now)
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return the requests that finished in this step."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        scheduled_at = time.perf_counter()
        self._move_blocks(out)
        self.runner.last_prepare_seconds = self.runner.last_forward_seconds = 0.0
        finished_requests: dict[str, _Request] = {}
        if not out.is_empty:
            tables = [self.cache_manager.block_table(s.seq.seq_id) for s in out.scheduled]
            logits = self.runner.execute(out.scheduled, tables)
            rows: list[int] = []  # the logits row each sampled sequence reads
            sampled: list[Seq] = []
            beams: list[tuple[int, Seq]] = []
            children: list[tuple[Seq, Seq]] = []  # (parent, child) forks to make after this step
            for row, seq in enumerate(s.seq for s in out.scheduled if s.samples):
                request = self.requests[seq.request_id]
                if request.beam is not None:
                    beams.append((row, seq))
                    continue
                rows.append(row)
                sampled.append(seq)
                for child in self._new_children(seq, request):  # they sample from the prompt's logits
                    rows.append(row)
                    sampled.append(child)
                    children.append((seq, child))
            tokens = []
            if sampled:
                tokens = self.sampler(
                    logits[rows], [s.params for s in sampled], [s.generator for s in sampled],
                    [self._banned(s) for s in sampled],
                )  # fmt: skip
            for row, seq in beams:
                request = self.requests[seq.request_id]
                assert request.beam is not None
                request.candidates[seq.seq_id] = request.beam.top_candidates(logits[row])
            self.scheduler.after_step(out.scheduled)  # only once the step has fully succeeded
            for parent, child in children:  # the parent's prompt is computed now: share its pages
                child.num_computed_tokens = parent.num_computed_tokens
                self.cache_manager.fork(parent, child)
                self.scheduler.add_forked(child)
            now = time.monotonic()
            for seq, token in zip(sampled, tokens, strict=True):
                self._append_token(seq, token, now)
                if seq.is_finished:
                    self.scheduler.finish(seq)
                    request = self.requests[seq.request_id]
                    if all(s.is_finished for s in request.seqs):
                        finished_requests[request.request_id] = request
        if self.beam_requests:
            self._advance_beams(finished_requests)
        if out.is_empty and self.scheduler.has_unfinished() and not (out.preempted or out.swap_in):
            raise RuntimeError(
                "the scheduler made no progress: no sequence could be scheduled"
            )  # pragma: no cover
        self.last_step = StepStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            num_scheduled_seqs=len(out.scheduled),
            num_scheduled_tokens=out.num_tokens,
            num_preempted=len(out.preempted),
            kv_usage=self.cache_manager.usage,
            seconds=time.perf_counter() - start,
            schedule_seconds=scheduled_at - start,
            prepare_seconds=self.runner.last_prepare_seconds,
            forward_seconds=self.runner.last_forward_seconds,
        )
        results = []
        for request in finished_requests.values():
            results.append(self._request_output(request))
            del self.requests[request.request_id]
        return results

    # -- sharing --------------------------------------------------------------------------------
    def _new_children(self, parent: Seq, request: _Request) -> list[Seq]:
        """The samples ``1 .. n-1`` of a request, made when its first sequence samples its first token.

        They are plain copies of the parent (tokens, computed count); their page tables are forked
        after the step, once the parent's prompt is in the cache.
        """
        if not parent.pending_forks:
            return []
        first = len(request.seqs)
        kids = [self._copy_of(parent, first + i) for i in range(parent.pending_forks)]
        parent.pending_forks = 0
        request.seqs += kids
        return kids

    def _copy_of(self, parent: Seq, sample_index: int) -> Seq:
        return Seq(
            next(self._seq_ids), parent.request_id, parent.prompt_token_ids, parent.params,
            parent.arrival_time, sample_index, self._generator(parent.params, sample_index),
            output_token_ids=list(parent.output_token_ids), num_computed_tokens=parent.num_computed_tokens,
            cache_salt=parent.cache_salt, group_id=parent.group_id,
        )  # fmt: skip

    def _advance_beams(self, finished_requests: dict[str, _Request]) -> None:
        """For every beam search whose live beams all have their next-token candidates: rank them,
        then fork the beams that continue more than once, free those that do not continue, and give
        each new beam its token. A beam still waiting for a sibling is parked by the scheduler."""
        now = time.monotonic()
        for request in list(self.beam_requests.values()):
            beams, search = request.seqs, request.beam
            assert search is not None
            if not all(self._beam_ready(request, b) for b in beams):
                continue
            chosen = search.step(
                request.beam_logprobs, [request.candidates[b.seq_id] for b in beams],
                [b.output_token_ids for b in beams],
            )  # fmt: skip
            request.candidates.clear()
            beams[0].pending_forks = 0  # its seats are the new beams' now
            new_beams, continued = [], set()
            for c in chosen:  # forks first: a child copies its parent before the parent grows
                parent = beams[c.parent]
                if c.parent in continued:
                    child = self._copy_of(parent, 0)
                    self.cache_manager.fork(parent, child)
                    self.scheduler.add_forked(child)
                    new_beams.append(child)
                else:
                    continued.add(c.parent)
                    new_beams.append(parent)
            for index, beam in enumerate(beams):
                if index not in continued:  # a dead end: its blocks go back (or to its siblings)
                    beam.status = SequenceStatus.FINISHED
                    self.scheduler.finish(beam)
            for beam, c in zip(new_beams, chosen, strict=True):
                beam.output_token_ids.append(c.token)
            if request.metrics.first_token_time is None:  # the first tokens were chosen (or ended) now
                request.metrics.first_token_time = now
            request.seqs, request.beam_logprobs = new_beams, [c.cum_logprob for c in chosen]
            if search.done:
                del self.beam_requests[request.request_id]
                finished_requests[request.request_id] = request

    @staticmethod
    def _beam_ready(request: _Request, beam: Seq) -> bool:
        """Its candidates are known and still hold: it has not been preempted to recompute since."""
        return (
            beam.seq_id in request.candidates
            and beam.status is SequenceStatus.RUNNING
            and beam.num_computed_tokens == beam.num_tokens
        )

    def _move_blocks(self, out: SchedulerOutput) -> None:
        """Do the block copies the scheduler asked for, before the step's writes (order matters)."""
        if out.swap_out:
            assert self.cpu_cache is not None
            self.kv_cache.copy_blocks_to(self.cpu_cache, out.swap_out)
        if out.swap_in:
            assert self.cpu_cache is not None
            self.cpu_cache.copy_blocks_to(self.kv_cache, out.swap_in)
        self.kv_cache.copy_blocks(out.block_copies)

    def _banned(self, seq: Seq) -> list[int]:
        """Before ``min_tokens`` outputs, the stop tokens may not be sampled (vLLM's rule)."""
        if len(seq.output_token_ids) >= seq.params.min_tokens:
            return []
        ids = set(self.requests[seq.request_id].stop_token_ids)
        if not seq.params.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)

    def _append_token(self, seq: Seq, token: int, now: float) -> None:
        seq.output_token_ids.append(token)
        request = self.requests[seq.request_id]
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        params = seq.params
        n_out = len(seq.output_token_ids)
        if n_out >= params.min_tokens:
            if token in request.stop_token_ids:
                seq.finish(FinishReason.STOP, now, stop_reason=token)
                return
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish(FinishReason.STOP, now)
                return
        if params.stop_strings:
            # Look for a stop string only where it could newly end: in the text this token added,
            # plus the few characters before it that a stop string could start in (as vLLM does).
            previous, text = seq.output_text, self._detokenize(seq)
            seq.output_text = text
            if n_out >= params.min_tokens:
                for stop in params.stop_strings:
                    at = text.find(stop, max(0, len(previous) - len(stop) + 1))
                    if at >= 0:
                        seq.output_text = text[:at]
                        seq.finish(FinishReason.STOP, now, stop_reason=stop)
                        return
        if n_out >= (params.max_tokens or 0) or seq.num_tokens >= self.max_model_len:
            seq.finish(FinishReason.LENGTH, now)

    def _detokenize(self, seq: Seq) -> str:
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _request_output(self, request: _Request) -> RequestOutput:
        if request.beam is not None:
            return self._beam_request_output(request)
        outputs = []
        for seq in request.seqs:
            text = seq.output_text if seq.stop_reason in seq.params.stop_strings else self._detokenize(seq)
            tokens = list(seq.output_token_ids)
            outputs.append(
                CompletionOutput(
                    seq.sample_index, text, tokens,
                    seq.finish_reason.value if seq.finish_reason else None, seq.stop_reason,
                )
            )  # fmt: skip
        metrics = request.metrics
        metrics.finished_time = max((s.finish_time or 0.0) for s in request.seqs)
        metrics.num_preemptions = sum(s.num_preemptions for s in request.seqs)
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, outputs, True, metrics
        )

    def _beam_request_output(self, request: _Request) -> RequestOutput:
        """A finished beam search as vLLM's server returns it: one output per best beam, best first."""
        assert request.beam is not None
        outputs = []
        for i, h in enumerate(request.beam.finished):
            text = self.tokenizer.decode(h.token_ids, skip_special_tokens=True)
            outputs.append(CompletionOutput(i, text, list(h.token_ids), h.finish_reason, None, h.cum_logprob))
        request.metrics.finished_time = time.monotonic()
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, outputs, True, request.metrics
        )

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no sequence holds (e.g. between benchmark runs)."""
        if not isinstance(self.cache_manager, PagedKVCacheManager):
            return 0  # a contiguous cache keeps no prefix cache
        return self.cache_manager.reset_prefix_cache()


class LLM:
    """vLLM's offline API: ``LLM(model=...).generate(prompts, sampling_params)``.

    With no ``model`` it serves the embedded tiny Llama (see :mod:`paged_attention.models`).
    ``gpu_memory_utilization`` sizes the KV cache on CUDA; on a CPU the cache is sized by
    ``num_kv_blocks`` or ``kv_cache_memory`` (bytes), else 512 MiB. Other keyword arguments go to
    :class:`LLMEngine`; vLLM's ``trust_remote_code``, ``enforce_eager``, ``disable_log_stats``,
    ``swap_space`` and ``tensor_parallel_size=1`` are accepted and do nothing here.
    """

    # vLLM arguments that mean nothing here, accepted so that vLLM programs run unchanged.
    _VLLM_NO_OPS = ("trust_remote_code", "enforce_eager", "disable_log_stats", "swap_space")

    def __init__(self, model: str | os.PathLike | PreTrainedModel | None = None, **kwargs: Any) -> None:
        for name in self._VLLM_NO_OPS:
            kwargs.pop(name, None)
        tensor_parallel_size = kwargs.pop("tensor_parallel_size", 1)
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size must be 1 (one device), got {tensor_parallel_size!r}")
        self.llm_engine = LLMEngine(model, **kwargs)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int] | dict[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Serve every prompt to the end; outputs come back in the order of ``prompts``.

        A prompt that cannot be served (empty, too long, bad ids) raises ``ValueError`` before any
        work starts, naming its index, so that a batch is all-or-nothing like vLLM's.
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        return self._serve(prompts, params_list, use_tqdm, "Processed prompts")

    def beam_search(
        self,
        prompts: str | list[int] | Sequence[str | list[int] | dict[str, Any]],
        params: BeamSearchParams,
        use_tqdm: bool | Callable[..., Any] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search every prompt (vLLM's ``LLM.beam_search``); one :class:`BeamSearchOutput` each.

        Each output holds the best ``beam_width`` finished sequences, best first; their ``tokens``
        include the prompt, as in vLLM. ``concurrency_limit`` caps how many prompts search at once.
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompts = _as_prompt_list(prompts)
        limit = (
            len(prompts)
            if concurrency_limit is None
            else check_positive_int("concurrency_limit", concurrency_limit)
        )
        tokenizer = self.llm_engine.tokenizer
        results = []
        for first in range(0, len(prompts), max(1, limit)):
            chunk = prompts[first : first + limit]
            for request in self._serve(chunk, [params] * len(chunk), use_tqdm, "Beam search"):
                sequences = []
                for out in request.outputs:
                    tokens = request.prompt_token_ids + out.token_ids
                    logprob = out.cumulative_logprob or 0.0
                    score = penalized_score(logprob, len(out.token_ids), params.length_penalty)
                    text = tokenizer.decode(tokens)
                    sequences.append(
                        BeamSearchSequence(tokens, logprob, text, out.finish_reason, None, score)
                    )
                results.append(BeamSearchOutput(sequences))
        return results

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's free blocks (vLLM's ``LLM.reset_prefix_cache``)."""
        self.llm_engine.reset_prefix_cache()
        return True

    def _serve(
        self,
        prompts: list[str | list[int] | dict[str, Any]],
        params_list: list[SamplingParams] | list[BeamSearchParams],
        use_tqdm: bool | Callable[..., Any],
        desc: str,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                try:
                    ids.append(engine.add_request(None, prompt, params))
                except (ValueError, TypeError) as err:
                    raise type(err)(f"prompt {i}: {err}") from err
        except Exception:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        progress_cls = use_tqdm if callable(use_tqdm) else tqdm
        bar = progress_cls(total=len(ids), desc=desc, disable=use_tqdm is False, unit="req")
        with bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    results[output.request_id] = output
                    bar.update(1)
        return [results[i] for i in ids]


def _as_prompt_list(
    prompts: str | list[int] | Sequence[str | list[int] | dict[str, Any]],
) -> list[str | list[int] | dict[str, Any]]:
    """One prompt (a string, a dict, a list of token ids) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        return [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
        raise TypeError(
            f"prompts must be a string, a list of token ids, or a list of those, got {type(prompts)}"
        )
    return list(prompts)


def _resolve_model(
    model: str | os.PathLike | PreTrainedModel | None,
    tokenizer: str | os.PathLike | PreTrainedTokenizerBase | None,
    dtype: str | torch.dtype | None,
    device: torch.device,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model object is used as given; anything else goes through ``from_pretrained`` (offline)."""
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        tok = tokenizer
    elif tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    if isinstance(model, PreTrainedModel):
        if tokenizer is None:
            source = getattr(model, "name_or_path", "")
            if not source:
                raise ValueError("a model object needs tokenizer= (a tokenizer, or where to load one)")
            tok = load_tokenizer(source)
        if dtype is not None:
            model = model.to(resolve_dtype(dtype, device, model.config))
        return model.to(device).eval(), tok
    loaded, default_tok = load_model(model, dtype, device)
    return loaded, tok if tokenizer is not None else default_tok


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return ids


__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "SequenceStatus",
]
