"""The paper's experiments: serve(), the cost-model knobs they use, and every bench command end to end."""

import json

import pytest

from paged_attention.cli.main import main
from paged_attention.experiments import paper, throughput
from paged_attention.experiments.cost_model import CostModel
from paged_attention.experiments.serve import figure2_stack, serve, sustainable_rate
from paged_attention.experiments.traces import TRACE_SHAPES, synthetic_trace


@pytest.fixture(scope="module")
def backlog_runs():
    trace = synthetic_trace("sharegpt", 120, seed=3)
    return {m: serve(trace, m) for m in paper.MANAGERS}


def test_serve_orders_the_managers_as_the_paper_does(backlog_runs):
    batch = {m: r.mean_batch for m, r in backlog_runs.items()}
    assert batch["max"] < batch["pow2"] < batch["oracle"] < batch["paged"]
    assert backlog_runs["max"].peak_batch == 7  # 7 x 2048 slots fill the paper's 15,728
    tokens = {m: figure2_stack(r.memory)[0] for m, r in backlog_runs.items()}
    assert tokens["max"] < tokens["pow2"] < tokens["oracle"] < tokens["paged"]
    assert tokens["paged"] > 90
    for run in backlog_runs.values():
        assert sum(run.memory.values()) == pytest.approx(1.0)
        assert sum(figure2_stack(run.memory)) == pytest.approx(100.0)
        assert run.normalized_latency > 0 and run.duration > 0
    # paging reserves ahead only the blocks of a prompt's later chunks, from its admission to its last chunk
    assert 0 <= backlog_runs["paged"].memory["reserved"] < 0.01
    assert backlog_runs["oracle"].memory["internal_fragmentation"] == 0  # the oracle never over-reserves
    assert backlog_runs["max"].preemptions == 0 and backlog_runs["paged"].preemptions > 0


def test_serve_rejects_an_unknown_manager():
    with pytest.raises(ValueError, match="manager must be 'paged' or one of"):
        serve(synthetic_trace("alpaca", 2), "best-fit")


def test_sustainable_rate_interpolates_the_crossing():
    assert sustainable_rate([1, 2, 3], [0.05, 0.05, 0.25], 0.15) == pytest.approx(2.5)
    assert sustainable_rate([1, 2, 3], [0.05, 0.06, 0.07], 0.1) == 3  # never crosses: the last rate
    assert sustainable_rate([1, 2], [0.2, 0.3], 0.1) == 0.0  # above from the start


def test_step_overhead_and_block_reads_add_to_the_roofline():
    base = CostModel.named("A100-40GB", "OPT-13B")
    slow = CostModel.named("A100-40GB", "OPT-13B", step_overhead=0.015)
    assert slow.step_time(8, 4000) == pytest.approx(base.step_time(8, 4000) + 0.015)
    assert slow.step_time(0, 0) == 0.0  # an empty step costs nothing, overhead included
    blocks = base.step_cost(8, 4000, kv_blocks_read=250).bytes_moved - base.step_cost(8, 4000).bytes_moved
    assert blocks == 250 * base.model.kv_streams * base.block_read_overhead
    assert base.model.kv_streams == 2 * 40 * 40  # K and V, 40 layers, 40 heads
    with pytest.raises(ValueError, match="step_overhead must be >= 0"):
        CostModel.named("A100-40GB", "OPT-13B", step_overhead=-1.0)
    with pytest.raises(ValueError, match="kv_blocks_read must be an int >= 0"):
        base.step_cost(1, 1, kv_blocks_read=-1)


def test_paged_memory_bound_at_the_papers_rate_only_with_the_step_overhead():
    trace = synthetic_trace("sharegpt", 300, request_rate=2.0, seed=0)
    roofline = serve(trace, "paged", step_overhead=0.0, report_every=0)
    calibrated = serve(trace, "paged", report_every=0)
    assert calibrated.mean_batch > 1.3 * roofline.mean_batch


def _bench(tmp_path, name, *args):
    main(["bench", name, *args, "--out", str(tmp_path)])
    stem = name.replace("-", "_")
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
    return json.loads((tmp_path / f"{stem}.json").read_text())


def test_bench_fragmentation_writes_the_figure_2_comparison(tmp_path, capsys):
    payload = _bench(tmp_path, "fragmentation", "--requests", "60")
    assert set(payload["ours"]) == {"max", "pow2", "oracle", "paged", "pow2/first-fit", "oracle/first-fit"}
    assert payload["paper"]["max"] == [20.4, 13.3, 57.3, 8.9]
    assert payload["categories"] == list(paper.FIG2_CATEGORIES)  # the fourth: "external frag. & others"
    out = capsys.readouterr().out
    assert "largest gap to the paper" in out and "external frag. & others %" in out


def test_memory_is_averaged_over_the_whole_run_when_nobody_waits():
    quiet = serve(synthetic_trace("sharegpt", 20, request_rate=0.05, seed=0), "paged")
    assert quiet.saturated_share == 0 and quiet.memory_window.startswith("the whole run")
    assert quiet.memory["free"] > 0.5  # room it did not need
    busy = serve(synthetic_trace("sharegpt", 60, seed=0), "max")
    assert busy.saturated_share > 0 and busy.memory_window == "steps with a request waiting"


def test_trace_shapes_take_the_papers_means():
    for name, shape in TRACE_SHAPES.items():
        prompt, output = paper.FIG11_MEANS[name]
        assert (shape.prompt_mean, shape.output_mean) == (round(prompt), round(output))


def test_bench_capacity_latency_and_block_size_run_small(tmp_path):
    cap = _bench(tmp_path, "capacity", "--requests", "40", "--sweep-requests", "20")
    assert set(cap["by_budget"]) == set(paper.MANAGERS) and len(cap["by_budget"]["paged"]) == 5
    lat = _bench(tmp_path, "latency", "--requests", "15")
    assert set(lat["normalized_latency"]) == set(paper.MANAGERS)
    assert all(len(v) == len(lat["rates"]) for v in lat["normalized_latency"].values())
    bs = _bench(tmp_path, "block-size", "--requests", "15")
    assert set(bs["traces"]) == {"sharegpt", "alpaca"} and bs["block_sizes"][0] == 1


def test_bench_throughput_measures_every_manager_on_the_real_model(tmp_path, capsys):
    payload = _bench(
        tmp_path,
        "throughput",
        "--requests",
        "4",
        "--kv-slots",
        "1024",
        "--max-model-len",
        "256",
        "--repeats",
        "1",
    )
    assert set(payload["tokens_per_s"]) == {"paged", "max", "pow2", "oracle", "static"}
    assert all(payload["same_outputs"].values())
    assert payload["paged_speedup"]["paged"] == 1.0
    assert "same tokens" in capsys.readouterr().out
    rows = throughput.step_time_by_batch(payload)
    assert sum(r["steps"] for r in rows) == sum(payload["steps"].values())
    assert all(r["batch"][0] <= r["mean_batch"] <= r["batch"][1] and r["ms_per_step"] > 0 for r in rows)
    # 1024 slots hold all 4 max-length (256) reservations: no one waits, every manager runs one batch
    batches = [t["batch"] for t in payload["timeline"].values()]
    assert all(b == batches[0] for b in batches)


def test_the_experiments_run_as_functions_and_viz_draws_their_results():
    """What a notebook does: call the experiment (no command, no printing), draw its payload."""
    from matplotlib.figure import Figure

    from paged_attention import viz
    from paged_attention.experiments import block_size, latency

    lat = latency.run(num_requests=10, rates=(0.5, 2.0))
    assert set(lat["sustained_rate"]) == set(paper.MANAGERS)
    sweep = block_size.run(block_sizes=(8, 16), traces={"alpaca": (50.0, 10)})
    assert sweep["traces"]["alpaca"]["best_block_size"] in (8, 16)
    for fig in (viz.paper.latency_figure(lat), viz.paper.block_size_figure(sweep)):
        assert isinstance(fig, Figure)
    text = viz.tables.table([["paged", 7.0]], ["manager", "mean batch"])
    assert text.splitlines() == ["manager  mean batch", "-------  ----------", "  paged         7.0"]
