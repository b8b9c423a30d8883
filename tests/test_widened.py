"""bfloat16 products of many rows, the weights widened to float32 in registers, four rows at a time
(paged_attention.kernels.widened, loop_rows.linear_quads): the row loop's bits, the float32 sums of
the exact products rounded once; the shapes it takes and declines; the engine's row kernel handing
it the products of many rows only where asked (or where the CPU needs it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_attention import LLM, SamplingParams
from paged_attention.kernels import compiled, rows, widened
from paged_attention.models import cpu_dtype, invariant, packed_linear

needs_numba = pytest.mark.skipif(not compiled.available(), reason="Numba unavailable")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The float32 sums of the exact products (bfloat16 times bfloat16 fits a float32), plus the bias."""
    out = x.double() @ weight.double().t()
    return (out if bias is None else out + bias.double()).float()


def count_widened(monkeypatch, ways: tuple[str, ...] = ("quads",)) -> list[int]:
    """The rows of every product taken four rows at a time from now on (by the row kernel's loop
    by address, the ``ways`` of ``rows._loop`` counted, or by :func:`widened.linear`)."""
    calls: list[int] = []
    loop, product = rows._loop, widened.linear

    def loops(way: str):
        inner = loop(way)

        def counted(x_address, n, *rest):
            calls.append(n)
            return inner(x_address, n, *rest)

        return counted if way in ways else inner

    def linear(x, weight, bias):
        out = product(x, weight, bias)
        if out is not None:  # (a product it declined does not count)
            calls.append(x.numel() // x.shape[-1])
        return out

    monkeypatch.setattr(rows, "_loop", loops)
    monkeypatch.setattr(widened, "linear", linear)
    return calls


@needs_numba
@settings(max_examples=30, deadline=None)
@given(
    rows_=st.integers(1, 11),
    n_out=st.integers(1, 70),
    k_in=st.integers(1, 130),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_four_rows_at_a_time_give_the_row_loops_bits(rows_, n_out, k_in, bias, seed) -> None:
    """linear_quads: whatever the rows (quads and the rows past them), the outputs (tails of K and N
    included) and the bias, each output has the row loop's bits (each row alone; on a CPU whose row
    loop pairs bfloat16 in one instruction, the same but near float32's least normal number, which
    these values never reach), and lies within half a bfloat16 step of the exact sum."""
    from paged_attention.kernels import loop_rows
    from paged_attention.kernels.arrays import as_numpy

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows_, k_in, generator=g).bfloat16()
    weight = torch.randn(n_out, k_in, generator=g).bfloat16()
    b = torch.randn(n_out, generator=g).bfloat16() if bias else torch.zeros(0, dtype=torch.bfloat16)
    quads, alone = (torch.empty(rows_, n_out, dtype=torch.bfloat16) for _ in range(2))
    loop_rows.linear_quads(as_numpy(x), as_numpy(weight), as_numpy(b), as_numpy(quads))
    for m in range(rows_):
        row, out = as_numpy(x[m : m + 1]), as_numpy(alone[m : m + 1])
        loop_rows.linear_rows(row, as_numpy(weight), as_numpy(b), out)
    assert torch.equal(quads, alone)
    exact = reference(x, weight, b if bias else None)
    step = torch.finfo(torch.bfloat16).eps * exact.abs()
    scale = 1e-5 * (x.float().abs() @ weight.float().abs().t()).clamp(min=1.0)  # float32 sums' order
    assert bool(((quads.float() - exact).abs() <= step / 2 + scale).all())


@needs_numba
def test_a_widened_product_is_within_one_rounding_of_onednns() -> None:
    """The tensor entry point on a larger product (blocks of weight rows, SmolLM2's K): F.linear's
    results within one rounding, the float32 sums rounded once."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(21, 576, generator=g).bfloat16()
    weight = torch.randn(700, 576, generator=g).bfloat16()
    bias = torch.randn(700, generator=g).bfloat16()
    with torch.inference_mode():
        got, expected = widened.linear(x, weight, bias), F.linear(x, weight, bias)
    assert got is not None and got.dtype == torch.bfloat16
    exact = reference(x, weight, bias)
    step = torch.finfo(torch.bfloat16).eps * exact.abs()
    scale = 1e-5 * (x.float().abs() @ weight.float().abs().t()).clamp(min=1.0)
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
        assert widened.linear(few, weight, bias) is None  # too few rows: the row loop (or oneDNN)
        assert widened.linear(x.float(), weight, bias) is None  # float32: not this kernel's
        assert widened.linear(x, weight.float(), None) is None
        assert widened.linear(x, weight, bias.float()) is None  # a bias of another dtype
        assert widened.linear(x, weight, bias[:5]) is None  # nor shape
        assert widened.linear(x[..., :39], weight, bias) is None  # K does not match
        assert widened.linear(x, weight.t().contiguous().t(), None) is None  # a strided weight
    assert widened.linear(x, weight, bias) is None  # autograd on: the ordinary product


@needs_numba
def test_the_row_kernel_widens_many_rows_only_where_asked() -> None:
    """Streamed(wide=True) hands products of more than LINEAR_ROWS rows to the widened product, and
    of WIDE_ROWS up to its ``rows`` too (the same bits as its row loop, which takes fewer), even
    with ``rows`` lowered to 0 by a tuning; Streamed(wide=False) declines what exceeds its ``rows``
    (oneDNN's then); by default it widens exactly where the CPU lacks bfloat16 arithmetic."""
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(24, 64, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    many = torch.randn(rows.LINEAR_ROWS + 3, 64, generator=g).bfloat16()
    one, four = many[:1], many[: widened.WIDE_ROWS]
    wide, narrow = rows.Streamed(wide=True), rows.Streamed(wide=False)
    with torch.inference_mode():
        prepared = wide.prepare(weight, bias, None)
        assert torch.equal(wide(many, prepared, bias), widened.linear(many, weight, bias))
        assert narrow(many, prepared, bias) is None
        assert torch.equal(wide(four, prepared, bias), widened.linear(four, weight, bias))
        assert torch.equal(wide(one, prepared, bias), rows.linear_rows(one, weight, bias))
        each = torch.cat([rows.linear_rows(r[None], weight, bias) for r in four])
        assert torch.equal(wide(four, prepared, bias), each)
        wide.rows = 0  # a tuning that found oneDNN faster at every count it measured
        assert wide(one, prepared, bias) is None and wide(four, prepared, bias) is None
        assert torch.equal(wide(many, prepared, bias), widened.linear(many, weight, bias))
    assert rows.Streamed().wide is widened.needed()


@needs_numba
def test_an_engine_widens_its_prompts_where_asked_and_keeps_its_tokens(monkeypatch) -> None:
    """A bfloat16 engine (compiled backend) on a CPU that needs widening (pretended here) prefills
    through the widened product (its one-row decode steps do not); its greedy tokens are those of
    the same engine multiplying each row alone by the row loop (the same bits; oneDNN's products
    round otherwise, and this random model's greedy text follows one rounding). In batch-invariant
    mode nothing is widened."""
    calls = count_widened(monkeypatch)
    monkeypatch.setattr(widened, "needed", lambda: True)
    prompt = [{"prompt_token_ids": list(range(5, 5 + 4 * rows.LINEAR_ROWS))}]
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4, attention_backend="compiled")
    tokens = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert calls and min(calls) > rows.LINEAR_ROWS
    counting = rows._loop
    monkeypatch.setattr(rows, "_loop", lambda way: counting("rows"))  # each row alone
    alone = LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4, attention_backend="compiled")
    assert alone.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == tokens
    monkeypatch.setattr(rows, "_loop", counting)
    monkeypatch.setattr(widened, "needed", lambda: True)
    calls.clear()
    invariant = LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4, batch_invariant=True)
    invariant.generate(prompt, params, use_tqdm=False)
    assert calls and min(calls) > rows.LINEAR_ROWS  # the mode's products: the loops' too, unchunked
    monkeypatch.setattr(widened, "needed", lambda: False)
    calls.clear()
    LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4, batch_invariant=True).generate(prompt, params)
    assert not calls  # a CPU with bfloat16 arithmetic: nothing widened (oneDNN's or the pairs' loop)


@needs_numba
def test_every_backend_multiplies_bfloat16_through_the_loops_where_onednn_emulates_it(monkeypatch) -> None:
    """On a CPU without bfloat16 arithmetic (pretended here) the loops are what ``dtype="auto"``
    times (the engine registers them with its probe), so a bfloat16 engine takes them whatever its
    attention backend; on a CPU with bfloat16 arithmetic the gathered backend keeps oneDNN's."""
    calls = count_widened(monkeypatch)
    prompt = [{"prompt_token_ids": list(range(5, 5 + 4 * rows.LINEAR_ROWS))}]
    params = SamplingParams(temperature=0, max_tokens=2)
    for wide in (True, False):
        monkeypatch.setattr(widened, "needed", lambda w=wide: w)
        assert isinstance(cpu_dtype.engine_row_kernel(), rows.Streamed) is wide
        calls.clear()
        llm = LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4, attention_backend="torch")
        llm.generate(prompt, params, use_tqdm=False)
        assert bool(calls) is wide and all(n > rows.LINEAR_ROWS for n in calls)


@needs_numba
@pytest.mark.skipif(not packed_linear.packing_available(), reason="oneDNN cannot pack here")
@pytest.mark.parametrize("way", ["quads", "columns", None])
def test_the_batch_invariant_mode_takes_a_widening_kernels_products_whole(monkeypatch, way) -> None:
    """In the mode a packed layer and a merged group whose row kernel widens (a CPU without
    bfloat16 arithmetic) or multiplies pairs (AVX512-BF16: pretended either way) multiply every
    row count at once through the loops, unchunked, unpadded, each row with the bits it gets
    alone; a kernel that does neither leaves the mode's oneDNN chunks (also invariant). Outside
    the mode nothing changes."""
    from paged_attention.models.merged_projections import MergedProduct

    g = torch.Generator().manual_seed(4)
    q, k = torch.nn.Linear(40, 24, bias=False).bfloat16(), torch.nn.Linear(40, 8, bias=False).bfloat16()
    kernel = rows.Streamed(wide=way == "quads", paired=way == "columns")
    layer = packed_linear.PackedLinear(torch.nn.Linear(40, 24).bfloat16(), kernel)
    owners = [layer, MergedProduct([q, k], kernel)]
    calls = count_widened(monkeypatch, ("quads", "columns"))
    x = torch.randn(invariant.ROWS + 5, 40, generator=g).bfloat16()
    for owner in owners:
        with torch.inference_mode(), invariant.batch_invariant():
            got = owner.product(x)
            assert calls == ([x.shape[0]] if way else [])  # 21 rows at once (their four-row tiles)
            alone = torch.cat([owner.product(x[i : i + 1]) for i in range(x.shape[0])])
        assert torch.equal(got, alone)
        calls.clear()
