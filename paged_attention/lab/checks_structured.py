"""Check of the structured-outputs exercise (notebook 12): the token mask by brute force, compared
with the package's oracle (:func:`paged_attention.engine.structured_output.reference.allowed_tokens`)
on named and random cases, with a hint for each likely mistake."""

from __future__ import annotations

import random
import re
from typing import Any

import regex

from ..engine.structured_output.reference import allowed_tokens
from .checking import expect
from .student import Student, driver

#: A small vocabulary: texts by token id; the last id (its text None) is the stop token.
VOCAB = ["0", "1", "12", "123", "-", "-a", "a", "ab", "abc", "b", " ", "x", "3-", "", "ye", "yes", "s", None]
STOP = [len(VOCAB) - 1]
DIGITS = r"[0-9]{3}-[a-z]{2}"

NAMED = [
    ("nothing written yet: the tokens that can start a match", "", DIGITS),
    ("a token may end inside the match ('12') or carry several characters ('123')", "1", DIGITS),
    ("a token may cross from the digits into the dash ('3-')", "12", DIGITS),
    ("a token that runs past the end of the match ('abc' after '123-') is refused", "123-", DIGITS),
    ("a whole match: only the stop token", "123-ab", DIGITS),
    ("a whole match that may go on: the stop token and the tokens that continue", "12", r"[0-9]+"),
    ("a choice, half written", "y", r"(yes|no|maybe)"),
    ("a text that can no longer match allows nothing", "x", DIGITS),
]
PATTERNS = [DIGITS, r"[0-9]+", r"(yes|no|maybe)", r"a(b|-)*", r"[a-c]{1,3}( [0-9])?", r"(12|3-)+x?"]
SAMPLES = [
    "123-ab",
    "120-ba",
    "12",
    "7",
    "yes",
    "no",
    "maybe",
    "ab-b",
    "a",
    "cab 1",
    "b",
    "123-x",
    "3-12x",
    "12x",
]


@driver
def mask_run(state: dict, objects: tuple, text: str, texts: list, pattern: str, stop_ids: list[int]) -> Any:
    """The student's ``token_mask(text, texts, pattern, stop_ids)``, as a sorted list of ints."""
    got = objects[0](text, list(texts), pattern, list(stop_ids))
    try:
        return sorted(int(t) for t in got)
    except (TypeError, ValueError):
        return repr(got)[:80]


def _prefix_match(text: str, texts: list, pattern: str, stop_ids: list[int]) -> list[int]:
    """A likely mistake: "the pattern matches at the start" instead of "a match is still possible"."""
    ids = [i for i, piece in enumerate(texts) if piece and re.match(pattern, text + piece)]
    return sorted(ids + (list(stop_ids) if re.fullmatch(pattern, text) else []))


def _without_stop(text: str, texts: list, pattern: str, stop_ids: list[int]) -> list[int]:
    return [i for i in allowed_tokens(text, texts, pattern, stop_ids) if i not in stop_ids]


def _stop_always(text: str, texts: list, pattern: str, stop_ids: list[int]) -> list[int]:
    return sorted(set(allowed_tokens(text, texts, pattern, stop_ids)) | set(stop_ids))


def _empty_allowed(text: str, texts: list, pattern: str, stop_ids: list[int]) -> list[int]:
    compiled = regex.compile(pattern)
    extra = [i for i, piece in enumerate(texts) if piece == "" and compiled.fullmatch(text, partial=True)]
    return sorted(set(allowed_tokens(text, texts, pattern, stop_ids)) | set(extra))


def token_mask(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``token_mask(text, texts, pattern, stop_ids)``: the ids whose text keeps a match of
    ``pattern`` possible after ``text``, and the stop ids when ``text`` is a whole match."""
    rng = random.Random(seed)
    cases = [(name, text, VOCAB, pattern) for name, text, pattern in NAMED]
    for _ in range(40 if not thorough else 200):
        pattern, sample = rng.choice(PATTERNS), rng.choice(SAMPLES)
        text = sample[: rng.randint(0, len(sample))]
        pieces = {sample[a:b] for a in range(len(sample)) for b in range(a + 1, len(sample) + 1)}
        texts = [*rng.sample(sorted(pieces), min(len(pieces), 6)), *rng.sample(VOCAB[:-1], 5), None]
        cases.append(("random", text, texts, pattern))
    for name, text, texts, pattern in cases:
        stop = [len(texts) - 1]
        call = f"token_mask({text!r}, {texts}, {pattern!r}, stop_ids={stop})"
        case = call if name == "random" else f"{call} ({name})"
        want = allowed_tokens(text, texts, pattern, stop)
        got = student.call(case, "checks_structured:mask_run", text, texts, pattern, stop)
        hint = "a token may come next when text + its text can still become a whole match"
        if got == _prefix_match(text, texts, pattern, stop) != want:
            hint = (
                "re.match asks whether the pattern matches at the start, not whether a match is still "
                "possible: regex.fullmatch(pattern, text + piece, partial=True) does"
            )
        elif got == _without_stop(text, texts, pattern, stop) != want:
            hint = "the stop tokens may come next exactly when the text so far is a whole match"
        elif got == _stop_always(text, texts, pattern, stop) != want:
            hint = "a stop token only after a whole match: regex.fullmatch(pattern, text)"
        elif got == _empty_allowed(text, texts, pattern, stop) != want:
            hint = "a token without text (None, or '': the special tokens) is never allowed"
        expect(case, want, got, hint)
    return len(cases)
