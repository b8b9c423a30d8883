"""What runs the model (vLLM v1: ``vllm/v1/worker/``, ``vllm/v1/kv_cache_interface.py``).

model_runner  packs a step (input ids, positions, slot mapping, block tables) and runs the
              transformers model with our attention function
kv_cache      the KV tensors: KVCacheSpec (bytes per token) and one tensor pair per layer
"""
