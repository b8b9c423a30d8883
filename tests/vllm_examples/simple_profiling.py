# Copied from vLLM, https://github.com/vllm-project/vllm (Apache License 2.0; its SPDX lines, if any, are kept).
# source: examples/offline_inference/simple_profiling.py
# commit: 5d56f61cd714837f972a42ed6eafa6cc88cb8670
# sha256 of the original: 40ea76fe50704a188c330afca4c86c230569c5f4c8c1a46120a8eba255f8df5c
# Everything after the "# --- original file follows ---" line is the original byte for byte, except
# these lines (each - line of the original was replaced by the + line after it):
#   - from vllm import LLM, SamplingParams
#   + from paged_attention import LLM, SamplingParams
#   -         model="facebook/opt-125m",
#   +         model="paged-attention/tiny-llama",
# The newer version: the profiler is configured by LLM(profiler_config=...); see
# simple_profiling_26d25d4.py for the older one (VLLM_TORCH_PROFILER_DIR).
# --- original file follows ---
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import time

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


def main():
    # Create an LLM.
    llm = LLM(
        model="paged-attention/tiny-llama",
        tensor_parallel_size=1,
        profiler_config={
            "profiler": "torch",
            "torch_profiler_dir": "./vllm_profile",
        },
    )

    llm.start_profile()

    # Generate texts from the prompts. The output is a list of RequestOutput
    # objects that contain the prompt, generated text, and other information.
    outputs = llm.generate(prompts, sampling_params)

    llm.stop_profile()

    # Print the outputs.
    print("-" * 50)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\nGenerated text: {generated_text!r}")
        print("-" * 50)

    # Add a buffer to wait for profiler in the background process
    # (in case MP is on) to finish writing profiling output.
    time.sleep(10)


if __name__ == "__main__":
    main()
