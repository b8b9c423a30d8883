"""Where benchmark results go: ``figures/<name>.png`` and the JSON behind it, side by side."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from ... import viz


def write_results(name: str, payload: dict, fig: Figure | None, out_dir: Path | None = None) -> Path:
    """Save ``payload`` as ``<out_dir>/<name>.json`` and ``fig`` (if any) as ``<name>.png``, in
    ``figures/`` by default; return the folder. ``python -m paged_attention readme`` then puts the
    numbers into README.md."""
    out_dir = out_dir or viz.figures_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    if fig is not None:
        viz.save(fig, name, out_dir)
        print(f"wrote {out_dir / name}.png and {name}.json")
    else:
        print(f"wrote {out_dir / name}.json")
    return out_dir
