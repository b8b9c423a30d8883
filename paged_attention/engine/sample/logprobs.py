"""Log-probabilities as vLLM reports them: a :class:`Logprob` per token at each position.

For each output position of a request with ``logprobs=k`` the output holds a dict
``{token_id: Logprob(logprob, rank, decoded_token)}``: the sampled token first (always, whatever
its rank), then the ``k`` most likely tokens (ranks 1..k; ``k=-1``: the whole vocabulary). ``rank``
is 1 + the number of tokens with a strictly larger log-probability. ``prompt_logprobs=k`` gives the
same for each prompt token after the first (the first has no context: its entry is ``None``).

The values come from the *raw* logits (the model's own distribution, before penalties,
temperature or filters: vLLM v1's default ``logprobs_mode="raw_logprobs"``), or from the
processed distribution that the token was drawn from (``"processed_logprobs"``). vLLM v0 used the
processed ones. ``cumulative_logprob`` sums the sampled tokens' values; as in vLLM v1 it is
``None`` unless ``logprobs`` is set (v0 always kept it), and the sampler computes no
log-probability for a request that reports none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")

#: ``CompletionOutput.logprobs`` and ``RequestOutput.prompt_logprobs`` (vLLM's type names).
SampleLogprobs = list[dict[int, "Logprob"]]
PromptLogprobs = list[dict[int, "Logprob"] | None]


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def ranks(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's rank of its token: 1 + how many tokens are strictly more likely."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    return (logprobs > chosen).sum(dim=1) + 1


def entries(
    logprobs: torch.Tensor,
    tokens: torch.Tensor,
    k: int,
    decode: Callable[[int], str] | None,
) -> list[dict[int, Logprob]]:
    """For each row of ``logprobs`` ``[rows, vocab]``: its ``tokens[row]`` and its ``k`` most likely
    tokens (``-1``: all), as vLLM's dicts; ``decode`` gives each token's text (``None``: no text)."""
    vocab = logprobs.shape[1]
    k = vocab if k < 0 else min(k, vocab)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    rank = ranks(logprobs, tokens)
    top_values, top_ids = logprobs.topk(k, dim=1)
    result = []
    for row in range(logprobs.shape[0]):
        token = int(tokens[row])
        entry = {token: Logprob(float(chosen[row]), int(rank[row]), decode(token) if decode else None)}
        for position, (value, token_id) in enumerate(
            zip(top_values[row].tolist(), top_ids[row].tolist(), strict=True)
        ):
            if token_id not in entry:
                entry[token_id] = Logprob(value, position + 1, decode(token_id) if decode else None)
        result.append(entry)
    return result


def prompt_entries(
    logits: torch.Tensor, seq: Any, positions: range, decode: Callable[[int], str]
) -> list[dict[int, Logprob]]:
    """The entries of the prompt tokens that the rows of ``logits`` (prompt positions
    ``positions`` of ``seq``) predict, from the raw logits: position ``p`` predicts prompt token
    ``p + 1``; ``seq.params`` says how many top tokens, and whether to ``decode`` their text."""
    params, prompt = seq.params, seq.prompt_token_ids
    targets = torch.tensor([prompt[p + 1] for p in positions])
    text = decode if params.detokenize else None
    return entries(logits.float().log_softmax(-1), targets, params.prompt_logprobs or 0, text)
