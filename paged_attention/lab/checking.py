"""``check(exercise_id, *objects)``: grade an exercise's objects against the package's own code.

A check function runs cases (fixed ones first, the ones a student is likely to get wrong, then
random ones drawn from a seed) and stops at the first wrong one with :class:`CheckFailed`, which
names the case and shows what was expected and what came back. It reaches the student's objects
only through a :class:`~.student.Student` (:mod:`.student`): in this process for a notebook's check
cell, in a child process for the grader (:mod:`.sandbox`). ``thorough=True`` (the grader) runs more
cases than the notebook shows.
"""

from __future__ import annotations

import importlib
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


def run(exercise_id: str, *objects: Any, thorough: bool = False, seed: int = 0) -> int:
    """Run an exercise's cases (drawn from ``seed``) on ``objects`` in this process; returns how many
    passed, raises on the first failure (the grader runs the same check on a child process)."""
    from .student import LocalStudent  # it imports CheckFailed from here

    check = checker(exercise_id)
    names = EXERCISES[exercise_id].names
    if len(objects) != len(names):
        raise TypeError(f"check({exercise_id!r}, ...) takes {len(names)} object(s): {', '.join(names)}")
    return check(LocalStudent(objects), seed=seed, thorough=thorough)


def check(exercise_id: str, *objects: Any) -> None:
    """Grade an exercise in the notebook: prints a pass line, or raises naming the first wrong case.

    An unfinished exercise raises its ``NotImplementedError``; a wrong one :class:`CheckFailed`.
    The cases are the same on every run (seed 0), so a failing case can be rerun and debugged; the
    grader draws fresh ones."""
    passed = run(exercise_id, *objects)
    print(f"✓ {exercise_id} ({EXERCISES[exercise_id].title}): all {passed} cases pass")
