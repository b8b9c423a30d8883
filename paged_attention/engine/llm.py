"""vLLM's offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

A program written for vLLM's offline API runs here with only its import line (and the model name)
changed. :class:`LLM` is a thin front over :class:`~.llm_engine.LLMEngine`: it adds every prompt,
steps the engine until all are done, and returns the outputs in the order of the prompts.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .._checks import check_positive_int
from .beam_search import BeamSearchOutput, BeamSearchSequence, penalized_score
from .engine_args import EngineArgs
from .inputs import Prompt, as_prompt_list
from .llm_engine import LLMEngine
from .metrics import Metric
from .outputs import RequestOutput
from .sample.sampling import BeamSearchParams, RequestOutputKind, SamplingParams


def check_profiler_config(config: object) -> dict | None:
    """vLLM's ``profiler_config``: ``None`` or ``{"profiler": "torch", "torch_profiler_dir": folder}``."""
    if config is None:
        return None
    if not isinstance(config, dict) or config.get("profiler", "torch") != "torch":
        raise ValueError(
            "profiler_config must be None or {'profiler': 'torch', 'torch_profiler_dir': folder}, "
            f"got {config!r}"
        )
    return config


def cleanup_dist_env_and_memory() -> None:
    """vLLM's clean-up after ``del llm``: here one process, one device, so it collects garbage and
    gives cached CUDA memory back (``vllm.distributed.cleanup_dist_env_and_memory``)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class LLM:
    """vLLM's offline API: ``LLM(model=...).generate(prompts, sampling_params)``.

    With no ``model`` it serves the embedded tiny Llama (see :mod:`paged_attention.models.embedded`).
    The keywords are :class:`~.engine_args.EngineArgs`' (``LLM(**vars(engine_args))`` works too):
    ``gpu_memory_utilization`` sizes the KV cache on CUDA; on a CPU the cache is sized by
    ``num_kv_blocks`` or ``kv_cache_memory`` (bytes), else 512 MiB. vLLM keywords that change
    nothing here (``trust_remote_code``, ``swap_space``, ...) are accepted; ones it cannot
    honour (``tensor_parallel_size=2``, ``quantization``, ...) are refused by name
    (:data:`~.engine_args.IGNORED`, :data:`~.engine_args.REFUSED`). ``cache_manager_factory`` and
    ``scheduling_policy`` objects go to the engine as they are.
    """

    def __init__(self, model: str | os.PathLike | PreTrainedModel | None = None, **kwargs: Any) -> None:
        objects = {k: kwargs.pop(k) for k in ("cache_manager_factory", "scheduling_policy") if k in kwargs}
        args = EngineArgs.from_keywords("LLM", {"model": model, **kwargs})
        self.llm_engine = LLMEngine.from_engine_args(args, **objects)
        self._profiler: Any = None
        self._profile_dir: Path | None = None
        self.profiler_config = check_profiler_config(args.profiler_config)

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters a request gets when it brings none: vLLM's defaults, changed
        by the model's generation config (``generation_config="auto"``; :mod:`.generation_config`)."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def get_metrics(self) -> list[Metric]:
        """vLLM's metrics (:mod:`.metrics`): ``Counter``, ``Gauge``, ``Histogram`` records."""
        return self.llm_engine.get_metrics()

    def start_profile(self, profile_dir: str | os.PathLike | None = None) -> None:
        """Start torch's profiler (CPU, and CUDA when serving on a GPU). The trace is written by
        :meth:`stop_profile` into ``profile_dir``, else ``profiler_config["torch_profiler_dir"]``,
        else ``$VLLM_TORCH_PROFILER_DIR`` (vLLM's two ways); with none, ``RuntimeError`` says what to set."""
        configured = (self.profiler_config or {}).get("torch_profiler_dir")
        folder = profile_dir or configured or os.environ.get("VLLM_TORCH_PROFILER_DIR")
        if not folder:
            raise RuntimeError(
                "profiling is not enabled: set VLLM_TORCH_PROFILER_DIR to a folder for the trace, or "
                "LLM(profiler_config={'profiler': 'torch', 'torch_profiler_dir': folder}) (as in vLLM), "
                "or pass start_profile(profile_dir=...)"
            )
        if self._profiler is not None:
            raise RuntimeError("a profile is already running: call stop_profile() first")
        import torch.profiler as tp

        activities = [tp.ProfilerActivity.CPU]
        if self.llm_engine.runner.device.type == "cuda":
            activities.append(tp.ProfilerActivity.CUDA)
        self._profile_dir = Path(folder)
        self._profile_dir.mkdir(parents=True, exist_ok=True)
        self._profiler = tp.profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()

    def stop_profile(self) -> Path:
        """Stop the profiler; returns the Chrome trace it wrote (open it in Perfetto or chrome://tracing)."""
        if self._profiler is None or self._profile_dir is None:
            raise RuntimeError("no profile is running: call start_profile() first")
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        path = self._profile_dir / f"trace-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        profiler.export_chrome_trace(str(path))
        return path

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
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them (vLLM's ``LLM.chat``); one output each, in order.

        A conversation is a list of ``{"role": ..., "content": ...}`` dicts. Each is rendered by the
        tokenizer's chat template (or ``chat_template``), given ``tools`` (OpenAI's function specs:
        the template may show them to the model; as in vLLM, the answer is not parsed for calls),
        and served like :meth:`generate`; the output's ``prompt`` is the rendered text. Malformed
        messages raise ``TypeError``/``ValueError`` naming the conversation and message, before any
        work starts.
        """
        from .chat import as_conversations, render_chat

        conversations = as_conversations(messages)
        tokenizer = self.get_tokenizer()
        if tools is not None:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
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
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
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

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache's free blocks (vLLM's ``LLM.reset_prefix_cache``); returns
        whether it did. Between ``generate`` calls nothing runs, so ``reset_running_requests``
        (vLLM's: preempt running requests first) changes nothing here but is checked."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def _serve(
        self,
        prompts: list[Prompt],
        params_list: list[SamplingParams] | list[BeamSearchParams],
        use_tqdm: bool | Callable[..., Any],
        desc: str,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids: list[str] = []
        known = set(engine.request_ids)  # an interrupt may land between add_request and the append
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                if isinstance(params, SamplingParams):  # as vLLM's LLM: no streaming, one output each
                    params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                try:
                    ids.append(engine.add_request(None, prompt, params))
                except (ValueError, TypeError) as err:
                    raise type(err)(f"prompt {i}: {err}") from err
        except BaseException:  # a bad prompt, or Ctrl-C while adding: leave none of ours queued
            engine.abort_request([i for i in engine.request_ids if i not in known])
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
            mine = set(ids)
            engine.abort_request([i for i in engine.request_ids if i in mine])
            raise
        return [results[i] for i in ids]
