"""``python -m paged_attention bench spec-decode``: n-gram speculative decoding against plain decoding.

Grounded work (answers that copy from the prompt) and open-ended chat, at batch 1 and a larger
batch, the same requests greedily with and without drafts in one run
(:mod:`paged_attention.experiments.spec_decode`); prints tokens/s, the ratio, whether the outputs
are identical and the drafts' acceptance; writes ``figures/spec_decode.{json,png}``.
"""

from __future__ import annotations

import argparse

from ... import viz
from ...experiments import spec_decode
from ...experiments.provenance import provenance
from .._threads import set_threads
from ._results import write_results


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench spec-decode", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2", help="checkpoint folder, cached hub name or smollm2")
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument(
        "--lookup",
        type=int,
        nargs=2,
        default=(2, 4),
        metavar=("MIN", "MAX"),
        help="prompt_lookup_min and prompt_lookup_max",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 2, 1 if busy)")
    parser.add_argument(
        "--dtype", default="float32", help="float32 (default: outputs must be identical), bfloat16 or auto"
    )
    parser.add_argument("--no-save", action="store_true", help="print only: write nothing to figures/")
    opts = parser.parse_args(args)
    threads = set_threads(opts.threads)
    config = {
        "method": "ngram",
        "num_speculative_tokens": opts.k,
        "prompt_lookup_min": opts.lookup[0],
        "prompt_lookup_max": opts.lookup[1],
    }
    print(
        f"model {opts.model} in {opts.dtype}, speculative_config {config}, greedy, up to {opts.max_tokens} "
        f"tokens per request, torch threads {threads}"
    )
    rows = spec_decode.compare(opts.model, config, tuple(opts.batch_sizes), opts.max_tokens, dtype=opts.dtype)
    print(
        f"\n{'workload':>9} {'batch':>5} {'plain tok/s':>11} {'ngram tok/s':>11} {'speedup':>8} "
        f"{'identical':>9} {'accepted':>14} {'mean length':>11}"
    )
    for r in rows:
        rate = f"{r['accepted_tokens']}/{r['draft_tokens']}"
        length = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
        print(
            f"{r['workload']:>9} {r['batch']:>5} {r['plain_tokens_per_s']:>11.1f} "
            f"{r['ngram_tokens_per_s']:>11.1f} {r['speedup']:>7.2f}x "
            f"{r['identical']:>4}/{r['requests']:<4} {rate:>14} {length:>11}"
        )
    if not opts.no_save:
        payload = {
            "rows": rows,
            "config": config,
            "model": opts.model,
            "threads": threads,
            "max_tokens": opts.max_tokens,
            "dtype": opts.dtype,
            **provenance(),
        }
        write_results("spec_decode", payload, viz.speculative.speedup_bars(rows))
