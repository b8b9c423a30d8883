"""A trace executor: the real scheduler and cache manager, with the model replaced by a script.

Memory experiments do not need a model's numbers, only its *lengths*: each request of a trace says
how many tokens it will generate. The executor runs the very same
:class:`~paged_attention.scheduler.Scheduler` and cache manager as the engine, step by step, and
instead of a forward pass it appends a dummy token to every sequence that samples, finishing it
when its scripted output length is reached.
An hour of traffic takes seconds, and every step's state is recorded for pictures.

Time is counted in steps (one model iteration each); requests arrive at their trace step.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from .cache_manager import KVCacheManager
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import FinishReason, Sequence
from .workloads import TraceRequest


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
    token_slots: int  # slots holding token states (memory report)


@dataclass
class TraceResult:
    steps: list[StepRecord] = field(default_factory=list)
    finish_step: dict[int, int] = field(default_factory=dict)  # request index -> step it finished
    num_preemptions: int = 0

    @property
    def peak_running(self) -> int:
        return max((s.num_running for s in self.steps), default=0)

    @property
    def mean_running(self) -> float:
        return sum(s.num_running for s in self.steps) / max(1, len(self.steps))


def run_trace(
    trace: Seq[TraceRequest],
    cache: KVCacheManager,
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    preemption_mode: str = "recompute",
    max_steps: int = 1_000_000,
) -> TraceResult:
    """Serve ``trace`` (``arrival_time`` in steps) with the real scheduler; return per-step records."""
    scheduler = Scheduler(cache, max_num_seqs, max_num_batched_tokens, preemption_mode)
    pending = sorted(range(len(trace)), key=lambda i: (trace[i].arrival_time, i))
    sequences: dict[int, Sequence] = {}
    result = TraceResult()
    next_arrival = 0
    step = 0
    while next_arrival < len(pending) or scheduler.has_unfinished():
        if step >= max_steps:
            raise RuntimeError(f"trace did not finish within {max_steps} steps")
        while next_arrival < len(pending) and trace[pending[next_arrival]].arrival_time <= step:
            index = pending[next_arrival]
            request = trace[index]
            params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
            seq = Sequence(index, str(index), [0] * request.prompt_len, params, request.arrival_time)
            scheduler.add(seq)
            sequences[index] = seq
            next_arrival += 1
        out = scheduler.schedule()
        scheduler.after_step(out.scheduled)
        finished = 0
        for s in out.scheduled:
            if s.samples:
                seq = s.seq
                seq.output_token_ids.append(0)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    seq.finish(FinishReason.LENGTH, float(step))
                    scheduler.finish(seq)
                    result.finish_step[seq.seq_id] = step
                    finished += 1
        report = cache.memory_report()
        result.steps.append(
            StepRecord(
                step, len(scheduler.running), len(scheduler.waiting), len(scheduler.swapped), out.num_tokens,
                len(out.preempted), finished, getattr(cache, "num_free_blocks", 0), report.token_slots,
            )
        )  # fmt: skip
        step += 1
    result.num_preemptions = scheduler.num_preemptions
    return result
