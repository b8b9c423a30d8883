"""Scheduler tests without a model: sequences of given lengths, and the replay's scripted step."""

from paged_attention.engine.core.scheduler import Scheduler, SchedulerOutput
from paged_attention.engine.sample.sampling import SamplingParams
from paged_attention.engine.sequence import Sequence
from paged_attention.experiments.replay import scripted_step


def seq(seq_id: int, prompt_len: int, max_tokens: int = 8, arrival: float | None = None) -> Sequence:
    """A sequence of ``prompt_len`` dummy tokens; it arrives at ``seq_id`` unless ``arrival`` is given."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(
        seq_id, str(seq_id), [1] * prompt_len, params, float(seq_id if arrival is None else arrival)
    )


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One step with a scripted model: each sampling sequence gets token 7, through the scheduler's
    own end of a step (a sequence that reaches ``max_tokens`` finishes and frees its blocks)."""
    return scripted_step(scheduler, 0.0, token=7)[0]
