"""Results as plain-text tables, for printing beside the figures (commands and notebooks alike)."""

from __future__ import annotations


def table(rows: list[list[object]], header: list[str]) -> str:
    """A plain-text table (right-aligned columns; floats to one decimal), for printing results."""
    cells = [[str(c) for c in header]] + [
        [f"{c:.1f}" if isinstance(c, float) else str(c) for c in r] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plural(count: int, noun: str) -> str:
    """``"1 block"``, ``"2 blocks"``: a count and its noun, singular when the count is 1."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
