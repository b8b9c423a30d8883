"""One decode step's attention on a CPU: every layer's K/V store and attention in one compiled call.

:class:`DecodeStep` holds, as NumPy arrays made once per step, what every layer's call reads besides
its own query, keys and values: every layer's caches, the slot mapping, the block table and the
lengths. :func:`decode_layer` then stores one layer's new keys and values and attends over its
pages in one call into compiled code (one dispatch from Python instead of two, no per-layer views
to make), through the loop :func:`_decode_loop` picks once per step: the int8 loop
(:mod:`.loop_int8`), the AMX tiles (:mod:`.loop_amx`), the bfloat16 lanes (:mod:`.loop_bf16`) or
the loop nest (:mod:`.loop_nest`), as :func:`.compiled.paged_decode` picks for one call, so a
token gets the same bits either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from . import compiled, tiles
from .arrays import NOT_FP8 as _NOT_FP8
from .arrays import as_numpy
from .quantization import StoreMap


@dataclass(frozen=True)
class DecodeStep:
    """A decode step as :func:`decode_layer` reads it, made once per step for every layer (the
    compiled backend's per-step metadata): every layer's caches (and an int8 cache's scales) and
    the step's slot mapping, block table and lengths as NumPy arrays."""

    caches: np.ndarray  # [layers, 2, num_blocks, block_size, H_kv, D]: keys (0) and values (1)
    dtype: torch.dtype  # the caches' (bfloat16 arrives as its raw bits)
    slots: np.ndarray  # int64 [num_seqs]: where each sequence's new token's K/V go
    blocks: np.ndarray  # int64 [num_seqs, width]: the first cdiv(seq_lens[s], block_size) entries real
    seq_lens: np.ndarray  # int64 [num_seqs], each at least 1, the new token included
    scales: np.ndarray | None = None  # int8: float32 [layers, 2, num_blocks, H_kv]
    map_blocks: np.ndarray | None = None  # int8: the step's StoreMap
    map_tokens: np.ndarray | None = None
    #: The loop every layer of the step calls, by (query dtype, query heads): chosen at its first layer
    loops: dict[tuple[torch.dtype, int], Callable[..., None]] = field(default_factory=dict, compare=False)

    @classmethod
    def build(
        cls,
        caches: torch.Tensor,
        slot_mapping: torch.Tensor,
        blocks: torch.Tensor,
        seq_lens: torch.Tensor,
        scales: torch.Tensor | None = None,
        store_map: StoreMap | None = None,
    ) -> DecodeStep | None:
        """``None`` where the compiled kernel cannot read these caches (a dtype other than
        :data:`.compiled.DTYPES` or int8, not contiguous, or Numba unavailable in this process);
        ``scales``: an int8 cache's, every layer's."""
        int8 = caches.dtype == torch.int8 and scales is not None
        if (
            not compiled.available()
            or (caches.dtype not in compiled.DTYPES and not int8)
            or not caches.is_contiguous()
        ):
            return None

        def int64(t: torch.Tensor) -> np.ndarray:
            return t.to(torch.int64).contiguous().numpy()

        arrays = [as_numpy(caches), caches.dtype, int64(slot_mapping), int64(blocks), int64(seq_lens)]
        if not int8:
            return cls(*arrays)
        assert scales is not None
        plan = store_map or StoreMap.build(slot_mapping, caches.shape[3])
        return cls(*arrays, scales.numpy(), plan.blocks.numpy(), plan.tokens.numpy())


def decode_layer(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, step: DecodeStep, scale: float
) -> torch.Tensor | None:
    """:func:`.compiled.store_kv` then :func:`.compiled.paged_decode` for layer ``layer`` of ``step``
    in one compiled call (no checks: the caller validated): ``query[S, H, D]`` and ``key``/``value``
    ``[S, H_kv, D]`` may be strided views (their last dimension contiguous), as transformers hands
    them over; returns ``out[S, H, D]``. ``None`` when this call cannot take the compiled path
    (another dtype than the caches', Numba unavailable): the caller then makes the two calls apart."""
    int8 = step.scales is not None
    if (
        not compiled.available()
        or not query.dtype == key.dtype == value.dtype
        or query.dtype not in compiled.DTYPES
    ):
        return None
    if (
        query.stride(-1) != 1
        or key.stride(-1) != 1
        or value.stride(-1) != 1
        or not (int8 or query.dtype == step.dtype)
    ):
        return None
    out = query.new_empty(query.shape)
    try:
        loop = step.loops.get(key_ := (query.dtype, query.shape[1]))
        if loop is None:
            loop = step.loops[key_] = _decode_loop(step, *key_)
        loop(as_numpy(query.detach()), as_numpy(key.detach()), as_numpy(value.detach()), layer, scale,
             as_numpy(out))  # fmt: skip
    except Exception as error:
        compiled.give_up(error)
        return None
    return out


def _decode_loop(step: DecodeStep, dtype: torch.dtype, heads: int) -> Callable[..., None]:
    """``loop(q, k, v, layer, scale, out)`` for every layer of ``step`` (NumPy arrays): the int8
    loop, the AMX tiles' (where :func:`.tiles.rows` takes this query), the bfloat16 lanes (where
    :func:`.tiles.pairs` does) or the loop nest, with what it
    reads besides the layer's own arrays bound once for the step."""
    from . import loop_int8, loop_nest  # imported late: importing Numba costs half a second

    caches, slots, blocks, seq_lens = step.caches, step.slots, step.blocks, step.seq_lens
    if step.scales is not None:
        scales_, map_blocks, map_tokens = step.scales, step.map_blocks, step.map_tokens

        def int8(q, k, v, layer, scale, out):  # type: ignore[no-untyped-def]
            loop_int8.decode_layer_int8(q, k, v, caches, scales_, layer, map_blocks, map_tokens, blocks,
                                        seq_lens, scale, _NOT_FP8, out)  # fmt: skip

        return int8
    if tiles.rows(dtype, step.dtype, heads, caches.shape):
        from .loop_amx import decode_layer as on_tiles

        record = tiles.record(heads // caches.shape[4])

        def tiled(q, k, v, layer, scale, out):  # type: ignore[no-untyped-def]
            on_tiles(q, k, v, caches, layer, slots, blocks, seq_lens, scale, record, out)

        return tiled
    if tiles.pairs(dtype, step.dtype, caches.shape[-1], False):
        from .loop_bf16 import decode_layer as in_lanes

        def pairs(q, k, v, layer, scale, out):  # type: ignore[no-untyped-def]
            in_lanes(q, k, v, caches, layer, slots, blocks, seq_lens, scale, out)

        return pairs
    ones = np.lib.stride_tricks.as_strided(_ONE, caches.shape[2:5:2], (0, 0))

    def nest(q, k, v, layer, scale, out):  # type: ignore[no-untyped-def]
        loop_nest.decode_layer(q, k, v, caches, layer, slots, blocks, seq_lens, scale, ones, _NOT_FP8, out)

    return nest


_ONE = np.ones(1, np.float32)
