# Copied from vLLM, https://github.com/vllm-project/vllm (Apache License 2.0; its SPDX lines, if any, are kept).
# source: examples/offline_inference/context_extension.py
# commit: 6333d8027f7a9a179434be12f026642dbb764976
# sha256 of the original: e4213bde0dbeeef27f5b349e6c0bbad7b2c7db60db0eb65f0644ec771ba9187d
# Everything after the "# --- original file follows ---" line is the original byte for byte, except
# these lines (each - line of the original was replaced by the + line after it):
#   - from vllm import LLM, SamplingParams
#   + from paged_attention import LLM, SamplingParams
#   - llm = LLM(model="Qwen/Qwen3-0.6B", hf_overrides=hf_overrides)
#   + llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", hf_overrides=hf_overrides)
# Its max_model_len (131072, set through hf_overrides) is kept: on a CPU the tiny model's KV cache
# (512 MiB, 2 KiB per token in float32) holds 262144 tokens, and yarn rope scaling gives the positions.
# --- original file follows ---
# SPDX-License-Identifier: Apache-2.0

from paged_attention import LLM, SamplingParams

rope_theta = 1000000
original_max_position_embeddings = 32768
factor = 4.0

# Use yarn to extend context
hf_overrides = {
    "rope_theta": rope_theta,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original_max_position_embeddings,
    },
    "max_model_len": int(original_max_position_embeddings * factor),
}

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", hf_overrides=hf_overrides)

sampling_params = SamplingParams(
    temperature=0.8,
    top_p=0.95,
    max_tokens=128,
)

conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
]
outputs = llm.chat(conversation, sampling_params, use_tqdm=False)


def print_outputs(outputs):
    print("\nGenerated Outputs:\n" + "-" * 80)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\n")
        print(f"Generated text: {generated_text!r}")
        print("-" * 80)


print_outputs(outputs)
