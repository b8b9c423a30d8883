"""The token mask by brute force: every token of the vocabulary tried against the text so far.

This is what a grammar engine computes, written the slow and obvious way, as the oracle that
xgrammar's mask is checked against (notebook 12, and its exercise ``12.token_mask``): a token may
come next exactly when the text so far followed by the token's text can still become a match, and
a stop token exactly when the text so far is a whole match. For a regular expression the first
question is a *partial* match, which the ``regex`` package answers (``fullmatch(..., partial=True)``:
the string matches, or could if more characters followed; Python's ``re`` cannot say).

It costs one regex run per token per step: some 35-100 ms over SmolLM2's 49,152 tokens on this
CPU, where xgrammar takes a fraction of a millisecond, because it sorts the vocabulary once per
state of its automaton, at compile time, into tokens always allowed, never allowed, and the few
that depend on the stack (its adaptive token-mask cache), and walks bytes, not characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import regex


def token_texts(tokenizer: Any, vocab_size: int | None = None) -> list[str | None]:
    """Each token's text, as the grammar sees it (its bytes, decoded); ``None`` for the tokens that
    are never text: the special ones (``<|endoftext|>``, ...) and the pieces of a character that
    a token alone does not complete (byte-level vocabularies split some characters over tokens)."""
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    special = set(tokenizer.all_special_ids)
    texts: list[str | None] = []
    for token_id, raw in enumerate(info.decoded_vocab):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = ""
        texts.append(text if text and token_id not in special else None)
    return texts


def allowed_tokens(
    text: str, texts: Sequence[str | None], pattern: str, stop_ids: Sequence[int]
) -> list[int]:
    """The ids that may follow ``text`` under the regular expression ``pattern``, sorted: every
    token whose text keeps a match possible, and ``stop_ids`` when ``text`` is a whole match."""
    compiled = regex.compile(pattern)
    ids = [i for i, piece in enumerate(texts) if piece and compiled.fullmatch(text + piece, partial=True)]
    if compiled.fullmatch(text):
        ids += [i for i in stop_ids if i not in ids]
    return sorted(ids)
