"""The cross-check's comparison (experiments/crosscheck.py) fails on what it must, on synthetic answers
(the real run against vLLM is `make crosscheck`)."""

from __future__ import annotations

import copy

from paged_attention.experiments.crosscheck import LOGPROB_TOL, MISSING_FIELDS, compare


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
