# Copied from vLLM, https://github.com/vllm-project/vllm (Apache License 2.0; its SPDX lines, if any, are kept).
# source: examples/offline_inference/basic_with_model_default_sampling.py
# commit: 5f95f8a180da9e56de98130284920812c0f3f254
# sha256 of the original: fc323231f6adf625f3b3882990982a1e4582e1fe2f8f725415fef0a0673bda5f
# Everything after the "# --- original file follows ---" line is the original byte for byte, except
# these lines (each - line of the original was replaced by the + line after it):
#   - from vllm import LLM
#   + from paged_attention import LLM
#   - llm = LLM(model="Qwen/Qwen2.5-0.5B-Instruct", generation_config="auto")
#   + llm = LLM(model="paged-attention/tiny-llama", generation_config="auto")
# The original has no SPDX line.
# --- original file follows ---
from paged_attention import LLM

# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]

# Create an LLM with built-in default generation config.
# The generation config is set to None by default to keep
# the behavior consistent with the previous version.
# If you want to use the default generation config from the model,
# you should set the generation_config to "auto".
llm = LLM(model="paged-attention/tiny-llama", generation_config="auto")

# Load the default sampling parameters from the model.
sampling_params = llm.get_default_sampling_params()
# Modify the sampling parameters if needed.
sampling_params.temperature = 0.5

# Generate texts from the prompts. The output is a list of RequestOutput objects
# that contain the prompt, generated text, and other information.
outputs = llm.generate(prompts, sampling_params)
# Print the outputs.
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
