"""What ``LLMEngine.add_request`` does before it queues anything: every check a request must
pass, then the request and its sequences.

In order: the parameters are checked again and copied (they may have been changed since they were
built); the prompt is tokenized and checked against the vocabulary and ``max_model_len``
(``max_tokens=None`` becomes the room left); ``logprobs`` against ``max_logprobs``; bad words are
tokenized; a ``structured_outputs`` constraint is compiled (each sequence gets its own matcher);
the samples (``n``, or ``best_of``) or beams are made, as one sequence that will fork
when the cache manager can fork, else as independent sequences; and each must be able to fit the
cache at all. Nothing is changed in the engine until all of this passed (the ids the sequence pool
gave out aside), so a bad request is rejected alone.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .beam_search import BeamSearchRequest, check_beams_fit
from .inputs import Prompt, check_arrival_time, check_logprobs, check_prompt, tokenize
from .parallel_sampling import SamplingRequest
from .params import BeamSearchParams, SamplingParams
from .request import Request
from .sample.logits import bad_words_token_ids
from .sequence import Sequence

if TYPE_CHECKING:
    from .llm_engine import LLMEngine


def build_request(
    engine: LLMEngine,
    request_id: str,
    prompt: Prompt,
    params: SamplingParams | BeamSearchParams | None,
    arrival_time: float | None,
) -> tuple[Request, list[Sequence]]:
    """The request ``add_request`` will queue, and its sequences (see the module docstring);
    raises ``TypeError``/``ValueError`` naming what is wrong."""
    params = params or SamplingParams()
    if not isinstance(params, (SamplingParams, BeamSearchParams)):
        raise TypeError(f"params must be a SamplingParams or BeamSearchParams, got {type(params).__name__}")
    beam = params if isinstance(params, BeamSearchParams) else None
    if beam is not None:
        params = SamplingParams(temperature=0.0, max_tokens=beam.max_tokens, ignore_eos=beam.ignore_eos)
    assert isinstance(params, SamplingParams)
    params = params.clone()  # checked again (it may have been changed since it was built), and ours
    check_arrival_time(arrival_time)
    text, token_ids, cache_salt = tokenize(prompt, engine.tokenizer)
    params = check_prompt(token_ids, params, engine.model.config.vocab_size, engine.max_model_len)
    check_logprobs(params, engine.max_logprobs)
    if params.bad_words:
        params.bad_words_token_ids = bad_words_token_ids(params.bad_words, engine.tokenizer)
    constraint = params.structured_outputs
    grammar = engine.structured_output.grammar(constraint) if constraint is not None else None
    width = beam.beam_width if beam else params.num_samples
    if beam is not None and not engine.cache_manager.supports_fork:
        raise ValueError("beam search forks page tables: it needs a cache manager that can fork")
    forks = width > 1 and engine.cache_manager.supports_fork  # else: n unshared sequences, same outputs
    now = time.monotonic() if arrival_time is None else arrival_time
    seqs = [
        engine.pool.new(request_id, token_ids, params, now, i, cache_salt, grammar and grammar.fork())
        for i in range(1 if forks else width)
    ]
    seqs[0].pending_forks = width - 1 if forks else 0
    for seq in seqs:
        if not engine.cache_manager.fits_at_all(seq):
            raise ValueError(
                f"request {request_id!r} can never fit: {engine.cache_manager.unfit_reason(seq)}"
            )
    if beam is not None:
        check_beams_fit(engine.cache_manager, request_id, seqs[0], width)
    request: Request
    if beam is None:
        request = SamplingRequest(request_id, text, token_ids, params, seqs, now, engine.detokenizer)
    else:
        eos = engine.stop_rules.eos_token_ids
        request = BeamSearchRequest(request_id, text, token_ids, beam, seqs[0], now, engine.detokenizer,
                                    eos, engine.pool)  # fmt: skip
    return request, seqs
