"""Checks of the kernel exercises: the online-softmax update, a Triton kernel that reads K through a
block table (graded under Triton's interpreter on a CPU, compiled on a GPU), and the split-K merge."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from .._triton_env import triton_interpreted
from ..kernels.reference import gather_kv
from .checking import CheckFailed


def _device() -> torch.device:
    return torch.device("cpu" if triton_interpreted() or not torch.cuda.is_available() else "cuda")


def _close(case: str, expected: torch.Tensor, got: object, hint: str = "", atol: float = 1e-4) -> None:
    """Raise :class:`CheckFailed` at the first element of ``got`` that differs from ``expected``."""
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(case, "a tensor", type(got).__name__)
    if got.numel() != expected.numel():
        raise CheckFailed(case + ": shape", tuple(expected.shape), tuple(got.shape))
    want = expected.double().flatten()
    have = got.detach().to("cpu", torch.float64).flatten()
    wrong = ~torch.isclose(have, want, atol=atol, rtol=1e-4)
    if wrong.any():
        i = int(wrong.nonzero()[0])
        where = f" at index {i}" if want.numel() > 1 else ""
        raise CheckFailed(case + where, round(want[i].item(), 5), round(have[i].item(), 5), hint)


def online_softmax(update: Callable, thorough: bool = False) -> int:
    """``online_softmax_update(m, total, acc, scores, values) -> (m, total, acc)``: ``m`` the running max and
    ``l`` the running sum of ``exp(score - m)`` (0-d tensors, starting at -inf and 0), ``acc`` the
    running sum of ``exp(score - m) * value`` ([head_dim], starting at zeros), ``scores`` [tile] and
    ``values`` [tile, head_dim]. After the last tile, ``acc / total`` must be softmax(scores) @ values,
    and after every tile ``m`` and ``l`` must be exactly what they say."""
    gen = torch.Generator().manual_seed(6)
    cases = [
        ("rising scores: every tile has a larger max than the last", torch.arange(12.0) * 3, 4),
        (
            "large scores (exp would overflow without subtracting the max)",
            400 + torch.randn(10, generator=gen),
            3,
        ),
        ("one tile", torch.randn(5, generator=gen), 8),
    ]
    for i in range(12 if not thorough else 60):
        n = 1 + i % 17
        cases.append((f"random scores, {n} tokens", torch.randn(n, generator=gen) * (1 + i % 5), 1 + i % 6))
    for name, scores, tile in cases:
        dim = 4
        values = torch.randn(scores.numel(), dim, generator=gen, dtype=torch.float64)
        scores = scores.double()
        m, total, acc = (
            torch.tensor(float("-inf"), dtype=torch.float64),
            torch.tensor(0.0, dtype=torch.float64),
            torch.zeros(dim, dtype=torch.float64),
        )
        for start in range(0, scores.numel(), tile):
            seen = scores[: start + tile]
            m, total, acc = update(m, total, acc, scores[start : start + tile], values[start : start + tile])
            case = f"{name}, tile size {tile}, after tokens 0..{min(start + tile, scores.numel()) - 1}"
            _close(case + ": m", seen.max().reshape(()), m, "m is the largest score seen so far")
            _close(
                case + ": l",
                (seen - seen.max()).exp().sum().reshape(()),
                total,
                "l is the sum of exp(score - m) over the scores seen, rescaled when m grows",
            )
        expected = scores.softmax(0) @ values
        _close(
            f"{name}, tile size {tile}: acc / total",
            expected,
            acc / total,
            "when m grows, scale the old acc and l by exp(m_old - m_new) before adding the tile",
        )
    return len(cases)


def split_k_merge(merge: Callable, thorough: bool = False) -> int:
    """``merge_partitions(maxes [P], sums [P], outs [P, head_dim]) -> [head_dim]``: each partition's
    max score, sum of exp(score - its max), and normalized output; the merge must equal attention
    over the whole sequence."""
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    cases = [
        ("partitions with very different maxes", [torch.randn(4, generator=gen) + 30 * k for k in range(3)])
    ]
    cases += [("one partition", [torch.randn(6, generator=gen)])]
    for _ in range(15 if not thorough else 80):
        parts = rng.randint(1, 6)
        cases.append(
            (
                f"{parts} partitions",
                [
                    torch.randn(rng.randint(1, 9), generator=gen) * rng.choice((1, 5, 20))
                    for _ in range(parts)
                ],
            )
        )
    for name, pieces in cases:
        pieces = [p.double() for p in pieces]
        values = [torch.randn(p.numel(), 5, generator=gen, dtype=torch.float64) for p in pieces]
        maxes = torch.stack([p.max() for p in pieces])
        sums = torch.stack([(p - p.max()).exp().sum() for p in pieces])
        outs = torch.stack([p.softmax(0) @ v for p, v in zip(pieces, values, strict=True)])
        expected = torch.cat(pieces).softmax(0) @ torch.cat(values)
        _close(
            f"{name} (maxes {[round(x, 2) for x in maxes.tolist()]})",
            expected,
            merge(maxes, sums, outs),
            "weight partition s by sums[s] * exp(maxes[s] - max over all partitions)",
        )
    return len(cases)


def block_table(kernel: object, thorough: bool = False) -> int:
    """``paged_scores_kernel[(num_logical_blocks,)](q, key_cache, block_table, scores, seq_len,
    BLOCK_SIZE=..., HEAD_DIM=...)``: program ``i`` stores ``q . K[t]`` for each token ``t`` of logical
    block ``i`` (``t < seq_len``), reading K from physical block ``block_table[i]`` of ``key_cache``
    ``[num_blocks, BLOCK_SIZE, HEAD_DIM]``. Unused cache slots hold NaN; scores past ``seq_len`` must
    be left alone."""
    device = _device()
    gen = torch.Generator().manual_seed(8)
    rng = random.Random(8)
    cases = [(4, 16, 10), (4, 16, 8), (8, 32, 1), (16, 16, 33)]
    cases += [
        (rng.choice((2, 4, 8, 16)), rng.choice((16, 32)), rng.randint(1, 40))
        for _ in range(4 if not thorough else 16)
    ]
    sentinel = 12345.0
    for block_size, head_dim, seq_len in cases:
        num_logical = -(-seq_len // block_size)
        num_blocks = num_logical + 3
        key_cache = torch.full((num_blocks, block_size, head_dim), float("nan"))
        table = torch.tensor(rng.sample(range(num_blocks), num_logical), dtype=torch.int32)
        keys = torch.randn(seq_len, head_dim, generator=gen)
        for t in range(seq_len):
            key_cache[table[t // block_size], t % block_size] = keys[t]
        q = torch.randn(head_dim, generator=gen)
        scores = torch.full((num_logical * block_size,), sentinel)
        args = [x.to(device) for x in (q, key_cache, table, scores)]
        kernel[(num_logical,)](*args, seq_len, BLOCK_SIZE=block_size, HEAD_DIM=head_dim)  # type: ignore[index]
        gathered = gather_kv(key_cache.unsqueeze(2), key_cache.unsqueeze(2), table, seq_len)[0].squeeze(1)
        expected = torch.cat([gathered @ q, torch.full((num_logical * block_size - seq_len,), sentinel)])
        case = (
            f"block_size={block_size}, head_dim={head_dim}, seq_len={seq_len}, block_table={table.tolist()}"
        )
        _close(
            case,
            expected.double(),
            args[3].cpu(),
            "logical block i lives in physical block block_table[i]; mask the tokens at or past seq_len",
        )
    return len(cases)
