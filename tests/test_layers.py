"""The folders are the layers: an AST walk of every import keeps the dependency rule true.

    kernels   memory   models          (import nothing of the package but the shared helpers)
        ^        ^       ^
        +------ engine --+  <- serving, baselines <- experiments <- viz, lab <- cli

``kernels`` knows only tensors, ``memory`` only bookkeeping (not even torch), ``models`` only where
weights come from; ``engine`` serves with the three and never imports the apparatus around it
(baselines, experiments, pictures, commands). Two private helper modules at the top (``_checks``,
``_triton_env``) may be imported by anyone. The notebooks import the core, ``experiments`` and
``viz`` (and ``lab`` for their checks), never ``cli``.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "paged_attention"
SHARED = {"_checks", "_triton_env", "__version__"}  # and the package's version string
CORE = {"engine", "memory", "kernels", "models"}
ALLOWED = {
    "kernels": {"kernels"},
    "memory": {"memory"},
    "models": {"models"},
    "engine": CORE,
    "serving": {"serving", *CORE},
    "baselines": {"baselines", *CORE},
    "experiments": {"experiments", "baselines", "serving", *CORE},
    "viz": {"viz", "experiments", "baselines", "serving", *CORE},
    "lab": {"lab", "experiments", "baselines", "serving", *CORE},
    "cli": {"cli", "lab", "viz", "experiments", "baselines", "serving", *CORE},
}
NOTEBOOK_ALLOWED = {"lab", "viz", "experiments", "baselines", "serving", *CORE}


def package_imports(source: str, path: Path) -> set[str]:
    """The top-level package folders (``memory``, ``engine``, ...) that ``source``, the text of the
    module at ``path``, imports, anywhere in it (function bodies included)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [target] if node.module else [[*target, a.name] for a in node.names]
            elif node.module == "paged_attention":  # a layer by name, or the engine's public API
                names = [["paged_attention", a.name if a.name in ALLOWED else "engine"] for a in node.names]
            elif node.module and node.module.split(".")[0] == "paged_attention":
                names = [node.module.split(".")]
            else:
                continue
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names if a.name.split(".")[0] == "paged_attention"]
        else:
            continue
        for parts in names:
            if len(parts) > 1:
                found.add(parts[1])
    return found


def layer_of(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if layer_of(p) in ALLOWED)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_layers(path: Path) -> None:
    layer = layer_of(path)
    bad = package_imports(path.read_text(), path) - ALLOWED[layer] - SHARED
    assert not bad, f"{path.relative_to(PACKAGE)} ({layer}) imports {sorted(bad)}: see the rule above"


def test_memory_is_bookkeeping_only() -> None:
    """No tensors in ``memory``: not torch, not numpy, nothing that computes on K/V."""
    for path in sorted((PACKAGE / "memory").glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
        assert not imported & {"torch", "numpy", "triton"}, f"memory/{path.name} imports tensors"


def test_memory_runs_without_torch() -> None:
    """Not only its own files: importing every memory module, with the shared helpers they import,
    loads no torch (the lab's grader starts its children for the bookkeeping exercises on it)."""
    import os
    import subprocess
    import sys

    modules = [f"paged_attention.memory.{p.stem}" for p in sorted((PACKAGE / "memory").glob("*.py"))]
    code = f"import sys\nfor m in {modules!r}:\n    __import__(m)\nprint('torch' in sys.modules)"
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # as a grader's child gets it
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_every_module_lives_in_a_layer() -> None:
    top = {p.name for p in PACKAGE.iterdir() if p.suffix == ".py"}
    assert top == {"__init__.py", "__main__.py", "_checks.py", "_triton_env.py"}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(ALLOWED)


def test_the_rule_catches_a_core_module_importing_the_apparatus() -> None:
    probe = PACKAGE / "engine" / "probe.py"  # a module that does not exist: only its text is parsed
    source = (
        "from ..baselines import contiguous\nfrom paged_attention.viz import save\nfrom . import models\n"
    )
    found = package_imports(source, probe)
    assert found == {"baselines", "viz", "engine"}
    assert found - ALLOWED["engine"] - SHARED == {"baselines", "viz"}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_reads_in_one_sitting(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 400, "split it: one concept per module"


def test_no_core_module_asks_which_cache_manager_it_has() -> None:
    managers = ("PagedKVCacheManager", "ContiguousKVCacheManager")
    for path in SOURCES:
        if layer_of(path) in ("memory", "engine"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                    named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                    assert not named & set(managers), f"{path.name} asks which manager it has"


def private_names(source: str) -> set[str]:
    """``obj._name`` attributes and ``_name`` imports a piece of code reaches for (dunders excepted)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = [node.attr] if isinstance(node, ast.Attribute) else []
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
        found |= {n for n in names if n.startswith("_") and not n.startswith("__")}
    return found


NOTEBOOKS = sorted((PACKAGE.parent / "notebooks").glob("*.ipynb"))


def notebook_code(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_import_the_core_experiments_and_viz_never_the_cli(path: Path) -> None:
    probe = PACKAGE / "notebook.py"  # absolute imports only: where the probe sits does not matter
    found = package_imports(notebook_code(path), probe)
    assert found, "a notebook that imports nothing of the package teaches nothing of it"
    assert not found - NOTEBOOK_ALLOWED - SHARED, f"{path.name} imports {sorted(found - NOTEBOOK_ALLOWED)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_use_only_public_views(path: Path) -> None:
    assert private_names(notebook_code(path)) == set()


def test_the_command_line_uses_only_public_views() -> None:
    for path in sorted((PACKAGE / "cli").rglob("*.py")):
        source = path.read_text()
        reached = private_names(source) - {"_results", "_checks"}  # the cli's own helper modules
        assert reached == set(), f"{path.relative_to(PACKAGE)} reaches for {sorted(reached)}"


# -- the engine's rooms (vLLM v1's tree): the rooms below the front never reach up into it -------------
ENGINE = PACKAGE / "engine"
ROOMS = ("core", "worker", "sample", "spec_decode")
# The front and the entry points: what tokenizes, builds requests, talks to a user or to another process.
FRONT = {"llm_engine", "llm", "intake", "inputs", "chat", "engine_args", "generation_config",
         "compatibility", "metrics", "async_llm", "engine_core", "core_client"}  # fmt: skip


def engine_modules(source: str, path: Path) -> set[str]:
    """The engine modules (``llm_engine``, ``core``, ...: the first name below ``engine``) that
    ``source``, the text of the module at ``path``, imports relatively."""
    here = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            target = [*here[: len(here) - node.level + 1], *(node.module.split(".") if node.module else [])]
            if target[:2] == ["paged_attention", "engine"] and len(target) > 2:
                found.add(target[2])
            elif target[:2] == ["paged_attention", "engine"]:
                found |= {a.name for a in node.names}
    return found


@pytest.mark.parametrize("room", ROOMS)
def test_engine_rooms_never_import_the_front(room: str) -> None:
    for path in sorted((ENGINE / room).glob("*.py")):
        reached = engine_modules(path.read_text(), path) & FRONT
        assert not reached, f"engine/{room}/{path.name} imports the front: {sorted(reached)}"


def test_the_room_rule_catches_a_scheduler_importing_the_front() -> None:
    probe = ENGINE / "core" / "probe.py"
    found = engine_modules("from ..llm_engine import LLMEngine\nfrom .step import StepUpdate\n", probe)
    assert found == {"llm_engine", "core"} and found & FRONT == {"llm_engine"}


def test_no_room_holds_more_than_a_fifth_of_the_package() -> None:
    """A room is one folder's own modules; none may hold over ~20% of the package's lines."""
    lines: dict[Path, int] = {}
    for path in PACKAGE.rglob("*.py"):
        lines[path.parent] = lines.get(path.parent, 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    crowded = {str(d.relative_to(PACKAGE.parent)): n / total for d, n in lines.items() if n > 0.2 * total}
    assert not crowded, f"split these rooms: {crowded}"
