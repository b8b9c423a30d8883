"""Structured outputs (issue 35): a JSON schema, a regex, a choice or a grammar as a token mask.

The engine's greedy tokens equal transformers' ``generate`` with xgrammar's own logits processor
(an implementation of the mask that shares nothing with ours but the grammar engine); every output
matches its constraint, sampled or greedy, forked, drafted for, preempted and recomputed; and
bad constraints are refused at the door, naming the field.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import regex
import torch
import xgrammar

from paged_attention import LLM, SamplingParams, StructuredOutputsParams
from paged_attention.engine.structured_output.grammar import Grammar, choice_grammar, is_lark, unpack_bitmask
from paged_attention.models import DEFAULT_MODEL_NAME, load_model, load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICE = ["yes", "no", 'maybe "so"']
GRAMMAR = 'root ::= ("ab" | "c")+ "."'
PROMPTS = ["The weather today is", "A list of animals:", "Once upon a time"]


def matches(constraint: StructuredOutputsParams, text: str) -> bool:
    if constraint.json is not None or constraint.json_object:
        try:
            jsonschema.validate(json.loads(text), constraint.schema() or {})
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if constraint.regex is not None:
        return re.fullmatch(constraint.regex, text) is not None
    if constraint.choice is not None:
        return text in constraint.choice
    return re.fullmatch(r"(ab|c)+\.", text) is not None  # GRAMMAR, as a regex


CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "json_text": StructuredOutputsParams(json=json.dumps(SCHEMA)),
    "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICE),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(block_size=4, num_kv_blocks=64)


def hf_structured_greedy(model, tokenizer, compiled, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` with xgrammar's Hugging Face logits processor."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        logits_processor=[xgrammar.contrib.hf.LogitsProcessor(compiled)],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in tokens else tokens


@pytest.mark.parametrize("name", ["json", "regex", "choice", "grammar"])
def test_greedy_equals_transformers_generate_with_xgrammars_logits_processor(llm: LLM, name: str) -> None:
    model, _ = load_model(DEFAULT_MODEL_NAME)
    tokenizer = load_tokenizer(None)
    constraint = CONSTRAINTS[name]
    compiled = llm.llm_engine.structured_output.compiler.compile(constraint)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer(prompt)["input_ids"]
        expected = hf_structured_greedy(model, tokenizer, compiled, ids, 40)
        completion = out.outputs[0]
        got = list(completion.token_ids)
        assert got == expected[: len(got)] and len(got) == len(expected), (name, prompt, completion.text)
        assert completion.finish_reason == "stop" and matches(constraint, completion.text), completion.text


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_every_sample_matches_its_constraint(llm: LLM, name: str) -> None:
    constraint = CONSTRAINTS[name]
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=64, structured_outputs=constraint)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    finished = [c for out in outputs for c in out.outputs if c.finish_reason == "stop"]
    assert len(finished) >= 3, [c.text for out in outputs for c in out.outputs]  # random weights ramble
    for completion in finished:
        assert matches(constraint, completion.text), (name, completion.text)
    for out in outputs:
        for completion in out.outputs:  # an unfinished one is a prefix of a match: never a wrong token
            assert completion.finish_reason in ("stop", "length")


def test_drafts_preemption_and_chunked_prefill_change_no_token() -> None:
    """n-gram drafts verified against the grammar's mask at every drafted position, a cache small
    enough to preempt, and prompts split in chunks: the same greedy tokens as a plain run."""
    prompts = [p * 3 for p in PROMPTS]
    params = [
        SamplingParams(temperature=0, max_tokens=48, structured_outputs=c) for c in CONSTRAINTS.values()
    ]
    plain = LLM(num_kv_blocks=256)
    want = [[o.outputs[0].token_ids for o in plain.generate(prompts, p, use_tqdm=False)] for p in params]
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    tight = LLM(block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, speculative_config=ngram)
    got = [[o.outputs[0].token_ids for o in tight.generate(prompts, p, use_tqdm=False)] for p in params]
    assert got == want
    engine = tight.llm_engine
    assert engine.scheduler.num_preemptions > 0 and engine.speculator is not None
    assert engine.speculator.stats.num_accepted_tokens > 0
    assert engine.cache_manager.num_free_blocks == engine.cache_manager.num_blocks


def test_a_refused_draft_is_never_accepted() -> None:
    """The drafts copy the prompt's "12a" pattern; the grammar allows digits only, so every drafted
    "a" is rejected at its position while drafted digits may be accepted."""
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    prompt = "12a" * 7
    params = SamplingParams(
        temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[0-9]+")
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    stats = llm.llm_engine.speculator.stats
    assert re.fullmatch("[0-9]+", out.text), out.text
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # drafts were made, and some refused


def test_the_mask_is_xgrammars_bitmask_bit_for_bit() -> None:
    words = torch.randint(-(2**31), 2**31 - 1, (5,), dtype=torch.int32)
    logits = torch.zeros(1, 150)
    xgrammar.apply_token_bitmask_inplace(logits, words.unsqueeze(0))
    assert torch.equal(unpack_bitmask(words, 150), logits[0] == 0)


def test_a_grammar_follows_its_sequence_backwards_and_forwards(llm: LLM) -> None:
    compiler = llm.llm_engine.structured_output.compiler
    tokenizer = llm.get_tokenizer()
    grammar = Grammar(compiler.compile(StructuredOutputsParams(regex=REGEX)), compiler)
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "123"]
    first = grammar.mask([])
    after = grammar.mask(digits)
    assert grammar.num_consumed == 3 and not torch.equal(first, after)
    allowed = [tokenizer.decode([t]) for t in after.nonzero().flatten().tolist()]
    assert "-" in allowed and not any(ch.isdigit() for text in allowed for ch in text)
    grammar.rollback_to(1)
    assert grammar.num_consumed == 1 and torch.equal(
        grammar.mask(digits[:1]), grammar.fork().mask(digits[:1])
    )
    assert torch.equal(grammar.mask(digits), after)  # forward again
    assert torch.equal(grammar.mask([digits[1]]), grammar.fork().mask([digits[1]]))  # not a continuation
    ahead = grammar.masks_ahead([], digits)
    assert len(ahead) == 4 and torch.equal(ahead[0], first) and torch.equal(ahead[3], after)
    assert grammar.num_consumed == 0  # masks_ahead leaves the matcher where it was


def test_a_lark_grammar_is_taken_as_vllm_takes_it(llm: LLM) -> None:
    lark = 'start: item ("," item)*\nitem: "red" | "green" | "blue"  // a comment'
    constraint = StructuredOutputsParams(grammar=lark)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, structured_outputs=constraint),
                       use_tqdm=False)  # fmt: skip
    for o in out:  # a whole match, or (cut by max_tokens) the beginning of one
        finished = o.outputs[0].finish_reason == "stop"
        assert regex.fullmatch(
            r"(red|green|blue)(,(red|green|blue))*", o.outputs[0].text, partial=not finished
        )
    assert is_lark(lark) and not is_lark(GRAMMAR) and not is_lark("# only a comment ::= here\nroot ::= x")
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar could not be compiled: Lark error"):
        llm.llm_engine.add_request(
            "bad", "Hi", SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: ??"))
        )


def test_llm_chat_gives_the_tools_to_the_template(llm: LLM) -> None:
    template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if tools %} [{{ tools[0]['function']['name'] }}]{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    params = SamplingParams(max_tokens=1)
    with_tools = llm.chat(
        [{"role": "user", "content": "hi"}], params, use_tqdm=False, chat_template=template, tools=tools
    )
    assert with_tools[0].prompt == "hi [lookup]"


def test_a_complete_match_ends_even_before_min_tokens(llm: LLM) -> None:
    """min_tokens bans the stop token; after "yes" the grammar allows nothing else: the grammar wins
    (the row is the grammar's alone) and the answer ends, rather than running on unconstrained."""
    constraint = StructuredOutputsParams(choice=["yes", "no"])
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature, seed=1, max_tokens=12, min_tokens=8, structured_outputs=constraint
        )
        for out in llm.generate(PROMPTS, params, use_tqdm=False):
            assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"
    longer = StructuredOutputsParams(regex="[a-z]+")  # min_tokens still holds where the grammar may go on
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=8, structured_outputs=longer)
    assert all(len(o.outputs[0].token_ids) >= 8 for o in llm.generate(PROMPTS, params, use_tqdm=False))


def test_choice_grammar_escapes_quotes_and_backslashes() -> None:
    assert choice_grammar(['a "b"', "c\\d", "e\nf"]) == 'root ::= "a \\"b\\"" | "c\\\\d" | "e\\nf"'


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(), ValueError, "exactly one of json, regex, choice, grammar, json_object; got none"),
        (dict(regex="a", choice=["a"]), ValueError, "got regex, choice"),
        (dict(json=3), TypeError, "structured_outputs.json must be a JSON schema"),
        (dict(json="{not json"), ValueError, "structured_outputs.json is not valid JSON"),
        (dict(regex=""), TypeError, "structured_outputs.regex must be a non-empty string"),
        (dict(choice=[]), TypeError, "structured_outputs.choice must be a list of non-empty strings"),
        (dict(choice=["a", 3]), TypeError, "structured_outputs.choice must be a list of non-empty strings"),
        (dict(json_object=False), ValueError, "structured_outputs.json_object must be True"),
        (dict(regex="a", structural_tag="{}"), ValueError, "structural_tag and whitespace_pattern"),
        (dict(regex="a", disable_any_whitespace=1), TypeError, "disable_any_whitespace must be a bool"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(kwargs, error, message) -> None:
    with pytest.raises(error, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_only_structured_outputs_params() -> None:
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (
            StructuredOutputsParams(json={"type": "nope"}),
            'structured_outputs.json could not be compiled: Unsupported type "nope"',
        ),
        (
            StructuredOutputsParams(regex="[a-"),
            "structured_outputs.regex could not be compiled: Regex parsing error",
        ),
        (
            StructuredOutputsParams(grammar="root ::= "),
            "structured_outputs.grammar could not be compiled: EBNF parser error",
        ),
        (StructuredOutputsParams(regex="[^\\s\\S]"), "structured_outputs.regex matches no text"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_and_nothing_is_queued(
    llm: LLM, constraint, message
) -> None:
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request("bad", "Hello", SamplingParams(structured_outputs=constraint))
    assert not engine.has_unfinished_requests()
    out = llm.generate(
        ["Hello"], SamplingParams(max_tokens=4, structured_outputs=CONSTRAINTS["regex"]), use_tqdm=False
    )
    assert re.fullmatch(
        r"[0-9]{1,3}(-[a-z]{0,2})?", out[0].outputs[0].text
    )  # it serves on (a prefix: 4 tokens)
