"""A stored result is shown with the machine that made it, never as "this CPU": the machine that
reads ``figures/*.json`` (a student's laptop, CI) is seldom the one that measured it."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest

from paged_attention import viz

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parent.parent


def titles(fig) -> str:
    texts = [fig.get_suptitle()] + [ax.get_title() for ax in fig.axes]
    return " | ".join(texts)


@pytest.mark.parametrize(
    ("name", "draw"),
    [("serve_sweep", viz.serving.serve_sweep_figure), ("throughput", viz.paper.throughput_figure)],
)
def test_a_stored_result_is_drawn_with_its_machine(name, draw):
    payload = viz.stored_results(name)
    assert payload.get("machine"), f"figures/{name}.json records no machine"
    shown = titles(draw(payload))
    assert payload["machine"] in shown and "this CPU" not in shown, shown
    live = {k: v for k, v in payload.items() if k != "machine"}  # a run made in this process
    assert "this CPU" in titles(draw(live))


def test_measured_on_says_where():
    assert viz.measured_on({"machine": "AMD EPYC, 2 cores"}) == "AMD EPYC, 2 cores"
    assert viz.measured_on({}) == "this CPU"


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_no_notebook_cell_calls_a_stored_result_this_cpus(path):
    """A code cell that reads stored results prints or titles them with ``viz.measured_on``."""
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        text = "".join(cell["source"])
        if cell["cell_type"] == "code" and "stored_results(" in text:
            assert "this CPU" not in text, f"{path.name} cell {index}: a stored result called 'this CPU'"
