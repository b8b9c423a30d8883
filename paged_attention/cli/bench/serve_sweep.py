"""``python -m paged_attention bench serve-sweep``: the paper's Figure 12 measured through the server.

For paged, Oracle and Max (the same KV bytes, the same scheduler), a server each, the same
ShareGPT-like requests at each rate (:mod:`paged_attention.experiments.serve_sweep`). Writes
``figures/serve_sweep.{png,json}``. It takes several minutes: run it alone (2 cores: the server's
torch thread and the client).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ...experiments import serve_sweep
from ...viz.serving import serve_sweep_figure
from ...viz.tables import table
from ._results import write_results


def main(args: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m paged_attention bench serve-sweep", description=__doc__.split("\n")[0]
    )
    setup = serve_sweep.SETUP
    p.add_argument("--model", default=setup["model"])
    p.add_argument(
        "--managers",
        nargs="+",
        default=list(serve_sweep.MANAGERS),
        choices=("paged", "oracle", "pow2", "max"),
    )
    p.add_argument("--rates", type=float, nargs="+", default=list(setup["rates"]))
    p.add_argument("--num-requests", type=int, default=setup["num_requests"], help="per rate")
    p.add_argument("--num-kv-blocks", type=int, default=setup["num_kv_blocks"])
    p.add_argument("--max-model-len", type=int, default=setup["max_model_len"])
    p.add_argument("--length-scale", type=float, default=setup["length_scale"])
    p.add_argument("--threads", type=int, default=setup["threads"], help="the server's torch threads")
    p.add_argument("--seed", type=int, default=setup["seed"])
    p.add_argument(
        "--out", type=Path, default=None, help="folder for serve_sweep.{png,json} (default figures/)"
    )
    opts = p.parse_args(args)
    chosen = {
        k: getattr(opts, k)
        for k in (
            "model",
            "rates",
            "num_requests",
            "num_kv_blocks",
            "max_model_len",
            "length_scale",
            "threads",
            "seed",
        )
    }
    print(f"server torch threads {opts.threads} (the load generator takes the other core)")
    payload = serve_sweep.run(chosen, opts.managers)
    managers = list(payload["normalized_latency"])
    rows = [
        [
            f"{rate:g}",
            *(payload["normalized_latency"][m][i] * 1000 for m in managers),
            *(payload["ttft_mean"][m][i] for m in managers),
        ]
        for i, rate in enumerate(payload["rates"])
    ]
    print(table(rows, ["req/s", *(f"{m} ms/tok" for m in managers), *(f"{m} TTFT s" for m in managers)]))
    print(
        f"sustained (normalized latency under {payload['threshold_s_per_token'] * 1000:.0f} ms/token, "
        f"{payload['threshold_factor']}x the lowest measured):"
    )
    top = payload["rates"][-1]
    for m, rate in payload["sustained_rate"].items():
        print(f"  {m}: {'>= ' if rate >= top else ''}{rate:.2f} req/s")
    for m, ratio in payload["paged_over"].items():
        bound = ">= " if payload["sustained_rate"]["paged"] >= top else ""
        paper_range = payload["paper_paged_over"].get(m)
        print(
            f"paged sustains {bound}{ratio:.2f}x the rate of {m}"
            + (f" (paper, A100: {paper_range[0]}-{paper_range[1]}x)" if paper_range else "")
        )
    print(f"{payload['seconds']:.0f} s in all")
    write_results("serve_sweep", payload, serve_sweep_figure(payload), opts.out)
