"""bfloat16 products of many rows from weights widened to float32 (paged_attention.kernels.widened):
the float32 sums of the exact products, rounded once; the shapes it takes and declines; the engine's
row kernel handing it the products of many rows only where asked (or where the CPU needs it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_attention import LLM, SamplingParams
from paged_attention.kernels import compiled, rows, widened
from paged_attention.models import invariant, packed_linear

needs_numba = pytest.mark.skipif(not compiled.available(), reason="Numba unavailable")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The float32 sums of the exact products (bfloat16 times bfloat16 fits a float32), plus the bias."""
    out = x.double() @ weight.double().t()
    return (out if bias is None else out + bias.double()).float()


@needs_numba
@settings(max_examples=25, deadline=None)
@given(
    rows_=st.integers(widened.WIDE_ROWS, 48),
    n_out=st.integers(1, 70),
    k_in=st.integers(1, 90),
    bias=st.booleans(),
    slice_=st.sampled_from([1, 64, 1000, widened.SLICE]),
    seed=st.integers(0, 2**16),
)
def test_a_widened_product_is_the_float32_sum_rounded_once(rows_, n_out, k_in, bias, slice_, seed) -> None:
    """Whatever the slices (one weight row each, or all of them at once), each output is within
    half a bfloat16 step of the float32 sum (rounded once; the sums' order is MKL's) and within one
    rounding of F.linear's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows_, k_in, generator=g).bfloat16()
    weight = torch.randn(n_out, k_in, generator=g).bfloat16()
    b = torch.randn(n_out, generator=g).bfloat16() if bias else None
    original = widened.SLICE
    widened.SLICE = slice_
    try:
        with torch.inference_mode():
            got = widened.linear(x, weight, b)
            expected = F.linear(x, weight, b)
    finally:
        widened.SLICE = original
    assert got is not None and got.shape == (rows_, n_out) and got.dtype == torch.bfloat16
    exact = reference(x, weight, b)
    step = torch.finfo(torch.bfloat16).eps * exact.abs()  # one bfloat16 step at each value
    scale = 1e-5 * (x.float().abs() @ weight.float().abs().t()).clamp(min=1.0)  # float32 sums' order
    assert bool(((got.float() - exact).abs() <= step / 2 + scale).all())
    assert bool(((got.float() - expected.float()).abs() <= step + scale).all())


@needs_numba
def test_a_widened_product_keeps_leading_dims_and_declines_what_it_does_not_take() -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(24, 40, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    x = torch.randn(2, widened.WIDE_ROWS, 40, generator=g).bfloat16()
    with torch.inference_mode():
        got = widened.linear(x, weight, bias)
        assert got is not None and got.shape == (2, widened.WIDE_ROWS, 24)
        assert torch.equal(got.reshape(-1, 24), widened.linear(x.reshape(-1, 40), weight, bias))
        few = x[0, : widened.WIDE_ROWS - 1]
        assert widened.linear(few, weight, bias) is None  # too few rows: oneDNN's product
        assert widened.linear(x.float(), weight, bias) is None  # float32: not this kernel's
        assert widened.linear(x, weight.float(), None) is None
        assert widened.linear(x, weight, bias.float()) is None  # a bias of another dtype
        assert widened.linear(x, weight, bias[:5]) is None  # nor shape
        assert widened.linear(x[..., :39], weight, bias) is None  # K does not match
        assert widened.linear(x, weight.t().contiguous().t(), None) is None  # a strided weight
    assert widened.linear(x, weight, bias) is None  # autograd on: the ordinary product


@needs_numba
def test_the_row_kernel_widens_many_rows_only_where_asked() -> None:
    """Streamed(wide=True) hands products of WIDE_ROWS rows or more to the widened product (the same
    bits), fewer to its row loop; Streamed(wide=False) declines them (oneDNN's then); by default it
    widens exactly where the CPU lacks bfloat16 arithmetic."""
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(24, 64, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    many = torch.randn(widened.WIDE_ROWS + 3, 64, generator=g).bfloat16()
    one = many[:1]
    wide, narrow = rows.Streamed(wide=True), rows.Streamed(wide=False)
    with torch.inference_mode():
        prepared = wide.prepare(weight, bias, None)
        assert torch.equal(wide(many, prepared, bias), widened.linear(many, weight, bias))
        assert narrow(many, prepared, bias) is None
        assert torch.equal(wide(one, prepared, bias), rows.linear_rows(one, weight, bias))
    assert rows.Streamed().wide is widened.needed()


@needs_numba
def test_an_engine_widens_its_prompts_where_asked_and_keeps_its_tokens(monkeypatch) -> None:
    """A bfloat16 engine (compiled backend) on a CPU that needs widening (pretended here) prefills
    through the widened product (its one-row decode steps do not); its greedy tokens are those of
    the same engine with oneDNN's products. In batch-invariant mode nothing is widened."""
    calls: list[int] = []
    product = widened.linear

    def counted(x, weight, bias):
        out = product(x, weight, bias)
        if out is not None:  # (a product it declined does not count)
            calls.append(x.numel() // x.shape[-1])
        return out

    monkeypatch.setattr(widened, "linear", counted)
    monkeypatch.setattr(widened, "needed", lambda: True)
    prompt = [{"prompt_token_ids": list(range(5, 5 + 2 * widened.WIDE_ROWS))}]
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4, attention_backend="compiled")
    tokens = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert calls and min(calls) >= widened.WIDE_ROWS
    monkeypatch.setattr(widened, "needed", lambda: False)
    plain = LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4, attention_backend="compiled")
    assert plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == tokens
    monkeypatch.setattr(widened, "needed", lambda: True)
    calls.clear()
    invariant = LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4, batch_invariant=True)
    invariant.generate(prompt, params, use_tqdm=False)
    assert not calls


@needs_numba
@pytest.mark.skipif(not packed_linear.packing_available(), reason="oneDNN cannot pack here")
def test_a_packed_layer_tries_no_row_kernel_in_batch_invariant_mode(monkeypatch) -> None:
    """The mode's fixed chunks of rows (16, WIDE_ROWS) go to oneDNN's product even where the layer
    holds a widening row kernel (a model first served by another engine): a row's bits are then
    the same in any batch."""
    linear = torch.nn.Linear(40, 24).bfloat16()
    layer = packed_linear.PackedLinear(linear, rows.Streamed(wide=True))
    calls = []
    product = widened.linear
    monkeypatch.setattr(widened, "linear", lambda *args: calls.append(1) or product(*args))
    x = torch.randn(invariant.ROWS + 4, 40).bfloat16()
    with torch.inference_mode():
        layer(x)
        assert calls  # outside the mode: widened
        calls.clear()
        with invariant.batch_invariant():
            got = layer(x)
            alone = layer(x[:1])
    assert not calls and torch.equal(got[:1], alone)


def test_widening_is_needed_on_avx512_without_bfloat16_instructions_only(monkeypatch) -> None:
    from llvmlite import binding

    for features, expected in (
        ({"avx512f": True, "avx512bf16": False, "amx-bf16": False}, True),  # an Ice Lake Xeon
        ({"avx512f": True, "avx512bf16": True, "amx-bf16": False}, False),  # a Zen 4
        ({"avx512f": True, "avx512bf16": True, "amx-bf16": True}, False),  # a Sapphire Rapids
        ({"avx2": True, "avx512f": False, "avx512bf16": False}, False),  # no AVX-512: not measured
    ):
        monkeypatch.setattr(binding, "get_host_cpu_features", lambda f=features: f)
        assert widened.needed.__wrapped__() is expected
