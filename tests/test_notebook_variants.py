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


def variants() -> list[tuple[str, dict]]:
    everything = os.environ.get("PAGED_ATTENTION_ALL_VARIANTS") == "1"
    return [(path.name, v) for path in NOTEBOOKS for v in listed(json.loads(path.read_text()), everything)]


def names(cell: dict) -> set[str]:
    import ast

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
    source = "\n".join(f"{key} = {value!r}" for key, value in overrides.items())
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell(source))
    resources = {"metadata": {"path": str(path.parent)}}
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources=resources)
    client.execute()  # raises CellExecutionError naming the failing cell and its traceback
