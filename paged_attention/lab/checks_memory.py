"""Checks of the memory exercises: KV bytes, the free queue, slot mapping, copy-on-write, hashes."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from ..engine.kv_cache import KVCacheSpec
from ..memory.allocator import BlockAllocator, FreeBlockQueue, KVCacheBlock
from ..memory.page_table import PageTable
from ..memory.prefix_cache import extend_block_hashes
from .checking import CheckFailed, expect

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def _cases(thorough: bool, quick: int = 60, more: int = 400) -> int:
    return more if thorough else quick


def kv_bytes(kv_bytes_per_token: Callable[[int, int, int, int], int], thorough: bool = False) -> int:
    """``kv_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value)`` vs KVCacheSpec."""
    rng = random.Random(1)
    known = [
        (40, 40, 128, 2, "OPT-13B in fp16"),
        (32, 8, 128, 2, "Llama-3-8B (GQA)"),
        (30, 3, 64, 4, "SmolLM2 fp32"),
    ]
    cases = [(a, b, c, d, n) for a, b, c, d, n in known]
    for _ in range(_cases(thorough)):
        dtype = rng.choice(DTYPES)
        cases.append(
            (
                rng.randint(1, 96),
                rng.randint(1, 64),
                rng.choice((32, 64, 80, 96, 128, 256)),
                dtype.itemsize,
                f"{dtype}",
            )
        )
    for layers, heads, dim, size, name in cases:
        dtype = next(d for d in DTYPES if d.itemsize == size)
        expected = KVCacheSpec(layers, heads, dim, dtype).bytes_per_token
        got = kv_bytes_per_token(layers, heads, dim, size)
        hint = "a token stores a key AND a value per KV head per layer" if got * 2 == expected else ""
        expect(
            f"{layers} layers, {heads} KV heads of {dim}, {size}-byte values ({name})", expected, got, hint
        )
    return len(cases)


def _queue_ops(rng: random.Random, n: int, steps: int) -> list[tuple[str, int]]:
    inside, outside, ops = list(range(n)), [], []
    for _ in range(steps):
        choice = rng.random()
        if inside and choice < 0.35:
            ops.append(("popleft", 0))
            outside.append(inside.pop(0))
        elif inside and choice < 0.7:
            block = rng.choice(inside)
            ops.append(("remove", block))
            inside.remove(block)
            outside.append(block)
        elif outside:
            block = outside.pop(rng.randrange(len(outside)))
            ops.append(("append", block))
            inside.append(block)
    return ops


def free_queue(FreeQueue: type, thorough: bool = False) -> int:
    """``FreeQueue(blocks)`` with ``popleft``, ``remove(block)``, ``append(block)``, ``len`` and
    iteration, replayed against :class:`FreeBlockQueue`; then removal from the middle timed at two
    sizes, which a queue that scans (a Python list) cannot pass."""
    rng = random.Random(2)
    runs = [1, 2, 3] + [rng.randint(1, 12) for _ in range(_cases(thorough, 40, 200))]
    for n in runs:
        ours_blocks = [KVCacheBlock(i) for i in range(n)]
        theirs_blocks = [KVCacheBlock(i) for i in range(n)]
        ours, theirs = FreeBlockQueue(ours_blocks), FreeQueue(theirs_blocks)
        history = [f"FreeQueue(blocks {list(range(n))})"]
        expect(history[0] + ": len", len(ours), len(theirs))
        for op, block in _queue_ops(rng, n, 3 * n + 2):
            if op == "popleft":
                got, want = theirs.popleft(), ours.popleft()
                history.append("popleft()")
                expect("; ".join(history) + ": block returned", want.block_id, getattr(got, "block_id", got))
            else:
                getattr(ours, op)(ours_blocks[block])
                getattr(theirs, op)(theirs_blocks[block])
                history.append(f"{op}(block {block})")
            where = "; ".join(history[-8:])
            expect(f"after {where}: len", len(ours), len(theirs))
            expect(
                f"after {where}: order front to back",
                [b.block_id for b in ours],
                [b.block_id for b in theirs],
            )
        if len(theirs) == 0:
            try:
                theirs.popleft()
            except IndexError:
                pass
            else:
                raise CheckFailed("popleft() on an empty queue", "IndexError", "no error")
    _check_constant_time(FreeQueue)
    return len(runs) + 1


def _check_constant_time(FreeQueue: type) -> None:
    def cost(n: int) -> float:
        blocks = [KVCacheBlock(i) for i in range(n)]
        queue = FreeQueue(blocks)
        middle = blocks[n // 4 : n // 4 + 200]
        start = time.perf_counter()
        for block in middle:
            queue.remove(block)
            queue.append(block)
        return time.perf_counter() - start

    small, large = min(cost(2_000) for _ in range(3)), min(cost(200_000) for _ in range(3))
    if large > 20 * small + 1e-3:
        raise CheckFailed(
            f"remove + append of 200 blocks from the middle took {large / small:.0f}x longer with 200,000 "
            "blocks than with 2,000",
            hint="each operation must touch a fixed number of links, never scan the queue",
        )


def slot_mapping(
    slot_mapping: Callable[[list[int], int, int, int], list[int]], thorough: bool = False
) -> int:
    """``slot_mapping(block_ids, block_size, start, num_tokens)`` vs :meth:`PageTable.slot`."""
    rng = random.Random(3)
    cases = [(4, 0, 6), (4, 3, 2), (16, 15, 1), (16, 16, 1), (3, 0, 7)]
    cases += [(rng.randint(1, 32), rng.randint(0, 60), rng.randint(1, 40)) for _ in range(_cases(thorough))]
    for block_size, start, num_tokens in cases:
        allocator = _shuffled_allocator(rng, 8 + (start + num_tokens) // block_size)
        table = PageTable(allocator, block_size)
        table.append_tokens(start + num_tokens)
        expected = [table.slot(p) for p in range(start, start + num_tokens)]
        got = slot_mapping(list(table.block_ids), block_size, start, num_tokens)
        positions = f"positions {start}..{start + num_tokens - 1}"
        expect(
            f"block_ids={table.block_ids}, block_size={block_size}, {positions}",
            expected,
            list(got) if got is not None else None,
        )
    return len(cases)


def _shuffled_allocator(rng: random.Random, num_blocks: int) -> BlockAllocator:
    """An allocator whose free queue is in random order, so tables get blocks like 5, 0, 7, ..."""
    allocator = BlockAllocator(num_blocks)
    taken = allocator.allocate_many(num_blocks)
    for block_id in rng.sample(taken, len(taken)):
        allocator.free(block_id)
    return allocator


def copy_on_write(
    copy_on_write: Callable[[list[int], int, int, BlockAllocator], tuple[int, int] | None],
    thorough: bool = False,
) -> int:
    """``copy_on_write(block_ids, num_tokens, block_size, allocator)``, called before token
    ``num_tokens`` is written, vs what :meth:`PageTable.append_tokens` does: the same returned copy
    ``(src, dst)`` or None, the same block ids after, the same reference count of every block."""
    rng = random.Random(4)
    cases = [(4, 6, 1), (4, 8, 1), (4, 6, 2), (4, 6, 0), (1, 3, 1), (16, 22, 1), (16, 22, 3)]
    cases += [(rng.randint(1, 16), rng.randint(1, 60), rng.randint(0, 3)) for _ in range(_cases(thorough))]
    for block_size, num_tokens, forks in cases:
        seed = rng.random()
        setups = []
        for _ in range(2):  # two identical worlds: the package acts in one, the student in the other
            world = random.Random(seed)
            allocator = _shuffled_allocator(world, 4 + 2 * (num_tokens // block_size + 1) * (forks + 1))
            table = PageTable(allocator, block_size)
            table.append_tokens(num_tokens)
            children = [table.fork() for _ in range(forks)]
            setups.append((allocator, table, children))
        (ours_alloc, ours, _), (theirs_alloc, theirs, _) = setups
        owners = ours_alloc.ref_count(ours.block_ids[-1])
        case = (
            f"block_size={block_size}, {num_tokens} tokens in blocks {ours.block_ids}, last block held by"
            f" "
            f"{owners} table(s), next write at position {num_tokens}"
        )
        expected = None
        if ours.needs_copy_on_write():  # then appending one token copies and takes no other block
            copy = ours.append_tokens(1).copy
            expected = (copy.src, copy.dst)
        ids = list(theirs.block_ids)
        got = copy_on_write(ids, num_tokens, block_size, theirs_alloc)
        got = tuple(got) if got is not None else None
        hint = "copy only a partly filled last block that another table shares"
        expect(case + ": the copy returned", expected, got, hint)
        expect(case + ": block ids after", list(ours.block_ids), ids)
        blocks = range(ours_alloc.num_blocks)
        counts = {b: ours_alloc.ref_count(b) for b in blocks if ours_alloc.ref_count(b)}
        got_counts = {b: theirs_alloc.ref_count(b) for b in blocks if theirs_alloc.ref_count(b)}
        hint = "the table must drop its reference to the shared block (allocator.free)"
        expect(case + ": {block: ref count} after", counts, got_counts, hint)
    return len(cases)


def block_hashes(block_hashes: Callable[..., list[bytes]], thorough: bool = False) -> int:
    """``block_hashes(token_ids, block_size, cache_salt=None)`` vs :func:`extend_block_hashes`."""
    rng = random.Random(5)
    cases: list[tuple[list[int], int, str | None]] = [
        ([1, 2, 3, 4, 1, 2, 3, 4], 4, None),  # two equal blocks: different hashes (different prefixes)
        ([1, 2, 3, 4, 5], 4, None),  # a partial block is not hashed
        ([7, 7, 7], 4, None),
        ([1, 2, 3, 4, 5, 6, 7, 8], 4, "tenant-a"),
        ([], 4, None),
    ]
    for _ in range(_cases(thorough, 40, 200)):
        block_size = rng.randint(1, 8)
        tokens = [rng.randint(0, 9) for _ in range(rng.randint(0, 5 * block_size + 3))]
        cases.append((tokens, block_size, rng.choice((None, None, "salt"))))
    for tokens, block_size, salt in cases:
        expected = extend_block_hashes([], tokens, block_size, salt)
        got = block_hashes(tokens, block_size, salt) if salt is not None else block_hashes(tokens, block_size)
        case = f"token_ids={tokens}, block_size={block_size}" + (f", cache_salt={salt!r}" if salt else "")
        if got is None or len(got) != len(expected):
            raise CheckFailed(
                case + ": number of hashes",
                len(expected),
                None if got is None else len(got),
                "one hash per FULL block",
            )
        for index, (want, have) in enumerate(zip(expected, got, strict=True)):
            expect(
                f"{case}: hash of block {index}",
                want.hex()[:12],
                bytes(have).hex()[:12],
                "block i's parent is block i-1's hash (None for block 0); the salt is an extra key of "
                "block 0 only: extra_keys=(cache_salt,)",
            )
    return len(cases)
