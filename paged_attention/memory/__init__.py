"""KV memory: where the keys and values live, and who owns which block.

    allocator      the O(1) free queue of blocks, with reference counts
    page_table     one sequence's logical -> physical block map: slots, fork, copy-on-write
    prefix_cache   the block-hash chain and the hash -> block map, LRU eviction
    kv_cache       the KV tensors, bytes per token, a memory budget -> a number of blocks
    manager        the KVCacheManager protocol: all the scheduler and engine may ask of memory
    paged_manager  the paged implementation (watermark, fork, swap, prefix caching)
    accounting     memory reports: tokens, reserved, fragmentation, free

Nothing here knows about sampling or scheduling (a model's config only to size the KV cache): a
sequence is seen only through the :class:`~.manager.CachedSequence` protocol.
"""
