"""Rows on a CPU: RMSNorm as one compiled pass per row, a vectorized greedy argmax, products of a few rows.

A decode step of SmolLM2 at 64 sequences spent ~17 ms in small eager PyTorch operations besides its
products and attention (torch's profiler, this project's 2-core machine, bfloat16). Two of them:

* a transformers ``LlamaRMSNorm`` is eight operations (widen, square, mean, add, rsqrt, multiply,
  round, multiply), 61 of them per step; :class:`RMSNorm` (:mod:`.loop_rows`, compiled by Numba)
  is one pass per row: 29 instead of 40 us at 64 rows, 0.41 instead of 0.76 ms at 2,048 (the
  engine uses it for bfloat16 models: see :func:`replace_norms`);
* the greedy sampler widened the ``[64, 49152]`` logits to float32 and ran ``torch.argmax`` (a
  scalar loop): ~2.7 ms a step; :func:`greedy_argmax` takes ~0.3 ms (float32) from chunk maxima.

vLLM's CPU path gets the same from its compiled graph (inductor fuses the norm) and its
``greedy_argmax`` C++ operation. Whatever these do not cover (another device or dtype, autograd,
Numba missing) takes the eager operations, with the same result (:func:`linear_rows`: within one
rounding, its sums in another order than oneDNN's).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from . import compiled, widened

CHUNK = 256  # values per chunk maximum in greedy_argmax


def _fits(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (
        compiled.available()
        and first.dtype in compiled.DTYPES  # the Numba loops' kinds, as for attention
        and all(t.device.type == "cpu" and t.dtype == first.dtype for t in tensors)
    )


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``logits[rows, vocab]`` (int64), bit for bit: the first largest
    index per row, NaN counting as the largest. torch's ``argmax`` is a scalar loop on a CPU (2.6 ms
    for 64 rows of 49,152 float32, 11 ms in bfloat16); its ``amax`` is vectorized (0.16 ms). So:
    the maximum of each chunk of :data:`CHUNK` values, the first chunk that holds the row's maximum,
    the first index in it that does."""
    rows, vocab = logits.shape if logits.dim() == 2 else (0, 0)
    chunks = vocab // CHUNK
    if chunks == 0 or rows == 0 or logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    x = logits.detach().contiguous()
    maxima = x.as_strided((rows, chunks, CHUNK), (vocab, CHUNK, 1)).amax(dim=-1)
    if chunks * CHUNK < vocab:  # the tail, a shorter chunk
        maxima = torch.cat([maxima, x[:, chunks * CHUNK :].amax(dim=-1, keepdim=True)], dim=1)
    best = maxima.amax(dim=-1, keepdim=True)
    if bool(best.isnan().any()):  # NaN is the largest: torch's rule (rare; its own loop finds it)
        return logits.argmax(dim=-1)
    first = (maxima == best).to(torch.uint8).argmax(dim=-1)  # argmax: the first of equal values
    where = (first * CHUNK).unsqueeze(1) + torch.arange(CHUNK)
    inside = x.gather(1, where.clamp_(max=vocab - 1))  # (clamped repeats come after the real ones)
    return first * CHUNK + (inside == best).to(torch.uint8).argmax(dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` of ``x[..., D]`` with ``weight[D]`` (see :mod:`.loop_rows`)."""
    if not _fits(x, weight) or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return _eager_rms_norm(x, weight, eps)
    rows = x.detach().reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    try:
        from .loop_rows import rms_norm as loop  # imported late: importing Numba costs half a second

        weights = compiled.as_numpy(weight.detach().contiguous())
        loop(compiled.as_numpy(rows), weights, float(eps), compiled.as_numpy(out))
    except Exception as error:
        compiled.give_up(error)
        return _eager_rms_norm(x, weight, eps)
    return out.view(x.shape)


#: The most rows :func:`linear_rows` multiplies (more rows: oneDNN's packed product is faster).
LINEAR_ROWS = 4
#: The most rows :class:`Streamed` may take on a CPU that multiplies bfloat16 pairs (one lane per
#: output column, :mod:`.loop_columns`), if an engine's tuning measures it faster than oneDNN there.
PAIRED_ROWS = 64


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for a bfloat16 ``x[..., K]`` of at most :data:`LINEAR_ROWS` rows
    and a contiguous ``weight[N, K]``, as one pass over the weights (:mod:`.loop_rows`): a decode
    step of one sequence is a matrix-vector product per layer, bound by reading the weights, and
    oneDNN's blocked kernel reads them below the memory's pace there. On a 2-core Xeon with AMX, one
    thread, a pass over SmolLM2's 121 products at one row: 25-26 ms against oneDNN's 33 (the weights
    alone, no Python around them; a pass of plain vector loads over the same bytes: 20 ms); at two
    rows oneDNN is faster (the loop is then bound by its arithmetic: every row re-reads the weights
    from the L1 cache), so the engine measures which to use, ``engine.worker.tuning``. Each output
    is summed alone in float32 lanes (:func:`.loop_rows.linear_rows` gives the order), rounded once,
    so a row gets the same bits whatever rows are beside it; the results may differ from oneDNN's
    by one rounding, and float32 models keep their own kernel (:mod:`.tiled`), because a float32
    model promises transformers' greedy tokens. ``None`` where it does not apply (more rows,
    another dtype or device, shapes that do not match, autograd, Numba unavailable): the caller
    multiplies as before. :class:`Streamed` is the engine's way in (the views made once, and a copy
    of the weight laid out as the loop reads it, :func:`.loop_rows.linear_groups`; on a CPU with
    AVX512-BF16 it takes the column loop instead, :mod:`.loop_columns`)."""
    rows = x.numel() // max(1, x.shape[-1])
    if rows > LINEAR_ROWS or rows == 0 or x.dtype != torch.bfloat16 or torch.is_grad_enabled():
        return None
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or not weight.is_contiguous():
        return None  # (the loop reads whole weight rows unchecked; a strided weight: oneDNN's product)
    if bias is not None and bias.shape != (weight.shape[0],):
        return None
    if not _fits(x, weight, *(() if bias is None else (bias,))):
        return None
    flat = x.detach().reshape(rows, x.shape[-1]).contiguous()
    out = flat.new_empty(rows, weight.shape[0])
    try:
        from .loop_rows import linear_rows as loop  # imported late: importing Numba costs half a second

        added = bias.detach().contiguous() if bias is not None else weight.new_empty(0)
        matrix = compiled.as_numpy(weight.detach())  # (contiguous: checked above)
        loop(compiled.as_numpy(flat), matrix, compiled.as_numpy(added), compiled.as_numpy(out))
    except Exception as error:
        compiled.give_up(error)
        return None
    return out.view(*x.shape[:-1], weight.shape[0])


_prompts: contextvars.ContextVar[bool] = contextvars.ContextVar("prompt_rows", default=False)


@contextlib.contextmanager
def prompt_rows(held: bool = True) -> Iterator[None]:
    """Within this context (an engine step that ``held`` prompt rows) a :class:`Streamed` kernel that
    multiplies pairs takes no product: every product is oneDNN's, whose bits for a row do not depend
    on the rows beside it (it sums each output over K in one order whatever the row count), so a
    prompt computed whole or after a cached prefix gets the same bits, as in vLLM, whose every
    product is oneDNN's (vLLM's ``prefix_caching.py`` example prints that its answers are the same).
    The column loop takes only some row counts (those its tuning measured faster), so a prompt's
    rows left after a cached prefix would otherwise meet it and the same prompt whole oneDNN. A
    kernel that widens keeps every product (oneDNN emulates bfloat16 there; its loops take every
    count past a few rows, with the row loop's bits)."""
    token = _prompts.set(held)
    try:
        yield
    finally:
        _prompts.reset(token)


@dataclass(eq=False)
class Streamable:
    """What :class:`Streamed` keeps for one weight: the tensors and their bits as NumPy views, made
    once, so that a product of a few rows costs the loop and little else (one product of
    SmolLM2's decode step takes ~0.1 ms, and a step makes 121 of them), and a copy of the weight
    laid out as the loop reads it (its price: the weight's bytes once more)."""

    weight: Tensor  #: ``[N, K]`` bfloat16, contiguous
    bias: Tensor | None  #: ``[N]``, the bias the layer had when the weight was prepared
    weight_bits: np.ndarray  #: the weight as ``uint16``
    bias_bits: np.ndarray  #: the bias as ``uint16`` (length 0: none)
    #: the weight's bits in the order the row loop reads them (:func:`.loop_rows.group`), a copy made
    #: by the first product that reads it (dropped with the rest where an engine's tuning keeps oneDNN's)
    grouped: np.ndarray | None = None
    #: the same for the column loop (:func:`.loop_columns.arrange`), where the CPU multiplies pairs
    #: (one copy or the other is made, never both: each CPU takes one of the two loops)
    arranged: np.ndarray | None = None


class Streamed:
    """:func:`linear_rows` as a row kernel of :mod:`..models.packed_linear`: for a contiguous
    bfloat16 weight it keeps a :class:`Streamable` (views; the grouped or the arranged copy when
    first read). It takes products of up to ``rows`` rows (an engine's tuning sets it, up to
    :attr:`most`) and, if
    ``wide`` (by default: where :func:`.widened.needed`, a CPU without bfloat16 arithmetic), those
    of more than :data:`LINEAR_ROWS` rows too; there, from :data:`.widened.WIDE_ROWS` rows on,
    four rows at a time (:mod:`.widened`): the row loop's bits. Where ``paired`` (a CPU with
    AVX512-BF16, :func:`.lanes.paired`) every count goes to the column loop (:mod:`.loop_columns`,
    from its own copy of the weight): other bits than the row loop's. Either way a row gets the
    bits it gets alone, whatever rows are beside it (a bias other than the one prepared, rare: the
    row loop's product up to :data:`LINEAR_ROWS` rows, oneDNN's beyond)."""

    def __init__(self, rows: int = LINEAR_ROWS, wide: bool | None = None, paired: bool | None = None) -> None:
        self.rows = rows
        self._wide = wide
        self._paired = paired

    @property
    def wide(self) -> bool:
        """Whether it widens products of many rows (asked of the CPU on first use: importing the
        package does not load Numba's LLVM)."""
        if self._wide is None:
            self._wide = widened.needed()
        return self._wide

    @property
    def paired(self) -> bool:
        """Whether it multiplies with bfloat16 pair instructions, one lane per output column
        (:mod:`.loop_columns`; asked on first use, as :attr:`wide`; never where it widens)."""
        if self._paired is None:
            from . import lanes  # imported late: importing Numba costs half a second

            self._paired = not self.wide and lanes.paired()
        return self._paired

    @property
    def most(self) -> int:
        """The most rows it may be given (``rows``, as tuning chooses): :data:`PAIRED_ROWS` where
        :attr:`paired`, else :data:`LINEAR_ROWS`."""
        return PAIRED_ROWS if self.paired else LINEAR_ROWS

    def prepare(
        self, weight: Tensor, bias: Tensor | None, product: Callable[[Tensor], Tensor]
    ) -> Streamable | None:
        del product  # (no check: the loop is within one rounding of the product, not its bits)
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
            return None
        if weight.device.type != "cpu" or weight.shape[1] == 0:
            return None
        if bias is not None and (bias.shape != (weight.shape[0],) or not _fits(weight, bias)):
            return None
        bias_bits = compiled.as_numpy(bias.contiguous()) if bias is not None else np.zeros(0, np.uint16)
        return Streamable(weight, bias, compiled.as_numpy(weight), bias_bits)

    def __call__(self, x: Tensor, prepared: Streamable, bias: Tensor | None) -> Tensor | None:
        rows = _rows(x, prepared)
        wide = rows >= widened.WIDE_ROWS and self.wide  # (past LINEAR_ROWS, whatever the tuning chose)
        if not (0 < rows <= self.rows or (wide and rows > LINEAR_ROWS)):
            return None
        if _prompts.get() and self.paired:  # (a step with prompt rows: oneDNN's, see prompt_rows)
            return None
        if not _direct(bias, prepared):
            return (widened.linear if wide else linear_rows)(x, prepared.weight, bias)  # (checks, views)
        return _by_address(x, rows, prepared, self._way(rows))

    def invariant(self, x: Tensor, prepared: Streamable, bias: Tensor | None) -> Tensor | None:
        """The product of ``x`` (any number of rows) where each row gets the bits it gets alone,
        whatever ``rows`` a tuning chose: the batch-invariant mode's product (:mod:`..models.invariant`)
        on a CPU where this kernel is ``wide`` or ``paired`` (there the loops, each output summed
        alone in one fixed order, are also about as fast as oneDNN's product, which would need
        fixed chunks of padded rows). ``None`` elsewhere, and where it does not apply (another
        dtype, shape or device): not a row count."""
        rows = _rows(x, prepared)
        if not (self.wide or self.paired) or rows == 0 or not _direct(bias, prepared):
            return None
        return _by_address(x, rows, prepared, self._way(rows))

    def _way(self, rows: int) -> str:
        """Which loop takes ``rows`` rows (:func:`_loop`; on one CPU, all give a row the same bits)."""
        if self.wide:
            return "quads" if rows >= widened.WIDE_ROWS else "rows"
        return "columns" if self.paired else "rows"


def _rows(x: Tensor, prepared: Streamable) -> int:
    """The rows of ``x`` that the loops could multiply by ``prepared`` (0: none: another K, dtype
    or device)."""
    k_in = prepared.weight_bits.shape[1]
    if x.shape[-1] != k_in or x.dtype != torch.bfloat16 or not x.is_cpu:
        return 0
    return x.numel() // k_in


def _direct(bias: Tensor | None, prepared: Streamable) -> bool:
    """Whether the loop may be called by address with ``prepared``'s views: the bias it viewed,
    autograd off, Numba available."""
    return _same(bias, prepared.bias) and not torch.is_grad_enabled() and compiled.available()


def _by_address(x: Tensor, rows: int, prepared: Streamable, way: str) -> Tensor | None:
    """The loop's product of the bfloat16 ``x[..., K]`` (``rows`` rows), by address, the ``way``
    :func:`_loop` names (on one CPU, the same bits each); ``None`` if Numba cannot compile it."""
    x = x.contiguous()
    out = torch.empty((*x.shape[:-1], prepared.weight_bits.shape[0]), dtype=torch.bfloat16)
    try:  # (by address: both contiguous bfloat16, alive until the loop returns)
        _loop(way)(x.data_ptr(), rows, prepared, out.data_ptr())
    except Exception as error:
        compiled.give_up(error)
        return None
    return out


def _same(bias: Tensor | None, kept: Tensor | None) -> bool:
    """Whether ``bias`` is the bias :class:`Streamable` viewed (the same memory: a layer hands over
    a fresh ``detach()`` of its parameter at every call)."""
    if bias is None or kept is None:
        return bias is kept
    return bias.data_ptr() == kept.data_ptr() and bias.shape == kept.shape and bias.dtype == kept.dtype


@functools.cache
def _loop(way: str) -> Callable[[int, int, Streamable, int], None]:
    """The loop by address, ``(x_address, rows, prepared, out_address)``: ``"quads"``, four rows at
    a time widened (:mod:`.widened`, the weights in their own layout); ``"rows"``, each row alone
    from the grouped copy; ``"columns"``, one lane per output column from the arranged copy
    (:mod:`.loop_columns`). A copy is made by the first product that reads it."""
    from . import loop_columns, loop_rows  # imported late: importing Numba costs half a second

    if way == "quads":
        quads = loop_rows.linear_quads_at
        return lambda x, rows, p, out: quads(x, rows, p.weight_bits, p.bias_bits, out)
    if way == "columns":
        return _reading(loop_columns.linear_columns_at, "arranged", loop_columns.arrange)
    return _reading(loop_rows.linear_rows_at, "grouped", loop_rows.group)


def _reading(loop: Callable[..., None], copy: str, make: Callable[[np.ndarray], np.ndarray]):
    """``loop`` by address, reading ``prepared``'s attribute ``copy`` (made by ``make`` from the
    weight's bits on the first call)."""

    def run(x: int, rows: int, p: Streamable, out: int) -> None:
        laid = getattr(p, copy)
        if laid is None:
            laid = make(p.weight_bits)
            setattr(p, copy, laid)
        loop(x, rows, p.weight_bits, laid, p.bias_bits, out)

    return run


#: A bfloat16 row kernel taking all it can (an engine makes its own, to lower its rows).
STREAMED = Streamed()


def _eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``, operation for operation."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(x.dtype)


class RMSNorm(torch.nn.Module):
    """A transformers ``*RMSNorm`` (``weight``, ``variance_epsilon``; the same Parameter, so ties and
    the state dict are unchanged) whose forward is one compiled pass per row."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced: the eager operations, for the compiler to fuse
            return _eager_rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


#: transformers' norms whose forward is ``LlamaRMSNorm``'s, operation for operation.
NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm"})


def replace_norms(model: torch.nn.Module) -> int:
    """Replace every bfloat16 CPU norm of :data:`NORMS` in ``model`` by an :class:`RMSNorm`, in
    place, each after checking on a probe that the two agree (within one rounding); returns how
    many were replaced (0 where the compiled loop is unavailable). float32 norms stay transformers'
    own: the loop sums the mean in another order than torch (about half the values one ulp apart),
    and a float32 model must equal transformers token for token."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child).__name__ in NORMS
        and child.weight.dtype == torch.bfloat16
        and _fits(child.weight.detach())
    ]
    replaced = 0
    for parent, name, child in targets:
        fused = RMSNorm(child)
        if _agrees(child, fused):
            setattr(parent, name, fused)
            replaced += 1
    return replaced


def _agrees(norm: torch.nn.Module, fused: RMSNorm) -> bool:
    weight = norm.weight
    probe = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.inference_mode():
        expected, got = norm(probe).float(), fused(probe).float()
    if not compiled.available():  # compiling failed on the probe: nothing to gain
        return False
    ulp = torch.finfo(weight.dtype).eps
    return bool(torch.allclose(got, expected, rtol=ulp, atol=ulp * float(expected.abs().max())))
