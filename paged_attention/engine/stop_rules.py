"""When a sampled sequence ends: the rules vLLM applies after every token. They only decide.

In order, after a token is appended (nothing can end a sequence before ``min_tokens`` outputs,
and before then the stop tokens may not even be sampled, :meth:`StopRules.banned`; the one
exception is a structured output whose grammar allows nothing but a stop token: it ends):

1. a token of ``stop_token_ids`` ends it with reason ``"stop"`` (``stop_reason`` = the token);
2. EOS ends it with reason ``"stop"``, unless ``ignore_eos``;
3. a ``stop`` string in the new text ends it, the text cut where the string starts (or, with
   ``include_stop_str_in_output``, where it ends);
4. ``max_tokens`` outputs, or ``max_model_len`` tokens in all, end it with reason ``"length"``.

Rules 1-2 look at token ids only, before the new token is decoded, so that a stop token's text is
left out of the output (``Stop.hide_token``) unless ``include_stop_str_in_output`` (vLLM v1's rule;
with ``skip_special_tokens`` an EOS shows nothing either way). Rule 3 reads the text, which
:meth:`StopRules.check` brings up to date (:mod:`.detokenizer`) only for sequences that have stop
strings. The check returns a :class:`Stop` (or ``None``) and finishes nothing: the one owner of
the end of a step (:meth:`Scheduler.update_from_output <.scheduler.Scheduler.update_from_output>`)
does.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from .detokenizer import Detokenizer


@dataclass(frozen=True)
class Stop:
    """A decision to end a sequence: why, what ended it (a stop token or string), where a stop
    string cuts the text (``None``: the text stays whole), and whether the last token's text is
    left out (a stop token's, unless ``include_stop_str_in_output``)."""

    reason: FinishReason
    stop_reason: int | str | None = None
    cut: int | None = None
    hide_token: bool = False


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

    def check(self, seq: Sequence, detokenizer: Detokenizer | None = None) -> Stop | None:
        """Does ``seq`` end with the token just appended? ``detokenizer`` brings its text up to
        date for rule 3 (only read if the sequence has stop strings)."""
        params, token = seq.params, seq.output_token_ids[-1]
        n_out = len(seq.output_token_ids)
        hide = not params.include_stop_str_in_output
        # With a grammar, a stop token sampled before min_tokens is one the grammar alone allowed
        # (a complete match: the ban gave way, :mod:`.sample.logits` step 0): it ends the sequence.
        if n_out >= params.min_tokens or seq.grammar is not None:
            if token in (params.stop_token_ids or ()):
                return Stop(FinishReason.STOP, token, hide_token=hide)
            if not params.ignore_eos and token in self.eos_token_ids:
                return Stop(FinishReason.STOP, hide_token=hide)
        if params.stop_strings and detokenizer is not None:
            # Read every token (before min_tokens too, so that a string made then is old news), and
            # look only in the new text or the few characters before it that a stop string could
            # start in (as vLLM looks for it).
            text_from = detokenizer.update(seq)
            text = seq.output_text
            for stop in params.stop_strings if n_out >= params.min_tokens else ():
                at = text.find(stop, max(0, text_from - len(stop) + 1))
                if at >= 0:
                    return Stop(FinishReason.STOP, stop, cut=at + (0 if hide else len(stop)))
        if (params.max_tokens is not None and n_out >= params.max_tokens) or (
            self.max_model_len is not None and seq.num_tokens >= self.max_model_len
        ):
            return Stop(FinishReason.LENGTH)
        return None
