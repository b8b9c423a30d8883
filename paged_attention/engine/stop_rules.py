"""When a sampled sequence ends: the rules vLLM applies after every token. They only decide.

In order, after a token is appended (nothing can end a sequence before ``min_tokens`` outputs,
and before then the stop tokens may not even be sampled, :meth:`StopRules.banned`):

1. a token of ``stop_token_ids`` ends it with reason ``"stop"`` (``stop_reason`` = the token);
2. EOS ends it with reason ``"stop"``, unless ``ignore_eos``;
3. a ``stop`` string in the new text ends it, the text cut where the string starts;
4. ``max_tokens`` outputs, or ``max_model_len`` tokens in all, end it with reason ``"length"``.

:meth:`StopRules.check` changes nothing: it returns a :class:`Stop` (or ``None``), and the one
owner of the end of a step (:meth:`Scheduler.update_from_output
<.scheduler.Scheduler.update_from_output>`) finishes the sequence. Rule 3 reads the text, which the
scheduler brings up to date first (:mod:`.detokenizer`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from .sequence import FinishReason, Sequence


@dataclass(frozen=True)
class Stop:
    """A decision to end a sequence: why, what ended it (a stop token or string), and where a stop
    string cuts the text (``None``: the text stays whole)."""

    reason: FinishReason
    stop_reason: int | str | None = None
    cut: int | None = None


class StopRules:
    """The rules above, for one engine's EOS tokens and ``max_model_len`` (``None``: no limit but
    ``max_tokens``, as in a trace replay)."""

    def __init__(self, eos_token_ids: Collection[int] = (), max_model_len: int | None = None) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def banned(self, seq: Sequence) -> list[int]:
        """Before ``min_tokens`` outputs, the stop tokens may not be sampled (vLLM's rule)."""
        params = seq.params
        if len(seq.output_token_ids) >= params.min_tokens:
            return []
        ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)

    def check(self, seq: Sequence, text_from: int = 0) -> Stop | None:
        """Does ``seq`` end with the token just appended? ``text_from``: where the text that token
        added starts in ``seq.output_text`` (only read if the sequence has stop strings)."""
        params, token = seq.params, seq.output_token_ids[-1]
        n_out = len(seq.output_token_ids)
        if n_out >= params.min_tokens:
            if token in (params.stop_token_ids or ()):
                return Stop(FinishReason.STOP, token)
            if not params.ignore_eos and token in self.eos_token_ids:
                return Stop(FinishReason.STOP)
            # A stop string can newly end only in the new text, or in the few characters before it
            # that it could start in (as vLLM looks for it).
            text = seq.output_text
            for stop in params.stop_strings:
                at = text.find(stop, max(0, text_from - len(stop) + 1))
                if at >= 0:
                    return Stop(FinishReason.STOP, stop, cut=at)
        if (params.max_tokens is not None and n_out >= params.max_tokens) or (
            self.max_model_len is not None and seq.num_tokens >= self.max_model_len
        ):
            return Stop(FinishReason.LENGTH)
        return None
