"""Builders for kernel tests: a paged cache whose every unused slot is NaN.

Any read past a sequence's end, from a padding entry of its block table or from a block it does not
own, would pull a NaN into the softmax and make the output NaN. So a finite, correct output proves
that the kernel read exactly the slots it should.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    # bf16 keeps 8 bits of mantissa: allow one ulp at the outputs' magnitude (|out| < 4).
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


@dataclass
class PagedCase:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    keys: list[torch.Tensor]  # contiguous [seq_len, kv_heads, head_dim] per sequence
    values: list[torch.Tensor]


def make_paged_case(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = key_cache.clone()
    order = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous pages
    nan_block = order.pop()  # padding entries point at a block full of NaN
    width = max(blocks_per_seq) + 2
    block_tables = torch.full((len(seq_lens), width), nan_block, dtype=torch.int32)
    keys, values = [], []
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        ids = [order.pop() for _ in range(nb)]
        block_tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(n):
            key_cache[ids[pos // block_size], pos % block_size] = k[pos]
            value_cache[ids[pos // block_size], pos % block_size] = v[pos]
        keys.append(k)
        values.append(v)
    return PagedCase(
        key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), keys, values
    )


def query_start_loc(q_lens: list[int]) -> torch.Tensor:
    loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    loc[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return loc
