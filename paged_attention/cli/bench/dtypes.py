"""``python -m paged_attention bench engine --dtype float32 bfloat16``: the dtypes side by side.

Decode tokens/s at each batch size, the step against the weight-read and arithmetic bounds, and
greedy agreement with the first dtype (:mod:`paged_attention.experiments.dtypes`); writes
``figures/dtypes.{json,png}``, or with ``--compile`` (the engine compiled)
``figures/dtypes_compiled.{json,png}``.
"""

from __future__ import annotations

from ... import viz
from ...experiments import dtypes
from ...experiments.provenance import provenance
from ._results import write_results


def run(
    model: str | None,
    names: list[str],
    batch_sizes: list[int],
    threads: int,
    save: bool,
    compiled: bool = False,
) -> dict:
    """Measure, print and (if ``save``) write the comparison of ``names``, the engine compiled if
    ``compiled``."""
    mode = "compiled" if compiled else "eager"
    print(f"model {model or 'embedded'}, dtypes {', '.join(names)}, {mode}, torch threads {threads}")
    result = dtypes.compare(model, names, batch_sizes, compiled=compiled)
    read, copy = (result["bandwidth"][k] / 1e9 for k in ("read", "copy"))
    print(
        f"memory bandwidth, streaming {dtypes.PROBE_BYTES >> 20} MiB: read {read:.1f} GB/s, "
        f"copy {copy:.1f} GB/s (bytes copied)"
    )
    rates = ", ".join(f"{d} {r * 2 / 1e9:.0f}" for d, r in result["multiply_adds_per_s"].items())
    print(f"one large product ({dtypes.RATE_ROWS} rows), GFLOP/s: {rates}")
    first = result["rows"][0]["dtype"]
    speed = dtypes.speedups(result, first)
    header = ("dtype", "seqs", "ms/step", "tok/s", f"vs {first}", "bound ms", "arith. ms", "prod. ms")
    header += ("step/bound", "step/roof", "step/floor")
    print("\n" + " ".join(f"{h:>10}" for h in header))
    for r in result["rows"]:
        cells = (
            r["dtype"],
            str(r["batch"]),
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['tokens_per_s']:.1f}",
            f"{speed[r['dtype']][r['batch']]:.2f}x",
            f"{r['bound_s'] * 1e3:.1f}",
            f"{r['arithmetic_s'] * 1e3:.1f}",
            f"{r['products_s'] * 1e3:.1f}",
            f"{r['step_s'] / r['bound_s']:.2f}x",
            f"{r['step_s'] / dtypes.roof_seconds(r):.2f}x",
            f"{r['step_s'] / dtypes.floor_seconds(r):.2f}x",
        )
        print(" ".join(f"{c:>10}" for c in cells))
    print(f"\ngreedy answers ({result['max_tokens']} tokens, all prompts in one batch) against {first}:")
    for name, a in result["agreement"].items():
        diffs = sorted(a["first_difference"])
        where = f"; the others first differ at tokens {diffs}" if diffs else ""
        print(f"  {name}: {a['identical']}/{a['prompts']} identical{where}")
    print(f"\ndtype='auto' here: {result['auto']}")
    if save:
        payload = {**result, "model": model, "threads": threads, **provenance()}
        name = "dtypes_compiled" if compiled else "dtypes"
        write_results(name, payload, viz.dtypes.step_vs_bound(result))
    return result
