"""How a check reaches the student's code: only through ``student.call(case, driver, *args)``.

A check never holds the student's objects. It names a *driver*, a small function of its own module
marked :func:`driver`, that runs beside the student's objects, calls them on plain inputs and
returns plain data (numbers, strings, lists, dicts: what JSON carries). The check compares that
data with what the package's own code gives on the same inputs. Two students implement the call:

* :class:`LocalStudent` (a notebook's ``check`` cell): the objects live in this process;
* :class:`~.sandbox.ChildStudent` (the grader): the objects live in a fresh interpreter of their
  own, behind a pipe, with a time and a memory limit, so that nothing the cell does can reach the
  check or the reference (see :mod:`.sandbox`).

Both send the driver's result through JSON, so a check sees exactly the same data either way.
A driver keeps what must outlive one call (a queue being operated on, say) in ``state``, a dict
that lives as long as the student.

An exception in the student's code fails the case being run: :class:`CheckFailed` names the case,
the exception and the line of the student's cell that raised it. The exercise's own
``NotImplementedError`` means "unfinished" and goes through unchanged.
"""

from __future__ import annotations

import importlib
import json
import re
import time
import traceback
from collections.abc import Callable
from typing import Any

from .checking import CheckFailed

#: Where drivers live: modules under :mod:`paged_attention.lab`.
DRIVER_MODULES = ("checks_memory", "checks_kernels", "checks_serving", "checks_load", "checks_spec",
                  "checks_structured", "checks_quantization")  # fmt: skip


def driver(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``function(state, objects, *args)`` as a driver a check may name (and nothing else)."""
    function.lab_driver = True  # type: ignore[attr-defined]
    return function


def find_driver(name: str) -> Callable[..., Any]:
    """The driver called ``"module:function"`` (a module of :data:`DRIVER_MODULES`)."""
    module, _, function = name.partition(":")
    if module not in DRIVER_MODULES:
        raise ValueError(f"driver must be 'module:function' with module in {DRIVER_MODULES}, got {name!r}")
    found = getattr(importlib.import_module(f"{__package__}.{module}"), function, None)
    if not getattr(found, "lab_driver", False):
        raise ValueError(f"{name!r} is not a driver")
    return found  # type: ignore[return-value]


def to_json(value: Any) -> str:
    """The driver's result as JSON: what crosses from the student's side to the check's."""
    return json.dumps(value, default=_unknown, allow_nan=True)


def _unknown(value: Any) -> str:
    """An object JSON cannot carry (a student's return value, say) crosses as its type's name."""
    return f"<a {type(value).__name__}>"


_STUB = re.compile(r"NotImplementedError\(\s*[\"'](Exercise [^\"']*)[\"']\s*\)")


def unfinished(err: BaseException) -> NotImplementedError | None:
    """The exercise's own ``NotImplementedError("Exercise <id>: ...")`` behind ``err``, if that is
    what it is: Triton's interpreter wraps it (as the cause), and a compiler that cannot compile a
    ``raise`` quotes it. Any other ``NotImplementedError`` (torch's, say) is an error like others."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, NotImplementedError) and str(seen).startswith("Exercise "):
            return seen
        seen = seen.__cause__ or seen.__context__
    match = _STUB.search(str(err))
    return NotImplementedError(match.group(1)) if match else None


def describe(err: BaseException, filenames: set[str], offset: int = 0) -> dict[str, Any]:
    """What the check says about an exception the student's code raised: its type, its message and
    the line of the student's cell that raised it (the deepest frame in one of ``filenames``,
    minus ``offset``, the lines the grader puts before the cell)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename in filenames]
    line = frames[-1].lineno - offset if frames and frames[-1].lineno is not None else None
    if isinstance(err, SyntaxError) and err.filename in filenames and err.lineno is not None:
        line = err.lineno - offset
    return {"type": type(err).__name__, "message": str(err)[:500], "line": line}


def raised(case: str, error: dict[str, Any], hint: str = "") -> CheckFailed:
    """The failing case for an exception the student's code raised (see :func:`describe`)."""
    where = f" (line {error['line']} of your cell)" if error.get("line") else ""
    message = f": {error['message']}" if error.get("message") else ""
    return CheckFailed(f"{case} raised {error['type']}{message}{where}", hint=hint)


class Student:
    """The student's objects as a check sees them (see the module docstring)."""

    def call(self, case: str, name: str, *args: Any, hint: str = "") -> Any:
        """Run driver ``name`` on the student's objects with ``args``; its result, through JSON.

        Raises the exercise's ``NotImplementedError`` if the student's code is unfinished, and
        :class:`CheckFailed` naming ``case`` (and ``hint``) if it raises anything else."""
        raise NotImplementedError

    def timed(self, case: str, name: str, *args: Any) -> tuple[Any, float]:
        """:meth:`call`, and the seconds it took by this side's clock: a student cannot fake them."""
        start = time.perf_counter()
        result = self.call(case, name, *args)
        return result, time.perf_counter() - start


class LocalStudent(Student):
    """The student's objects in this process (a notebook's check cell)."""

    def __init__(self, objects: tuple[Any, ...]) -> None:
        self.objects = objects
        self.state: dict[str, Any] = {}
        self.filenames = {f for obj in objects for f in _source_files(obj)}

    def call(self, case: str, name: str, *args: Any, hint: str = "") -> Any:
        function = find_driver(name)
        try:
            result = function(self.state, self.objects, *json.loads(to_json(list(args))))
        except CheckFailed:
            raise
        except Exception as err:
            stub = unfinished(err)
            if stub is not None:
                raise stub from None
            raise raised(case, describe(err, self.filenames), hint) from err
        return json.loads(to_json(result))


def _source_files(obj: Any) -> set[str]:
    """The files the student's object was written in (a notebook cell's file, in a notebook)."""
    obj = getattr(obj, "fn", obj)  # a Triton kernel wraps its Python function
    if isinstance(obj, type):
        return {f for member in vars(obj).values() for f in _source_files(member) if callable(member)}
    code = getattr(obj, "__code__", None)
    return {code.co_filename} if code is not None else set()
