"""Sharing changes memory, never outputs: prefix caching, parallel sampling and beam search in the engine.

Where a test must rule out rounding (sampled tokens compared across different batches), the model
runs in float64: in float32, a batch of a different shape rounds matrix products differently
(about 1e-6), which can move a sampled token when the random draw falls right on a boundary.
"""

import random
from collections import Counter

import pytest
import torch

from paged_attention.baselines.engines import contiguous_cache
from paged_attention.engine.llm import LLM
from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.engine.sample.sampling import BeamSearchParams, SamplingParams
from paged_attention.engine.sequence import FinishReason
from paged_attention.models import DEFAULT_MODEL_NAME, load_model, load_tokenizer
from tests.streaming import finished_only


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def model():
    return load_model(DEFAULT_MODEL_NAME)[0]


@pytest.fixture(scope="module")
def hf_model():
    return load_model(DEFAULT_MODEL_NAME)[0]  # a separate instance: the engine swaps its attention function


@pytest.fixture(scope="module")
def model64():
    return load_model(DEFAULT_MODEL_NAME)[0].to(torch.float64)


def shared_prefix_trace(num_requests: int, prefix_len: int, share: float, seed: int = 0):
    """(arrival step, prompt, max_tokens): a fraction ``share`` of the prompts start with one prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(prefix_len)]
    trace = []
    for i in range(num_requests):
        suffix = [rng.randrange(3, 500) for _ in range(rng.randint(1, 12))]
        body = prefix + suffix if rng.random() < share else [rng.randrange(3, 500) for _ in range(prefix_len)]
        trace.append((i // 2, body, rng.randint(2, 10)))
    return trace


def serve(engine: LLMEngine, trace) -> tuple[dict[str, list[int]], int]:
    """Add each request at its arrival step; returns outputs by request id and the tokens computed."""
    pending = sorted(range(len(trace)), key=lambda i: trace[i][0])
    results, step, computed = {}, 0, 0
    while pending or engine.has_unfinished_requests():
        while pending and trace[pending[0]][0] <= step:
            index = pending.pop(0)
            _, prompt, max_tokens = trace[index]
            engine.add_request(str(index), prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        for out in finished_only(engine.step()):
            results[out.request_id] = out.outputs[0].token_ids
        computed += engine.last_step.num_scheduled_tokens
        step += 1
    return results, computed


# -- prefix caching ----------------------------------------------------------------------------
def test_prefix_caching_changes_no_greedy_token_on_a_trace_where_80_percent_share_a_prefix(model, tokenizer):
    trace = shared_prefix_trace(40, prefix_len=100, share=0.8)
    # 60 blocks of 8 slots hold about four requests: sequences are preempted and come back,
    # finding their own blocks and the shared prefix in the cache.
    engines = {
        on: LLMEngine(model, tokenizer, block_size=8, num_kv_blocks=60, enable_prefix_caching=on)
        for on in (False, True)
    }
    (off, computed_off), (on, computed_on) = (serve(engines[flag], trace) for flag in (False, True))
    assert on == off
    stats = engines[True].cache_manager.prefix_cache_stats
    assert stats.requests == 40 and stats.hit_rate > 0.6
    assert computed_on < 0.45 * computed_off
    assert engines[True].scheduler.num_preemptions > 0
    for engine in engines.values():
        assert engine.cache_manager.num_free_blocks == 60 and not engine.cache_manager.page_tables


def test_a_cache_salt_keeps_requests_apart(model, tokenizer):
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=64, block_size=8)
    prompt = list(range(10, 60))
    params = SamplingParams(temperature=0, max_tokens=3)
    first = llm.generate({"prompt_token_ids": prompt, "cache_salt": "a"}, params, use_tqdm=False)
    other = llm.generate({"prompt_token_ids": prompt, "cache_salt": "b"}, params, use_tqdm=False)
    stats = llm.llm_engine.cache_manager.prefix_cache_stats
    assert stats.hits == 0 and first[0].outputs[0].token_ids == other[0].outputs[0].token_ids
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "a"}, params, use_tqdm=False)
    assert stats.hits == 48
    assert llm.reset_prefix_cache() and llm.llm_engine.cache_manager.allocator.num_cached_blocks == 0
    with pytest.raises(TypeError, match="cache_salt"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": 7}, params, use_tqdm=False)


# -- parallel sampling -------------------------------------------------------------------------
def test_parallel_samples_equal_unshared_requests_seeded_seed_plus_i_whatever_the_batch(model64, tokenizer):
    prompt = list(range(40, 77))  # 37 tokens: 4 full blocks of 8 and a half-full one to copy on write
    params = SamplingParams(n=4, seed=11, temperature=0.9, max_tokens=24, ignore_eos=True)
    unshared = LLM(model64, tokenizer=tokenizer, num_kv_blocks=200, block_size=8, enable_prefix_caching=False)
    expected = []
    for i in range(4):
        alone = SamplingParams(seed=11 + i, temperature=0.9, max_tokens=24, ignore_eos=True)
        expected.append(unshared.generate(prompt, alone, use_tqdm=False)[0].outputs[0].token_ids)
    shared = LLM(model64, tokenizer=tokenizer, num_kv_blocks=200, block_size=8)
    out = shared.generate(prompt, params, use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == expected and [o.index for o in out.outputs] == [0, 1, 2, 3]
    # In a crowd, under memory pressure (children preempted and recomputed), with chunked prefill:
    crowded = LLM(model64, tokenizer=tokenizer, num_kv_blocks=24, block_size=8, max_num_batched_tokens=16)
    rng = random.Random(1)
    others = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 30))] for _ in range(5)]
    outs = crowded.generate(
        [others[0], prompt, *others[1:]],
        [SamplingParams(max_tokens=20, seed=1), params] + [SamplingParams(temperature=0, max_tokens=15)] * 4,
        use_tqdm=False,
    )
    assert [o.token_ids for o in outs[1].outputs] == expected
    engine = crowded.llm_engine
    assert engine.scheduler.num_preemptions > 0 and engine.cache_manager.num_free_blocks == 24


def test_forked_samples_share_the_prompt_blocks_and_copy_only_the_last_one(model, tokenizer):
    engine = LLMEngine(model, tokenizer, block_size=8, num_kv_blocks=100)
    engine.add_request("r", list(range(40, 77)), SamplingParams(n=4, seed=0, max_tokens=5, ignore_eos=True))
    engine.step()  # prefill, then fork: 4 page tables over the same 5 blocks
    report = engine.cache_manager.memory_report()
    assert report.shared_blocks == 5 and report.saved_blocks == 15 and report.token_slots == 37 + 0
    assert report.sharing_saving(8) == pytest.approx(15 / 20)
    out = engine.scheduler.schedule()  # each sample's first decode: 3 copies of the half-full block
    assert len(out.block_copies) == 3 and len({c.src for c in out.block_copies}) == 1
    for seq in list(engine.scheduler.running):  # (nothing ran)
        engine.scheduler.finish(seq, FinishReason.ABORTED, 0.0)
    assert engine.cache_manager.num_free_blocks == 100


def test_unseeded_samples_and_early_finishers_are_all_returned(model, tokenizer):
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=100, block_size=8)
    outs = llm.generate([[5, 6, 7], [9]], SamplingParams(n=3, max_tokens=4, min_tokens=1), use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert all(o.finish_reason in ("stop", "length") for r in outs for o in r.outputs)
    one_token = llm.generate([5, 6, 7], SamplingParams(n=5, max_tokens=1, seed=3), use_tqdm=False)[0]
    assert all(len(o.token_ids) == 1 for o in one_token.outputs)
    assert llm.llm_engine.cache_manager.num_free_blocks == 100


def test_n_larger_than_max_num_seqs_is_refused(model, tokenizer):
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=100, block_size=8, max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        llm.generate([5, 6], SamplingParams(n=5), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


# -- beam search -------------------------------------------------------------------------------
PROMPTS = [[17, 99, 4, 250, 31], list(range(40, 57)), [7, 300, 12] * 9, [3]]


def hf_beams(model, prompt, k, max_new_tokens, length_penalty, eos):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), num_beams=k, num_return_sequences=k, do_sample=False,
        max_new_tokens=max_new_tokens, length_penalty=length_penalty, early_stopping=False,
        eos_token_id=sorted(eos), pad_token_id=2,
    )  # fmt: skip
    beams = []
    for row in out[:, len(prompt) :].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        beams.append(row[:end])
    return beams


@pytest.mark.parametrize("k", [2, 4])
def test_beam_search_returns_transformers_beams_for_every_length_penalty(k, model, hf_model, tokenizer):
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=300, block_size=8)
    # Make the token greedy decoding produces most an end-of-sequence token too, so that beams end early.
    greedy = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    frequent = Counter(t for out in greedy for t in out.outputs[0].token_ids).most_common(1)[0][0]
    eos = {1, frequent}
    llm.llm_engine.stop_rules.eos_token_ids = frozenset(eos)
    reasons = Counter()
    for length_penalty in (1.0, 0.0, 2.0):
        params = BeamSearchParams(beam_width=k, max_tokens=16, length_penalty=length_penalty)
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            expected = hf_beams(hf_model, prompt, k, 16, length_penalty, eos)
            got = [s.tokens[len(prompt) :] for s in out.sequences]
            assert got[0] == expected[0]  # the top sequence
            assert got == expected  # and, here, every returned beam
            assert all(s.tokens[: len(prompt)] == prompt for s in out.sequences)
            scores = [s.score for s in out.sequences]
            assert scores == sorted(scores, reverse=True)
            reasons.update(s.finish_reason for s in out.sequences)
    assert reasons["stop"] > 0 and reasons["length"] > 0
    assert llm.llm_engine.cache_manager.num_free_blocks == 300


def test_beam_width_1_is_greedy_decoding(model, tokenizer):
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=200, block_size=8)
    greedy = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    for prompt, g, b in zip(PROMPTS, greedy, beams, strict=True):
        assert len(b.sequences) == 1 and b.sequences[0].tokens == prompt + g.outputs[0].token_ids
        assert b.sequences[0].text == tokenizer.decode(b.sequences[0].tokens)


def test_beams_fork_and_free_page_tables_and_survive_memory_pressure(model, tokenizer):
    prompts = [*PROMPTS, list(range(100, 120)), [5, 6] * 7]
    params = BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True)
    roomy = LLM(model, tokenizer=tokenizer, num_kv_blocks=400, block_size=4)
    expected = roomy.beam_search(prompts, params)
    # Six searches of 4 beams (up to 47 tokens, 12 blocks each) and three greedy requests in 52
    # blocks: beams are parked while siblings wait for the token budget, preempted, recomputed.
    tight = LLM(model, tokenizer=tokenizer, num_kv_blocks=52, block_size=4, max_num_batched_tokens=24)
    engine = tight.llm_engine
    for i in range(3):
        engine.add_request(f"g{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=10))
    got = tight.beam_search(prompts, params)
    for a, b in zip(expected, got, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert engine.scheduler.num_preemptions > 5
    assert engine.cache_manager.prefix_cache_stats.preempted_hits > 0  # recomputed beams reuse blocks
    assert engine.cache_manager.num_free_blocks == 52 and not engine.cache_manager.page_tables
    assert not engine.request_ids


def test_beams_share_blocks_while_they_run(model, tokenizer):
    engine = LLMEngine(model, tokenizer, block_size=4, num_kv_blocks=200)
    engine.add_request("b", PROMPTS[2], BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))
    saved = []
    while engine.has_unfinished_requests():
        engine.step()
        saved.append(engine.cache_manager.memory_report().saved_blocks)
    assert max(saved) >= 3 * 6  # the 27-token prompt's 6 full blocks are held once, not 4 times
    assert engine.cache_manager.num_free_blocks == 200


def test_aborting_a_beam_search_frees_every_beam(model, tokenizer):
    engine = LLMEngine(model, tokenizer, block_size=4, num_kv_blocks=100)
    engine.add_request("b", PROMPTS[1], BeamSearchParams(beam_width=3, max_tokens=10))
    for _ in range(4):
        engine.step()
    assert len(engine.sequences("b")) == 3
    engine.abort_request("b")
    assert engine.cache_manager.num_free_blocks == 100 and not engine.request_ids
    assert not engine.has_unfinished_requests()


def test_beam_search_params_and_requests_are_checked(model, tokenizer):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(TypeError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=4.0)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="finite"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=40, block_size=4)
    with pytest.raises(ValueError, match="beams of up to"):  # 4 x (10 blocks + a spare one) > 40 blocks
        llm.beam_search([list(range(10, 40))], BeamSearchParams(beam_width=4, max_tokens=10))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search([[5]], SamplingParams())
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search([[5]], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.beam_search([[5], [6], [7]], BeamSearchParams(beam_width=2, max_tokens=3), concurrency_limit=2)
    assert len(out) == 3 and all(len(o.sequences) == 2 for o in out)


def test_a_contiguous_cache_serves_n_samples_unshared_with_the_same_tokens(model64, tokenizer):
    params = SamplingParams(n=3, seed=4, temperature=0.8, max_tokens=10, ignore_eos=True)
    paged = LLM(model64, tokenizer=tokenizer, num_kv_blocks=100, block_size=8)
    contiguous = LLM(
        model64,
        tokenizer=tokenizer,
        num_kv_blocks=100,
        block_size=8,
        cache_manager_factory=contiguous_cache("oracle"),
    )
    assert not contiguous.llm_engine.cache_manager.supports_fork
    shared = paged.generate([5, 6, 7, 8], params, use_tqdm=False)[0]
    unshared = contiguous.generate([5, 6, 7, 8], params, use_tqdm=False)[0]
    assert [o.token_ids for o in shared.outputs] == [o.token_ids for o in unshared.outputs]
    with pytest.raises(ValueError, match="a cache manager that can fork"):
        contiguous.beam_search([[5, 6]], BeamSearchParams(beam_width=2, max_tokens=3))
    assert contiguous.reset_prefix_cache() and not contiguous.llm_engine.has_unfinished_requests()


# -- everything at once ------------------------------------------------------------------------
def _micro_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval().to(torch.float64)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_mix_of_samples_beams_shared_prefixes_and_aborts_loses_nothing(mode, tokenizer):
    model = _micro_model(tokenizer)
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randint(8, 30))] for _ in range(3)]
    requests = []
    for i in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 10))]
        kind = rng.choice(["greedy", "samples", "beams"])
        if kind == "greedy":
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12))
        elif kind == "samples":
            params = SamplingParams(
                n=rng.randint(2, 3), seed=i, max_tokens=rng.randint(1, 12), ignore_eos=True
            )
        else:
            params = BeamSearchParams(beam_width=rng.randint(1, 3), max_tokens=rng.randint(1, 8))
        requests.append((i // 3, prompt, params, rng.random() < 0.1))

    def run(engine):
        pending, outputs, step = list(range(len(requests))), {}, 0
        while pending or engine.has_unfinished_requests():
            while pending and requests[pending[0]][0] <= step:
                i = pending.pop(0)
                engine.add_request(str(i), requests[i][1], requests[i][2])
            for out in finished_only(engine.step()):
                outputs[out.request_id] = [o.token_ids for o in out.outputs]
            for i, (arrival, _, _, abort) in enumerate(requests):
                if abort and step == arrival + 3 and str(i) in engine.request_ids:
                    engine.abort_request(str(i))
            step += 1
        return outputs

    roomy = run(LLMEngine(model, tokenizer, block_size=4, num_kv_blocks=2000))
    engine = LLMEngine(model, tokenizer, block_size=4, num_kv_blocks=40, max_num_batched_tokens=24,
                       max_num_seqs=12, preemption_mode=mode)  # fmt: skip
    tight = run(engine)
    kept = {str(i) for i, r in enumerate(requests) if not r[3]}  # an abort may come before or after the end
    assert {k: v for k, v in tight.items() if k in kept} == {k: v for k, v in roomy.items() if k in kept}
    assert kept <= set(tight)
    assert engine.scheduler.num_preemptions > 0
    cache = engine.cache_manager
    assert cache.num_free_blocks == 40 and not cache.page_tables and not cache.num_swapped
    assert not engine.request_ids and not engine.scheduler.has_unfinished()
    if cache.cpu_allocator is not None:
        assert cache.cpu_allocator.num_free_blocks == cache.cpu_allocator.num_blocks


def test_a_one_token_beam_search_ends_at_its_first_step(model, hf_model, tokenizer):
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=50, block_size=4)
    out = llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=3, max_tokens=1))[0]
    assert [s.tokens[3:] for s in out.sequences] == hf_beams(hf_model, [5, 6, 7], 3, 1, 1.0, {1})
    assert all(s.finish_reason == "length" for s in out.sequences)
    assert llm.llm_engine.cache_manager.num_free_blocks == 50
