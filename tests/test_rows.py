"""The row-wise CPU operations of :mod:`paged_attention.kernels.rows` against the eager ones they replace.

``greedy_argmax`` must be ``torch.argmax`` exactly (first index of the largest, NaN largest) for any
row length, below, at and past its chunk size, with many ties; the compiled RMSNorm must agree with
transformers' ``LlamaRMSNorm`` within one rounding (bfloat16: nearly always the same bits), and the
engine must fall back to the eager operations when compiling is unavailable.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from paged_attention import LLM, SamplingParams
from paged_attention.engine.sample.sampling import Sampler
from paged_attention.kernels import compiled, rows

from .test_tuning import measured_as


@settings(max_examples=60, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 5), st.sampled_from([1, 7, 255, 256, 257, 600, 1024])),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
    specials=st.lists(st.sampled_from(["nan", "inf", "-inf"]), max_size=3),
)
def test_greedy_argmax_is_torchs_argmax_ties_nan_and_inf_included(shape, dtype, seed, specials) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, shape, generator=g).to(dtype)  # few values: ties everywhere
    for i, value in enumerate(specials):
        logits[i % shape[0], int(torch.randint(shape[1], (1,), generator=g))] = float(value)
    assert torch.equal(rows.greedy_argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(rows.greedy_argmax(logits.float()), logits.float().argmax(dim=-1))


def test_greedy_argmax_finds_a_maximum_in_the_last_partial_chunk() -> None:
    logits = torch.zeros(3, 2 * rows.CHUNK + 10)
    logits[0, -1] = logits[1, -10] = logits[2, 2 * rows.CHUNK - 1] = 1.0
    assert rows.greedy_argmax(logits).tolist() == [2 * rows.CHUNK + 9, 2 * rows.CHUNK, 2 * rows.CHUNK - 1]


def _norm(dtype: torch.dtype) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(1))
    return norm


def test_the_compiled_rms_norm_agrees_with_transformers_within_a_few_ulps() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        norm = _norm(dtype)
        x = (torch.randn(2, 33, 96, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
        with torch.inference_mode():
            expected, got = norm(x), rows.RMSNorm(norm)(x)
        assert got.dtype == dtype and got.shape == x.shape
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got.float(), expected.float(), rtol=4 * eps, atol=eps)  # a few ulps
        if dtype == torch.bfloat16:  # one float32 ulp in the mean rarely moves a bfloat16 rounding
            assert (got != expected).float().mean() < 1e-3


def test_without_numba_the_norm_is_transformers_own_to_the_bit(monkeypatch) -> None:
    monkeypatch.setattr(compiled, "_failed", "Numba missing (simulated)")
    for dtype in (torch.float32, torch.bfloat16):
        norm = _norm(dtype)
        x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
        with torch.inference_mode():
            assert torch.equal(rows.RMSNorm(norm)(x), norm(x))
    assert rows.replace_norms(torch.nn.Sequential(_norm(torch.bfloat16))) == 0


def test_the_engine_fuses_bfloat16_norms_only_and_still_generates_the_same_tokens(monkeypatch) -> None:
    """The compiled backend's bfloat16 engine with fused norms writes the tokens of the same engine
    with transformers' norms (the attention the same: the fused norms alone differ)."""
    from paged_attention.engine.worker import model_runner

    prompts = [[5, 6, 7, 5, 6, 7], [9, 1, 1, 2, 3, 4, 4]]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    float32 = LLM(num_kv_blocks=32, block_size=4)
    assert float32.llm_engine.runner.num_fused_norms == 0  # float32 keeps transformers' norm
    model = LLM(num_kv_blocks=8, block_size=4).llm_engine.model.to(torch.bfloat16)
    layers = model.config.num_hidden_layers
    fused = LLM(model, num_kv_blocks=32, block_size=4, attention_backend="compiled")
    assert fused.llm_engine.runner.num_fused_norms == 2 * layers + 1
    eager_model = LLM(num_kv_blocks=8, block_size=4).llm_engine.model.to(torch.bfloat16)
    monkeypatch.setattr(model_runner, "replace_norms", lambda model: 0)
    eager = LLM(eager_model, num_kv_blocks=32, block_size=4, attention_backend="compiled")
    assert eager.llm_engine.runner.num_fused_norms == 0
    fused_out, eager_out = (llm.generate(prompts, greedy, use_tqdm=False) for llm in (fused, eager))
    assert [o.outputs[0].token_ids for o in fused_out] == [o.outputs[0].token_ids for o in eager_out]


def test_the_sampler_takes_the_plain_argmax_only_where_nothing_changes_the_logits() -> None:
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    plain = SamplingParams(temperature=0)
    biased = SamplingParams(temperature=0, logit_bias={7: 100.0})
    out = Sampler()(logits, [plain, biased, plain], [None, None, None])
    expected = logits.float().argmax(dim=-1).tolist()
    assert out.tokens == [expected[0], 7, expected[2]] and out.logprobs == [None, None, None]
    out = Sampler()(logits, [plain, plain, plain], [None] * 3, banned=[[], [expected[1]], []])
    assert out.tokens[1] != expected[1] and out.tokens[0] == expected[0]


@settings(max_examples=30, deadline=None)
@given(
    rows_=st.integers(1, rows.LINEAR_ROWS),
    features=st.sampled_from([(1, 1), (7, 33), (64, 576), (300, 129)]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_product_of_a_few_bfloat16_rows_is_f_linear_within_one_rounding(rows_, features, bias, seed):
    """linear_rows sums in float32 and rounds once, as oneDNN's bfloat16 product does (in another
    order): against the float64 product, its error is at most one bfloat16 rounding, and it is
    never further from it than F.linear is by more than one."""
    out_features, in_features = features
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows_, in_features, generator=g).bfloat16()
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    with torch.inference_mode():
        got = rows.linear_rows(x, weight, b)
        torch_product = torch.nn.functional.linear(x, weight, b)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows_, out_features)
    exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    ulp = exact.abs() * 2**-8 + 1e-6 * in_features  # one bfloat16 rounding, and float32 sums
    assert ((got.double() - exact).abs() <= ulp).all()
    assert ((got.double() - exact).abs() <= (torch_product.double() - exact).abs() + ulp).all()


def test_a_product_of_a_few_rows_keeps_leading_dims_and_declines_the_rest() -> None:
    weight = torch.randn(5, 8).bfloat16()
    with torch.inference_mode():
        x = torch.randn(1, 1, 8).bfloat16()
        assert rows.linear_rows(x, weight, None).shape == (1, 1, 5)
        assert rows.linear_rows(torch.randn(rows.LINEAR_ROWS + 1, 8).bfloat16(), weight, None) is None
        assert rows.linear_rows(torch.randn(1, 8).half(), weight.half(), None) is None  # no float16 loop
        assert rows.linear_rows(torch.randn(1, 8), weight.float(), None) is None  # float32: kernels.tiled
        assert rows.linear_rows(torch.randn(1, 9).bfloat16(), weight, None) is None  # K does not match
        assert rows.linear_rows(x, weight, torch.zeros(4).bfloat16()) is None  # nor does the bias
        assert rows.linear_rows(x, weight.t().contiguous().t(), None) is None  # a strided weight
    assert rows.linear_rows(x, weight, None) is None  # autograd on: the ordinary product


def test_the_engine_streams_the_weights_of_one_row_products_and_generates_the_same_text(monkeypatch) -> None:
    """bfloat16, compiled backend: a one-sequence decode takes linear_rows in every packed and merged
    layer; the greedy tokens are those of the same engine multiplying with oneDNN throughout."""
    from paged_attention.models import packed_linear
    from paged_attention.models.merged_projections import MergedMember

    params = SamplingParams(temperature=0, max_tokens=12)
    measured_as(monkeypatch, {1: 2.0, 2: 2.0, 3: 2.0, 4: 2.0})  # (where this machine measured it faster)
    llm = LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4, attention_backend="compiled")
    calls = []
    loop = rows._loop("rows")

    def counted(*args):
        calls.append(1)
        return loop(*args)

    model = llm.llm_engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, packed_linear.PackedLinear)]
    groups = {id(m.group): m.group for m in model.modules() if isinstance(m, MergedMember) and m.group}
    owners = [*layers, *groups.values()]
    assert layers and all(isinstance(o.rows, rows.Streamed) for o in owners)
    assert all(o.rows.rows == rows.LINEAR_ROWS for o in owners)
    assert all(o.prepared.weight.data_ptr() == o.weight.data_ptr() for o in owners)  # the weight itself
    monkeypatch.setattr(rows, "_loop", lambda way: counted)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]
    text = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert any(calls)
    for owner in owners:
        owner.prepared = None
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == text


def test_a_loop_file_is_stamped_when_the_helpers_it_imports_are_newer(tmp_path) -> None:
    """Numba's disk cache checks only a function's own file: :mod:`.loop_rows` and :mod:`.loop_int8`
    take a newer modification time when ``loop_nest.py`` (their helpers) is newer, so that their
    loops compile again."""
    import os

    from paged_attention.kernels.loop_nest import stamp

    target, dependency = tmp_path / "loop_rows.py", tmp_path / "loop_nest.py"
    target.write_text("a")
    dependency.write_text("b")
    os.utime(target, (1_000, 1_000))
    os.utime(dependency, (2_000, 2_000))
    assert stamp(target, dependency) and target.stat().st_mtime > 2_000
    assert not stamp(target, dependency)  # now newer: left alone
    assert not stamp(tmp_path / "missing.py", dependency)


def test_every_loop_file_using_loop_nests_helpers_stamps_itself_on_import() -> None:
    """The files whose compiled loops call :mod:`.loop_nest`'s helpers call ``stamp(Path(__file__))``
    at import (a top-level statement), so an edited helper is compiled into them too."""
    import ast
    from pathlib import Path

    import paged_attention.kernels as package

    users = []
    for path in sorted(Path(package.__file__).parent.glob("loop_*.py")):
        tree = ast.parse(path.read_text())
        imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "loop_nest"]
        if path.name == "loop_nest.py" or not imports:
            continue
        users.append(path.name)
        calls = [n.value for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
        calls = [c for c in calls if getattr(c.func, "id", "") == "stamp"]
        assert [ast.unparse(c) for c in calls][:1] == ["stamp(Path(__file__))"], path.name
    assert users == ["loop_amx.py", "loop_bf16.py", "loop_columns.py", "loop_int8.py", "loop_rows.py"]


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it() -> None:
    """Each output of linear_rows is summed alone: row r of a product of 1-4 rows has the bits it
    has alone, whatever the weight's shape (tails of K % 32 and N % 4 included)."""
    g = torch.Generator().manual_seed(3)
    for out_features, in_features in [(7, 33), (64, 576), (13, 1536)]:
        x = torch.randn(rows.LINEAR_ROWS, in_features, generator=g).bfloat16()
        weight = torch.randn(out_features, in_features, generator=g).bfloat16()
        b = torch.randn(out_features, generator=g).bfloat16()
        with torch.inference_mode():
            together = rows.linear_rows(x, weight, b)
            for r in range(rows.LINEAR_ROWS):
                assert torch.equal(rows.linear_rows(x[r : r + 1], weight, b)[0], together[r])
                assert torch.equal(rows.linear_rows(x[: r + 1], weight, b), together[: r + 1])


def test_the_grouped_copy_holds_each_weight_once_and_gives_the_weights_own_bits() -> None:
    """Streamed reads a copy of the weight laid out as the loop reads it (one stream): value
    ``[n, k]`` of the whole part at ``[n // 4, k // 32, n % 4, k % 32]``; for 1-4 rows and every
    tail (K % 32, N % 4, N below one group) the bits of the loop reading the weight itself."""
    g = torch.Generator().manual_seed(5)
    for out_features, in_features in [(7, 33), (64, 576), (13, 1536), (3, 40)]:
        weight = torch.randn(out_features, in_features, generator=g).bfloat16()
        b = torch.randn(out_features, generator=g).bfloat16()
        kernel = rows.Streamed(wide=False, paired=False)  # (the row loop: its copy)
        prepared = kernel.prepare(weight, b, None)
        assert prepared.grouped is None  # made by the first product that reads it
        x = torch.randn(rows.LINEAR_ROWS, in_features, generator=g).bfloat16()
        with torch.inference_mode():
            for r in range(1, rows.LINEAR_ROWS + 1):
                assert torch.equal(kernel(x[:r], prepared, b), rows.linear_rows(x[:r], weight, b))
        grouped, bits = prepared.grouped, weight.view(torch.int16).numpy()
        n4, whole = out_features // 4 * 4, in_features // 32 * 32
        assert grouped.size == n4 * whole and grouped.dtype == prepared.weight_bits.dtype
        assert grouped.size == 0 or grouped.ctypes.data % 64 == 0  # on a line: no load spans two
        n, k = np.meshgrid(np.arange(n4), np.arange(whole), indexing="ij")
        at = ((n // 4 * (whole // 32) + k // 32) * 4 + n % 4) * 32 + k % 32
        assert np.array_equal(grouped.view(np.int16)[at], bits[:n4, :whole])


def test_streamed_takes_any_layout_of_the_rows_and_the_bias_it_was_given() -> None:
    """Streamed (the engine's way in) gives linear_rows' bits for leading dims and a strided input;
    a bias other than the prepared one (other memory) still counts; more rows than it takes, or a
    K that does not match: None (the caller's product then)."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(24, 64, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    kernel = rows.Streamed(rows=2)
    prepared = kernel.prepare(weight, bias, None)
    assert prepared is not None and kernel.prepare(weight, bias.float(), None) is None
    wide = torch.randn(2, 1, 128, generator=g).bfloat16()
    x = wide[..., ::2]  # [2, 1, 64], strided
    with torch.inference_mode():
        got = kernel(x, prepared, bias.detach())  # (a layer passes a fresh detach: the same memory)
        assert got.shape == (2, 1, 24)
        assert torch.equal(got, rows.linear_rows(x.contiguous(), weight, bias))
        other = bias + 1
        assert torch.equal(kernel(x, prepared, other), rows.linear_rows(x.contiguous(), weight, other))
        assert torch.equal(kernel(x, prepared, None), rows.linear_rows(x.contiguous(), weight, None))
        assert kernel(torch.randn(3, 64).bfloat16(), prepared, bias) is None
        assert kernel(torch.randn(1, 65).bfloat16(), prepared, bias) is None
