# Copied from vLLM, https://github.com/vllm-project/vllm (Apache License 2.0; its SPDX lines, if any, are kept).
# source: examples/offline_inference/llm_engine_example.py
# commit: 2758bed7fb2f428f00ebb90ac75ba7cb95173856
# sha256 of the original: 66d8549dcbc82f4239f10a6b8f6ce8bb076f53173e8eded17cbed36cdc6327d0
# Everything after the "# --- original file follows ---" line is the original byte for byte, except
# these lines (each - line of the original was replaced by the + line after it):
#   - from vllm import EngineArgs, LLMEngine, RequestOutput, SamplingParams
#   + from paged_attention import EngineArgs, LLMEngine, RequestOutput, SamplingParams
#   - from vllm.utils import FlexibleArgumentParser
#   + from argparse import ArgumentParser as FlexibleArgumentParser
# No model is named in the script: it serves EngineArgs' default model (vLLM's: facebook/opt-125m;
# paged_attention's: the embedded paged-attention/tiny-llama), so no model line is changed.
# --- original file follows ---
# SPDX-License-Identifier: Apache-2.0

import argparse

from paged_attention import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from argparse import ArgumentParser as FlexibleArgumentParser


def create_test_prompts() -> list[tuple[str, SamplingParams]]:
    """Create a list of test prompts with their sampling parameters."""
    return [
        ("A robot may not injure a human being",
         SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1)),
        ("To be or not to be,",
         SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
        ("What is the meaning of life?",
         SamplingParams(n=2,
                        best_of=5,
                        temperature=0.8,
                        top_p=0.95,
                        frequency_penalty=0.1)),
    ]


def process_requests(engine: LLMEngine,
                     test_prompts: list[tuple[str, SamplingParams]]):
    """Continuously process a list of prompts and handle the outputs."""
    request_id = 0

    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1

        request_outputs: list[RequestOutput] = engine.step()

        for request_output in request_outputs:
            if request_output.finished:
                print(request_output)


def initialize_engine(args: argparse.Namespace) -> LLMEngine:
    """Initialize the LLMEngine from the command line arguments."""
    engine_args = EngineArgs.from_cli_args(args)
    return LLMEngine.from_engine_args(engine_args)


def main(args: argparse.Namespace):
    """Main function that sets up and runs the prompt processing."""
    engine = initialize_engine(args)
    test_prompts = create_test_prompts()
    process_requests(engine, test_prompts)


if __name__ == '__main__':
    parser = FlexibleArgumentParser(
        description='Demo on using the LLMEngine class directly')
    parser = EngineArgs.add_cli_args(parser)
    args = parser.parse_args()
    main(args)
