"""How big one token's KV state is, and how many blocks a memory budget buys: arithmetic, no tensors.

Every layer of a transformer keeps, for every token it has seen, one key and one value vector per
KV head, so one token costs ``2 x num_layers x num_kv_heads x head_dim x bytes per element``.
:class:`~paged_attention.engine.worker.kv_cache.KVCacheSpec` reads those numbers off a model's config and
the element size off its dtype; the bookkeeping below needs only the integers.
"""

from __future__ import annotations

from .._checks import check_int, check_positive_int


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes of KV cache one token occupies: K and V, in every layer, for every KV head."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("element_size", element_size)):  # fmt: skip
        check_positive_int(name, value)
    return 2 * num_layers * num_kv_heads * head_dim * element_size


def scale_bytes_per_block(num_layers: int, num_kv_heads: int, scale_size: int = 4) -> int:
    """Bytes of scales one block of a cache quantized per block and KV head carries (int8): one
    float32 for K and one for V, per KV head, in every layer, whatever the block size."""
    return (
        2
        * check_positive_int("num_layers", num_layers)
        * check_positive_int("num_kv_heads", num_kv_heads)
        * (scale_size)
    )


def num_blocks_for_budget(
    budget_bytes: int, bytes_per_token: int, block_size: int, scale_bytes: int = 0
) -> int:
    """How many whole blocks of ``block_size`` tokens (and ``scale_bytes`` of scales each, for a
    cache quantized per block) fit in ``budget_bytes``; at least one, or a ``ValueError`` that says
    what one block needs."""
    check_int("budget_bytes", budget_bytes, minimum=0)
    block_bytes = check_positive_int("bytes_per_token", bytes_per_token) * check_positive_int(
        "block_size", block_size
    ) + check_int("scale_bytes", scale_bytes, minimum=0)
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"budget_bytes={budget_bytes} holds no block: one block of {block_size} tokens "
            f"needs {block_bytes} bytes"
        )
    return num_blocks
