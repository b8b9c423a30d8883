"""``python -m paged_attention bench engine``: our engine against transformers' own generation loops.

The three contenders (``paged-engine``: this package; ``hf-static``: ``model.generate`` on padded
batches of ``--batch-size`` requests; ``hf-continuous``: transformers' continuous batching), the
workload and the shared KV budget are :mod:`paged_attention.experiments.engine_vs_transformers`.
The score is *useful* output tokens per second; it also reports how much of our engine's step time
goes to bookkeeping rather than to the model, at 32+ running sequences.

``--dtype`` names the dtype to load the model in (default ``auto``); with two or more, the command
compares the dtypes instead (:mod:`.dtypes`): decode tokens/s at ``--batch-sizes`` sequences, the
step against the weight-read bound, greedy agreement; written to ``figures/dtypes.{json,png}``.
"""

from __future__ import annotations

import argparse
import re

from ...experiments import engine_vs_transformers as versus
from ...experiments.provenance import provenance
from ...models import explain_dtype
from ...models.pretrained import find_pretrained
from .._threads import set_threads
from . import dtypes
from ._results import write_results


def _print_run(name: str, result: dict | Exception) -> None:
    if isinstance(result, Exception):
        print(f"{name} failed: {type(result).__name__}: {result}")
    else:
        print(f"  {name}: {result['seconds']:.1f} s")


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench engine", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model", default=None, help="checkpoint folder, cached hub name or smollm2 (default: embedded)"
    )
    parser.add_argument("--requests", type=int, default=64, help="fewer for a quick run")
    parser.add_argument("--batch-size", type=int, default=None, help="static batch size (sets the KV budget)")
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--output-lens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="the paged engine's running-sequence cap"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None, help="runs per method; the fastest counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 2, 1 if busy)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["hf-static", "hf-continuous"])
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["auto"],
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the model's dtype; two or more: compare them (decode speed, weight-read bound, agreement)",
    )
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 16, 64], help="with several --dtype: sequences"
    )
    parser.add_argument(
        "--compile", action="store_true", help="with several --dtype: the engine compiled (mode 3)"
    )
    parser.add_argument("--no-save", action="store_true", help="print only: write nothing to figures/")
    opts = parser.parse_args(args)
    if opts.compile and len(opts.dtype) < 2:
        parser.error("--compile applies to a comparison of dtypes: name two or more with --dtype")
    if len(opts.dtype) > 1:
        threads = set_threads(opts.threads)
        dtypes.run(opts.model, opts.dtype, opts.batch_sizes, threads, not opts.no_save, opts.compile)
        return
    setup = versus.default_setup(opts.model)
    batch_size = opts.batch_size or setup["batch_size"]
    prompt_lens = tuple(opts.prompt_lens or setup["prompt_lens"])
    output_lens = tuple(opts.output_lens or setup["output_lens"])
    repeats = opts.repeats or setup["repeats"]
    threads = set_threads(opts.threads)
    ours_model, tokenizer, hf_model = versus.load_models(opts.model, opts.dtype[0])
    print(f"dtype: {explain_dtype(opts.model, opts.dtype[0])}")
    if not versus.has_continuous_batching(hf_model) and "hf-continuous" not in opts.skip:
        print("this transformers has no continuous batching (generate_batch): hf-continuous skipped")
        opts.skip.append("hf-continuous")
    work = versus.make_workload(
        opts.requests, ours_model.config.vocab_size, opts.seed, prompt_lens, output_lens
    )
    print(
        f"model {opts.model or 'embedded'}: {opts.requests} requests, "
        f"prompts {prompt_lens[0]}-{prompt_lens[1]} tokens, outputs {output_lens[0]}-{output_lens[1]} "
        f"tokens, EOS ignored ({work.useful_tokens} in all), "
        f"static batch size {batch_size}, torch threads {threads}"
    )
    kv_slots = versus.static_batch_slots(work, batch_size)
    print(f"KV budget of both batched methods: {kv_slots} token slots (one padded static batch)")
    results = versus.compare(
        ours_model, tokenizer, hf_model, work, batch_size, opts.max_num_seqs, repeats, opts.skip, _print_run
    )
    ours = results["paged-engine"]
    print(f"\n{'method':>14} {'seconds':>8} {'useful tok/s':>13} {'paged-engine is':>16} {'same tokens':>12}")
    methods = {}
    for name, r in results.items():
        same = versus.same_outputs(r, ours)
        methods[name] = {"seconds": r["seconds"], "tokens_per_s": work.useful_tokens / r["seconds"],
                         "paged_faster": r["seconds"] / ours["seconds"], "same_tokens": same}  # fmt: skip
        print(
            f"{name:>14} {r['seconds']:>8.1f} {work.useful_tokens / r['seconds']:>13.0f} "
            f"{r['seconds'] / ours['seconds']:>15.2f}x {same:>6}/{len(work.prompts)}"
        )
    print(
        f"\npaged-engine: up to {ours['peak_batch']} sequences per step in that KV memory, "
        f"{ours['preemptions']} preemptions; best of {repeats} run(s) each, torch threads {threads}"
    )
    print(
        f"paged-engine overhead over the {ours['overhead_steps']} steps with >= {ours['busy_batch']} "
        f"sequences "
        f"({ours['steps']} steps in all): {ours['outside_forward']:.1%} of step time outside the model "
        f"forward; bookkeeping {ours['overhead']:.1%} (scheduler + allocator {ours['schedule_share']:.1%}, "
        f"batch packing {ours['overhead'] - ours['schedule_share']:.1%})"
    )
    if not opts.no_save:
        keys = ("peak_batch", "preemptions", "overhead_steps", "busy_batch", "steps", "outside_forward",
                "overhead", "schedule_share")  # fmt: skip
        payload = {
            "model": opts.model or "embedded", "dtype": explain_dtype(opts.model, opts.dtype[0]),
            "threads": threads, "requests": opts.requests, "prompt_lens": prompt_lens,
            "output_lens": output_lens, "batch_size": batch_size, "kv_slots": kv_slots,
            "useful_tokens": work.useful_tokens, "repeats": repeats, "methods": methods,
            "paged": {k: ours[k] for k in keys}, **provenance(),
        }  # fmt: skip
        write_results(results_name(opts.model), payload, None)


def results_name(model: str | None) -> str:
    """``engine`` for the embedded model, ``engine_smollm2`` for SmolLM2, else ``engine_<name>``."""
    if model is None:
        return "engine"
    spec = find_pretrained(model)
    slug = spec.folder.split("-")[0] if spec else re.sub(r"[^A-Za-z0-9]+", "_", str(model).strip("/"))
    return f"engine_{slug}".lower()
