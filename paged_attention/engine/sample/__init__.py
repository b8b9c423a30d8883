"""From logits to tokens (vLLM v1: ``vllm/v1/sample/``).

sampling   the batched sampler (greedy, temperature, top-k/p, min-p, seeds)
logits     penalties, bias, allowed tokens, bad words: the logits before the draw
logprobs   vLLM's Logprob entries, raw or processed
gumbel     the Gumbel-max draw with hashed noise, as vLLM's CPU sampler draws
rejection  greedy and probabilistic verification of speculative drafts
"""
