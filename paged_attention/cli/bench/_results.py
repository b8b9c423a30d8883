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
    fig.savefig(out_dir / f"{name}.png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    print(f"wrote {out_dir / name}.png and {name}.json")
    return out_dir


def table(rows: list[list[object]], header: list[str]) -> str:
    """A plain-text table (right-aligned columns), for printing results."""
    cells = [[str(c) for c in header]] + [
        [f"{c:.1f}" if isinstance(c, float) else str(c) for c in r] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
