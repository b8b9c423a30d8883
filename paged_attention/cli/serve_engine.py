"""The engine a ``serve`` command line asks for, built in the engine core's process.

A module of its own: the core process imports its builder's module by name, and the server's
module (FastAPI, uvicorn, the routes) would add ~0.6 s to every core's start for nothing.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from ._threads import set_threads

if TYPE_CHECKING:
    from ..engine.llm_engine import LLMEngine


def build_engine(opts: argparse.Namespace) -> LLMEngine:
    """The engine a ``serve`` command line asks for (also what ``bench serve --compare-offline``
    builds to serve the same requests offline). Imported here, not at the top: the front of a server
    whose engine core runs in another process never loads the model code (transformers' modeling,
    ~3.5 s of a server's start)."""
    from ..baselines.engines import baseline_engine

    model = None if opts.model == "tiny" else opts.model
    return baseline_engine(
        model,
        kv_manager=opts.kv_manager,
        block_size=opts.block_size,
        num_kv_blocks=opts.num_kv_blocks,
        kv_cache_memory=opts.kv_cache_memory,
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        max_model_len=opts.max_model_len,
        preemption_mode=opts.preemption_mode,
        enable_prefix_caching=not opts.no_enable_prefix_caching,
        dtype=opts.dtype,
        seed=opts.seed,
        compilation_config=getattr(opts, "compilation_config", None),
        kv_cache_dtype=getattr(opts, "kv_cache_dtype", "auto"),
        calculate_kv_scales=getattr(opts, "calculate_kv_scales", False),
        batch_invariant=getattr(opts, "batch_invariant", None),
    )


def build_core(opts: argparse.Namespace, threads: int) -> LLMEngine:
    """The engine, built in the engine-core process (picklable with ``functools.partial``)."""
    logging.basicConfig(level=opts.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    set_threads(threads)
    return build_engine(opts)
