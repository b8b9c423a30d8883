"""Regenerate ``figures/``: the notebooks' figures, then the experiments' (``bench ...``) results.

Every figure is drawn through :mod:`paged_attention.plots`. The notebooks build theirs step by step,
so this command runs them (on copies; the stored notebook outputs are left alone) and lets them
save their figures. The paper's experiments at full size are benchmark commands; their figures
(``fragmentation``, ``capacity``, ``latency``, ``block_size``, ``throughput``, ``sharing_memory``,
``sharing_prefix``) come from running those commands with their default settings.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .plots import figures_dir, repo_root


def notebook_paths() -> list[Path]:
    root = repo_root()
    if root is None:
        raise FileNotFoundError("figures are drawn by the notebooks of a source checkout; none was found")
    return sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


EXPERIMENTS = ("fragmentation", "capacity", "latency", "block-size", "throughput", "sharing")
# Arguments for `make figures`, to stay within its time budget (the measured ones run once, not best of N).
QUICK_ARGS = {"throughput": ["--repeats", "1"], "sharing": ["--repeats", "1"]}


def regenerate_figures(timeout: int = 600, experiments: bool = True) -> None:
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError as err:  # pragma: no cover - dev extra missing
        raise SystemExit("`figures` runs the notebooks: pip install -e '.[dev]' first") from err
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for path in notebook_paths():
        start = time.perf_counter()
        notebook = nbformat.read(path, as_version=4)
        NotebookClient(
            notebook,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        ).execute()
        print(f"{path.name}: ran in {time.perf_counter() - start:.1f} s")
    if experiments:
        import importlib

        for name in EXPERIMENTS:
            start = time.perf_counter()
            module = importlib.import_module(f".benchmarks.{name.replace('-', '_')}", __package__)
            module.main(QUICK_ARGS.get(name, []))
            print(f"bench {name}: ran in {time.perf_counter() - start:.1f} s")
    print(f"figures in {figures_dir()}:")
    for png in sorted(figures_dir().glob("*.png")):
        print(f"  {png.name}")
