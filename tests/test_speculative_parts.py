"""The parts of speculative decoding, alone: vLLM's ``speculative_config`` validated, the n-gram
proposer against a brute-force definition, and the rejection rule (greedy on synthetic argmaxes;
sampling by its distribution, which must be exactly the target's at every position)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_attention.engine.sample.rejection import verify_greedy, verify_sampled
from paged_attention.engine.spec_decode.ngram import propose
from paged_attention.engine.spec_decode.speculative import SpeculativeConfig

# -- speculative_config ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"method": "ngram", "num_speculative_tokens": 3}, (3, 5, 5)),
        ({"num_speculative_tokens": 4, "prompt_lookup_max": 3}, (4, 3, 3)),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 2}, (2, 2, 2)),
        (
            {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
            (5, 1, 4),
        ),
    ],
)
def test_a_valid_config_and_vllms_defaults(config: dict, expected: tuple) -> None:
    parsed = SpeculativeConfig.from_dict(config)
    assert (parsed.num_speculative_tokens, parsed.prompt_lookup_min, parsed.prompt_lookup_max) == expected
    assert SpeculativeConfig.from_dict(None) is None and SpeculativeConfig.from_dict(parsed) is parsed


@pytest.mark.parametrize(
    "config, error, message",
    [
        ({"method": "medusa", "num_speculative_tokens": 3}, ValueError, "needs a draft model"),
        ({"method": "suffix_tree", "num_speculative_tokens": 3}, ValueError, r"must be one of \['ngram'\]"),
        ({"num_speculative_tokens": 0}, ValueError, r"\['num_speculative_tokens'\] must be >= 1, got 0"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            ValueError,
            r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)",
        ),
        ({"num_speculative_tokens": "3"}, TypeError, r"\['num_speculative_tokens'\] must be an int, got str"),
        ({"num_speculative_tokens": True}, TypeError, "must be an int, got bool"),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": 2.5}, TypeError, "must be an int, got float"),
        ({"method": "ngram"}, ValueError, "needs 'num_speculative_tokens'"),
        ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, ValueError, "unknown key"),
        ([("num_speculative_tokens", 2)], TypeError, "must be a dict or None, got list"),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(config: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        SpeculativeConfig.from_dict(config)  # type: ignore[arg-type]


# -- the n-gram proposer ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, expected",
    [
        ([1, 2, 3, 4, 1, 2], 1, 3, 2, [3, 4]),  # "1 2" occurred at 0: propose what followed
        ([1, 2, 3, 4, 1, 2], 1, 3, 9, [3, 4, 1, 2]),  # up to k, fewer at the end of the sequence
        ([2, 7, 1, 2, 9, 1, 2], 1, 2, 1, [9]),  # the longest match ("1 2"), not the shorter ("2" -> 7)
        ([1, 2, 3, 1, 2, 4, 1, 2], 2, 2, 1, [3]),  # the first occurrence, as vLLM's NgramProposer
        ([1, 2, 3], 1, 3, 2, []),  # nothing repeats
        ([1, 2, 3, 1], 2, 3, 2, []),  # "3 1" never occurred, and 1-grams are below min_n
        ([1, 2, 3, 1], 1, 3, 2, [2, 3]),
        ([5, 5, 5, 5], 2, 3, 3, [5]),  # overlapping: "5 5 5" at 0 is followed by one 5
        ([1, 2, 1, 2], 1, 2, 0, []),  # k = 0
        ([7], 1, 2, 3, []),
    ],
)
def test_propose(tokens: list[int], min_n: int, max_n: int, k: int, expected: list[int]) -> None:
    assert propose(tokens, min_n, max_n, k) == expected


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[len(tokens) - n :]]
        if starts:
            return tokens[starts[0] + n : starts[0] + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=40),
    st.integers(1, 4),
    st.integers(0, 3),
    st.integers(0, 6),
)
def test_propose_is_the_longest_earliest_match(tokens: list[int], min_n: int, extra: int, k: int) -> None:
    got = propose(tokens, min_n, min_n + extra, k)
    assert got == (brute_force(tokens, min_n, min_n + extra, k) if k else [])
    assert len(got) <= k


# -- the rejection rule ----------------------------------------------------------------------------

EOS = 0


@pytest.mark.parametrize(
    "drafts, target, tokens, accepted",
    [
        ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8], 3),  # every draft right: k + 1 tokens from one forward
        ([5, 6, 7], [5, 9, 7, 8], [5, 9], 1),  # an early mismatch: the target's own token replaces it
        ([5, 6, 7], [4, 6, 7, 8], [4], 0),  # all rejected: one token, as without drafts
        ([], [3], [3], 0),
        ([5, EOS, 7], [5, EOS, 7, 8], [5, EOS, 7, 8], 3),  # EOS inside: the caller stops at it
    ],
)
def test_verify_greedy(drafts: list[int], target: list[int], tokens: list[int], accepted: int) -> None:
    assert verify_greedy(drafts, target) == (tokens, accepted)


def test_verify_greedy_needs_one_more_target_than_drafts() -> None:
    with pytest.raises(ValueError, match=r"len\(drafts\) \+ 1 = 3"):
        verify_greedy([1, 2], [1, 2])


P0 = torch.tensor([0.5, 0.3, 0.2, 0.0])
P1 = torch.tensor([0.1, 0.1, 0.1, 0.7])


def draws(drafts: list[int], probs: torch.Tensor, n: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [verify_sampled(drafts, probs, generator)[0] for _ in range(n)]


def assert_distributed_as(samples: list[int], p: torch.Tensor, what: str) -> None:
    """Every token's frequency within 5 standard errors of its probability."""
    n = len(samples)
    counts = torch.bincount(torch.tensor(samples), minlength=p.numel()).double() / n
    for token, (freq, prob) in enumerate(zip(counts.tolist(), p.tolist(), strict=True)):
        tolerance = 5 * math.sqrt(max(prob * (1 - prob), 1e-12) / n) + 1e-9
        assert abs(freq - prob) <= tolerance, f"{what}: token {token} drawn {freq:.4f}, p = {prob:.4f}"


@pytest.mark.parametrize("draft", [0, 1, 3], ids=["likely draft", "less likely draft", "impossible draft"])
def test_verify_sampled_emits_exactly_the_targets_distribution(draft: int) -> None:
    """Leviathan et al.'s rule for a point-mass draft: the first token is distributed as p0 whatever
    the draft, and after an accepted draft the next is distributed as p1."""
    samples = draws([draft], torch.stack([P0, P1]), 40_000, seed=draft)
    assert_distributed_as([s[0] for s in samples], P0, f"first token, draft {draft}")
    after = [s[1] for s in samples if s[0] == draft and len(s) == 2]
    if P0[draft] > 0:
        assert len(after) == sum(s[0] == draft for s in samples)  # an accepted draft is followed by a draw
        assert_distributed_as(after, P1, f"token after an accepted draft {draft}")


def test_verify_sampled_counts_and_shapes() -> None:
    certain = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    assert verify_sampled([1], certain) == ([1, 0], 1)  # p(draft) = 1: always accepted
    assert verify_sampled([0], certain)[1] == 0  # p(draft) = 0: never
    with pytest.raises(ValueError, match=r"\[len\(drafts\) \+ 1, vocab\]"):
        verify_sampled([1, 2], certain)
