"""``python -m paged_attention bench kv-dtype``: the 8-bit KV-cache formats against bfloat16, side by side.

Capacity and throughput in the demo's KV budget, greedy agreement, and the error over a few thousand
tokens of text (:mod:`paged_attention.experiments.kv_dtype`); writes ``figures/kv_dtype.{json,png}``,
which ``python -m paged_attention readme`` puts into README.md.
"""

from __future__ import annotations

import argparse

from ... import viz
from ...experiments import kv_dtype
from ...experiments.provenance import provenance
from .._threads import set_threads
from ._results import write_results


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench kv-dtype", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2", help="checkpoint folder, cached hub name or smollm2")
    parser.add_argument("--dtype", default="bfloat16", help="the model's dtype (the reference cache's)")
    parser.add_argument(
        "--num-kv-blocks", type=int, default=64, help="the budget, in blocks of the reference"
    )
    parser.add_argument("--requests", type=int, default=48, help="chat questions (cycled)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the formats, alternating")
    parser.add_argument("--text-tokens", type=int, default=3000, help="tokens of text for the error")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 2, 1 if busy)")
    parser.add_argument("--no-save", action="store_true", help="print only: write nothing to figures/")
    opts = parser.parse_args(args)
    threads = set_threads(opts.threads)
    print(
        f"model {opts.model} in {opts.dtype}, KV budget {opts.num_kv_blocks} reference blocks, "
        f"torch threads {threads}"
    )
    result = kv_dtype.compare(
        opts.model,
        opts.dtype,
        opts.num_kv_blocks,
        num_requests=opts.requests,
        max_tokens=opts.max_tokens,
        repeats=opts.repeats,
        text_tokens=opts.text_tokens,
    )
    print(
        f"budget {result['budget_bytes'] / 2**20:.1f} MiB: "
        f"float32 would hold {result['float32_blocks']} blocks\n"
    )
    header = (
        "format",
        "blocks",
        "max-len reqs",
        "peak run",
        "tok/s",
        "identical",
        "KL mean",
        "KL max",
        "dlogp max",
        "top-1",
        "ppl corpus",
    )
    print(" | ".join(header))
    for r in result["rows"]:
        e, a = r["error"], r["agreement"]
        print(
            " | ".join(
                (
                    r["format"],
                    str(r["blocks"]),
                    str(r["max_length_requests"]),
                    str(r["peak_running"]),
                    f"{r['tokens_per_s']:.1f}",
                    f"{a['identical']}/{a['answers']}",
                    f"{e['kl_mean']:.5f}",
                    f"{e['kl_max']:.3f}",
                    f"{e['logprob_change_max']:.3f}",
                    f"{e['top1_agreement']:.4f}",
                    f"{e['corpus_perplexity']:.3f}",
                )
            )
        )
    if not opts.no_save:
        payload = {**result, "threads": threads, **provenance()}
        write_results("kv_dtype", payload, viz.quantization.kv_dtype_summary(result))
