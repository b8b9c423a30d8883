"""float32 products of a few rows from a tiled weight (:mod:`paged_attention.kernels.tiled`).

The contract: where :func:`tile_like` tiles a weight, the loop's product of one or two rows is, bit
for bit, what the product it stands in for (oneDNN's packed product of many rows) gives those rows;
a row's result never depends on the rows beside it; the engine's float32 layers take it for a
one-sequence step and write the same tokens as with oneDNN throughout.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_attention import LLM, SamplingParams
from paged_attention.kernels import compiled, tiled
from paged_attention.models import packed_linear
from paged_attention.models.merged_projections import MergedMember
from paged_attention.models.packed_linear import PackedLinear, pack_weight, packed_product

from .test_tuning import measured_as

needs_packing = pytest.mark.skipif(not packed_linear.packing_available(), reason="oneDNN cannot pack here")
#: oneDNN's float32 order of sums, which the loop follows, was measured on its AVX-512 kernel.
AVX512 = torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")
needs_avx512 = pytest.mark.skipif(not AVX512, reason="oneDNN's float32 order was measured on AVX-512")

#: SmolLM2-135M's products: merged Q/K/V, o_proj, merged gate/up, down_proj, (a slice of) the output layer.
SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576)]


def _packed(weight: torch.Tensor, bias: torch.Tensor | None):
    packed = pack_weight(weight)
    return lambda x: packed_product(x, packed, bias)


@needs_packing
@needs_avx512
@pytest.mark.parametrize("shape", SMOLLM2)
@pytest.mark.parametrize("with_bias", [False, True])
def test_smollm2s_products_are_tiled_and_equal_onednns_bits(shape, with_bias) -> None:
    """On an AVX-512 CPU (oneDNN's kernel whose order the loop follows) every SmolLM2 product is
    tiled, and fresh rows (not the probe) come out as oneDNN's product of 16 rows gives them."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(shape, generator=g) * 0.05
    bias = torch.randn(shape[0], generator=g) if with_bias else None
    product = _packed(weight, bias)
    tiles = tiled.tile_like(weight, bias, product)
    assert tiles is not None
    assert tiles.block == (1024 if shape[1] == 1536 else 512)  # oneDNN's blocks of K, as measured
    x = torch.randn(16, shape[1], generator=g) * 3
    with torch.inference_mode():
        expected = product(x)
        for rows in range(1, tiled.ROWS + 1):
            for start in (0, 5, 16 - rows):
                assert torch.equal(
                    tiled.tiled_product(x[start : start + rows], tiles, bias), expected[start : start + rows]
                )


@needs_packing
@needs_avx512
def test_a_shape_matched_before_is_checked_on_fewer_rows_and_searched_again_if_wrong(monkeypatch) -> None:
    """A second weight of a shape takes the block matched for the first after a check of the probe's
    first rows (one product for each of their row counts, bit for bit, not the whole probe); a block
    remembered wrongly for a shape is found out by that check, and the right one searched for."""
    g = torch.Generator().manual_seed(2)
    first, second = (torch.randn(576, 576, generator=g) * 0.05 for _ in range(2))
    calls = []
    loop = tiled.tiled_product
    monkeypatch.setattr(tiled, "tiled_product", lambda *a: calls.append(1) or loop(*a))
    key = (576, 576, False, torch.get_num_threads())
    monkeypatch.delitem(tiled._matched, key, raising=False)
    assert tiled.tile_like(first, None, _packed(first, None)).block == 512
    searched, calls[:] = len(calls), []
    assert tiled.tile_like(second, None, _packed(second, None)).block == 512
    assert len(calls) == sum(tiled.ROWS // rows for rows in range(1, tiled.ROWS + 1)) < searched
    monkeypatch.setitem(tiled._matched, key, 1024)  # one block for all of K = 576: not oneDNN's order
    tiles = tiled.tile_like(second, None, _packed(second, None))
    assert tiles.block == 512 and tiled._matched[key] == 512


@needs_packing
@settings(max_examples=25, deadline=None)
@given(
    out_features=st.integers(1, 200),
    in_features=st.sampled_from([1, 3, 64, 511, 512, 513, 700, 1024, 1100, 2100]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_where_a_weight_is_tiled_its_rows_are_the_packed_products_bits(
    out_features, in_features, with_bias, seed
):
    """Any shape (columns past a whole tile, K below, at and past a block): either :func:`tile_like`
    declines, or every row it multiplies is the packed product's, and within float32 rounding of
    the exact product. On AVX-512 every weight of more than one output is tiled (oneDNN multiplies a
    single output column another way: that one is declined, found out by the probe)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    product = _packed(weight, bias)
    tiles = tiled.tile_like(weight, bias, product)
    if tiles is None:
        assert not (AVX512 and compiled.available() and out_features > 1)
        return
    x = torch.randn(64, in_features, generator=g)
    with torch.inference_mode():
        expected = product(x)
        got = torch.cat([tiled.tiled_product(x[i : i + 2], tiles, bias) for i in range(0, 64, 2)])
        alone = torch.cat([tiled.tiled_product(x[i : i + 1], tiles, bias) for i in range(64)])
    assert torch.equal(got, expected) and torch.equal(alone, expected)
    exact = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    bound = 1e-6 * in_features * (x.double().abs() @ weight.double().abs().T + 1)
    assert ((got.double() - exact).abs() <= bound).all()


def test_a_rows_result_does_not_depend_on_the_row_beside_it() -> None:
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(130, 1536, generator=g)
    tiles = tiled.tile(weight, 1024)
    x = torch.randn(2, 1536, generator=g)
    with torch.inference_mode():
        pair = tiled.tiled_product(x, tiles, None)
        assert torch.equal(pair[0], tiled.tiled_product(x[:1], tiles, None)[0])
        assert torch.equal(pair[1], tiled.tiled_product(torch.stack([x[1] * 7, x[1]]), tiles, None)[1])


def test_tiled_products_decline_what_they_do_not_take_and_tile_refuses_bad_input() -> None:
    weight = torch.randn(5, 8)
    tiles = tiled.tile(weight, 512)
    with torch.inference_mode():
        assert tiled.tiled_product(torch.randn(1, 1, 8), tiles, None).shape == (1, 1, 5)  # leading dims kept
        assert tiled.tiled_product(torch.randn(tiled.ROWS + 1, 8), tiles, None) is None  # oneDNN's rows
        assert tiled.tiled_product(torch.randn(1, 8).bfloat16(), tiles, None) is None  # float32 only
        assert tiled.tiled_product(torch.randn(1, 9), tiles, None) is None  # K does not match
        assert tiled.tiled_product(torch.randn(1, 8), tiles, torch.zeros(4)) is None  # nor does the bias
        assert tiled.tile_like(weight.bfloat16(), None, lambda x: x) is None
    assert tiled.tiled_product(torch.randn(1, 8), tiles, None) is None  # autograd on: the ordinary product
    with pytest.raises(ValueError, match="weight must be a 2-D float32"):
        tiled.tile(weight.double(), 512)
    with pytest.raises(ValueError, match="block must be a positive int"):
        tiled.tile(weight, 0)
    assert tiles.nbytes == 64 * 8 * 4  # one tile of 64 columns, zero-padded past the 5 real ones


@needs_packing
def test_a_packed_layer_retiles_when_its_weight_changes() -> None:
    linear = torch.nn.Linear(40, 70)
    layer = PackedLinear(linear, tiled.TILED)
    assert isinstance(layer.prepared, tiled.Tiles)
    x = torch.randn(1, 40)
    with torch.no_grad():
        linear.weight.mul_(3.0)
    with torch.inference_mode():
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, linear.weight, linear.bias), atol=1e-5)


@needs_packing
@needs_avx512
@pytest.mark.skipif(not compiled.available(), reason="Numba unavailable")
def test_the_engines_float32_layers_take_tiles_for_one_sequence_and_write_the_same_tokens(
    monkeypatch,
) -> None:
    """float32, compiled backend: every packed and merged layer is tiled; a one-sequence decode
    multiplies through the tiles (where this machine measured them faster: here told so); its
    greedy tokens are those of oneDNN throughout."""
    measured_as(monkeypatch, {1: 2.0, 2: 2.0})
    llm = LLM(dtype="float32", num_kv_blocks=32, block_size=4, attention_backend="compiled")
    model = llm.llm_engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    groups = {id(m.group): m.group for m in model.modules() if isinstance(m, MergedMember) and m.group}
    owners = [*layers, *groups.values()]
    assert layers and groups and all(isinstance(o.prepared, tiled.Tiles) for o in owners)
    calls = []
    original = tiled.tiled_product

    def counted(*args):
        out = original(*args)
        calls.append(out is not None)  # the tiles multiplied (None: declined, oneDNN's product)
        return out

    monkeypatch.setattr(tiled, "tiled_product", counted)
    params = SamplingParams(temperature=0, max_tokens=12)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]
    text = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert sum(calls) >= 11 * len(owners)  # every layer, every decode step
    for owner in owners:
        owner.prepared = None
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == text
