# Copied from vLLM, https://github.com/vllm-project/vllm (Apache License 2.0; its SPDX lines, if any, are kept).
# source: examples/offline_inference/basic.py
# commit: f51e265074b7fc757b003ab20186dddfa834bb39
# sha256 of the original: 02bd4a84126175417491b183e16ea477785a6ca2a99f55f18a6d6f838baf1f00
# Everything after the "# --- original file follows ---" line is the original byte for byte, except
# these lines (each - line of the original was replaced by the + line after it):
#   - from vllm import LLM, SamplingParams
#   + from paged_attention import LLM, SamplingParams
#   - llm = LLM(model="facebook/opt-125m")
#   + llm = LLM(model="paged-attention/tiny-llama")
# The original (an older layout, before basic/basic.py) has no SPDX line and no newline at its end;
# neither has this copy.
# --- original file follows ---
from paged_attention import LLM, SamplingParams

# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

# Create an LLM.
llm = LLM(model="paged-attention/tiny-llama")
# Generate texts from the prompts. The output is a list of RequestOutput objects
# that contain the prompt, generated text, and other information.
outputs = llm.generate(prompts, sampling_params)
# Print the outputs.
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")