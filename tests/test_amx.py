"""The AMX loops (:mod:`paged_attention.kernels.loop_amx`): against the float64 reference, bit for
bit the same row whether it is computed in a prompt, after a cached prefix or as a decode step, and
taken exactly where :mod:`paged_attention.kernels.tiles` says. Skipped on processors without AMX
(the tests of :mod:`paged_attention.kernels.compiled` cover the other loops there)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from paged_attention import kernels
from paged_attention.kernels import compiled, per_layer, reference, tiles

from .kernel_cases import TOLERANCE, make_paged_case, query_start_loc

amx = pytest.importorskip("paged_attention.kernels.amx")
numba = pytest.importorskip("numba")
needs_amx = pytest.mark.skipif(not amx.permitted(), reason="this processor (or process) has no AMX")


def test_the_tile_record_names_each_tiles_rows_and_width_and_refuses_what_a_tile_cannot_hold():
    record = amx.config({0: (16, 12), 5: (3, 64)})
    assert record[0] == 1 and record[48] == 16 and record[53] == 3
    assert record[16:18].view("<u2")[0] == 12 and record[26:28].view("<u2")[0] == 64
    for shape in ({0: (17, 64)}, {1: (16, 65)}, {8: (1, 4)}, {2: (0, 4)}):
        with pytest.raises(ValueError, match="allowed: 1-16 rows of 1-64 bytes"):
            amx.config(shape)


@numba.njit(boundscheck=False)
def _layouts(block, weights, transposed, spread):  # pragma: no cover - compiled
    amx.transpose16(transposed, 0, block, 0)
    amx.spread16(spread, 0, weights, 0)


def test_the_tile_layouts_transpose_a_block_and_spread_weights_over_even_and_odd_slots():
    """Vector shuffles only (no tile instruction): checked on any processor."""
    generator = np.random.default_rng(3)
    block = generator.integers(0, 2**32, (16, 16), dtype=np.uint32)
    weights = torch.randn(16, 16).bfloat16().float().numpy()  # rounded to bfloat16, as the softmax's
    transposed, spread = np.zeros((16, 16), np.uint32), np.zeros((2, 16, 16), np.uint32)
    _layouts(block, weights, transposed, spread)
    np.testing.assert_array_equal(transposed, block.T)
    bits = weights.view(np.uint32).T  # a row per column, a word per position
    np.testing.assert_array_equal(spread[0], bits >> 16)  # even slots: the low halves
    np.testing.assert_array_equal(spread[1], bits)  # odd slots: the high halves (low halves zero)


def test_amx_can_be_switched_off_from_the_environment():
    env = {**os.environ, "PAGED_ATTENTION_AMX": "0"}
    code = "from paged_attention.kernels import amx, tiles; import torch; "
    code += "print(amx.permitted(), tiles.rows(torch.bfloat16, torch.bfloat16, 9, (4, 16, 3, 64)))"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "0"]


@needs_amx
def test_tiles_take_bfloat16_caches_whose_blocks_heads_and_groups_fit_a_tile():
    bf16 = torch.bfloat16
    assert tiles.rows(bf16, bf16, 9, (4, 16, 3, 64)) == 5  # SmolLM2: 3 query heads a KV head, 5 rows of them
    assert tiles.rows(bf16, bf16, 16, (4, 32, 1, 128)) == 1  # MQA with 16 heads: one row fills the tile
    assert tiles.rows(bf16, bf16, 8, (4, 16, 8, 64)) == 16
    for dtype, cache, heads, shape, quantized in [
        (torch.float32, torch.float32, 9, (4, 16, 3, 64), False),  # the tiles multiply bfloat16 only
        (bf16, torch.float8_e4m3fn, 9, (4, 16, 3, 64), False),  # an 8-bit cache, even without scales
        (bf16, bf16, 9, (4, 8, 3, 64), False),  # a tile of 16 positions would cross a block
        (bf16, bf16, 9, (4, 16, 3, 80), False),  # a key tile holds 32 dimensions
        (bf16, bf16, 32, (4, 16, 1, 64), False),  # 32 query heads do not fit 16 columns
        (bf16, bf16, 9, (4, 16, 3, 64), True),  # scaled (8-bit) caches keep the loop nest
    ]:
        assert tiles.rows(dtype, cache, heads, shape, quantized) == 0


#: (query heads, KV heads), head size, block size; the last: 7 KV heads of 3 columns share the
#: softmax's 16 lanes 5 and 2 at a time in decode.
CASES = [((9, 3), 64, 16), ((8, 8), 64, 32), ((16, 1), 128, 16), ((8, 2), 96, 64), ((21, 7), 64, 16)]


@needs_amx
@pytest.mark.parametrize(("heads", "head_dim", "block_size"), CASES)
def test_decode_and_prompts_on_the_tiles_match_the_reference(heads, head_dim, block_size, monkeypatch):
    """Lengths at and across the 16-position tiles and 32-position chunks, prompts whole and after
    a cached prefix, NaN in every slot past a sequence: within bfloat16's tolerance of float64, and
    the loop nest never called."""
    from paged_attention.kernels import loop_nest

    monkeypatch.setattr(loop_nest, "prefill", None)  # would fail if a call took the loop nest
    monkeypatch.setattr(loop_nest, "decode_layer", None)
    monkeypatch.setattr(compiled, "_compile", lambda: None)
    lens = [1, 15, 16, 17, 31, 32, 33, 100, 257]
    case = make_paged_case(lens, block_size, heads[1], head_dim, torch.bfloat16, seed=head_dim + block_size)
    q = torch.randn(len(lens), heads[0], head_dim).bfloat16()
    args = (q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    out = kernels.paged_decode(*args, backend="compiled")
    exact = reference.paged_decode(*(a.double() if a.is_floating_point() else a for a in args))
    torch.testing.assert_close(out.double(), exact, **TOLERANCE[torch.bfloat16])

    q_lens = [1, 7, 16, 5, 31, 17, 33, 65, 100]  # the rest of each sequence: a cached prefix
    query = torch.randn(sum(q_lens), heads[0], head_dim).bfloat16()
    prompt_args = (query, *args[1:], query_start_loc(q_lens))
    out = kernels.paged_prefill(*prompt_args, backend="compiled")
    expected = reference.paged_prefill(*prompt_args, compute=torch.float64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])


@needs_amx
@pytest.mark.parametrize(("heads", "head_dim", "block_size"), CASES)
def test_a_row_gets_the_same_bits_in_a_prompt_after_a_cached_prefix_and_as_a_decode_step(
    heads, head_dim, block_size
):
    """Batch invariance: the prefix cache and chunked prefill hand the loops the same row in other
    company and at another place in its tile; decode hands it over alone."""
    length = 150
    case = make_paged_case([length], block_size, heads[1], head_dim, torch.bfloat16, seed=7)
    query = torch.randn(length, heads[0], head_dim).bfloat16()
    cache = (case.key_cache, case.value_cache, case.block_tables)

    def prompt(rows: slice) -> torch.Tensor:
        new = rows.stop - rows.start
        return kernels.paged_prefill(query[rows], *cache, torch.tensor([rows.stop], dtype=torch.int32),
                                     query_start_loc([new]), backend="compiled")  # fmt: skip

    whole = prompt(slice(0, length))
    for cut in (1, 7, 32, 33, 149):
        assert torch.equal(torch.cat([prompt(slice(0, cut)), prompt(slice(cut, length))]), whole), cut
    for position in (0, 31, 32, 100, 149):
        seen = torch.tensor([position + 1], dtype=torch.int32)
        step = kernels.paged_decode(query[position : position + 1], *cache, seen, backend="compiled")
        assert torch.equal(step[0], whole[position]), position


@needs_amx
def test_sharp_softmaxes_on_the_tiles_stay_as_accurate_as_the_loop_nest(monkeypatch):
    """Scores hundreds apart: the running maximum moves chunk after chunk and most weights underflow;
    rounding the weights to bfloat16 for the tiles costs no more than the output's own rounding."""
    case = make_paged_case([300, 77, 16], 16, 3, 64, torch.bfloat16, seed=5)
    generator = torch.Generator().manual_seed(5)
    for factor in (40.0, 1.0, 0.0):
        q = (torch.randn(3, 9, 64, generator=generator) * factor).bfloat16()
        args = (q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
        exact = reference.paged_decode(*(a.double() if a.is_floating_point() else a for a in args))
        out = kernels.paged_decode(*args, backend="compiled")
        with monkeypatch.context() as patch:
            patch.setenv("PAGED_ATTENTION_AMX", "0")
            patch.setattr(tiles, "rows", lambda *a, **k: 0)
            loops = kernels.paged_decode(*args, backend="compiled")
        loop_error = (loops.double() - exact).abs().max().item()
        assert (out.double() - exact).abs().max().item() <= 2 * loop_error + 1e-2 * exact.abs().max().item()


@needs_amx
def test_one_call_per_layer_on_the_tiles_stores_and_attends_as_the_two_calls_do():
    case = make_paged_case([40, 1, 63], 16, 3, 64, torch.bfloat16, seed=2)  # room for one more each
    caches = torch.stack([torch.stack([case.key_cache, case.value_cache])] * 2)  # two layers
    q = torch.randn(3, 9, 64).bfloat16()
    key, value = torch.randn(2, 3, 3, 64).bfloat16()
    tables, lens = case.block_tables, case.seq_lens + 1
    slots = torch.tensor(
        [int(tables[i, n // 16]) * 16 + n % 16 for i, n in enumerate(case.seq_lens.tolist())]
    )
    step = per_layer.DecodeStep.build(caches, slots, tables, lens)
    assert step is not None
    out = per_layer.decode_layer(q, key, value, 1, step, 0.125)
    compiled.store_kv(key, value, case.key_cache, case.value_cache, slots)
    for stored, cache in zip(caches[1], (case.key_cache, case.value_cache), strict=True):
        assert torch.equal(stored.view(torch.int16), cache.view(torch.int16))  # bits: NaN outside
    expected = kernels.paged_decode(
        q, case.key_cache, case.value_cache, tables, lens, 0.125, backend="compiled"
    )
    assert torch.equal(out, expected)
