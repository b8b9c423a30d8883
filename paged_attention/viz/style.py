"""The house style of every figure, and where figures are saved.

Shared colours (one per role, one per sequence), :func:`save` (``figures/<name>.png``) and the
folders it writes to. Every chapter module draws with these, so a figure looks the same wherever it
is drawn. Drawing functions take plain data, return a ``matplotlib.figure.Figure`` and never call
``plt.show()``; the caller saves through :func:`save`.
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

GiB = 1024**3
COLORS = {
    "tokens": "#2b6cb0",
    "future": "#90cdf4",
    "wasted": "#e53e3e",
    "free": "#edf2f7",
    "weights": "#4a5568",
}
SEQUENCE_COLORS = plt.get_cmap("tab10").colors
#: one colour per memory manager, the same in every figure (paged blue, Oracle green, Pow2 ochre,
#: Max red, static batching grey)
MANAGER_COLORS = {
    "paged": "#2b6cb0",
    "oracle": "#38a169",
    "pow2": "#d69e2e",
    "max": "#e53e3e",
    "static": "#718096",
}


def manager_color(name: str) -> str:
    """The colour of a manager named by its key (``"pow2"``) or a label that contains it
    (``"Orca (Pow2)"``, ``"vLLM (paged)"``, ``"Orca (Oracle)\nfirst-fit"``, ``"static batching"``)."""
    lowered = name.lower()
    for key in ("oracle", "pow2", "static", "max", "paged"):  # "static batching (Max, ...)" is static
        if key in lowered:
            return MANAGER_COLORS[key]
    return "#4a5568"


FIG2_COLORS = ("#2b6cb0", "#90cdf4", "#e53e3e", "#f6ad55")  # tokens, reserved, internal, external + free
ARENA_COLORS = {"tokens": FIG2_COLORS[0], "reserved": FIG2_COLORS[1], "internal": FIG2_COLORS[2],
                "rounding": FIG2_COLORS[3]}  # fmt: skip


def repo_root() -> Path | None:
    """The source checkout this package lives in, if it lives in one (editable install)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").exists() and (root / "notebooks").is_dir() else None


def figures_dir() -> Path:
    """Where figures go: ``$PAGED_ATTENTION_FIGURES``, else the checkout's ``figures/``, else ./figures."""
    env = os.environ.get("PAGED_ATTENTION_FIGURES")
    root = repo_root()
    path = Path(env) if env else (root / "figures" if root else Path.cwd() / "figures")
    path.mkdir(parents=True, exist_ok=True)
    return path


def stored_results(name: str) -> dict:
    """The stored results ``figures/<name>.json`` of the checkout (what ``make figures`` measured),
    wherever new figures are being written: a notebook reads the full runs it cannot redo here."""
    import json

    root = repo_root()
    path = (root / "figures" if root else figures_dir()) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no stored results {path}: run `make figures` (or the bench command) first")
    return json.loads(path.read_text())


def measured_on(payload: dict) -> str:
    """Where a result was measured: its stored ``machine`` ("AMD EPYC, 2 cores"), or "this CPU" for a
    run just made in this process (which carries none). A stored result is never "this CPU": the
    machine that reads it may not be the one that made it."""
    return str(payload.get("machine") or "this CPU")


def save(fig: Figure, name: str, folder: Path | None = None) -> None:
    """Save ``fig`` as ``figures/<name>.png``, or ``<folder>/<name>.png`` (no software tag, so reruns
    are byte-stable).

    Returns nothing, so that a notebook cell ending in ``viz.save(...)`` prints no path.
    """
    if folder is None:
        folder = figures_dir()
    else:
        folder.mkdir(parents=True, exist_ok=True)
    fig.savefig(folder / f"{name}.png", dpi=110, bbox_inches="tight", metadata={"Software": None})
