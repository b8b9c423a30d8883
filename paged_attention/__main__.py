"""Command line: ``python -m paged_attention {demo, bench, figures}``.

* ``demo``: the main job; today a live walkthrough of paged KV memory (allocator, page tables,
  fork and copy-on-write) with a memory map after every step.
* ``bench <name>``: benchmarks (``allocator``, ``kernel``); each measures side by side in one run.
* ``figures``: regenerate every figure under ``figures/`` by running the notebooks that draw them.
"""

from __future__ import annotations

import argparse
import sys

BENCHMARKS = ("allocator", "kernel")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m paged_attention", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="walk through paged KV memory step by step")
    demo.add_argument("--seed", type=int, default=0)
    bench = sub.add_parser("bench", help="run a benchmark", add_help=False)
    bench.add_argument("name", choices=BENCHMARKS)
    figures = sub.add_parser("figures", help="regenerate figures/ from the notebooks")
    figures.add_argument("--timeout", type=int, default=600, help="seconds allowed per notebook")
    opts, rest = parser.parse_known_args(argv)
    if rest and opts.command != "bench":  # bench passes the rest to the benchmark's own parser
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    if opts.command == "demo":
        from .demo import run_demo

        run_demo(seed=opts.seed)
    elif opts.command == "bench":
        from .benchmarks import allocator, kernel

        {"allocator": allocator.main, "kernel": kernel.main}[opts.name](rest)
    elif opts.command == "figures":
        from .figures import regenerate_figures

        regenerate_figures(timeout=opts.timeout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
