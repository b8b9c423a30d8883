"""What the server costs over the engine: the same requests through HTTP and through ``LLM``-style
offline calls, in one run (``bench serve --compare-offline``).

* **Throughput at saturation**: every request sent at once (rate ``inf``) to the server, against the
  same requests added to an engine built with the same settings and stepped to the end in-process;
  both warm (each after one unmeasured pass of other requests of the same shape).
  Output tokens per second, and their ratio (1.0 would mean the server adds nothing).
* **TTFT at low load**: one request at a time; the client's time to first token through the server
  against the offline time from ``add_request`` to the first ``step()`` that returns a token.

The server runs as a child process while the client runs here, twice: with its engine core in a
process of its own (the default, vLLM v1's) and on a thread of the server's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the CPU time each process used says how much of the second
core the split puts to work. The offline engine runs here after the servers have stopped, with the
same thread count.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

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


#: Where the server's engine core runs: vLLM's switch, ``VLLM_ENABLE_V1_MULTIPROCESSING``.
PLACEMENTS = {"process": "1", "thread": "0"}


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a Linux process has used so far, its threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def engine_core_pid(front: int) -> int | None:
    """The child process of a server (pid ``front``) that runs its engine core, if it has one."""
    found = [c for c in children(front) if "engine_core" in Path(f"/proc/{c}/cmdline").read_text()]
    return found[0] if found else None


def serve_once(
    serve_args: Sequence[str], placement: str, num_requests: int, num_low_load: int, length_scale: float,
    seed: int, report: Callable[[str], None],
) -> tuple[dict, list[LoadRequest], list[LoadRequest]]:  # fmt: skip
    """One server (its engine core in ``placement``): all requests at once (with the CPU time its
    front and its core used meanwhile), then a few one at a time; returns the measurements, the
    requests, and those of the unmeasured first pass."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": PLACEMENTS[placement]}
    with ServerProcess(serve_args, env=env) as server:
        assert server.process is not None
        front = server.process.pid
        core = engine_core_pid(front)
        requests, model = asyncio.run(
            workload_from_server(server.url, "sharegpt", num_requests, length_scale, seed=seed)
        )
        # one unmeasured pass first, of other prompts (nothing for the prefix cache): a fresh process
        # meets each batch shape once (oneDNN's primitives, the kernels' first calls), as the
        # offline engine has before it is measured
        warm, _ = asyncio.run(
            workload_from_server(server.url, "sharegpt", num_requests, length_scale, seed=seed + 1)
        )
        asyncio.run(run_load(server.url, warm, float("inf"), model=model, seed=seed))
        before = {pid: cpu_seconds(pid) for pid in (front, core) if pid is not None}
        results, duration = asyncio.run(run_load(server.url, requests, float("inf"), model=model, seed=seed))
        used = {pid: (cpu_seconds(pid) - seconds) / duration for pid, seconds in before.items()}
        saturated = summarize(results, duration)
        report(
            f"server (engine core in a {placement}), all {num_requests} at once: "
            f"{saturated['output_throughput']:.1f} output tokens/s"
        )
        low_load, low_duration = asyncio.run(
            run_load(server.url, requests[:num_low_load], float("inf"), model=model, max_concurrency=1)
        )
        low = summarize(low_load, low_duration)
    return (
        {
            "output_throughput": saturated["output_throughput"],
            "completed": saturated["completed"],
            "low_load_ttft_mean_s": low["ttft_s"]["mean"],
            "low_load_completed": low["completed"],
            "front_cpu_cores": used[front],  # CPU seconds per second of the saturated run
            "core_cpu_cores": used.get(core),  # (None: the core is a thread of the front)
        },
        requests,
        warm,
    )


def run(
    serve_args: Sequence[str],
    build_engine: Callable[[], LLMEngine],
    num_requests: int = 32,
    num_low_load: int = 16,
    length_scale: float = 0.125,
    seed: int = 0,
    repeats: int = 3,
    report: Callable[[str], None] = print,
) -> dict:
    """Both measurements (see the module docstring) for a server whose engine core runs in its own
    process (``server``, the default) and on a thread of the server's process (``server_thread``),
    and offline; ``build_engine`` builds the offline engine with the server's settings. The three
    alternate ``repeats`` times (this machine's speed drifts by 10% and more between minutes); each
    number reported is the median over the rounds, each ratio the median of the rounds' ratios."""
    args = (num_requests, num_low_load, length_scale, seed, report)
    engine: LLMEngine | None = None
    rounds = []
    for _ in range(repeats):
        server, requests, warm = serve_once(serve_args, "process", *args)
        thread, _, _ = serve_once(serve_args, "thread", *args)
        if engine is None:
            engine = build_engine()
            offline_throughput(engine, warm)  # the same unmeasured first pass as each server's
        engine.reset_prefix_cache()  # as a fresh server's: nothing cached from the round before
        seconds, tokens = offline_throughput(engine, requests)
        report(f"offline, all {num_requests} at once: {tokens / seconds:.1f} output tokens/s")
        first_token = statistics.fmean(offline_first_token(engine, requests[:num_low_load]))
        offline = {
            "output_throughput": tokens / seconds,
            "output_tokens": tokens,
            "first_token_mean_s": first_token,
        }
        rounds.append({"server": server, "server_thread": thread, "offline": offline})

    def median(part: str, field: str) -> float:
        return statistics.median(r[part][field] for r in rounds if r[part][field] is not None)

    def ratio(part: str) -> float:
        return statistics.median(
            r[part]["output_throughput"] / r["offline"]["output_throughput"] for r in rounds
        )

    def later(part: str) -> float:
        return statistics.median(
            r[part]["low_load_ttft_mean_s"] - r["offline"]["first_token_mean_s"] for r in rounds
        )

    fields = {part: [k for k, v in rounds[0][part].items() if isinstance(v, float)] for part in rounds[0]}
    return {
        **provenance(),
        "setup": {
            "serve_args": list(serve_args),
            "num_requests": num_requests,
            "num_low_load": num_low_load,
            "length_scale": length_scale,
            "seed": seed,
            "repeats": repeats,
            "torch_threads_offline": torch.get_num_threads(),
        },
        **{part: {k: median(part, k) for k in keys} for part, keys in fields.items()},
        "throughput_ratio": ratio("server"),
        "ttft_difference_s": later("server"),
        "thread_throughput_ratio": ratio("server_thread"),
        "thread_ttft_difference_s": later("server_thread"),
        "rounds": rounds,
    }
