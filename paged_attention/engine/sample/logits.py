"""Logits processing: what a request's settings do to its next-token logits before the draw.

In vLLM v1's order, on float32 logits ``[rows, vocab]``, each row with its own settings
(:class:`~.params.SamplingParams`) and its own past tokens (a :class:`History`):

0. a structured output's grammar mask (:mod:`..structured_output`): every token the grammar does
   not allow next gets ``-inf`` (vLLM applies the grammar bitmask before its sampler); should steps
   1-4 then leave no token at all (``min_tokens`` banning the stop token that alone ends a complete
   match, say), the grammar wins and the row is the masked logits alone;
1. ``allowed_token_ids``: every other token gets ``-inf``;
2. ``bad_words``: a word's last token gets ``-inf`` where the output already ends with the word's
   other tokens (a one-token word is always banned);
3. the stop tokens get ``-inf`` before ``min_tokens`` outputs (the ``banned`` ids), and ``logit_bias``
   is added;
4. penalties: ``repetition_penalty`` ``r`` on every token of the prompt *or* the output (a logit
   ``x > 0`` becomes ``x / r``, else ``x * r``, as transformers' ``RepetitionPenaltyLogitsProcessor``),
   then ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` on the output's tokens only:
   ``x - f * count - p * (count > 0)`` (OpenAI's definition).

Then the sampler applies temperature and the filters (:mod:`.sampling`). Rows whose settings are
all neutral are not touched, so an ordinary request pays nothing for this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..params import SamplingParams


@dataclass(frozen=True)
class History:
    """A row's past tokens: what the penalties and bad words look at."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


def needs_history(params: SamplingParams) -> bool:
    return params.penalized or bool(params.bad_words_token_ids)


def changes(params: SamplingParams, banned: Sequence[int] = (), mask: torch.Tensor | None = None) -> bool:
    """Whether steps 0-4 can change a row with these settings (``banned``: its stop tokens before
    ``min_tokens``; ``mask``: its grammar's allowed tokens)."""
    return (
        mask is not None
        or params.allowed_token_ids is not None
        or bool(params.bad_words_token_ids)
        or bool(banned)
        or bool(params.logit_bias)
        or params.penalized
    )


def process(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    banned: Sequence[Sequence[int]] | None = None,
    histories: Sequence[History | None] | None = None,
    masks: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Apply steps 0-4 to ``logits`` in place (a float32 CPU tensor); returns it. ``masks[i]``: the
    tokens row ``i``'s grammar allows (bool ``[vocab]``), or ``None``."""
    vocab = logits.shape[1]
    for row, p in enumerate(params):
        mask = masks[row] if masks is not None else None
        masked = None
        if mask is not None:
            masked = logits[row].masked_fill_(~mask, float("-inf")).clone()
        if p.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[[t for t in p.allowed_token_ids if t < vocab]] = True
            logits[row].masked_fill_(~keep, float("-inf"))
        history = histories[row] if histories is not None else None
        if p.bad_words_token_ids and history is not None:
            ids = banned_by_words(p.bad_words_token_ids, history.output_token_ids)
            if ids:
                logits[row, ids] = float("-inf")
        if banned is not None and banned[row]:
            logits[row, list(banned[row])] = float("-inf")
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            logits[row, ids] += torch.tensor([p.logit_bias[t] for t in ids])
        if p.penalized and history is not None:
            apply_penalties(logits[row], p, history)
        if masked is not None and not torch.isfinite(logits[row]).any():
            logits[row] = masked  # nothing left but what the grammar allows: it wins (see step 0)
    return logits


def banned_by_words(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete a bad word after ``output`` (vLLM's ``apply_bad_words``)."""
    banned = []
    for word in bad_words:
        prefix = list(word[:-1])
        if not prefix or (len(output) >= len(prefix) and list(output[len(output) - len(prefix) :]) == prefix):
            banned.append(word[-1])
    return banned


def apply_penalties(row: torch.Tensor, params: SamplingParams, history: History) -> None:
    """Step 4 on one row ``[vocab]``, in place. Counts are over the output; the repetition penalty
    also looks at the prompt."""
    vocab = row.numel()
    output = torch.tensor(list(history.output_token_ids), dtype=torch.long)
    counts = torch.bincount(output[output < vocab], minlength=vocab).to(row.dtype)
    if params.repetition_penalty != 1.0:
        prompt = torch.tensor(list(history.prompt_token_ids), dtype=torch.long)
        seen = counts > 0
        seen[prompt[prompt < vocab]] = True
        r = params.repetition_penalty
        row[seen] = torch.where(row[seen] > 0, row[seen] / r, row[seen] * r)
    if params.frequency_penalty:
        row -= params.frequency_penalty * counts
    if params.presence_penalty:
        row -= params.presence_penalty * (counts > 0).to(row.dtype)


def bad_words_token_ids(words: Sequence[str], tokenizer: object) -> list[list[int]]:
    """Each bad word as token ids, alone and after a space (a word inside a sentence usually
    tokenizes with its leading space), as vLLM's ``SamplingParams.update_from_tokenizer``."""
    sequences: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))  # type: ignore[attr-defined]
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
