"""Every input is checked at the door: a clear TypeError/ValueError naming the argument and what is
allowed, nothing queued, and the engine keeps serving afterwards."""

from __future__ import annotations

import pytest
import torch

from paged_attention import LLM, BeamSearchParams, SamplingParams
from paged_attention.kernels.reference import store_kv


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=64, block_size=8)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(seed=2**64), ValueError, "seed must be in"),
        (dict(seed=-(2**63) - 1), ValueError, "seed must be in"),
        (dict(seed=2**64 - 1, n=2), ValueError, r"seed \+ i for i < n=2"),
        (dict(seed=1.5), TypeError, "seed must be an int"),
        (dict(stop=5), TypeError, "stop must be a string, a list of strings or None, got int"),
        (dict(stop=[""]), TypeError, "stop must be a non-empty string"),
        (dict(stop_token_ids=5), TypeError, "stop_token_ids must be a list of token ids"),
        (dict(stop_token_ids=[-1]), TypeError, "stop_token_ids must be a list of token ids"),
        (dict(n=0), ValueError, "n must be at least 1"),
        (dict(top_p=0), ValueError, "top_p must be in"),
        (dict(max_tokens=0), ValueError, "max_tokens must be at least 1"),
    ],
)
def test_sampling_params_are_checked_when_built(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_the_largest_seeds_work() -> None:
    torch.Generator().manual_seed(SamplingParams(seed=2**64 - 2, n=2).seed + 1)
    torch.Generator().manual_seed(SamplingParams(seed=-(2**63)).seed)


@pytest.mark.parametrize(
    "field, value, error, message",
    [("n", 0, ValueError, "n must be at least 1"), ("stop", 5, TypeError, "stop must be"),
     ("seed", 2**64, ValueError, "seed must be in"), ("temperature", -1.0, ValueError, "temperature")],
)  # fmt: skip
def test_a_changed_params_object_is_checked_again(
    llm: LLM, field: str, value: object, error: type, message: str
) -> None:
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)
    engine = llm.llm_engine
    with pytest.raises(error, match=message):
        engine.add_request(None, "hello", params)
    assert not engine.has_unfinished_requests()
    assert llm.generate(["hello"], SamplingParams(max_tokens=3), use_tqdm=False)[0].finished


def test_the_engine_keeps_its_own_copy_of_the_params(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, stop=None)
    engine = llm.llm_engine
    engine.add_request("copy", "the cache", params)
    params.max_tokens = 1  # too late: the engine checked and copied it at the door
    params.stop = ["e"]
    outputs = [o for _ in range(50) if engine.has_unfinished_requests() for o in engine.step() if o.finished]
    assert len(outputs[0].outputs[0].token_ids) == 5


@pytest.mark.parametrize(
    "args, error, message",
    [
        (("x", "hi", SamplingParams(), "yesterday"), TypeError, "arrival_time must be a finite number"),
        (("x", "hi", SamplingParams(), float("nan")), TypeError, "arrival_time must be a finite number"),
        ((True, "hi", SamplingParams()), TypeError, "request_id must be a str"),
        (("x", "hi", "params"), TypeError, "params must be a SamplingParams or BeamSearchParams"),
        (("x", "", SamplingParams()), ValueError, "the prompt is empty"),
    ],
)
def test_add_request_checks_every_argument(llm: LLM, args: tuple, error: type, message: str) -> None:
    engine = llm.llm_engine
    with pytest.raises(error, match=message):
        engine.add_request(*args)
    assert "x" not in engine.request_ids and not engine.has_unfinished_requests()


def test_automatic_ids_skip_the_ids_users_chose(llm: LLM) -> None:
    engine = llm.llm_engine
    for chosen in ("0", "1", "2", "3"):
        engine.add_request(chosen, "mine", SamplingParams(max_tokens=2))
    outputs = llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.prompt for o in outputs] == ["a", "b"]
    assert not {o.request_id for o in outputs} & {"0", "1", "2", "3"}
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize(
    "sampling_params, message",
    [
        ("notparams", "sampling_params must be a SamplingParams, a list of them"),
        (BeamSearchParams(beam_width=2, max_tokens=4), "for a beam search call LLM.beam_search"),
        ([SamplingParams(), 3], "sampling_params must hold SamplingParams only, got int"),
    ],
)
def test_generate_names_what_sampling_params_may_be(llm: LLM, sampling_params: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        llm.generate(["a"], sampling_params, use_tqdm=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [dict(kv_cache_memory=10**13), dict(num_kv_blocks=10**9)])
def test_a_kv_budget_the_host_cannot_hold_is_refused_before_anything_is_built(kwargs: dict) -> None:
    import time

    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"GiB available; give a smaller kv_cache_memory \(in bytes"):
        LLM(**kwargs)
    assert time.perf_counter() - start < 30  # no block objects were built for it


def test_a_request_that_fills_the_cache_exactly_fits() -> None:
    """prompt + max_tokens - 1 slots: the last sampled token is never fed back, so never stored."""
    llm = LLM(num_kv_blocks=3, block_size=4, watermark=0.0, enable_prefix_caching=False)
    prompt = list(range(1, 6))  # 5 tokens; 5 + 8 - 1 = 12 = 3 blocks of 4
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 8
    assert llm.llm_engine.max_model_len == 13  # not given: the longest request the cache holds
    with pytest.raises(ValueError, match=r"prompt \(5 tokens\) \+ max_tokens \(9\) exceeds max_model_len=13"):
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=9), use_tqdm=False)


def test_a_cache_smaller_than_one_max_model_len_request_is_refused_when_built() -> None:
    message = (
        r"max_model_len=64 does not fit the KV cache: the cache holds 12 token slots \(3 blocks of 4\), "
        r"and one request of 64 tokens cannot fit \(it may store up to 63 tokens .*\); "
        r"pass max_model_len <= 13, or give the cache more memory"
    )
    with pytest.raises(ValueError, match=message):
        LLM(num_kv_blocks=3, block_size=4, watermark=0.0, max_model_len=64)
    with pytest.raises(ValueError, match=r"16 blocks, 1 of which stay free .* pass max_model_len <= 61"):
        LLM(num_kv_blocks=16, block_size=4, watermark=0.1, max_model_len=64)
    assert LLM(num_kv_blocks=16, block_size=4, watermark=0.1).llm_engine.max_model_len == 61


def test_store_into_a_non_contiguous_cache_is_refused() -> None:
    cache = torch.zeros(4, 2, 8, 4).transpose(1, 2)  # [4, 8, 2, 4], not contiguous
    key = torch.ones(1, 2, 4)
    with pytest.raises(ValueError, match="key_cache must be contiguous"):
        store_kv(key, key, cache, cache.clone(), torch.tensor([0]))
