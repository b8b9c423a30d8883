"""A trace executor: the real scheduler and cache manager, with the model replaced by a script.

Memory experiments do not need a model's numbers, only its *lengths*: each request of a trace says
how many tokens it will generate. The executor runs the very same
:class:`~paged_attention.engine.core.scheduler.Scheduler` and cache manager as the engine, step by step, and
instead of a forward pass it hands the scheduler's own end of a step
(:meth:`~paged_attention.engine.core.scheduler.Scheduler.update_from_output`) a dummy token for every
sequence that samples; the stop rules finish it when its scripted output length is reached.
An hour of traffic takes seconds, and every step's state is recorded for pictures.

**Time.** Without a ``step_time`` model every step lasts one unit, whatever it computes, and
arrival times count steps: a step that recomputes a preempted sequence's 100 tokens costs what a
step of one decode does, and swapping's copies cost nothing either. Given a ``step_time``, each
step lasts what it says, arrival times are in its unit, and the clock jumps over idle gaps to the
next arrival. :func:`linear_step_time` charges each step a fixed cost plus a price per token
computed and per block copied between GPU and CPU (so recomputation and swapping both pay for
their work); :func:`cost_model_step_time` is a roofline model of a named GPU serving a named
model, in seconds. Averages over a run are then *time* averages, as in the PagedAttention paper's
Figure 2.

**Preemptions** are counted per request (:attr:`TraceResult.preemptions`), and a preemption is a
*self-preemption* when the sequence that asked for memory was itself the latest arrival among the
running ones: the scheduler's victim rule then picks it, and it steps back
(:attr:`TraceResult.num_self_preemptions`). In swap mode a victim whose blocks do not fit the CPU
pool is recomputed instead: :attr:`TraceResult.num_swap_fallbacks` counts those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .._checks import cdiv
from ..engine.core.scheduler import Scheduler, SchedulerOutput, SchedulingPolicy, StepUpdate
from ..engine.params import SamplingParams
from ..engine.sequence import Sequence
from ..memory.accounting import MemoryReport
from ..memory.manager import KVCacheManager
from .traces import TraceRequest

StepTime = Callable[[SchedulerOutput], float]


@dataclass(frozen=True)
class StepRecord:
    """The state after one step."""

    step: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_scheduled_tokens: int
    num_preempted: int
    num_finished: int
    free_blocks: int
    token_slots: int  # slots holding token states (memory report; -1 on steps without one)
    time: float = 0.0  # when the step started
    duration: float = 1.0
    report: MemoryReport | None = None  # the full memory report, on the steps that record one
    num_blocks_copied: int = 0  # blocks swapped out or in (between GPU and CPU) this step


@dataclass
class TraceResult:
    steps: list[StepRecord] = field(default_factory=list)
    finish_step: dict[int, int] = field(default_factory=dict)  # request index -> step it finished
    finish_time: dict[int, float] = field(default_factory=dict)  # request index -> time it finished
    num_preemptions: int = 0
    preemptions: dict[int, int] = field(default_factory=dict)  # request index -> times it was preempted
    num_self_preemptions: int = 0  # preemptions of the very sequence that asked for memory
    num_swap_fallbacks: int = 0  # swap mode: victims recomputed because the CPU pool was too full

    @property
    def max_preemptions(self) -> int:
        """The most times one request was preempted (0 if none was)."""
        return max(self.preemptions.values(), default=0)

    @property
    def peak_running(self) -> int:
        return max((s.num_running for s in self.steps), default=0)

    @property
    def mean_running(self) -> float:
        """Sequences in the running batch, averaged over steps."""
        return sum(s.num_running for s in self.steps) / max(1, len(self.steps))

    @property
    def duration(self) -> float:
        return sum(s.duration for s in self.steps)

    @property
    def time_mean_running(self) -> float:
        """Sequences in the running batch, averaged over time (each step weighted by its duration)."""
        return sum(s.num_running * s.duration for s in self.steps) / max(1e-30, self.duration)

    def mean_memory(self, saturated_only: bool = True) -> dict[str, float]:
        """Each memory category as a share of the cache, averaged over time (steps with a report).

        ``saturated_only`` keeps the steps in which some request was waiting: memory was the
        bottleneck then, which is what the comparison is about (the ramp-up of an empty cache and
        the drain after the last arrival say nothing about a memory manager).
        """
        recorded = [s for s in self.steps if s.report is not None and (s.num_waiting or not saturated_only)]
        total = sum(s.duration for s in recorded)
        if not recorded or total <= 0:
            if any(s.report is not None for s in self.steps):
                raise ValueError("no request ever waited; use saturated_only=False")
            raise ValueError("no memory reports were recorded (run_trace(..., report_every=...))")
        sums: dict[str, float] = {}
        for s in recorded:
            for k, share in s.report.fractions().items():  # type: ignore[union-attr]
                sums[k] = sums.get(k, 0.0) + share * s.duration
        return {k: v / total for k, v in sums.items()}


def run_trace(
    trace: list[TraceRequest] | tuple[TraceRequest, ...],
    cache_manager: KVCacheManager,
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    preemption_mode: str = "recompute",
    scheduling_policy: SchedulingPolicy | None = None,
    step_time: StepTime | None = None,
    report_every: int = 1,
    max_steps: int = 1_000_000,
    until: float | None = None,
    progress: bool = False,
) -> TraceResult:
    """Serve ``trace`` with the real scheduler; return per-step records.

    ``report_every`` records the full memory report every that many steps (0: never).
    ``until`` stops the run once the clock reaches it, leaving the cache as it is then (for
    snapshots); unfinished requests have no finish time. ``progress`` shows a progress bar.
    ``scheduling_policy``: continuous batching by default; ``StaticBatching()`` for the baseline.
    ``step_time``: each step's duration (see the module docstring); ``None``: one unit per step.
    """
    scheduler = Scheduler(
        cache_manager, max_num_seqs, max_num_batched_tokens, preemption_mode, scheduling_policy
    )
    pending = sorted(range(len(trace)), key=lambda i: (trace[i].arrival_time, i))
    sequences: dict[int, Sequence] = {}
    result = TraceResult()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(trace), unit="req", leave=False)
    next_arrival = 0
    step = 0
    now = 0.0
    while next_arrival < len(pending) or scheduler.has_unfinished():
        if step >= max_steps:
            raise RuntimeError(f"trace did not finish within {max_steps} steps")
        if step_time is None:
            now = float(step)  # without a time model, time counts steps
        elif not scheduler.has_unfinished():  # idle: jump to the next arrival
            now = max(now, trace[pending[next_arrival]].arrival_time)
        if until is not None and now >= until:
            break
        while next_arrival < len(pending) and trace[pending[next_arrival]].arrival_time <= now:
            index = pending[next_arrival]
            request = trace[index]
            params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
            seq = Sequence(index, str(index), [0] * request.prompt_len, params, request.arrival_time)
            scheduler.add(seq)
            sequences[index] = seq
            next_arrival += 1
        out, done = scripted_step(scheduler, float(step))
        for victim in out.preempted:
            result.preemptions[victim.seq_id] = result.preemptions.get(victim.seq_id, 0) + 1
        duration = step_time(out) if step_time is not None else 1.0
        for seq in done:
            result.finish_step[seq.seq_id] = step
            result.finish_time[seq.seq_id] = (now + duration) if step_time is not None else step + 1
        finished = len(done)
        report = cache_manager.memory_report() if report_every > 0 and step % report_every == 0 else None
        result.steps.append(
            StepRecord(
                step, len(scheduler.running), len(scheduler.waiting), len(scheduler.swapped), out.num_tokens,
                len(out.preempted), finished, cache_manager.num_free_blocks,
                -1 if report is None else report.token_slots, now, duration, report,
                len(out.swap_out) + len(out.swap_in),
            )
        )  # fmt: skip
        if bar is not None and finished:
            bar.update(finished)
        now += duration
        step += 1
    if bar is not None:
        bar.close()
    result.num_preemptions = scheduler.num_preemptions
    result.num_self_preemptions = scheduler.num_self_preemptions
    result.num_swap_fallbacks = scheduler.num_swap_fallbacks
    return result


def scripted_step(scheduler: Scheduler, now: float, token: int = 0) -> tuple[SchedulerOutput, list[Sequence]]:
    """One step with the model replaced by a script: schedule, then the scheduler's own end of a
    step with ``token`` sampled by every sequence that reached its last token (the stop rules end
    a sequence at its ``max_tokens``). Returns the step's schedule and the sequences it finished.
    The trace replay, notebook 04 and the scheduler tests all step this way."""
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, StepUpdate.scripted(out, token), now)


def linear_step_time(
    per_step: float = 1.0, per_token: float = 0.0, per_block_copied: float = 0.0
) -> StepTime:
    """A ``step_time`` for :func:`run_trace` that charges the work a step does.

    A step lasts ``per_step``, plus ``per_token`` for every token it computes (prefill chunks,
    recomputation and decodes alike), plus ``per_block_copied`` for every block it swaps out or in.
    ``linear_step_time()`` is the uniform clock: each step one unit, as without a ``step_time``,
    except that idle gaps are skipped instead of recorded as empty steps (latencies are the same).
    """
    if not per_step > 0:
        raise ValueError(f"per_step must be positive (a step always takes time), got {per_step!r}")
    if not (per_token >= 0 and per_block_copied >= 0):
        raise ValueError(
            f"prices must be >= 0, got per_token={per_token!r}, per_block_copied={per_block_copied!r}"
        )

    def step_time(out: SchedulerOutput) -> float:
        copies = len(out.swap_out) + len(out.swap_in)
        return per_step + per_token * out.num_tokens + per_block_copied * copies

    return step_time


def cost_model_step_time(model: object, block_size: int | None = None) -> StepTime:
    """A ``step_time`` for :func:`run_trace` from a :class:`~.cost_model.CostModel`.

    A step processes ``out.num_tokens`` new tokens, and each scheduled sequence's attention reads
    its whole context so far (``start + num_new_tokens`` cached token states). Give ``block_size``
    for a paged cache, so that the model can charge each block read (contiguous memory: ``None``).
    """

    def step_time(out: SchedulerOutput) -> float:
        contexts = [s.start + s.num_new_tokens for s in out.scheduled]
        blocks = sum(cdiv(c, block_size) for c in contexts) if block_size else 0
        return model.step_time(out.num_tokens, sum(contexts), blocks)  # type: ignore[attr-defined]

    return step_time
