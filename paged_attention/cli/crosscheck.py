"""``python -m paged_attention crosscheck``: the same cases on this engine and on the real vLLM.

``make crosscheck`` builds ``.venv-vllm`` (vLLM's CPU build, pinned) and runs this. It prints one
line per case (what matched, what differed and why) and exits non-zero on any difference in tokens
or fields; ``--peer`` also measures both engines' offline throughput (:mod:`.bench.peer`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

VLLM_PYTHON = ".venv-vllm/bin/python"
#: vLLM's CPU settings: 1 GiB of KV cache; its worker on core 0 (the probe's own process waits).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention crosscheck", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--vllm-python", default=VLLM_PYTHON, help=f"vLLM's Python (default {VLLM_PYTHON})")
    parser.add_argument("--out", default="build/crosscheck", help="where the answers and the report go")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per case (default 32)")
    opts = parser.parse_args(argv)
    from ..experiments.crosscheck import compare, run_probe, table
    from ..experiments.crosscheck_cases import cases
    from ..models.pretrained import pretrained_path

    if not Path(opts.vllm_python).exists():
        print(
            f"no {opts.vllm_python}: `make crosscheck` installs vLLM's CPU build there first", file=sys.stderr
        )
        return 2
    out = Path(opts.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    spec = cases(str(pretrained_path()), opts.max_tokens)
    (out / "cases.json").write_text(json.dumps(spec, indent=1))
    start = time.perf_counter()
    theirs = run_probe(
        str(Path(opts.vllm_python).absolute()), "vllm", out / "cases.json", out / "vllm.json", VLLM_ENV
    )
    ours = run_probe(sys.executable, "paged_attention", out / "cases.json", out / "paged_attention.json",
                     {"OMP_NUM_THREADS": "1"})  # fmt: skip
    checks = compare(ours, theirs)
    print(
        f"vLLM {theirs['version']} (ready in {theirs['ready_seconds']:.0f} s) against paged-attention "
        f"{ours['version']} (ready in {ours['ready_seconds']:.0f} s), float32, SmolLM2-135M-Instruct"
    )
    print(table(checks))
    failed = [c.name for c in checks if not c.ok]
    report = {
        "vllm": theirs["version"],
        "seconds": round(time.perf_counter() - start),
        "cases": [dataclasses.asdict(c) for c in checks],
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(
        f"{len(checks) - len(failed)} of {len(checks)} cases the same"
        + (f"; differ: {failed}" if failed else "")
    )
    return 1 if failed else 0
