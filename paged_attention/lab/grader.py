"""The local grader: each exercise cell's code taken from a student's notebook, run on its own in a
child process (:mod:`.sandbox`), and checked with more cases than the notebook shows, drawn afresh
from a seed on every run.

A cell is graded in a fresh interpreter whose namespace holds only its exercise's ``setup``
(imports): so an exercise cell must define everything its check needs. Grading never runs the rest
of the notebook, and never runs the student's code in the grader's own process: the verdict comes
from comparing what the child reports with the package's own code, here.

Statuses (:data:`STATUSES`): ``pass``; ``fail`` (a wrong answer, or an exception in the student's
code, naming the case); ``unfinished`` (the exercise's ``NotImplementedError``); ``error`` (the cell
cannot be graded: it raises while loading, lacks a name, uses the package's own implementation of
the exercise, or ends its process); ``timeout`` and ``memory`` (past a limit); ``missing`` (no cell).
"""

from __future__ import annotations

import ast
import json
import secrets
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .checking import CheckFailed, checker
from .notebook import exercise_cells, read
from .registry import EXERCISES, Exercise
from .sandbox import MEMORY_LIMIT, TIME_LIMIT, CellError, ChildStudent, LimitExceeded, undumpable

STATUSES = ("pass", "fail", "unfinished", "error", "timeout", "memory", "missing")


@dataclass(frozen=True)
class Grade:
    """The result of one exercise: ``status`` is one of :data:`STATUSES`; ``detail`` the first
    failing case (or the error), empty on a pass; ``seed`` the seed its cases were drawn from."""

    exercise_id: str
    notebook: str
    status: str
    points: int
    earned: int
    detail: str = ""
    cases: int = 0
    seed: int = 0


def fresh_seed() -> int:
    """A seed for one grading run: the cases differ from run to run, so none can be hard-coded."""
    return secrets.randbelow(2**31)


# The screen: what a cell may import, and what it may not name. An allow list, because Python has
# many back doors: a cell needs the standard library's arithmetic and containers, torch and Triton,
# and the few package types its exercise works with; nothing that loads, inspects or starts code.
NOT_RUN = "the grader does not run such cells"
STANDARD_MODULES = frozenset(
    {
        "__future__",
        "abc",
        "bisect",
        "collections",
        "collections.abc",
        "dataclasses",
        "decimal",
        "enum",
        "fractions",
        "functools",
        "heapq",
        "itertools",
        "math",
        "numbers",
        "numpy",
        "random",
        "statistics",
        "time",
        "torch",
        "triton",
        "triton.language",
        "typing",
    }
)
PACKAGE_NAMES = {
    "paged_attention.memory.allocator": {"KVCacheBlock", "BlockAllocator", "NoFreeBlocksError"},
    "paged_attention.memory.manager": {"KVCacheManager"},
    "paged_attention.memory.paged_manager": {"PagedKVCacheManager"},
    "paged_attention.memory.prefix_cache": {"hash_block_tokens"},
    "paged_attention.engine.sequence": {"Sequence", "SequenceStatus"},
    "paged_attention.engine.core.scheduler": {"SchedulingPolicy"},
    "paged_attention.engine.core.policy": {"SchedulingPolicy"},
}
OFF_LIMITS_NAMES = frozenset(
    {
        "__import__",
        "exec",
        "eval",
        "compile",
        "globals",
        "locals",
        "vars",
        "dir",
        "getattr",
        "setattr",
        "delattr",
        "open",
        "breakpoint",
        "input",
        "__builtins__",
        "__loader__",
        "__spec__",
    }
)
DUNDERS_ALLOWED = frozenset(
    {
        "__init__",
        "__name__",
        "__len__",
        "__iter__",
        "__next__",
        "__repr__",
        "__str__",
        "__eq__",
        "__lt__",
        "__le__",
        "__gt__",
        "__ge__",
        "__hash__",
        "__contains__",
        "__getitem__",
        "__setitem__",
    }
)


def screen(exercise: Exercise, code: str) -> str:
    """Why the cell is not graded, or ``""``, read from its text (nothing of it runs here).

    What is refused is what code *does*, never what it is called: an import outside
    :data:`STANDARD_MODULES` and :data:`PACKAGE_NAMES`; a builtin of :data:`OFF_LIMITS_NAMES`; a dunder
    attribute (but the usual methods); importing the package's own implementation of the exercise
    (one of ``exercise.references``) or reading it, or a private attribute, from an object the cell
    did not make (``cache_manager.can_admit``, ``allocator.FreeBlockQueue``); or one of the methods
    the student writes read from anything but ``self`` (``super().admits``). Local names,
    parameters, comments, docstrings and the student's own attributes (``self.x = ...``, ``def x``)
    may use any word, the package's included."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return ""  # the child reports it, with its line
    own = _own_attributes(tree)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        why = _screen_node(exercise, node, own)
        if why:
            return f"line {line} {why}"
    return ""


def _own_attributes(tree: ast.AST) -> set[str]:
    """The attribute names the cell makes itself: its functions, methods and classes, and what it
    assigns to ``self`` (an assignment to another object's attribute makes nothing of its own)."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
            own.add(node.attr)
    return own


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id == "self"


def _screen_node(exercise: Exercise, node: ast.AST, own: set[str]) -> str:
    references = exercise.references
    implementation = "the package's own implementation of this exercise: write it yourself"
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name not in STANDARD_MODULES and alias.name not in PACKAGE_NAMES:
                return f"imports {alias.name}, which no exercise needs: {NOT_RUN}"
    elif isinstance(node, ast.ImportFrom):
        module = node.module or ""
        if module in PACKAGE_NAMES:
            extra = [a.name for a in node.names if a.name not in PACKAGE_NAMES[module]]
            if extra:
                return f"imports {', '.join(extra)} from {module}, which no exercise needs: {NOT_RUN}"
            taken = [a.name for a in node.names if a.name in references]
            if taken:
                return f"imports {taken[0]}, {implementation}"
        elif module not in STANDARD_MODULES or node.level:
            return f"imports from {module or '.'}, which no exercise needs: {NOT_RUN}"
    elif isinstance(node, ast.Name):
        if node.id in OFF_LIMITS_NAMES:
            return f"uses {node.id}, which no exercise needs: {NOT_RUN}"
    elif isinstance(node, ast.Attribute):
        on_self = _on_self(node)
        mine = on_self or node.attr in own
        if node.attr.startswith("__") and node.attr.endswith("__") and node.attr not in DUNDERS_ALLOWED:
            return f"reads .{node.attr}, which no exercise needs: {NOT_RUN}"
        if node.attr.startswith("_") and not node.attr.startswith("__") and not mine:
            return f"reads .{node.attr}, a private part of another object: {NOT_RUN}"
        if node.attr in references and not mine:
            return f"uses .{node.attr} of an object it did not make, {implementation}"
        if node.attr in exercise.names_overridden and not on_self:
            return (
                f"reads .{node.attr} of something else than self, the package's own rule: write it yourself"
            )
    return ""


def grade_cell(
    exercise: Exercise,
    code: str,
    notebook: str = "",
    seed: int | None = None,
    time_limit: float = TIME_LIMIT,
    memory_limit: int = MEMORY_LIMIT,
    thorough: bool = True,
) -> Grade:
    """Grade one exercise from the text of its cell (see the module docstring); ``seed`` None draws
    a fresh one; ``thorough=False`` runs the notebook's own number of cases (tests of the grader's
    plumbing), not the grader's."""
    seed = fresh_seed() if seed is None else seed

    def result(status: str, detail: str = "", cases: int = 0) -> Grade:
        earned = exercise.points if status == "pass" else 0
        return Grade(exercise.exercise_id, notebook, status, exercise.points, earned, detail, cases, seed)

    refusal = screen(exercise, code)
    if refusal:
        return result("error", refusal)
    check = checker(exercise.exercise_id)
    try:
        with undumpable(), ChildStudent(exercise, code, time_limit, memory_limit) as student:
            cases = check(student, seed=seed, thorough=thorough)
        return result("pass", cases=cases)
    except NotImplementedError as err:
        return result("unfinished", str(err) or "NotImplementedError")
    except CheckFailed as err:
        return result("fail", str(err))
    except LimitExceeded as err:
        return result(err.kind, str(err))
    except CellError as err:
        return result("error", str(err))
    except Exception as err:
        # an answer of the cell's process the check could not read (its drivers were changed), or a
        # bug in the check itself: either way no points, and the whole message
        return result(
            "error",
            f"grading stopped: {type(err).__name__}: {err} (an answer from the cell's process that the check "
            "could not read, or a bug in the check: please report it)",
        )


def grade_notebook(
    path: str | Path,
    only: Iterable[str] | None = None,
    seed: int | None = None,
    time_limit: float = TIME_LIMIT,
) -> list[Grade]:
    """Grade every exercise of a notebook (or those in ``only``), all from one seed (None: a fresh
    one); an exercise the registry places in this notebook whose cell is gone is graded ``missing``."""
    path = Path(path)
    seed = fresh_seed() if seed is None else seed
    wanted = set(only) if only is not None else None
    grades, seen = [], set()
    for cell in exercise_cells(read(path)):
        if cell.exercise_id not in EXERCISES:
            raise ValueError(f"{path.name} cell {cell.index}: unknown exercise {cell.exercise_id!r}")
        if wanted is not None and cell.exercise_id not in wanted:
            continue
        seen.add(cell.exercise_id)
        grades.append(grade_cell(EXERCISES[cell.exercise_id], cell.source, path.name, seed, time_limit))
    for exercise in EXERCISES.values():
        unseen = exercise.notebook == path.name and exercise.exercise_id not in seen
        if unseen and (wanted is None or exercise.exercise_id in wanted):
            grades.append(
                Grade(
                    exercise.exercise_id,
                    path.name,
                    "missing",
                    exercise.points,
                    0,
                    f"no cell tagged 'lab:{exercise.exercise_id}'",
                    seed=seed,
                )
            )
    return grades


def table(grades: list[Grade]) -> str:
    """The grades as a text table, a total line, the seed, and each failing case in full below."""
    rows = [("exercise", "points", "result")]
    rows += [(g.exercise_id, f"{g.earned}/{g.points}", g.status) for g in grades]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in rows]
    earned, total = sum(g.earned for g in grades), sum(g.points for g in grades)
    passed = sum(g.status == "pass" for g in grades)
    lines.append(f"total: {earned}/{total} points, {passed} of {len(grades)} exercises pass")
    seeds = sorted({g.seed for g in grades if g.status != "missing"})
    if len(seeds) == 1:
        lines.append(f"cases drawn from seed {seeds[0]} (--seed {seeds[0]} draws the same ones again)")
    for g in grades:
        if g.detail:
            lines.append("")
            lines.append(f"{g.exercise_id} ({g.status}):")
            lines += textwrap.wrap(g.detail, 100, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)


def junit_xml(grades: list[Grade]) -> str:
    """JUnit XML, one test case per exercise, for autograders (GitHub Classroom, GitLab, Jenkins)."""
    failures = sum(g.status != "pass" for g in grades)
    suite = ET.Element(
        "testsuite", name="paged-attention lab", tests=str(len(grades)), failures=str(failures)
    )
    for g in grades:
        case = ET.SubElement(
            suite, "testcase", classname=g.notebook.removesuffix(".ipynb"), name=g.exercise_id
        )
        ET.SubElement(case, "properties")
        if g.status != "pass":
            failure = ET.SubElement(case, "failure", message=f"{g.status}: {g.detail[:200]}", type=g.status)
            failure.text = g.detail
    return ET.tostring(suite, encoding="unicode")


def gradescope_json(grades: list[Grade]) -> str:
    """Gradescope's autograder results (``/autograder/results/results.json``): one test per
    exercise with its score, the total, and each failing case whole as the test's output."""
    tests = [
        {
            "name": f"{g.exercise_id} ({EXERCISES[g.exercise_id].title})"
            if g.exercise_id in EXERCISES
            else g.exercise_id,
            "score": g.earned,
            "max_score": g.points,
            "status": "passed" if g.status == "pass" else "failed",
            "output": f"{g.status}: {g.detail}" if g.detail else g.status,
        }
        for g in grades
    ]
    seeds = sorted({g.seed for g in grades})
    payload = {
        "score": sum(g.earned for g in grades),
        "output": f"cases drawn from seed {', '.join(map(str, seeds))}",
        "tests": tests,
    }
    return json.dumps(payload, indent=1)
