"""``speculative_config``: what vLLM v1 takes to turn on speculative decoding, validated.

Only the draft-model-free method is built here, ``"ngram"`` (prompt lookup): drafts are copied from
earlier in the request's own tokens (:mod:`.ngram`) and verified by the target model in one forward
(:mod:`.rejection`). vLLM's other methods (``"eagle"``, ``"eagle3"``, ``"medusa"``, ``"mlp_speculator"``,
``"draft_model"``) need a second model and are refused by name.

Defaults follow vLLM v1's ``SpeculativeConfig``: with neither ``prompt_lookup_min`` nor
``prompt_lookup_max`` given both are 5; with one given, the other takes its value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
NEEDS_A_DRAFT_MODEL = ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "deepseek_mtp", "mtp")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
DEFAULT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """N-gram speculation: propose up to ``num_speculative_tokens`` tokens that followed the longest
    earlier match (between ``prompt_lookup_min`` and ``prompt_lookup_max`` tokens long) of the
    sequence's last tokens."""

    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    method: str = "ngram"

    @classmethod
    def from_dict(cls, config: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """The config of ``LLM(..., speculative_config=...)``; None (no speculation) stays None.

        Raises :class:`TypeError` for a value of the wrong type and :class:`ValueError` for an
        unknown key or method, a count below 1, or ``prompt_lookup_min > prompt_lookup_max``, each
        naming the key and what is allowed."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config must be a dict or None, got {type(config).__name__}")
        unknown = sorted(set(config) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; allowed: {list(KEYS)}")
        method = config.get("method", "ngram")
        if not isinstance(method, str):
            raise TypeError(f"speculative_config['method'] must be a str, got {type(method).__name__}")
        if method in NEEDS_A_DRAFT_MODEL:
            raise ValueError(
                f"speculative_config['method']={method!r} needs a draft model, which this engine does not "
                f"run; allowed: {list(METHODS)}"
            )
        if method not in METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {list(METHODS)}, got {method!r}")
        if "num_speculative_tokens" not in config:
            raise ValueError(
                "speculative_config needs 'num_speculative_tokens' (the drafted tokens per step, >= 1)"
            )
        values = {key: config.get(key) for key in KEYS[1:]}
        for key, value in values.items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise TypeError(f"speculative_config[{key!r}] must be an int, got {type(value).__name__}")
            if value is not None and value < 1:
                raise ValueError(f"speculative_config[{key!r}] must be >= 1, got {value}")
        low, high = values["prompt_lookup_min"], values["prompt_lookup_max"]
        low, high = (low or high or DEFAULT_LOOKUP), (high or low or DEFAULT_LOOKUP)
        if low > high:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})"
            )
        return cls(values["num_speculative_tokens"], low, high, method)
