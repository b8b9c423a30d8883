"""Structured outputs: a grammar as a mask over the vocabulary (vLLM v1: ``vllm/v1/structured_output/``).

params   StructuredOutputsParams: a JSON schema, a regex, a choice or a grammar a request's output must match
grammar  the grammar engine (xgrammar, as vLLM's default backend): one compiler per engine, one matcher
         per sequence, kept in step with its output tokens; the mask of the tokens allowed next
reference the same mask by brute force (every token tried with a regex's partial match): the oracle
"""
