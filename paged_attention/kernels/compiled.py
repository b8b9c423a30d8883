"""The CPU fast path: decode attention that reads K and V through the block table, in place, compiled.

The eager recipe (:mod:`.reference`) copies every page of every sequence into a padded
``[num_seqs, max_len, kv_heads, dim]`` tensor and then runs attention over the copy: the very copy
PagedAttention exists to avoid. Here the same arithmetic is written as one short loop nest over
``(sequence, block column, slot, kv head, query head in the group)``, in which each key and value is
loaded *through* the block table (``key_cache[block_tables[s, w], t, h]``). Inductor, torch.compile's
CPU code generator, turns it into vectorized C++ whose loads are indirect: no gathered copy is ever
made, and the scores (``[num_seqs, width, block_size, kv_heads, group]``, small) are the only
intermediate.

The contract is :func:`.reference.paged_decode`'s. Scores, softmax and sums run in float32 whatever
the cache dtype (bfloat16 K/V are widened as they are loaded), and the result is cast back to the
query's dtype. Padding entries of the tables are never trusted: positions at or past ``seq_len``
get a score of -inf and a value of 0, so a cache holding NaN or garbage outside the sequences
cannot leak into the result.

Compilation: one graph per (dtype, heads, kv heads, head dim, block size), with the batch, the
table width and the cache's number of blocks dynamic, so that a growing batch never recompiles
(dynamo compiles a size of 1 apart: batch 1, and a table one block wide, are graphs of their own).
The first call in a process costs seconds (importing inductor, then compiling, or loading the
compiled code from inductor's on-disk cache, ``/tmp/torchinductor_$USER``); later calls cost a
guard check. Where compilation cannot run (no C++ compiler), the first call says so once with a
warning and every call falls back to the eager recipe, which gives the same numbers. A process that
meets more static shapes than :data:`RECOMPILE_LIMIT` (a test session cycling through models) gets a
warning once, and the shapes past the limit take the eager recipe; the ones compiled stay compiled.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch

_lock = threading.Lock()
_compiled: Callable[..., torch.Tensor] | None = None
_failed: str | None = None  # why compilation is unavailable in this process, once it has failed
_over_limit: set[tuple[object, ...]] = set()  # shapes refused by dynamo's recompile limit: eager from then on

#: Distinct static shapes one process may compile (dtype x heads x head dim x block size, and batch
#: sizes 1 and >1, which dynamo keeps apart); torch's default of 8 is short for a test session.
RECOMPILE_LIMIT = 64


def decode_in_place(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The loop nest that inductor compiles (it also runs eagerly, as a gather, for reading).

    ``query[S, H, D]``; caches ``[num_blocks, block_size, H_kv, D]``; ``blocks[S, W]`` int64, the
    first ``cdiv(seq_lens[s], block_size)`` entries of row ``s`` real block ids; ``seq_lens[S]``.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    width = blocks.shape[1]
    group = num_heads // num_kv_heads
    position = torch.arange(width * block_size, device=query.device).view(width, block_size)
    valid = position[None] < seq_lens[:, None, None]  # [S, W, BS]
    used = valid[:, :, 0]  # [S, W]: the block holds at least one of the sequence's tokens
    table = torch.where(used, blocks, 0)  # padding entries may hold anything: read block 0 instead
    keys = key_cache[table]  # [S, W, BS, H_kv, D]: under inductor a load, not a copy
    values = value_cache[table]
    q = query.view(num_seqs, 1, 1, num_kv_heads, group, head_dim).float()
    scores = (q * keys[..., None, :].float()).sum(-1) * scale  # [S, W, BS, H_kv, G]
    scores = scores.masked_fill(~valid[..., None, None], float("-inf"))
    weights = torch.exp(scores - scores.amax((1, 2), keepdim=True))
    total = weights.sum((1, 2))  # [S, H_kv, G]
    values = torch.where(valid[..., None, None], values.float(), 0.0)  # 0 * NaN would be NaN
    out = (weights[..., None] * values[..., None, :]).sum((1, 2)) / total[..., None]  # [S, H_kv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _compile() -> Callable[..., torch.Tensor] | None:
    global _compiled, _failed
    with _lock:
        if _compiled is None and _failed is None:
            import torch._dynamo

            config = torch._dynamo.config
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
            _compiled = torch.compile(decode_in_place, dynamic=False, fullgraph=True)
        return _compiled


def available() -> bool:
    """Whether this process can still use the compiled kernel (``False`` once compiling failed)."""
    return _failed is None


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`decode_in_place`, compiled (no checks: the caller validated the tables once)."""
    global _failed
    shape = _shape_key(query, key_cache, blocks)
    compiled = _compile() if _failed is None and shape not in _over_limit else None
    if compiled is None:
        return decode_in_place(query, key_cache, value_cache, blocks, seq_lens, scale)
    import torch._dynamo

    dynamic = ((query, (0,)), (key_cache, (0,)), (value_cache, (0,)), (blocks, (0, 1)), (seq_lens, (0,)))
    for tensor, dims in dynamic:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    try:
        return compiled(query, key_cache, value_cache, blocks, seq_lens, scale)
    except torch._dynamo.exc.FailOnRecompileLimitHit:  # one shape too many: this one stays eager
        with _lock:
            first = not _over_limit
            _over_limit.add(shape)
        if first:
            warnings.warn(
                f"the in-place CPU attention has compiled {RECOMPILE_LIMIT} shapes in this process, dynamo's "
                f"limit; new ones ({shape}) take the eager gather (same numbers, slower)",
                RuntimeWarning,
                stacklevel=2,
            )
        return decode_in_place(query, key_cache, value_cache, blocks, seq_lens, scale)
    except torch._dynamo.exc.BackendCompilerFailed as error:  # no C++ compiler, or an inductor limit
        with _lock:
            _failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        warnings.warn(
            f"compiling the in-place CPU attention failed ({_failed[:300]}); decode attention falls back "
            "to the eager gather (same numbers, slower). Pass attention_backend='torch' to choose it.",
            RuntimeWarning,
            stacklevel=2,
        )
        return decode_in_place(query, key_cache, value_cache, blocks, seq_lens, scale)


def _shape_key(query: torch.Tensor, key_cache: torch.Tensor, blocks: torch.Tensor) -> tuple[object, ...]:
    """What tells one compiled graph from another: the static sizes, a batch or table width of 1
    (dynamo specializes those), and the grad mode (a guard of its own)."""
    _, num_heads, head_dim = query.shape
    return (
        query.dtype,
        num_heads,
        key_cache.shape[2],
        head_dim,
        key_cache.shape[1],
        query.shape[0] == 1,
        blocks.shape[1] == 1,
        torch.is_grad_enabled(),
    )
