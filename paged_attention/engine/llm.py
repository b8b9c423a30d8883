"""vLLM's offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

A program written for vLLM's offline API runs here with only its import line (and the model name)
changed. :class:`LLM` is a thin front over :class:`~.llm_engine.LLMEngine`: it adds every prompt,
steps the engine until all are done, and returns the outputs in the order of the prompts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .._checks import check_positive_int
from .beam_search import BeamSearchOutput, BeamSearchSequence, penalized_score
from .inputs import Prompt, as_prompt_list
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """vLLM's offline API: ``LLM(model=...).generate(prompts, sampling_params)``.

    With no ``model`` it serves the embedded tiny Llama (see :mod:`paged_attention.models.embedded`).
    ``gpu_memory_utilization`` sizes the KV cache on CUDA; on a CPU the cache is sized by
    ``num_kv_blocks`` or ``kv_cache_memory`` (bytes), else 512 MiB. Other keyword arguments go to
    :class:`LLMEngine`; vLLM's ``trust_remote_code``, ``enforce_eager``, ``disable_log_stats``,
    ``swap_space`` and ``tensor_parallel_size=1`` are accepted and do nothing here.
    """

    # vLLM arguments that mean nothing here, accepted so that vLLM programs run unchanged.
    _VLLM_NO_OPS = ("trust_remote_code", "enforce_eager", "disable_log_stats", "swap_space")

    def __init__(self, model: str | os.PathLike | PreTrainedModel | None = None, **kwargs: Any) -> None:
        for name in self._VLLM_NO_OPS:
            kwargs.pop(name, None)
        tensor_parallel_size = kwargs.pop("tensor_parallel_size", 1)
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size must be 1 (one device), got {tensor_parallel_size!r}")
        self.llm_engine = LLMEngine(model, **kwargs)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.llm_engine.tokenizer

    def chat(
        self,
        messages: Sequence[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them (vLLM's ``LLM.chat``); one output each, in order.

        A conversation is a list of ``{"role": ..., "content": ...}`` dicts. Each is rendered by the
        tokenizer's chat template (or ``chat_template``) and served like :meth:`generate`; the output's
        ``prompt`` is the rendered text. Malformed messages raise ``TypeError``/``ValueError`` naming
        the conversation and message, before any work starts.
        """
        from .chat import as_conversations, render_chat

        conversations = as_conversations(messages)
        tokenizer = self.get_tokenizer()
        prompts: list[Prompt] = [
            render_chat(
                tokenizer,
                c,
                add_generation_prompt,
                continue_final_message,
                chat_template,
                chat_template_kwargs,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Serve every prompt to the end; outputs come back in the order of ``prompts``.

        A prompt that cannot be served (empty, too long, bad ids) raises ``ValueError`` before any
        work starts, naming its index, so that a batch is all-or-nothing like vLLM's. If the run
        is interrupted (Ctrl-C) or fails, the requests it added are aborted before the exception
        goes on: the engine is left serving nothing of theirs and holding none of their blocks.
        """
        prompts = as_prompt_list(prompts)
        if isinstance(sampling_params, BeamSearchParams):
            raise TypeError("sampling_params must be SamplingParams; for a beam search call LLM.beam_search")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            if isinstance(sampling_params, (str, bytes)) or not isinstance(sampling_params, Sequence):
                raise TypeError(
                    "sampling_params must be a SamplingParams, a list of them (one per prompt) or None, "
                    f"got {type(sampling_params).__name__}"
                )
            params_list = list(sampling_params)
            wrong = [type(p).__name__ for p in params_list if not isinstance(p, SamplingParams)]
            if wrong:
                raise TypeError(
                    f"sampling_params must hold SamplingParams only, got {', '.join(sorted(set(wrong)))}"
                )
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        return self._serve(prompts, params_list, use_tqdm, "Processed prompts")

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        use_tqdm: bool | Callable[..., Any] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search every prompt (vLLM's ``LLM.beam_search``); one :class:`BeamSearchOutput` each.

        Each output holds the best ``beam_width`` finished sequences, best first; their ``tokens``
        include the prompt, as in vLLM. ``concurrency_limit`` caps how many prompts search at once.
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompts = as_prompt_list(prompts)
        limit = (
            len(prompts)
            if concurrency_limit is None
            else check_positive_int("concurrency_limit", concurrency_limit)
        )
        tokenizer = self.llm_engine.tokenizer
        results = []
        for first in range(0, len(prompts), max(1, limit)):
            chunk = prompts[first : first + limit]
            for request in self._serve(chunk, [params] * len(chunk), use_tqdm, "Beam search"):
                sequences = []
                for out in request.outputs:
                    tokens = request.prompt_token_ids + out.token_ids
                    logprob = out.cumulative_logprob or 0.0
                    score = penalized_score(logprob, len(out.token_ids), params.length_penalty)
                    text = tokenizer.decode(tokens)
                    sequences.append(
                        BeamSearchSequence(tokens, logprob, text, out.finish_reason, None, score)
                    )
                results.append(BeamSearchOutput(sequences))
        return results

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's free blocks (vLLM's ``LLM.reset_prefix_cache``)."""
        self.llm_engine.reset_prefix_cache()
        return True

    def _serve(
        self,
        prompts: list[Prompt],
        params_list: list[SamplingParams] | list[BeamSearchParams],
        use_tqdm: bool | Callable[..., Any],
        desc: str,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                if isinstance(params, SamplingParams):  # as vLLM's LLM: no streaming, one output each
                    params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                try:
                    ids.append(engine.add_request(None, prompt, params))
                except (ValueError, TypeError) as err:
                    raise type(err)(f"prompt {i}: {err}") from err
        except Exception:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        progress_cls = use_tqdm if callable(use_tqdm) else tqdm
        bar = progress_cls(total=len(ids), desc=desc, disable=use_tqdm is False, unit="req")
        try:
            with bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            bar.update(1)
        except BaseException:  # Ctrl-C included: leave nothing of ours holding blocks, then re-raise
            for request_id in ids:
                if request_id in engine.request_ids:
                    engine.abort_request(request_id)
            raise
        return [results[i] for i in ids]
