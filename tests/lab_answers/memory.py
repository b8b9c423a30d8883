"""Answers written apart from the notebooks: one right and at least one plausibly wrong per exercise.

The right ones are deliberately written differently from the notebooks' solutions, so that the
checks are shown to accept any correct answer, not one text."""

from __future__ import annotations


def kv_bytes_right(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    per_layer = num_kv_heads * head_dim * bytes_per_value
    return sum(2 * per_layer for _ in range(num_layers))


def kv_bytes_wrong(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    return num_layers * num_kv_heads * head_dim * bytes_per_value  # forgets the values


class FreeQueueRight:
    """A doubly linked list with a single circular sentinel (the notebook uses two)."""

    def __init__(self, blocks):
        from paged_attention.memory.allocator import KVCacheBlock

        self.root = KVCacheBlock(-1)
        self.root.prev_free = self.root.next_free = self.root
        self.count = 0
        for block in blocks:
            self.append(block)

    def __len__(self):
        return self.count

    def append(self, block):
        last = self.root.prev_free
        block.prev_free, block.next_free = last, self.root
        last.next_free = self.root.prev_free = block
        self.count += 1

    def remove(self, block):
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.count -= 1

    def popleft(self):
        if self.count == 0:
            raise IndexError("empty")
        block = self.root.next_free
        self.remove(block)
        return block

    def __iter__(self):
        block = self.root.next_free
        while block is not self.root:
            yield block
            block = block.next_free


class FreeQueueKeepsLinks(FreeQueueRight):
    """Right order and length, but a block taken out keeps its old links (the hint says to clear them)."""

    def remove(self, block):
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        self.count -= 1


class FreeQueueScans(FreeQueueRight):
    """Right links, but remove walks from the front to find the block: O(n)."""

    def remove(self, block):
        node = self.root.next_free
        while node is not block:
            node = node.next_free
        super().remove(node)


class FreeQueueList:
    """Right answers, O(n) time: a Python list scans on remove and shifts on popleft."""

    def __init__(self, blocks):
        self.items = list(blocks)

    def __len__(self):
        return len(self.items)

    def append(self, block):
        self.items.append(block)

    def remove(self, block):
        self.items.remove(block)

    def popleft(self):
        return self.items.pop(0)

    def __iter__(self):
        return iter(list(self.items))


class FreeQueueStack(FreeQueueList):
    """Wrong order: reuses the most recently freed block first (a stack, not a queue)."""

    def popleft(self):
        return self.items.pop()


def slot_mapping_right(block_ids, block_size, start, num_tokens):
    out = []
    for position in range(start, start + num_tokens):
        block, offset = divmod(position, block_size)
        out.append(block_ids[block] * block_size + offset)
    return out


def slot_mapping_off_by_one(block_ids, block_size, start, num_tokens):
    return [
        block_ids[p // block_size] * block_size + p % block_size
        for p in range(start + 1, start + num_tokens + 1)
    ]


def slot_mapping_logical(block_ids, block_size, start, num_tokens):
    return list(range(start, start + num_tokens))  # ignores the page table


def copy_on_write_right(block_ids, num_tokens, block_size, allocator):
    if num_tokens % block_size == 0:
        return None
    last = block_ids[-1]
    if allocator.ref_count(last) == 1:
        return None
    fresh = allocator.allocate()
    allocator.free(last)
    block_ids[-1] = fresh
    return last, fresh


def copy_on_write_keeps_reference(block_ids, num_tokens, block_size, allocator):
    if num_tokens % block_size and allocator.ref_count(block_ids[-1]) > 1:
        fresh = allocator.allocate()
        old, block_ids[-1] = block_ids[-1], fresh  # forgets allocator.free(old)
        return old, fresh
    return None


def copy_on_write_full_blocks_too(block_ids, num_tokens, block_size, allocator):
    if allocator.ref_count(block_ids[-1]) > 1:  # copies a FULL shared block too
        fresh = allocator.allocate()
        allocator.free(block_ids[-1])
        old, block_ids[-1] = block_ids[-1], fresh
        return old, fresh
    return None


def block_hashes_right(token_ids, block_size, cache_salt=None):
    from paged_attention.memory.prefix_cache import hash_block_tokens

    hashes, parent = [], None
    full = len(token_ids) - len(token_ids) % block_size
    for index, begin in enumerate(range(0, full, block_size)):
        extra = (cache_salt,) if index == 0 and cache_salt is not None else None
        parent = hash_block_tokens(parent, token_ids[begin : begin + block_size], extra)
        hashes.append(parent)
    return hashes


def block_hashes_unchained(token_ids, block_size, cache_salt=None):
    from paged_attention.memory.prefix_cache import hash_block_tokens

    n = len(token_ids) // block_size
    extra = (cache_salt,) if cache_salt is not None else None
    return [
        hash_block_tokens(None, token_ids[i * block_size : (i + 1) * block_size], extra) for i in range(n)
    ]
