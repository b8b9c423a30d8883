"""Checks of the kernel exercises: the online-softmax update, a Triton kernel that reads K through a
block table (graded under Triton's interpreter on a CPU, compiled on a GPU), and the split-K merge."""

from __future__ import annotations

import random
from typing import Any

import torch

from .._triton_env import triton_interpreted
from ..kernels.reference import gather_kv
from .checking import CheckFailed
from .student import Student, driver


def _device() -> torch.device:
    return torch.device("cpu" if triton_interpreted() or not torch.cuda.is_available() else "cuda")


def _floats(value: Any) -> Any:
    """A tensor or number as a flat list of floats; anything else as its repr (it fails the case)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float64).flatten().tolist()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)]
    return repr(value)[:80]


def _close(case: str, expected: torch.Tensor, got: Any, hint: str = "", atol: float = 1e-4) -> None:
    """Raise :class:`CheckFailed` at the first element of ``got`` (a driver's list of floats) that
    differs from ``expected``."""
    if not isinstance(got, list):
        raise CheckFailed(case, "a tensor", got)
    if len(got) != expected.numel():
        raise CheckFailed(case + ": number of elements", expected.numel(), len(got))
    want = expected.double().flatten()
    have = torch.tensor(got, dtype=torch.float64)
    wrong = ~torch.isclose(have, want, atol=atol, rtol=1e-4, equal_nan=False)
    if wrong.any():
        i = int(wrong.nonzero()[0])
        where = f" at index {i}" if want.numel() > 1 else ""
        raise CheckFailed(case + where, round(want[i].item(), 5), round(have[i].item(), 5), hint)


# -- 03.online_softmax -----------------------------------------------------------------------------


@driver
def online_run(
    state: dict, objects: tuple, scores: list[float], values: list[list[float]], tile: int
) -> dict:
    """The student's update folded over ``scores`` tile by tile from (-inf, 0, zeros), in float64:
    ``m`` and ``l`` after every tile, and ``acc / l`` at the end."""
    update = objects[0]
    s = torch.tensor(scores, dtype=torch.float64)
    v = torch.tensor(values, dtype=torch.float64)
    m = torch.tensor(float("-inf"), dtype=torch.float64)
    total = torch.tensor(0.0, dtype=torch.float64)
    acc = torch.zeros(v.shape[1], dtype=torch.float64)
    after = []
    for start in range(0, len(scores), tile):
        m, total, acc = update(m, total, acc, s[start : start + tile], v[start : start + tile])
        after.append([_floats(m), _floats(total)])
    out = acc / total if isinstance(acc, torch.Tensor) else acc
    return {"after": after, "out": _floats(out)}


def online_softmax(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``online_softmax_update(m, total, acc, scores, values) -> (m, total, acc)``: ``m`` the running max and
    ``l`` the running sum of ``exp(score - m)`` (0-d tensors, starting at -inf and 0), ``acc`` the
    running sum of ``exp(score - m) * value`` ([head_dim], starting at zeros), ``scores`` [tile] and
    ``values`` [tile, head_dim]. After the last tile, ``acc / total`` must be softmax(scores) @ values,
    and after every tile ``m`` and ``l`` must be exactly what they say. Scores near +-1,000 make
    ``exp`` overflow (or underflow to 0) in float64 unless the running max is subtracted."""
    gen = torch.Generator().manual_seed(seed)
    cases = [
        ("rising scores: every tile has a larger max than the last", torch.arange(12.0) * 3, 4),
        (
            "scores near 1,000 (exp overflows float64 without subtracting the max)",
            1000 + torch.randn(10, generator=gen),
            3,
        ),
        (
            "scores near -1,000 (exp underflows to 0 without subtracting the max)",
            -1000 + torch.randn(9, generator=gen),
            4,
        ),
        ("one tile", torch.randn(5, generator=gen), 8),
    ]
    for i in range(12 if not thorough else 60):
        n = 1 + i % 17
        cases.append((f"random scores, {n} tokens", torch.randn(n, generator=gen) * (1 + i % 5), 1 + i % 6))
    for name, scores, tile in cases:
        scores = scores.double()
        values = torch.randn(scores.numel(), 4, generator=gen, dtype=torch.float64)
        case = f"{name}, tile size {tile}"
        got = student.call(case, "checks_kernels:online_run", scores.tolist(), values.tolist(), tile)
        for index, start in enumerate(range(0, scores.numel(), tile)):
            seen = scores[: start + tile]
            where = f"{case}, after tokens 0..{min(start + tile, scores.numel()) - 1}"
            m, total = got["after"][index]
            _close(where + ": m", seen.max().reshape(()), m, "m is the largest score seen so far")
            _close(
                where + ": l",
                (seen - seen.max()).exp().sum().reshape(()),
                total,
                "l is the sum of exp(score - m) over the scores seen, rescaled when m grows",
            )
        _close(
            f"{case}: acc / total",
            scores.softmax(0) @ values,
            got["out"],
            "when m grows, scale the old acc and l by exp(m_old - m_new) before adding the tile",
        )
    return len(cases)


# -- 03.split_k_merge ------------------------------------------------------------------------------


@driver
def merge_run(
    state: dict, objects: tuple, maxes: list[float], sums: list[float], outs: list[list[float]]
) -> Any:
    """The student's merge on float64 tensors, as a list of floats."""
    tensors = [torch.tensor(x, dtype=torch.float64) for x in (maxes, sums, outs)]
    return _floats(objects[0](*tensors))


def split_k_merge(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``merge_partitions(maxes [P], sums [P], outs [P, head_dim]) -> [head_dim]``: each partition's
    max score, sum of exp(score - its max), and normalized output; the merge must equal attention
    over the whole sequence, also where the maxes are near +-800 and ``exp(max)`` overflows float64
    (or underflows to 0) unless the global max is subtracted first."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    cases = [
        ("partitions with very different maxes", [torch.randn(4, generator=gen) + 30 * k for k in range(3)]),
        (
            "maxes near 800: exp(max) overflows float64",
            [torch.randn(5, generator=gen) + 800 + k for k in range(3)],
        ),
        (
            "maxes near -800: exp(max) underflows to 0",
            [torch.randn(3, generator=gen) - 800 - k for k in range(4)],
        ),
        ("one partition", [torch.randn(6, generator=gen)]),
    ]
    for _ in range(15 if not thorough else 80):
        parts = rng.randint(1, 6)
        scale = rng.choice((1, 5, 20))
        cases.append(
            (
                f"{parts} partitions",
                [torch.randn(rng.randint(1, 9), generator=gen) * scale for _ in range(parts)],
            )
        )
    for name, pieces in cases:
        pieces = [p.double() for p in pieces]
        values = [torch.randn(p.numel(), 5, generator=gen, dtype=torch.float64) for p in pieces]
        maxes = torch.stack([p.max() for p in pieces])
        sums = torch.stack([(p - p.max()).exp().sum() for p in pieces])
        outs = torch.stack([p.softmax(0) @ v for p, v in zip(pieces, values, strict=True)])
        case = f"{name} (maxes {[round(x, 2) for x in maxes.tolist()]})"
        got = student.call(case, "checks_kernels:merge_run", maxes.tolist(), sums.tolist(), outs.tolist())
        _close(
            case,
            torch.cat(pieces).softmax(0) @ torch.cat(values),
            got,
            "weight partition s by sums[s] * exp(maxes[s] - max over all partitions)",
        )
    return len(cases)


# -- 03.block_table --------------------------------------------------------------------------------

SENTINEL = 12345.0


def kernel_inputs(
    block_size: int, head_dim: int, seq_len: int, table: list[int], seed: int
) -> list[torch.Tensor]:
    """``q``, ``key_cache`` (NaN in unused slots), ``block_table`` and ``scores`` (the sentinel) of
    one case; the same arguments give the same tensors on either side of the pipe."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = len(table) + 3
    key_cache = torch.full((num_blocks, block_size, head_dim), float("nan"))
    keys = torch.randn(seq_len, head_dim, generator=gen)
    for t in range(seq_len):
        key_cache[table[t // block_size], t % block_size] = keys[t]
    q = torch.randn(head_dim, generator=gen)
    scores = torch.full((len(table) * block_size,), SENTINEL)
    return [q, key_cache, torch.tensor(table, dtype=torch.int32), scores]


@driver
def kernel_run(
    state: dict, objects: tuple, block_size: int, head_dim: int, seq_len: int, table: list[int], seed: int
) -> Any:
    """The student's kernel launched on one case's tensors; the scores it stored (or what the
    object is, if it is not a Triton kernel)."""
    from triton.runtime.jit import KernelInterface  # compiled (JITFunction) and interpreted alike

    if not isinstance(objects[0], KernelInterface):
        return f"<a {type(objects[0]).__name__}, not a @triton.jit kernel>"
    args = [x.to(_device()) for x in kernel_inputs(block_size, head_dim, seq_len, table, seed)]
    objects[0][(len(table),)](*args, seq_len, BLOCK_SIZE=block_size, HEAD_DIM=head_dim)
    return _floats(args[3])


def block_table(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``paged_scores_kernel[(num_logical_blocks,)](q, key_cache, block_table, scores, seq_len,
    BLOCK_SIZE=..., HEAD_DIM=...)``: program ``i`` stores ``q . K[t]`` for each token ``t`` of logical
    block ``i`` (``t < seq_len``), reading K from physical block ``block_table[i]`` of ``key_cache``
    ``[num_blocks, BLOCK_SIZE, HEAD_DIM]``. Unused cache slots hold NaN; scores past ``seq_len`` must
    be left alone."""
    rng = random.Random(seed)
    cases = [(4, 16, 10), (4, 16, 8), (8, 32, 1), (16, 16, 33)]
    cases += [
        (rng.choice((2, 4, 8, 16)), rng.choice((16, 32)), rng.randint(1, 40))
        for _ in range(4 if not thorough else 16)
    ]
    for block_size, head_dim, seq_len in cases:
        num_logical = -(-seq_len // block_size)
        table = rng.sample(range(num_logical + 3), num_logical)
        tensor_seed = rng.randrange(2**31)
        q, key_cache, table_tensor, _ = kernel_inputs(block_size, head_dim, seq_len, table, tensor_seed)
        case = f"block_size={block_size}, head_dim={head_dim}, seq_len={seq_len}, block_table={table}"
        got = student.call(
            case, "checks_kernels:kernel_run", block_size, head_dim, seq_len, table, tensor_seed
        )
        if isinstance(got, str):
            raise CheckFailed(
                "paged_scores_kernel", "a @triton.jit kernel", got, "decorate it with @triton.jit"
            )
        gathered = gather_kv(key_cache.unsqueeze(2), key_cache.unsqueeze(2), table_tensor, seq_len)[
            0
        ].squeeze(1)
        expected = torch.cat([gathered @ q, torch.full((num_logical * block_size - seq_len,), SENTINEL)])
        _close(
            case,
            expected.double(),
            got,
            "logical block i lives in physical block block_table[i]; mask the tokens at or past seq_len",
        )
    return len(cases)
