"""``LLMEngine.step()`` streams as vLLM's does: an output for every request that moved on, in the
request's ``output_kind``; ``LLM.generate`` collects the same final outputs."""

import itertools

import pytest

from paged_attention.engine.llm import LLM
from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.engine.models import load_model
from paged_attention.engine.sampling import BeamSearchParams, RequestOutputKind, SamplingParams

PROMPTS = ["The page table", "A block of sixteen tokens holds", "Hi"]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_model(None)


def params(kind: RequestOutputKind, **kwargs) -> SamplingParams:
    settings = dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, output_kind=kind)
    return SamplingParams(**{**settings, **kwargs})


def stream(engine: LLMEngine, kind: RequestOutputKind, **kwargs) -> dict[str, list]:
    """Every output ``step()`` returns, by request id, in order."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params(kind, **kwargs))
    seen: dict[str, list] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


def test_outputs_arrive_unfinished_then_finished_with_growing_text_equal_to_generate(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, tokenizer, block_size=4, num_kv_blocks=64, max_num_batched_tokens=6)
    seen = stream(engine, RequestOutputKind.CUMULATIVE, n=2)
    final = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=64).generate(
        PROMPTS, params(RequestOutputKind.CUMULATIVE, n=2), use_tqdm=False
    )
    for request_id, outs in seen.items():
        assert len(outs) >= 2  # a 12-token request streams over several steps
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        for sample in range(2):
            texts = [o.outputs[sample].text for o in outs]
            tokens = [o.outputs[sample].token_ids for o in outs]
            assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
            assert all(b[: len(a)] == a for a, b in itertools.pairwise(tokens))
        last, expected = outs[-1], final[int(request_id)]
        assert [(o.text, o.token_ids, o.finish_reason) for o in last.outputs] == [
            (o.text, o.token_ids, o.finish_reason) for o in expected.outputs
        ]
    assert not engine.request_ids and engine.cache_manager.num_free_blocks == 64


def test_delta_outputs_add_up_to_the_cumulative_ones(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    cumulative = stream(LLMEngine(model, tokenizer, num_kv_blocks=32), RequestOutputKind.CUMULATIVE)
    delta = stream(LLMEngine(model, tokenizer, num_kv_blocks=32), RequestOutputKind.DELTA)
    for request_id, outs in delta.items():
        whole = cumulative[request_id][-1].outputs[0]
        assert "".join(o.outputs[0].text for o in outs) == whole.text
        assert [t for o in outs for t in o.outputs[0].token_ids] == whole.token_ids
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == whole.finish_reason


def test_final_only_reports_once_and_a_beam_search_reports_when_it_ends(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, tokenizer, num_kv_blocks=64)
    seen = stream(engine, RequestOutputKind.FINAL_ONLY)
    assert all(len(outs) == 1 and outs[0].finished for outs in seen.values())
    engine.add_request("beams", [5, 6, 7], BeamSearchParams(beam_width=2, max_tokens=4))
    reports = []
    while engine.has_unfinished_requests():
        reports += engine.step()
    assert len(reports) == 1 and reports[0].finished and len(reports[0].outputs) == 2


def test_the_public_views_show_a_running_request_and_forget_it_when_done(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, tokenizer, block_size=4, num_kv_blocks=32)
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(n=3, seed=1, max_tokens=3))
    engine.step()  # prefill, then three samples share the prompt's blocks
    seqs = engine.sequences("a")
    assert engine.request_ids == ["a"] and len(seqs) == 3
    tables = [engine.cache_manager.block_table(s.seq_id) for s in seqs]
    assert tables[0][0] == tables[1][0] == tables[2][0]  # the full first block is shared
    with pytest.raises(TypeError):
        engine.cache_manager.page_tables[99] = None  # a read-only view
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.request_ids == []
    with pytest.raises(ValueError, match="no unfinished request"):
        engine.sequences("a")


def test_text_a_stop_string_could_still_cut_is_never_streamed(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    plain = (
        LLM(model, tokenizer=tokenizer, num_kv_blocks=32)
        .generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        .outputs[0]
    )
    stop = plain.text[4:7]  # three characters from the middle of the greedy text: it must end there
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        engine = LLMEngine(model, tokenizer, num_kv_blocks=32)
        engine.add_request(
            "a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop=stop, output_kind=kind)
        )
        texts = []
        while engine.has_unfinished_requests():
            texts += [o.outputs[0].text for o in engine.step()]
        final = plain.text[: plain.text.index(stop)]
        streamed = "".join(texts) if kind is RequestOutputKind.DELTA else texts[-1]
        assert streamed == final
        if kind is RequestOutputKind.CUMULATIVE:
            assert all(final.startswith(t) for t in texts)  # nothing shown is ever taken back


def test_each_streamed_output_keeps_its_own_metrics(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, tokenizer, num_kv_blocks=32)
    engine.add_request(
        "a", PROMPTS[0], SamplingParams(max_tokens=5, seed=0, output_kind=RequestOutputKind.DELTA)
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[0].metrics is not outs[-1].metrics and outs[0].metrics.finished_time is None
    assert [o.metrics.num_output_tokens for o in outs] == list(range(1, len(outs) + 1))
    assert outs[-1].time_per_output_token is not None  # counted over all 5 tokens, not the last delta


def test_gpu_memory_utilization_is_checked_even_with_a_block_count(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        LLMEngine(model, tokenizer, num_kv_blocks=8, gpu_memory_utilization=5)
