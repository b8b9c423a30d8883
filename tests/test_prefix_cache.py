"""Automatic prefix caching: the hash chain, the hash-to-block map, LRU eviction, the cache manager.

The state machines at the bottom drive random programs; the second one stores, for every token,
a value that depends on the token *and everything before it* (as a real model's keys and values
do). A sequence that starts from cached blocks must read back exactly those values, so a wrong
hit, an eviction of a block in use or a missed copy-on-write shows up as a wrong number.
"""

import itertools
import random
from collections import Counter

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_attention.engine.sample.sampling import SamplingParams
from paged_attention.engine.sequence import Sequence
from paged_attention.engine.worker.kv_cache import KVCache, KVCacheSpec
from paged_attention.memory.allocator import NoFreeBlocksError
from paged_attention.memory.paged_manager import PagedKVCacheManager
from paged_attention.memory.prefix_cache import (
    PrefixCacheStats,
    PrefixCachingBlockAllocator,
    extend_block_hashes,
    hash_block_tokens,
)

tokens_st = st.lists(st.integers(0, 5), max_size=40)


# -- hashing ---------------------------------------------------------------------------------------
@given(tokens_st, tokens_st, st.integers(1, 6))
def test_equal_hashes_mean_equal_prefixes(a, b, block_size):
    ha, hb = extend_block_hashes([], a, block_size), extend_block_hashes([], b, block_size)
    assert len(ha) == len(a) // block_size  # a partly filled block is never hashed
    for i, (x, y) in enumerate(zip(ha, hb, strict=False)):
        assert (x == y) == (a[: (i + 1) * block_size] == b[: (i + 1) * block_size])


@given(tokens_st, st.integers(1, 6), st.data())
def test_the_chain_grows_incrementally(tokens, block_size, data):
    cut = data.draw(st.integers(0, len(tokens)))
    hashes = extend_block_hashes([], tokens[:cut], block_size)
    assert extend_block_hashes(hashes, tokens, block_size) == extend_block_hashes([], tokens, block_size)


@given(st.lists(st.integers(0, 5), min_size=4, max_size=20), st.text(max_size=3), st.text(max_size=3))
def test_a_cache_salt_separates_every_block(tokens, salt_a, salt_b):
    a = extend_block_hashes([], tokens, 2, salt_a)
    b = extend_block_hashes([], tokens, 2, salt_b)
    assert all((x == y) == (salt_a == salt_b) for x, y in zip(a, b, strict=True))
    assert extend_block_hashes([], tokens, 2, None) != a  # no salt differs from any salt, even ""


def test_extra_keys_and_parents_cannot_be_confused():
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1], (2,))
    parent = hash_block_tokens(None, [1])
    assert hash_block_tokens(parent, [2]) != hash_block_tokens(None, [2])
    assert len(parent) == 32 and isinstance(parent, bytes)


# -- the hash-to-block map and LRU eviction --------------------------------------------------------
def test_freed_cached_blocks_are_reused_until_evicted_least_recently_freed_first():
    alloc = PrefixCachingBlockAllocator(4)
    hashes = [hash_block_tokens(None, [i]) for i in range(4)]
    blocks = alloc.allocate_many(4)
    for b, h in zip(blocks, hashes, strict=True):
        alloc.cache_block(b, h)
    for b in (blocks[2], blocks[0], blocks[3], blocks[1]):  # free order = LRU order
        alloc.free(b)
    assert alloc.num_free_blocks == 4 and alloc.num_cached_free_blocks() == 4
    alloc.touch(alloc.lookup([hashes[0]])[0])  # a hit pulls block 0 out of the middle of the queue
    assert alloc.ref_count(blocks[0]) == 1 and alloc.free_block_ids() == [blocks[2], blocks[3], blocks[1]]
    assert alloc.allocate() == blocks[2]  # evicts the least recently freed
    assert alloc.lookup([hashes[2]]) == [] and alloc.num_evictions == 1
    assert alloc.lookup([hashes[3]]) == [blocks[3]]


def test_lookup_returns_the_longest_cached_prefix_only():
    alloc = PrefixCachingBlockAllocator(4)
    chain = extend_block_hashes([], [1, 2, 3, 4, 5, 6], 2)
    a, b, c = alloc.allocate_many(3)
    alloc.cache_block(a, chain[0])
    alloc.cache_block(c, chain[2])  # block 2 is cached but block 1 is not: the prefix stops at 1
    assert alloc.lookup(chain) == [a]
    alloc.cache_block(b, chain[1])
    assert alloc.lookup(chain) == [a, b, c]


def test_duplicate_contents_keep_one_cached_copy_and_bad_input_is_refused():
    alloc = PrefixCachingBlockAllocator(3)
    h = hash_block_tokens(None, [9])
    a, b = alloc.allocate_many(2)
    alloc.cache_block(a, h)
    alloc.cache_block(b, h)  # same contents computed twice: the first copy stays the one found
    assert alloc.lookup([h]) == [a] and alloc.block_hashes[b] is None
    with pytest.raises(ValueError, match="only a block in use"):
        alloc.cache_block(2, hash_block_tokens(None, [8]))
    with pytest.raises(TypeError, match="bytes"):
        alloc.cache_block(a, "not a hash")


def test_reset_forgets_free_cached_blocks_only():
    alloc = PrefixCachingBlockAllocator(3)
    h1, h2 = hash_block_tokens(None, [1]), hash_block_tokens(None, [2])
    a, b = alloc.allocate_many(2)
    alloc.cache_block(a, h1)
    alloc.cache_block(b, h2)
    alloc.free(a)
    assert alloc.reset() == 1
    assert alloc.lookup([h1]) == [] and alloc.lookup([h2]) == [b]


class EvictionMachine(RuleBasedStateMachine):
    """Random allocate / cache / free / hit programs against a plain-Python model of the LRU queue."""

    NUM_BLOCKS = 6

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PrefixCachingBlockAllocator(self.NUM_BLOCKS)
        self.held = Counter()  # block -> references we hold
        self.lru = list(range(self.NUM_BLOCKS))  # the model: free blocks, least recently freed first
        self.contents: dict[int, bytes] = {}  # the model: block -> hash of the contents it holds
        self.names = itertools.count()

    @rule()
    def allocate_and_cache(self):
        if not self.lru:
            with pytest.raises(NoFreeBlocksError):
                self.alloc.allocate()
            return
        block = self.alloc.allocate()
        assert block == self.lru.pop(0)  # the front of the queue: least recently freed
        if block in self.contents:
            event("evicted a cached block")
            assert self.alloc.lookup([self.contents.pop(block)]) == []
        h = hash_block_tokens(None, [next(self.names)])
        self.alloc.cache_block(block, h)
        self.contents[block] = h
        self.held[block] += 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        block = data.draw(st.sampled_from(sorted(self.held)))
        self.alloc.free(block)
        self.held[block] -= 1
        if not self.held[block]:
            del self.held[block]
            self.lru.append(block)

    @precondition(lambda self: self.contents)
    @rule(data=st.data())
    def hit(self, data):
        block = data.draw(st.sampled_from(sorted(self.contents)))
        assert self.alloc.lookup([self.contents[block]]) == [block]
        self.alloc.touch(block)
        if block in self.lru:
            event("hit a free cached block")
            self.lru.remove(block)
        self.held[block] += 1

    @invariant()
    def the_allocator_matches_the_model(self):
        assert self.alloc.free_block_ids() == self.lru
        assert {b: self.alloc.ref_count(b) for b in self.held} == dict(self.held)
        assert self.alloc.cached_blocks == {h: b for b, h in self.contents.items()}
        assert all(self.alloc.block_hashes[b] == self.contents.get(b) for b in range(self.NUM_BLOCKS))

    def teardown(self):
        for block, n in self.held.items():
            for _ in range(n):
                self.alloc.free(block)
        assert self.alloc.num_free_blocks == self.NUM_BLOCKS


TestEviction = EvictionMachine.TestCase


# -- the cache manager -----------------------------------------------------------------------------
def seq(seq_id, tokens, arrival=0.0, salt=None):
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    return Sequence(seq_id, str(seq_id), list(tokens), params, arrival, cache_salt=salt)


def admit(cache, s):
    """What the scheduler does: start from the cached prefix, allocate the rest, mark it computed."""
    s.num_computed_tokens = cache.lookup_prefix(s)
    n = s.num_uncomputed_tokens
    assert cache.can_admit(s, n)
    allocation = cache.allocate_slots(s, n)
    assert allocation is not None
    s.num_computed_tokens += n
    return allocation


def test_a_shared_prefix_is_found_and_its_last_token_is_always_recomputed():
    cache = PagedKVCacheManager(20, 4, watermark=0.0, enable_prefix_caching=True)
    a = seq(0, range(10))
    admit(cache, a)  # blocks 0-3, 4-7 full (cached), 8-9 partial
    b = seq(1, [*range(8), 50, 51])
    assert cache.lookup_prefix(b) == 8
    allocation = admit(cache, b)
    assert len(allocation.slot_mapping) == 2  # only tokens 8 and 9 are computed
    assert cache.block_table(1)[:2] == cache.block_table(0)[:2]
    assert cache.memory_report().shared_blocks == 2
    c = seq(2, range(8))  # the whole prompt is cached, but its last token needs logits
    assert cache.lookup_prefix(c) == 4
    assert cache.prefix_cache_stats == PrefixCacheStats(requests=2, queries=20, hits=8)
    assert cache.prefix_cache_stats.misses == 12 and cache.prefix_cache_stats.hit_rate == 0.4


def test_freed_blocks_stay_cached_and_a_preempted_sequence_finds_its_own_blocks():
    cache = PagedKVCacheManager(6, 4, watermark=0.0, enable_prefix_caching=True)
    a = seq(0, range(9))
    admit(cache, a)
    cache.free(0)  # preempted (or finished): the blocks are free but still hold its K/V
    assert cache.num_free_blocks == 6
    a.num_computed_tokens, a.num_preemptions = 0, 1
    admit(cache, a)
    assert cache.prefix_cache_stats.preempted_hits == 8 and cache.prefix_cache_stats.hits == 0


def test_memory_pressure_evicts_and_the_salt_isolates():
    cache = PagedKVCacheManager(4, 4, watermark=0.0, enable_prefix_caching=True)
    admit(cache, seq(0, range(9)))
    assert cache.lookup_prefix(seq(9, range(9), salt="tenant-b")) == 0
    cache.free(0)
    admit(cache, seq(1, range(100, 116)))  # needs all 4 blocks: every cached block is evicted
    assert cache.lookup_prefix(seq(2, range(9))) == 0
    assert cache.allocator.num_evictions == 2


def test_fork_shares_blocks_and_hashes_and_reset_clears_the_cache():
    cache = PagedKVCacheManager(10, 4, watermark=0.0, enable_prefix_caching=True)
    parent = seq(0, range(6))
    admit(cache, parent)
    child = seq(1, range(6))
    child.num_computed_tokens = 6
    cache.fork(parent, child)
    assert cache.block_table(1) == cache.block_table(0) and child.block_hashes == parent.block_hashes
    child.output_token_ids.append(7)
    allocation = cache.allocate_slots(child, 1)
    assert len(allocation.copies) == 1  # copy-on-write of the shared half-full block
    with pytest.raises(ValueError, match="holds no KV cache"):
        cache.fork(seq(5, [1]), seq(6, [1]))
    with pytest.raises(ValueError, match="copy of the parent"):
        cache.fork(parent, seq(7, range(3)))
    for s in (0, 1):
        cache.free(s)
    assert cache.reset_prefix_cache() == 1 and cache.lookup_prefix(seq(3, range(6))) == 0


def test_a_sequence_cannot_claim_computed_tokens_that_are_not_cached():
    cache = PagedKVCacheManager(10, 4, enable_prefix_caching=True)
    s = seq(0, range(10))
    s.num_computed_tokens = 4
    with pytest.raises(ValueError, match="cached prefix"):
        cache.allocate_slots(s, 1)


def test_without_prefix_caching_nothing_is_found():
    cache = PagedKVCacheManager(10, 4)
    admit(cache, seq(0, range(9)))
    assert cache.lookup_prefix(seq(1, range(9))) == 0
    assert cache.reset_prefix_cache() == 0 and cache.prefix_cache_stats == PrefixCacheStats()


class PrefixCachedMemoryMachine(RuleBasedStateMachine):
    """Sequences over a 3-letter alphabet (so prefixes repeat) admitted, grown, forked, preempted and
    freed at random over a small prefix-caching manager and a real KV cache. The value stored for
    position ``p`` is a function of ``tokens[: p + 1]``, like a model's K/V."""

    BLOCK_SIZE = 2
    NUM_BLOCKS = 10

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCacheManager(
            self.NUM_BLOCKS, self.BLOCK_SIZE, watermark=0.0, enable_prefix_caching=True
        )
        self.kv = KVCache(KVCacheSpec(1, 1, 1, torch.float64), self.NUM_BLOCKS, self.BLOCK_SIZE)
        self.live: dict[int, Sequence] = {}
        self.ids = itertools.count()

    @initialize(seed=st.integers(0, 2**16))
    def seed(self, seed):
        self.rng = random.Random(seed)

    @staticmethod
    def value(tokens: list[int], position: int) -> float:
        return float(hash(tuple(tokens[: position + 1])) % 1_000_003)

    def _compute(self, s: Sequence, n: int) -> bool:
        """Allocate and 'compute' ``n`` tokens of ``s`` (store their values); False if out of memory."""
        allocation = self.cache.allocate_slots(s, n)
        if allocation is None:
            return False
        if allocation.copies:
            event("copy-on-write")
            self.kv.copy_blocks(allocation.copies)
        start = s.num_computed_tokens
        values = torch.tensor([self.value(s.tokens, p) for p in range(start, start + n)], dtype=torch.float64)
        kv = values.view(n, 1, 1)
        self.kv.store(0, kv, -kv, torch.tensor(allocation.slot_mapping, dtype=torch.int64))
        s.num_computed_tokens += n
        return True

    @rule(length=st.integers(1, 9))
    def admit(self, length):
        prompt = [self.rng.randrange(3) for _ in range(length)]
        s = Sequence(next(self.ids), "r", prompt, SamplingParams(max_tokens=8), 0.0)
        s.num_computed_tokens = self.cache.lookup_prefix(s)
        if s.num_computed_tokens:
            event("prefix hit")
        if self._compute(s, s.num_uncomputed_tokens):
            self.live[s.seq_id] = s
        else:
            s.num_computed_tokens = 0
            assert s.seq_id not in self.cache.page_tables

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 3))
    def grow(self, data, n):
        s = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        s.output_token_ids += [self.rng.randrange(3) for _ in range(n)]
        if not self._compute(s, n):
            del s.output_token_ids[-n:]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = Sequence(next(self.ids), "r", parent.prompt_token_ids, parent.params, 0.0)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.cache.fork(parent, child)
        self.live[child.seq_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data(), readmit=st.booleans())
    def free(self, data, readmit):
        """Finish a sequence, or preempt it and admit it again (from whatever is still cached)."""
        s = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.cache.free(s.seq_id)
        if readmit:
            s.num_computed_tokens, s.num_preemptions = 0, s.num_preemptions + 1
            s.num_computed_tokens = self.cache.lookup_prefix(s)
            if self._compute(s, s.num_uncomputed_tokens):
                self.live[s.seq_id] = s

    @invariant()
    def every_sequence_reads_what_its_tokens_would_compute(self):
        keys = self.kv.key_cache(0).reshape(-1)
        for s in self.live.values():
            table = self.cache.page_tables[s.seq_id]
            assert table.num_tokens == s.num_computed_tokens == s.num_tokens
            slots = [table.slot(p) for p in range(s.num_tokens)]
            assert keys[slots].tolist() == [self.value(s.tokens, p) for p in range(s.num_tokens)]

    @invariant()
    def ref_counts_the_map_and_the_free_queue_agree(self):
        alloc = self.cache.allocator
        holders = Counter(b for t in self.cache.page_tables.values() for b in t.block_ids)
        assert all(alloc.ref_count(b) == holders[b] for b in range(self.NUM_BLOCKS))
        assert sorted(alloc.free_block_ids()) == [b for b in range(self.NUM_BLOCKS) if not holders[b]]
        assert all(alloc.block_hashes[b] == h for h, b in alloc.cached_blocks.items())
        assert len(alloc.cached_blocks) == sum(h is not None for h in alloc.block_hashes)
        self.cache.memory_report()  # counts every block in use exactly once, or raises

    def teardown(self):
        for seq_id in list(self.live):
            self.cache.free(seq_id)
        assert self.cache.num_free_blocks == self.NUM_BLOCKS
        assert not self.cache.page_tables


TestPrefixCachedMemory = PrefixCachedMemoryMachine.TestCase
