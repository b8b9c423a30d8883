"""Where benchmark results go: ``figures/<name>.png`` and the JSON behind it, side by side."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from ... import viz


def write_results(name: str, payload: dict, fig: Figure, out_dir: Path | None = None) -> Path:
    """Save ``fig`` as ``<out_dir>/<name>.png`` and ``payload`` as ``<name>.json``; return the folder."""
    out_dir = out_dir or viz.figures_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    viz.save(fig, name, out_dir)
    print(f"wrote {out_dir / name}.png and {name}.json")
    return out_dir
