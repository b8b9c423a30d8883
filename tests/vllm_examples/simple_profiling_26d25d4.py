# Copied from vLLM, https://github.com/vllm-project/vllm (Apache License 2.0; its SPDX lines, if any, are kept).
# source: examples/offline_inference/simple_profiling.py
# commit: 26d25d4ac71151b1f81f8cb9ce21f98640c421d5
# sha256 of the original: 8645065361ef0ca18466858488d873ee02e27bd9d6178e5d42271845e6e1f946
# Everything after the "# --- original file follows ---" line is the original byte for byte, except
# these lines (each - line of the original was replaced by the + line after it):
#   - from vllm import LLM, SamplingParams
#   + from paged_attention import LLM, SamplingParams
#   -     llm = LLM(model="facebook/opt-125m", tensor_parallel_size=1)
#   +     llm = LLM(model="paged-attention/tiny-llama", tensor_parallel_size=1)
# The older version of simple_profiling.py: the profiler is enabled by VLLM_TORCH_PROFILER_DIR.
# --- original file follows ---
# SPDX-License-Identifier: Apache-2.0

import os
import time

from paged_attention import LLM, SamplingParams

# enable torch profiler, can also be set on cmd line
os.environ["VLLM_TORCH_PROFILER_DIR"] = "./vllm_profile"

# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

if __name__ == "__main__":

    # Create an LLM.
    llm = LLM(model="paged-attention/tiny-llama", tensor_parallel_size=1)

    llm.start_profile()

    # Generate texts from the prompts. The output is a list of RequestOutput
    # objects that contain the prompt, generated text, and other information.
    outputs = llm.generate(prompts, sampling_params)

    llm.stop_profile()

    # Print the outputs.
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

    # Add a buffer to wait for profiler in the background process
    # (in case MP is on) to finish writing profiling output.
    time.sleep(10)
