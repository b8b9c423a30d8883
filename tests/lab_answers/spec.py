"""Speculative-decoding exercise answers written apart from the notebook (right and wrong ones)."""

from __future__ import annotations

import torch


def propose_drafts_right(token_ids, min_n, max_n, k):
    tokens = list(token_ids)
    for n in range(max_n, min_n - 1, -1):
        if k <= 0 or n >= len(tokens):
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def propose_drafts_last_occurrence(token_ids, min_n, max_n, k):
    tokens = list(token_ids)
    for n in range(max_n, min_n - 1, -1):
        if k <= 0 or n >= len(tokens):
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # the latest occurrence, not the first
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def propose_drafts_shortest_first(token_ids, min_n, max_n, k):
    tokens = list(token_ids)
    for n in range(min_n, max_n + 1):  # the shortest match first
        if k <= 0 or n >= len(tokens):
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def propose_drafts_without_overlap(token_ids, min_n, max_n, k):
    tokens = list(token_ids)
    for n in range(max_n, min_n - 1, -1):
        if k <= 0 or n >= len(tokens):
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - 2 * n + 1):  # an occurrence that ends before the tail starts
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def accept_drafts_right(drafts, probs, generator, greedy):
    out = []
    for i, draft in enumerate(drafts):
        if greedy:
            best = int(probs[i].argmax())
            if best != draft:
                return [*out, best]
            out.append(draft)
            continue
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(probs[i][draft]):
            out.append(draft)
            continue
        rest = probs[i].clone()
        rest[draft] = 0
        return [*out, int(torch.multinomial(rest / rest.sum(), 1, generator=generator))]
    last = probs[len(drafts)]
    return [*out, int(last.argmax()) if greedy else int(torch.multinomial(last, 1, generator=generator))]


def accept_drafts_resample_full(drafts, probs, generator, greedy):
    if greedy:
        return accept_drafts_right(drafts, probs, generator, greedy)
    out = []
    for i, draft in enumerate(drafts):
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(probs[i][draft]):
            out.append(draft)
            continue
        return [*out, int(torch.multinomial(probs[i], 1, generator=generator))]  # the draft can come back
    return [*out, int(torch.multinomial(probs[len(drafts)], 1, generator=generator))]


def accept_drafts_no_bonus(drafts, probs, generator, greedy):
    out = []
    for i, draft in enumerate(drafts):
        best = int(probs[i].argmax())
        if best != draft:
            return [*out, best]
        out.append(draft)
    return out or [int(probs[0].argmax())]  # forgets the target's token after the last draft


def _sampled_slip(drafts, probs, generator, greedy, chance, after):
    """The right rule, greedy as it is; sampled with one part swapped: ``chance(p)`` of keeping a
    draft of probability ``p``, ``after(last_row, generator)`` for the token after the drafts."""
    if greedy:
        return accept_drafts_right(drafts, probs, generator, greedy)
    out = []
    for i, draft in enumerate(drafts):
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < chance(float(probs[i][draft])):
            out.append(draft)
            continue
        rest = probs[i].clone()
        rest[draft] = 0
        return [*out, int(torch.multinomial(rest / rest.sum(), 1, generator=generator))]
    return [*out, after(probs[len(drafts)], generator)]


def accept_drafts_bonus_argmax(drafts, probs, generator, greedy):
    # sampled, yet the token after the drafts is the argmax
    return _sampled_slip(drafts, probs, generator, greedy, lambda p: p, lambda last, g: int(last.argmax()))


def accept_drafts_too_often(drafts, probs, generator, greedy):
    # p(x) ** 0.8: 0.05-0.08 too often at the checks' probabilities, the subtlest slip caught
    def draw(last, g):
        return int(torch.multinomial(last, 1, generator=g))

    return _sampled_slip(drafts, probs, generator, greedy, lambda p: p**0.8, draw)
