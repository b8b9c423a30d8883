"""The paper's experiments: traces, GPU step times, and the real scheduler replayed without a model.

traces      synthetic ShareGPT-/Alpaca-like requests (log-normal lengths, Poisson arrivals)
cost_model  a roofline model of a step on an A100 / H100 / H200 for OPT-13B, Llama-2-7B, Llama-3-8B
replay      run_trace: the real scheduler and a cache manager over a trace, no forward pass
serve       one trace, one manager, timed by the cost model: what the bench commands run
paper       the paper's setup and every number it reports (the one source for cited numbers)
"""
