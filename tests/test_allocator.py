import pytest

from paged_attention.memory.allocator import BlockAllocator, FreeBlockQueue, KVCacheBlock, NoFreeBlocksError


def test_allocate_takes_blocks_in_free_queue_order_and_free_appends():
    alloc = BlockAllocator(4)
    assert [alloc.allocate() for _ in range(3)] == [0, 1, 2]
    alloc.free(1)
    alloc.free(0)
    assert alloc.free_block_ids() == [3, 1, 0]  # freed blocks join at the back
    assert alloc.allocate() == 3
    assert alloc.allocate() == 1


def test_counts_and_usage():
    alloc = BlockAllocator(8)
    assert (alloc.num_free_blocks, alloc.num_used_blocks, alloc.usage) == (8, 0, 0.0)
    ids = alloc.allocate_many(6)
    assert sorted(ids) == list(range(6))
    assert (alloc.num_free_blocks, alloc.num_used_blocks, alloc.usage) == (2, 6, 0.75)
    assert all(alloc.ref_count(b) == 1 for b in ids)
    assert not alloc.is_free(0) and alloc.is_free(7)


def test_share_keeps_block_until_last_owner_frees():
    alloc = BlockAllocator(2)
    b = alloc.allocate()
    alloc.share(b)
    alloc.share(b)
    assert alloc.ref_count(b) == 3
    alloc.free(b)
    alloc.free(b)
    assert not alloc.is_free(b) and alloc.num_free_blocks == 1
    alloc.free(b)
    assert alloc.is_free(b) and alloc.num_free_blocks == 2


def test_running_out_raises_dedicated_error_and_allocate_many_is_all_or_nothing():
    alloc = BlockAllocator(3)
    alloc.allocate()
    with pytest.raises(NoFreeBlocksError) as info:
        alloc.allocate_many(3)
    assert (info.value.requested, info.value.available) == (3, 2)
    assert alloc.num_free_blocks == 2  # nothing was taken
    alloc.allocate_many(2)
    with pytest.raises(NoFreeBlocksError, match="only 0 are free"):
        alloc.allocate()


def test_touch_pulls_a_free_block_out_of_the_middle_of_the_queue():
    alloc = BlockAllocator(5)
    alloc.touch(2)  # a prefix-cache hit on a free block
    assert alloc.ref_count(2) == 1
    assert alloc.free_block_ids() == [0, 1, 3, 4]
    alloc.touch(2)  # a hit on a block in use just adds an owner
    assert alloc.ref_count(2) == 2 and alloc.num_free_blocks == 4


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda a: a.free(0), ValueError, r"free\(block 0\).*already free \(double free\)"),
        (lambda a: a.free(9), ValueError, r"free\(block 9\): unknown block id.*blocks 0..3"),
        (lambda a: a.free(-1), ValueError, r"unknown block id"),
        (lambda a: a.free("3"), TypeError, r"block_id must be an int"),
        (lambda a: a.share(1), ValueError, r"share\(block 1\).*is free"),
        (lambda a: a.ref_count(4), ValueError, r"unknown block id"),
        (lambda a: a.allocate_many(0), ValueError, r"n must be a positive int, got 0"),
        (lambda a: a.allocate_many(-2), ValueError, r"n must be a positive int"),
    ],
)
def test_bad_input_names_the_block_and_the_rule(call, error, message):
    with pytest.raises(error, match=message):
        call(BlockAllocator(4))


@pytest.mark.parametrize(
    ("size", "error"), [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)]
)
def test_num_blocks_must_be_a_positive_int(size, error):
    with pytest.raises(error, match="num_blocks"):
        BlockAllocator(size)


def test_free_queue_remove_append_popleft_keep_links_consistent():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert [b.block_id for b in queue] == [1, 3] and len(queue) == 2
    queue.append(blocks[0])
    assert queue.popleft() is blocks[1]
    assert [b.block_id for b in queue] == [3, 0]
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
    queue.popleft()
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_operations_do_not_scan(monkeypatch):
    """O(1): the work per operation must not grow with the number of blocks.

    Count pointer-following steps instead of timing: iterating the queue is the only O(n) path,
    so forbid it while a large allocator serves a burst of operations.
    """
    alloc = BlockAllocator(200_000)

    def no_scan(self):
        raise AssertionError("an allocator operation walked the free queue")

    monkeypatch.setattr(FreeBlockQueue, "__iter__", no_scan)
    held = [alloc.allocate() for _ in range(1000)]
    for b in held[::2]:
        alloc.share(b)
    for b in held:
        alloc.free(b)
    alloc.touch(150_000)
    assert alloc.num_free_blocks == 200_000 - 500 - 1
