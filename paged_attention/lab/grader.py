"""The local grader: each exercise cell's code taken from a student's notebook, run on its own and
checked with more cases than the notebook shows.

A cell is graded in a fresh namespace that holds only its exercise's ``setup`` (imports): so an
exercise cell must define everything its check needs. Grading never runs the rest of the notebook.
"""

from __future__ import annotations

import linecache
import signal
import threading
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .checking import CheckFailed, run
from .notebook import exercise_cells, read
from .registry import EXERCISES, Exercise

STATUSES = ("pass", "fail", "unfinished", "error", "missing")
TIME_LIMIT = 300  # seconds per exercise


@dataclass(frozen=True)
class Grade:
    """The result of one exercise: ``status`` is one of :data:`STATUSES`; ``detail`` the first
    failing case (or the error), empty on a pass."""

    exercise_id: str
    notebook: str
    status: str
    points: int
    earned: int
    detail: str = ""
    cases: int = 0


class _TimeUp(Exception):
    pass


def _alarm(seconds: int) -> bool:
    """Arm a wall-clock limit where signals work (the main thread of a Unix process)."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        return False

    def up(signum: int, frame: object) -> None:
        raise _TimeUp

    signal.signal(signal.SIGALRM, up)
    signal.alarm(seconds)
    return True


def grade_cell(exercise: Exercise, code: str, notebook: str = "") -> Grade:
    """Grade one exercise from the text of its cell (see the module docstring)."""

    def result(status: str, detail: str = "", cases: int = 0) -> Grade:
        earned = exercise.points if status == "pass" else 0
        return Grade(exercise.exercise_id, notebook, status, exercise.points, earned, detail, cases)

    source = exercise.setup + code
    filename = f"<lab {exercise.exercise_id}>"
    # Triton reads a kernel's source through linecache: register the cell's text under its name.
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict = {"__name__": "__lab__"}
    armed = _alarm(TIME_LIMIT)
    try:
        exec(compile(source, filename, "exec"), namespace)  # grading runs the student's code
        missing = [name for name in exercise.names if name not in namespace]
        if missing:
            return result("error", f"the cell defines no {', '.join(missing)}")
        cases = run(exercise.exercise_id, *(namespace[n] for n in exercise.names), thorough=True)
        return result("pass", cases=cases)
    except NotImplementedError as err:
        return result("unfinished", str(err) or "NotImplementedError")
    except CheckFailed as err:
        return result("fail", str(err))
    except _TimeUp:
        return result("error", f"took longer than {TIME_LIMIT} s")
    except Exception as err:  # the student's code may raise anything: report it, go on
        frame = traceback.extract_tb(err.__traceback__)[-1]
        return result(
            "error", f"{type(err).__name__}: {err} (line {frame.lineno} of {Path(frame.filename).name})"
        )
    finally:
        if armed:
            signal.alarm(0)


def grade_notebook(path: str | Path, only: Iterable[str] | None = None) -> list[Grade]:
    """Grade every exercise of a notebook (or those in ``only``); an exercise the registry places in
    this notebook whose cell is gone is graded ``missing``."""
    path = Path(path)
    wanted = set(only) if only is not None else None
    grades, seen = [], set()
    for cell in exercise_cells(read(path)):
        if cell.exercise_id not in EXERCISES:
            raise ValueError(f"{path.name} cell {cell.index}: unknown exercise {cell.exercise_id!r}")
        if wanted is not None and cell.exercise_id not in wanted:
            continue
        seen.add(cell.exercise_id)
        grades.append(grade_cell(EXERCISES[cell.exercise_id], cell.source, path.name))
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
                )
            )
    return grades


def table(grades: list[Grade]) -> str:
    """The grades as a text table, with a total line."""
    rows = [("exercise", "points", "result", "first failing case")]
    rows += [(g.exercise_id, f"{g.earned}/{g.points}", g.status, g.detail[:150]) for g in grades]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [
        "  ".join(cell.ljust(widths[i]) if i < 3 else cell for i, cell in enumerate(r)).rstrip() for r in rows
    ]
    earned, total = sum(g.earned for g in grades), sum(g.points for g in grades)
    passed = sum(g.status == "pass" for g in grades)
    lines.append(f"total: {earned}/{total} points, {passed} of {len(grades)} exercises pass")
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
