"""What the server costs over the engine: the same requests through HTTP and through ``LLM``-style
offline calls, in one run (``bench serve --compare-offline``).

* **Throughput at saturation**: every request sent at once (rate ``inf``) to the server, against the
  same requests added to an engine built with the same settings and stepped to the end in-process.
  Output tokens per second, and their ratio (1.0 would mean the server adds nothing).
* **TTFT at low load**: one request at a time; the client's time to first token through the server
  against the offline time from ``add_request`` to the first ``step()`` that returns a token.

The server runs as a child process (1 torch thread by default) while the client runs here; the
offline engine runs here after the server has stopped, with the same thread count.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ..engine.llm_engine import LLMEngine
from ..engine.params import SamplingParams
from ..serving.launch import ServerProcess
from .latency_stats import summarize
from .loadgen import LoadRequest, run_load, workload_from_server
from .provenance import provenance


def _params(request: LoadRequest) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=request.ignore_eos)


def offline_throughput(engine: LLMEngine, requests: Sequence[LoadRequest]) -> tuple[float, int]:
    """Seconds to serve every request at once through ``engine``, and the output tokens made."""
    start = time.perf_counter()
    for request in requests:
        engine.add_request(None, {"prompt_token_ids": list(request.prompt or [])}, _params(request))
    tokens = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens += sum(len(o.token_ids) for o in output.outputs)
    return time.perf_counter() - start, tokens


def offline_first_token(engine: LLMEngine, requests: Sequence[LoadRequest]) -> list[float]:
    """Each request alone: seconds from ``add_request`` to the first step that returns a token."""
    times = []
    for request in requests:
        start = time.perf_counter()
        request_id = engine.add_request(
            None, {"prompt_token_ids": list(request.prompt or [])}, _params(request)
        )
        while not any(o.outputs[0].token_ids for o in engine.step() if o.request_id == request_id):
            pass
        times.append(time.perf_counter() - start)
        engine.abort_request(request_id)
    return times


def run(
    serve_args: Sequence[str],
    build_engine: Callable[[], LLMEngine],
    num_requests: int = 32,
    num_low_load: int = 8,
    length_scale: float = 0.125,
    seed: int = 0,
    report: Callable[[str], None] = print,
) -> dict:
    """Both measurements (see the module docstring); ``build_engine`` builds the offline engine
    with the server's settings."""
    with ServerProcess(serve_args) as server:
        requests, model = asyncio.run(
            workload_from_server(server.url, "sharegpt", num_requests, length_scale, seed=seed)
        )
        results, duration = asyncio.run(run_load(server.url, requests, float("inf"), model=model, seed=seed))
        saturated = summarize(results, duration)
        report(f"server, all {num_requests} at once: {saturated['output_throughput']:.1f} output tokens/s")
        low_load, low_duration = asyncio.run(
            run_load(server.url, requests[:num_low_load], float("inf"), model=model, max_concurrency=1)
        )
        low = summarize(low_load, low_duration)
    engine = build_engine()
    offline_first_token(engine, requests[:1])  # warm up, as the server's first requests warmed it
    seconds, tokens = offline_throughput(engine, requests)
    report(f"offline, all {num_requests} at once: {tokens / seconds:.1f} output tokens/s")
    first_token = offline_first_token(engine, requests[:num_low_load])
    offline_ttft = statistics.fmean(first_token)
    return {
        **provenance(),
        "setup": {
            "serve_args": list(serve_args),
            "num_requests": num_requests,
            "num_low_load": num_low_load,
            "length_scale": length_scale,
            "seed": seed,
            "torch_threads_offline": torch.get_num_threads(),
        },
        "server": {
            "output_throughput": saturated["output_throughput"],
            "completed": saturated["completed"],
            "low_load_ttft_mean_s": low["ttft_s"]["mean"],
            "low_load_completed": low["completed"],
        },
        "offline": {
            "output_throughput": tokens / seconds,
            "output_tokens": tokens,
            "first_token_mean_s": offline_ttft,
        },
        "throughput_ratio": saturated["output_throughput"] / (tokens / seconds),
        "ttft_difference_s": low["ttft_s"]["mean"] - offline_ttft,
    }
