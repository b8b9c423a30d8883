"""Verifying drafted tokens: which to keep, so that the output is exactly the target model's.

The target model runs once over a sequence's last token and its ``k`` drafts, and gives ``k + 1``
next-token distributions: position ``i`` is what should follow the sequence plus drafts ``0..i-1``.

* **Greedy** (:func:`verify_greedy`): keep drafts while each equals the target's argmax at its
  position; then append the target's own argmax at the first mismatch (or after the last draft).
  The output is token for token what greedy decoding without drafts gives, in 1 to ``k + 1``
  tokens per forward.
* **Sampling** (:func:`verify_sampled`), Leviathan et al. (2023) for a draft that is a single
  token (an n-gram draft is a point mass, q = 1 on draft x): accept ``x`` with probability
  ``min(1, p(x) / q(x)) = p(x)``; on a rejection draw from ``max(0, p - q)`` renormalised, which is
  ``p`` with ``x`` removed; if every draft is accepted, draw one more token from the last
  distribution. Each emitted token is then distributed exactly as ``p`` at its position, with
  every sampling parameter already applied to ``p`` (temperature, top-k, top-p, min-p, penalties).

Both return the tokens to append and how many drafts were accepted; the caller appends them one by
one, stopping at a stop token or string, so nothing after a stop is kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def verify_greedy(drafts: Sequence[int], target: Sequence[int]) -> tuple[list[int], int]:
    """``target[i]``: the target's argmax at position ``i`` (``len(drafts) + 1`` of them)."""
    if len(target) != len(drafts) + 1:
        raise ValueError(f"target must hold len(drafts) + 1 = {len(drafts) + 1} tokens, got {len(target)}")
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return [*drafts[:accepted], int(target[accepted])], accepted


def verify_sampled(
    drafts: Sequence[int], probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """``probs``: ``[len(drafts) + 1, vocab]``, the target's distribution at each position (rows sum
    to 1, every sampling parameter applied). Draws with ``generator`` (a request's seed)."""
    if probs.dim() != 2 or probs.shape[0] != len(drafts) + 1:
        raise ValueError(
            f"probs must be [len(drafts) + 1, vocab] = [{len(drafts) + 1}, V], got {list(probs.shape)}"
        )
    probs = probs.double()
    tokens: list[int] = []
    for i, draft in enumerate(drafts):
        keep = probs[i, draft]
        if torch.rand((), generator=generator, dtype=torch.float64) < keep:
            tokens.append(int(draft))
            continue
        rest = probs[i].clone()
        rest[draft] = 0.0  # max(0, p - q) for a point mass q on the draft
        tokens.append(int(torch.multinomial(rest / rest.sum(), 1, generator=generator)))
        return tokens, i
    tokens.append(int(torch.multinomial(probs[-1], 1, generator=generator)))
    return tokens, len(drafts)
