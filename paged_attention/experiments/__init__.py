"""The paper's experiments: traces, GPU step times, the real scheduler replayed without a model,
and the measured runs behind every ``bench`` command (their figures are in :mod:`paged_attention.viz`).

traces                  synthetic ShareGPT-/Alpaca-like requests (log-normal lengths, Poisson arrivals)
cost_model              a roofline step time on an A100 / H100 / H200, for OPT-13B, Llama-2-7B, Llama-3-8B
replay                  run_trace: the real scheduler and a cache manager over a trace, no forward pass
serve                   one trace, one manager, timed by the cost model: what the replayed experiments run
paper                   the paper's setup and every number it reports (the one source for cited numbers)
fragmentation           where KV memory goes per manager (Figure 2)
capacity                requests running at once, at the paper's point and against the KV budget (Figure 13)
latency                 normalized latency against request rate, the rate each manager sustains (Figure 12)
block_size              normalized latency against the block size (Figure 18b)
throughput              the real engine and model, paged vs contiguous reservations vs static batches
sharing                 memory saved by parallel sampling and beam search, a cached prefix (Fig. 15, 16)
engine_vs_transformers  our engine against transformers' static and continuous batching
allocator_timing        the block allocator's cost per allocate/free pair, ordered, scrambled and forked
kernel_timing           the kernels checked against the reference, and decode bandwidth per contender
progress                one progress bar over an experiment's runs
"""
