"""The physical block allocator: who owns which KV-cache block, in O(1) per operation.

PagedAttention cuts the KV cache into fixed-size *blocks* (pages) of ``block_size`` token slots.
The allocator knows nothing about tokens or sequences; it hands out block ids and takes them back.
Three ideas carry the whole design:

1. **A free queue.** Free blocks wait in a queue. ``allocate`` pops from the front, ``free`` appends
   to the back, so the block freed longest ago is reused first. That order does not matter yet,
   but with prefix caching (:mod:`.prefix_cache`) a freed block still holds valid keys and values, and
   reusing the *least recently freed* block first is exactly LRU eviction.

2. **A doubly linked list, not a Python list.** Prefix caching also needs to pull a block *out of
   the middle* of the queue when a new request hits its cached contents. ``list.remove`` and
   ``collections.deque.remove`` are O(n) scans; with a million blocks that is a million comparisons
   per cache hit. Each block therefore carries ``prev_free``/``next_free`` pointers, and removal is
   four pointer writes (vLLM v1's ``FreeKVCacheBlockQueue`` does the same).

3. **Reference counts.** A block may be shared: parallel samples and beams fork a sequence and
   point at the same prompt blocks. ``share`` adds a reference, ``free`` drops one, and the block
   returns to the free queue only when the last reference is gone.

Running out of blocks is not a bug but the normal signal of memory pressure: it raises
:class:`NoFreeBlocksError`, which the scheduler catches to preempt a sequence.

**Transactions.** An engine step must be undoable (a step is a transaction: if anything raises,
the engine is put back exactly as it was). Between :meth:`BlockAllocator.begin` and
:meth:`~BlockAllocator.commit`, every change writes its inverse into an *undo log* (a database's
rollback journal): :meth:`~BlockAllocator.rollback` replays it backwards and restores the free
queue's order and every reference count in O(changes), however many blocks the cache has. The
allocator also notes which blocks it handed out that *held data* when the transaction began (freed
during it, by a preemption say): the engine saves their contents before the step writes into them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .._checks import check_int, check_positive_int


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than the free queue holds.

    Nothing has been allocated when it is raised: allocations are all-or-nothing.
    """

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"asked for {requested} block(s) but only {available} are free")
        self.requested = requested
        self.available = available


class KVCacheBlock:
    """Book-keeping for one physical block: its id, its reference count and its free-queue links.

    ``__slots__`` keeps a million of these small (about 80 bytes each) and attribute access fast.
    """

    __slots__ = ("block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """A doubly linked list of free blocks with O(1) ``popleft``, ``append`` and ``remove``.

    Two sentinel nodes (``head`` and ``tail``) sit at the ends so that no operation needs an
    "is the list empty?" special case: every real block always has a neighbour on both sides.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.num_free_blocks = len(blocks)
        previous = self.head
        for block in blocks:
            previous.next_free = block
            block.prev_free = previous
            previous = block
        previous.next_free = self.tail
        self.tail.prev_free = previous

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block at the front (the one freed longest ago)."""
        block = self.head.next_free
        if block is self.tail or block is None:
            raise IndexError("pop from an empty free-block queue")
        nxt = block.next_free
        self.head.next_free = nxt
        nxt.prev_free = self.head  # type: ignore[union-attr]
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it sits in the queue: four pointer writes, no scan."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        """Link ``block`` right behind ``prev`` (a block in the queue or the head sentinel)."""
        nxt = prev.next_free
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block  # type: ignore[union-attr]
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back of the queue (it will be reused last)."""
        last = self.tail.prev_free
        last.next_free = block  # type: ignore[union-attr]
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Walk the queue front to back (O(n); for tests, pictures and debugging only)."""
        block = self.head.next_free
        while block is not self.tail and block is not None:
            yield block
            block = block.next_free


class BlockAllocator:
    """Hands out the ids ``0 .. num_blocks-1`` of physical KV-cache blocks, with reference counts.

    >>> alloc = BlockAllocator(4)
    >>> a = alloc.allocate(); alloc.share(a); alloc.ref_count(a)
    2
    >>> alloc.free(a); alloc.free(a); alloc.num_free_blocks
    4
    """

    def __init__(self, num_blocks: int) -> None:
        check_positive_int("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._undo: list[tuple[Callable[..., Any], tuple]] | None = None  # open transaction's log
        self._freed: set[int] = set()  # blocks whose last owner let go during the transaction
        self._reused: list[int] = []  # blocks handed out again that held data when it began

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, between 0.0 and 1.0."""
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        """How many owners (page tables) hold ``block_id``; 0 means it is free."""
        return self._block(block_id, "ref_count").ref_cnt

    def is_free(self, block_id: int) -> bool:
        return self._block(block_id, "is_free").ref_cnt == 0

    def free_block_ids(self) -> list[int]:
        """The free queue front to back (O(n), for pictures and tests)."""
        return [block.block_id for block in self.free_queue]

    # -- operations ------------------------------------------------------------------------------
    def allocate(self) -> int:
        """Take the block at the front of the free queue; its reference count becomes 1."""
        queue = self.free_queue
        if queue.num_free_blocks == 0:
            raise NoFreeBlocksError(1, 0)
        block = queue.popleft()
        block.ref_cnt = 1
        if self._undo is not None:
            self._undo.append((self._unpop, (block,)))
            if block.block_id in self._freed:
                self._reused.append(block.block_id)
        return block.block_id

    def allocate_many(self, n: int) -> list[int]:
        """Allocate ``n`` blocks at once, all or nothing."""
        check_positive_int("n", n)
        if n > self.free_queue.num_free_blocks:
            raise NoFreeBlocksError(n, self.free_queue.num_free_blocks)
        return [self.allocate() for _ in range(n)]

    def share(self, block_id: int) -> None:
        """Add an owner to a block that is in use (a fork shares its parent's blocks)."""
        block = self._block(block_id, "share")
        if block.ref_cnt == 0:
            raise ValueError(
                f"share(block {block_id}): block {block_id} is free; only an allocated block can be shared"
            )
        self._log_ref(block)
        block.ref_cnt += 1

    def touch(self, block_id: int) -> None:
        """Add an owner to a block, taking it back out of the free queue if it was free.

        This is the prefix-cache hit path: a freed block whose contents are still valid is pulled
        from the middle of the free queue in O(1) and used again without recomputing it.
        """
        block = self._block(block_id, "touch")
        if block.ref_cnt == 0:
            if self._undo is not None:
                self._undo.append((self.free_queue.insert_after, (block.prev_free, block)))
            self.free_queue.remove(block)
        self._log_ref(block)
        block.ref_cnt += 1

    def free(self, block_id: int) -> None:
        """Drop one owner; when none is left the block goes to the back of the free queue."""
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks:
            self._block(block_id, "free")  # raises the right TypeError/ValueError
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            raise ValueError(
                f"free(block {block_id}): block {block_id} is already free (double free); "
                "every allocate() or share() must be matched by exactly one free()"
            )
        self._log_ref(block)
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue.append(block)
            if self._undo is not None:
                self._undo.append((self.free_queue.remove, (block,)))
                self._freed.add(block_id)

    # -- transactions (see the module docstring) -------------------------------------------------
    def begin(self) -> None:
        """Start a transaction: from now on every change is logged, to be committed or rolled back."""
        self._undo, self._freed, self._reused = [], set(), []

    def commit(self) -> None:
        """Keep every change since :meth:`begin` and stop logging."""
        self._undo, self._freed, self._reused = None, set(), []

    def rollback(self) -> None:
        """Undo every change since :meth:`begin`, newest first, and stop logging."""
        undo, self._undo = self._undo, None
        for undo_one, args in reversed(undo or []):
            undo_one(*args)
        self._freed, self._reused = set(), []

    def reused_blocks(self) -> list[int]:
        """Blocks handed out since :meth:`begin` whose contents were someone's when it began: their
        K/V must be saved before the step writes into them, to be restored on a rollback."""
        return list(self._reused)

    def _log_ref(self, block: KVCacheBlock) -> None:
        if self._undo is not None:
            self._undo.append((setattr, (block, "ref_cnt", block.ref_cnt)))

    def _unpop(self, block: KVCacheBlock) -> None:
        block.ref_cnt = 0
        self.free_queue.insert_after(self.free_queue.head, block)

    def _block(self, block_id: int, op: str) -> KVCacheBlock:
        check_int("block_id", block_id)
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(
                f"{op}(block {block_id}): unknown block id; "
                f"this allocator owns blocks 0..{self.num_blocks - 1}"
            )
        return self.blocks[block_id]

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, free={self.num_free_blocks})"
