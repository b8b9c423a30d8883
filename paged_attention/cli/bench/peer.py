"""``python -m paged_attention bench peer``: offline throughput beside the real vLLM, alternating runs.

Needs vLLM's CPU build in ``.venv-vllm`` (``make crosscheck`` installs it). The same token-id
workload on both engines (:mod:`paged_attention.experiments.peer`), one compute thread each, vLLM
compiled as it runs by default; prints each run's output tokens/s and the ratio of medians, and
writes ``figures/peer.json`` (README block) unless ``--no-save``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ...experiments import peer
from ...experiments.provenance import provenance
from ._results import write_results


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench peer", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--vllm-python", default=".venv-vllm/bin/python", help="the Python of vLLM's venv (make crosscheck's)"
    )
    parser.add_argument(
        "--dtype", nargs="+", default=["bfloat16", "float32"], help="one row each (default bfloat16 float32)"
    )
    parser.add_argument("--requests", type=int, default=64, help="requests of the workload (default 64)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default 128)")
    parser.add_argument(
        "--runs", type=int, default=2, help="alternating runs per engine and dtype (default 2)"
    )
    parser.add_argument(
        "--compile", action="store_true", help="this engine compiled too (compilation_config=3), as vLLM is"
    )
    parser.add_argument("--no-save", action="store_true", help="print only: write nothing to figures/")
    opts = parser.parse_args(args)
    from ...models.pretrained import pretrained_path
    from ...models.resolve import load_tokenizer

    vllm_python = Path(opts.vllm_python)
    if not vllm_python.exists():
        raise SystemExit(f"no {vllm_python}: `make crosscheck` installs vLLM's CPU build there first")
    model = str(pretrained_path())
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = load_tokenizer(model)
        result = peer.measure(str(vllm_python.absolute()), sys.executable, model, tokenizer, Path(folder),
                              opts.dtype, opts.requests, opts.max_tokens, opts.runs,
                              compiled=opts.compile)  # fmt: skip
    print(f"{'dtype':10}{'vLLM tokens/s':>22}{'this engine':>22}{'ratio':>8}  same first tokens")
    for row in result["rows"]:
        theirs = ", ".join(f"{v:.1f}" for v in row["vllm_tokens_per_s"])
        ours = ", ".join(f"{v:.1f}" for v in row["ours_tokens_per_s"])
        print(f"{row['dtype']:10}{theirs:>22}{ours:>22}{row['ratio']:>8.2f}  {row['same_first_tokens']} of "
              f"{opts.requests}")  # fmt: skip
    if not opts.no_save:
        payload = {**result, **provenance(), "threads": 1, "runs": opts.runs}
        write_results("peer", payload, None)
