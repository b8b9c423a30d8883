"""Speculative decoding in the engine (n-gram drafts): greedy output token for token equal to
decoding without drafts (float64 tiny model: any k, any lookup window, under preemption, chunked
prefill, prefix hits, penalties and stops, a contiguous manager), sampled output distributed as
without drafts, streaming several tokens per step, nothing leaked, bad configs refused."""

from __future__ import annotations

import collections
import functools
import math

import pytest
import torch

from paged_attention import LLM, SamplingParams
from paged_attention.baselines.contiguous import ContiguousKVCacheManager
from paged_attention.engine.sample.sampling import RequestOutputKind

# Prompts that repeat themselves (what n-gram drafts live on) and one that does not.
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [17, 99, 4, 250, 31],
    list(range(40, 57)) * 2,
    [7, 300, 12] * 13,
    [3, 14, 15, 9, 26, 5, 35, 8, 3, 14, 15],
]


@functools.cache
def tiny() -> tuple[torch.nn.Module, object]:
    engine = LLM(num_kv_blocks=8, block_size=4).llm_engine
    return engine.model.double(), engine.tokenizer


def ngram(k: int, low: int = 1, high: int = 3) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": low,
        "prompt_lookup_max": high,
    }


def run(params: SamplingParams, prompts: list[list[int]] = PROMPTS, **engine) -> tuple[list, LLM]:
    model, tokenizer = tiny()
    llm = LLM(model, tokenizer=tokenizer, **engine)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    manager = llm.llm_engine.cache_manager
    assert manager.num_free_blocks == manager.num_blocks  # every block came back
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outputs], llm


GREEDY = SamplingParams(temperature=0, max_tokens=48)


@pytest.mark.parametrize(
    "k, low, high, cache",
    [
        (1, 1, 1, dict(num_kv_blocks=64)),
        (3, 1, 3, dict(num_kv_blocks=64)),
        (5, 2, 5, dict(num_kv_blocks=64, enable_prefix_caching=False)),
        (8, 1, 4, dict(num_kv_blocks=64)),
        # 24 blocks of 4 cannot hold the five requests: preemption and recompute; 8-token chunks
        (4, 1, 3, dict(num_kv_blocks=24, max_num_batched_tokens=8)),
    ],
)
def test_greedy_output_equals_decoding_without_drafts(k: int, low: int, high: int, cache: dict) -> None:
    want, _ = run(GREEDY, block_size=4, **cache)
    got, llm = run(GREEDY, block_size=4, speculative_config=ngram(k, low, high), **cache)
    assert got == want
    stats = llm.llm_engine.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    if cache["num_kv_blocks"] == 24:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def oracle(outputs: dict[tuple[int, ...], list[int]], wrong_every: int):
    """A drafter that knows each prompt's greedy continuation and proposes it, with every
    ``wrong_every``-th drafted position wrong: long accepted runs, rejections at every depth."""

    def propose(tokens: list[int], low: int, high: int, k: int) -> list[int]:
        for prompt, continuation in outputs.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                drafts = continuation[done : done + k]
                return [t if (done + i) % wrong_every else (t + 1) % 512 for i, t in enumerate(drafts)]
        return []

    return propose


@pytest.mark.parametrize("wrong_every", [2, 5, 10**9])
@pytest.mark.parametrize(
    "cache",
    [dict(num_kv_blocks=64), dict(num_kv_blocks=20, max_num_batched_tokens=8)],
    ids=["roomy", "tight"],
)
def test_known_drafts_verify_and_roll_back_exactly(monkeypatch, wrong_every: int, cache: dict) -> None:
    """Drafts that are mostly right (the n-gram drafter rarely is on the tiny model's gibberish):
    every accepted run, every rejection depth, blocks dropped by truncation, under preemption."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want, _ = run(params, block_size=4, **cache)
    known = {tuple(p): w[0] for p, w in zip(PROMPTS, want, strict=True)}
    monkeypatch.setattr("paged_attention.engine.spec_decode.speculation.propose", oracle(known, wrong_every))
    got, llm = run(params, block_size=4, speculative_config=ngram(7), **cache)
    assert got == want
    stats = llm.llm_engine.speculator.stats
    if wrong_every > 100:  # every draft right: every draft accepted, k + 1 tokens per step
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0, stats
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
        assert stats.accepted_per_position[wrong_every - 2] > 0  # runs as long as the first wrong one
    if cache["num_kv_blocks"] == 20:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_penalties_min_tokens_stops_and_max_tokens_hold_inside_an_accepted_run() -> None:
    """Each drafted position is judged with the drafts before it as output: penalties, min_tokens;
    a stop token or string inside an accepted run ends it there; max_tokens is never passed."""
    base, _ = run(GREEDY)
    stop_token = base[0][0][12]  # a token of the first request's output, for a stop
    params = [
        SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(temperature=0, max_tokens=40, presence_penalty=0.8, min_tokens=20),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=40, stop=[base[3][2][5:8]]),
        SamplingParams(temperature=0, max_tokens=7),
    ]
    for p in params:
        want, _ = run(p)
        got, _ = run(p, speculative_config=ngram(6))
        assert got == want, p


def test_a_contiguous_manager_reserves_for_drafts_and_gives_the_same_output() -> None:
    def factory(num_blocks: int, block_size: int, max_model_len: int) -> ContiguousKVCacheManager:
        return ContiguousKVCacheManager(num_blocks * block_size, max_model_len, policy="max")

    want, _ = run(GREEDY, num_kv_blocks=96, max_model_len=128, cache_manager_factory=factory)
    got, llm = run(
        GREEDY,
        num_kv_blocks=96,
        max_model_len=128,
        cache_manager_factory=factory,
        speculative_config=ngram(4),
    )
    assert got == want and llm.llm_engine.speculator.stats.num_accepted_tokens > 0


def test_streaming_delivers_several_tokens_in_one_step() -> None:
    model, tokenizer = tiny()
    llm = LLM(model, tokenizer=tokenizer, speculative_config=ngram(6))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=48, output_kind=RequestOutputKind.DELTA)
    engine.add_request("a", PROMPTS[3], params)
    chunks = []
    while engine.has_unfinished_requests():
        chunks += [o.outputs[0].token_ids for o in engine.step()]
    want, _ = run(GREEDY, [PROMPTS[3]])
    assert [t for c in chunks for t in c] == want[0][0]
    assert max(len(c) for c in chunks) > 1


FILTERS = [
    dict(temperature=0.9),
    dict(temperature=0.9, top_k=4),
    dict(temperature=0.9, top_p=0.7),
    dict(temperature=0.9, min_p=0.2),
    dict(temperature=0.9, repetition_penalty=1.4),
]


@pytest.mark.parametrize("settings", FILTERS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_sampled_output_is_distributed_as_without_drafts(monkeypatch, settings: dict) -> None:
    """The same 400 seeded requests with and without drafts (the greedy continuation, which the
    sampled tokens often follow, so that drafts are accepted at every depth and rejected too): the
    tokens at positions 1 to 3 follow the same distribution (a chi-square test of homogeneity,
    failing at p < 1e-5). Seeds give different draws with drafts: equality is in distribution."""
    prompt = [7, 300, 12] * 6
    greedy, _ = run(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), [prompt])
    params = [SamplingParams(max_tokens=5, seed=s, ignore_eos=True, **settings) for s in range(400)]
    samples = {}
    for name, extra in (("plain", {}), ("drafted", {"speculative_config": ngram(3)})):
        model, tokenizer = tiny()
        if extra:
            monkeypatch.setattr(
                "paged_attention.engine.spec_decode.speculation.propose",
                oracle({tuple(prompt): greedy[0][0]}, 10**9),
            )
        llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=512, **extra)
        outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        samples[name] = [tuple(o.outputs[0].token_ids[1:4]) for o in outputs]
        if extra:
            stats = llm.llm_engine.speculator.stats
            assert 20 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    for position in range(3):
        a = collections.Counter(s[position] for s in samples["plain"])
        b = collections.Counter(s[position] for s in samples["drafted"])
        assert chi_square_p(a, b) > 1e-5, (position, a.most_common(5), b.most_common(5))


def chi_square_p(a: collections.Counter, b: collections.Counter) -> float:
    """p-value of Pearson's chi-square test that two samples come from one distribution (rare
    tokens pooled so that every expected count is at least 5)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    cells, pooled = [], [0, 0]
    for token in set(a) | set(b):
        if (a[token] + b[token]) * min(n_a, n_b) / (n_a + n_b) >= 5:
            cells.append((a[token], b[token]))
        else:
            pooled[0] += a[token]
            pooled[1] += b[token]
    if sum(pooled):
        cells.append(tuple(pooled))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected
    dof = max(1, len(cells) - 1)
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def test_parallel_samples_and_seeds_draft_too_and_nothing_leaks() -> None:
    got, llm = run(SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=24), speculative_config=ngram(4))
    assert all(len(tokens) <= 24 for tokens, _, _ in got)
    assert llm.llm_engine.speculator.stats.num_draft_tokens > 0


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "needs a draft model"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "must be >= 1"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "must be <= prompt_lookup_max",
        ),
    ],
)
def test_a_bad_speculative_config_is_refused_when_the_engine_is_built(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(num_kv_blocks=8, block_size=4, speculative_config=config)


def test_mean_acceptance_length_and_rate() -> None:
    _, llm = run(GREEDY, speculative_config=ngram(4))
    stats = llm.llm_engine.speculator.stats
    assert math.isclose(stats.acceptance_rate, stats.num_accepted_tokens / stats.num_draft_tokens)
    assert math.isclose(stats.mean_acceptance_length, 1 + stats.num_accepted_tokens / stats.num_drafts)


def test_the_engine_reports_vllms_speculative_counters() -> None:
    _, llm = run(GREEDY, speculative_config=ngram(3))
    stats = llm.llm_engine.speculator.stats
    metrics = llm.llm_engine.get_metrics()
    records = {(m.name, m.labels.get("position")): m.value for m in metrics if hasattr(m, "value")}
    assert records[("vllm:spec_decode_num_drafts", None)] == stats.num_drafts > 0
    assert records[("vllm:spec_decode_num_draft_tokens", None)] == stats.num_draft_tokens
    assert records[("vllm:spec_decode_num_accepted_tokens", None)] == stats.num_accepted_tokens
    per_position = [records[("vllm:spec_decode_num_accepted_tokens_per_pos", str(i))] for i in range(3)]
    assert per_position == stats.accepted_per_position


def test_metrics_endpoint_text_carries_the_speculative_counters() -> None:
    from paged_attention.serving.metrics import prometheus_text

    _, llm = run(GREEDY, speculative_config=ngram(2))
    text = prometheus_text(llm.llm_engine.get_metrics(), "tiny").decode()
    stats = llm.llm_engine.speculator.stats
    assert f'vllm:spec_decode_num_drafts_total{{model_name="tiny"}} {float(stats.num_drafts)}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text


def test_a_stop_inside_an_accepted_run_ends_it_there(monkeypatch) -> None:
    """Right drafts that run past a stop token: the tokens after the stop are not emitted."""
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want, _ = run(plain)
    known = {tuple(p): w[0] for p, w in zip(PROMPTS, want, strict=True)}
    monkeypatch.setattr("paged_attention.engine.spec_decode.speculation.propose", oracle(known, 10**9))
    stop = want[2][0][9]  # a token in the middle of request 2's output
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    expected, _ = run(params)
    got, llm = run(params, speculative_config=ngram(8))
    assert got == expected and got[2][0][-1] == stop and got[2][1] == "stop"
    assert llm.llm_engine.speculator.stats.num_accepted_tokens > 0
    counted = {m.name: m.value for m in llm.llm_engine.get_metrics() if hasattr(m, "value") and not m.labels}
    assert counted["vllm:generation_tokens"] == sum(len(tokens) for tokens, _, _ in got)  # not the cut drafts


@pytest.mark.parametrize("settings", FILTERS[:3], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_seeded_samples_are_the_same_with_drafts(monkeypatch, settings: dict) -> None:
    """Sample, then compare: a seeded request draws the same numbers with drafts as without, so it
    gives the same tokens (float64: no rounding difference between one and several positions)."""
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want_greedy, _ = run(plain)
    known = {tuple(p): w[0] for p, w in zip(PROMPTS, want_greedy, strict=True)}
    params = SamplingParams(max_tokens=24, seed=3, ignore_eos=True, **settings)
    want, _ = run(params)
    monkeypatch.setattr("paged_attention.engine.spec_decode.speculation.propose", oracle(known, 10**9))
    got, llm = run(params, speculative_config=ngram(4))
    assert got == want
    assert llm.llm_engine.speculator.stats.num_draft_tokens > 0


def test_swap_preemption_with_drafts() -> None:
    params = SamplingParams(temperature=0, max_tokens=40)
    cache = dict(
        block_size=4, num_kv_blocks=20, max_num_batched_tokens=8, preemption_mode="swap", num_cpu_blocks=40
    )
    want, _ = run(params, **cache)
    got, llm = run(params, speculative_config=ngram(4), **cache)
    assert got == want and llm.llm_engine.scheduler.num_preemptions > 0
