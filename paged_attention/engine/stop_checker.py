"""When a sampled sequence ends, and its text: the rules vLLM applies after every token.

In order, after a token is appended (nothing can end a sequence before ``min_tokens`` outputs,
and before then the stop tokens may not even be sampled, :meth:`StopChecker.banned`):

1. a token of ``stop_token_ids`` ends it with reason ``"stop"`` (``stop_reason`` = the token);
2. EOS ends it with reason ``"stop"``, unless ``ignore_eos``;
3. a ``stop`` string in the new text ends it, the text cut where the string starts;
4. ``max_tokens`` outputs, or ``max_model_len`` tokens in all, end it with reason ``"length"``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from .sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class StopChecker:
    """Applies the stop rules above; also turns a sequence's tokens into text (vLLM keeps that in a
    detokenizer of its own; here the stop strings need the text, so both live together)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Collection[int], max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
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

    def text(self, seq: Sequence) -> str:
        """The output text: cut at the stop string that ended it, if one did."""
        if seq.stop_reason in seq.params.stop_strings:
            return seq.output_text
        return self.decode(seq.output_token_ids, seq.params.skip_special_tokens)

    def stable_text(self, seq: Sequence, text: str) -> str:
        """What of an unfinished sequence's ``text`` may be streamed: without a trailing half UTF-8
        character, and without the last ``len(stop) - 1`` characters, which a stop string still to
        be completed by the next tokens could cut (vLLM's stop buffer)."""
        hold = max((len(s) for s in seq.params.stop_strings), default=1) - 1
        text = text[: len(text) - hold] if hold else text
        return text.rstrip("\ufffd")

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def append(self, seq: Sequence, token: int, now: float) -> None:
        """Append ``token`` to ``seq``, and finish ``seq`` if a rule above says so."""
        seq.output_token_ids.append(token)
        params = seq.params
        n_out = len(seq.output_token_ids)
        if n_out >= params.min_tokens:
            if token in (params.stop_token_ids or ()):
                seq.finish(FinishReason.STOP, now, stop_reason=token)
                return
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish(FinishReason.STOP, now)
                return
        if params.stop_strings:
            # Look for a stop string only where it could newly end: in the text this token added,
            # plus the few characters before it that a stop string could start in (as vLLM does).
            previous = seq.output_text
            text = seq.output_text = self.decode(seq.output_token_ids, params.skip_special_tokens)
            if n_out >= params.min_tokens:
                for stop in params.stop_strings:
                    at = text.find(stop, max(0, len(previous) - len(stop) + 1))
                    if at >= 0:
                        seq.output_text = text[:at]
                        seq.finish(FinishReason.STOP, now, stop_reason=stop)
                        return
        if n_out >= (params.max_tokens or 0) or seq.num_tokens >= self.max_model_len:
            seq.finish(FinishReason.LENGTH, now)
