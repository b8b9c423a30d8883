"""The compiled in-place CPU decode kernel (:mod:`paged_attention.kernels.compiled`) against the
PyTorch reference and against SDPA on contiguous K/V, the same way as the Triton kernels: shuffled
block tables, lengths 1, block_size, block_size + 1 and longer, and NaN in every slot it must not read.

Numba compiles the kernel once per cache dtype; the shapes are arguments, so the grid cycles through
head layouts, head sizes, block sizes and dtypes (float16 takes the eager recipe by design).
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from paged_attention import kernels
from paged_attention.kernels import compiled, reference, tiles

from .kernel_cases import TOLERANCE, make_paged_case, query_start_loc

HEADS = [(8, 8), (8, 2), (9, 3), (16, 1)]
HEAD_SIZES = [64, 80]
BLOCK_SIZES = [1, 8, 16]
# Numba compiles once per cache dtype, so the kernel's dtypes take the whole product; float16 takes
# the eager recipe by design and needs only a few cases.
GRID = [
    *((h, d, b, dtype) for dtype in (torch.float32, torch.bfloat16)
      for h, d, b in itertools.product(HEADS, HEAD_SIZES, BLOCK_SIZES)),
    *((h, 64, 16, torch.float16) for h in HEADS[:2]),
]  # fmt: skip


def lengths(block_size: int) -> list[int]:
    return [1, block_size, block_size + 1, 3 * block_size + 5]


@pytest.mark.parametrize(("heads", "head_dim", "block_size", "dtype"), GRID)
def test_compiled_decode_matches_reference(heads, head_dim, block_size, dtype):
    case = make_paged_case(lengths(block_size), block_size, heads[1], head_dim, dtype, seed=head_dim)
    q = torch.randn(len(case.keys), heads[0], head_dim).to(dtype)
    args = (q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    out = kernels.paged_decode(*args, backend="compiled")
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out, reference.paged_decode(*args), **TOLERANCE[dtype])


def test_compiled_decode_matches_sdpa_on_contiguous_tensors():
    case = make_paged_case([3, 40, 17], 8, 2, 64, torch.float32, seed=3)
    q = torch.randn(3, 8, 64)
    out = kernels.paged_decode(q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                               backend="compiled")  # fmt: skip
    for i, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        expected = F.scaled_dot_product_attention(
            q[i, :, None], k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_bfloat16_decode_takes_the_lanes_loop_where_its_head_dim_allows_and_matches_sdpa(
    head_dim, monkeypatch
):
    """A bfloat16 cache whose head_dim is a multiple of 32 is decoded by kernels/loop_bf16.py (the
    loop nest otherwise; on an AMX host, the tiles, switched off here): within bfloat16's tolerance
    of SDPA on the contiguous K/V, GQA and partial blocks included."""
    from paged_attention.kernels import loop_bf16

    monkeypatch.setattr(tiles, "rows", lambda *a, **k: 0)
    calls, lanes_decode = [], loop_bf16.decode
    monkeypatch.setattr(loop_bf16, "decode", lambda *a: (calls.append(a[0].shape), lanes_decode(*a))[1])
    case = make_paged_case([3, 40, 17, 1], 16, 3, head_dim, torch.bfloat16, seed=head_dim)
    q = torch.randn(4, 9, head_dim).bfloat16()
    out = kernels.paged_decode(q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                               backend="compiled")  # fmt: skip
    assert calls == ([(4, 9, head_dim)] if head_dim % 32 == 0 else [])
    for i, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        expected = F.scaled_dot_product_attention(
            q[i, :, None].float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(), enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(out[i].float(), expected, **TOLERANCE[torch.bfloat16])


def test_sharp_and_flat_softmaxes_and_long_sequences_are_as_accurate_as_the_reference():
    """Scores hundreds apart (the running maximum changes block after block, and most weights
    underflow to zero) and scores all equal: against float64, the kernel's error is no larger than
    the float32 reference's own (sharp scores are ill-conditioned in float32 for both)."""
    case = make_paged_case([300, 77, 16], 16, 3, 64, torch.float32, seed=5)
    generator = torch.Generator().manual_seed(5)
    for factor in (40.0, 1.0, 0.0):
        q = torch.randn(3, 9, 64, generator=generator) * factor
        args = (q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
        exact = reference.paged_decode(q.double(), case.key_cache.double(), case.value_cache.double(),
                                       case.block_tables, case.seq_lens)  # fmt: skip
        out = kernels.paged_decode(*args, backend="compiled")
        reference_error = (reference.paged_decode(*args).double() - exact).abs().max().item()
        assert (out.double() - exact).abs().max().item() <= 2 * reference_error + 1e-6


def test_the_exp_is_accurate_over_its_whole_range():
    from paged_attention.kernels.loop_nest import exp

    x = np.linspace(-87.0, 88.0, 35001, dtype=np.float32)
    got = np.array([exp(v) for v in x], dtype=np.float64)
    want = np.exp(x.astype(np.float64))
    assert np.all(np.abs(got - want) <= 4e-7 * want)
    assert exp(np.float32(-1e30)) < 1e-37 and exp(np.float32(1e30)) > 1e38  # clamped, finite


def test_engine_decode_rows_inside_a_mixed_step_use_the_compiled_kernel(monkeypatch):
    """paged_prefill with the compiled backend: decode rows (a decoding sequence, one verifying a few
    drafts) by the in-place decode kernel, the prompt by the in-place prefill loop nest."""
    case = make_paged_case([1 + 8, 13, 30], 8, 2, 32, torch.float32)
    q_lens = [1, 13, 5]
    query = torch.randn(sum(q_lens), 8, 32)
    loc = query_start_loc(q_lens)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, loc)
    decoded, prefilled = [], []
    decode, prefill = compiled.paged_decode, compiled.paged_prefill
    monkeypatch.setattr(
        compiled, "paged_decode", lambda q, *a, **k: decoded.append(len(q)) or decode(q, *a, **k)
    )
    monkeypatch.setattr(compiled, "paged_prefill", lambda *a: prefilled.append(a[6]) or prefill(*a))
    out = kernels.paged_prefill(*args, backend="compiled")
    assert decoded == [1 + 5] and prefilled == [[1]]
    torch.testing.assert_close(out, reference.paged_prefill(*args), atol=2e-5, rtol=1e-5)


PREFILL_SHAPES = [((8, 8), 64, 16), ((9, 3), 64, 5), ((16, 1), 80, 1), ((8, 2), 6, 128), ((4, 2), 33, 16)]
PREFILL_GRID = [(*shape, dtype) for dtype in (torch.float32, torch.bfloat16) for shape in PREFILL_SHAPES]


@pytest.mark.parametrize(("heads", "head_dim", "block_size", "dtype"), PREFILL_GRID)
def test_compiled_prefill_reads_the_pages_in_place_and_matches_reference_and_sdpa(
    heads, head_dim, block_size, dtype, monkeypatch
):
    """Prompts longer than the decode path takes, whole or after a cached prefix (chunked prefill,
    prefix-cache hits), at and across query and key tile edges, any block size and head size (6 and
    33: not a multiple of the loop's four), GQA/MQA: the loop nest writes every long sequence's rows
    (no SDPA call), within the decode kernel's tolerance of the float64 reference; on contiguous
    float32 tensors also of SDPA with a causal mask. NaN in every slot past a sequence's end."""
    q_lens = [7, 16, 17, 64, 65, 130, 40]
    context = [0, 0, 3, 0, 64, 20, 100]  # cached before the new tokens
    lens = [c + n for c, n in zip(context, q_lens, strict=True)]
    case = make_paged_case(lens, block_size, heads[1], head_dim, dtype, seed=head_dim + block_size)
    query = torch.randn(sum(q_lens), heads[0], head_dim).to(dtype)
    loc = query_start_loc(q_lens)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, loc)
    calls = []
    real = compiled.paged_prefill
    monkeypatch.setattr(compiled, "paged_prefill", lambda *a: calls.append(a[6]) or real(*a))
    monkeypatch.setattr(F, "scaled_dot_product_attention", None)  # would fail if the prompts took SDPA
    out = kernels.paged_prefill(*args, backend="compiled")
    assert calls == [list(range(len(q_lens)))] and torch.isfinite(out).all()
    monkeypatch.undo()
    torch.testing.assert_close(out, reference.paged_prefill(*args, compute=torch.float64), **TOLERANCE[dtype])
    if dtype == torch.float32:
        for i, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
            rows = slice(int(loc[i]), int(loc[i + 1]))
            visible = torch.arange(lens[i])[None, :] <= (context[i] + torch.arange(q_lens[i]))[:, None]
            expected = F.scaled_dot_product_attention(
                query[rows].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible,
                enable_gqa=True,
            ).transpose(0, 1)  # fmt: skip
            torch.testing.assert_close(out[rows], expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_flags_give_prompt_rows_and_generated_rows_one_path_whatever_their_count(
    dtype, monkeypatch
):
    """The decode kernel and the prefill loop nest each compute a row alone, in different orders of
    sums. With ``decoding`` flags (the engine's) a prompt's rows take the prefill nest however few
    come after a cached prefix, so they keep the whole prompt's bits; generated tokens take the
    decode kernel however many drafts are verified at once, so each keeps the bits it gets decoded
    alone."""
    monkeypatch.setattr(tiles, "rows", lambda *a, **k: 0)  # the loop nests, on an AMX host too
    length = 90
    case = make_paged_case([length], 16, 3, 64, dtype, seed=11)
    query = torch.randn(length, 9, 64, generator=torch.Generator().manual_seed(11)).to(dtype)
    cache = (case.key_cache, case.value_cache, case.block_tables)

    def attend(rows: slice, decoding: list[bool]) -> torch.Tensor:
        seen = torch.tensor([rows.stop], dtype=torch.int32)
        return kernels.paged_prefill(query[rows], *cache, seen, query_start_loc([rows.stop - rows.start]),
                                     backend="compiled", decoding=decoding)  # fmt: skip

    whole = attend(slice(0, length), [False])
    for new in (1, 2, 6, 7, 40):  # what a prefix-cache hit or the last chunk leaves to compute
        assert torch.equal(attend(slice(length - new, length), [False]), whole[-new:]), new
    for count in (2, 6, 9):  # the last token and its drafts, verified in one step
        verified = attend(slice(length - count, length), [True])
        for j, position in enumerate(range(length - count, length)):
            seen = torch.tensor([position + 1], dtype=torch.int32)
            alone = kernels.paged_decode(query[position : position + 1], *cache, seen, backend="compiled")
            assert torch.equal(verified[j], alone[0]), (count, position)
    with pytest.raises(ValueError, match="decoding must hold a flag per sequence"):
        attend(slice(0, 5), [False, True])


def test_auto_is_the_compiled_kernel_on_a_cpu_and_bad_input_errors_are_the_references():
    assert kernels.resolve_backend("auto", torch.device("cpu")) == "compiled"
    case = make_paged_case([5, 12], 8, 2, 64, torch.float32)
    q = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match="one query per"):
        kernels.paged_decode(q[:1], case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    tables = case.block_tables.clone()
    tables[1, 1] = 10_000
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = .* is not a block of the cache"):
        kernels.paged_decode(q, case.key_cache, case.value_cache, tables, case.seq_lens, backend="compiled")
    with pytest.raises(TypeError, match="share one dtype"):
        kernels.paged_decode(q.half(), case.key_cache, case.value_cache, case.block_tables, case.seq_lens)


def small_decode_args() -> tuple[torch.Tensor, ...]:
    """A two-sequence float32 decode batch: (query, key_cache, value_cache, block_tables, seq_lens)."""
    case = make_paged_case([5, 12], 8, 2, 64, torch.float32)
    return torch.randn(2, 4, 64), case.key_cache, case.value_cache, case.block_tables, case.seq_lens


def test_a_failed_compilation_warns_once_and_falls_back_to_the_same_numbers(monkeypatch):
    """No Numba (simulated): the first call warns, every call gives the eager recipe's result (decode
    and store), and ``auto`` then resolves to the torch backend in this process."""

    def missing():
        raise ModuleNotFoundError("No module named 'numba'")

    monkeypatch.setattr(compiled, "_compile", missing)
    monkeypatch.setattr(compiled, "_failed", None)
    args = small_decode_args()
    with pytest.warns(RuntimeWarning, match="falls back to the eager gather"):
        out = kernels.paged_decode(*args, backend="compiled")
    torch.testing.assert_close(out, reference.paged_decode(*args), **TOLERANCE[torch.float32])
    assert not compiled.available()
    assert kernels.resolve_backend("auto", torch.device("cpu")) == "torch"
    key = torch.randn(2, 2, 64)
    caches = (torch.zeros(4, 8, 2, 64), torch.zeros(4, 8, 2, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        kernels.paged_decode(*args, backend="compiled")
        kernels.store_kv(key, key, *caches, torch.tensor([3, 9]), backend="compiled")
    assert torch.equal(caches[0].view(32, 2, 64)[9], key[1])


def test_a_store_that_cannot_compile_warns_once_and_stores_eagerly(monkeypatch):
    import paged_attention.kernels.loop_nest as loop_nest

    def broken(*args):
        raise ImportError("numba's store is unavailable (simulated)")

    monkeypatch.setattr(loop_nest, "store", broken)
    monkeypatch.setattr(compiled, "_failed", None)
    key = torch.randn(2, 2, 64)
    caches = (torch.zeros(4, 8, 2, 64), torch.zeros(4, 8, 2, 64))
    with pytest.warns(RuntimeWarning, match="falls back to the eager gather"):
        kernels.store_kv(key, key, *caches, torch.tensor([3, 9]), backend="compiled")
    assert torch.equal(caches[1].view(32, 2, 64)[3], key[0]) and not compiled.available()


def test_an_error_that_is_not_compilation_is_raised_and_keeps_the_kernel(monkeypatch):
    def buggy():
        raise RuntimeError("a bug, not a missing compiler")

    monkeypatch.setattr(compiled, "_compile", buggy)
    monkeypatch.setattr(compiled, "_failed", None)
    with pytest.raises(RuntimeError, match="a bug"):
        kernels.paged_decode(*small_decode_args(), backend="compiled")
    assert compiled.available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_store_writes_the_references_slots_and_skips_minus_one(dtype):
    generator = torch.Generator().manual_seed(1)
    key, value = (torch.randn(6, 2, 32, generator=generator).to(dtype) for _ in range(2))
    slots = torch.tensor([5, -1, 0, 17, -1, 31])
    caches = {}
    for backend in ("torch", "compiled"):
        key_cache, value_cache = torch.zeros(4, 8, 2, 32, dtype=dtype), torch.zeros(4, 8, 2, 32, dtype=dtype)
        kernels.store_kv(key, value, key_cache, value_cache, slots, backend=backend)
        caches[backend] = (key_cache, value_cache)
    assert torch.equal(caches["torch"][0], caches["compiled"][0])
    assert torch.equal(caches["torch"][1], caches["compiled"][1])
    assert torch.equal(caches["compiled"][0].view(32, 2, 32)[17], key[3])
    with pytest.raises(ValueError, match="slot_mapping holds slot 32"):
        bad = torch.tensor([0, 1, 2, 3, 4, 32])
        kernels.store_kv(key, value, *caches["compiled"], bad, backend="compiled")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_verification_rows_take_the_kernel_and_match_the_reference(dtype, monkeypatch):
    """Sequences bringing up to DECODE_ROWS_MAX tokens (speculative drafts to verify) attend as one
    decode row per token, each seeing the positions up to its own; longer ones take SDPA."""
    longest = reference.DECODE_ROWS_MAX
    q_lens = [2, longest, longest + 1, 1, 5]
    context = [40, 17, 30, 9, longest]  # cached before the new tokens
    case = make_paged_case([c + n for c, n in zip(context, q_lens, strict=True)], 8, 2, 32, dtype, seed=4)
    query = torch.randn(sum(q_lens), 8, 32).to(dtype)
    loc = query_start_loc(q_lens)
    rows = []
    real = compiled.paged_decode
    monkeypatch.setattr(compiled, "paged_decode", lambda *a: rows.append(a[0].shape[0]) or real(*a))
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, loc)
    out = kernels.paged_prefill(*args, backend="compiled")
    assert rows == [sum(n for n in q_lens if n <= longest)]  # one batched call, a row per token
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference.paged_prefill(*args, compute=torch.float64), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "block_size"), [((9, 3), 16), ((8, 8), 1), ((16, 1), 8)])
def test_one_call_per_layer_stores_and_attends_as_the_two_calls_do(dtype, heads, block_size):
    """kernels.decode_layer (store, then decode, one compiled call over every layer's caches) on the
    strided views transformers hands over: the same caches and the same output, bit for bit, as
    store_kv followed by paged_decode, and as close to the reference as they are."""
    num_heads, num_kv_heads = heads
    lens = [1, block_size + 1, 3 * block_size + 5]
    case = make_paged_case(lens, block_size, num_kv_heads, 64, dtype, seed=block_size)
    layers = torch.stack([torch.stack([case.key_cache, case.value_cache])] * 3)  # [3, 2, blocks, ...]
    generator = torch.Generator().manual_seed(7)
    # [1, heads, tokens, dim] as transformers hands them over, here laid out heads first in memory,
    # so that the [tokens, heads, dim] views the kernel gets are strided
    query = torch.randn(1, num_heads, 3, 64, generator=generator).to(dtype)
    key, value = (torch.randn(1, num_kv_heads, 3, 64, generator=generator).to(dtype) for _ in range(2))
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    assert not q.is_contiguous() or num_heads == 1
    blocks = case.block_tables.long()  # each sequence's last position gets the new token
    slots = torch.tensor([blocks[i, (n - 1) // block_size] * block_size + (n - 1) % block_size
                          for i, n in enumerate(lens)])  # fmt: skip
    plan = kernels.plan_decode(case.block_tables, case.seq_lens, case.key_cache)
    step = kernels.decode_step(layers, slots, plan)
    assert step is not None
    expected_caches = layers[1].clone()
    kernels.store_kv(k.contiguous(), v.contiguous(), *expected_caches, slots, backend="compiled")
    expected = kernels.paged_decode(q.contiguous(), *expected_caches, case.block_tables, case.seq_lens,
                                    backend="compiled")  # fmt: skip
    out = kernels.decode_layer(q, k, v, 1, step)
    assert out is not None and torch.equal(out, expected)
    same = dict(atol=0, rtol=0, equal_nan=True)  # (unused slots hold NaN)
    torch.testing.assert_close(layers[1], expected_caches, **same)  # as the two calls leave them
    for other in (0, 2):  # other layers untouched
        torch.testing.assert_close(layers[other, 0], case.key_cache, **same)
        torch.testing.assert_close(layers[other, 1], case.value_cache, **same)
    want = reference.paged_decode(q.contiguous(), *expected_caches, case.block_tables, case.seq_lens)
    torch.testing.assert_close(out, want, **TOLERANCE[dtype])


def test_a_steps_layers_share_the_loop_chosen_at_its_first_layer(monkeypatch):
    """The loop (and what it reads besides the layer's arrays) is chosen once per step and query
    shape, not per layer; every layer still stores and attends as the two calls do."""
    from paged_attention.kernels import compiled

    case = make_paged_case([5, 12], 8, 2, 64, torch.float32, seed=3)
    plan = kernels.plan_decode(case.block_tables, case.seq_lens, case.key_cache)
    slots = torch.tensor([4, 19])
    layers = torch.stack([torch.stack([case.key_cache, case.value_cache])] * 3)
    asked = []
    rows = compiled.tiles.rows
    monkeypatch.setattr(compiled.tiles, "rows", lambda *a: asked.append(a) or rows(*a))
    step = kernels.decode_step(layers, slots, plan)
    generator = torch.Generator().manual_seed(5)
    chosen = 0
    for layer in range(3):
        q, k, v = torch.randn(2, 4, 64, generator=generator), *torch.randn(2, 2, 2, 64, generator=generator)
        expected_caches = layers[layer].clone()
        kernels.store_kv(k, v, *expected_caches, slots, backend="compiled")
        expected = kernels.paged_decode(
            q, *expected_caches, case.block_tables, case.seq_lens, backend="compiled"
        )
        before = len(asked)  # (paged_decode asks too)
        assert torch.equal(kernels.decode_layer(q, k, v, layer, step), expected)
        chosen += len(asked) - before
        torch.testing.assert_close(layers[layer], expected_caches, atol=0, rtol=0, equal_nan=True)
    assert chosen == 1 and len(step.loops) == 1
    before = len(asked)
    kernels.decode_layer(q, k, v, 0, kernels.decode_step(layers, slots, plan))  # a new step chooses again
    assert len(asked) == before + 1


def test_one_call_per_layer_declines_what_it_cannot_read():
    """float16 caches have no compiled kernel (no step is made); a query of another dtype than the
    caches', or float64, is declined with None: the engine then makes the two calls."""
    case = make_paged_case([5, 12], 8, 2, 64, torch.float32)
    plan = kernels.plan_decode(case.block_tables, case.seq_lens, case.key_cache)
    slots = torch.tensor([4, 20])
    layers = torch.stack([case.key_cache, case.value_cache])[None]
    assert kernels.decode_step(layers.half(), slots, plan) is None
    step = kernels.decode_step(layers, slots, plan)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    assert kernels.decode_layer(q.bfloat16(), k.bfloat16(), k.bfloat16(), 0, step) is None
    assert kernels.decode_layer(q.double(), k.double(), k.double(), 0, step) is None
    assert kernels.decode_layer(q, k, k, 0, step) is not None


def test_the_engine_takes_the_one_call_path_after_each_steps_first_layer(monkeypatch):
    """A decode step of the compiled backend: the first layer through the two checked calls, every
    later layer through decode_layer; if that declines (here: Numba failing, simulated), the two
    calls again, with the same tokens and a warning once."""
    from paged_attention import LLM, SamplingParams

    llm = LLM(num_kv_blocks=32, block_size=4, attention_backend="compiled")
    layers = llm.llm_engine.model.config.num_hidden_layers
    calls = {"one": 0, "two": 0}
    one, two = kernels.decode_layer, kernels.paged_decode

    def counted_one(*args, **kwargs):
        out = one(*args, **kwargs)
        calls["one"] += out is not None
        return out

    def counted_two(*args, **kwargs):
        calls["two"] += 1
        return two(*args, **kwargs)

    monkeypatch.setattr(kernels, "decode_layer", counted_one)
    monkeypatch.setattr(kernels, "paged_decode", counted_two)
    params = SamplingParams(temperature=0, max_tokens=5)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    decode_steps = len(expected) - 1  # the first token comes from the prompt's step
    assert calls == {"one": decode_steps * (layers - 1), "two": decode_steps}

    import paged_attention.kernels.loop_nest as loop_nest

    def broken(*args):
        raise ImportError("numba's decode_layer is unavailable (simulated)")

    monkeypatch.setattr(loop_nest, "decode_layer", broken)
    monkeypatch.setattr(compiled, "_failed", None)
    with pytest.warns(RuntimeWarning, match="falls back"):
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == expected


def test_one_call_per_layer_declines_a_strided_last_dimension():
    case = make_paged_case([5, 12], 8, 2, 64, torch.float32)
    plan = kernels.plan_decode(case.block_tables, case.seq_lens, case.key_cache)
    layers = torch.stack([case.key_cache, case.value_cache])[None]
    step = kernels.decode_step(layers, torch.tensor([4, 20]), plan)
    q, k = torch.randn(2, 4, 128)[..., ::2], torch.randn(2, 2, 64)
    assert q.stride(-1) == 2 and kernels.decode_layer(q, k, k, 0, step) is None
