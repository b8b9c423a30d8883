"""The serving engine: requests in, tokens out, one step at a time over the KV-cache manager.

The path of a request, module by module::

    inputs             prompt -> token ids
    sequence           one prompt + its output so far, and where it is in its life
    request            a request's sequences, and the interface the step drives them through
    parallel_sampling  n samples forked from one prompt          beam_search  beams forked and freed
    scheduler          who runs this step, with how many tokens (continuous batching, preemption)
    model_runner       packs the step, runs the transformers model with our attention function
    sampling           SamplingParams and the batched sampler    stop_checker  when a sequence ends
    outputs            RequestOutput / CompletionOutput (vLLM's) and step counters
    llm_engine         LLMEngine: add_request / step / abort_request
    llm                LLM: vLLM's offline front (generate, chat, beam_search)
    chat               conversations checked and rendered by the chat template
    models, embedded   loading any model offline; the embedded tiny Llama
    pretrained         SmolLM2-135M-Instruct: fetched at install (sha256-checked), converted once, verified

The engine uses :mod:`paged_attention.memory` and :mod:`paged_attention.kernels` and never imports
the apparatus around it (baselines, experiments, pictures, commands).
"""
