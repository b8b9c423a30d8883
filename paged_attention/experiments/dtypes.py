"""float32 against bfloat16 on this CPU, in one run (``bench engine --dtype float32 bfloat16``).

Three measurements, side by side:

* **decode speed**: the real engine, one dtype after the other, with ``batch`` sequences all in
  their decode phase (chat prompts, greedy, EOS ignored): the median time of a step, and tokens per
  second (``batch`` tokens per step);
* **the weight-read bound**: a decode step reads every weight once, so it cannot be faster than
  the model's weight bytes divided by the memory bandwidth. The bandwidth is measured in the same
  run by streaming through a buffer far larger than the caches (:func:`memory_bandwidth`: reading
  it, the roof for reading weights; and copying it, counted once per byte copied);
* **the products' floor**: the same step's matrix products alone, each linear layer (packed,
  merged, or a row kernel's: what the engine multiplies with) timed by itself on ``batch`` rows
  (:func:`products_seconds`). Past a few rows a step is bound by arithmetic, not by reading: no
  step of this engine beats ``max(bound, products)``, the *floor* the table compares with;
* **the arithmetic bound**: the step's multiply-adds (every linear layer's ``in x out`` per row,
  :func:`multiply_adds`) at the best rate this core reaches on one large product of the dtype
  (:func:`matmul_rate`, the same run): the time a step cannot beat however its weights are read.
  At one row it is far below the weight-read bound; at 16 rows of SmolLM2 in bfloat16 on the
  project's AMD EPYC it is above it: such a step is bound by arithmetic there, and its *roof* is
  the larger of the two;
* **greedy agreement**: the same chat prompts answered greedily in each dtype, all in one batch:
  how many answers are token for token those of the first dtype (float32), and where the others
  first differ. bfloat16 keeps 8 bits of mantissa, so near-ties between two tokens can flip and the
  answers then go their own ways; it is not an error, but it is the price, and it is counted here.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from ..engine.chat import render_chat
from ..engine.llm_engine import LLMEngine
from ..engine.sample.sampling import RequestOutputKind, SamplingParams
from ..kernels.rows import Streamed
from ..models import explain_dtype, load_model
from ..models.merged_projections import MergedMember, product_owners
from ..models.packed_linear import PackedLinear, pack_weight, packed_product, packing_available
from .prompts import QUESTIONS

BATCH_SIZES = (1, 16, 64)
PROBE_BYTES = 256 << 20  #: the buffer streamed to measure bandwidth: far beyond any cache
RATE_ROWS = 1024  #: rows of the large product that measures the arithmetic rate


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each tensor once (tied embeddings count once): what a decode
    step reads (the output layer reads the whole embedding matrix)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def memory_bandwidth(repeats: int = 3) -> dict[str, float]:
    """Bytes per second of streaming through :data:`PROBE_BYTES` at the current torch thread count,
    best of ``repeats``: ``read`` (summing it) and ``copy`` (copying it, bytes of the copy)."""
    src = torch.ones(PROBE_BYTES // 4)
    dst = torch.empty_like(src)

    def best(run: Callable[[], object]) -> float:
        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return PROBE_BYTES / min(times)

    return {"read": best(src.sum), "copy": best(lambda: dst.copy_(src))}


def matmul_rate(dtype: torch.dtype, rows: int = RATE_ROWS, size: int = 1024, repeats: int = 3) -> float:
    """Multiply-adds per second of one large product (``x[rows, size]`` times a ``[4 size, size]``
    weight, transposed) at ``dtype`` and the current thread count, best of ``repeats``, the fastest
    way this package multiplies: oneDNN's product of the weight packed as the engine packs it (where
    this CPU packs it) and, in bfloat16, the engine's own loops where they take many rows (a CPU
    without bfloat16 arithmetic, whose oneDNN emulates it; AVX512-BF16's pairs). About the most the
    core gives: on the project's AMD EPYC, one thread, ~110 GFLOP/s in float32 and ~215-220 in
    bfloat16 (oneDNN's, both), against 117 and 233 for the fused multiply-add and bfloat16 pair
    instructions back to back in registers."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, size, generator=generator).to(dtype)
    weight = torch.randn(4 * size, size, generator=generator).to(dtype)
    ways = [functools.partial(torch.nn.functional.linear, weight=weight)]
    if packing_available():
        ways = [functools.partial(packed_product, packed=pack_weight(weight, rows), bias=None)]
    loops = Streamed(rows=0)
    prepared = loops.prepare(weight, None, torch.nn.functional.linear)
    if prepared is not None and (loops.wide or loops.paired):
        ways.append(functools.partial(loops.invariant, prepared=prepared, bias=None))  # (every row count)
    best = float("inf")
    with torch.inference_mode():
        for product in ways:
            if product(x) is None:  # warm-up: primitives built, pages touched (None: it declined)
                continue
            for _ in range(repeats):
                start = time.perf_counter()
                product(x)
                best = min(best, time.perf_counter() - start)
    return rows * size * 4 * size / best


def chat_prompts(tokenizer: object, count: int) -> list[dict]:
    """``count`` chat prompts from :data:`~.prompts.QUESTIONS`, cycled."""
    return [
        render_chat(tokenizer, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(count)
    ]


@contextlib.contextmanager
def decoding_together(
    engine: LLMEngine, prompts: Sequence[dict], max_tokens: int, name: str
) -> Iterator[None]:
    """Add ``prompts`` (greedy, EOS ignored, ``max_tokens`` each, ids ``{name}-{i}``) and step until
    every one of them decodes in the same step; on exit, abort whichever have not finished. Raises
    ``ValueError`` when they never decode together (a cache too small to hold them all)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    ids = [engine.add_request(f"{name}-{i}", p, params) for i, p in enumerate(prompts)]
    try:
        for _ in range(sum(len(p["prompt_token_ids"]) for p in prompts) + 1):  # every step prefills some
            engine.step()
            last = engine.last_step
            if last.num_scheduled_tokens == last.num_scheduled_seqs == len(prompts):  # every prefill done
                break
        else:
            raise ValueError(
                f"the {len(prompts)} sequences never decoded together: give the cache more blocks"
            )
        yield
    finally:
        for request_id in ids:
            with contextlib.suppress(ValueError):  # one that already finished
                engine.abort_request(request_id)


def decode_step_seconds(engine: LLMEngine, prompts: Sequence[dict], steps: int, warmup: int = 2) -> dict:
    """Median seconds of a step while every one of ``prompts`` decodes (prefills done, ``warmup``
    steps skipped), over ``steps`` steps; the requests are aborted afterwards, whatever happens.
    Raises ``ValueError`` when the batch cannot decode together (more prompts than
    ``max_num_seqs``, or a cache too small to hold them all)."""
    batch = len(prompts)
    if batch > engine.scheduler.max_num_seqs:
        raise ValueError(f"{batch} prompts, but the engine runs at most {engine.scheduler.max_num_seqs}")
    times, forward = [], []
    with decoding_together(engine, prompts, warmup + steps + 4, "decode"):
        for step in range(warmup + steps):
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            if engine.last_step.num_scheduled_seqs != batch or engine.last_step.num_preempted:
                raise ValueError("the batch changed while timing: give the cache more blocks")
            if step >= warmup:
                times.append(seconds)
                forward.append(engine.last_step.forward_seconds)
    step = statistics.median(times)
    forward_s = statistics.median(forward)
    return {"batch": batch, "step_s": step, "forward_s": forward_s, "tokens_per_s": batch / step}


def _products(model: torch.nn.Module) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], int, int]]:
    """Every product the engine makes per row, as ``(call, in, out)``: a merged group once, every
    other linear layer once."""
    calls = [(owner.product, *owner.weight.shape[::-1]) for owner in product_owners(model)]
    calls += [
        (m, m.in_features, m.out_features)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
        and not isinstance(m, PackedLinear)
        and not (isinstance(m, MergedMember) and m.group is not None)
    ]  # the layers neither packed nor merged
    return calls


def multiply_adds(model: torch.nn.Module) -> int:
    """Multiply-adds of one row (one sequence's decode step) through every linear layer of
    ``model``, the output layer included."""
    return sum(k * n for _, k, n in _products(model))


def products_seconds(model: torch.nn.Module, rows: int, repeats: int = 3) -> float:
    """Seconds ``model``'s linear products take for ``rows`` rows each (a decode step of ``rows``
    sequences), every layer timed as the engine calls it (a merged group once), best of
    ``repeats`` passes over all of them."""
    dtype = next(model.parameters()).dtype
    inputs = [(call, torch.randn(rows, k).to(dtype)) for call, k, _ in _products(model)]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for call, x in inputs:
                call(x)
            best = min(best, time.perf_counter() - start)
    return best


def greedy_answers(engine: LLMEngine, prompts: Sequence[dict], max_tokens: int) -> list[list[int]]:
    """Every prompt answered greedily, all in one batch."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY)
    for i, p in enumerate(prompts):
        engine.add_request(f"answer-{i}", p, params)
    answers: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            answers[int(out.request_id.split("-")[1])] = list(out.outputs[0].token_ids)
    return [answers[i] for i in range(len(prompts))]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How many answers are identical, and the token index where each other one first differs."""
    first = []
    for a, b in zip(reference, other, strict=True):
        if a != b:
            pairs = enumerate(zip(a, b, strict=False))  # the shorter answer may stop first
            first.append(next((i for i, (x, y) in pairs if x != y), min(len(a), len(b))))
    return {"identical": len(reference) - len(first), "prompts": len(reference), "first_difference": first}


def compare(
    model: str | None,
    dtypes: Sequence[str],
    batch_sizes: Sequence[int] = BATCH_SIZES,
    steps: int = 10,
    num_prompts: int = 16,
    max_tokens: int = 48,
    progress: Callable[[str], None] = print,
    compiled: bool = False,
) -> dict:
    """Decode speed, weight-read bound and greedy agreement for each of ``dtypes`` (the first is the
    reference for agreement; two names of one dtype are refused); see the module docstring. One
    engine per dtype, then freed; ``compiled``: each engine with ``compilation_config=3``
    (:mod:`..models.compilation`), its compilation done before anything is timed."""
    bandwidth = memory_bandwidth()
    rows, answers, sizes, rates = [], {}, {}, {}
    for name in dtypes:
        hf_model, tokenizer = load_model(model, dtype=name)
        dtype = str(next(hf_model.parameters()).dtype).removeprefix("torch.")
        if dtype in sizes:
            raise ValueError(f"dtypes {list(dtypes)} name {dtype} twice ({name!r} resolves to it)")
        sizes[dtype], rates[dtype] = weight_bytes(hf_model), matmul_rate(next(hf_model.parameters()).dtype)
        longest = max(len(p["prompt_token_ids"]) for p in chat_prompts(tokenizer, len(QUESTIONS)))
        per_sequence = longest + steps + 2 + max(max_tokens, 64)  # prompt, timed steps, room to spare
        seats = max(*batch_sizes, num_prompts)
        blocks = seats * -(-per_sequence // 16) + 16
        engine = LLMEngine(hf_model, tokenizer, num_kv_blocks=blocks, block_size=16, max_num_seqs=seats,
                           enable_prefix_caching=False,
                           compilation_config=3 if compiled else None)  # fmt: skip
        for batch in batch_sizes:
            row = decode_step_seconds(engine, chat_prompts(tokenizer, batch), steps)
            row |= {"dtype": dtype, "weight_bytes": sizes[dtype],
                    "bound_s": sizes[dtype] / bandwidth["read"],
                    "arithmetic_s": multiply_adds(engine.model) * batch / rates[dtype],
                    "products_s": products_seconds(engine.model, batch)}  # fmt: skip
            rows.append(row)
            progress(f"  {dtype}, {batch} sequences: {row['step_s'] * 1e3:.1f} ms per decode step")
        answers[dtype] = greedy_answers(engine, chat_prompts(tokenizer, num_prompts), max_tokens)
        del engine, hf_model
    reference = next(iter(answers.values()))
    return {
        "rows": rows,
        "bandwidth": bandwidth,
        "multiply_adds_per_s": rates,
        "agreement": {d: agreement(reference, a) for d, a in answers.items()},
        "auto": explain_dtype(model, "auto"),
        "steps": steps,
        "max_tokens": max_tokens,
        "compiled": compiled,
    }


def roof_seconds(row: dict) -> float:
    """A step's roof: the larger of its weight-read and arithmetic bounds (the first alone in a row
    measured before the second was)."""
    return max(row["bound_s"], row.get("arithmetic_s", 0.0))


def floor_seconds(row: dict) -> float:
    """A step's floor: the larger of its weight-read bound and its products' time (0 if unmeasured)."""
    return max(row["bound_s"], row.get("products_s", 0.0))


def speedups(result: dict, reference: str = "float32") -> dict[str, dict[int, float]]:
    """``{dtype: {batch: tokens/s over the reference dtype's}}`` from :func:`compare`'s rows."""
    base = {r["batch"]: r["tokens_per_s"] for r in result["rows"] if r["dtype"] == reference}
    out: dict[str, dict[int, float]] = {}
    for r in result["rows"]:
        if r["batch"] in base:
            out.setdefault(r["dtype"], {})[r["batch"]] = r["tokens_per_s"] / base[r["batch"]]
    return out
