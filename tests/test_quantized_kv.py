"""Quantized pages: every store and attention kernel on fp8 (e4m3, e5m2) and int8 caches.

The oracle is the float cache the 8-bit one stands for: :func:`quantization.dequantize_blocks` of every
block, then the float reference. A kernel that dequantizes as it loads must give that result, and the
stores of all three backends must write the same bits. Slots and blocks no sequence owns hold NaN
(fp8 bytes; int8 blocks no sequence owns get NaN *scales*; the unused offsets of a sequence's last
int8 block hold zeros), so a kernel that reads an unowned block gives NaN.
"""

from __future__ import annotations

import pytest
import torch

from paged_attention import kernels
from paged_attention.kernels import decode, prefill, quantization, reference, store

from .kernel_cases import query_start_loc

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
BACKENDS = ["torch", "compiled", "triton"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in quantization.FP8_DTYPES else t


def empty_scales(fmt: torch.dtype, num_blocks: int, num_kv_heads: int) -> torch.Tensor:
    if fmt == torch.int8:
        return torch.full((num_blocks, num_kv_heads), float("nan"))  # unwritten blocks: NaN scales
    return torch.tensor(0.5)


def quantized_case(seq_lens, block_size, num_kv_heads, head_dim, fmt, chunk=7, seed=0, dtype=torch.float32):
    """A cache of ``fmt`` holding sequences of ``seq_lens`` tokens, stored ``chunk`` tokens per call
    (so int8 blocks fill over several stores), on shuffled blocks; returns the cache, its scales, the
    tables and the tokens' true keys and values."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = (
        torch.full(shape, float("nan")).to(fmt) if fmt != torch.int8 else torch.full(shape, 99, dtype=fmt)
    )
    value_cache = key_cache.clone()
    k_scale, v_scale = (
        empty_scales(fmt, num_blocks, num_kv_heads),
        empty_scales(fmt, num_blocks, num_kv_heads),
    )
    order = torch.randperm(num_blocks, generator=gen).tolist()
    spare = order.pop()
    tables = torch.full((len(seq_lens), max(per_seq) + 1), spare, dtype=torch.int32)
    truth = []
    for i, (n, nb) in enumerate(zip(seq_lens, per_seq, strict=True)):
        ids = [order.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        k = (torch.randn(n, num_kv_heads, head_dim, generator=gen) * torch.linspace(0.2, 3, head_dim)).to(
            dtype
        )
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor([ids[p // block_size] * block_size + p % block_size for p in range(n)])
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            reference.store_kv(
                k[part], v[part], key_cache, value_cache, slots[part], k_scale=k_scale, v_scale=v_scale
            )
        truth.append((k, v))
    return key_cache, value_cache, k_scale, v_scale, tables, torch.tensor(seq_lens, dtype=torch.int32), truth


def dequantized(cache: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    ids = torch.arange(cache.shape[0])
    return quantization.dequantize_blocks(cache, scales, ids)


# -- the stores: three backends, the same bits -----------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_backend_stores_the_same_bits(fmt, dtype):
    num_blocks, block_size, heads, dim = 6, 8, 2, 32
    results = []
    for backend in BACKENDS:
        kc = torch.zeros(num_blocks, block_size, heads, dim).to(fmt)
        vc = kc.clone()
        ks = torch.zeros(num_blocks, heads) if fmt == torch.int8 else torch.tensor(0.03)
        vs = ks.clone()
        g = torch.Generator().manual_seed(1)
        # a prompt over blocks 4 and 1, two decode tokens, then a growing value, a skipped slot, and
        # block 4 reused from offset 0 (a fresh owner)
        for slots, size in (
            ([32 + i for i in range(8)] + [8, 9, 10], 1.0),
            ([11], 1.0),
            ([12, -1], 4.0),
            ([32], 0.5),
        ):
            k = (torch.randn(len(slots), heads, dim, generator=g) * size).to(dtype)
            v = (torch.randn(len(slots), heads, dim, generator=g) * size).to(dtype)
            kernels.store_kv(k, v, kc, vc, torch.tensor(slots), backend=backend, k_scale=ks, v_scale=vs)
        results.append((bits(kc), bits(vc), ks, vs))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", quantization.FP8_DTYPES)
def test_the_triton_fp8_store_rounds_as_torch_converts(fmt):
    """Triton's interpreter converts float32 to fp8 wrongly (carries into the exponent, ties); the
    kernel rounds to the grid itself: every value, subnormals, ties and saturation included."""
    limit = quantization.fp8_max(fmt)
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt).float()
    grid = grid[grid.isfinite()].unique()
    middles = (grid[1:] + grid[:-1]) / 2  # exact ties
    saturating = torch.tensor([limit * 1.5, -limit * 3])
    values = torch.cat([saturating, grid, middles, middles.nextafter(grid[1:]), middles.nextafter(grid[:-1])])
    values = values[: values.numel() // 2 * 2]  # pairs: the saturating values come first, never dropped
    x = values.view(-1, 1, 2)
    cache = torch.zeros(x.shape[0], 1, 1, 2).to(fmt)
    slots = torch.arange(x.shape[0])
    store.store_kv(x, x, cache, cache.clone(), slots, k_scale=1.0, v_scale=1.0)
    expected = x.clamp(-limit, limit).to(fmt)
    # equal numbers (the interpreter writes a rounded -0.0 as +0.0, the same number; a GPU keeps the sign)
    assert torch.equal(cache.view(-1).float(), expected.view(-1).float())
    assert torch.equal(
        bits(cache.view(-1))[expected.view(-1).float() != 0],
        bits(expected.view(-1))[expected.view(-1).float() != 0],
    )


def test_an_int8_block_keeps_one_scale_that_grows_as_it_fills():
    gen = torch.Generator().manual_seed(2)
    kc = torch.zeros(3, 16, 1, 8, dtype=torch.int8)
    vc = kc.clone()
    ks, vs = torch.zeros(3, 1), torch.zeros(3, 1)
    k = torch.randn(16, 1, 8, generator=gen)
    k[10] *= 6  # a late, larger token: the block's scale must grow then
    slots = torch.arange(16, 32)  # block 1
    for t in range(16):
        reference.store_kv(k[t : t + 1], k[t : t + 1], kc, vc, slots[t : t + 1], k_scale=ks, v_scale=vs)
        assert ks[1, 0] == k[: t + 1].abs().max() / 127  # the largest |x| so far over 127
    error = (dequantized(kc, ks)[1] - k).abs()
    assert error.max() <= ks[1, 0] * 1.0001  # at most one step (two roundings for the rows before 10)
    assert error[10:].max() <= ks[1, 0] / 2 * 1.0001  # rows after the growth: one rounding
    one_go_k, one_go_v = torch.zeros_like(kc), torch.zeros_like(vc)
    one_scale = torch.zeros(3, 1)
    reference.store_kv(k, k, one_go_k, one_go_v, slots, k_scale=one_scale, v_scale=one_scale.clone())
    assert one_scale[1, 0] == ks[1, 0]
    assert (dequantized(one_go_k, one_scale)[1] - k).abs().max() <= one_scale[1, 0] / 2 * 1.0001
    # the block is freed and taken by another sequence: its first store starts it afresh
    small = torch.full((1, 1, 8), 0.01)
    reference.store_kv(small, small, kc, vc, torch.tensor([16]), k_scale=ks, v_scale=vs)
    assert ks[1, 0] == pytest.approx(0.01 / 127)


# -- attention: dequantized on load == dequantized first ---------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("heads", "head_dim", "block_size"), [((8, 2), 64, 16), ((4, 4), 80, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_quantized_pages_as_their_dequantized_values(fmt, heads, head_dim, block_size, dtype):
    num_heads, num_kv_heads = heads
    kc, vc, ks, vs, tables, lens, _ = quantized_case([1, block_size, block_size + 1, 45], block_size,
                                                     num_kv_heads, head_dim, fmt)  # fmt: skip
    query = torch.randn(4, num_heads, head_dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    oracle = reference.paged_decode(query.float(), dequantized(kc, ks), dequantized(vc, vs), tables, lens)
    tolerance = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    for backend in BACKENDS:
        out = kernels.paged_decode(query, kc, vc, tables, lens, backend=backend, k_scale=ks, v_scale=vs)
        assert out.dtype == dtype and out.isfinite().all(), backend
        torch.testing.assert_close(out.float(), oracle, **tolerance, msg=backend)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_lens", [[1, 3, 16, 5], [20, 2, 1, 9]])
def test_prefill_and_draft_verification_read_quantized_pages(fmt, q_lens):
    """Prompts, chunks after a cached prefix and a few drafts (the compiled backend's decode rows)."""
    kc, vc, ks, vs, tables, lens, _ = quantized_case([1 + 3, 16 + 4, 16, 30], 8, 2, 32, fmt)
    q_lens = [min(q, int(n)) for q, n in zip(q_lens, lens.tolist(), strict=True)]
    query = torch.randn(sum(q_lens), 4, 32, generator=torch.Generator().manual_seed(4))
    loc = query_start_loc(q_lens)
    oracle = reference.paged_prefill(query, dequantized(kc, ks), dequantized(vc, vs), tables, lens, loc)
    for backend in BACKENDS:
        out = kernels.paged_prefill(query, kc, vc, tables, lens, loc, backend=backend, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(out, oracle, atol=2e-5, rtol=1e-5, msg=backend)


def test_split_k_decode_reads_quantized_pages():
    kc, vc, ks, vs, tables, lens, _ = quantized_case([700, 40], 16, 1, 32, torch.int8, chunk=300)
    query = torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(5))
    oracle = reference.paged_decode(query, dequantized(kc, ks), dequantized(vc, vs), tables, lens)
    out = decode.paged_decode(query, kc, vc, tables, lens, split_k=True, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, oracle, atol=2e-5, rtol=1e-5)


def test_quantized_attention_stays_close_to_sdpa_on_the_true_values():
    """Each format's error against torch's SDPA on the unquantized keys and values (keys with wide
    and narrow channels, as real ones have): bounded, and smallest for int8's scale per block and head."""
    errors = {}
    for fmt in FORMATS:
        kc, vc, ks, vs, tables, lens, truth = quantized_case([64], 16, 2, 64, fmt, chunk=64)
        query = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(6))
        k, v = (t.repeat_interleave(2, 1).transpose(0, 1)[:, None] for t in truth[0])
        exact = torch.nn.functional.scaled_dot_product_attention(query.transpose(0, 1)[:, None], k, v)
        out = kernels.paged_decode(query, kc, vc, tables, lens, backend="compiled", k_scale=ks, v_scale=vs)
        errors[fmt] = float((out - exact[:, 0].transpose(0, 1)).abs().max())
    assert max(errors.values()) < 0.25, errors
    assert errors[torch.int8] < min(errors[torch.float8_e4m3fn], errors[torch.float8_e5m2]) / 2, errors


def test_scales_are_checked_against_the_cache():
    kc = torch.zeros(4, 8, 2, 16, dtype=torch.int8)
    q = torch.zeros(1, 2, 16)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(
        ValueError, match=r"k_scale must be a float32 \[num_blocks, num_kv_heads\] = \[4, 2\]"
    ):
        reference.paged_decode(q, kc, kc, tables, lens)
    with pytest.raises(ValueError, match="go with an 8-bit cache"):
        reference.paged_decode(q, kc.float(), kc.float(), tables, lens, k_scale=1.0, v_scale=1.0)
    fp8 = kc.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="v_scale must be 0-d and > 0"):
        decode.paged_decode(q, fp8, fp8, tables, lens, k_scale=1.0, v_scale=torch.ones(2))
    with pytest.raises(TypeError, match="share one dtype"):
        prefill.paged_prefill(q, fp8, kc, tables, lens, query_start_loc([1]))


def test_the_fp8_scale_defaults_to_one():
    kc, vc, _, _, tables, lens, _ = quantized_case([9], 8, 1, 16, torch.float8_e4m3fn)
    q = torch.randn(1, 1, 16)
    default = reference.paged_decode(q, kc, vc, tables, lens)
    ones = reference.paged_decode(q, kc, vc, tables, lens, k_scale=1.0, v_scale=1.0)
    torch.testing.assert_close(default, ones)
