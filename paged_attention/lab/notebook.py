"""Exercise cells in notebooks: finding them, and turning an instructor notebook into a student one.

An exercise is a code cell tagged ``lab:<id>`` (e.g. ``lab:02.free_queue``) whose answer lies
between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` lines. The student build replaces each
region by ``raise NotImplementedError("Exercise <id>: <task>")`` at the region's indentation and
keeps everything around it (signatures, docstrings, hints); it clears every output and tags the
exercise and check cells ``raises-exception``, so "Run All" goes on past an unfinished exercise.

It refuses a notebook whose regions are unbalanced or nested, a tagged cell without a region (or a
region in an untagged cell), an exercise the registry does not know, and any answer line that would
survive elsewhere in the student copy.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path

from .registry import EXERCISES

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
TAG_PREFIX = "lab:"
CHECK_CALL = re.compile(r"^\s*check\(\s*[\"']([\w.]+)[\"']", re.MULTILINE)
# Answer lines shorter than this (``return out``, ``i += 1``) may well appear elsewhere on their own.
MIN_ANSWER_LINE = 16


class LabError(ValueError):
    """A notebook that cannot be built into a student copy (names the notebook, cell and reason)."""


@dataclass(frozen=True)
class ExerciseCell:
    """One exercise cell of a notebook: its id, the cell's index and its source."""

    exercise_id: str
    index: int
    source: str


def read(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write(nb: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def source(cell: dict) -> str:
    text = cell.get("source", "")
    return text if isinstance(text, str) else "".join(text)


def tags(cell: dict) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def exercise_id(cell: dict) -> str | None:
    """The exercise a cell holds (its ``lab:<id>`` tag), or None."""
    found = [t[len(TAG_PREFIX) :] for t in tags(cell) if t.startswith(TAG_PREFIX)]
    if len(found) > 1:
        raise LabError(f"a cell has two exercise tags: {found}")
    return found[0] if found else None


def exercise_cells(nb: dict) -> list[ExerciseCell]:
    """The exercise cells of a notebook, in order."""
    return [
        ExerciseCell(ex, i, source(c))
        for i, c in enumerate(nb["cells"])
        if c["cell_type"] == "code" and (ex := exercise_id(c)) is not None
    ]


def regions(text: str, where: str) -> list[tuple[int, int]]:
    """``(begin_line, end_line)`` index pairs of the solution regions of ``text``; balanced, flat."""
    found, start = [], None
    for number, line in enumerate(text.split("\n")):
        marker = line.strip()
        if marker == BEGIN:
            if start is not None:
                raise LabError(f"{where}: nested {BEGIN!r} at line {number + 1}")
            start = number
        elif marker == END:
            if start is None:
                raise LabError(f"{where}: {END!r} without {BEGIN!r} at line {number + 1}")
            found.append((start, number))
            start = None
    if start is not None:
        raise LabError(f"{where}: {BEGIN!r} at line {start + 1} is never ended")
    return found


def strip_solutions(text: str, exercise: str, where: str) -> tuple[str, list[str]]:
    """The student's version of ``text`` and the answer lines it took out."""
    lines = text.split("\n")
    task = EXERCISES[exercise].task.replace('"', "'")
    out, answers, last = [], [], 0
    for begin, end in regions(text, where):
        indent = re.match(r"\s*", lines[begin]).group(0)
        out += lines[last:begin]
        out.append(f'{indent}raise NotImplementedError("Exercise {exercise}: {task}")')
        answers += [line.strip() for line in lines[begin + 1 : end] if line.strip()]
        last = end + 1
    out += lines[last:]
    return "\n".join(out), answers


def student_notebook(nb: dict, name: str) -> dict:
    """The student copy of an instructor notebook (see the module docstring)."""
    nb = copy.deepcopy(nb)
    answers: list[tuple[str, str]] = []
    for index, cell in enumerate(nb["cells"]):
        where = f"{name} cell {index}"
        text = source(cell)
        cell_tags = tags(cell)
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
            ex = exercise_id(cell)
            found = regions(text, where)
            if ex is None and found:
                raise LabError(f"{where}: a solution region in a cell without a 'lab:<id>' tag")
            if ex is not None:
                if ex not in EXERCISES:
                    raise LabError(f"{where}: unknown exercise {ex!r} (not in paged_attention.lab.EXERCISES)")
                if not found:
                    raise LabError(f"{where}: exercise {ex!r} has no {BEGIN!r} region")
                text, taken = strip_solutions(text, ex, where)
                answers += [(line, ex) for line in taken if len(line) >= MIN_ANSWER_LINE]
                cell["source"] = text
            if (ex is not None or CHECK_CALL.search(text)) and "raises-exception" not in cell_tags:
                cell.setdefault("metadata", {})["tags"] = [*cell_tags, "raises-exception"]
        elif regions(text, where):
            raise LabError(f"{where}: a solution region outside a code cell")
    everything = "\n".join(source(c) for c in nb["cells"])
    for line, ex in answers:
        if line in everything:
            raise LabError(f"{name}: the answer of {ex} would survive in the student copy: {line!r}")
    return nb


def build(notebooks: list[Path], out_dir: Path) -> list[Path]:
    """Write the student copy of each notebook into ``out_dir``; returns the files written.

    Every notebook is checked before anything is written, so a refused build leaves no half copy."""
    built = [(path.name, student_notebook(read(path), path.name)) for path in notebooks]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, nb in built:
        write(nb, out_dir / name)
        written.append(out_dir / name)
    return written
