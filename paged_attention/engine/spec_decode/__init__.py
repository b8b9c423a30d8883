"""Speculative decoding (vLLM v1: ``vllm/v1/spec_decode/``).

speculative  SpeculativeConfig: vLLM's ``speculative_config`` checked
ngram        n-gram drafts proposed from the sequence's own tokens (prompt lookup)
speculation  drafts scheduled, verified in one step and rolled back when rejected
"""
