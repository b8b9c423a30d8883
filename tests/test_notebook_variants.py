"""The notebooks survive a student's edit: each one's ``parameters`` cell, overridden with every
variant its metadata lists, runs to the end, every check included.

A notebook declares its knobs in one code cell tagged ``parameters`` (papermill's convention):
plain ``NAME = value`` assignments that every later cell derives its numbers, titles and checks
from. Its metadata lists the variants a student might try::

    "metadata": {"paged_attention": {"variants": [{"BLOCK_SIZE": 3}, {"NUM_BLOCKS": 32}]}}

Each variant runs the notebook from the top with a cell after ``parameters`` that assigns the
overrides. ``more_variants`` lists further ones, run when ``PAGED_ATTENTION_ALL_VARIANTS=1`` (they
keep ``make test`` within its time on two cores). Prose cannot be executed, so the rule for prose
is the notebook's own: a sentence whose number depends on a parameter prints it from code instead
of typing it.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def parameters_cell(cells: list[dict]) -> int | None:
    tagged = [i for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) <= 1, "at most one cell tagged 'parameters'"
    return tagged[0] if tagged else None


def listed(nb: dict, everything: bool) -> list[dict]:
    meta = nb["metadata"].get("paged_attention", {})
    return meta.get("variants", []) + (meta.get("more_variants", []) if everything else [])


def _stored(node: ast.AST) -> set[str]:
    out = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    defined = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return out | {n.name for n in ast.walk(node) if isinstance(n, defined)}


def _loaded(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _reads(stmt: ast.stmt) -> set[str]:
    """The names a statement reads from before it: an assignment's right-hand side (and its
    targets' subscripts); a compound statement's names less those it binds itself (loop variables)."""
    if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        read = _loaded(stmt.value) if stmt.value is not None else set()
        read |= set().union(*(_loaded(t) for t in targets))
        if isinstance(stmt, ast.AugAssign):
            read |= _stored(stmt.target)
        return read
    return _loaded(stmt) - _stored(stmt)


def parameter_reach(cells: list[dict]) -> int:
    """How many cells a variant must run: up to the last code cell that reads a parameter or
    something computed from one. Statement by statement: a statement that reads such a name makes
    what it assigns, and every object it touches (a call may change one), computed from one; a
    statement that reads none makes what it assigns clean again. Imports and builtins are never
    computed from a parameter. The cells after the reach run as in the notebook's own run (nbval
    runs that one), whatever the parameters."""
    index = parameters_cell(cells)
    computed = names(cells[index])
    exempt = set(dir(builtins))
    for cell in cells:
        if cell["cell_type"] == "code":
            for node in ast.walk(ast.parse("".join(cell["source"]))):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    exempt |= {(a.asname or a.name).split(".")[0] for a in node.names}
    last = index
    for i, cell in enumerate(cells[index + 1 :], start=index + 1):
        if cell["cell_type"] != "code":
            continue
        for stmt in ast.parse("".join(cell["source"])).body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                continue
            if _reads(stmt) & computed:
                computed |= _stored(stmt) | (_loaded(stmt) - exempt)
                last = i
            else:
                computed -= _stored(stmt)
    return last + 1


def variants() -> list[tuple[str, dict]]:
    everything = os.environ.get("PAGED_ATTENTION_ALL_VARIANTS") == "1"
    return [(path.name, v) for path in NOTEBOOKS for v in listed(json.loads(path.read_text()), everything)]


def names(cell: dict) -> set[str]:
    tree = ast.parse("".join(cell["source"]))
    targets = [t for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
    targets += [node.target for node in tree.body if isinstance(node, ast.AnnAssign)]
    return {t.id for t in targets if isinstance(t, ast.Name)}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_variants_name_real_parameters(path: Path) -> None:
    nb = json.loads(path.read_text())
    every = listed(nb, everything=True)
    index = parameters_cell(nb["cells"])
    if index is None:
        assert not every, "variants listed but no cell is tagged 'parameters'"
        return
    known = names(nb["cells"][index])
    for variant in every:
        unknown = sorted(set(variant) - known)
        assert not unknown, f"{unknown} are not assigned in the parameters cell"


@pytest.mark.parametrize("name, overrides", variants(), ids=[f"{n[:2]}-{v}" for n, v in variants()])
def test_notebook_runs_with_changed_parameters(
    name: str, overrides: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One torch thread in the kernel (it inherits the variable): these runs check that every cell
    # still holds, not speed, and two OpenMP threads beside any other busy process run 10-30x slower.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    path = ROOT / "notebooks" / name
    nb = nbformat.read(path, as_version=4)
    index = parameters_cell(nb.cells)
    nb.cells = nb.cells[: parameter_reach(nb.cells)]  # the rest does not depend on the parameters
    source = "\n".join(f"{key} = {value!r}" for key, value in overrides.items())
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell(source))
    resources = {"metadata": {"path": str(path.parent)}}
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources=resources)
    client.execute()  # raises CellExecutionError naming the failing cell and its traceback


def _cells(*sources: str, parameters: int = 0) -> list[dict]:
    cells = [{"cell_type": "code", "source": [src], "metadata": {}} for src in sources]
    cells[parameters]["metadata"]["tags"] = ["parameters"]
    return cells


@pytest.mark.parametrize(
    "sources, reach",
    [
        (["N = 3", "x = N * 2", "print(x)", "y = 1"], 3),  # through an assignment
        (["N = 3", "items = []", "items.append(N)", "print(len(items))"], 4),  # a call changed items
        (["N = 3", "x = N", "x = 5", "print(x)"], 2),  # x made anew from nothing computed
        (["N = 3", "for x in range(2):\n    pass", "print(x)"], 1),  # a loop variable is its own
        (["N = 3", "def f():\n    return N", "import math", "print(math.pi, f())"], 4),  # via a function
        (["N = 3", "print(N)", "z = sum([1, 2])"], 2),  # builtins are not computed from N
    ],
)
def test_parameter_reach_follows_what_is_computed_from_a_parameter(sources: list[str], reach: int) -> None:
    assert parameter_reach(_cells(*sources)) == reach
