"""Offline throughput beside the real vLLM: the same workload on both engines, alternating runs.

The workload (the yardstick of the speed issue): ``requests`` prompts of 27 to 300 tokens (seeded
lengths, cut from the tokenized prose of :mod:`..models.corpus` and the demo's questions), greedy,
``max_tokens`` output tokens each with ``ignore_eos``, ``max_model_len=512``, 1 GiB of KV cache, one
compute thread each (this engine: ``OMP_NUM_THREADS=1``; vLLM: its worker bound to core 0); then
the first prompt alone (batch 1), in the same process. vLLM
runs as a new user would run it: compiled (its default), its start-up not timed; this engine eager
(its default) or, with ``compiled``, compiled too. Runs alternate,
vLLM then this engine, ``runs`` times per dtype; the ratio is of the medians.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

from ..models.corpus import CORPUS
from .crosscheck import run_probe
from .prompts import QUESTIONS

#: vLLM's CPU settings (the cross-check's too): 1 GiB of KV cache, its worker on core 0.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
OURS_ENV = {"OMP_NUM_THREADS": "1"}


def workload(tokenizer: Any, requests: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """``requests`` token-id prompts of 27-300 tokens (seeded), as ``{"prompt_token_ids": [...]}``."""
    text = "\n\n".join([CORPUS, *QUESTIONS]) * 4
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for _ in range(requests):
        length = rng.randint(27, 300)
        start = rng.randrange(0, len(ids) - length)
        prompts.append({"prompt_token_ids": ids[start : start + length]})
    return prompts


def spec(
    model: str, dtype: str, prompts: list[dict], max_tokens: int, compiled: bool = False
) -> dict[str, Any]:
    """The probe's spec for one measured run (:mod:`.peer_probe`'s ``throughput`` case); ``compiled``:
    this engine with ``compilation_config=3`` (:mod:`..models.compilation`), compiled in ``LLM(...)``
    as vLLM is."""
    params = dict(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    case = {
        "name": "throughput",
        "kind": "throughput",
        "prompts": prompts,
        "warmup": prompts[:16],  # compiled code loaded and caches warm before the timed run
        "params": params,
    }
    # then one request alone (batch 1: every step reads all the weights for one token)
    alone = {**case, "name": "batch1", "prompts": prompts[:1], "warmup": prompts[1:2]}
    return {
        "engine_args": dict(model=model, dtype=dtype, max_model_len=512, seed=0),
        "paged_attention_args": dict(
            kv_cache_memory=2**30, **({"compilation_config": 3} if compiled else {})
        ),
        "cases": [case, alone],
    }


def measure(vllm_python: str, ours_python: str, model: str, tokenizer: Any, out: Path,
            dtypes: list[str], requests: int, max_tokens: int, runs: int,
            compiled: bool = False) -> dict[str, Any]:  # fmt: skip
    """Alternating runs (vLLM, this engine, ...) per dtype; tokens/s of each, the ratio of medians,
    and whether the greedy outputs' first tokens agreed."""
    import json

    prompts = workload(tokenizer, requests)
    result: dict[str, Any] = {
        "requests": requests,
        "max_tokens": max_tokens,
        "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
        "ours_compiled": compiled,
        "rows": [],
    }
    for dtype in dtypes:
        path = out / f"peer-{dtype}.json"
        path.write_text(json.dumps(spec(model, dtype, prompts, max_tokens, compiled)))
        speeds: dict[str, list[float]] = {"vllm": [], "ours": []}
        alone: dict[str, list[float]] = {"vllm": [], "ours": []}  # batch 1
        ready: dict[str, list[float]] = {"vllm": [], "ours": []}  # seconds from start (import) to ready
        first: dict[str, list] = {}
        for run in range(runs):
            for engine, python, env in (("vllm", vllm_python, VLLM_ENV), ("ours", ours_python, OURS_ENV)):
                name = "vllm" if engine == "vllm" else "paged_attention"
                answer = run_probe(
                    python, name, path, out / f"peer-{dtype}-{engine}-{run}.json", env, timeout=1800
                )
                r, one = answer["answers"]["throughput"], answer["answers"]["batch1"]
                speeds[engine].append(r["output_tokens"] / r["seconds"])
                alone[engine].append(one["output_tokens"] / one["seconds"])
                ready[engine].append(answer["ready_seconds"])
                first[engine] = r["first_tokens"]
                result[f"{engine}_version"] = answer["version"]
                print(f"{dtype} run {run + 1}: {engine} {speeds[engine][-1]:.1f} output tokens/s, batch 1 "
                      f"{alone[engine][-1]:.1f}", flush=True)  # fmt: skip
        same = sum(a == b for a, b in zip(first["vllm"], first["ours"], strict=True))
        vllm_median, ours_median = statistics.median(speeds["vllm"]), statistics.median(speeds["ours"])
        result["rows"].append(
            {
                "dtype": dtype,
                "vllm_tokens_per_s": speeds["vllm"],
                "ours_tokens_per_s": speeds["ours"],
                "vllm_ready_s": ready["vllm"],
                "ours_ready_s": ready["ours"],
                "ratio": ours_median / vllm_median,
                "same_first_tokens": same,
                "vllm_batch1_tokens_per_s": alone["vllm"],
                "ours_batch1_tokens_per_s": alone["ours"],
                "batch1_ratio": statistics.median(alone["ours"]) / statistics.median(alone["vllm"]),
            }
        )
    return result
