"""README's measured blocks are the ones generated from figures/*.json (the runs that made them)."""

from __future__ import annotations

import json
from pathlib import Path

from paged_attention.viz import readme

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_holds_the_generated_blocks() -> None:
    text = (ROOT / "README.md").read_text()
    assert readme.update(text, ROOT / "figures") == text, (
        "README.md's generated blocks are stale: run `python -m paged_attention readme`"
    )


def test_a_stale_number_fails(tmp_path: Path) -> None:
    """Change one measured number in a copy of the JSON: the README no longer matches it."""
    for name in ("serve_sweep", "serve_overhead", "spec_decode", "dtypes"):
        (tmp_path / f"{name}.json").write_text((ROOT / "figures" / f"{name}.json").read_text())
    overhead = json.loads((tmp_path / "serve_overhead.json").read_text())
    overhead["throughput_ratio"] += 0.5
    (tmp_path / "serve_overhead.json").write_text(json.dumps(overhead))
    text = (ROOT / "README.md").read_text()
    assert readme.update(text, tmp_path) != text
    dtypes = json.loads((tmp_path / "dtypes.json").read_text())
    dtypes["rows"][-1]["step_s"] *= 1.01
    (tmp_path / "dtypes.json").write_text(json.dumps(dtypes))
    (tmp_path / "serve_overhead.json").write_text((ROOT / "figures" / "serve_overhead.json").read_text())
    assert readme.update(text, tmp_path) != text


def test_each_block_says_where_and_when_it_was_measured() -> None:
    for name in ("serve_sweep", "serve_overhead", "spec_decode", "dtypes"):
        payload = json.loads((ROOT / "figures" / f"{name}.json").read_text())
        assert payload["machine"] and payload["date"], name
    block = readme.serving_block(ROOT / "figures")
    assert (
        "torch thread" in block
        and json.loads((ROOT / "figures" / "serve_sweep.json").read_text())["date"] in block
    )
