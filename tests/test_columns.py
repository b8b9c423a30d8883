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
    the pairs of K in order, the odd element's product first, each step a fused multiply-add (the
    exact product added, then rounded to float32: in float64, where the product of two bfloat16
    is exact and the sum of it and a float32 rounds to float32 as if done at once); the bias;
    rounded once to bfloat16; NaN as ``0x7FC0``."""
    xs, ws = x.double(), weight.double()
    if x.shape[1] % 2:  # (an odd K's last pair: a zero beside it)
        xs, ws = torch.nn.functional.pad(xs, (0, 1)), torch.nn.functional.pad(ws, (0, 1))
    total = torch.zeros(x.shape[0], weight.shape[0])
    for p in range(xs.shape[1] // 2):
        for k in (2 * p + 1, 2 * p):
            total = (total.double() + xs[:, k, None] * ws[None, :, k]).float()
    if bias is not None:
        total = total + bias.float()
    out = total.bfloat16()
    out.view(torch.int16)[total.isnan()] = 0x7FC0
    return out


SPECIALS = (float("nan"), float("inf"), -float("inf"), 3.0e38, -3.0e38)  # (products past float32's range)


@needs_numba
@settings(max_examples=40, deadline=None)
@given(
    count=st.one_of(st.just(1), st.integers(2, 30), st.integers(110, 140)),  # (one row; past a block)
    n_out=st.one_of(st.integers(1, 70), st.sampled_from([32, 64, 96, 97, 128, 160])),  # (whole blocks)
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
def test_every_tile_and_tail_writes_each_output_once_in_the_promised_order() -> None:
    """A grid over every tile (12, 8, 4, the one-row loop over two blocks and its odd last block),
    more than BLOCK_ROWS rows, whole blocks and the last columns aside, K odd and 1; the output is a
    window of a larger array filled with a sentinel, which nothing outside the window may change
    (every output is checked, so each is written)."""
    from paged_attention.kernels import loop_columns

    g = torch.Generator().manual_seed(11)
    for count in (1, 2, 3, 4, 5, 8, 9, 12, 13, 27, loop_columns.BLOCK_ROWS, loop_columns.BLOCK_ROWS + 13):
        for n_out in (1, 31, 32, 33, 64, 96, 97):
            for k_in in (1, 2, 3, 33):
                x = torch.randn(count, k_in, generator=g).bfloat16()
                weight = torch.randn(n_out, k_in, generator=g).bfloat16()
                b = torch.randn(n_out, generator=g).bfloat16() if k_in % 2 else None
                frame = np.full(count * n_out + 64, 0xABCD, np.uint16)
                out = frame[32:-32].reshape(count, n_out)  # (a C-order window, 32 sentinels each side)
                bias = bits(b) if b is not None else np.zeros(0, np.uint16)
                loop_columns.linear_columns(bits(x), loop_columns.arrange(bits(weight)), bias, out)
                np.testing.assert_array_equal(out, bits(in_order(x, weight, b)))
                assert (frame[:32] == 0xABCD).all() and (frame[-32:] == 0xABCD).all()


@needs_numba
def test_products_past_float32s_range_are_not_rounded_on_their_own() -> None:
    """Each step is a fused multiply-add (as ``vdpbf16ps`` and its two-FMA coding): -2 * 3e38 is
    not -inf before the next product is added (the sums below stay finite, or +inf, not NaN)."""
    cases = [([-2.0, 1.0, 0.0, 0.0], [3.0e38, 3.0e38, 0.0, 0.0]), ([-2.0, float("inf")], [3.0e38, 1.0])]
    for xs, ws in cases:
        x, weight = torch.tensor([xs]).bfloat16(), torch.tensor([ws]).bfloat16()
        got = columns(x, weight, None)
        np.testing.assert_array_equal(bits(got), bits(in_order(x, weight, None)))
        assert not got.isnan().any()


@needs_numba
def test_a_rows_bits_are_those_it_gets_alone_in_every_tile() -> None:
    """Row counts that take every tile (12 + 12 + 4, 12 + 8, the one-row loop) and a second block of rows:
    each row's bits are those it gets alone, and within two roundings of F.linear's value."""
    from paged_attention.kernels import loop_columns

    g = torch.Generator().manual_seed(3)
    for count, n_out, k_in in [(loop_columns.BLOCK_ROWS + 7, 70, 577), (27, 96, 64), (1, 33, 5)]:
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


@needs_numba
def test_a_step_with_prompt_rows_leaves_every_product_to_onednn(monkeypatch) -> None:
    """Inside ``prompt_rows`` a kernel that multiplies pairs declines every product (oneDNN's then,
    whose bits for a row do not depend on the rows beside it) and one that widens keeps them; an
    engine holds it for the steps with prompt rows only, so a prompt's rows left after a cached
    prefix meet the same product as the prompt whole, and the answers are the same."""
    from paged_attention import LLM, SamplingParams
    from paged_attention.kernels import widened

    g = torch.Generator().manual_seed(2)
    weight = torch.randn(24, 64, generator=g).bfloat16()
    x = torch.randn(8, 64, generator=g).bfloat16()
    paired = rows.Streamed(rows=rows.PAIRED_ROWS, wide=False, paired=True)
    wide = rows.Streamed(wide=True)
    with torch.inference_mode():
        prepared, kept = paired.prepare(weight, None, None), wide.prepare(weight, None, None)
        with rows.prompt_rows():
            assert paired(x, prepared, None) is None and wide(x, kept, None) is not None
        with rows.prompt_rows(False):
            assert paired(x, prepared, None) is not None
    monkeypatch.setattr(widened, "needed", lambda: False)
    monkeypatch.setattr(rows.Streamed, "paired", property(lambda self: True))
    loop, calls = rows._loop, []
    monkeypatch.setattr(
        rows, "_loop", lambda way: lambda x, n, *a: calls.append(rows._prompts.get()) or loop(way)(x, n, *a)
    )
    prefix = list(range(5, 5 + 32))  # (two blocks of 16: cached whole)
    prompts = [{"prompt_token_ids": [*prefix, 40 + i, 50 + i, 60 + i]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8)
    answers = []
    for caching in (False, True):
        llm = LLM(dtype="bfloat16", num_kv_blocks=64, block_size=16, enable_prefix_caching=caching)
        if caching:
            llm.generate(prompts[:1], params, use_tqdm=False)
        calls.clear()
        answers.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert calls and not any(calls)  # the kernel took decode steps' products, no prompt's
    assert answers[0] == answers[1]
