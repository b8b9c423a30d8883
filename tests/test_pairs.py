"""bfloat16 products of many rows four at a time in pair instructions
(:mod:`paged_attention.kernels.loop_pairs`): the row loop's bits for every shape (rows padded to
fours, blocks of rows, tails of K % 32 and N % 4, a bias or none); the row kernel taking them on a
CPU that multiplies bfloat16 pairs, up to the rows its tuning chose; the tuning's row counts."""

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


def both(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray]:
    """(linear_pairs, linear_groups) of the same product, as bits."""
    from paged_attention.kernels import loop_pairs, loop_rows

    w = bits(weight)
    grouped = loop_rows.group(w)
    b = bits(bias) if bias is not None else np.zeros(0, np.uint16)
    pairs = np.full((x.shape[0], w.shape[0]), 0xFFFF, np.uint16)  # (every output must be written)
    alone = np.zeros_like(pairs)
    loop_pairs.linear_pairs(bits(x), w, grouped, b, pairs)
    loop_rows.linear_groups(bits(x), w, grouped, b, alone)
    return pairs, alone


SPECIALS = (float("nan"), float("inf"), -float("inf"), 1e-39, 3.0e38, 1.00390625)  # (a subnormal; a tie)


@needs_numba
@settings(max_examples=40, deadline=None)
@given(
    rows_=st.one_of(st.integers(1, 19), st.integers(60, 140)),  # (past one block of rows, and not)
    n_out=st.integers(1, 40),
    k_in=st.integers(1, 130),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
    specials=st.lists(st.sampled_from(SPECIALS), max_size=3),
)
def test_four_rows_at_a_time_give_the_row_loops_bits(rows_, n_out, k_in, bias, seed, specials) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows_, k_in, generator=g).bfloat16()
    weight = torch.randn(n_out, k_in, generator=g).bfloat16()
    b = torch.randn(n_out, generator=g).bfloat16() if bias else None
    for i, value in enumerate(specials):  # in the inputs, the weights and the bias in turn
        target = (x, weight, b if b is not None else x)[i % 3].view(-1)
        target[int(torch.randint(target.numel(), (1,), generator=g))] = value
    pairs, alone = both(x, weight, b)
    np.testing.assert_array_equal(pairs, alone)


@needs_numba
def test_blocks_of_rows_and_the_last_padded_four_give_the_row_loops_bits() -> None:
    """Past BLOCK_ROWS rows the weights are read again for each block; the last block's padding
    rows are not written anywhere (SmolLM2's K, a K with a tail, large values that overflow in a
    few outputs)."""
    from paged_attention.kernels import loop_pairs

    g = torch.Generator().manual_seed(7)
    for count, n_out, k_in in [(2 * loop_pairs.BLOCK_ROWS + 3, 13, 576), (loop_pairs.BLOCK_ROWS + 5, 8, 70)]:
        x = torch.randn(count, k_in, generator=g).bfloat16()
        x[3, :] = 1.0e38  # (some sums overflow: infinities and NaN come out as the row loop's)
        x[5, ::2], x[5, 1::2] = 1.0e38, -1.0e38
        weight = torch.randn(n_out, k_in, generator=g).bfloat16()
        pairs, alone = both(x, weight, torch.randn(n_out, generator=g).bfloat16())
        np.testing.assert_array_equal(pairs, alone)
        assert not np.isfinite(
            torch.from_numpy(pairs.view(np.int16)).view(torch.bfloat16).float().numpy()
        ).all()


@needs_numba
def test_the_row_kernel_takes_many_rows_in_pairs_only_where_it_multiplies_pairs(monkeypatch) -> None:
    """Streamed(paired=True) takes up to its ``rows`` (PAIRED_ROWS at most, its ``most``) through the
    pairs' loop with the bits of each row alone and declines more; not paired, it takes at most
    LINEAR_ROWS; a kernel that widens never multiplies pairs."""
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
        each = torch.cat([rows.linear_rows(r[None], weight, bias) for r in x])
        for count in (1, 4, 5, 17, rows.PAIRED_ROWS):
            assert torch.equal(paired(x[:count], prepared, bias), each[:count])
        assert ways == ["pairs"] * 5
        assert paired(x, prepared, bias) is None  # more than it takes: oneDNN's product
        paired.rows = 8  # as a tuning may lower it
        assert paired(x[:9], prepared, bias) is None and torch.equal(paired(x[:8], prepared, bias), each[:8])


@needs_numba
def test_the_batch_invariant_mode_multiplies_pairs_whole_where_the_cpu_has_them(monkeypatch) -> None:
    """A bfloat16 engine in batch-invariant mode on a CPU with bfloat16 pairs (pretended here) gives
    its layers a row kernel that takes no rows of its own but every product of the mode, whole
    (four rows at a time: no chunks of padded rows); prompts decoded together get the tokens each
    gets alone. Without pairs (nor widening) the layers keep oneDNN's chunks, and so with AMX tiles."""
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
        assert bool(calls) is paired and all(way == "pairs" for way, _ in calls)
        assert (max((n for _, n in calls), default=0) > invariant.ROWS) is paired  # whole, not chunked
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        assert together == alone
    monkeypatch.setattr(rows.Streamed, "paired", property(lambda self: True))
    assert tuning.bfloat16_row_kernel(invariant=True) is not None
    assert tuning.bfloat16_row_kernel(invariant=False) is None  # (the fast path measures its own)
    monkeypatch.setattr(tuning, "_tiles", lambda: True)
    assert tuning.bfloat16_row_kernel(invariant=True) is None
