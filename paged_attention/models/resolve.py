"""Loading a model and its tokenizer, offline: a checkpoint folder, a cached hub name, or the embedded one.

Every model takes the same road, ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` with ``local_files_only=True``: nothing is ever downloaded. The
embedded default (a tiny random Llama, built on first use) is described in :mod:`.embedded`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # transformers is imported lazily: `import paged_attention` stays fast
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .._checks import DTYPE_NAMES
from .cpu_dtype import choose_cpu_dtype, stored_dtype
from .embedded import DEFAULT_MODEL_NAME, default_model_path, quiet_progress
from .pretrained import SMOLLM2, CheckpointError, find_pretrained, pretrained_path


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device, config: object | None = None
) -> torch.dtype:
    """Turn a user's ``dtype`` into a torch dtype.

    ``None`` and ``"auto"`` mean, on a CPU, what :func:`.cpu_dtype.choose_cpu_dtype` chooses for
    ``config``'s model: bfloat16 for a half-precision checkpoint where this processor multiplies
    bfloat16 faster (measured once, cached), else float32 (and float32 without a ``config``); on a
    GPU, the checkpoint's own dtype when it is float16 or bfloat16, else float32. Otherwise one of
    ``"float32"`` (``"float"``), ``"float16"`` (``"half"``), ``"bfloat16"``, or the matching
    ``torch.dtype``.
    """
    allowed = {getattr(torch, name) for name in DTYPE_NAMES.values()}
    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        if device.type == "cpu":
            return torch.float32 if config is None else choose_cpu_dtype(config).dtype
        stored = stored_dtype(config) if config is not None else None
        return stored if stored in (torch.float16, torch.bfloat16) else torch.float32
    if isinstance(dtype, str):
        if dtype.lower() in DTYPE_NAMES:
            return getattr(torch, DTYPE_NAMES[dtype.lower()])
    elif isinstance(dtype, torch.dtype):
        if dtype in allowed:
            return dtype
    else:
        raise TypeError(f"dtype must be a str, a torch.dtype or None, got {type(dtype).__name__}")
    names = ", ".join(repr(n) for n in ["auto", *DTYPE_NAMES])
    raise ValueError(f"unsupported dtype {dtype!r}: allowed are {names}, or torch.float32/float16/bfloat16")


def explain_dtype(
    model: str | os.PathLike | PreTrainedModel | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> str:
    """The dtype ``model`` is served in with this ``dtype`` on ``device``, and why, in words: the
    model-load line the commands print, e.g. ``"bfloat16 (auto: its bfloat16 matmul is faster
    here: ...)"`` or ``"float32 (asked for)"``. A model object is served in its own dtype unless
    one is asked for. On a CPU whose bfloat16 the engine multiplies in its own loops, the answer is
    the engine's once the engine is imported (it registers them: :func:`.cpu_dtype.multiply_bfloat16_with`);
    before, the probe times oneDNN's product, what the model runs on outside the engine, and says
    so. ``paged_attention.explain_dtype`` is this function with the engine imported."""
    from transformers import AutoConfig, PreTrainedModel

    dev = _resolve_device(device)
    resolved = str(resolve_dtype(dtype, dev)).removeprefix("torch.")  # validates dtype first
    if dtype is not None and not (isinstance(dtype, str) and dtype.lower() == "auto"):
        return f"{resolved} (asked for)"
    if isinstance(model, PreTrainedModel):
        return f"{str(next(model.parameters()).dtype).removeprefix('torch.')} (the model object's own)"
    config = AutoConfig.from_pretrained(_locate(model), local_files_only=True)
    if dev.type != "cpu":
        chosen = str(resolve_dtype(dtype, dev, config)).removeprefix("torch.")
        stored = str(stored_dtype(config)).removeprefix("torch.")
        return f"{chosen} (auto on a GPU: the checkpoint's {stored}, float32 unless half precision)"
    choice = choose_cpu_dtype(config)
    return f"{str(choice.dtype).removeprefix('torch.')} (auto: {choice.reason})"


def _resolve_device(device: str | torch.device) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but no CUDA GPU is available here: use 'cpu'")
    return dev


def _hub_cache_hint() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover - transformers always brings huggingface_hub
        return "~/.cache/huggingface/hub"


def load_model(
    model: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    tokenizer: str | os.PathLike | None = None,
    hf_overrides: dict[str, Any] | Callable[[Any], Any] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, offline, and return ``(model, tokenizer)``.

    ``model`` is one of:

    - ``None`` or :data:`DEFAULT_MODEL_NAME`: the embedded tiny Llama, built on first use
      (see :func:`default_model_path`);
    - a local folder holding a transformers checkpoint (``config.json`` and weights);
    - ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` (or ``"smollm2"``): the real model fetched and
      converted at install (:mod:`.pretrained`); a missing or corrupt cache is an error naming
      the command that repairs it;
    - a Hugging Face hub name, such as ``"Qwen/Qwen2-0.5B"``, that is already in the local cache.
      Nothing is ever downloaded: this package runs without a network.

    An empty or blank name is refused (``ValueError``): as a path it would be the current folder.
    Every case goes through ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained``; ``tokenizer`` names another folder or hub name to take the
    tokenizer from. ``dtype`` is resolved by :func:`resolve_dtype`. The model comes back in eval mode
    on ``device``. A cache folder that cannot hold the embedded model it must build raises
    :class:`~.embedded.CacheDirError` (a ``ValueError``). ``hf_overrides`` (vLLM's) changes the
    model's config before the weights load: a dict of config fields, or a function of the config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    _check_name("model", model)
    _check_name("tokenizer", tokenizer)
    dev = _resolve_device(device)
    if isinstance(dtype, str) or dtype is None or isinstance(dtype, torch.dtype):
        resolve_dtype(dtype, torch.device("cpu"))  # fail on a bad dtype before any loading
    else:
        raise TypeError(f"dtype must be a str, a torch.dtype or None, got {type(dtype).__name__}")

    source = _locate(model)
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
        config = _override(config, hf_overrides)
        torch_dtype = resolve_dtype(dtype, dev, config)
        with quiet_progress():
            loaded = AutoModelForCausalLM.from_pretrained(
                source, config=config, dtype=torch_dtype, local_files_only=True
            )
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load model {model!r} from {source}: {err}") from err

    tok = _load_tokenizer(source if tokenizer is None else _locate(tokenizer), f"model {model!r}")
    return loaded.to(dev).eval(), tok


def _override(config: Any, overrides: dict[str, Any] | Callable[[Any], Any] | None) -> Any:
    if overrides is None:
        return config
    if callable(overrides):
        return overrides(config)
    if not isinstance(overrides, dict):
        raise TypeError(f"hf_overrides must be a dict of config fields or a function, got {overrides!r}")
    config.update(overrides)
    return config


def load_tokenizer(tokenizer: str | os.PathLike | None = None) -> PreTrainedTokenizerBase:
    """Load only a tokenizer, offline, from the same kinds of sources as :func:`load_model`
    (``None`` is the embedded model's). Useful when the model is already in memory."""
    _check_name("tokenizer", tokenizer)
    return _load_tokenizer(_locate(tokenizer), f"tokenizer {tokenizer!r}")


def _check_name(what: str, name: object) -> None:
    """Refuse what cannot name a model: not a str, path or None (TypeError), or an empty or blank
    string (ValueError: ``Path("")`` is the current folder, which the user surely did not mean)."""
    if name is not None and not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"{what} must be a hub name, a folder path or None, got {type(name).__name__}")
    if isinstance(name, str) and not name.strip():
        raise ValueError(
            f"{what}={name!r} is empty: give None for the embedded model ({DEFAULT_MODEL_NAME!r}), a "
            f"checkpoint folder, a hub name in the local Hugging Face cache, or {SMOLLM2.name!r} "
            "('smollm2')"
        )


def _load_tokenizer(source: str, what: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    problem = ""
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
        # Given a folder with no tokenizer files, transformers 5 builds an *empty* tokenizer of the
        # model's type rather than failing; it would turn every prompt into nothing. Catch it here.
        probe = tok("Hello world", add_special_tokens=False).input_ids
        if not probe or all(i == tok.unk_token_id for i in probe):
            problem = "it has no vocabulary"
    except (OSError, ValueError, TypeError) as err:
        problem = str(err)
    if problem:
        raise ValueError(
            f"{what}: found no usable tokenizer in {source} ({problem}); "
            "pass tokenizer= a folder or cached hub name that holds one"
        )
    return tok


def _locate(name: str | os.PathLike | None) -> str:
    """Where ``from_pretrained`` should look: a local folder, or a hub name found in the local cache."""
    if name is None or (isinstance(name, str) and name == DEFAULT_MODEL_NAME):
        return str(default_model_path())
    if find_pretrained(name) is not None:  # SmolLM2, fetched at install: its verified cache folder
        try:
            return str(pretrained_path(find_pretrained(name)))
        except CheckpointError as err:
            raise ValueError(str(err)) from err
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ValueError(f"model path {str(name)!r} is a file: give the folder that holds config.json")
    text = os.fspath(name)
    try:
        from huggingface_hub import try_to_load_from_cache

        found = isinstance(try_to_load_from_cache(text, "config.json"), str)
    except ValueError:  # not a valid repo id, e.g. "./missing/folder" or "a/b/c"
        found = False
    if not found:
        raise ValueError(
            f"cannot find model {text!r}: it is neither a local folder nor a model in the local "
            f"Hugging Face cache ({_hub_cache_hint()}), and nothing is downloaded (this package runs "
            f"offline). Give a checkpoint folder, a hub name you have downloaded before, or no model "
            f"for the embedded default {DEFAULT_MODEL_NAME!r}."
        )
    return text


def resolve_model(
    model: str | os.PathLike | PreTrainedModel | None,
    tokenizer: str | os.PathLike | PreTrainedTokenizerBase | None,
    dtype: str | torch.dtype | None,
    device: torch.device,
    hf_overrides: dict[str, Any] | Callable[[Any], Any] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model object is used as given (moved to ``device``, cast to ``dtype`` if one is named);
    anything else goes through :func:`load_model`. ``tokenizer`` likewise: an object, or where to
    load one (by default the model's own)."""
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    tok = None
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        tok = tokenizer
    elif tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    if isinstance(model, PreTrainedModel):
        if tok is None:
            source = getattr(model, "name_or_path", "")
            if not source:
                raise ValueError("a model object needs tokenizer= (a tokenizer, or where to load one)")
            tok = load_tokenizer(source)
        if hf_overrides is not None:
            raise ValueError(
                "hf_overrides changes a config before loading: give a model name, not a model object"
            )
        if dtype is not None:
            model = model.to(resolve_dtype(dtype, device, model.config))
        return model.to(device).eval(), tok
    loaded, default_tok = load_model(model, dtype, device, hf_overrides=hf_overrides)
    return loaded, tok if tok is not None else default_tok


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every token that ends a sequence: the generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return ids


def attention_window(config: object) -> int | None:
    """The model's sliding attention window, if it uses one (Mistral; Qwen2 only when enabled)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def check_supported(config: object) -> None:
    """Refuse models whose attention or logits need what our kernels do not do, instead of
    serving them wrongly: soft-capped attention scores (Gemma 2) or rescaled logits (Cohere)."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None):
            raise ValueError(f"{type(config).__name__} uses {name}, which paged_attention does not implement")
    if getattr(config, "logit_scale", 1.0) not in (None, 1.0):
        raise ValueError(
            f"{type(config).__name__} rescales its logits (logit_scale), which is not implemented"
        )


def serving_length(config: object, max_model_len: int | None) -> int:
    """The longest sequence to serve: ``max_model_len``, by default the model's positions (or its
    sliding window, if shorter); never more than either."""
    from .._checks import check_positive_int

    check_supported(config)
    model_max = getattr(config, "max_position_embeddings", None) or 2048
    window = attention_window(config)
    if window is not None and window < model_max:
        # Our kernels attend to the whole context. Within the window that is exactly what a
        # sliding-window model does, so serve sequences only up to the window's length.
        if max_model_len is not None and max_model_len > window:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's sliding window of {window} tokens, "
                "which paged_attention does not implement"
            )
        model_max = window
    length = check_positive_int("max_model_len", model_max if max_model_len is None else max_model_len)
    if length > model_max:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's {model_max} positions")
    return length
