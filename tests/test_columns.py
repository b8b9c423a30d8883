"""bfloat16 products with one lane per output column (:mod:`paged_attention.kernels.loop_columns`):
exactly the bits of the order of sums it promises (checked against that order written in PyTorch,
for every shape: rows in tiles of 12, 8, 4 and alone, blocks of rows, N and odd K tails, a bias or
none, NaN and infinities), so each row's bits whatever rows are beside it; the arranged copy; the
row kernel taking every count through it on a CPU that multiplies bfloat16 pairs; the
batch-invariant mode taking its products whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_attention.kernels import compiled, rows

needs_numba = pytest.mark.skipif(not compiled.available(), reason="Numba unavailable")


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint16).numpy()


def columns(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """linear_columns of ``x``, ``weight`` and ``bias`` (bfloat16), as bfloat16."""
    from paged_attention.kernels import loop_columns

    b = bits(bias) if bias is not None else np.zeros(0, np.uint16)
    out = np.full((x.shape[0], weight.shape[0]), 0xFFFF, np.uint16)  # (every output must be written)
    loop_columns.linear_columns(bits(x), loop_columns.arrange(bits(weight)), b, out)
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)


def in_order(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The order of sums the loop promises, in PyTorch: per output one float32 sum from zero over
    the pairs of K in order, the odd element's product first; the bias; rounded once (the
    products of two bfloat16 are exact in float32); NaN as ``0x7FC0``."""
    xs, ws = x.float(), weight.float()
    if x.shape[1] % 2:  # (an odd K's last pair: a zero beside it)
        xs, ws = torch.nn.functional.pad(xs, (0, 1)), torch.nn.functional.pad(ws, (0, 1))
    total = torch.zeros(x.shape[0], weight.shape[0])
    for p in range(xs.shape[1] // 2):
        for k in (2 * p + 1, 2 * p):
            total = total + xs[:, k, None] * ws[None, :, k]
    if bias is not None:
        total = total + bias.float()
    out = total.bfloat16()
    out.view(torch.int16)[total.isnan()] = 0x7FC0
    return out


SPECIALS = (float("nan"), float("inf"), -float("inf"), 3.0e38, 1.00390625)  # (overflows; a tie)


@needs_numba
@settings(max_examples=40, deadline=None)
@given(
    count=st.one_of(st.integers(1, 30), st.integers(110, 140)),  # (past one block of rows, and not)
    n_out=st.integers(1, 70),
    k_in=st.integers(1, 130),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
    specials=st.lists(st.sampled_from(SPECIALS), max_size=3),
)
def test_each_output_is_summed_in_the_promised_order(count, n_out, k_in, bias, seed, specials) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, k_in, generator=g).bfloat16()
    weight = torch.randn(n_out, k_in, generator=g).bfloat16()
    b = torch.randn(n_out, generator=g).bfloat16() if bias else None
    for i, value in enumerate(specials):  # in the inputs, the weights and the bias in turn
        target = (x, weight, b if b is not None else x)[i % 3].view(-1)
        target[int(torch.randint(target.numel(), (1,), generator=g))] = value
    np.testing.assert_array_equal(bits(columns(x, weight, b)), bits(in_order(x, weight, b)))


@needs_numba
def test_a_rows_bits_are_those_it_gets_alone_in_every_tile() -> None:
    """Row counts that take every tile (12, 8, 4, the one-row loop) and a second block of rows:
    each row's bits are those it gets alone, and within two roundings of F.linear's value."""
    from paged_attention.kernels import loop_columns

    g = torch.Generator().manual_seed(3)
    for count, n_out, k_in in [(loop_columns.BLOCK_ROWS + 7, 70, 577), (23, 96, 64), (1, 33, 5)]:
        x = torch.randn(count, k_in, generator=g).bfloat16()
        weight = torch.randn(n_out, k_in, generator=g).bfloat16()
        b = torch.randn(n_out, generator=g).bfloat16()
        together = columns(x, weight, b)
        for r in range(count):
            assert torch.equal(columns(x[r : r + 1], weight, b), together[r : r + 1]), (count, r)
        expected = torch.nn.functional.linear(x.float(), weight.float(), b.float())
        ulp = float(expected.abs().max()) * 2**-7
        assert (together.float() - expected).abs().max() <= 2 * ulp


def test_the_arranged_copy_holds_the_weight_padded_on_a_line() -> None:
    """Value ``[n, k]`` at ``[n // 32, k // 2, n % 32 // 16, n % 16, k % 2]``; the columns past N and
    an odd K's last element are zeros; the copy starts on a 64-byte line."""
    from paged_attention.kernels import loop_columns

    for n_out, k_in in [(33, 7), (64, 576), (5, 2)]:
        weight = np.arange(1, n_out * k_in + 1, dtype=np.uint16).reshape(n_out, k_in)
        arranged = loop_columns.arrange(weight)
        wide, half = -(-n_out // 32) * 32, -(-k_in // 2)
        assert arranged.size == wide * 2 * half and arranged.ctypes.data % 64 == 0
        n, k = np.meshgrid(np.arange(n_out), np.arange(k_in), indexing="ij")
        at = (((n // 32 * half + k // 2) * 2 + n % 32 // 16) * 16 + n % 16) * 2 + k % 2
        assert np.array_equal(arranged[at], weight)
        assert int(arranged.astype(np.int64).sum()) == int(weight.astype(np.int64).sum())  # rest: zeros


@needs_numba
def test_the_row_kernel_takes_every_count_through_columns_where_it_multiplies_pairs(monkeypatch) -> None:
    """Streamed(paired=True) takes up to its ``rows`` (PAIRED_ROWS at most, its ``most``) through the
    column loop, from its own copy (no grouped copy made), and declines more; not paired, it takes
    at most LINEAR_ROWS through the row loop; a kernel that widens never multiplies pairs."""
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(24, 64, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    paired = rows.Streamed(rows=rows.PAIRED_ROWS, wide=False, paired=True)
    assert (
        paired.most == rows.PAIRED_ROWS and rows.Streamed(wide=False, paired=False).most == rows.LINEAR_ROWS
    )
    assert not rows.Streamed(wide=True).paired and rows.Streamed(wide=True).most == rows.LINEAR_ROWS
    prepared = paired.prepare(weight, bias, None)
    x = torch.randn(rows.PAIRED_ROWS + 1, 64, generator=g).bfloat16()
    loop, ways = rows._loop, []
    monkeypatch.setattr(rows, "_loop", lambda way: ways.append(way) or loop(way))
    with torch.inference_mode():
        each = columns(x, weight, bias)
        for count in (1, 4, 5, 17, rows.PAIRED_ROWS):
            assert torch.equal(paired(x[:count], prepared, bias), each[:count])
        assert ways == ["columns"] * 5 and prepared.grouped is None and prepared.arranged is not None
        assert paired(x, prepared, bias) is None  # more than it takes: oneDNN's product
        paired.rows = 8  # as a tuning may lower it
        assert paired(x[:9], prepared, bias) is None and torch.equal(paired(x[:8], prepared, bias), each[:8])


@needs_numba
def test_the_batch_invariant_mode_multiplies_columns_whole_where_the_cpu_has_pairs(monkeypatch) -> None:
    """A bfloat16 engine in batch-invariant mode on a CPU with bfloat16 pairs (pretended here) gives
    its layers a row kernel that takes no rows of its own but every product of the mode, whole
    (no chunks of padded rows); prompts decoded together get the tokens each gets alone. Without
    pairs (nor widening) the layers keep oneDNN's chunks, and so with AMX tiles."""
    from paged_attention import LLM, SamplingParams
    from paged_attention.engine.worker import tuning
    from paged_attention.kernels import widened
    from paged_attention.models import invariant
    from paged_attention.models.merged_projections import product_owners

    monkeypatch.setattr(widened, "needed", lambda: False)
    monkeypatch.setattr(tuning, "_tiles", lambda: False)  # (with AMX oneDNN's chunks stay)
    loop, calls = rows._loop, []
    monkeypatch.setattr(
        rows, "_loop", lambda way: lambda x, n, *a: calls.append((way, n)) or loop(way)(x, n, *a)
    )
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 14)]
    params = SamplingParams(temperature=0, max_tokens=6)
    for paired in (True, False):
        monkeypatch.setattr(rows.Streamed, "paired", property(lambda self, p=paired: p))
        llm = LLM(dtype="bfloat16", num_kv_blocks=64, block_size=4, batch_invariant=True)
        owners = product_owners(llm.llm_engine.runner.model)
        assert all((o.rows is not None and o.rows.rows == 0) is paired for o in owners)
        calls.clear()
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert bool(calls) is paired and all(way == "columns" for way, _ in calls)
        assert (max((n for _, n in calls), default=0) > invariant.ROWS) is paired  # whole, not chunked
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        assert together == alone
    monkeypatch.setattr(rows.Streamed, "paired", property(lambda self: True))
    assert tuning.bfloat16_row_kernel(invariant=True) is not None
    assert tuning.bfloat16_row_kernel(invariant=False) is None  # (the fast path measures its own)
    monkeypatch.setattr(tuning, "_tiles", lambda: True)
    assert tuning.bfloat16_row_kernel(invariant=True) is None
