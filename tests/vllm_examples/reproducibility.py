# Copied from vLLM, https://github.com/vllm-project/vllm (Apache License 2.0; its SPDX lines, if any, are kept).
# source: examples/offline_inference/reproducibility.py
# commit: 10ceafe330abe5f3f8b103cd6964bd14c5bc1fcb
# sha256 of the original: 82af88427709aa3f94727be6eb87ed98790e63efe8143267536d53a0e41dc1bd
# Everything after the "# --- original file follows ---" line is the original byte for byte, except
# these lines (each - line of the original was replaced by the + line after it):
#   - from vllm import LLM, SamplingParams
#   + from paged_attention import LLM, SamplingParams
#   -     llm = LLM(model="facebook/opt-125m", seed=SEED)
#   +     llm = LLM(model="paged-attention/tiny-llama", seed=SEED)
# --- original file follows ---
# SPDX-License-Identifier: Apache-2.0
"""
Demonstrates how to achieve reproducibility in vLLM.

Main article: https://docs.vllm.ai/en/latest/usage/reproducibility.html
"""

import os
import random

from paged_attention import LLM, SamplingParams

# V1 only: Turn off multiprocessing to make the scheduling deterministic.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

# V0 only: Set the global seed. The default seed is None, which is
# not reproducible.
SEED = 42

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    llm = LLM(model="paged-attention/tiny-llama", seed=SEED)
    outputs = llm.generate(prompts, sampling_params)
    print("-" * 50)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\nGenerated text: {generated_text!r}")
        print("-" * 50)

    # Try generating random numbers outside vLLM
    # The same number is output across runs, meaning that the random state
    # in the user code has been updated by vLLM
    print(random.randint(0, 100))


if __name__ == "__main__":
    main()
