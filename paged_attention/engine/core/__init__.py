"""Who runs this step (vLLM v1: ``vllm/v1/core/sched/``, ``vllm/v1/core/kv_cache_utils.py``).

    scheduler    continuous batching, the token budget, chunked prefill, preemption; and
                 update_from_output, the one owner of the end of a step
    policy       who may join and who steps back (continuous batching's two choices)
    step         the records a step passes along (SchedulerOutput, StepUpdate)
    capacity     how many blocks a budget holds; the longest request that fits
    transaction  a step is a transaction: every part owns its undo

This room decides; it never tokenizes, loads a model or builds an output for a user.
"""
