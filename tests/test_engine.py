"""The engine against transformers' own ``generate``, under memory pressure, on three architectures."""

import random

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from paged_attention.engine.llm import LLM
from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.engine.sample.sampling import SamplingParams
from paged_attention.models import DEFAULT_MODEL_NAME, load_model, load_tokenizer
from tests.streaming import finished_only

PROMPTS = [[5], [17, 99, 4, 250, 31], list(range(40, 57)), [7, 300, 12] * 13]  # 1, 5, 17, 39 tokens


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _random_model(kind: str, tokenizer) -> torch.nn.Module:
    torch.manual_seed(0)
    special = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if kind == "qwen2":  # GQA: 4 query heads share 2 KV heads
        config = Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=0.2,
            **special,
        )
        return Qwen2ForCausalLM(config).eval()
    if kind == "gpt2":  # learned positions, fused QKV, no GQA
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2, **special)
        return GPT2LMHeadModel(config).eval()
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        initializer_range=0.3,
        **special,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def models(tokenizer):
    default, _ = load_model(DEFAULT_MODEL_NAME)
    return {
        "llama": default,
        "qwen2": _random_model("qwen2", tokenizer),
        "gpt2": _random_model("gpt2", tokenizer),
        "micro": _random_model("micro", tokenizer),
    }


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_matches_transformers_generate_under_preemption_and_chunked_prefill(arch, models, tokenizer):
    model = models[arch]
    expected = [hf_greedy(model, p, 16) for p in PROMPTS]
    # 12 blocks of 4 slots cannot hold all four requests (up to 55 tokens each): sequences get
    # preempted and recomputed; a budget of 8 tokens per step splits the long prompts into chunks.
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=16, max_num_batched_tokens=8)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.cache_manager.num_free_blocks == 16


def test_triton_backend_under_the_interpreter_matches_too(models, tokenizer):
    model = models["qwen2"]
    prompts = PROMPTS[:3]
    expected = [hf_greedy(model, p, 4) for p in prompts]
    llm = LLM(model, tokenizer=tokenizer, block_size=8, num_kv_blocks=32, attention_backend="triton")
    assert llm.llm_engine.runner.backend == "triton"
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_compiled_backend_takes_every_decode_step_and_matches_generate(models, tokenizer, monkeypatch):
    """The default CPU backend: every decode step runs the compiled in-place kernel over the whole
    batch; greedy output equals transformers'."""
    from paged_attention.kernels import compiled

    model = models["llama"]
    prompts = [[(7 * i + j) % 500 + 3 for j in range(40 + 9 * i)] for i in range(12)]  # 40..139 tokens
    expected = [hf_greedy(model, p, 6) for p in prompts]
    calls = []
    real = compiled.paged_decode
    monkeypatch.setattr(compiled, "paged_decode", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    llm = LLM(model, tokenizer=tokenizer, block_size=16, num_kv_blocks=160)
    runner = llm.llm_engine.runner
    assert runner.backend == "compiled" and runner.step_backend() == "compiled"
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert calls and max(calls) == 12  # the whole batch, in place


def _serve_with_arrivals(
    engine: LLMEngine, requests: list[tuple[int, list[int], int]]
) -> dict[str, list[int]]:
    """Add each request at its arrival step, step until done, return outputs by request id."""
    pending = sorted(range(len(requests)), key=lambda i: requests[i][0])
    results, step = {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and requests[pending[0]][0] <= step:
            index = pending.pop(0)
            _, prompt, max_tokens = requests[index]
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(str(index), prompt, params)
        for out in finished_only(engine.step()):
            results[out.request_id] = out.outputs[0].token_ids
        step += 1
    return results


def test_soak_500_requests_tight_memory_both_preemption_modes_match_unlimited_memory(models, tokenizer):
    rng = random.Random(0)
    requests = [
        (rng.randint(0, 300), [rng.randrange(3, 500) for _ in range(rng.randint(1, 24))], rng.randint(1, 12))
        for _ in range(500)
    ]
    model = models["micro"]
    reference = _serve_with_arrivals(LLMEngine(model, tokenizer, block_size=4, num_kv_blocks=4000), requests)
    for mode in ("recompute", "swap"):
        engine = LLMEngine(
            model, tokenizer, block_size=4, num_kv_blocks=12, preemption_mode=mode, max_num_batched_tokens=32
        )
        assert _serve_with_arrivals(engine, requests) == reference
        assert engine.scheduler.num_preemptions > 50
        assert engine.cache_manager.num_free_blocks == 12 and not engine.cache_manager.page_tables
        if mode == "swap":
            assert (
                engine.cache_manager.cpu_allocator.num_free_blocks
                == engine.cache_manager.cpu_allocator.num_blocks
            )


def test_the_articles_program_runs_with_only_the_import_and_model_name_changed():
    # A program written for vLLM's offline API; only the import line and the model name differ.
    from paged_attention import LLM, SamplingParams

    llm = LLM(model=DEFAULT_MODEL_NAME, dtype="float16", gpu_memory_utilization=0.9)
    sampling_params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=12)
    prompts = ["Once upon a time", "Paged memory is", "A block table maps"]
    outputs = llm.generate(prompts, sampling_params)
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        assert isinstance(output.outputs[0].text, str) and 1 <= len(output.outputs[0].token_ids) <= 12
        assert output.outputs[0].finish_reason in ("stop", "length")
        assert output.metrics.time_to_first_token is not None and output.metrics.time_to_first_token >= 0


def test_seeded_samples_do_not_depend_on_the_rest_of_the_batch(models, tokenizer):
    llm = LLM(models["llama"], tokenizer=tokenizer, block_size=4, num_kv_blocks=64)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=10, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    others = SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True)
    together = llm.generate(crowd, [others, params, others], use_tqdm=False)[1].outputs[0].token_ids
    assert alone == together


def test_n_samples_use_seed_plus_index(models, tokenizer):
    llm = LLM(models["llama"], tokenizer=tokenizer, block_size=4, num_kv_blocks=64)
    two = llm.generate(
        [PROMPTS[1]], SamplingParams(n=2, seed=3, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert [o.index for o in two.outputs] == [0, 1]
    for i in range(2):
        single = SamplingParams(seed=3 + i, max_tokens=8, ignore_eos=True)
        assert (
            llm.generate([PROMPTS[1]], single, use_tqdm=False)[0].outputs[0].token_ids
            == two.outputs[i].token_ids
        )


def test_stop_rules(models, tokenizer):
    llm = LLM(models["llama"], tokenizer=tokenizer, num_kv_blocks=64)
    greedy = llm.generate(
        [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    stop_id = greedy.token_ids[3]
    out = llm.generate(
        [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_id) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    late = llm.generate(
        [PROMPTS[2]],
        SamplingParams(
            temperature=0,
            max_tokens=12,
            stop_token_ids=[stop_id],
            min_tokens=greedy.token_ids.index(stop_id) + 2,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert late.token_ids[: greedy.token_ids.index(stop_id) + 1] != out.token_ids or len(
        late.token_ids
    ) > len(out.token_ids)
    text = greedy.text
    cut = text[4:7]
    stopped = llm.generate(
        [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, stop=cut, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == cut and cut not in stopped.text
    assert text.startswith(stopped.text)


@pytest.mark.parametrize(
    ("prompt", "params", "error", "message"),
    [
        ("", SamplingParams(), ValueError, "prompt is empty"),
        ([], SamplingParams(), ValueError, "prompt is empty"),
        ([1] * 1020, SamplingParams(max_tokens=8), ValueError, "exceeds max_model_len"),
        ([1] * 1024, SamplingParams(), ValueError, "leaves no room"),
        ([1, 99999], SamplingParams(), ValueError, "prompt token ids must be in"),
        (3.5, SamplingParams(), TypeError, "a prompt must be a string or a list of token ids"),
        ("hi", {"temperature": 0}, TypeError, "must be a SamplingParams"),
    ],
)
def test_bad_requests_are_rejected_and_the_engine_keeps_serving(
    models, tokenizer, prompt, params, error, message
):
    engine = LLMEngine(models["llama"], tokenizer, num_kv_blocks=128)
    engine.add_request("good", PROMPTS[1], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(error, match=message):
        engine.add_request("bad", prompt, params)
    finished = []
    while engine.has_unfinished_requests():
        finished += finished_only(engine.step())
    assert [o.request_id for o in finished] == ["good"] and len(finished[0].outputs[0].token_ids) == 3


def test_a_request_bigger_than_the_whole_cache_is_rejected(models, tokenizer):
    llm = LLM(models["llama"], tokenizer=tokenizer, block_size=4, num_kv_blocks=4)  # 16 slots
    assert llm.llm_engine.max_model_len == 17  # not given: the longest request 16 slots hold
    message = r"prompt 1: prompt \(10 tokens\) \+ max_tokens \(8\) exceeds max_model_len=17"
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2], [1] * 10], SamplingParams(max_tokens=8), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the batch is all-or-nothing
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(temperature=-0.5), ValueError, "temperature must be >= 0"),
        (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), ValueError, "top_k must be -1 or 0"),
        (dict(max_tokens=0), ValueError, "max_tokens must be at least 1"),
        (dict(n=0), ValueError, "n must be at least 1"),
        (dict(min_p=2.0), ValueError, "min_p must be in"),
        (dict(min_tokens=5, max_tokens=2), ValueError, "min_tokens=5 must not exceed"),
        (dict(temperature="hot"), TypeError, "temperature must be a number"),
        (dict(max_tokens=2.5), TypeError, "max_tokens must be an int"),
        (dict(stop=[""]), TypeError, "stop must be a non-empty string"),
        (dict(seed="x"), TypeError, "seed must be an int"),
    ],
)
def test_sampling_params_are_validated(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_top_k_minus_one_and_zero_mean_all_tokens():
    from paged_attention.engine.sample.sampling import filtered_scores

    def kept(params):
        return filtered_scores(logits.clone(), [params])[0] > float("-inf")

    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    for top_k in (-1, 0):
        assert kept(SamplingParams(top_k=top_k)).all()
    assert kept(SamplingParams(top_k=2)).tolist() == [
        True,
        True,
        False,
        False,
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(model="/no/such/folder"), ValueError, r"cannot find model|neither a local folder"),
        (dict(model=42), TypeError, "model must be"),
        (dict(block_size=0), ValueError, "block_size must be a positive int"),
        (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization must be in"),
        (dict(attention_backend="fast"), ValueError, "backend must be one of"),
        (dict(preemption_mode="drop"), ValueError, "preemption_mode must be one of"),
        (dict(dtype="float8"), ValueError, "dtype"),
    ],
)
def test_bad_engine_settings(kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM(**kwargs)


def test_abort_frees_everything(models, tokenizer):
    engine = LLMEngine(models["llama"], tokenizer, block_size=4, num_kv_blocks=64)
    engine.add_request("a", PROMPTS[3], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    engine.abort_request("a")
    finished = []
    while engine.has_unfinished_requests():
        finished += finished_only(engine.step())
    assert [o.request_id for o in finished] == ["b"]
    assert engine.cache_manager.num_free_blocks == 64
    with pytest.raises(ValueError, match="no request with id"):
        engine.abort_request("zzz")


def test_sampling_filters_follow_vllm_order_min_p_then_top_k_then_top_p():
    from paged_attention.engine.sample.sampling import filtered_scores

    def kept(params):
        return filtered_scores(logits.clone(), [params])[0] > float("-inf")

    logits = torch.tensor([[0.5, 0.3, 0.1, 0.1]]).log()
    keep = kept(SamplingParams(top_p=0.6, min_p=0.3))
    # min-p drops the 0.1s; renormalized, 0.5 becomes 0.625 > top_p, so top-p keeps it alone (as vLLM does).
    assert keep.tolist() == [True, False, False, False]
    keep = kept(SamplingParams(top_p=0.9, min_p=0.3))
    assert keep.tolist() == [True, True, False, False]
    keep = kept(SamplingParams(top_k=1))
    assert keep.tolist() == [True, False, False, False]
    keep = kept(SamplingParams(top_p=0.5))
    assert keep.tolist() == [True, False, False, False]


def test_abort_forgets_the_request_and_its_id_can_be_reused(models, tokenizer):
    engine = LLMEngine(models["llama"], tokenizer, block_size=4, num_kv_blocks=64)
    engine.add_request("a", PROMPTS[1], SamplingParams(max_tokens=5))
    engine.abort_request("a")
    assert "a" not in engine.request_ids and not engine.has_unfinished_requests()
    engine.add_request("a", PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True))
    finished = []
    while engine.has_unfinished_requests():
        finished += finished_only(engine.step())
    assert [o.request_id for o in finished] == ["a"] and not engine.request_ids


def test_swap_mode_never_reports_a_false_stall(models, tokenizer):
    # Found by review: swapped sequences came back with no room for their next token, a step then
    # scheduled nothing, and the engine wrongly reported that it could make no progress.
    engine = LLMEngine(
        models["micro"],
        tokenizer,
        block_size=4,
        num_kv_blocks=4,
        preemption_mode="swap",
        max_num_batched_tokens=7,
        max_num_seqs=5,
    )
    pending = [(4, 5, 1), (6, 1, 10), (7, 3, 8), (7, 5, 5), (7, 6, 6), (10, 3, 7), (10, 4, 4)]
    step, done = 0, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            arrival, prompt_len, n = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            engine.add_request(None, [7 + i for i in range(prompt_len)], params, arrival_time=float(arrival))
        done += len(finished_only(engine.step()))
        step += 1
    assert done == 7 and engine.cache_manager.num_free_blocks == 4


def test_stop_string_made_before_min_tokens_does_not_end_the_request_later(models, tokenizer):
    llm = LLM(models["llama"], tokenizer=tokenizer, num_kv_blocks=64)
    free = llm.generate(
        [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    text = free[0].outputs[0].text
    stop = text[:2]  # appears in the very first tokens
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop, min_tokens=15)
    out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
    later = text.find(
        stop,
        len(tokenizer.decode(free[0].outputs[0].token_ids[:14], skip_special_tokens=True)) - len(stop) + 1,
    )
    if later < 0:
        assert out.finish_reason == "length" and len(out.token_ids) == 20
    else:
        assert out.text == text[:later] and len(out.token_ids) >= 15


def test_bad_stop_token_ids_and_settings_are_rejected(models, tokenizer):
    engine = LLMEngine(models["llama"], tokenizer, num_kv_blocks=64)
    with pytest.raises(ValueError, match="stop_token_ids must be in"):
        engine.add_request("x", PROMPTS[1], SamplingParams(min_tokens=2, stop_token_ids=[100_000]))
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLMEngine(models["llama"], tokenizer, num_kv_blocks=64, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(models["llama"], tokenizer, num_kv_blocks=64, max_model_len=0)
    with pytest.raises(TypeError, match="seed must be an int"):
        LLMEngine(models["llama"], tokenizer, num_kv_blocks=64, seed="x")


def test_a_single_dict_prompt_works_like_vllm(models, tokenizer):
    llm = LLM(models["llama"], tokenizer=tokenizer, num_kv_blocks=64)
    out = llm.generate(
        {"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False
    )
    assert len(out) == 1 and out[0].prompt_token_ids == PROMPTS[1] and out[0].outputs[0].logprobs is None


def test_sliding_window_models_are_served_only_within_their_window(tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        sliding_window=8,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = MistralForCausalLM(config).eval()
    engine = LLMEngine(model, tokenizer, num_kv_blocks=16)
    assert engine.max_model_len == 8
    with pytest.raises(ValueError, match=r"max_model_len=8"):
        engine.add_request("long", list(range(3, 33)), SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="sliding window of 8 tokens"):
        LLMEngine(model, tokenizer, num_kv_blocks=16, max_model_len=64)


def test_models_with_soft_capped_attention_are_refused(tokenizer, models):
    model = models["micro"]
    model.config.attn_logit_softcapping = 50.0
    try:
        with pytest.raises(ValueError, match="attn_logit_softcapping"):
            LLMEngine(model, tokenizer, num_kv_blocks=16)
    finally:
        model.config.attn_logit_softcapping = None


def test_common_vllm_constructor_arguments_are_accepted(models, tokenizer):
    llm = LLM(
        models["llama"],
        tokenizer=tokenizer,
        num_kv_blocks=16,
        trust_remote_code=True,
        enforce_eager=True,
        tensor_parallel_size=1,
    )
    assert llm.generate("abc", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(
        ValueError, match=r"LLM\(tensor_parallel_size=2\) is not supported: this engine runs on one device"
    ):
        LLM(models["llama"], tokenizer=tokenizer, num_kv_blocks=16, tensor_parallel_size=2)
