"""README's measured blocks are the ones generated from figures/*.json (the runs that made them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paged_attention.viz import readme

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_holds_the_generated_blocks() -> None:
    text = (ROOT / "README.md").read_text()
    assert readme.update(text, ROOT / "figures") == text, (
        "README.md's generated blocks are stale: run `python -m paged_attention readme`"
    )


#: a measured number in each JSON a block reads: (file, path to the number)
MEASURED = [
    ("crosscheck", ("cases", 0, "tokens")),
    ("peer", ("rows", 0, "ratio")),
    ("serve_overhead", ("throughput_ratio",)),
    ("serve_overhead_tiny", ("thread_throughput_ratio",)),
    ("dtypes", ("rows", -1, "step_s")),
    ("demo", ("runs", "paged", "tokens_per_second")),
    ("allocator", ("results", 0, "pairs_per_second")),
    ("engine", ("methods", "paged-engine", "tokens_per_s")),
    ("engine_smollm2", ("methods", "hf-static", "paged_faster")),
    ("sharing_prefix", ("results", "1-shot", "speedup")),
    ("throughput", ("paged_speedup", "max")),
    ("fragmentation", ("ours", "pow2", "stack", 0)),
    ("capacity", ("ours", "paged", "mean_batch")),
    ("latency", ("paged_over", "oracle")),
]
#: the measured (not replayed) runs, which must say where and when they ran
WITH_PROVENANCE = (
    "crosscheck", "peer", "serve_sweep", "serve_overhead", "serve_overhead_tiny", "spec_decode", "dtypes",
    "demo", "allocator", "engine", "engine_smollm2", "sharing_memory", "sharing_prefix", "throughput",
)  # fmt: skip


@pytest.mark.parametrize(("name", "path"), MEASURED, ids=[m[0] for m in MEASURED])
def test_a_stale_number_fails(tmp_path: Path, name: str, path: tuple) -> None:
    """Change one measured number in a copy of the JSON files: the README no longer matches them."""
    for source in (ROOT / "figures").glob("*.json"):
        (tmp_path / source.name).write_text(source.read_text())
    text = (ROOT / "README.md").read_text()
    assert readme.update(text, tmp_path) == text
    payload = json.loads((tmp_path / f"{name}.json").read_text())
    holder = payload
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = holder[path[-1]] * 1.1 + 1
    (tmp_path / f"{name}.json").write_text(json.dumps(payload))
    assert readme.update(text, tmp_path) != text


@pytest.mark.parametrize("name", WITH_PROVENANCE)
def test_each_measured_block_says_where_and_when_it_ran(name: str) -> None:
    payload = json.loads((ROOT / "figures" / f"{name}.json").read_text())
    assert payload["machine"] and payload["date"], name
    text = (ROOT / "README.md").read_text()
    assert payload["date"] in text and payload["machine"] in text
    block = readme.serving_block(ROOT / "figures")
    assert (
        "torch thread" in block
        and json.loads((ROOT / "figures" / "serve_sweep.json").read_text())["date"] in block
    )
