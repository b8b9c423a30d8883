"""KV memory's bookkeeping: who owns which block. No tensors here (not even torch): the K/V
themselves live in :mod:`paged_attention.engine.worker.kv_cache`, and the tensors the kernels read are
built in :mod:`paged_attention.kernels.layout`.

    allocator      the O(1) free queue of blocks, with reference counts and an undo log
    page_table     one sequence's logical -> physical block map: slots, fork, copy-on-write
    prefix_cache   the block-hash chain and the hash -> block map, LRU eviction
    sizes          bytes per token, a memory budget -> a number of blocks (arithmetic)
    manager        the KVCacheManager protocol: all the scheduler and engine may ask of memory
    paged_manager  the paged implementation (watermark, fork, swap, prefix caching)
    accounting     memory reports: tokens, reserved, fragmentation, free

Nothing here knows about sampling or scheduling: a sequence is seen only through the
:class:`~.manager.CachedSequence` protocol. A step of the engine is a transaction, and memory owns
its part of the undo (``begin``/``commit``/``rollback``): the allocator's log is O(changes), the
page tables' snapshots O(1) each.
"""
