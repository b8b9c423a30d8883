"""``python -m paged_attention bench serve``: a load generator against an OpenAI-compatible server.

In the shape of ``vllm bench serve``: requests arrive at ``--request-rate`` (Poisson, or gamma with
``--burstiness``; ``inf`` sends all at once), stream, and are timed by the client; it prints TTFT,
TPOT, inter-token and end-to-end latency (mean, median, p99), throughput and goodput under
``--goodput`` SLOs, and writes the JSON with ``--result-file``. It speaks HTTP only: point
``--base-url`` at any server, this package's or ``vllm serve`` on a GPU machine; or let it start
this package's server for the run with ``--launch "<serve arguments>"`` (127.0.0.1, a free port).

``--compare-offline`` measures what the server costs: the same requests through a launched server
and through an engine built with the same arguments, in one run
(:mod:`paged_attention.experiments.server_overhead`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
from pathlib import Path

from ...experiments import server_overhead
from ...experiments.latency_stats import SLO_METRICS, summarize
from ...experiments.loadgen import WORKLOADS, run_load, workload_from_server
from ...serving.launch import ServerProcess
from ...viz import figures_dir
from .._threads import set_threads
from ..serve import build_engine
from ..serve import parser as serve_parser

DEFAULT_LAUNCH = "--model smollm2 --threads 1 --num-kv-blocks 64 --max-model-len 256"


def _slos(items: list[str]) -> dict[str, float]:
    """``ttft:2000 tpot:200`` (milliseconds) as ``{"ttft": 2.0, "tpot": 0.2}`` (seconds)."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise SystemExit(f"--goodput takes NAME:MILLISECONDS with NAME in {SLO_METRICS}, got {item!r}")
        slos[name] = float(value) / 1000
    return slos


def print_summary(summary: dict) -> None:
    print(f"{'completed':<28}{summary['completed']} ({summary['failed']} failed)")
    print(f"{'duration':<28}{summary['duration_s']:.2f} s")
    print(f"{'request throughput':<28}{summary['request_throughput']:.2f} req/s")
    print(f"{'output token throughput':<28}{summary['output_throughput']:.1f} tok/s")
    print(f"{'total token throughput':<28}{summary['total_token_throughput']:.1f} tok/s")
    if "goodput" in summary:
        print(f"{'goodput':<28}{summary['goodput']:.2f} req/s ({summary['good_requests']} met every SLO)")
    print(f"\n{'ms':<20}{'mean':>10}{'median':>10}{'p99':>10}")
    for key, name in (
        ("ttft_s", "TTFT"),
        ("tpot_s", "TPOT"),
        ("itl_s", "ITL"),
        ("e2el_s", "E2EL"),
        ("normalized_latency_s_per_token", "E2EL / token"),
    ):
        row = summary[key]
        print(f"{name:<20}{row['mean'] * 1000:>10.1f}{row['median'] * 1000:>10.1f}{row['p99'] * 1000:>10.1f}")
    for error, count in summary["errors"].items():
        print(f"error x{count}: {error}")


def _load(opts: argparse.Namespace, url: str) -> dict:
    requests, model = asyncio.run(
        workload_from_server(
            url, opts.workload, opts.num_prompts, opts.length_scale, opts.max_tokens, opts.seed
        )
    )
    results, duration = asyncio.run(
        run_load(
            url,
            requests,
            opts.request_rate,
            opts.burstiness,
            opts.seed,
            model,
            opts.max_concurrency,
            opts.temperature,
        )
    )
    summary = summarize(results, duration, _slos(opts.goodput))
    summary["setup"] = {k: v for k, v in vars(opts).items() if k != "result_file"}
    return summary


def main(args: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m paged_attention bench serve", description=__doc__.split("\n")[0]
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server")
    p.add_argument(
        "--launch",
        default=None,
        metavar="ARGS",
        help=f"start our server with these serve arguments for the run (e.g. {DEFAULT_LAUNCH!r})",
    )
    p.add_argument("--workload", choices=WORKLOADS, default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, or inf (default)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier")
    p.add_argument("--length-scale", type=float, default=0.125, help="sharegpt: lengths x this (CPU-sized)")
    p.add_argument("--max-tokens", type=int, default=64, help="chat: the answer's cap")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--goodput", nargs="*", default=[], metavar="NAME:MS", help="SLOs, e.g. ttft:2000 tpot:200"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--result-file",
        type=Path,
        default=None,
        help="write the summary as JSON here (--compare-offline: figures/serve_overhead.json by default)",
    )
    p.add_argument("--repeats", type=int, default=3, help="--compare-offline: alternating rounds (default 3)")
    p.add_argument(
        "--compare-offline",
        action="store_true",
        help="server vs offline engine on the same requests (launches --launch or the default)",
    )
    opts = p.parse_args(args)
    if opts.compare_offline:
        launch = shlex.split(opts.launch or DEFAULT_LAUNCH)
        serve_opts = serve_parser().parse_args(launch)
        threads = set_threads(serve_opts.threads)
        print(f"server: serve {' '.join(launch)}; offline engine in this process, torch threads {threads}")
        result = server_overhead.run(
            launch,
            lambda: build_engine(serve_opts),
            opts.num_prompts,
            length_scale=opts.length_scale,
            seed=opts.seed,
            repeats=opts.repeats,
        )
        offline = result["offline"]
        print(f"medians of {opts.repeats} rounds; offline: {offline['output_throughput']:.1f} output "
              f"tokens/s, first token at low load {offline['first_token_mean_s'] * 1000:.1f} ms")  # fmt: skip
        for key, name in (("", "process"), ("thread_", "thread")):
            s = result["server_thread" if key else "server"]
            print(
                f"engine core in a {name}: the server gives {result[key + 'throughput_ratio']:.3f}x the "
                f"offline output tokens/s, first token {result[key + 'ttft_difference_s'] * 1000:+.1f} ms "
                f"through HTTP; CPU cores used: front {s['front_cpu_cores']:.2f}"
                + (f", core {s['core_cpu_cores']:.2f}" if "core_cpu_cores" in s else "")
            )
    elif opts.launch is not None:
        with ServerProcess(shlex.split(opts.launch)) as server:
            print(f"launched: serve {opts.launch} at {server.url}")
            result = _load(opts, server.url)
        print_summary(result)
    else:
        result = _load(opts, opts.base_url)
        print_summary(result)
    if opts.compare_offline and opts.result_file is None:
        opts.result_file = figures_dir() / "serve_overhead.json"  # what the README's numbers come from
    if opts.result_file:
        opts.result_file.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {opts.result_file}")
