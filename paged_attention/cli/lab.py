"""``python -m paged_attention lab {list, build, grade}``: the course lab from the command line.

* ``list``: the exercises, their notebooks, points and estimated minutes.
* ``build --out DIR [NOTEBOOK ...]``: write the student notebooks (answers removed, outputs cleared).
* ``grade [NOTEBOOK ...] [--exercise ID ...] [--junit FILE] [--gradescope FILE] [--seed N]``: grade
  notebooks (JUnit XML for most CIs, Gradescope's ``results.json``); exit
  status 1 unless every exercise passes. Without notebooks it grades the student build
  (``build/student/*.ipynb``, what ``make student`` writes) or refuses, saying what to pass; the
  instructor notebooks (``notebooks/``, answers included) are graded only when named, and then
  the report says so loudly.

Without notebooks, ``build`` takes the repository's ``notebooks/*.ipynb``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
STUDENT_BUILD = Path("build") / "student"


def _notebooks(paths: list[str]) -> list[Path]:
    found = [Path(p) for p in paths] if paths else sorted(NOTEBOOKS.glob("*.ipynb"))
    missing = [str(p) for p in found if not p.is_file()]
    if missing:
        raise SystemExit(f"no such notebook: {', '.join(missing)}")
    if not found:
        raise SystemExit(f"no notebooks given and none in {NOTEBOOKS}")
    return found


INSTRUCTOR_BANNER = (
    "!! These are the INSTRUCTOR notebooks ({names}), answers included: their marks say the answers are\n"
    "!! right, not that a student passed. Grade a student's copy: build/student/ (make student) or theirs."
)


def _student_build() -> list[Path]:
    """The student build's notebooks (``build/student/`` here, or in the repository), or refuse."""
    for folder in (STUDENT_BUILD, ROOT / STUDENT_BUILD):
        found = sorted(folder.glob("*.ipynb"))
        if found:
            return found
    raise SystemExit(
        "lab grade: no notebooks given and no student build in build/student/. Pass the notebooks to grade "
        "(python -m paged_attention lab grade my/*.ipynb), or write the student build first (make student). "
        "The instructor notebooks hold the answers: name them (notebooks/*.ipynb) to check those answers."
    )


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"must be a number of seconds in (0, 1e6), got {text}")
    return value


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_attention lab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="the exercises")
    build = sub.add_parser("build", help="write the student notebooks")
    build.add_argument("--out", required=True, help="folder for the student notebooks")
    build.add_argument("notebooks", nargs="*")
    grade = sub.add_parser(
        "grade",
        help="grade notebooks (default: the student build, build/student/*.ipynb)",
        description="Grade the exercise cells of notebooks, each in a child process, on cases drawn "
        "afresh from a seed. Without NOTEBOOK arguments: the student build in build/student/ "
        "(make student writes it), never the instructor notebooks, which hold the answers.",
    )
    grade.add_argument(
        "notebooks", nargs="*", metavar="NOTEBOOK", help="student notebooks (default: build/student/*.ipynb)"
    )
    grade.add_argument("--exercise", action="append", help="grade only this exercise (repeatable)")
    grade.add_argument("--junit", help="also write JUnit XML to this file")
    grade.add_argument("--gradescope", help="also write Gradescope's results.json to this file")
    grade.add_argument(
        "--seed", type=int, help="draw the cases from this seed (default: a fresh one; the report prints it)"
    )
    grade.add_argument(
        "--time-limit", type=_seconds, default=300.0, help="seconds per exercise (default 300)"
    )
    opts = parser.parse_args(argv)

    from ..lab.registry import EXERCISES

    if opts.action == "list":
        print(f"{'exercise':<22} {'notebook':<36} {'points':>6} {'minutes':>7}  title")
        for e in EXERCISES.values():
            print(f"{e.exercise_id:<22} {e.notebook:<36} {e.points:>6} {e.minutes:>7}  {e.title}")
        return 0
    if opts.action == "build":
        from ..lab.notebook import LabError
        from ..lab.notebook import build as build_notebooks

        try:
            written = build_notebooks(_notebooks(opts.notebooks), Path(opts.out))
        except LabError as err:
            raise SystemExit(f"lab build refused: {err}") from None
        print(f"wrote {len(written)} student notebooks to {opts.out}")
        return 0
    from ..lab.grader import grade_notebook, gradescope_json, junit_xml, table

    unknown = sorted(set(opts.exercise or ()) - set(EXERCISES))
    if unknown:
        raise SystemExit(f"--exercise must be one of {sorted(EXERCISES)}, got {unknown}")
    from ..lab.grader import fresh_seed

    paths = [Path(p) for p in opts.notebooks] or _student_build()
    paths = _notebooks([str(p) for p in paths])
    instructor = [p.name for p in paths if p.resolve().parent == NOTEBOOKS.resolve()]
    if instructor:
        print(INSTRUCTOR_BANNER.format(names=", ".join(instructor)))
    seed = fresh_seed() if opts.seed is None else opts.seed
    grades = []
    for path in paths:
        grades += grade_notebook(path, opts.exercise, seed, opts.time_limit)
    if not grades:
        raise SystemExit("no exercises found in these notebooks")
    print(table(grades))
    if instructor:
        print(INSTRUCTOR_BANNER.format(names=", ".join(instructor)))
    if opts.junit:
        Path(opts.junit).write_text(junit_xml(grades), encoding="utf-8")
    if opts.gradescope:
        Path(opts.gradescope).write_text(gradescope_json(grades), encoding="utf-8")
    return 0 if all(g.status == "pass" for g in grades) else 1
