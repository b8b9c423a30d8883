"""Run a Hugging Face transformers model through *our* paged attention, without copying its code.

transformers looks attention up by name: every attention layer calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, mask, ...)``.
We register one more name, ``"paged_attention"``, whose function stores the layer's new keys and
values into their KV-cache slots and then runs the paged prefill or decode kernel. The model's own
projections, rotary embeddings, MLPs and norms run unchanged. (vLLM's transformers backend plugs
in the same way.)

**One packed row per step.** All tokens scheduled in a step, from every sequence, go through the
model as one batch row of ``num_tokens`` tokens: a decode contributes one token, a prefill chunk
many. Nothing is padded. What keeps sequences apart is the metadata, not the tensor shape:

* ``position_ids``: each token's position *within its own sequence* (rotary and learned position
  embeddings read it);
* ``slot_mapping``: where each token's K/V go;
* ``block_tables``, ``seq_lens``, ``query_start_loc``: which tokens belong to which sequence and
  where each sequence's pages are, so attention never mixes sequences.

The metadata travels to the attention function through a *forward context* (a context variable
set around the forward pass), as in vLLM, rather than through the model's call signature. Outside
a forward context the function falls back to transformers' SDPA attention, so the same model object
still works with ``model.generate``.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ... import kernels
from ...kernels import reference
from ...kernels.layout import pad_block_ids
from ...kernels.rows import Streamed, prompt_rows, replace_norms
from ...kernels.tiled import Tiled
from ...models import invariant
from ...models.compilation import CompilationConfig, compile_model
from ...models.merged_projections import merge_projections
from ...models.packed_linear import pack_linear_layers
from ..core.scheduler import ScheduledSequence
from .kv_cache import KVCache
from .tuning import bfloat16_row_kernel, tune

ATTENTION_NAME = "paged_attention"
COMPILED_NAME = "paged_attention_compiled"  # a compiled engine's (:func:`compiled_attention_forward`)


@dataclass
class ForwardContext:
    """The per-step metadata our attention function needs (the same for every layer)."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs], cached tokens after this step
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    decode_only: bool  # every sequence brings exactly one token, past its prompt
    backend: str
    plan: kernels.GatherPlan | None = None  # CPU decode (torch, compiled): built once, used by every layer
    step: kernels.per_layer.DecodeStep | None = None  # CPU decode (compiled): caches and plan as NumPy arrays
    invariant: bool = False  # batch-invariant mode: every query length takes the one float64 path
    checked: bool = False  # the step's slot mapping has been checked against the cache (first layer)
    store_map: kernels.StoreMap | None = None  # an int8 cache's: which new tokens go to which block
    decoding: list[bool] | None = None  # per sequence: its tokens come after its prompt (decode path)


_context: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "paged_forward", default=None
)


def current_context() -> ForwardContext | None:
    """The packed step the model is running now (``None`` outside a forward pass): what every
    layer's attention reads. A forward hook may call it to look at a step (notebook 05 does)."""
    return _context.get()


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    """Make ``ctx`` the current step for the duration of one forward pass."""
    token = _context.set(ctx)
    try:
        yield
    finally:
        _context.reset(token)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls in every attention layer (shapes ``[1, heads, tokens, dim]``)."""
    ctx = _context.get()
    if ctx is None:  # called outside the engine (e.g. model.generate): behave like plain SDPA
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if not torch.autograd.profiler._is_profiler_enabled:  # (the labelled range costs ~15 us a call)
        return _attend(ctx, module.layer_idx, query, key, value, scaling)
    with torch.profiler.record_function(ATTENTION_NAME):  # one labelled range in a profile
        return _attend(ctx, module.layer_idx, query, key, value, scaling)


def _attend(
    ctx: ForwardContext,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
) -> tuple[torch.Tensor, None]:
    q = query[0].transpose(0, 1)  # [tokens, heads, dim]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    if ctx.step is not None and ctx.checked:  # a decode step after its first layer: one compiled call
        out = kernels.decode_layer(q, k, v, layer, ctx.step, scaling)
        if out is not None:
            return out.unsqueeze(0), None
    k, v = k.contiguous(), v.contiguous()
    cache = ctx.kv_cache
    key_cache, value_cache = cache.key_cache(layer), cache.value_cache(layer)
    if cache.calibrating:  # fp8 with calculate_kv_scales: this step's tokens set the layer's scales
        keep = ctx.slot_mapping >= 0
        cache.calibrate(layer, k[keep], v[keep])
    scales = {"k_scale": cache.k_scale(layer), "v_scale": cache.v_scale(layer)}  # None for a float cache
    kernels.store_kv(k, v, key_cache, value_cache, ctx.slot_mapping, backend=ctx.backend, checked=ctx.checked,
                     plan=ctx.store_map, **scales)  # fmt: skip
    ctx.checked = True  # the step's slots are the same for every layer, and so are the caches' shapes
    q = q.contiguous()
    if ctx.invariant:  # one path for every query length, sums in float64 (see ModelRunner)
        out = reference.paged_prefill(q, key_cache, value_cache, ctx.block_tables, ctx.seq_lens,
                                      ctx.query_start_loc, scaling, compute=torch.float64,
                                      **scales)  # fmt: skip
    elif ctx.decode_only:  # the plan (torch backend) was checked once for all layers: the cache is finite
        out = kernels.paged_decode(q, key_cache, value_cache, ctx.block_tables, ctx.seq_lens, scaling,
                                   backend=ctx.backend, plan=ctx.plan, **scales)  # fmt: skip
    else:
        out = kernels.paged_prefill(q, key_cache, value_cache, ctx.block_tables, ctx.seq_lens,
                                    ctx.query_start_loc, scaling, backend=ctx.backend, decoding=ctx.decoding,
                                    **scales)  # fmt: skip
    return out.unsqueeze(0), None  # [1, tokens, heads, dim], as transformers expects


def _attend_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float | None
) -> torch.Tensor:
    """Attention as one operation a compiled graph calls and does not look into: it reads the
    step's forward context and writes the layer's K/V pages (state outside the graph)."""
    ctx = _context.get()
    if ctx is None:
        raise RuntimeError("a compiled model runs only inside the engine's forward context")
    return _attend(ctx, layer, query, key, value, scaling)[0]


def _attend_shape(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float | None
) -> torch.Tensor:
    _, heads, tokens, dim = query.shape
    return query.new_empty(1, tokens, heads, dim)


# Registered through a library rather than ``torch.library.custom_op``, whose Python wrapper costs
# ~50 us a call (vLLM's ``direct_register_custom_op`` does the same, for the same reason).
_library = torch.library.Library(ATTENTION_NAME, "FRAGMENT")
_library.define("attend" + torch.library.infer_schema(_attend_op, mutates_args=()))
_library.impl("attend", _attend_op, "CompositeExplicitAutograd")
torch.library.register_fake(f"{ATTENTION_NAME}::attend", _attend_shape, lib=_library)


def _mask(*args: object, **kwargs: object) -> torch.Tensor | None:
    """Inside the engine our kernels apply causality and sequence boundaries themselves, so
    transformers builds no mask; outside it (``model.generate``) the SDPA mask is built as usual."""
    return None if _context.get() is not None else sdpa_mask(*args, **kwargs)


def compiled_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A compiled engine's attention function (:mod:`..models.compilation`): traced, one opaque
    operation in the graph; run eagerly (outside the engine's compiled forward),
    :func:`paged_attention_forward`."""
    if torch.compiler.is_compiling():
        op = torch.ops.paged_attention.attend
        return op(query, key, value, module.layer_idx, kwargs.get("scaling")), None
    return paged_attention_forward(module, query, key, value, *args, **kwargs)


def _compiled_mask(*args: object, **kwargs: object) -> torch.Tensor | None:
    return None if torch.compiler.is_compiling() else _mask(*args, **kwargs)


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, _mask)
AttentionInterface.register(COMPILED_NAME, compiled_attention_forward)
AttentionMaskInterface.register(COMPILED_NAME, _compiled_mask)


class ModelRunner:
    """Packs a step's scheduled tokens into one row, runs the model, returns next-token logits."""

    def __init__(
        self,
        model: PreTrainedModel,
        kv_cache: KVCache,
        backend: str = "auto",
        batch_invariant: bool | None = False,
        compilation: CompilationConfig | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = next(model.parameters()).device
        self.backend = kernels.resolve_backend(backend, self.device)
        #: Batch-invariant mode: a token's logits do not depend on what else the step runs (how many
        #: sequences, how many drafts it verifies, prefill or decode): every linear layer multiplies
        #: in fixed chunks of rows (:mod:`..models.invariant`) and attention takes one path for every
        #: query length, its sums in float64 (:func:`..kernels.reference.attend`). Slower; see
        #: ``bench batch-invariant``.
        self.batch_invariant = invariant.requested(batch_invariant)  # None: VLLM_BATCH_INVARIANT
        #: Whether the base model runs compiled (:mod:`..models.compilation`; never batch-invariant)
        self.compiled = bool(compilation and compilation.compiles) and not self.batch_invariant
        if compilation and compilation.compiles and self.batch_invariant:
            warnings.warn(
                "batch-invariant mode runs the model eagerly: compilation_config ignored", stacklevel=3
            )
        prepared = getattr(model, "_paged_attention_prepared", None)  # by an earlier engine
        if prepared not in (None, "compiled" if self.compiled else "eager"):
            wanted = "compiled" if self.compiled else "eager"
            raise ValueError(
                f"compilation_config: this model object was prepared for an engine that runs it {prepared} "
                f"(mode 0 is eager); load it again to run it {wanted}"
            )
        model._paged_attention_prepared = "compiled" if self.compiled else "eager"
        model.set_attn_implementation(COMPILED_NAME if self.compiled else ATTENTION_NAME)
        #: Q/K/V and gate/up become one product each (:mod:`..models.merged_projections`), then the
        #: other linear layers on a CPU get their weights packed once (:mod:`..models.packed_linear`);
        #: with the compiled backend, products of a few rows stream the weights instead (a step of
        #: one sequence is bound by reading them): bfloat16 ones from a copy laid out as read
        #: (:mod:`..kernels.rows`), float32 ones from a tiled copy, in oneDNN's order of sums
        #: (:mod:`..kernels.tiled`), for the row counts where this machine measures them faster
        #: (:mod:`.tuning`; one float32 row may take MKL's ``F.linear`` instead); on a CPU without
        #: bfloat16 arithmetic, bfloat16 products of many rows four rows at a time, the weights
        #: widened to float32 in registers (:mod:`..kernels.widened`), and there every bfloat16
        #: product takes the loops, whatever the backend.
        #: A compiled model's graph calls each of these layers as one opaque operation
        #: (:mod:`..models.opaque`): they choose at run time.
        on_cpu = self.device.type == "cpu"
        bf16 = next(model.parameters()).dtype == torch.bfloat16
        fast = self.backend == "compiled" and not self.batch_invariant
        few = (Streamed() if bf16 else Tiled()) if fast else None
        if few is None and bf16 and on_cpu:  # the loops on a CPU without bfloat16 arithmetic, in any
            few = bfloat16_row_kernel(self.batch_invariant)  # backend and mode (in the mode: their
            # invariant product, whole; there also with AVX512-BF16 and no AMX: the column loop)
        self.num_merged_groups = merge_projections(model, few) if on_cpu else 0
        self.num_packed_layers = pack_linear_layers(model, rows=few) if on_cpu else 0
        #: This machine's measured choices (``None``: not the compiled CPU backend)
        self.tuning = tune(model, few) if fast and on_cpu else None
        #: With the compiled CPU backend, each bfloat16 RMSNorm is one compiled pass per row
        #: (:mod:`..kernels.rows`); a compiled model's norms are inductor's
        eager_norms = self.backend == "compiled" and not self.compiled
        self.num_fused_norms = replace_norms(model) if eager_norms else 0
        if self.batch_invariant:
            invariant.make_linear_layers_invariant(model)
        self.base_model = model.base_model
        self._forward = compile_model(self.base_model) if self.compiled else self.base_model
        self.lm_head = model.get_output_embeddings()
        self.last_prepare_seconds = self.last_forward_seconds = 0.0  # timings of the latest step
        self._saved: tuple[float, float] | None = None
        #: Seconds spent compiling the model when the runner was built (0.0 when eager)
        self.compile_seconds = self._compile_now() if self.compiled else 0.0

    @torch.inference_mode()
    def _compile_now(self) -> float:
        """Trace and compile at start, as vLLM does, on a two-token step that writes nothing (its
        slots are -1) and reads only block 0; returns the seconds it took."""
        start, device = time.perf_counter(), self.device
        ctx = ForwardContext(
            kv_cache=self.kv_cache,
            slot_mapping=torch.full((2,), -1, dtype=torch.int64, device=device),
            block_tables=torch.zeros(1, 2, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([2], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, 2], dtype=torch.int32, device=device),
            decode_only=False,
            backend=self.step_backend(),
        )
        with forward_context(ctx):
            ids = torch.zeros(1, 2, dtype=torch.long, device=device)
            self._forward(input_ids=ids, position_ids=torch.arange(2, device=device)[None], use_cache=False)
        return time.perf_counter() - start

    # -- a step is a transaction (:mod:`.transaction`): the latest step's timings ---------------
    def begin(self) -> None:
        self._saved = (self.last_prepare_seconds, self.last_forward_seconds)

    def commit(self) -> None:
        self._saved = None

    def rollback(self) -> None:
        if self._saved is not None:
            self.last_prepare_seconds, self.last_forward_seconds = self._saved
        self._saved = None

    def step_backend(self) -> str:
        """The backend of one step: the runner's, except in the batch-invariant mode. (The compiled
        in-place kernel is faster than the eager gather at every size measured, from one sequence
        of 32 tokens to 16 of 512: 2-12x per layer call at SmolLM2's shapes, one thread on a 2-core
        CPU; the kernel is single-threaded. Its first call in a process costs about half a second,
        importing Numba and loading its cached machine code.)"""
        if self.batch_invariant:
            return "torch"  # (attention takes the float64 path; K/V are stored by the reference)
        return self.backend

    @property
    def attention_implementation(self) -> str:
        """The name transformers' layers look up in ``ALL_ATTENTION_FUNCTIONS``: ours, once set."""
        return str(self.model.config._attn_implementation)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence], block_tables: list[list[int]]) -> torch.Tensor:
        """Run one step; returns the logits of every scheduled sequence's ``logit_positions``, in
        order: ``[rows, vocab]``, one row per sampling sequence plus any prompt log-probability rows."""
        start = time.perf_counter()
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        last_rows: list[int] = []
        decoding = [s.decoding for s in scheduled]  # past its prompt: attention's decode path
        for s in scheduled:
            first = s.start
            token_ids += s.token_ids
            positions += range(first, first + s.num_new_tokens)
            slots += s.slot_mapping
            seq_lens.append(first + s.num_new_tokens)
            last_rows += [starts[-1] + p - first for p in s.logit_positions]
            starts.append(starts[-1] + s.num_new_tokens)
        device = self.device
        ctx = ForwardContext(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=pad_block_ids(block_tables, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            decode_only=len(token_ids) == len(scheduled) and all(decoding),
            backend=self.step_backend(),
            invariant=self.batch_invariant,
            decoding=decoding,
        )
        cache = self.kv_cache
        if cache.per_block_scales:  # int8: one map of new tokens to blocks for every layer's store
            ctx.store_map = kernels.StoreMap.build(ctx.slot_mapping, cache.block_size)
        if ctx.decode_only and ctx.backend in ("torch", "compiled") and not ctx.invariant:
            ctx.plan = kernels.plan_decode(ctx.block_tables, ctx.seq_lens, cache.key_cache(0))
            if ctx.backend == "compiled":
                scales = cache.scales if cache.per_block_scales else None
                ctx.step = kernels.decode_step(cache.data, ctx.slot_mapping, ctx.plan, scales, ctx.store_map)
        input_ids = torch.tensor([token_ids], device=device)
        position_ids = torch.tensor([positions], device=device)
        prepared = time.perf_counter()
        mode = invariant.batch_invariant() if self.batch_invariant else contextlib.nullcontext()
        with forward_context(ctx), mode, prompt_rows(not all(decoding)):  # (prompts: oneDNN's products)
            hidden = self._forward(input_ids=input_ids, position_ids=position_ids, use_cache=False)[0]
            logits = (
                self.lm_head(hidden[0, last_rows])
                if last_rows
                else hidden.new_zeros(0, self.lm_head.out_features)
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.last_prepare_seconds = prepared - start
        self.last_forward_seconds = time.perf_counter() - prepared
        return logits
