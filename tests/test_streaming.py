"""``LLMEngine.step()`` streams as vLLM's does: an output for every request that moved on, in the
request's ``output_kind``; ``LLM.generate`` collects the same final outputs."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_attention.engine.detokenizer import Detokenizer
from paged_attention.engine.llm import LLM
from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.engine.sample.sampling import BeamSearchParams, RequestOutputKind, SamplingParams
from paged_attention.engine.sequence import Sequence
from paged_attention.models import load_model

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


# -- incremental detokenization ------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_incremental_text_equals_a_whole_decode(model_and_tokenizer, data, skip):
    """Fed one token or several at a time, the detokenizer's text is a whole decode's: while it
    streams, a prefix of it (never a half character), and once flushed, all of it."""
    _, tokenizer = model_and_tokenizer
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    seq = Sequence(0, "0", [1], SamplingParams(skip_special_tokens=skip), 0.0)
    detokenizer = Detokenizer(tokenizer)
    whole = tokenizer.decode(ids, skip_special_tokens=skip)
    fed = 0
    for n in chunks:
        if fed == len(ids):
            break
        seq.output_token_ids += ids[fed : fed + n]
        fed = min(len(ids), fed + n)
        detokenizer.update(seq)
        partial = tokenizer.decode(ids[:fed], skip_special_tokens=skip)
        assert partial.startswith(seq.output_text) and "\ufffd" not in seq.output_text[-1:]
    detokenizer.flush(seq)
    assert seq.output_text == whole


def test_a_streamed_step_decodes_a_few_tokens_however_long_the_output(model_and_tokenizer):
    """The per-step cost of streaming does not grow with the output: every step decodes the newest
    token and a window of one or two before it, at step 10 as at step 300 (a whole decode per step
    would be O(n), O(n^2) over the stream)."""
    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, tokenizer, block_size=16, num_kv_blocks=64)
    decoded: list[int] = []
    decode = tokenizer.decode

    def counting(ids, *args, **kwargs):
        decoded[-1] += len(ids)
        return decode(ids, *args, **kwargs)

    tokenizer.decode = counting
    try:
        stop = ["never in the text"]  # a stop string: the text is brought up to date at every step
        kind = RequestOutputKind.DELTA
        engine.add_request("long", "The KV cache", params(kind, max_tokens=300, ignore_eos=True, stop=stop))
        text, tokens = "", []
        while engine.has_unfinished_requests():
            decoded.append(0)
            for out in engine.step():
                text += out.outputs[0].text
                tokens += out.outputs[0].token_ids
    finally:
        del tokenizer.decode
    assert out.finished and len(tokens) == 300
    early, late = decoded[5:25], decoded[-21:-1]  # (the last step flushes the held-back text too)
    assert max(decoded[1:-1]) <= 12 and sum(late) <= 2 * sum(early) + 20, (early, late)
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)  # nothing lost on the way


def test_the_hold_back_shows_nothing_of_a_text_shorter_than_it(model_and_tokenizer):
    """Held back: the last ``len(stop) - 1`` characters. A text shorter than that shows nothing (a
    negative slice would have shown its beginning, then streamed it again)."""
    seq = Sequence(0, "0", [1], SamplingParams(stop=["a stop string"]), 0.0)
    for text in ("short", "ten chars!", "twelve chars"):  # 5, 10, 12 characters; the hold is 12
        seq.output_text = text
        assert Detokenizer.stable_text(seq) == ""
    seq.output_text = "a longer text than the stop string"
    assert Detokenizer.stable_text(seq) == seq.output_text[: -len("a stop string") + 1]


@pytest.mark.parametrize("skip", [True, False])
def test_a_run_of_tokens_that_decode_to_nothing_keeps_the_window_short(model_and_tokenizer, skip):
    """200 EOS tokens (``ignore_eos`` benchmarks sample them), then text: each update still decodes a
    few tokens, and the text is a whole decode's."""
    _, tokenizer = model_and_tokenizer
    eos = tokenizer.eos_token_id
    ids = [*tokenizer.encode("The page", add_special_tokens=False), *[eos] * 200,
           *tokenizer.encode(" table holds", add_special_tokens=False)]  # fmt: skip
    seq = Sequence(0, "0", [1], SamplingParams(skip_special_tokens=skip), 0.0)
    detokenizer, decoded = Detokenizer(tokenizer), []
    decode = detokenizer.decode
    detokenizer.decode = lambda token_ids, skip=True: (
        decoded.append(len(token_ids)) or decode(token_ids, skip)
    )
    for token in ids:
        seq.output_token_ids.append(token)
        detokenizer.update(seq)
    detokenizer.flush(seq)
    assert max(decoded) <= 12, max(decoded)
    assert seq.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
