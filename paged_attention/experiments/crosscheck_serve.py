"""Each engine's load generator against the other's server: the wire protocol, both ways.

* vLLM's own client, ``vllm bench serve`` (random prompts, streaming completions), against
  ``python -m paged_attention serve``;
* this package's ``bench serve`` (streaming chat completions) against ``vllm serve``.

Both run unchanged, on 127.0.0.1 and free ports, with a bounded number of requests; each summary is
saved. What is checked is that every request completed; the timings are kept, not asserted (two
engines and a client share two cores). While each server is up, it also answers the requests of
:mod:`.crosscheck_echo` (``echo``, ``logprobs``, ``prompt_logprobs``), saved for the comparison.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..serving.launch import LOCALHOST, ServerProcess, free_port, wait_healthy
from .crosscheck_echo import ask

NUM_PROMPTS = 16  # requests each load generator sends: every one must complete


def vllm_client_against_ours(
    vllm_bin: str, model: str, out: Path, num_prompts: int = NUM_PROMPTS
) -> dict[str, Any]:
    """``vllm bench serve`` against this package's server; vLLM's summary (its JSON)."""
    result = out / "vllm-bench-serve-against-ours.json"
    server_args = ["--model", model, "--dtype", "float32", "--threads", "1", "--max-model-len", "1024"]
    with ServerProcess(server_args, log=out / "ours-server.log") as server:
        done = subprocess.run(
            [vllm_bin, "bench", "serve", "--backend", "vllm", "--base-url", server.url, "--model", model,
             "--tokenizer", model, "--dataset-name", "random", "--random-input-len", "64",
             "--random-output-len", "32", "--num-prompts", str(num_prompts), "--request-rate", "inf",
             "--seed", "0", "--save-result", "--result-dir", str(out), "--result-filename", result.name],
            env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        (out / "echo-ours.json").write_text(json.dumps(ask(server.url)))
    (out / "vllm-bench-serve.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(result.read_text())


def our_client_against_vllm(vllm_bin: str, model: str, out: Path, env: dict[str, str],
                            num_prompts: int = NUM_PROMPTS) -> dict[str, Any]:  # fmt: skip
    """This package's ``bench serve`` against ``vllm serve`` (eager, float32); our summary."""
    port = free_port()
    url = f"http://{LOCALHOST}:{port}"
    result = out / "bench-serve-against-vllm.json"
    with open(out / "vllm-server.log", "w") as log:
        server = subprocess.Popen(
            [vllm_bin, "serve", model, "--host", LOCALHOST, "--port", str(port), "--dtype", "float32",
             "--max-model-len", "1024", "--enforce-eager", "--block-size", "32"],
            env={**os.environ, "HF_HUB_OFFLINE": "1", **env}, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_healthy(url, timeout=600, process=server)
            done = subprocess.run(
                [sys.executable, "-m", "paged_attention", "bench", "serve", "--base-url", url,
                 "--num-prompts", str(num_prompts), "--workload", "chat", "--max-tokens", "32",
                 "--result-file", str(result)],
                capture_output=True, text=True, timeout=900,
            )  # fmt: skip
            (out / "echo-vllm.json").write_text(json.dumps(ask(url)))
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    (out / "bench-serve.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(
            f"bench serve against vllm serve failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(result.read_text())
