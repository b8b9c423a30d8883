"""A grammar as a mask over the vocabulary, one token at a time (vLLM's xgrammar backend).

**Compile once per request.** :class:`GrammarCompiler` (one per engine, built when the first
structured request arrives) turns a :class:`~.params.StructuredOutputsParams` into xgrammar's
compiled grammar: a pushdown automaton over *bytes*, with, for every state, the tokens of the
vocabulary precomputed as always allowed, always refused, or to be checked (xgrammar's adaptive
token-mask cache). A JSON schema becomes a grammar first, a ``choice`` becomes the grammar
``root ::= "a" | "b"``; compiled grammars are cached by their text.

**A matcher per sequence.** :class:`Grammar` holds one ``GrammarMatcher``: the automaton's state
after the sequence's output so far. Before each draw it fills a bitmask of the tokens allowed next
(one bit per token, 32 to an ``int32``), which :meth:`Grammar.mask` unpacks to a boolean row; the
sampler sets every other logit to ``-inf`` before anything else touches the row (vLLM applies the
grammar bitmask to the logits before its sampler). So a greedy request takes the likeliest *allowed*
token, and a sampled one draws among the allowed tokens in proportion to the model's probabilities.

**In step with the output, whatever happens to it.** The matcher is advanced lazily, to the
sequence's ``output_token_ids``, when the next step asks for a mask: it only ever sees the tokens of
steps that committed, and a step that is rolled back (a step is a transaction) cuts only the tokens
it appended itself. The matcher may have caught up with the step before in the meantime: its
sequence begins, commits and rolls back its grammar with itself, and a rollback takes the matcher
back to the tokens it had seen when the step began (:meth:`Grammar.rollback_to`); a preempted
sequence keeps its output and so its state; a forked sample gets a fresh matcher on the same
compiled grammar (:meth:`Grammar.fork`) that catches up with its own tokens; and output that is not
a continuation of what the matcher saw (never the case in the engine) sends it back to the start.
Speculative drafts are checked by advancing through them, filling a mask at each position, and
rolling back (:meth:`Grammar.masks_ahead`): the target's verification then sees at every position
the mask it would see had the drafts before it been generated, so a draft the grammar refuses is
never accepted.

**The end.** The grammar allows the stop tokens (the tokenizer's end of sequence) exactly when
the text so far is complete; drawing one ends the request as usual. Once the matcher has accepted a
stop token it is *terminated* and masks nothing (``ignore_eos`` requests go on unconstrained, as in
vLLM). A state that allows no token at all cannot happen with a grammar that compiled, but should
one appear the stop tokens are allowed there, so the request ends instead of drawing from nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import torch

from .params import StructuredOutputsParams

_SHIFTS = torch.arange(32, dtype=torch.int32)


def choice_grammar(choice: Sequence[str]) -> str:
    """The EBNF grammar whose texts are exactly the choices: ``root ::= "a" | "b"`` (each choice a
    JSON-escaped string literal, which xgrammar's EBNF reads)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def is_lark(grammar: str) -> bool:
    """Whether a grammar is Lark rather than EBNF: no line defines a rule with ``::=`` (vLLM's
    ``grammar_is_likely_lark``; comments, ``#`` or ``//``, left out)."""
    lines = (re.sub(r"(#|//).*$", "", line).strip() for line in grammar.splitlines())
    return bool(grammar.strip()) and not any("::=" in line for line in lines)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's token bitmask (``int32 [ceil(vocab / 32)]``, bit ``i % 32`` of word ``i // 32``
    set when token ``i`` is allowed) as a boolean row ``[vocab_size]``."""
    return ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(-1)[:vocab_size].bool()


class GrammarCompiler:
    """xgrammar's compiler over one tokenizer; :meth:`compile` gives what a :class:`Grammar` runs."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        """``vocab_size``: the model's logits row (it may exceed the tokenizer's vocabulary: the
        extra ids are never allowed); ``stop_token_ids``: the tokens that end a complete text."""
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params``; ``ValueError`` naming the field if it does not
        compile (a schema xgrammar refuses, a malformed regex or grammar) or if no text matches it."""
        kind, compiler = params.kind, self._compiler
        try:
            if kind in ("json", "json_object"):
                compact = params.disable_any_whitespace
                compiled = compiler.compile_json_schema(
                    json.dumps(params.schema()),
                    any_whitespace=not compact,
                    separators=(",", ":") if compact else None,
                )
            elif kind == "regex":
                compiled = compiler.compile_regex(params.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(params.choice or []))
            elif is_lark(params.grammar or ""):  # vLLM takes Lark too (xgrammar converts it)
                compiled = compiler.compile_grammar(self._xgr.Grammar.from_lark(params.grammar))
            else:
                compiled = compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as err:
            lines = str(err).strip().splitlines() or [type(err).__name__]
            message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0])  # xgrammar's time and source line
            raise ValueError(f"structured_outputs.{kind} could not be compiled: {message}") from None
        if Grammar(compiled, self).starts_dead():
            raise ValueError(f"structured_outputs.{kind} matches no text: nothing can be generated")
        return compiled

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids or None)

    def bitmask(self) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(1, self.vocab_size)


class Grammar:
    """One sequence's matcher, kept in step with its output tokens (see the module docstring)."""

    def __init__(self, compiled: Any, compiler: GrammarCompiler) -> None:
        self.compiled = compiled
        self.compiler = compiler
        self._matcher = compiler.matcher(compiled)
        self._consumed: list[int] = []  # the output tokens the matcher has seen, in order
        self._pushed: list[bool] = []  # whether each was fed to it (not after it terminated)
        self._refused: list[int] = []  # positions of tokens it refused (none, unless the mask was bypassed)
        self._saved: int | None = None  # tokens seen when the open step began

    def fork(self) -> Grammar:
        """A fresh matcher on the same compiled grammar (a forked sample's: it catches up with its
        own output when its first mask is asked for)."""
        return Grammar(self.compiled, self.compiler)

    @property
    def num_consumed(self) -> int:
        return len(self._consumed)

    @property
    def is_valid(self) -> bool:
        """Whether every token it has seen was allowed where it came: the text is a match, or the
        beginning of one (tokens after a stop token are not asked)."""
        return not self._refused

    def mask(self, output_token_ids: Sequence[int]) -> torch.Tensor | None:
        """The tokens allowed after ``output_token_ids`` (bool ``[vocab_size]``); ``None`` once a
        stop token completed the text (nothing is masked then)."""
        self._advance(output_token_ids)
        return self._fill()

    def masks_ahead(
        self, output_token_ids: Sequence[int], drafts: Sequence[int]
    ) -> list[torch.Tensor | None]:
        """The mask at each of ``len(drafts) + 1`` positions, as if the drafts before it had been
        output; the matcher ends where it began. Past the first draft the grammar refuses, the
        masks repeat that position's (the draft there is rejected, so the rest are never used)."""
        self._advance(output_token_ids)
        masks = [self._fill()]
        taken = 0
        for token in drafts:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                break
            taken += 1
            masks.append(self._fill())
        if taken:
            self._matcher.rollback(taken)
        masks += [masks[-1]] * (len(drafts) + 1 - len(masks))
        return masks

    def rollback_to(self, num_tokens: int) -> None:
        """Forget every output token from ``num_tokens`` on (a rolled-back step cut them)."""
        if num_tokens >= len(self._consumed):
            return
        pushed = sum(self._pushed[num_tokens:])
        if pushed:
            self._matcher.rollback(pushed)
        del self._consumed[num_tokens:], self._pushed[num_tokens:]
        self._refused = [i for i in self._refused if i < num_tokens]

    # -- a step is a transaction (begun, committed, rolled back by its sequence) ----------------------
    def begin(self) -> None:
        self._saved = len(self._consumed)

    def commit(self) -> None:
        self._saved = None

    def rollback(self) -> None:
        if self._saved is not None:
            self.rollback_to(self._saved)
        self._saved = None

    def _advance(self, output_token_ids: Sequence[int]) -> None:
        consumed = self._consumed
        n = len(consumed)
        if n > len(output_token_ids) or (n and consumed[-1] != output_token_ids[n - 1]):
            self.rollback_to(0)  # not a continuation of what it saw (never the case in the engine)
        for token in output_token_ids[len(consumed) :]:
            asked = not self._matcher.is_terminated()
            pushed = asked and bool(self._matcher.accept_token(token))
            if asked and not pushed:
                self._refused.append(len(consumed))
            consumed.append(token)
            self._pushed.append(pushed)

    def starts_dead(self) -> bool:
        """Whether a fresh matcher allows no token at all (a grammar no text matches)."""
        return not self._matcher.is_terminated() and not self._fill(fallback=False).any()  # type: ignore[union-attr]

    def bitmask(self, output_token_ids: Sequence[int]) -> torch.Tensor | None:
        """xgrammar's packed form of :meth:`mask` (``int32 [ceil(vocab / 32)]``, see
        :func:`unpack_bitmask`), as vLLM sends it to its model runner; ``None`` once terminated."""
        self._advance(output_token_ids)
        return self._words()

    def _words(self) -> torch.Tensor | None:
        if self._matcher.is_terminated():
            return None
        bitmask = self.compiler.bitmask()  # a fresh one (a few kB): no state kept between steps
        self._matcher.fill_next_token_bitmask(bitmask)
        return bitmask[0]

    def _fill(self, fallback: bool = True) -> torch.Tensor | None:
        words = self._words()
        if words is None:
            return None
        allowed = unpack_bitmask(words, self.compiler.vocab_size)
        if fallback and not allowed.any():  # a dead end (see the module docstring): let the request stop
            allowed[self.compiler.stop_token_ids] = True
        return allowed


class StructuredOutputManager:
    """The engine's structured outputs (vLLM's name): the compiler, built on the first request that
    asks (reading a 49,152-token vocabulary takes ~0.4 s), and a matcher for each sequence."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._args = (tokenizer, vocab_size, list(stop_token_ids))
        self._compiler: GrammarCompiler | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(*self._args)
        return self._compiler

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for ``params`` (compiled once per text: the compiler caches); ``ValueError``
        if it does not compile."""
        compiler = self.compiler
        return Grammar(compiler.compile(params), compiler)
