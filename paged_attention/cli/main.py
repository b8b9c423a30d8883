"""Command line: ``python -m paged_attention <command>`` (demo, generate, chat, bench, compat, ...).

* ``demo``: the main job: real prompts on SmolLM2 under one KV budget, paged vs contiguous, side by side
  (``--model tiny``: the older demo, the paged engine alone under memory pressure on the embedded
  random model, in seconds).
* ``generate``: stream one completion from a model (``--model`` folder or cached hub name).
* ``walkthrough``: paged KV memory step by step (allocator, page tables, fork, copy-on-write).
* ``bench <name>``: benchmarks (``allocator``, ``kernel``, ``engine``) and the paper's experiments
  (``fragmentation``, ``capacity``, ``throughput``, ``latency``, ``block-size``, ``sharing``), each writing
  ``figures/<name>.png`` and the JSON behind it; each measures side by side.
* ``figures``: regenerate every figure under ``figures/`` by running the notebooks that draw them.
* ``model fetch``: fetch and convert the real model (SmolLM2-135M-Instruct) once; ``make install`` runs it.
* ``serve``: the OpenAI-compatible server (FastAPI + uvicorn) on 127.0.0.1; ``serve --help`` for its options.
* ``chat``: a terminal chat with the real model, streaming tokens and showing the KV blocks in use.
* ``readme``: rewrite README.md's generated result blocks from ``figures/*.json`` (``--check``: only compare).
* ``compat``: print the README's vLLM compatibility table (from :mod:`paged_attention.engine.compatibility`).
* ``crosscheck``: the same cases on this engine and the real vLLM (``make crosscheck``), compared.
* ``lab``: the course lab: ``list`` the exercises, ``build`` the student notebooks, ``grade`` them.
"""

from __future__ import annotations

import argparse
import sys

BENCHMARKS = (
    "allocator",
    "kernel",
    "engine",
    "fragmentation",
    "capacity",
    "throughput",
    "latency",
    "block-size",
    "sharing",
    "serve",
    "serve-sweep",
    "spec-decode",
    "peer",
    "batch-invariant",
    "kv-dtype",
)


def _generate(opts: argparse.Namespace) -> None:
    """Stream one completion through the engine's public API: ``step()`` returns the request's
    output after every step that adds text (``DELTA``: only the new part), the last one finished."""
    from ..engine.llm_engine import LLMEngine
    from ..engine.sample.sampling import RequestOutputKind, SamplingParams
    from ..models import explain_dtype
    from ._threads import set_threads

    threads = set_threads(opts.threads)
    engine = LLMEngine(opts.model, dtype=opts.dtype, num_kv_blocks=opts.num_kv_blocks, seed=opts.seed)
    name = (
        opts.model
        or "the embedded tiny Llama (random weights: its text is gibberish; --model smollm2 for real text)"
    )
    print(
        f"model: {name}; dtype: {explain_dtype(opts.model, opts.dtype)}; torch threads {threads}",
        file=sys.stderr,
    )
    params = SamplingParams(
        temperature=opts.temperature, top_p=opts.top_p, max_tokens=opts.max_tokens, seed=opts.seed,
        output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    engine.add_request(None, opts.prompt, params)
    print(opts.prompt, end="", flush=True)
    num_tokens = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            completion = output.outputs[0]
            print(completion.text, end="", flush=True)
            num_tokens += len(completion.token_ids)
            if output.finished:
                print(f"\n[{completion.finish_reason}: {num_tokens} tokens]")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m paged_attention", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="paged vs contiguous KV memory on SmolLM2 (--model tiny: paged alone)")
    demo.add_argument("--model", default="smollm2", help="smollm2 (default), or tiny: the embedded model")
    demo.add_argument("--requests", type=int, default=None, help="default: 16 (smollm2), 48 (tiny)")
    demo.add_argument("--num-kv-blocks", type=int, default=None, help="default: 64 (smollm2), 96 (tiny)")
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--max-tokens", type=int, default=48, help="smollm2: output tokens per answer")
    demo.add_argument("--threads", type=int, default=None, help="torch threads (default: 2, 1 if busy)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="smollm2: auto (default): bfloat16 where this CPU computes it faster, else float32",
    )  # fmt: skip
    demo.add_argument("--save", action="store_true", help="smollm2: write figures/demo.json (for README)")
    demo.add_argument(
        "--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
        help="smollm2: both engines batch-invariant, so their tokens must agree (default: on)",
    )  # fmt: skip
    gen = sub.add_parser("generate", help="stream one completion")
    gen.add_argument("--model", default=None, help="checkpoint folder or cached hub name (default: embedded)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default=None)
    gen.add_argument("--num-kv-blocks", type=int, default=None)
    gen.add_argument("--threads", type=int, default=None, help="torch threads (default: see demo --help)")
    chat = sub.add_parser("chat", help="a terminal chat with the real model, streaming, KV blocks shown")
    chat.add_argument(
        "--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="a model with a chat template"
    )
    chat.add_argument("--system", default=None, help="a system message (default: the template's own)")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument(
        "--temperature", type=float, default=0.7,
        help="0.7 (default), as chat services sample; 0: greedy, which repeats itself on open questions",
    )  # fmt: skip
    chat.add_argument("--top-p", type=float, default=0.9)
    chat.add_argument("--seed", type=int, default=0)
    chat.add_argument("--num-kv-blocks", type=int, default=256)
    chat.add_argument("--max-model-len", type=int, default=None, help="default: the model's (or what fits)")
    chat.add_argument("--threads", type=int, default=None, help="torch threads (default: see demo --help)")
    chat.add_argument("--dtype", default="auto", help="auto (default), float32, bfloat16 or float16")
    walk = sub.add_parser("walkthrough", help="paged KV memory step by step")
    walk.add_argument("--seed", type=int, default=0)
    bench = sub.add_parser("bench", help="run a benchmark", add_help=False)
    bench.add_argument("name", choices=BENCHMARKS)
    figures = sub.add_parser("figures", help="regenerate figures/ from the notebooks")
    figures.add_argument("--timeout", type=int, default=600, help="seconds allowed per notebook")
    figures.add_argument("--notebooks-only", action="store_true", help="skip the experiments (bench ...)")
    sub.add_parser("serve", help="the OpenAI-compatible server (serve --help)", add_help=False)
    readme = sub.add_parser("readme", help="rewrite README.md's generated result blocks from figures/*.json")
    readme.add_argument("--check", action="store_true", help="only say whether README.md is up to date")
    sub.add_parser("compat", help="print the README's vLLM compatibility table")
    sub.add_parser("lab", help="course lab: list, build, grade", add_help=False)
    sub.add_parser(
        "crosscheck", help="compare this engine with the real vLLM (make crosscheck)", add_help=False
    )
    sub.add_parser("model", help="the real model's cache: fetch, path", add_help=False)
    opts, rest = parser.parse_known_args(argv)
    if rest and opts.command not in (
        "bench",
        "lab",
        "crosscheck",
        "model",
        "serve",
    ):  # bench passes the rest to the benchmark's own parser
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    if opts.command == "demo":
        if opts.model == "tiny":
            from .demo_tiny import run_tiny_demo

            run_tiny_demo(opts.requests or 48, opts.num_kv_blocks or 96, opts.block_size, opts.seed)
        else:
            from .demo import run_demo

            run_demo(opts.requests or 16, opts.num_kv_blocks or 64, opts.block_size,
                     max_tokens=opts.max_tokens, threads=opts.threads, model=opts.model,
                     dtype=opts.dtype, save=opts.save, batch_invariant=opts.batch_invariant)  # fmt: skip
    elif opts.command == "generate":
        _generate(opts)
    elif opts.command == "chat":
        from .chat import run_chat

        run_chat(opts)
    elif opts.command == "walkthrough":
        from .walkthrough import run_walkthrough

        run_walkthrough(seed=opts.seed)
    elif opts.command == "bench":
        import importlib

        module = importlib.import_module(f".bench.{opts.name.replace('-', '_')}", __package__)
        module.main(rest)
    elif opts.command == "serve":
        from .serve import main as serve_main

        serve_main(rest)
    elif opts.command == "model":
        from .model import main as model_main

        return model_main(rest)
    elif opts.command == "crosscheck":
        from .crosscheck import main as crosscheck_main

        return crosscheck_main(rest)
    elif opts.command == "lab":
        from .lab import main as lab_main

        return lab_main(rest)
    elif opts.command == "readme":
        from .readme import update_readme

        return update_readme(check=opts.check)
    elif opts.command == "compat":
        from ..engine.compatibility import markdown_table

        print(markdown_table(), end="")
    elif opts.command == "figures":
        from .figures import regenerate_figures

        regenerate_figures(timeout=opts.timeout, experiments=not opts.notebooks_only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
