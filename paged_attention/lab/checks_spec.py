"""Checks of the speculative-decoding exercises (notebook 10): the n-gram proposer, compared with
the package's on named and random token lists, and the rule that accepts drafts, greedy exactly
and sampled by the distribution of what it emits (which must be the target's)."""

from __future__ import annotations

import math
import random
from typing import Any

from ..engine.spec_decode.ngram import propose
from .checking import CheckFailed, expect
from .student import Student, driver


@driver
def propose_run(state: dict, objects: tuple, tokens: list[int], low: int, high: int, k: int) -> Any:
    """The student's ``propose_drafts(token_ids, min_n, max_n, k)``, as a list of ints."""
    got = objects[0](list(tokens), low, high, k)
    try:
        return [int(t) for t in got]
    except (TypeError, ValueError):
        return repr(got)[:80]


def _last_occurrence(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        suffix = tokens[len(tokens) - n :]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == suffix]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


def _without_overlap(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """The package's rule, but an earlier occurrence may not overlap the suffix itself."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - 2 * n + 1):
            if tokens[start : start + n] == suffix and tokens[start + n : start + n + k]:
                return tokens[start + n : start + n + k]
    return []


def _shortest_first(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    for n in range(low, min(high, len(tokens) - 1) + 1):
        got = propose(tokens, n, n, k)
        if got:
            return got
    return []


NAMED = [
    ("'1 2' occurred before: propose what followed it", [1, 2, 3, 4, 1, 2], 1, 3, 2),
    ("the longest match wins ('1 2' -> 9), not a shorter one ('2' -> 7)", [2, 7, 1, 2, 9, 1, 2], 1, 2, 1),
    ("the first occurrence, as vLLM's NgramProposer", [1, 2, 3, 1, 2, 4, 1, 2], 2, 2, 1),
    ("fewer than k tokens follow the match", [1, 2, 3, 4, 1, 2], 1, 3, 9),
    ("no n-gram of at least min_n tokens repeats", [1, 2, 3, 1], 2, 3, 2),
    ("overlapping occurrences", [5, 5, 5, 5], 2, 3, 3),
    ("k = 0", [1, 2, 1, 2], 1, 2, 0),
    ("a single token", [7], 1, 2, 3),
]


def ngram(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``propose_drafts(token_ids, min_n, max_n, k)`` vs
    :func:`paged_attention.engine.spec_decode.ngram.propose`: the longest suffix between
    ``min_n`` and ``max_n`` tokens that occurred earlier, its first occurrence, and up to ``k``
    tokens that followed it."""
    rng = random.Random(seed)
    cases = [(name, tokens, low, high, k) for name, tokens, low, high, k in NAMED]
    for _ in range(60 if not thorough else 300):
        tokens = [rng.randint(0, 3) for _ in range(rng.randint(0, 30))]
        low = rng.randint(1, 3)
        cases.append(("random", tokens, low, low + rng.randint(0, 3), rng.randint(0, 6)))
    for name, tokens, low, high, k in cases:
        call = f"propose_drafts({tokens}, min_n={low}, max_n={high}, k={k})"
        case = call if name == "random" else f"{call} ({name})"
        want = propose(tokens, low, high, k)
        got = student.call(case, "checks_spec:propose_run", tokens, low, high, k)
        hint = "the tokens that followed the longest earlier match of the sequence's last tokens"
        if isinstance(got, list) and len(got) > k:
            hint = "at most k drafts"
        elif got == _last_occurrence(tokens, low, high, k) != want:
            hint = "take the first (earliest) occurrence of the n-gram, as vLLM does"
        elif got == _without_overlap(tokens, low, high, k) != want:
            hint = (
                "an earlier occurrence may overlap the last n tokens themselves: in 5 5 5 5 the last "
                "three tokens also occur at position 0, followed by one 5"
            )
        elif got == _shortest_first(tokens, low, high, k) != want:
            hint = "try the longest n first (max_n down to min_n): a longer match is a better guess"
        expect(case, want, got, hint)
    return len(cases)


@driver
def accept_run(
    state: dict,
    objects: tuple,
    drafts: list[int],
    probs: list[list[float]],
    greedy: bool,
    draws: int,
    seed: int,
) -> Any:
    """``accept_drafts(drafts, probs, generator, greedy)`` called ``draws`` times with one generator
    seeded ``seed``: how often each emitted token list came back (keys: the tokens joined by ',').
    Imports torch where it runs: the exercise's setup has imported it before the child's limits
    (the n-gram exercise's child, running only :func:`propose_run`, starts without torch)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    table = torch.tensor(probs, dtype=torch.float64)
    counts: dict[str, int] = {}
    for _ in range(draws):
        got = objects[0](list(drafts), table, generator, greedy)
        key = ",".join(str(int(t)) for t in got)
        counts[key] = counts.get(key, 0) + 1
    return counts


DISTRIBUTIONS = [
    ("a likely draft", [1], [[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]]),
    ("an unlikely draft", [2], [[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]]),
    ("an impossible draft", [3], [[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]]),
    ("a certain draft", [0], [[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]]),
    ("two drafts", [1, 2], [[0.3, 0.6, 0.1], [0.2, 0.2, 0.6], [0.5, 0.25, 0.25]]),
]


def _sequence_probabilities(drafts: list[int], probs: list[list[float]]) -> dict[str, float]:
    """The exact distribution of what the rule emits: each accepted prefix, then one token."""
    out: dict[str, float] = {}

    def walk(i: int, prefix: list[int], mass: float) -> None:
        for token, p in enumerate(probs[i]):
            if p <= 0:
                continue
            emitted = [*prefix, token]
            if i < len(drafts) and token == drafts[i]:
                walk(i + 1, emitted, mass * p)
            else:
                key = ",".join(map(str, emitted))
                out[key] = out.get(key, 0.0) + mass * p

    walk(0, [], 1.0)
    return out


def _ends_on_its_draft(key: str, drafts: list[int]) -> bool:
    """Whether an emitted token list stops on a token equal to the draft at its position (which an
    accepted draft never does: the rule would have gone on)."""
    tokens = [int(t) for t in key.split(",") if t]
    return 0 < len(tokens) <= len(drafts) and tokens[-1] == drafts[len(tokens) - 1]


def verify(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``accept_drafts(drafts, probs, generator, greedy)``: greedy, the drafts while each equals its
    row's argmax, then the argmax at the first mismatch (exactly :func:`verify_greedy`); sampled,
    what it emits over many draws must follow the target's distribution (a draft accepted with
    probability p(draft); on a rejection a token drawn from p without the draft; after the last
    accepted draft one more token): a chi-square test on the emitted token lists."""
    import torch

    from ..engine.sample.rejection import verify_greedy

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    passed = 0
    for _ in range(20 if not thorough else 80):
        k = rng.randint(0, 4)
        probs = torch.rand(k + 1, 6, generator=gen).softmax(-1)
        target = probs.argmax(-1).tolist()
        drafts = [t if rng.random() < 0.6 else (t + 1) % 6 for t in target[:k]]
        case = f"accept_drafts({drafts}, probs with argmaxes {target}, greedy=True)"
        want = verify_greedy(drafts, target)[0]
        counts = student.call(case, "checks_spec:accept_run", drafts, probs.tolist(), True, 1, seed)
        got = [int(t) for t in next(iter(counts)).split(",") if t] if counts else None
        expect(
            case,
            want,
            got,
            "greedy: keep drafts while each equals its row's argmax, then append the "
            "argmax of the first row that disagrees (or of the last row)",
        )
        passed += 1
    draws = 8_000  # mistakes off by 0.1 or more, slips of 0.05 too: caught at any seed (tests/test_lab.py)
    for name, drafts, probs in DISTRIBUTIONS:
        case = f"accept_drafts({drafts}, probs={probs}, greedy=False), {draws} draws ({name})"
        counts = student.call(
            case, "checks_spec:accept_run", drafts, probs, False, draws, rng.randrange(2**31)
        )
        exact = _sequence_probabilities(drafts, probs)
        unexpected = sorted(set(counts) - set(exact))
        came_back = [key for key in unexpected if _ends_on_its_draft(key, drafts)]
        if came_back:
            raise CheckFailed(
                case,
                f"only token lists among {sorted(exact)}",
                f"also {came_back[:3]}",
                "a rejected draft came back: on a rejection, draw from p WITHOUT the draft, renormalised",
            )
        if unexpected:
            raise CheckFailed(
                case,
                f"only token lists among {sorted(exact)}",
                f"also {unexpected[:3]}",
                "emit the accepted drafts, then one token: stop after the first token that is not a draft",
            )
        statistic = sum((counts.get(key, 0) - draws * p) ** 2 / (draws * p) for key, p in exact.items())
        dof = max(1, len(exact) - 1)
        critical = dof + 8 * math.sqrt(2 * dof) + 20  # far in the tail: a right rule fails ~never
        if statistic > critical:
            worst = max(exact, key=lambda key: abs(counts.get(key, 0) / draws - exact[key]))
            hint = "accept draft x with probability p(x); on a rejection draw from p without x, renormalised"
            first = [key for key in exact if key.split(",")[0] == str(drafts[0])]
            seen_first = sum(counts.get(key, 0) for key in first) / draws
            if seen_first > probs[0][drafts[0]] + 0.02:
                hint = "the draft comes out too often: on a rejection, draw from p WITHOUT the draft"
            raise CheckFailed(
                f"{case}: how often {worst.replace(',', ' then ')} is emitted",
                round(exact[worst], 4),
                round(counts.get(worst, 0) / draws, 4),
                hint,
            )
        passed += 1
    return passed
