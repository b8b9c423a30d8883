"""``python -m paged_attention bench throughput``: paging against contiguous memory, measured on this CPU.

The experiment (the real engine and the embedded model serving the same requests in the same KV
bytes with paging, Orca's three reservations and static batches) is
:mod:`paged_attention.experiments.throughput`; the figure
:func:`paged_attention.viz.paper.throughput_figure`. Run it on a quiet machine: with two cores, any
other busy process slows torch down several-fold. Writes ``figures/throughput.{png,json}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ...experiments import throughput
from ...experiments.provenance import provenance
from ...viz.paper import throughput_figure
from ...viz.tables import table
from ._results import write_results


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench throughput", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model", default=None, help="checkpoint folder or cached hub name (default: embedded)"
    )
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument(
        "--kv-slots", type=int, default=1536, help="KV token slots for every manager (1536: Max fits 3)"
    )
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for throughput.{png,json} (default figures/)"
    )
    opts = parser.parse_args(args)
    payload = throughput.run(
        opts.requests,
        opts.kv_slots,
        opts.max_model_len,
        opts.repeats,
        opts.seed,
        progress=True,
        model_name=opts.model,
        dtype=opts.dtype,
    )
    s = payload["setup"]
    print(f"{s['num_requests']} requests (mean {s['mean_prompt']:.0f} in / {s['mean_output']:.0f} out), "
          f"{s['kv_slots']} KV slots, torch threads {s['torch_threads']}")  # fmt: skip
    rows = [
        [c, payload["tokens_per_s"][c], payload["mean_batch"][c], payload["steps"][c],
         f"{payload['paged_speedup'][c]:.2f}x", "yes" if payload["same_outputs"][c] else "NO"]
        for c in payload["tokens_per_s"]
    ]  # fmt: skip
    print(table(rows, ["manager", "output tok/s", "mean batch", "steps", "paged is", "same tokens"]))
    stored = {**payload, **provenance()}
    write_results("throughput", stored, throughput_figure(stored), opts.out)
