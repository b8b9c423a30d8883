"""The paper's Figure 12 measured: latency against request rate through the real server and model.

For each KV-cache manager (paged, and the contiguous Orca baselines Oracle and Max), one server is
started (``python -m paged_attention serve --kv-manager ...``, a child process on 127.0.0.1) with
the same model, the same KV bytes, the same scheduler and limits; the load generator
(:mod:`.loadgen`) then sends the same ShareGPT-like requests at each rate, Poisson arrivals, and
each client times its stream. Each point is a whole run's mean normalized latency (end-to-end
seconds / output tokens), TTFT and TPOT.

How this differs from the paper's setting (say it where the numbers are shown):

* **Step time grows with the batch here.** On an A100 a decode step of OPT-13B costs about the same
  for 1 or 30 sequences (it reads the weights once), so a manager that fits more sequences gets
  their tokens nearly free. On this CPU a step of 16 sequences costs a few times a step of 1, so
  the extra sequences paging admits cost time too: the ratio of sustained rates is smaller than the
  ratio of batch sizes, and smaller than on a GPU.
* The lengths are ShareGPT-like (:mod:`.traces`) scaled down (``length_scale``) and
  ``max_model_len`` with them, so that a CPU serves a few hundred requests in minutes; the KV budget
  is set so that Max fits only a few requests, as the paper's 2048-token reservations do on an A100.
* One model, one seed, a few dozen requests per rate: the knees are clear, the digits noisy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import httpx

from ..serving.launch import ServerProcess
from . import paper
from .latency_stats import summarize
from .loadgen import parse_metrics, run_load, workload_from_server
from .provenance import provenance
from .serve import sustainable_rate

MANAGERS = ("paged", "oracle", "max")
#: The default setup: SmolLM2, lengths / 8 (mean prompt ~20, output ~42 tokens), 256-token
#: reservations, 64 blocks of 16 (1,024 token slots: Max fits 4 requests).
SETUP = {
    "model": "smollm2",
    "length_scale": 0.125,
    "max_model_len": 256,
    "num_kv_blocks": 64,
    "block_size": 16,
    "max_num_seqs": 64,
    "num_requests": 32,
    "rates": (0.25, 0.5, 1.0, 1.5, 2.0, 3.0),
    "threads": 1,
    "seed": 0,
}
#: A manager sustains a rate while its mean normalized latency stays under this multiple of the
#: lowest one measured (the unloaded latency): the cost-model experiment's 2.5x, kept.
THRESHOLD_FACTOR = 2.5
#: Read from the server before and after each rate: tokens per engine step (the batch, in decode)
#: and preemptions, so that each point says how large the batches were.
STEP_TOKENS = "vllm:iteration_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"


def server_args(manager: str, setup: dict) -> list[str]:
    """The ``serve`` command line of one manager's server (prefix caching off: the baselines have none)."""
    flags = {"--model": setup["model"], "--kv-manager": manager, "--num-kv-blocks": setup["num_kv_blocks"],
             "--block-size": setup["block_size"], "--max-model-len": setup["max_model_len"],
             "--max-num-seqs": setup["max_num_seqs"], "--threads": setup["threads"], "--seed": setup["seed"],
             "--log-level": "warning"}  # fmt: skip
    return [*(str(part) for pair in flags.items() for part in pair), "--no-enable-prefix-caching"]


async def _sweep_one(url: str, setup: dict, report: Callable[[str], None]) -> list[dict]:
    requests, model = await workload_from_server(
        url, "sharegpt", setup["num_requests"], setup["length_scale"], seed=setup["seed"]
    )
    points = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for rate in setup["rates"]:
            before = parse_metrics((await client.get("/metrics")).text)
            results, duration = await run_load(url, requests, rate, 1.0, setup["seed"], model)
            after = parse_metrics((await client.get("/metrics")).text)
            summary = summarize(results, duration)
            summary["rate"] = rate
            steps = after[STEP_TOKENS + "_count"] - before[STEP_TOKENS + "_count"]
            step_tokens = after[STEP_TOKENS + "_sum"] - before[STEP_TOKENS + "_sum"]
            summary["tokens_per_step"] = step_tokens / max(1, steps)
            summary["preemptions"] = after[PREEMPTIONS] - before[PREEMPTIONS]
            points.append(summary)
            report(
                f"  {rate:>5g} req/s: {summary['completed']}/{len(results)} done in {duration:.0f} s, "
                f"normalized {summary['normalized_latency_s_per_token']['mean'] * 1000:.0f} ms/token, "
                f"TTFT {summary['ttft_s']['mean']:.2f} s, TPOT {summary['tpot_s']['mean'] * 1000:.0f} ms, "
                f"{summary['tokens_per_step']:.1f} tokens per step, {summary['preemptions']:.0f} preemptions"
            )
    return points


def run(
    setup: dict | None = None, managers: Sequence[str] = MANAGERS, report: Callable[[str], None] = print
) -> dict:
    """Every manager's curve, the rate each sustains and paging's ratios (see the module docstring)."""
    setup = {**SETUP, **(setup or {})}
    setup["rates"] = list(setup["rates"])
    curves: dict[str, list[dict]] = {}
    started = time.perf_counter()
    for manager in managers:
        report(f"{manager}: starting its server ({' '.join(server_args(manager, setup))})")
        with ServerProcess(server_args(manager, setup)) as server:
            curves[manager] = asyncio.run(_sweep_one(server.url, setup, report))
    return analyse(setup, curves, time.perf_counter() - started)


def analyse(setup: dict, curves: dict[str, list[dict]], seconds: float) -> dict:
    """Knees and ratios from the measured curves: the sustained rate of each manager is where its
    mean normalized latency crosses ``THRESHOLD_FACTOR`` x the lowest one measured."""
    latency = {
        m: [p["normalized_latency_s_per_token"]["mean"] for p in points] for m, points in curves.items()
    }
    threshold = THRESHOLD_FACTOR * min(min(v) for v in latency.values())
    sustained = {m: sustainable_rate(setup["rates"], v, threshold) for m, v in latency.items()}
    paged = sustained.get("paged", 0.0)
    return {
        **provenance(),
        "setup": setup,
        "seconds": seconds,
        "rates": setup["rates"],
        "normalized_latency": latency,
        "ttft_mean": {m: [p["ttft_s"]["mean"] for p in points] for m, points in curves.items()},
        "tpot_mean": {m: [p["tpot_s"]["mean"] for p in points] for m, points in curves.items()},
        "output_throughput": {m: [p["output_throughput"] for p in points] for m, points in curves.items()},
        "tokens_per_step": {m: [p.get("tokens_per_step") for p in points] for m, points in curves.items()},
        "points": curves,
        "threshold_s_per_token": threshold,
        "threshold_factor": THRESHOLD_FACTOR,
        "sustained_rate": sustained,
        "paged_over": {m: paged / r for m, r in sustained.items() if m != "paged" and r > 0},
        "paper_paged_over": {m: list(v) for m, v in paper.FIG12_SHAREGPT.items()},
    }
