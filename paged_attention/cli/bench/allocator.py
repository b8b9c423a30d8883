"""How fast is the block allocator, and does its cost stay flat as the cache grows?

``python -m paged_attention bench allocator``. The workloads (``ordered``, ``scrambled`` and the
fork-heavy ``mixed``, at each size) are :mod:`paged_attention.experiments.allocator_timing`.
Numbers are allocate-or-share + free *pairs* per second, best of ``--repeats`` runs; written to
``figures/allocator.json`` (``--no-save``: print only).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ...experiments.allocator_timing import AllocatorResult, run
from ...experiments.provenance import provenance
from ._results import write_results


def report(results: list[AllocatorResult]) -> str:
    """The results as a table, and how the cost per pair at the largest size compares to the smallest."""
    lines = [f"{'blocks':>10} {'workload':>10} {'pairs/s':>12} {'ns/pair':>8}"]
    for r in results:
        lines.append(
            f"{r.num_blocks:>10,} {r.workload:>10} {r.pairs_per_second:>12,.0f} {r.ns_per_pair:>8.0f}"
        )
    by_key = {(r.num_blocks, r.workload): r.pairs_per_second for r in results}
    sizes = sorted({r.num_blocks for r in results})
    if len(sizes) > 1:
        small, large = sizes[0], sizes[-1]
        for workload in ("ordered", "scrambled", "mixed"):
            ratio = by_key[(small, workload)] / by_key[(large, workload)]
            lines.append(
                f"{workload:>10}: cost per pair at {large:,} blocks = {ratio:.2f}x the cost at {small:,}"
            )
    return "\n".join(lines)


def main(args: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench allocator", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1_000, 1_000_000], help="allocator sizes in blocks"
    )
    parser.add_argument("--pairs", type=int, default=300_000, help="pairs timed per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--no-save", action="store_true", help="write nothing to figures/")
    opts = parser.parse_args(args)
    results = run(tuple(opts.sizes), opts.pairs, opts.repeats)
    print(report(results))
    rows = [asdict(r) | {"ns_per_pair": r.ns_per_pair} for r in results]
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=2))
    if not opts.no_save:
        payload = {"results": rows, "pairs": opts.pairs, "repeats": opts.repeats, **provenance()}
        write_results("allocator", payload, None)
