"""``check(exercise_id, *objects)``: grade an exercise's objects against the package's own code.

A check function runs cases (fixed ones first, the ones a student is likely to get wrong, then
hypothesis-generated ones) and stops at the first wrong one with :class:`CheckFailed`, which names
the case and shows what was expected and what came back. ``thorough=True`` (the grader) runs more
cases than the notebook shows.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from .registry import EXERCISES


class CheckFailed(AssertionError):
    """An exercise gave a wrong answer: ``case`` says which input, ``expected`` and ``got`` what."""

    def __init__(self, case: str, expected: Any = None, got: Any = None, hint: str = "") -> None:
        self.case, self.expected, self.got, self.hint = case, expected, got, hint
        message = case if expected is None and got is None else f"{case}: expected {expected!r}, got {got!r}"
        super().__init__(message + (f" ({hint})" if hint else ""))


def expect(case: str, expected: Any, got: Any, hint: str = "") -> None:
    """Raise :class:`CheckFailed` unless ``got == expected``."""
    if got != expected:
        raise CheckFailed(case, expected, got, hint)


def checker(exercise_id: str) -> Callable[..., int]:
    """The check function of an exercise (see :mod:`.registry`)."""
    if exercise_id not in EXERCISES:
        raise ValueError(f"exercise_id must be one of {sorted(EXERCISES)}, got {exercise_id!r}")
    module, function = EXERCISES[exercise_id].checker.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def run(exercise_id: str, *objects: Any, thorough: bool = False) -> int:
    """Run an exercise's cases on ``objects``; returns how many passed, raises on the first failure."""
    check = checker(exercise_id)
    names = EXERCISES[exercise_id].names
    if len(objects) != len(names):
        raise TypeError(f"check({exercise_id!r}, ...) takes {len(names)} object(s): {', '.join(names)}")
    try:
        return check(*objects, thorough=thorough)
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as err:
        unfinished = _unfinished(err)
        if unfinished is None:
            raise
        raise unfinished from None


_STUB = re.compile(r"NotImplementedError\(\s*[\"'](Exercise [^\"']*)[\"']\s*\)")


def _unfinished(err: BaseException) -> NotImplementedError | None:
    """The exercise's own ``NotImplementedError`` behind ``err``, if that is what it is: Triton's
    interpreter wraps it (as the cause), and a compiler that cannot compile a ``raise`` quotes it."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, NotImplementedError):
            return seen
        seen = seen.__cause__ or seen.__context__
    match = _STUB.search(str(err))
    return NotImplementedError(match.group(1)) if match else None


def check(exercise_id: str, *objects: Any) -> None:
    """Grade an exercise in the notebook: prints a pass line, or raises naming the first wrong case.

    An unfinished exercise raises its ``NotImplementedError``; a wrong one :class:`CheckFailed`."""
    passed = run(exercise_id, *objects)
    print(f"✓ {exercise_id} ({EXERCISES[exercise_id].title}): all {passed} cases pass")
