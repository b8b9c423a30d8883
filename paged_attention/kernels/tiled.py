"""float32 products of a few rows in one pass over a tiled weight, summed in oneDNN's own order.

A decode step of one sequence multiplies one row by every weight matrix of the model: each weight
is read once and used once, so the step is bound by reading them. oneDNN's packed float32 product
(:mod:`..models.packed_linear`) reads SmolLM2's layer weights at ~14.7 GB/s at one row, ~12 at two
(one thread, this project's 2-core AMD EPYC); this loop at ~25 GB/s at one row, ~23 at two; at
three both read ~16.5 GB/s, and from four rows on oneDNN is faster (the products become
compute-bound and it keeps its sums in registers), so :func:`tiled_product` takes at most
:data:`ROWS` rows. On a 2-core Xeon with AMX oneDNN was the faster at one row too (~12 GB/s against
~10), and on an Ice Lake Xeon MKL's matrix-vector product (``F.linear``) beat both at one row
(12.3-13.1 GB/s, oneDNN 9.7-10.5, the tiles 8.4-9.2): the engine measures which is faster on its
machine (``engine.worker.tuning``).

The order of the sums is oneDNN's, so a row's result is the one the packed product gives it in a
step of many rows, bit for bit. Measured on torch 2.13's oneDNN (``tests/test_tiled.py`` keeps it
true): its AVX-512 float32 kernel runs across output columns, and each output sums its products in
the order of ``k`` with fused multiply-adds, from zero within each block of the input dimension
``K``, then adds the blocks' sums in order; the block is its choice by shape and row count (512 for
SmolLM2's ``K`` of 576, 1024 for the ``K`` of 1,536 of its down projection from two rows on; at
one row a separate matrix-vector kernel takes 512 there, so oneDNN's own results for a row depend
on whether it is alone). The loop does the same over a copy of the weight laid out as
``tiles[ceil(N / TILE), K, TILE]`` (:data:`TILE` output columns side by side, one vector
instruction's worth of four), and :func:`tile_like` finds the block by comparing with the packed
product on probe rows: a weight for which no candidate block gives oneDNN's bits is not tiled.

The price is memory: the tiled copy is one more copy of the weight (the packed one and the
original are kept too). A weight changed in place is the caller's to notice (the packed layers
retile when they repack).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import compiled

#: Output columns per tile: four 512-bit vectors of float32 (the loop's accumulators per row).
TILE = 64

#: The most rows :func:`tiled_product` multiplies (from three on, oneDNN's product is as fast).
ROWS = 2

#: Blocks of ``K`` tried, in order, by :func:`tile_like` (oneDNN's choices seen so far first).
BLOCKS = (512, 1024, 256, 2048, 4096)


@dataclass(frozen=True)
class Tiles:
    """A float32 ``weight[N, K]`` as ``tiles[ceil(N / TILE), K, TILE]`` (columns past ``N`` zero),
    summed over ``K`` in blocks of ``block``."""

    tiles: torch.Tensor
    out_features: int
    block: int

    @property
    def nbytes(self) -> int:
        """Bytes the tiled copy holds."""
        return self.tiles.numel() * self.tiles.element_size()


def tile(weight: torch.Tensor, block: int) -> Tiles:
    """A contiguous float32 CPU ``weight[N, K]`` tiled (a copy), to be summed in blocks of ``block``."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"weight must be a 2-D float32 CPU tensor, got {tuple(weight.shape)} {weight.dtype}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    n, k = weight.shape
    count = -(-n // TILE)
    padded = weight.detach()
    if n % TILE:  # columns past N are zero (a whole number of tiles needs no padded copy first)
        padded = padded.new_zeros(count * TILE, k)
        padded[:n] = weight.detach()
    tiles = padded.reshape(count, TILE, k).transpose(1, 2).contiguous()
    return Tiles(tiles, n, block)


def tiled_product(x: torch.Tensor, tiles: Tiles, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for a float32 ``x[..., K]`` of at most :data:`ROWS` rows, from
    the weight's :class:`Tiles`; ``None`` where it does not apply (more rows, another dtype or
    device, shapes that do not match, autograd, Numba unavailable): the caller multiplies as before."""
    k = tiles.tiles.shape[1]
    rows = x.numel() // max(1, x.shape[-1])
    if rows > ROWS or rows == 0 or x.dtype != torch.float32 or x.shape[-1] != k or torch.is_grad_enabled():
        return None
    if bias is not None and (bias.shape != (tiles.out_features,) or bias.dtype != torch.float32):
        return None
    if x.device.type != "cpu" or not compiled.available():
        return None
    flat = x.detach().reshape(rows, k).contiguous()
    out = flat.new_empty(rows, tiles.out_features)
    try:
        from .loop_rows import tiled_rows as loop  # imported late: importing Numba costs half a second

        added = bias.detach().contiguous() if bias is not None else flat.new_empty(0)
        loop(flat.numpy(), tiles.tiles.numpy(), tiles.block, added.numpy(), out.numpy())
    except Exception as error:
        compiled.give_up(error)
        return None
    return out.view(*x.shape[:-1], tiles.out_features)


def tile_like(
    weight: torch.Tensor, bias: torch.Tensor | None, product: Callable[[torch.Tensor], torch.Tensor]
) -> Tiles | None:
    """``weight`` tiled with the first block of :data:`BLOCKS` for which :func:`tiled_product` gives
    ``product(x)`` (the product to stand in for, of many rows) bit for bit on probe rows, for every
    row count it takes; ``None`` if none does, or the weight cannot be tiled. The match is found at
    the thread count in force (oneDNN may split the sums another way at another), on at least
    :data:`PROBED` values: a narrow weight (oneDNN multiplies a single column another way, which a
    few rows may not show) is probed with more rows.

    oneDNN chooses its order by shape, not by value: once a block matched for a shape (with a bias
    or without, at a thread count), a weight of that shape is tried with that block first and
    checked on the probe's first :data:`ROWS` rows only (still bit for bit, for every row count);
    should those disagree, it is searched for as the first was."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    if not compiled.available():
        return None
    rows = min(PROBED, max(16, -(-PROBED // weight.shape[0])))
    probe = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0))
    key = (*weight.shape, bias is not None, torch.get_num_threads())
    with torch.inference_mode():
        expected = product(probe)  # of many rows: the product a tiled row stands in for
        laid = tile(weight, BLOCKS[0])
        known = _matched.get(key)
        if known is not None:
            tiles = Tiles(laid.tiles, laid.out_features, known)
            if all(_agrees(probe[:ROWS], expected[:ROWS], tiles, bias, r) for r in range(1, ROWS + 1)):
                return tiles
        for block in BLOCKS if weight.shape[1] > min(BLOCKS) else BLOCKS[:1]:
            tiles = Tiles(laid.tiles, laid.out_features, block)
            if all(_agrees(probe, expected, tiles, bias, r) for r in range(1, ROWS + 1)):
                _matched[key] = block
                return tiles
    return None


#: The block :func:`tile_like` matched, by (N, K, with a bias, torch's thread count).
_matched: dict[tuple[int, int, bool, int], int] = {}


#: The fewest output values :func:`tile_like` compares for each row count.
PROBED = 4096


def _agrees(
    probe: torch.Tensor, expected: torch.Tensor, tiles: Tiles, bias: torch.Tensor | None, rows: int
) -> bool:
    """Every ``rows`` rows of ``probe`` multiplied from ``tiles`` are ``expected``'s, bit for bit."""
    for start in range(0, probe.shape[0] - rows + 1, rows):
        got = tiled_product(probe[start : start + rows], tiles, bias)
        if got is None or not torch.equal(got, expected[start : start + rows]):
            return False
    return True


class Tiled:
    """:func:`tiled_product` as a row kernel of :mod:`..models.packed_linear`: for a float32 weight
    it keeps the weight's :class:`Tiles` (:func:`tile_like` the product it stands in for). It takes
    products of up to ``rows`` rows (at most :data:`ROWS`; an engine lowers it where oneDNN
    measures faster)."""

    def __init__(self, rows: int = ROWS) -> None:
        self.rows = rows

    def prepare(
        self, weight: torch.Tensor, bias: torch.Tensor | None, product: Callable[[torch.Tensor], torch.Tensor]
    ) -> Tiles | None:
        return tile_like(weight, bias, product)

    def __call__(self, x: torch.Tensor, tiles: Tiles, bias: torch.Tensor | None) -> torch.Tensor | None:
        if x.numel() > self.rows * x.shape[-1]:
            return None
        return tiled_product(x, tiles, bias)


#: A float32 row kernel taking all it can (an engine makes its own, to lower its rows).
TILED = Tiled()
