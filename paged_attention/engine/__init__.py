"""The serving engine: requests in, tokens out, one step at a time over the KV-cache manager.

The path of a request, module by module::

    inputs             prompt -> token ids, and the checks a request must pass
    intake             add_request's checks, then the request and its sequences
    sequence           one prompt + its output so far, and where it is in its life
    request            a request's sequences, and the interface the step drives them through
    parallel_sampling  n samples forked from one prompt          beam_search  beams forked and freed
    scheduler          who runs this step, with how many tokens (continuous batching, preemption),
                       and update_from_output, the one owner of the end of a step
    policy             who may join and who steps back (continuous batching's two choices)
    step               the records a step passes along (SchedulerOutput, StepUpdate)
    kv_cache           the KV tensors (KVCacheSpec: bytes per token)    capacity  how many blocks
    model_runner       packs the step, runs the transformers model with our attention function
    params             SamplingParams, BeamSearchParams: what a request asks for, checked at the door
    logits             penalties, bias, allowed tokens, bad words: the logits before the draw
    sampling           the batched sampler        logprobs  vLLM's Logprob entries, raw or processed
    stop_rules         when a sequence ends (they decide; the scheduler finishes it)
    detokenizer        text a few tokens at a time (prefix and read offsets)
    transaction        a step is a transaction: every part owns its undo
    outputs            RequestOutput / CompletionOutput (vLLM's) and step counters
    llm_engine         LLMEngine: add_request / step / abort_request
    llm                LLM: vLLM's offline front (generate, chat, beam_search, metrics, profiling)
    engine_args        EngineArgs: every setting, from keywords or a command line; vLLM's ignored/refused
    generation_config  default sampling parameters from the model's generation_config.json
    metrics            vLLM's Counter/Gauge/Histogram records (LLM.get_metrics)
    compatibility      the README's vLLM compatibility table, as data
    chat               conversations checked and rendered by the chat template

The engine uses :mod:`paged_attention.memory`, :mod:`paged_attention.kernels` and, to load what it
serves, :mod:`paged_attention.models`; it never imports the apparatus around it (baselines,
experiments, pictures, commands).
"""
