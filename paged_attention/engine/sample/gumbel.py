"""Gumbel-max draws with hashed noise: how vLLM's CPU sampler turns a seed into a token.

Drawing token ``i`` with probability ``softmax(x)_i`` is the same as taking
``argmax_i (x_i + g_i)`` where the ``g_i`` are independent standard Gumbel variables,
``g = -log(-log(u))`` for ``u`` uniform in (0, 1) (the Gumbel-max trick). The filters before the draw
(min-p, top-k, top-p) set logits to ``-inf``, which can never win.

vLLM's CPU build (``torch.ops._C.fused_gumbel_argmax``, read at v0.32.0) makes each ``u_i`` from a
hash, not from a stream of random numbers: for a 64-bit ``seed`` and token index ``i``,

* ``key = mix(seed)``, ``bits_i = mix(key + (i + 1) * GAMMA) >> 11`` (53 bits), with ``mix`` the
  SplitMix64 finaliser and ``GAMMA = 0x9E3779B97F4A7C15`` (the golden ratio in 64 bits);
* ``u_i = (bits_i + 0.5) / 2**53``, ``g_i = -log(-log(u_i))``, in float64;
* the token is ``argmax_i (x_i + g_i)`` in float64, the lowest index on a tie.

Each step a request draws one ``seed`` in ``[0, 2**31)`` from its ``torch.Generator``
(``torch.randint(0, 2**31, (1,), generator=...)``), so a seeded request's tokens depend on its
generator alone, never on what shares the batch; and a request seeded ``s`` here draws what vLLM
draws for it, given the same logits. Because every ``g_i`` lies in ``[G_MIN, G_MAX]``, only tokens
within ``G_MAX - G_MIN`` of the largest logit can win: the noise is hashed for those alone (exact,
and much cheaper than hashing the whole vocabulary).
"""

from __future__ import annotations

import math

import numpy as np
import torch

GAMMA = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
SEED_HIGH = 2**31  # each draw's seed is in [0, SEED_HIGH)
#: Bounds on the noise: the least ``g`` (``u = 2**-54``) and a bound above every finite one.
G_MIN = -math.log(-math.log(0.5 * 2.0**-53))
G_MAX = 37.5
#: Scores hashed at once where most tokens can win (rows x vocabulary; a few float64 arrays of 8 MiB).
DENSE_CHUNK = 1 << 20


_MIX1_U, _MIX2_U, _GAMMA_U = np.uint64(_MIX1), np.uint64(_MIX2), np.uint64(GAMMA)


def mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array, in place (products wrap modulo 2**64); returns it."""
    z ^= z >> np.uint64(30)
    z *= _MIX1_U
    z ^= z >> np.uint64(27)
    z *= _MIX2_U
    z ^= z >> np.uint64(31)
    return z


def noise(seeds: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The Gumbel noise ``g`` (float64) of token ids ``tokens`` under ``seeds``; integer tensors of
    shapes that broadcast (``[rows, 1]`` and ``[rows, k]``, say). Computed in NumPy, whose uint64
    arithmetic wraps and shifts logically as the kernel's C++ does."""
    key = mix(seeds.numpy().astype(np.uint64))
    z = tokens.numpy().astype(np.uint64) + np.uint64(1)
    z *= _GAMMA_U
    z = mix(z + key)
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    np.log(u, out=u)
    np.negative(u, out=u)
    np.log(u, out=u)
    return torch.from_numpy(np.negative(u, out=u))


def gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """``argmax_i (logits[r, i] + g(seeds[r], i))`` for each row ``r`` of ``logits`` ``[rows, vocab]``
    (any float dtype; compared in float64). A row of only ``-inf`` gives token 0."""
    x = logits.to(torch.float64)
    rows_count, vocab = x.shape
    seeds = seeds.to(torch.int64)
    best = x.amax(dim=1, keepdim=True)
    # Only tokens that could beat the largest logit's least possible score are candidates.
    candidate = (x >= best - (G_MAX - G_MIN)) & (x > float("-inf"))
    out = torch.zeros(rows_count, dtype=torch.int64)
    if int(candidate.sum()) * 4 > x.numel():  # most tokens can win: hash them all, rows at a time
        ids, rows_at_once = torch.arange(vocab), max(1, DENSE_CHUNK // vocab)
        for start in range(0, rows_count, rows_at_once):
            part = slice(start, start + rows_at_once)
            score = x[part] + noise(seeds[part, None], ids)
            # the first index of the largest score (torch's argmax); a row of only -inf gives 0
            out[part] = score.masked_fill_(~candidate[part], float("-inf")).argmax(dim=1)
        return out
    rows, ids = candidate.nonzero(as_tuple=True)  # row-major: ids ascend within a row
    if rows.numel():
        score = x[rows, ids] + noise(seeds[rows], ids)
        # The largest score per row, then the lowest id reaching it.
        top = torch.full((rows_count,), float("-inf"), dtype=torch.float64)
        top = top.scatter_reduce(0, rows, score, reduce="amax")
        winner = score == top[rows]
        first = torch.full((rows_count,), vocab, dtype=torch.int64)
        first = first.scatter_reduce(0, rows[winner], ids[winner], reduce="amin")
        out = torch.where(first < vocab, first, out)
    return out


def draw_seed(generator: torch.Generator | None) -> int:
    """One draw's seed from ``generator`` (``None``: torch's global generator), as vLLM draws it."""
    return int(torch.randint(0, SEED_HIGH, (1,), generator=generator, dtype=torch.long))
