"""``python -m paged_attention bench batch-invariant``: what the batch-invariant mode costs, and buys.

The demo's workload (16 chat prompts on SmolLM2, greedy, paged against contiguous memory in one KV
budget; :mod:`paged_attention.cli.demo`) run with the mode off and on, alternating, ``--runs`` times
each. For each mode: output tokens/s of both engines (the best run; the mode's cost is the ratio,
measured side by side) and how many of the requests the two engines answered identically. Writes
``figures/batch_invariant.json`` (README block) unless ``--no-save``.
"""

from __future__ import annotations

import argparse
import contextlib
import io

from ...experiments.provenance import provenance
from ...models import explain_dtype
from ...models.pretrained import SMOLLM2
from .._threads import set_threads
from ..demo import run_demo
from ._results import write_results

MODES = {"off": False, "on": True}
ENGINES = ("contiguous", "paged")


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench batch-invariant", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=2, help="alternating runs per mode (default 2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--no-save", action="store_true", help="print only: write nothing to figures/")
    opts = parser.parse_args(args)
    if opts.runs < 1:
        parser.error(f"--runs must be at least 1, got {opts.runs}")
    threads = set_threads(opts.threads)
    print(f"{SMOLLM2.name}, dtype {explain_dtype(SMOLLM2.name, opts.dtype)}, torch threads {threads}")
    runs: dict[str, list[dict]] = {name: [] for name in MODES}
    for i in range(opts.runs):
        for name, on in MODES.items():
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                result = run_demo(opts.requests, max_tokens=opts.max_tokens, threads=threads,
                                  dtype=opts.dtype, batch_invariant=on)  # fmt: skip
            row = {engine: result[engine]["tokens_per_second"] for engine in ENGINES}
            row["identical"] = result["identical"]
            runs[name].append(row)
            print(
                f"run {i + 1}, mode {name:>3}: contiguous {row['contiguous']:6.1f} tok/s, paged "
                f"{row['paged']:6.1f} tok/s, identical outputs {row['identical']}/{opts.requests}"
            )
    best = {name: {e: max(r[e] for r in rows) for e in ENGINES} for name, rows in runs.items()}
    cost = {e: best["on"][e] / best["off"][e] for e in ENGINES}
    ratios = ", ".join(f"{engine} {ratio:.2f}x" for engine, ratio in cost.items())
    print(f"\nbatch-invariant on / off, best runs: {ratios}")
    if not opts.no_save:
        payload = {
            "model": SMOLLM2.name, "dtype": explain_dtype(SMOLLM2.name, opts.dtype), "threads": threads,
            "num_requests": opts.requests, "max_tokens": opts.max_tokens, "runs": runs, "best": best,
            "cost": cost, **provenance(),
        }  # fmt: skip
        write_results("batch_invariant", payload, None)
