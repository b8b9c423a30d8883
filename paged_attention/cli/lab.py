"""``python -m paged_attention lab {list, build, grade}``: the course lab from the command line.

* ``list``: the exercises, their notebooks, points and estimated minutes.
* ``build --out DIR [NOTEBOOK ...]``: write the student notebooks (answers removed, outputs cleared).
* ``grade [NOTEBOOK ...] [--exercise ID ...] [--junit FILE]``: grade notebooks (a student's, or the
  instructor's to prove the answers right); exit status 1 unless every exercise passes.

Without notebooks, ``build`` and ``grade`` take the repository's ``notebooks/*.ipynb``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _notebooks(paths: list[str]) -> list[Path]:
    found = [Path(p) for p in paths] if paths else sorted(NOTEBOOKS.glob("*.ipynb"))
    missing = [str(p) for p in found if not p.is_file()]
    if missing:
        raise SystemExit(f"no such notebook: {', '.join(missing)}")
    if not found:
        raise SystemExit(f"no notebooks given and none in {NOTEBOOKS}")
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_attention lab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="the exercises")
    build = sub.add_parser("build", help="write the student notebooks")
    build.add_argument("--out", required=True, help="folder for the student notebooks")
    build.add_argument("notebooks", nargs="*")
    grade = sub.add_parser("grade", help="grade notebooks")
    grade.add_argument("notebooks", nargs="*")
    grade.add_argument("--exercise", action="append", help="grade only this exercise (repeatable)")
    grade.add_argument("--junit", help="also write JUnit XML to this file")
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
    from ..lab.grader import grade_notebook, junit_xml, table

    unknown = sorted(set(opts.exercise or ()) - set(EXERCISES))
    if unknown:
        raise SystemExit(f"--exercise must be one of {sorted(EXERCISES)}, got {unknown}")
    grades = []
    for path in _notebooks(opts.notebooks):
        grades += grade_notebook(path, opts.exercise)
    if not grades:
        raise SystemExit("no exercises found in these notebooks")
    print(table(grades))
    if opts.junit:
        Path(opts.junit).write_text(junit_xml(grades), encoding="utf-8")
    return 0 if all(g.status == "pass" for g in grades) else 1
