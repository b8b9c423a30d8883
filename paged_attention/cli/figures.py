"""Regenerate ``figures/``: the notebooks' figures, then the experiments' (``bench ...``) results.

Every figure is drawn through :mod:`paged_attention.viz`. The notebooks build theirs step by step,
so this command runs them (on copies; the stored notebook outputs are left alone) and lets them
save their figures. The paper's experiments at full size are benchmark commands; their figures
(``fragmentation``, ``capacity``, ``latency``, ``block_size``, ``throughput``, ``sharing_memory``,
``sharing_prefix``, ``serve_sweep``, ``spec_decode``, ``dtypes``, and ``serve_overhead.json``) come
from running those commands with their default settings, or those :data:`MEASURED` names;
``python -m paged_attention readme`` then puts their numbers into README.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..viz import figures_dir, repo_root


def notebook_paths() -> list[Path]:
    root = repo_root()
    if root is None:
        raise FileNotFoundError("figures are drawn by the notebooks of a source checkout; none was found")
    return sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


# The replayed experiments are single-threaded and deterministic: they run two at a time. The
# measured ones (wall-clock timings) run alone afterwards, once each rather than best of N, to keep
# `make figures` within its time budget.
REPLAYED = ("latency", "capacity", "fragmentation", "block-size")  # longest first
#: what each measured run writes -> its command line after ``python -m paged_attention``
MEASURED = {
    "throughput": ["bench", "throughput", "--repeats", "1"],
    "sharing": ["bench", "sharing", "--repeats", "1"],
    "allocator": ["bench", "allocator"],
    "engine": ["bench", "engine", "--threads", "1"],  # the embedded model against transformers
    "engine_smollm2": [
        *("bench", "engine", "--model", "smollm2", "--requests", "16", "--dtype", "float32", "--threads", "1")
    ],
    "dtypes": ["bench", "engine", "--model", "smollm2", "--dtype", "float32", "bfloat16", "--threads", "1"],
    "demo": ["demo", "--save", "--threads", "1"],
    "batch_invariant": ["bench", "batch-invariant"],  # the demo's workload with the mode off and on
    "serve_sweep": ["bench", "serve-sweep"],  # Figure 12 through the real server and SmolLM2 (minutes)
    "serve_overhead": ["bench", "serve", "--compare-offline"],  # the server's overhead over the engine
    "serve_overhead_tiny": [  # the same with the embedded model, whose 2 ms steps make the front show
        *("bench", "serve", "--compare-offline", "--result-file", "figures/serve_overhead_tiny.json"),
        *("--launch", "--model tiny --threads 1 --num-kv-blocks 64 --max-model-len 256"),
    ],
    "spec_decode": ["bench", "spec-decode"],  # with and without n-gram drafts, SmolLM2 (minutes)
    "kv_dtype": ["bench", "kv-dtype", "--threads", "1"],  # the 8-bit KV caches against bfloat16, SmolLM2
}
EXPERIMENTS = (*REPLAYED, *MEASURED)


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
        run_experiments()
        from .readme import update_readme

        update_readme()
    print(f"figures in {figures_dir()}:")
    for png in sorted(figures_dir().glob("*.png")):
        print(f"  {png.name}")


def run_experiments(parallel: int = 2) -> None:
    """Run every experiment command with its defaults, writing its figure and JSON (see above)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(parallel) as pool:  # each thread waits on one `bench` subprocess
        for report in pool.map(_run_bench, REPLAYED):
            print(report)
    for name in MEASURED:
        print(_run_bench(name))


def _run_bench(name: str) -> str:
    """Run one experiment (a replayed ``bench <name>`` or a :data:`MEASURED` command line)."""
    import subprocess
    import sys

    start = time.perf_counter()
    args = MEASURED.get(name, ["bench", name])
    command = [sys.executable, "-m", "paged_attention", *args]
    env = {**os.environ, "PAGED_ATTENTION_FIGURES": str(figures_dir())}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return f"{done.stdout}{' '.join(args)}: ran in {time.perf_counter() - start:.1f} s"
