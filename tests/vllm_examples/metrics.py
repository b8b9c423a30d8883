# Copied from vLLM, https://github.com/vllm-project/vllm (Apache License 2.0; its SPDX lines, if any, are kept).
# source: examples/offline_inference/metrics.py
# commit: 26063889b897dc8c667c14ce91c3015eb281edb2
# sha256 of the original: 9ef60402e2892fcb035275f88362187cbf20f9ff8b7864170b78a76417e642b2
# Everything after the "# --- original file follows ---" line is the original byte for byte, except
# these lines (each - line of the original was replaced by the + line after it):
#   - from vllm import LLM, SamplingParams
#   + from paged_attention import LLM, SamplingParams
#   - from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector
#   + from paged_attention import Counter, Gauge, Histogram, Vector
#   -     llm = LLM(model="facebook/opt-125m", disable_log_stats=False)
#   +     llm = LLM(model="paged-attention/tiny-llama", disable_log_stats=False)
# --- original file follows ---
# SPDX-License-Identifier: Apache-2.0

from paged_attention import LLM, SamplingParams
from paged_attention import Counter, Gauge, Histogram, Vector

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
    llm = LLM(model="paged-attention/tiny-llama", disable_log_stats=False)

    # Generate texts from the prompts.
    outputs = llm.generate(prompts, sampling_params)

    # Print the outputs.
    print("-" * 50)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\nGenerated text: {generated_text!r}")
        print("-" * 50)

    # Dump all metrics
    for metric in llm.get_metrics():
        if isinstance(metric, Gauge):
            print(f"{metric.name} (gauge) = {metric.value}")
        elif isinstance(metric, Counter):
            print(f"{metric.name} (counter) = {metric.value}")
        elif isinstance(metric, Vector):
            print(f"{metric.name} (vector) = {metric.values}")
        elif isinstance(metric, Histogram):
            print(f"{metric.name} (histogram)")
            print(f"    sum = {metric.sum}")
            print(f"    count = {metric.count}")
            for bucket_le, value in metric.buckets.items():
                print(f"    {bucket_le} = {value}")


if __name__ == "__main__":
    main()
