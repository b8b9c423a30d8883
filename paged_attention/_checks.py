"""Argument checks shared by the package: one wording for every bad-input error.

A teaching codebase should fail loudly and helpfully. Each check names the argument, says what
was received and what is allowed, so that a student who passes ``block_size=0`` learns the rule
instead of reading a traceback from deep inside a kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """Return ``value`` if it is an ``int`` (not a ``bool``) and at least ``minimum``.

    Raises ``TypeError`` for a non-integer and ``ValueError`` for one below ``minimum``.
    """
    if type(value) is int and (minimum is None or value >= minimum):
        return value  # the common case, first: the scheduler checks millions of these in a replay
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        rule = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {rule}, got {value}")
    return value


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` if it is an ``int`` >= 1, else raise a ``TypeError``/``ValueError`` naming it."""
    return check_int(name, value, minimum=1)


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints: the number of size-``b`` blocks that hold ``a`` items."""
    return -(-a // b)


# vLLM's spellings are accepted too ("half", "float"), so programs written against vLLM run unchanged.
# Each maps to torch's own name (the attribute of ``torch``): this module imports no torch, so the
# bookkeeping layers that check their arguments here (the allocator, the page table) need none either.
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def as_dtype(dtype: Any) -> torch.dtype:
    """A ``torch.dtype`` from itself or its name: vLLM's spellings (:data:`DTYPE_NAMES`) or torch's
    (``"float64"``, ``"torch.float16"``). Raises ``TypeError`` naming what is allowed."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
        name = DTYPE_NAMES.get(name, name)
        if isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
    raise TypeError(f"dtype must be a torch.dtype or its name such as 'float16' or 'half', got {dtype!r}")
