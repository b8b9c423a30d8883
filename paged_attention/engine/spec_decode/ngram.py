"""N-gram ("prompt lookup") drafting: guess a sequence's next tokens from its own earlier tokens.

When a model copies (edits code, quotes a passage, fills a template), the tokens that followed an
earlier occurrence of its last few tokens are a good guess for what comes next, and finding them
needs no model at all. :func:`propose` looks for the longest suffix of the sequence, between
``min_n`` and ``max_n`` tokens long, that occurred earlier, and proposes up to ``k`` tokens that
followed its *first* occurrence (vLLM's ``NgramProposer`` picks the same: the longest n-gram, the
earliest match). The target model then verifies the guesses (:mod:`.rejection`).
"""

from __future__ import annotations

from collections.abc import Sequence


def propose(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` drafted tokens for the sequence ``token_ids`` (prompt and output so far).

    For ``n`` from ``max_n`` down to ``min_n``: if the last ``n`` tokens also occur earlier (ending
    before the last token), return the up to ``k`` tokens that followed their first occurrence;
    ``[]`` if no such ``n`` exists, or ``k`` is 0. O(len(token_ids) * max_n) per call."""
    if k <= 0 or min_n < 1 or min_n > max_n:
        return []
    tokens = list(token_ids)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        first = suffix[0]
        for start in range(length - n):  # an occurrence that ends before the suffix's last token
            if tokens[start] == first and tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []
