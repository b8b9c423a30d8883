"""Automatic prefix caching: find a block again by its *contents*, and reuse it instead of recomputing.

Many requests begin with the same tokens: a system prompt, the same few-shot examples, the prompt
of a conversation's previous turn. Their keys and values are the same too (causal attention: a
token's K/V depend only on the tokens up to it), so a block computed once can serve every later
request that starts the same way. Three ideas make that automatic (vLLM v1's design):

1. **A hash chain names a full block by everything before it.** Block ``i`` of a sequence gets

       hash_i = H(hash_{i-1}, token ids of block i, extra keys)

   so equal hashes mean equal *prefixes*, not just equal blocks: the same 16 tokens after a
   different beginning have different keys and values, and a different hash. Only full blocks are
   hashed (a partly filled block still changes). ``extra_keys`` carry whatever else the K/V depend
   on; here a per-request ``cache_salt`` (vLLM's name), so that tenants who must not see each
   other's cache never share blocks. H is SHA-256 of the pickled triple: a 64-bit hash would
   collide once in a few billion blocks, and a collision would silently serve someone else's K/V.

2. **A hash-to-block map.** When a block fills up, it is entered in ``cached_blocks``. A new request
   walks its own hash chain through the map; the longest run of hits is its cached prefix.

3. **Freed blocks stay cached until their memory is needed.** A freed block goes to the back of
   the free queue *with its contents and its hash*. A hit pulls it out of the middle of the queue
   (O(1): the queue is a doubly linked list) and takes it back. Only when :meth:`allocate` pops a
   block from the front for new contents is its hash forgotten: eviction, and since the front holds
   the block freed longest ago, eviction is LRU. A request frees its blocks last-to-first, so a
   prompt's tail is evicted before its beginning, the part most likely to be shared.

The allocator knows nothing about tokens: callers compute hashes (:func:`hash_block_tokens`, kept on
the sequence as it grows) and the cache manager decides when a block is full and computed.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass

from .._checks import check_positive_int
from .allocator import BlockAllocator

BlockHash = bytes
"""A 32-byte SHA-256 digest naming one full block together with everything before it."""


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    """The hash of one full block: its parent's hash, its token ids and any extra keys.

    ``parent_hash`` is ``None`` for a sequence's first block. Every input goes through ``pickle``, so
    ``(parent, [1, 2], None)`` and ``(parent, [1], (2,))`` can never be confused.
    """
    payload = pickle.dumps((parent_hash, tuple(token_ids), extra_keys), protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.sha256(payload).digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """Append to ``hashes`` the hash of every full block of ``token_ids`` not hashed yet; returns it.

    Sequences only grow, so the chain is extended, never recomputed: each block is hashed once in
    its life. ``cache_salt`` is an extra key of the first block only; through the chain it reaches
    every later block.
    """
    check_positive_int("block_size", block_size)
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[index - 1] if index else None
        extra = (cache_salt,) if index == 0 and cache_salt is not None else None
        block = token_ids[index * block_size : (index + 1) * block_size]
        hashes.append(hash_block_tokens(parent, block, extra))
    return hashes


@dataclass
class PrefixCacheStats:
    """Prefix-cache hits and queries, counted in tokens at each admission (vLLM's ``PrefixCacheStats``).

    Admissions of preempted sequences (which mostly find their *own* blocks again) are counted
    apart, so that ``hit_rate`` measures sharing between requests.
    """

    requests: int = 0
    queries: int = 0  # tokens the admitted sequences needed K/V for
    hits: int = 0  # of which were found in the cache
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def misses(self) -> int:
        """Queried tokens (first admissions) that had to be computed."""
        return self.queries - self.hits

    @property
    def hit_rate(self) -> float:
        """Fraction of the queried tokens (first admissions) that were cache hits."""
        return self.hits / self.queries if self.queries else 0.0


class PrefixCachingBlockAllocator(BlockAllocator):
    """A :class:`BlockAllocator` whose full blocks can be found again by hash until they are evicted.

    >>> alloc = PrefixCachingBlockAllocator(2)
    >>> h = hash_block_tokens(None, [7, 8])
    >>> b = alloc.allocate(); alloc.cache_block(b, h); alloc.free(b)   # freed, but still cached
    >>> alloc.lookup([h]), alloc.num_free_blocks
    ([0], 2)
    >>> _ = alloc.allocate(), alloc.allocate()  # memory needed: block 0 is evicted
    >>> alloc.lookup([h])
    []
    """

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.cached_blocks: dict[BlockHash, int] = {}
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.num_evictions = 0

    # -- queries ---------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the longest prefix of ``hashes`` that is cached (changes nothing)."""
        blocks = []
        for block_hash in hashes:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that a hash can find, in use or free."""
        return len(self.cached_blocks)

    def num_cached_free_blocks(self) -> int:
        """Free blocks whose contents are still reusable (O(n); for pictures and tests)."""
        return sum(1 for b in self.free_queue if self.block_hashes[b.block_id] is not None)

    # -- operations ------------------------------------------------------------------------------
    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Make the full, computed, in-use block ``block_id`` findable under ``block_hash``.

        If another block already holds the same contents, or this block is already cached, nothing
        changes: one copy in the map is enough (the duplicate is simply not findable).
        """
        if self._block(block_id, "cache_block").ref_cnt == 0:
            raise ValueError(f"cache_block(block {block_id}): only a block in use can be cached")
        if not isinstance(block_hash, bytes):
            raise TypeError(f"block_hash must be bytes, got {type(block_hash).__name__}")
        if block_hash in self.cached_blocks or self.block_hashes[block_id] is not None:
            return
        self.cached_blocks[block_hash] = block_id
        self.block_hashes[block_id] = block_hash
        if self._undo is not None:
            self._undo.append((self._forget, (block_id, block_hash)))

    def allocate(self) -> int:
        """Pop the least recently freed block; if it was cached, its old contents are evicted now."""
        block_id = super().allocate()
        old_hash = self.block_hashes[block_id]
        if old_hash is not None:
            self._forget(block_id, old_hash)
            self.num_evictions += 1
            if self._undo is not None:  # it held cached K/V: a rollback brings them back
                self._undo.append((self._remember, (block_id, old_hash)))
                if block_id not in self._freed:
                    self._reused.append(block_id)
        return block_id

    def _forget(self, block_id: int, block_hash: BlockHash) -> None:
        del self.cached_blocks[block_hash]
        self.block_hashes[block_id] = None

    def _remember(self, block_id: int, block_hash: BlockHash) -> None:
        self.cached_blocks[block_hash] = block_id
        self.block_hashes[block_id] = block_hash
        self.num_evictions -= 1

    def reset(self) -> int:
        """Forget every cached block that is free (vLLM's ``reset_prefix_cache``); returns how many.

        Blocks in use keep their hashes: their owners are still computing with them.
        """
        forgotten = 0
        for block in self.free_queue:
            old_hash = self.block_hashes[block.block_id]
            if old_hash is not None:
                del self.cached_blocks[old_hash]
                self.block_hashes[block.block_id] = None
                forgotten += 1
        return forgotten

    def __repr__(self) -> str:
        return (
            f"PrefixCachingBlockAllocator(num_blocks={self.num_blocks}, free={self.num_free_blocks}, "
            f"cached={self.num_cached_blocks})"
        )
