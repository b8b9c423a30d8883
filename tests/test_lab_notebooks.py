"""The lab in the real notebooks: registry, tags and check cells agree; the instructor notebooks'
answers pass the grader; the student build strips every answer, grades as unfinished everywhere,
and still runs top to bottom with no error but the expected ones."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from paged_attention.lab import EXERCISES
from paged_attention.lab.grader import grade_notebook
from paged_attention.lab.notebook import CHECK_CALL, build, exercise_cells, read, source

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
WITH_EXERCISES = sorted({ROOT / "notebooks" / e.notebook for e in EXERCISES.values()})


def test_registry_tags_and_check_cells_agree() -> None:
    tagged: dict[str, list[str]] = {}
    checked: dict[str, list[str]] = {}
    for path in NOTEBOOKS:
        nb = read(path)
        cells = exercise_cells(nb)
        for cell in cells:
            tagged.setdefault(cell.exercise_id, []).append(path.name)
            later = [source(c) for c in nb["cells"][cell.index + 1 :] if c["cell_type"] == "code"]
            calls = [m for text in later for m in CHECK_CALL.findall(text)]
            assert cell.exercise_id in calls, (
                f"{path.name}: no check({cell.exercise_id!r}, ...) after its cell"
            )
        for c in nb["cells"]:
            for called in CHECK_CALL.findall(source(c)) if c["cell_type"] == "code" else []:
                checked.setdefault(called, []).append(path.name)
    assert set(tagged) == set(EXERCISES), "every exercise has a tagged cell, every tag an exercise"
    for exercise_id, exercise in EXERCISES.items():
        assert tagged[exercise_id] == [exercise.notebook], (exercise_id, tagged[exercise_id])
        assert checked[exercise_id] == [exercise.notebook], (exercise_id, checked.get(exercise_id))


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.name)
def test_the_instructor_answers_pass_the_grader(path: Path) -> None:
    grades = grade_notebook(path)
    report = [(g.exercise_id, g.status, g.detail) for g in grades]
    assert grades and all(g.status == "pass" for g in grades), report


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("student")
    build(NOTEBOOKS, out)
    return out


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.name)
def test_every_student_exercise_is_unfinished(student: Path, path: Path) -> None:
    grades = grade_notebook(student / path.name)
    report = [(g.exercise_id, g.status) for g in grades]
    assert grades and all(g.status == "unfinished" for g in grades), report
    for grade in grades:
        assert grade.detail.startswith(f"Exercise {grade.exercise_id}: ")


def student_run_overrides(nb: dict) -> dict:
    """The parameters a student copy runs with below: the notebook's own, or, for a notebook whose
    full run is long, the variant its metadata names as ``student_run`` (one of its listed
    ``variants`` or ``more_variants``, which tests/test_notebook_variants.py can run on the
    instructor copy). Whether a cell outside the exercise and check cells uses what an exercise
    defines does not depend on the parameters, and the default parameters run under nbval on the
    instructor copy."""
    meta = nb["metadata"].get("paged_attention", {})
    overrides = meta.get("student_run", {})
    listed = meta.get("variants", []) + meta.get("more_variants", [])
    assert not overrides or overrides in listed, "student_run must be a listed variant"
    return overrides


def may_fail(cell: dict) -> bool:
    """An exercise or check cell of a student copy (tagged ``raises-exception``)."""
    return "raises-exception" in cell.get("metadata", {}).get("tags", [])


def exercise_names(cells: list[dict]) -> set[str]:
    """The names the exercise and check cells of a notebook bind at their top level (functions,
    classes, assignments): what a student's unfinished work leaves undefined or raising."""
    import ast

    bound: set[str] = set()
    for cell in filter(may_fail, cells):
        for node in ast.parse(source(cell)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            bound |= {t.id for t in targets if isinstance(t, ast.Name)}
    return bound


def loaded_names(text: str) -> set[str]:
    """Every name a cell reads (top-level ``await`` allowed, as in a notebook)."""
    import ast

    try:
        tree = ast.parse(text)
    except SyntaxError:  # top-level await: parse the cell as a coroutine's body
        tree = ast.parse("async def _cell():\n" + "\n".join("    " + line for line in text.splitlines()))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.name)
def test_no_other_cell_reads_what_an_exercise_defines(student: Path, path: Path) -> None:
    """The cells around the exercises use the package's implementation, never the student's (a
    notebook says so where it switches: "the cells from here on use the package's ..."), so an
    unfinished exercise fails only its own cell and its check."""
    cells = json.loads((student / path.name).read_text())["cells"]
    bound = exercise_names(cells)
    assert bound, f"{path.name}: its exercise cells define nothing"
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "code" and not may_fail(cell):
            used = loaded_names(source(cell)) & bound
            assert not used, (
                f"{path.name} cell {index} reads {sorted(used)}, which a student's exercise defines"
            )


@pytest.fixture(scope="module")
def kernel() -> Iterator[dict]:
    """The kernel the student runs share (``{"owner": client}`` once one has started it), shut down
    after the last. Each run starts with ``%reset -f``: a notebook sees none of the names an earlier
    one defined, only the modules it imported (already loaded: starting a kernel and importing the
    package and transformers cost 5-7 s a notebook). The process's other state carries over
    (environment variables, torch's threads and random state, Triton's mode): what a fresh kernel
    alone would catch, such as notebook 03's import order, nbval catches on the instructor copies.
    A run that raises shuts the kernel down, so the next starts a fresh one."""
    shared: dict = {}
    yield shared
    if shared.get("owner") is not None:
        shared["owner"]._cleanup_kernel()


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.name)
def test_the_student_notebook_runs_top_to_bottom(student: Path, path: Path, kernel: dict) -> None:
    """Only the exercise and check cells (tagged ``raises-exception``) may fail; every other cell
    must run, so a student can "Run All" before finishing anything.

    The run stops after the last exercise or check cell: no later cell reads what an exercise
    defines (:func:`test_no_other_cell_reads_what_an_exercise_defines`), so the rest runs as in
    the instructor copy, which nbval runs whole, each notebook in a fresh kernel (these runs share
    one: :func:`kernel`). The kernel runs torch on one thread: this run checks that cells run, not
    how fast, and on a two-core machine beside another busy process two OpenMP threads spin-wait
    (DESIGN.md); 08's student run took 272 s so and 47 s on one thread, on the same loaded machine."""
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.read(student / path.name, as_version=4)
    allowed = [
        i for i, c in enumerate(nb.cells) if "raises-exception" in c.get("metadata", {}).get("tags", [])
    ]
    nb.cells = nb.cells[: max(allowed) + 1]
    overrides = student_run_overrides(nb)
    if overrides:
        index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        source_text = "\n".join(f"{key} = {value!r}" for key, value in overrides.items())
        nb.cells.insert(index + 1, nbformat.v4.new_code_cell(source_text))
    nb.cells.insert(0, nbformat.v4.new_code_cell("%reset -f"))  # nothing of the notebook before
    resources = {"metadata": {"path": str(path.parent)}}
    owner = kernel.get("owner")
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources=resources, km=owner and owner.km,
        shutdown_kernel="immediate",
    )  # fmt: skip
    client.kc = owner and owner.kc
    try:
        client.execute(cleanup_kc=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except BaseException:
        (owner or client)._cleanup_kernel()
        kernel.pop("owner", None)
        raise
    kernel.setdefault("owner", client)
    cells = list(enumerate(nb.cells))
    failed = {
        source(c) for i, c in cells if any(o.get("output_type") == "error" for o in c.get("outputs", []))
    }
    allowed_sources = {
        source(c) for c in nb.cells if "raises-exception" in c.get("metadata", {}).get("tags", [])
    }
    assert failed <= allowed_sources, sorted(failed - allowed_sources)
    assert json.dumps(nb)  # still a valid notebook


def test_the_teaching_guide_lists_every_exercise() -> None:
    guide = (ROOT / "notebooks" / "TEACHING.md").read_text()
    for exercise_id, exercise in EXERCISES.items():
        row = next((line for line in guide.splitlines() if line.startswith(f"| `{exercise_id}` |")), None)
        assert row is not None, f"TEACHING.md has no row for {exercise_id}"
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == exercise.notebook[:2], row
        assert cells[3:] == [str(exercise.minutes), str(exercise.points)], row


def test_the_teaching_guide_quotes_what_students_see() -> None:
    """The pass line TEACHING.md quotes is in notebook 02's stored output, and its example failure
    is what the notebook's check raises for slot_mapping that ignores the page table."""
    from paged_attention.lab.checking import CheckFailed, run
    from tests.lab_answers.memory import slot_mapping_logical

    guide = (ROOT / "notebooks" / "TEACHING.md").read_text()
    nb = read(ROOT / "notebooks" / "02_allocator_and_page_table.ipynb")
    printed = "".join(
        "".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]
    )
    pass_line = re.search(r"`(✓ [^`]+)`", guide).group(1)
    assert pass_line in printed, (pass_line, "not in notebook 02's outputs")
    with pytest.raises(CheckFailed) as failure:
        run("02.slot_mapping", slot_mapping_logical)
    assert f"CheckFailed: {failure.value}" in guide
