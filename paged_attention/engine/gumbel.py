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

import torch

GAMMA = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
SEED_HIGH = 2**31  # each draw's seed is in [0, SEED_HIGH)
#: Bounds on the noise: the least ``g`` (``u = 2**-54``) and a bound above every finite one.
G_MIN = -math.log(-math.log(0.5 * 2.0**-53))
G_MAX = 37.5


def _signed(x: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no full uint64 arithmetic)."""
    x %= 2**64
    return x - 2**64 if x >= 2**63 else x


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 tensors that hold uint64 bits (``>>`` is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors holding uint64 bits (products wrap modulo 2**64)."""
    z = (z ^ _shift_right(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MIX2)
    return z ^ _shift_right(z, 31)


def noise(seeds: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The Gumbel noise ``g`` (float64) of token ids ``tokens`` under ``seeds``; both int64, of
    shapes that broadcast (``[rows, 1]`` and ``[rows, k]``, say)."""
    key = mix(seeds.to(torch.int64))
    bits = _shift_right(mix(key + (tokens.to(torch.int64) + 1) * _signed(GAMMA)), 11)
    u = (bits.to(torch.float64) + 0.5) * 2.0**-53
    return -torch.log(-torch.log(u))


def gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """``argmax_i (logits[r, i] + g(seeds[r], i))`` for each row ``r`` of ``logits`` ``[rows, vocab]``
    (any float dtype; compared in float64). A row of only ``-inf`` gives token 0."""
    x = logits.to(torch.float64)
    best = x.amax(dim=1, keepdim=True)
    # Only tokens that could beat the largest logit's least possible score are candidates.
    candidate = (x >= best - (G_MAX - G_MIN)) & (x > float("-inf"))
    rows, ids = candidate.nonzero(as_tuple=True)  # row-major: ids ascend within a row
    score = x[rows, ids] + noise(seeds.to(torch.int64)[rows], ids)
    out = torch.zeros(x.shape[0], dtype=torch.int64)
    if rows.numel():
        # The largest score per row, then the lowest id reaching it.
        top = torch.full((x.shape[0],), float("-inf"), dtype=torch.float64)
        top = top.scatter_reduce(0, rows, score, reduce="amax")
        winner = score == top[rows]
        first = torch.full((x.shape[0],), x.shape[1], dtype=torch.int64)
        first = first.scatter_reduce(0, rows[winner], ids[winner], reduce="amin")
        out = torch.where(first < x.shape[1], first, out)
    return out


def draw_seed(generator: torch.Generator | None) -> int:
    """One draw's seed from ``generator`` (``None``: torch's global generator), as vLLM draws it."""
    return int(torch.randint(0, SEED_HIGH, (1,), generator=generator, dtype=torch.long))
