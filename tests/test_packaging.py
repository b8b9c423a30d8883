"""The project's set-up files agree with each other and with the code."""

import doctest
import re
import sys
from pathlib import Path

import pytest

import paged_attention.memory.allocator

ROOT = Path(__file__).resolve().parent.parent

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _environment_yml_names() -> set[str]:
    names = set()
    text = (ROOT / "environment.yml").read_text()
    for line in text[text.index("dependencies:") :].splitlines():
        match = re.match(r"^\s+-\s+([A-Za-z0-9_.\-]+)", line)
        if match and match.group(1) not in {"python", "pip", "e", "-e"}:
            names.add(_name(match.group(1)))
    return names


def test_environment_yml_declares_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    assert _environment_yml_names() == declared


def test_makefile_pins_the_cpu_torch_wheel_and_matching_triton():
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in makefile and "triton==3.7.1" in makefile
    env = (ROOT / "environment.yml").read_text()
    assert "torch==2.13.0" in env and "triton==3.7.1" in env


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make demo" in readme


def test_docstring_examples_run():
    result = doctest.testmod(paged_attention.memory.allocator)
    assert result.attempted > 0 and result.failed == 0


def test_install_fetches_the_real_model_with_pinned_converters():
    """``make install`` (so ``make demo``/``make test`` on a fresh clone) ends by fetching SmolLM2;
    the packages that convert it are pinned, and the conda path says to run the same command."""
    makefile = (ROOT / "Makefile").read_text()
    install = makefile[makefile.index("install: $(STAMP)") :].split("\n\n")[0]
    assert "-m paged_attention model fetch" in install
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "gguf==0.19.0" in deps and "accelerate==1.15.0" in deps
    env = (ROOT / "environment.yml").read_text()
    assert "gguf==0.19.0" in env and "python -m paged_attention model fetch" in env
