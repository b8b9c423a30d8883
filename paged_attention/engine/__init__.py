"""The serving engine: requests in, tokens out, one step at a time over the KV-cache manager.

The rooms follow vLLM v1's tree (``vllm/v1/...``), so each of our files has its counterpart by folder::

    core/         who runs this step        scheduler, policy, step (its records), capacity,
                  (v1/core/sched/)          transaction (a step is a transaction: every part owns its undo)
    worker/       what runs the model       model_runner (packs a step, our attention in transformers),
                  (v1/worker/)              kv_cache (KVCacheSpec: bytes per token; the KV tensors)
    sample/       logits to tokens          sampling (the batched sampler), logits (penalties, bias,
                  (v1/sample/)              bad words), logprobs, gumbel, rejection (verifying drafts)
    spec_decode/  speculative decoding      speculative (its config), ngram (drafts), speculation
                  (v1/spec_decode/)
    structured_output/  constraints as masks   params (StructuredOutputsParams), grammar (xgrammar's
                  (v1/structured_output/)   compiler and a matcher per sequence), reference (brute force)

The request and what it asks for (v1/request.py, sampling_params.py, outputs.py)::

    params             SamplingParams, BeamSearchParams: what a request asks for, checked at the door
    sequence           one prompt + its output so far, and where it is in its life
    request            a request's sequences, and the interface the step drives them through
    parallel_sampling  n samples forked from one prompt          beam_search  beams forked and freed
    stop_rules         when a sequence ends (they decide; the scheduler finishes it)
    detokenizer        text a few tokens at a time (prefix and read offsets)
    outputs            RequestOutput / CompletionOutput (vLLM's) and step counters

The engine and its fronts (v1/engine/, entrypoints/)::

    inputs, intake     prompt -> token ids; add_request's checks, then the request and its sequences
    llm_engine         LLMEngine: add_request / step / abort_request (the engine core, in-process)
    engine_core        EngineCoreProc: the engine in its own process, a busy loop over ZeroMQ
    core_client        how a front reaches the core: on a thread (ThreadClient) or a process (MPClient)
    async_llm          AsyncLLM: concurrent requests streamed over a core client (the server's front)
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
