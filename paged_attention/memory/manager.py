"""The KV-cache manager: the only thing the scheduler asks about memory.

The scheduler never touches blocks. It asks a :class:`KVCacheManager` a few questions, in the
same words whatever the memory layout: *how much of this sequence is already cached*
(``lookup_prefix``), *may it start* (``can_admit``), *make room for ``n`` more tokens of it*
(``allocate_slots``, which may fail), and *it is done* (``free``). The engine adds *share this
sequence's pages with a copy* (``fork``) and the scheduler *move its pages to CPU memory and back*
(``swap_out``/``swap_in``). That interface is what lets the contiguous baselines
(:mod:`paged_attention.baselines`) run under the very same scheduler and engine, so that the
experiments compare memory managers and nothing else: a manager answers the questions it cannot
serve with "no" (``lookup_prefix`` 0, ``supports_fork`` and ``can_swap_out`` false), and nobody
asks which manager it is.

The manager knows a sequence only through :class:`CachedSequence`, the few fields it reads; the
engine's :class:`~paged_attention.engine.sequence.Sequence` is one.

The paged implementation is :class:`~.paged_manager.PagedKVCacheManager`; the contiguous ones
live in :mod:`paged_attention.baselines`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .accounting import MemoryReport
from .page_table import BlockCopy


class CachedSequence(Protocol):
    """What a KV-cache manager reads of a sequence (the engine's ``Sequence`` is one).

    ``block_hashes`` is the sequence's own list, which a prefix-caching manager extends in place
    (the hash chain of its full blocks, :mod:`.prefix_cache`), so that no block is hashed twice.
    """

    seq_id: int
    prompt_token_ids: list[int]
    num_computed_tokens: int  # tokens whose K/V are in the cache
    num_preemptions: int
    cache_salt: str | None
    block_hashes: list[bytes]

    @property
    def num_tokens(self) -> int: ...

    @property
    def max_total_tokens(self) -> int:
        """prompt + max_tokens: the most tokens it can ever hold."""
        ...

    @property
    def max_kv_tokens(self) -> int:
        """prompt + max_tokens - 1: the most tokens whose K/V it can ever store (the last token
        sampled ends the sequence and is never fed back through the model)."""
        ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


@dataclass(frozen=True)
class SlotAllocation:
    """Where one sequence's new tokens go this step, and block copies to perform first."""

    slot_mapping: list[int]
    copies: list[BlockCopy]


class KVCacheManager(Protocol):
    """What the scheduler and the engine may ask of KV memory (paged or contiguous alike).

    Geometry: the KV tensors hold ``num_blocks`` blocks of ``block_size`` slots (a contiguous
    manager counts single slots: ``block_size == 1``).
    """

    block_size: int
    num_blocks: int
    supports_fork: bool  # False: n samples run as unshared sequences, beam search is refused
    num_cpu_blocks: int  # swap space; 0: preemption can only recompute
    watermark_blocks: int  # blocks admission leaves free for running sequences to grow into

    def lookup_prefix(self, seq: CachedSequence) -> int:
        """How many leading tokens of ``seq`` the cache already holds (changes nothing).

        A multiple of ``block_size``, and always less than ``seq.num_tokens``: the last token must
        be computed to give logits. 0 for a manager without a prefix cache.
        """
        ...

    def num_free_prefix_blocks(self, seq: CachedSequence) -> int:
        """How many blocks of a waiting ``seq``'s prefix-cache hit sit in the free queue (cached, held
        by no one): admitting ``seq`` takes them out of it, so they cost free blocks as new ones do.
        0 without a prefix cache, without a hit, and for a sequence that holds memory already."""
        ...

    def can_admit(self, seq: CachedSequence, num_new_tokens: int) -> bool:
        """May ``seq`` start now with ``num_new_tokens`` tokens after its first ``seq.num_computed_tokens``?

        The whole sequence is passed, not just a count: a contiguous manager must know the prompt
        length and ``max_tokens`` to size its reservation, and a prefix cache looks at the tokens.
        """
        ...

    def allocate_slots(
        self, seq: CachedSequence, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> SlotAllocation | None:
        """Room for tokens ``seq.num_computed_tokens ..`` ``+ num_new_tokens - 1``; ``None`` (no change) if
        memory is short. For a sequence that holds no memory yet, its first ``num_computed_tokens``
        tokens must be the cached prefix that ``lookup_prefix`` reported.

        ``num_lookahead_tokens`` more slots follow for drafted tokens (speculative decoding, vLLM
        v1's name): they are written like the others but are not the sequence's tokens yet, so no
        block they fill is entered in a prefix cache; :meth:`truncate` forgets the rejected ones."""
        ...

    def reserve(self, seq: CachedSequence, num_new_tokens: int) -> bool:
        """Set aside now the memory for the ``num_new_tokens`` tokens that follow ``seq``'s allocated
        slots, without handing out their slots (the rest of a prompt computed in chunks: vLLM v0
        allocates a whole prompt's blocks at admission); later :meth:`allocate_slots` calls use it
        first. ``False`` (no change) if memory is short. A contiguous manager reserved it already."""
        ...

    def truncate(self, seq: CachedSequence, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` of ``seq``'s KV (the rejected drafts go): memory that
        held only the rest is released at once."""
        ...

    def free(self, seq_id: int) -> None:
        """Release everything ``seq_id`` holds (on the device and in swap space)."""
        ...

    def block_table(self, seq_id: int) -> list[int]:
        """Physical blocks of ``seq_id`` in logical order (what the kernels read)."""
        ...

    def fits_at_all(self, seq: CachedSequence) -> bool:
        """Could ``seq`` (grown to its longest) ever fit, with the cache otherwise empty?"""
        ...

    def unfit_reason(self, seq: CachedSequence) -> str:
        """Why ``fits_at_all(seq)`` is false, in this manager's own terms (for the error message)."""
        ...

    def fork(self, parent: CachedSequence, child: CachedSequence) -> None:
        """Give ``child`` (a copy of ``parent`` holding nothing yet) the parent's pages to share."""
        ...

    def can_swap_out(self, seq_id: int) -> bool: ...

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move ``seq_id``'s pages to CPU blocks; the ``(device block, cpu block)`` copies to do."""
        ...

    def can_swap_in(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        """May ``seq_id`` come back now, with ``num_new_tokens`` to compute before it samples?"""
        ...

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Bring ``seq_id``'s pages back; the ``(cpu block, device block)`` copies to do."""
        ...

    def begin(self) -> None:
        """An engine step begins: from here on, record enough to undo everything until
        :meth:`commit` or :meth:`rollback` (a step is a transaction), at a cost in what the step
        changes or in the sequences held, never in the blocks held."""
        ...

    def commit(self) -> None:
        """The step succeeded: keep its changes."""
        ...

    def rollback(self) -> None:
        """The step failed: put every table, allocator and cache entry back as at :meth:`begin`."""
        ...

    def reused_blocks(self) -> tuple[list[int], list[int]]:
        """``(device blocks, cpu blocks)`` handed out since :meth:`begin` whose contents were
        someone's when it began (freed by a preemption, an evicted prefix-cache block): the engine
        saves their K/V before the step writes, to restore them on a rollback."""
        ...

    def reset_prefix_cache(self) -> int:
        """Forget the cached contents of every free block; how many were forgotten."""
        ...

    def memory_report(self) -> MemoryReport: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def usage(self) -> float:
        """Share of the device blocks in use, 0..1."""
        ...
