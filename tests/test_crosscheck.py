"""The cross-check's comparison (experiments/crosscheck.py) fails on what it must, on synthetic answers
(the real run against vLLM is `make crosscheck`)."""

from __future__ import annotations

import copy

from paged_attention.experiments.crosscheck import LOGPROB_TOL, MISSING_FIELDS, Check, compare


def _answers() -> dict:
    sample = {
        "index": 0, "text": " Paris", "token_ids": [7042, 30], "finish_reason": "length", "stop_reason": None,
        "cumulative_logprob": -1.5, "fields": ["index", "text"],
        "logprobs": [[[7042, -0.5, 1, " Paris"], [314, -2.0, 2, " is"]], [[30, -1.0, 1, "."]]],
    }  # fmt: skip
    request = {
        "prompt": "The capital", "prompt_token_ids": [1, 2], "finished": True, "num_cached_tokens": 0,
        "prompt_logprobs": [None, [[2, -3.0, 4, "x"]]], "fields": ["prompt"], "outputs": [sample],
    }  # fmt: skip
    return {"answers": {"case": [request], "repr": "SamplingParams(n=1)", "gumbel": [3, 1]}}


def _ok(ours: dict, theirs: dict) -> list[bool]:
    return [c.ok for c in compare(ours, theirs)]


def test_equal_answers_pass_and_each_kind_of_difference_fails() -> None:
    theirs = _answers()
    assert _ok(copy.deepcopy(theirs), theirs) == [True, True, True]
    for change in (
        lambda a: a["answers"]["case"][0]["outputs"][0]["token_ids"].__setitem__(1, 31),
        lambda a: a["answers"]["case"][0]["outputs"][0].__setitem__("finish_reason", "stop"),
        lambda a: a["answers"]["case"][0]["outputs"][0].__setitem__("cumulative_logprob", None),
        lambda a: a["answers"]["case"][0].__setitem__("num_cached_tokens", 32),
        lambda a: a["answers"]["case"][0]["outputs"][0]["logprobs"][0][1].__setitem__(
            1, -2 + 10 * LOGPROB_TOL
        ),
        lambda a: a["answers"]["case"][0]["prompt_logprobs"][1][0].__setitem__(2, 5),
        lambda a: a["answers"].__setitem__("repr", "SamplingParams(n=2)"),
        lambda a: a["answers"]["gumbel"].__setitem__(0, 4),
    ):
        ours = copy.deepcopy(theirs)
        change(ours)
        assert not all(_ok(ours, theirs)), change


def test_near_ties_may_swap_and_listed_fields_may_be_missing() -> None:
    theirs = _answers()
    ours = copy.deepcopy(theirs)
    entry = ours["answers"]["case"][0]["outputs"][0]["logprobs"][0]
    entry[1] = [315, -2.0 + LOGPROB_TOL / 2, 2, " was"]  # the last of the top-k, within the tolerance
    theirs["answers"]["case"][0]["outputs"][0]["logprobs"][0].append([315, -2.0 - LOGPROB_TOL / 4, 3, " was"])
    ours["answers"]["case"][0]["outputs"][0]["logprobs"][0].append([314, -2.0 - LOGPROB_TOL / 4, 3, " is"])
    assert all(_ok(ours, theirs))
    listed = next(iter(MISSING_FIELDS))
    theirs["answers"]["case"][0]["fields"].append(listed)
    assert all(_ok(ours, theirs))
    theirs["answers"]["case"][0]["fields"].append("a_field_nobody_listed")
    assert not all(_ok(ours, theirs))


def test_the_last_of_the_top_k_may_differ_only_within_the_tolerance() -> None:
    """logprobs=1 with the sampled token outside the top-1: the top-1 tokens of the two engines may
    differ only if their log-probabilities are closer than the tolerance."""
    theirs = _answers()
    position = [[30, -3.0, 4, "."], [7, -1.0, 1, "a"]]  # sampled token (rank 4), then the top-1
    theirs["answers"]["case"][0]["outputs"][0]["logprobs"][1] = position
    for value, same in ((-1.0 - LOGPROB_TOL / 2, True), (-1.0 - 10 * LOGPROB_TOL, False)):
        ours = copy.deepcopy(theirs)
        ours["answers"]["case"][0]["outputs"][0]["logprobs"][1] = [[30, -3.0, 4, "."], [8, value, 1, "b"]]
        assert all(_ok(ours, theirs)) is same


def test_errors_and_empty_answers_are_differences() -> None:
    theirs = _answers()
    both_fail = {"answers": {**theirs["answers"], "case": {"error": "ValueError"}}}
    assert not all(_ok(copy.deepcopy(both_fail), both_fail))
    empty = {"answers": {**theirs["answers"], "case": []}}
    assert not all(_ok(copy.deepcopy(empty), empty))
    shorter = copy.deepcopy(theirs)
    shorter["answers"]["gumbel"].pop()
    assert not all(_ok(shorter, theirs))


def test_the_peer_workload_is_seeded_and_sized_as_documented() -> None:
    from paged_attention.experiments.peer import workload
    from paged_attention.models.resolve import load_tokenizer

    tokenizer = load_tokenizer()  # the embedded model's: any tokenizer cuts the same way
    prompts = workload(tokenizer, 64)
    lengths = [len(p["prompt_token_ids"]) for p in prompts]
    assert len(prompts) == 64 and min(lengths) >= 27 and max(lengths) <= 300
    assert prompts == workload(tokenizer, 64) and prompts != workload(tokenizer, 64, seed=1)


def test_the_echo_comparison_reports_each_kind_of_difference() -> None:
    """:mod:`~paged_attention.experiments.crosscheck_echo` on answers from this package's own server
    (the tiny model): equal to themselves; a moved log-probability, a changed rank, a ``null``
    that is not, another text and a missing field are each reported."""
    from paged_attention.engine.chat import PLAIN_TEMPLATE
    from paged_attention.engine.llm_engine import LLMEngine
    from paged_attention.experiments import crosscheck_echo
    from paged_attention.serving import AsyncLLM, ServerThread, build_app

    server = ServerThread(build_app(AsyncLLM(LLMEngine(None, num_kv_blocks=32)), "tiny", PLAIN_TEMPLATE))
    server.start()
    try:
        ours = crosscheck_echo.ask(server.url)
    finally:
        server.stop()
    assert all("error" not in answer for answer in ours)

    def differences(theirs: list[dict]) -> list[str]:
        check = Check("echo")
        crosscheck_echo.compare(check, ours, theirs)
        assert check.ok == (not check.notes)
        return check.notes

    assert differences(copy.deepcopy(ours)) == []
    cases = []
    moved = copy.deepcopy(ours)
    moved[0]["choices"][0]["logprobs"]["token_logprobs"][3] -= 0.01
    cases.append((moved, "token_logprobs[3]"))
    ranked = copy.deepcopy(ours)
    entry = ranked[3]["choices"][0]["prompt_logprobs"][2]
    next(iter(entry.values()))["rank"] += 1
    cases.append((ranked, "prompt_logprobs position 2"))
    first = copy.deepcopy(ours)
    first[1]["choices"][0]["logprobs"]["token_logprobs"][0] = -1.0
    cases.append((first, "token_logprobs[0]"))
    text = copy.deepcopy(ours)
    text[2]["choices"][0]["text"] += "!"
    cases.append((text, "text"))
    chat = copy.deepcopy(ours)
    chat[4]["prompt_logprobs"] = None
    cases.append((chat, "prompt_logprobs"))
    for theirs, where in cases:
        found = differences(theirs)
        assert found and all(where in line for line in found), (where, found)
