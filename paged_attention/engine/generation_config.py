"""Default sampling parameters from a model's ``generation_config.json``, as vLLM reads them.

vLLM's ``generation_config`` setting says where a request's defaults come from: ``"auto"`` (the
default) reads the model's own ``generation_config.json``; ``"vllm"`` ignores it and keeps
:class:`~.params.SamplingParams`' defaults; any other value is a folder holding a
``generation_config.json``. Only the fields vLLM takes are read, and only where the file sets
them to something else than transformers' defaults: ``repetition_penalty``, ``temperature``,
``top_k``, ``top_p``, ``min_p`` and ``max_new_tokens`` (which becomes ``max_tokens``).
``LLM.get_default_sampling_params()`` and ``LLM.generate(prompts)`` without parameters use them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import GenerationConfig, PreTrainedModel

#: The generation-config fields vLLM turns into sampling defaults (and their SamplingParams names).
FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
          "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}  # fmt: skip


def check_generation_config(value: object) -> str:
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise TypeError(f"generation_config must be 'auto', 'vllm' or a folder, got {value!r}")
    value = str(value)
    if value not in ("auto", "vllm") and not (Path(value) / "generation_config.json").is_file():
        raise ValueError(
            f"generation_config={value!r}: not 'auto' or 'vllm', and no generation_config.json in that folder"
        )
    return value


def sampling_defaults(model: PreTrainedModel, generation_config: str) -> dict[str, Any]:
    """The SamplingParams keywords that ``generation_config`` sets (see the module docstring)."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        config = getattr(model, "generation_config", None)
        if config is None:
            return {}
    else:
        config = GenerationConfig.from_pretrained(generation_config)
    diff = config.to_diff_dict()
    return {name: diff[key] for key, name in FIELDS.items() if diff.get(key) is not None}
