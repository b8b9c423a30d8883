"""``python -m paged_attention crosscheck``: the same cases on this engine and on the real vLLM.

``make crosscheck`` builds ``.venv-vllm`` (vLLM's CPU build, pinned) and runs this. Three parts:
the offline API's cases (:mod:`..experiments.crosscheck_cases`), vLLM's offline examples
(:mod:`..experiments.crosscheck_examples`), and each engine's load generator against the other's
server (:mod:`..experiments.crosscheck_serve`); then a short offline throughput comparison (the
``bench peer`` workload cut down: 16 requests, 32 output tokens, bfloat16, one run each; printed,
not asserted; ``bench peer`` measures the whole workload). It prints one line per case (what
matched, what differed and why) and exits non-zero on any difference in tokens or fields; ``--save``
also writes ``figures/crosscheck.json``, which README's block is made from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..experiments.crosscheck import Check

VLLM_PYTHON = ".venv-vllm/bin/python"
EXAMPLES = Path(__file__).resolve().parents[2] / "tests" / "vllm_examples"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention crosscheck", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--vllm-python", default=VLLM_PYTHON, help=f"vLLM's Python (default {VLLM_PYTHON})")
    parser.add_argument("--out", default="build/crosscheck", help="where the answers and the report go")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per case (default 32)")
    parser.add_argument("--no-examples", action="store_true", help="skip vLLM's offline examples")
    parser.add_argument(
        "--no-serve", action="store_true", help="skip the load generators against the servers"
    )
    parser.add_argument("--no-peer", action="store_true", help="skip the short throughput comparison")
    parser.add_argument("--save", action="store_true", help="also write figures/crosscheck.json (README)")
    opts = parser.parse_args(argv)
    from ..experiments.crosscheck import MISSING_FIELDS, Check, compare, run_probe, table
    from ..experiments.crosscheck_cases import cases
    from ..experiments.peer import VLLM_ENV
    from ..experiments.provenance import provenance
    from ..models.pretrained import pretrained_path
    from ..viz.style import figures_dir

    vllm_python = Path(opts.vllm_python).absolute()
    if not vllm_python.exists():
        print(f"no {vllm_python}: `make crosscheck` installs vLLM's CPU build there first", file=sys.stderr)
        return 2
    out = Path(opts.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = str(pretrained_path())
    spec = cases(model, opts.max_tokens)
    (out / "cases.json").write_text(json.dumps(spec, indent=1))
    start = time.perf_counter()
    theirs = run_probe(str(vllm_python), "vllm", out / "cases.json", out / "vllm.json", VLLM_ENV)
    ours = run_probe(sys.executable, "paged_attention", out / "cases.json", out / "paged_attention.json",
                     {"OMP_NUM_THREADS": "1"})  # fmt: skip
    checks = compare(ours, theirs)
    if not opts.no_examples:
        from ..experiments.crosscheck_examples import run_examples

        for run in run_examples(
            EXAMPLES, model, str(vllm_python), sys.executable, VLLM_ENV, out / "examples"
        ):
            checks.append(Check(f"example {run.name}", run.ok, [run.note], requests=run.compared))
    serving: dict[str, dict] = {}
    if not opts.no_serve:
        checks += _serve_checks(vllm_python.parent / "vllm", model, out / "serve", serving)
    peer_rows = []
    if not opts.no_peer:
        try:  # printed, not asserted: a failure here is reported and fails nothing
            peer_rows = _peer(str(vllm_python), model, out / "peer")
        except (RuntimeError, OSError, ValueError, KeyError, subprocess.SubprocessError) as error:
            print(f"the short throughput comparison did not run: {error}", file=sys.stderr)
    print(
        f"vLLM {theirs['version']} (ready in {theirs['ready_seconds']:.0f} s) against paged-attention "
        f"{ours['version']} (ready in {ours['ready_seconds']:.0f} s), float32, SmolLM2-135M-Instruct"
    )
    print(table(checks))
    for row in peer_rows:
        print(f"throughput, {row['dtype']}, 16 requests x 32 tokens: vLLM {row['vllm_tokens_per_s'][0]:.1f}, "
              f"this engine {row['ours_tokens_per_s'][0]:.1f} output tokens/s ({row['ratio']:.2f}x; one run "
              "each: `bench peer` measures the whole workload)")  # fmt: skip
    failed = [c.name for c in checks if not c.ok]
    report = {
        "vllm": theirs["version"],
        "paged_attention": ours["version"],
        "ready_seconds": {"vllm": round(theirs["ready_seconds"], 1), "ours": round(ours["ready_seconds"], 1)},
        "seconds": round(time.perf_counter() - start),
        "cases": [dataclasses.asdict(c) for c in checks],
        "missing_fields": MISSING_FIELDS,
        "serving": serving,
        "peer": peer_rows,
        **provenance(),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    if opts.save:
        path = figures_dir() / "crosscheck.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}")
    summary = f"{len(checks) - len(failed)} of {len(checks)} cases the same"
    print(summary + (f"; differ: {failed}" if failed else ""))
    return 1 if failed else 0


def _peer(vllm_python: str, model: str, out: Path) -> list[dict]:
    """The short throughput comparison (printed, not asserted)."""
    from ..experiments import peer
    from ..models.resolve import load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    result = peer.measure(
        vllm_python, sys.executable, model, load_tokenizer(model), out, ["bfloat16"], 16, 32, 1
    )
    return result["rows"]


def _serve_checks(vllm_bin: Path, model: str, out: Path, serving: dict[str, dict]) -> list:
    """Each load generator against the other engine's server: every request must complete."""
    from ..experiments.crosscheck import Check
    from ..experiments.crosscheck_serve import NUM_PROMPTS, our_client_against_vllm, vllm_client_against_ours
    from ..experiments.peer import VLLM_ENV

    out.mkdir(parents=True, exist_ok=True)
    checks = []
    runs = (
        (
            "vllm bench serve -> paged_attention serve",
            lambda: vllm_client_against_ours(str(vllm_bin), model, out),
        ),
        ("bench serve -> vllm serve", lambda: our_client_against_vllm(str(vllm_bin), model, out, VLLM_ENV)),
    )
    for name, run in runs:
        check = Check(name)
        try:
            summary = run()
        except (RuntimeError, OSError, TimeoutError, ValueError, subprocess.SubprocessError) as error:
            check.fail(str(error)[-300:])
        else:
            keep = ("completed", "num_prompts", "failed", "request_throughput", "output_throughput",
                    "mean_ttft_ms", "mean_tpot_ms", "total_output_tokens")  # fmt: skip
            serving[name] = {k: summary[k] for k in keep if k in summary}
            check.requests = int(summary.get("completed", 0))
            check.tokens = int(summary.get("total_output_tokens", summary.get("output_tokens", 0)) or 0)
            if check.requests != NUM_PROMPTS:
                check.fail(f"{check.requests} of {NUM_PROMPTS} requests completed")
            else:
                check.notes.append("every request completed")
        checks.append(check)
    checks.append(_echo_check(out))
    return checks


def _echo_check(out: Path) -> Check:
    """The same echo / logprobs / prompt_logprobs requests, answered by both servers: compared."""
    from ..experiments.crosscheck import LOGPROB_TOL, Check
    from ..experiments.crosscheck_echo import REQUESTS, compare

    check = Check("echo, logprobs, prompt_logprobs: ours vs vllm serve")
    try:
        ours, theirs = (json.loads((out / f"echo-{who}.json").read_text()) for who in ("ours", "vllm"))
    except (OSError, ValueError) as error:
        check.fail(f"no answers to compare: {error}")
        return check
    check.requests = len(REQUESTS)
    compare(check, ours, theirs)
    if check.ok:
        check.notes.append(f"texts, tokens, usage, ranks the same; log-probabilities within {LOGPROB_TOL:g}")
    return check
