"""Scheduler tests without a model: sequences of given lengths, and a step that appends a dummy token."""

from paged_attention.engine.sampling import SamplingParams
from paged_attention.engine.scheduler import Scheduler, SchedulerOutput
from paged_attention.engine.sequence import FinishReason, Sequence


def seq(seq_id: int, prompt_len: int, max_tokens: int = 8, arrival: float | None = None) -> Sequence:
    """A sequence of ``prompt_len`` dummy tokens; it arrives at ``seq_id`` unless ``arrival`` is given."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(
        seq_id, str(seq_id), [1] * prompt_len, params, float(seq_id if arrival is None else arrival)
    )


def step(scheduler: Scheduler, finish: bool = False) -> SchedulerOutput:
    """One step with a scripted model: each sampling sequence gets a token; with ``finish``, a
    sequence that reaches ``max_tokens`` ends and leaves the scheduler."""
    out = scheduler.schedule()
    scheduler.after_step(out.scheduled)
    for s in out.scheduled:
        if s.needs_logits:
            s.seq.output_token_ids.append(7)
            if finish and len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                s.seq.finish(FinishReason.LENGTH, 0.0)
                scheduler.finish(s.seq)
    return out
