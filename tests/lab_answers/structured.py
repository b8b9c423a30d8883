"""Answers to exercise 12.token_mask: one right (written apart from the notebook's), and wrong ones."""

from __future__ import annotations

import re

import regex


def token_mask_right(text, texts, pattern, stop_ids):
    viable = regex.compile(pattern)
    out = set()
    for token_id, piece in enumerate(texts):
        if piece and viable.fullmatch(text + piece, partial=True) is not None:
            out.add(token_id)
    if viable.fullmatch(text) is not None:
        out.update(stop_ids)
    return sorted(out)


def token_mask_prefix_match(text, texts, pattern, stop_ids):
    ids = [i for i, piece in enumerate(texts) if piece and re.match(pattern, text + piece)]
    return ids + (list(stop_ids) if re.fullmatch(pattern, text) else [])


def token_mask_no_stop(text, texts, pattern, stop_ids):
    viable = regex.compile(pattern)
    return [i for i, piece in enumerate(texts) if piece and viable.fullmatch(text + piece, partial=True)]


def token_mask_stop_always(text, texts, pattern, stop_ids):
    return sorted(set(token_mask_no_stop(text, texts, pattern, stop_ids)) | set(stop_ids))


def token_mask_empty_allowed(text, texts, pattern, stop_ids):
    viable = regex.compile(pattern)
    ids = [
        i
        for i, piece in enumerate(texts)
        if piece is not None and viable.fullmatch(text + piece, partial=True)
    ]
    return sorted(set(ids) | (set(stop_ids) if viable.fullmatch(text) else set()))
