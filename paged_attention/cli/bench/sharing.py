"""``python -m paged_attention bench sharing``: what sharing pages saves (the paper's Figures 15 and 16).

The two experiments, memory saved by parallel sampling and beam search and a shared few-shot
prefix with prefix caching on and off, are :mod:`paged_attention.experiments.sharing`; their figures
and tables :mod:`paged_attention.viz.sharing`. Writes ``figures/sharing_memory.{png,json}`` and
``figures/sharing_prefix.{png,json}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ...experiments import paper, sharing
from ...experiments.provenance import provenance
from ...experiments.traces import TRACE_SHAPES
from ...models import load_model
from ...viz import sharing as figures
from ._results import write_results


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench sharing", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--requests", type=int, default=8, help="requests per trace in the memory runs")
    parser.add_argument("--traces", nargs="+", default=list(sharing.TRACES), choices=sorted(TRACE_SHAPES))
    parser.add_argument(
        "--widths", type=int, nargs="+", default=list(sharing.WIDTHS), help="n and beam widths"
    )
    parser.add_argument("--prefix-requests", type=int, default=64)
    parser.add_argument(
        "--budget-requests", type=int, default=8, help="KV budget: this many prefix requests, unshared"
    )
    parser.add_argument("--repeats", type=int, default=3, help="prefix runs per setting; the fastest counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="*", default=[], choices=["memory", "prefix"])
    parser.add_argument("--out", type=Path, default=None, help="folder for the results (default figures/)")
    opts = parser.parse_args(args)
    model, tokenizer = load_model(None)
    if "memory" not in opts.skip:
        memory = sharing.run_memory(
            opts.traces, opts.widths, opts.requests, opts.seed, model, tokenizer, progress=True
        )
        print(f"KV memory saved by sharing ({opts.requests} requests per trace, time average):")
        print(figures.memory_report_text(memory))
        print(
            "paper: §6.3 (OPT-13B, real traces; Figure 15 plots Alpaca, the text gives ShareGPT); "
            "ours: a tiny random model, synthetic traces\n"
        )
        write_results("sharing_memory", {**memory, **provenance()}, figures.memory_figure(memory), opts.out)
    if "prefix" not in opts.skip:
        prefix = sharing.run_prefix(
            sharing.PREFIXES, opts.prefix_requests, opts.budget_requests, opts.repeats, opts.seed, model,
            tokenizer, progress=True,
        )  # fmt: skip
        print(
            f"\n{opts.prefix_requests} requests behind a shared prefix, KV budget of {opts.budget_requests} "
            f"unshared requests, best of {opts.repeats} runs, torch threads {torch.get_num_threads()}:"
        )
        print(figures.prefix_report_text(prefix))
        print(
            f"paper (§6.4, Figure 16; LLaMA-13B vs Orca (Oracle), A100, prefixes reserved in advance): "
            f"1-shot {paper.FIG16_SPEEDUP['1-shot']}x, 5-shot {paper.FIG16_SPEEDUP['5-shot']}x"
        )
        print("ours: caching on vs off, on this CPU; the ratio varies from run to run")
        write_results("sharing_prefix", {**prefix, **provenance()}, figures.prefix_figure(prefix), opts.out)
