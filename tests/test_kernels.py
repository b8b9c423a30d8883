"""Every kernel against the PyTorch reference, and the reference against SDPA on contiguous K/V.

The Triton kernels run under Triton's interpreter here (no GPU), exactly the code a GPU compiles.
Grid in the spirit of vLLM's kernel tests: (heads, kv_heads) x head size x block size x dtype, with
shuffled block tables, lengths 1, block_size, block_size + 1 and longer, and NaN in every slot that
must not be read.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from paged_attention import kernels
from paged_attention.kernels import decode, prefill, reference

from .kernel_cases import TOLERANCE, make_paged_case, query_start_loc

HEADS = [(8, 8), (8, 2), (16, 1)]
HEAD_SIZES = [64, 80, 128]
BLOCK_SIZES = [8, 16, 32]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def lengths(block_size: int) -> list[int]:
    return [1, block_size, block_size + 1, 3 * block_size + 5]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int | None) -> torch.Tensor:
    """torch SDPA on contiguous ``q[q_len, H, D]``, ``k/v[kv_len, H_kv, D]`` (float32)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (
        t.float().transpose(0, 1) for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    )
    mask = None
    if causal_offset is not None:
        q_pos = causal_offset + torch.arange(q.shape[1])[:, None]
        mask = torch.arange(k.shape[1])[None, :] <= q_pos
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)


# -- the reference is the oracle: check it against torch's own attention first ------------------
@pytest.mark.parametrize(
    ("heads", "head_dim", "block_size"), [((8, 2), 80, 16), ((4, 4), 64, 8), ((16, 1), 128, 32)]
)
def test_reference_decode_matches_sdpa(heads, head_dim, block_size):
    case = make_paged_case(lengths(block_size), block_size, heads[1], head_dim, torch.float32)
    q = torch.randn(len(case.keys), heads[0], head_dim)
    out = reference.paged_decode(q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    for i, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        torch.testing.assert_close(out[i], sdpa(q[i : i + 1], k, v, None)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "head_dim", "block_size"), [((8, 2), 80, 16), ((4, 4), 64, 8)])
def test_reference_prefill_matches_causal_sdpa_with_a_cached_prefix(heads, head_dim, block_size):
    seq_lens, q_lens = [7, 20, 33], [7, 4, 12]  # a fresh prompt, and two chunks after cached prefixes
    case = make_paged_case(seq_lens, block_size, heads[1], head_dim, torch.float32)
    q = torch.randn(sum(q_lens), heads[0], head_dim)
    loc = query_start_loc(q_lens)
    out = reference.paged_prefill(q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, loc)
    for i, (n, m) in enumerate(zip(seq_lens, q_lens, strict=True)):
        expected = sdpa(q[loc[i] : loc[i + 1]], case.keys[i], case.values[i], causal_offset=n - m)
        torch.testing.assert_close(out[loc[i] : loc[i + 1]], expected, atol=1e-5, rtol=1e-5)
    fresh = sdpa(q[:7], case.keys[0], case.values[0], causal_offset=None)  # is_causal for a whole prompt
    q0, k0, v0 = (
        t.transpose(0, 1)
        for t in (
            q[:7],
            case.keys[0].repeat_interleave(heads[0] // heads[1], 1),
            case.values[0].repeat_interleave(heads[0] // heads[1], 1),
        )
    )
    causal = F.scaled_dot_product_attention(q0, k0, v0, is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out[:7], causal, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fresh, causal)  # the causal mask matters


# -- Triton kernels (interpreter) against the reference -----------------------------------------
GRID = list(itertools.product(HEADS, HEAD_SIZES, BLOCK_SIZES, DTYPES))


@pytest.mark.parametrize(("heads", "head_dim", "block_size", "dtype"), GRID)
def test_triton_decode_matches_reference(heads, head_dim, block_size, dtype):
    case = make_paged_case(
        lengths(block_size), block_size, heads[1], head_dim, dtype, seed=block_size + head_dim
    )
    q = torch.randn(len(case.keys), heads[0], head_dim).to(dtype)
    args = (q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    out = decode.paged_decode(*args, split_k=False)
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out, reference.paged_decode(*args), **TOLERANCE[dtype])


# One dtype per (heads, head size, block size) combination, cycling through the dtypes.
PREFILL_GRID = [
    (h, d, b, DTYPES[i % len(DTYPES)])
    for i, (h, d, b) in enumerate(itertools.product(HEADS, HEAD_SIZES, BLOCK_SIZES))
]


@pytest.mark.parametrize(("heads", "head_dim", "block_size", "dtype"), PREFILL_GRID)
def test_triton_prefill_matches_reference(heads, head_dim, block_size, dtype):
    seq_lens = [1, block_size, block_size + 3, 2 * block_size + 7]
    q_lens = [1, block_size, 2, block_size + 1]  # whole prompts and chunks after a cached prefix
    case = make_paged_case(seq_lens, block_size, heads[1], head_dim, dtype, seed=head_dim)
    q = torch.randn(sum(q_lens), heads[0], head_dim).to(dtype)
    args = (q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, query_start_loc(q_lens))
    out = prefill.paged_prefill(*args)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference.paged_prefill(*args), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_decode_matches_reference_on_long_contexts(dtype):
    seq_lens = [1, 511, 512, 513, 1300]  # partitions of 512: one, one, one, two, three
    case = make_paged_case(seq_lens, 32, 2, 64, dtype, seed=3)
    q = torch.randn(len(seq_lens), 8, 64).to(dtype)
    args = (q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    split = decode.paged_decode(*args, split_k=True)
    assert torch.isfinite(split).all()
    torch.testing.assert_close(split, reference.paged_decode(*args), **TOLERANCE[dtype])
    torch.testing.assert_close(split, decode.paged_decode(*args, split_k=False), **TOLERANCE[dtype])


def test_custom_scale_is_applied():
    case = make_paged_case([9, 17], 8, 2, 64, torch.float32)
    q = torch.randn(2, 4, 64)
    args = (q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    torch.testing.assert_close(decode.paged_decode(*args, 0.3), reference.paged_decode(*args, 0.3))
    assert not torch.allclose(reference.paged_decode(*args, 0.3), reference.paged_decode(*args))


def test_split_k_heuristic():
    assert decode.should_split_k(num_seqs=1, num_kv_heads=8, max_seq_len=8192)
    assert not decode.should_split_k(num_seqs=1, num_kv_heads=8, max_seq_len=512)  # one partition
    assert not decode.should_split_k(num_seqs=64, num_kv_heads=8, max_seq_len=8192)  # grid already full


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_store_matches_torch_store_and_skips_minus_one(dtype):
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(6, 2, 80, generator=gen).to(dtype)
    value = torch.randn(6, 2, 80, generator=gen).to(dtype)
    slots = torch.tensor([5, -1, 0, 17, -1, 30])
    caches = [torch.zeros(4, 8, 2, 80, dtype=dtype) for _ in range(4)]
    kernels.store_kv(key, value, caches[0], caches[1], slots, backend="torch")
    kernels.store_kv(key, value, caches[2], caches[3], slots, backend="triton")
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int((caches[2] != 0).any(-1).any(-1).sum()) == 4


def test_package_entry_points_route_to_the_chosen_backend():
    case = make_paged_case([5, 12], 8, 2, 64, torch.float32)
    q = torch.randn(2, 4, 64)
    args = (q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    assert kernels.resolve_backend("auto", q.device) == "compiled"
    torch.testing.assert_close(kernels.paged_decode(*args, backend="triton"), kernels.paged_decode(*args))
    qp = torch.randn(4, 4, 64)
    loc = query_start_loc([1, 3])
    torch.testing.assert_close(
        kernels.paged_prefill(qp, *args[1:], loc, backend="triton"), kernels.paged_prefill(qp, *args[1:], loc)
    )


def test_backend_errors(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.resolve_backend("cuda", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        kernels.resolve_backend("triton", torch.device("cpu"))


# -- bad input: the same clear errors from every backend -----------------------------------------
def _good():
    case = make_paged_case([5, 12], 8, 2, 64, torch.float32)
    return torch.randn(2, 4, 64), case


@pytest.mark.parametrize("fn", [reference.paged_decode, decode.paged_decode])
@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (
            lambda q, c: (q[0], c.key_cache, c.value_cache, c.block_tables, c.seq_lens),
            ValueError,
            "3-d tensor",
        ),
        (
            lambda q, c: (q.half(), c.key_cache, c.value_cache, c.block_tables, c.seq_lens),
            TypeError,
            "share one dtype",
        ),
        (
            lambda q, c: (q.int(), c.key_cache, c.value_cache, c.block_tables, c.seq_lens),
            TypeError,
            "float32, float16",
        ),
        (lambda q, c: (q, c.key_cache, c.value_cache, c.block_tables.long(), c.seq_lens), TypeError, "int32"),
        (
            lambda q, c: (q, c.key_cache, c.value_cache, c.block_tables, c.seq_lens.long()),
            TypeError,
            "seq_lens",
        ),
        (
            lambda q, c: (torch.randn(2, 3, 64), c.key_cache, c.value_cache, c.block_tables, c.seq_lens),
            ValueError,
            "multiple of num_kv_heads",
        ),
        (
            lambda q, c: (torch.randn(2, 4, 32), c.key_cache, c.value_cache, c.block_tables, c.seq_lens),
            ValueError,
            "head_dim",
        ),
        (
            lambda q, c: (
                q,
                c.key_cache,
                c.value_cache,
                c.block_tables,
                torch.tensor([0, 3], dtype=torch.int32),
            ),
            ValueError,
            "every seq_len must be >= 1",
        ),
        (
            lambda q, c: (q, c.key_cache, c.value_cache, c.block_tables[:, :1], c.seq_lens),
            ValueError,
            "exceeds what a block table row holds",
        ),
        (
            lambda q, c: (q[:1], c.key_cache, c.value_cache, c.block_tables, c.seq_lens),
            ValueError,
            "one query per",
        ),
        (
            lambda q, c: (q, c.key_cache, c.value_cache[:, :4], c.block_tables, c.seq_lens),
            ValueError,
            "both be",
        ),
    ],
)
def test_decode_bad_input(fn, mutate, error, message):
    q, case = _good()
    with pytest.raises(error, match=message):
        fn(*mutate(q, case))


@pytest.mark.parametrize("fn", [reference.paged_prefill, prefill.paged_prefill])
@pytest.mark.parametrize(
    ("loc", "message"),
    [
        (torch.tensor([0, 1, 4]), "int32"),
        (torch.tensor([0, 1], dtype=torch.int32), r"num_seqs \+ 1"),
        (torch.tensor([0, 1, 3], dtype=torch.int32), "end at num_tokens=4"),
        (torch.tensor([0, 0, 4], dtype=torch.int32), "1 <= new tokens <= seq_len"),
    ],
)
def test_prefill_bad_query_start_loc(fn, loc, message):
    _, case = _good()
    with pytest.raises((TypeError, ValueError), match=message):
        fn(torch.randn(4, 4, 64), case.key_cache, case.value_cache, case.block_tables, case.seq_lens, loc)


# -- the wider grid, for a slower run: pytest -m slow --------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [32, 96, 112, 120, 192, 256])
@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_triton_kernels_on_more_head_and_block_sizes(head_dim, block_size):
    dtype = torch.float16
    case = make_paged_case([1, block_size + 1, 150], block_size, 2, head_dim, dtype, seed=head_dim)
    q = torch.randn(3, 8, head_dim).to(dtype)
    args = (q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    torch.testing.assert_close(
        decode.paged_decode(*args, split_k=False), reference.paged_decode(*args), **TOLERANCE[dtype]
    )
    qp = torch.randn(9, 8, head_dim).to(dtype)
    pargs = (qp, *args[1:], query_start_loc([1, 3, 5]))
    torch.testing.assert_close(
        prefill.paged_prefill(*pargs), reference.paged_prefill(*pargs), **TOLERANCE[dtype]
    )


def test_non_contiguous_index_tensors_give_the_same_result():
    case = make_paged_case([5, 30, 17], 8, 2, 64, torch.float32, seed=5)
    q = torch.randn(3, 4, 64)
    wide = torch.stack([case.block_tables, case.block_tables], dim=2)[:, :, 0]  # a strided view
    lens = torch.stack([case.seq_lens, case.seq_lens], dim=1)[:, 0]
    assert not wide.is_contiguous() and not lens.is_contiguous()
    expected = reference.paged_decode(q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    torch.testing.assert_close(decode.paged_decode(q, case.key_cache, case.value_cache, wide, lens), expected)
    loc = torch.stack([query_start_loc([1, 1, 1])] * 2, dim=1)[:, 0]
    torch.testing.assert_close(
        prefill.paged_prefill(q, case.key_cache, case.value_cache, wide, lens, loc), expected
    )


@pytest.mark.parametrize("fn", [reference.paged_decode, decode.paged_decode])
@pytest.mark.parametrize("bad_id", [-1, 10_000])
def test_block_ids_outside_the_cache_are_rejected(fn, bad_id):
    q, case = _good()
    tables = case.block_tables.clone()
    tables[1, 1] = bad_id  # sequence 1 has 12 tokens in blocks of 8: it reads entry 1
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = .* is not a block of the cache"):
        fn(q, case.key_cache, case.value_cache, tables, case.seq_lens)
    tables[1, 1] = case.block_tables[1, 1]
    tables[0, 1] = bad_id  # sequence 0 has 5 tokens: entry 1 is padding, never read, so allowed
    fn(q, case.key_cache, case.value_cache, tables, case.seq_lens)


def test_non_tensor_and_empty_caches_are_rejected():
    q, case = _good()
    with pytest.raises(TypeError, match=r"key_cache must be a torch\.Tensor"):
        reference.paged_decode(q, [1, 2], case.value_cache, case.block_tables, case.seq_lens)
    empty = torch.zeros(4, 8, 0, 64)
    with pytest.raises(ValueError, match="non-empty"):
        reference.paged_decode(q, empty, empty, case.block_tables, case.seq_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_path_matches_the_explicit_oracle(dtype):
    """The engine's CPU decode (torch's fused SDPA over the gathered pages) equals attend()'s math."""
    from paged_attention.kernels.reference import GatherPlan, decode_with_plan

    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, heads, dim = 24, 8, 2, 8, 32
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    seq_lens = torch.tensor([1, 17, 40, 9], dtype=torch.int32)
    tables = torch.randperm(num_blocks)[:20].view(4, 5).to(torch.int32)
    query = torch.randn(4, heads, dim).to(dtype)
    plan = GatherPlan.build(tables, seq_lens, block_size)
    explicit = decode_with_plan(query, key_cache, value_cache, plan, 0.2)
    fused = decode_with_plan(query, key_cache, value_cache, plan, 0.2, fused=True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fused.float(), explicit.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_prefill_path_matches_the_explicit_oracle(dtype):
    """The engine's CPU prefill (torch's fused SDPA in the cache's dtype) equals attend()'s float32
    math on the same inputs, to the dtype's rounding: decode rows, a fresh prompt and a chunk after a
    cached prefix, in one packed batch."""
    from paged_attention.kernels.reference import paged_prefill

    torch.manual_seed(0)
    case = make_paged_case([1 + 8, 13, 30], 8, 2, 32, dtype)  # q lens 1, 13 (all new), 5 after 25
    q_lens = [1, 13, 5]
    query = torch.randn(sum(q_lens), 8, 32).to(dtype)
    args = (
        query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.seq_lens,
        query_start_loc(q_lens),
    )
    explicit = paged_prefill(*args, 0.2)
    fused = paged_prefill(*args, 0.2, fused=True)
    assert fused.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fused.float(), explicit.float(), atol=tol, rtol=tol)
