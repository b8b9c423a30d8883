"""``python -m paged_attention serve``: the OpenAI-compatible server (see :mod:`paged_attention.serving`).

The engine is built as the experiments build theirs
(:func:`~paged_attention.baselines.engines.baseline_engine`), so ``--kv-manager max|pow2|oracle``
serves the contiguous baselines through the very same scheduler and server, in the same KV bytes
as the paged cache.

The engine core runs in a process of its own (vLLM v1's default: the front tokenizes, speaks HTTP and
streams on one CPU core while the model computes on the other); it takes one torch thread less than
the machine's cores (at least 1), unless ``--threads`` says otherwise, and is bound to those CPUs,
the front to the rest (:func:`bind_cores`). ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
(vLLM's switch) keeps it on a thread of the server's process instead.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os

from ..baselines.reservation import POLICIES
from ..engine.chat import PLAIN_TEMPLATE
from ..kernels.quantization import KV_CACHE_DTYPES
from ..serving import AsyncLLM, build_app
from ..serving.authentication import api_keys
from ..serving.launch import LOCALHOST, run
from ..serving.tools import PARSERS, TEMPLATES
from ._threads import set_threads
from .serve_engine import build_core, build_engine

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m paged_attention serve", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default=SMOLLM2, help=f"checkpoint folder, cached hub name, or tiny (default {SMOLLM2})"
    )
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    p.add_argument("--host", default=LOCALHOST, help="default 127.0.0.1 (this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--fd",
        type=int,
        default=None,
        help="serve on this inherited, already listening socket (as uvicorn's --fd); --host and --port then "
        "only name it in the log (a parent that bound the port first: no one can take it meanwhile)",
    )
    p.add_argument(
        "--kv-manager",
        choices=("paged", *POLICIES),  # baselines.engines.KV_MANAGERS (which imports the model code)
        default="paged",
        help="paged (default), or a contiguous baseline in the same KV bytes",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="the KV budget in blocks")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="the KV budget in bytes")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="requests that may wait to start before new ones get 503 (default: no limit)",
    )
    p.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the KV cache's: auto (the model's dtype), fp8 / fp8_e4m3 / fp8_e5m2 (a scale per layer, "
        "vLLM's), int8 (a scale per block and KV head)",
    )
    p.add_argument(
        "--calculate-kv-scales", action="store_true", help="fp8: each layer's scales from the first step"
    )
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each token's logits independent of what shares its step (default: vLLM's switch, "
        "$VLLM_BATCH_INVARIANT)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja file replacing the model's template, or a shipped one by name: chatml-tools (SmolLM2's "
        "format with tools in the Hermes format, for --tool-call-parser hermes)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="answer chats with tools with tool calls (vLLM's flag; needs --tool-call-parser)",
    )
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None, help="how tool calls are written")
    p.add_argument("--dtype", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compilation-config",
        "-cc",
        type=json.loads,
        default=None,
        help="vLLM's: 3 or '{\"mode\": 3}' compiles the model (~75 s for SmolLM2 here; default: eager)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: 2, 1 if busy)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="the /v1 routes answer only 'Authorization: Bearer KEY' with one of these keys "
        "(default: $VLLM_API_KEY, or no key)",
    )
    return p


def bind_cores(core_pid: int, threads: int) -> str:
    """As vLLM's CPU worker is bound to its cores: the engine core's process to the last ``threads``
    CPUs, this (the front's) to the others, so that neither evicts the other's caches. Linux only;
    returns what was done, for the banner."""
    if not hasattr(os, "sched_setaffinity"):
        return ""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) <= threads:
        return ""
    os.sched_setaffinity(core_pid, set(cpus[-threads:]))
    os.sched_setaffinity(0, set(cpus[:-threads]))
    return f", bound to CPU {','.join(map(str, cpus[-threads:]))}"


def in_process() -> bool:
    """vLLM's switch: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in this process."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").strip() in ("0", "false", "False")


def main(args: list[str] | None = None) -> None:
    opts = parser().parse_args(args)
    logging.basicConfig(level=opts.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if in_process():
        threads = set_threads(opts.threads)
        llm = AsyncLLM(build_engine(opts), opts.max_waiting)
        where = "on a thread of this process"
    else:  # one core for the front, the rest for the model (vLLM binds its worker the same way)
        threads = opts.threads or max(1, min(2, os.cpu_count() or 1) - 1)
        llm = AsyncLLM.from_builder(functools.partial(build_core, opts, threads), opts.max_waiting)
        where = f"in its own process (pid {llm.client.info['pid']})"
        where += bind_cores(llm.client.info["pid"], threads)
    template = None
    if opts.enable_auto_tool_choice and not opts.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice requires --tool-call-parser (vLLM's rule)")
    if opts.chat_template in TEMPLATES:
        template = TEMPLATES[opts.chat_template].read_text()
    elif opts.chat_template:
        with open(opts.chat_template) as f:
            template = f.read()
    elif not getattr(llm.tokenizer, "chat_template", None):
        template = PLAIN_TEMPLATE
        print("this model has no chat template: chats use a plain 'role: content' one (--chat-template FILE)")
    name = opts.served_model_name or opts.model
    info = llm.client.info
    print(
        f"serving {name} on http://{opts.host}:{opts.port} ({opts.kv_manager} KV cache: "
        f"{info['num_blocks']} blocks of {info['block_size']} tokens, max_model_len {info['max_model_len']}, "
        f"max_num_seqs {opts.max_num_seqs}, {info['dtype']}, engine core {where}, torch threads {threads})",
        flush=True,
    )
    keys = api_keys(opts.api_key)
    if keys:
        print(f"the /v1 routes ask for one of {len(keys)} API key(s)", flush=True)
    tool_parser = opts.tool_call_parser if opts.enable_auto_tool_choice else None  # both, as in vLLM
    if tool_parser:
        print(f'"auto" tool choice enabled: tool calls parsed as {tool_parser}', flush=True)
    app = build_app(llm, name, template, keys, tool_parser)
    # vLLM's freeze_gc_heap, as its server does at start: what exists now (torch, transformers, the
    # tokenizer: millions of objects) lives as long as the server, so the collector's oldest-generation
    # passes stop walking it; each such pass otherwise paused the event loop, and with it the requests
    # on their way to the engine core. (Here, not in build_app: a test's server thread shares its process.)
    gc.collect()
    gc.freeze()
    run(app, opts.host, opts.port, opts.log_level, opts.fd)
