"""``EngineArgs``: every engine setting in one dataclass, from keywords or a command line (vLLM's).

vLLM programs build their engine three ways, and all three work here: ``LLM(model=..., **kwargs)``,
``LLMEngine.from_engine_args(EngineArgs(...))``, and a command line through
``EngineArgs.add_cli_args(parser)`` then ``EngineArgs.from_cli_args(args)``. The fields are
:class:`~.llm_engine.LLMEngine`'s keywords (a test keeps them equal) plus vLLM's own keywords, in
two kinds:

* :data:`IGNORED`: vLLM settings that change nothing here (how vLLM compiles, downloads or logs);
  accepted, so that vLLM programs run, and documented as doing nothing;
* :data:`REFUSED`: vLLM settings this engine cannot honour except at their neutral value (several
  GPUs, quantized weights, LoRA, ...): another value raises ``ValueError`` naming the
  keyword and why, rather than silently serving something else.

An unknown keyword raises ``TypeError`` naming the caller (``LLM``, ``EngineArgs``) and the
closest known names.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
from dataclasses import dataclass
from typing import Any

#: vLLM keywords accepted and ignored here, with what they do in vLLM.
IGNORED = {
    "trust_remote_code": "runs a model's own code from the hub (models here load offline)",
    "disable_log_stats": "turns off periodic stats logging (get_metrics works either way)",
    "swap_space": "GiB of CPU swap per GPU (here: num_cpu_blocks, with preemption_mode='swap')",
    "tokenizer_mode": "picks a fast or slow tokenizer (transformers' AutoTokenizer decides)",
    "revision": "a hub revision (nothing is downloaded)",
    "tokenizer_revision": "a hub revision (nothing is downloaded)",
    "download_dir": "where to download weights (nothing is downloaded)",
    "load_format": "the weights' file format (transformers' from_pretrained decides)",
    "disable_custom_all_reduce": "a multi-GPU kernel choice",
    "max_seq_len_to_capture": "the longest CUDA graph captured (none are)",
    "enable_chunked_prefill": "chunked prefill is always on here (vLLM v1's default)",
    "disable_async_output_proc": "overlapping output processing with the next step",
    "async_scheduling": "overlapping scheduling with the model's step",
    "pt_load_map_location": "where torch.load maps the weights (they load on the CPU, then move)",
}

#: vLLM keywords honoured only at their neutral value: (neutral values, why another is refused).
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tensor_parallel_size": ((1,), "this engine runs on one device"),
    "pipeline_parallel_size": ((1,), "this engine runs on one device"),
    "data_parallel_size": ((1,), "this engine runs on one device"),
    "distributed_executor_backend": ((None,), "this engine runs on one device, in this process"),
    "quantization": ((None,), "weights are served in the dtype they load in"),
    "cpu_offload_gb": ((0,), "weights stay on the serving device"),
    "enable_lora": ((False,), "there are no LoRA adapters here"),
    "task": (("auto", "generate"), "this engine generates text (no pooling or embedding models)"),
    "runner": (("auto", "generate"), "this engine generates text (no pooling or embedding models)"),
}


#: Fields that :class:`~.llm.LLM` reads itself and does not pass to the engine.
LLM_ONLY = ("profiler_config",)


@dataclass
class EngineArgs:
    """The settings of :class:`~.llm_engine.LLMEngine`: ``generation_config`` (where default
    sampling parameters come from: ``"auto"``, the model's ``generation_config.json``; ``"vllm"``,
    vLLM's defaults; or a folder holding one), ``hf_overrides`` (config fields changed before the
    weights load: a dict, or a function of the config), and the rest as the engine documents them;
    plus :class:`~.llm.LLM`'s ``profiler_config`` (where ``start_profile`` writes its trace)."""

    model: Any = None
    tokenizer: Any = None
    dtype: Any = None
    device: Any = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    attention_backend: str = "auto"
    #: ``None``: vLLM's switch, ``VLLM_BATCH_INVARIANT=1`` in the environment (:mod:`..models.invariant`).
    batch_invariant: bool | None = None
    preemption_mode: str = "recompute"
    num_cpu_blocks: int | None = None
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    #: vLLM's: "auto" (the model's dtype), "fp8"/"fp8_e4m3", "fp8_e5m2", or "int8" (a scale per block
    #: and KV head); :mod:`..kernels.quantization`.
    kv_cache_dtype: str = "auto"
    #: fp8 caches: set each layer's scales from the first batch (else 1.0).
    calculate_kv_scales: bool = False
    seed: int | None = 0
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    generation_config: str = "auto"
    hf_overrides: Any = None
    #: vLLM v1's dict: ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": ..,
    #: "prompt_lookup_max": ..}`` (:mod:`.speculative`).
    speculative_config: Any = None
    #: vLLM's: ``0`` or ``{"mode": 0}`` eager (the default here), modes 1-3 compiled
    #: (:mod:`..models.compilation`).
    compilation_config: Any = None
    #: vLLM's: keep the model eager whatever ``compilation_config`` says.
    enforce_eager: bool = False
    #: ``LLM``'s, not the engine's: ``{"profiler": "torch", "torch_profiler_dir": folder}``.
    profiler_config: Any = None

    @classmethod
    def from_keywords(cls, caller: str, kwargs: dict[str, Any]) -> EngineArgs:
        """Check vLLM's keywords (ignored, refused, unknown; see the module docstring) and build
        the arguments from the rest. ``caller`` names who was called, for the errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in kwargs if k not in known and k not in IGNORED and k not in REFUSED]
        if unknown:
            name = unknown[0]
            close = difflib.get_close_matches(name, [*known, *IGNORED, *REFUSED], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}{hint}")
        for name, (neutral, why) in REFUSED.items():
            if name in kwargs and kwargs[name] not in neutral:
                allowed = " or ".join(repr(v) for v in neutral)
                raise ValueError(
                    f"{caller}({name}={kwargs[name]!r}) is not supported: {why} ({allowed} only)"
                )
        swap = kwargs.get("swap_space") or 0  # None: a command line's default
        if isinstance(swap, bool) or not isinstance(swap, (int, float)) or swap < 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0 (ignored here), got {swap!r}")
        return cls(**{k: v for k, v in kwargs.items() if k in known})

    def engine_kwargs(self) -> dict[str, Any]:
        """The keywords of :class:`~.llm_engine.LLMEngine` (values as they are: a model object is
        passed, not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in LLM_ONLY}

    # -- the command line (vLLM's spelling: --max-model-len) -------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one ``--option`` per field (and per ignored vLLM option, accepted); returns the parser."""
        group = parser.add_argument_group("engine (paged_attention.EngineArgs)")
        for f in dataclasses.fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            if f.name in ("hf_overrides", "profiler_config", "speculative_config", "compilation_config"):
                group.add_argument(flag, type=json.loads, default=None, help="JSON")
            elif isinstance(f.default, bool) or f.type == "bool | None":  # None: not given
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            else:
                group.add_argument(flag, type=_parser_for(f.default, f.type), default=f.default,
                                   help=f"default: {f.default}")  # fmt: skip
        for name in IGNORED:
            group.add_argument("--" + name.replace("_", "-"), nargs="?", const=True, default=None,
                               help=f"accepted and ignored: in vLLM, {IGNORED[name]}")  # fmt: skip
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        )


def _parser_for(default: Any, annotation: object) -> Any:
    """How a command-line string becomes a field's value: by the field's type."""
    text = str(annotation)
    if "float" in text:
        return float
    if "int" in text:
        return lambda s: None if s.lower() == "none" else int(s)
    return str
