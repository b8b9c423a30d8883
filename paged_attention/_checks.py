"""Argument checks shared by the package: one wording for every bad-input error.

A teaching codebase should fail loudly and helpfully. Each check names the argument, says what
was received and what is allowed, so that a student who passes ``block_size=0`` learns the rule
instead of reading a traceback from deep inside a kernel.
"""

from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """Return ``value`` if it is an ``int`` (not a ``bool``) and at least ``minimum``.

    Raises ``TypeError`` for a non-integer and ``ValueError`` for one below ``minimum``.
    """
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
