"""Incremental detokenization: a sequence's text grows by decoding only its newest tokens.

Decoding a sequence's whole output at every step costs O(n) per step, O(n^2) over a stream. vLLM's
detokenizer (v0's ``detokenize_incrementally``, v1's ``SlowIncrementalDetokenizer``) keeps two
offsets into the output tokens instead:

* ``read_offset``: the tokens before it are already in ``output_text``;
* ``prefix_offset``: where a short window starts, a few tokens before ``read_offset``, so that a
  token is decoded with its left neighbours (a byte-level BPE token may be half of a character).

Each update decodes ``tokens[prefix_offset:read_offset]`` (text already emitted) and
``tokens[prefix_offset:]``; what the second adds is new text. If it ends in ``"\\ufffd"`` (a
character whose last bytes have not arrived) nothing is emitted and the offsets stay, so the next
token completes it. Tokens that decode to nothing (skipped special tokens) are read at once, the
window keeping a few tokens of left context. The window is the last token or two plus any
still-undecodable ones: the cost of a step does not grow with the output (``tests/test_streaming.py``
counts the decoded tokens, a run of EOS included).

A request with ``detokenize=False`` gets no text at all.
The text is brought up to date only when someone reads it: the stop strings at every step, a
streamed output, and :meth:`Detokenizer.flush` when a sequence finishes. A ``FINAL_ONLY`` request
without stop strings (what ``LLM.generate`` asks for) decodes its output once, at the end.
The state lives on the :class:`~.sequence.Sequence` (``output_text``, ``prefix_offset``,
``read_offset``), so a step's rollback restores it with the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .sequence import Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


#: Tokens of left context a window keeps when tokens that decode to nothing move it on.
CONTEXT = 4


class Detokenizer:
    """Turns sequences' tokens into text, a few tokens at a time (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """A whole decode (for a beam's finished tokens, or anyone who wants the plain answer)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text, out of context (a log-probability entry's ``decoded_token``, as
        vLLM makes it: the token's string form, converted to text)."""
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        return self.tokenizer.convert_tokens_to_string([token]) if token is not None else ""

    def update(self, seq: Sequence) -> int:
        """Bring ``seq.output_text`` up to its tokens, holding back a trailing half character;
        returns the text's length before (where the new text starts)."""
        before = len(seq.output_text)
        if seq.read_offset < len(seq.output_token_ids) and seq.params.detokenize:
            self._advance(seq, seq.output_token_ids, final=False)
        return before

    def flush(self, seq: Sequence, hide_last: bool = False) -> None:
        """The sequence ended: decode what is left, a trailing half character included (as a whole
        decode shows it), but for the last token if ``hide_last`` (a stop token's text)."""
        ids = seq.output_token_ids[:-1] if hide_last else seq.output_token_ids
        if seq.read_offset < len(ids) and seq.params.detokenize:
            self._advance(seq, ids, final=True)

    def _advance(self, seq: Sequence, ids: list[int], final: bool) -> None:
        skip = seq.params.skip_special_tokens
        prefix = self.decode(ids[seq.prefix_offset : seq.read_offset], skip)
        text = self.decode(ids[seq.prefix_offset :], skip)
        if final or (len(text) > len(prefix) and not text.endswith("\ufffd")):
            seq.output_text += text[len(prefix) :]
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        elif text == prefix:  # the new tokens decode to nothing (skipped special tokens, a run of EOS
            # with ignore_eos): nothing is pending, so they are read; the window keeps at most
            # CONTEXT tokens before the next one, or it would grow with every such token.
            seq.read_offset = len(ids)
            seq.prefix_offset = max(seq.prefix_offset, seq.read_offset - CONTEXT)

    @staticmethod
    def stable_text(seq: Sequence) -> str:
        """What of an unfinished sequence's text may be streamed: all of it but the last
        ``len(stop) - 1`` characters, which a stop string still to be completed by the next tokens
        could cut (vLLM's stop buffer; none if the stop string stays in the output)."""
        text, params = seq.output_text, seq.params
        longest = 0 if params.include_stop_str_in_output else max(map(len, params.stop_strings), default=0)
        hold = max(0, longest - 1)
        return text[: max(0, len(text) - hold)]  # (not a negative index: shorter text shows nothing)
