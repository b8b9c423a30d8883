"""Checks of the memory exercises: KV bytes, the free queue, slot mapping, copy-on-write, hashes.

Each check draws its cases from ``seed`` (named cases first: the mistakes students make), reaches
the student's code only through drivers (:mod:`.student`) and compares what they report with the
package's own implementation.
"""

from __future__ import annotations

import random
from typing import Any

from .._checks import as_dtype
from ..memory.allocator import BlockAllocator, FreeBlockQueue, KVCacheBlock
from ..memory.page_table import PageTable
from ..memory.prefix_cache import extend_block_hashes
from .checking import CheckFailed, expect
from .student import Student, driver

DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn")  # 01.kv_bytes's, named: no torch here


def _cases(thorough: bool, quick: int = 60, more: int = 400) -> int:
    return more if thorough else quick


@driver
def call_function(state: dict, objects: tuple, *args: Any) -> Any:
    """The student's function (the exercise's one object) called on ``args``."""
    return objects[0](*args)


# -- 01.kv_bytes -----------------------------------------------------------------------------------


def kv_bytes(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``kv_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value)`` vs KVCacheSpec."""
    from ..engine.worker.kv_cache import KVCacheSpec  # and torch: the check's side only

    dtypes = [as_dtype(name) for name in DTYPES]
    rng = random.Random(seed)
    cases = [
        (40, 40, 128, 2, "OPT-13B in fp16"),
        (32, 8, 128, 2, "Llama-3-8B (GQA)"),
        (30, 3, 64, 4, "SmolLM2 fp32"),
    ]
    for _ in range(_cases(thorough)):
        dtype = rng.choice(dtypes)
        head_dim = rng.choice((32, 64, 80, 96, 128, 256))
        cases.append((rng.randint(1, 96), rng.randint(1, 64), head_dim, dtype.itemsize, f"{dtype}"))
    for layers, heads, dim, size, name in cases:
        dtype = next(d for d in dtypes if d.itemsize == size)
        expected = KVCacheSpec(layers, heads, dim, dtype).bytes_per_token
        case = f"kv_bytes_per_token({layers}, {heads}, {dim}, {size}) ({name})"
        got = student.call(case, "checks_memory:call_function", layers, heads, dim, size)
        hint = "a token stores a key AND a value per KV head per layer" if got == expected / 2 else ""
        expect(case, expected, got, hint)
    return len(cases)


# -- 02.free_queue ---------------------------------------------------------------------------------


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


def _link(block: object, blocks: list[KVCacheBlock]) -> int | str | None:
    """A link as the check sees it: a real block's id, ``"other"`` (a sentinel, say) or None."""
    if block is None:
        return None
    return next((b.block_id for b in blocks if b is block), "other")


def _queue_state(queue: Any, blocks: list[KVCacheBlock]) -> dict[str, Any]:
    order = []
    for block in queue:  # at most one lap more than there are blocks: a cycle must not hang the check
        order.append(_link(block, blocks))
        if len(order) > len(blocks) + 1:
            break
    links = [[_link(b.prev_free, blocks), _link(b.next_free, blocks)] for b in blocks]
    return {"len": len(queue), "order": order, "links": links}


@driver
def queue_new(state: dict, objects: tuple, n: int) -> dict[str, Any]:
    """``FreeQueue`` over ``n`` fresh blocks; its length, order front to back and every block's links."""
    state["blocks"] = [KVCacheBlock(i) for i in range(n)]
    state["queue"] = objects[0](state["blocks"])
    return _queue_state(state["queue"], state["blocks"])


@driver
def queue_op(state: dict, objects: tuple, op: str, block: int) -> dict[str, Any]:
    """One operation on the queue; what ``popleft`` returned and the state after (see above)."""
    queue, blocks = state["queue"], state["blocks"]
    returned = None
    if op == "popleft":
        got = queue.popleft()
        returned = _link(got, blocks) if isinstance(got, KVCacheBlock) else repr(got)[:80]
    elif op == "popleft_empty":
        try:
            queue.popleft()
        except IndexError:
            return {"raised": "IndexError"}
        return {"raised": None}
    else:
        getattr(queue, op)(blocks[block])
    return {"returned": returned, **_queue_state(queue, blocks)}


@driver
def queue_timing(state: dict, objects: tuple, n: int, phase: str) -> list[int]:
    """Phase ``build``: a queue of ``n`` blocks. Phase ``move``: remove 200 blocks from near the
    front quarter and append them again; returns the last 200 ids, front to back, read through the
    links (what the parent checks, so that skipping the work cannot pass)."""
    if phase == "build":
        state["timing"] = blocks = [KVCacheBlock(i) for i in range(n)]
        state["timing_queue"] = objects[0](blocks)
        return []
    blocks, queue = state["timing"], state["timing_queue"]
    for block in blocks[n // 4 : n // 4 + 200]:
        queue.remove(block)
        queue.append(block)
    tail, node = [], blocks[n // 4 + 199]
    while isinstance(node, KVCacheBlock) and node.block_id >= 0 and len(tail) < 200:
        tail.append(node.block_id)
        node = node.prev_free
    return tail[::-1]


QUEUE_HINTS = {
    "len": "count the blocks in the queue: +1 on append, -1 on remove and popleft",
    "order": "append links the block in before tail; popleft takes head.next_free",
    "returned": "popleft hands out the front block, the one freed longest ago",
}


def _expected_links(order: list[int], n: int) -> list[list[Any]]:
    links: list[list[Any]] = [[None, None] for _ in range(n)]
    for i, block in enumerate(order):
        links[block] = [order[i - 1] if i else "other", order[i + 1] if i + 1 < len(order) else "other"]
    return links


def _compare_queue(where: str, ours: FreeBlockQueue, got: dict[str, Any], n: int) -> None:
    order = [b.block_id for b in ours]
    expect(f"after {where}: len", len(ours), got["len"], QUEUE_HINTS["len"])
    expect(f"after {where}: order front to back", order, got["order"], QUEUE_HINTS["order"])
    for block, (want, have) in enumerate(zip(_expected_links(order, n), got["links"], strict=True)):
        if want == have:
            continue
        if want == [None, None]:
            hint = (
                "a block out of the queue has no links: set its prev_free and next_free to None when "
                "remove or popleft takes it out (the package's allocator tells a free block by them)"
            )
        else:
            hint = (
                "a block in the queue links to its neighbours: prev_free to the block before it (head "
                "for the first), next_free to the block after it (tail for the last)"
            )
        raise CheckFailed(
            f"after {where}: block {block}'s links [prev_free, next_free] ('other' = a sentinel)",
            want,
            have,
            hint,
        )


def free_queue(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``FreeQueue(blocks)`` with ``popleft``, ``remove(block)``, ``append(block)``, ``len`` and
    iteration, replayed against :class:`FreeBlockQueue`: after every operation the length, the
    order and every block's links (a neighbour, a sentinel, or None out of the queue) must agree.
    Then removal from the middle, timed by the check's own clock at two sizes, which a queue that
    scans cannot pass."""
    rng = random.Random(seed)
    runs = [1, 2, 3] + [rng.randint(1, 12) for _ in range(_cases(thorough, 40, 200))]
    for n in runs:
        ours_blocks = [KVCacheBlock(i) for i in range(n)]
        ours = FreeBlockQueue(ours_blocks)
        history = [f"FreeQueue(blocks {list(range(n))})"]
        _compare_queue(history[0], ours, student.call(history[0], "checks_memory:queue_new", n), n)
        for op, block in _queue_ops(rng, n, 3 * n + 2):
            history.append("popleft()" if op == "popleft" else f"{op}(block {block})")
            where = "; ".join(history[-8:])
            got = student.call(where, "checks_memory:queue_op", op, block)
            if op == "popleft":
                expect(f"{where}: the block returned", ours.popleft().block_id, got["returned"])
            else:
                getattr(ours, op)(ours_blocks[block])
            _compare_queue(where, ours, got, n)
        if len(ours) == 0:
            where = "; ".join([*history[-6:], "popleft() on the now empty queue"])
            got = student.call(where, "checks_memory:queue_op", "popleft_empty", 0)
            expect(where, "IndexError", got["raised"], "raise IndexError when the queue is empty")
    _check_constant_time(student)
    return len(runs) + 1


def _check_constant_time(student: Student) -> None:
    def cost(n: int) -> float:
        case = f"FreeQueue of {n:,} blocks: remove + append of 200 blocks from the middle"
        student.call(case, "checks_memory:queue_timing", n, "build")
        tail, seconds = student.timed(case, "checks_memory:queue_timing", n, "move")
        expect(
            case + ": the last 200 blocks, read back through prev_free",
            list(range(n // 4, n // 4 + 200)),
            tail,
        )
        return seconds

    small = min(cost(2_000) for _ in range(3))
    large = min(cost(200_000) for _ in range(3))
    if large > 20 * small + 5e-3:
        raise CheckFailed(
            f"remove + append of 200 blocks from the middle took {large / small:.0f}x longer with 200,000 "
            "blocks than with 2,000",
            hint="each operation must touch a fixed number of links, never scan the queue",
        )


# -- 02.slot_mapping -------------------------------------------------------------------------------


def slot_mapping(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``slot_mapping(block_ids, block_size, start, num_tokens)`` vs :meth:`PageTable.slot`."""
    rng = random.Random(seed)
    cases = [(4, 0, 6), (4, 3, 2), (16, 15, 1), (16, 16, 1), (3, 0, 7)]
    cases += [(rng.randint(1, 32), rng.randint(0, 60), rng.randint(1, 40)) for _ in range(_cases(thorough))]
    for block_size, start, num_tokens in cases:
        allocator = _shuffled_allocator(rng, 8 + (start + num_tokens) // block_size)
        table = PageTable(allocator, block_size)
        table.append_tokens(start + num_tokens)
        expected = [table.slot(p) for p in range(start, start + num_tokens)]
        positions = f"positions {start}..{start + num_tokens - 1}"
        case = f"block_ids={table.block_ids}, block_size={block_size}, {positions}"
        got = student.call(
            case, "checks_memory:call_function", list(table.block_ids), block_size, start, num_tokens
        )
        expect(case, expected, got)
    return len(cases)


def _shuffled_allocator(rng: random.Random, num_blocks: int) -> BlockAllocator:
    """An allocator whose free queue is in random order, so tables get blocks like 5, 0, 7, ..."""
    allocator = BlockAllocator(num_blocks)
    taken = allocator.allocate_many(num_blocks)
    for block_id in rng.sample(taken, len(taken)):
        allocator.free(block_id)
    return allocator


# -- 02.copy_on_write ------------------------------------------------------------------------------


def cow_world(seed: float, block_size: int, num_tokens: int, forks: int) -> tuple[BlockAllocator, PageTable]:
    """A scattered allocator holding one table of ``num_tokens`` tokens and ``forks`` forks of it;
    the same arguments build the same world on either side of the pipe."""
    world = random.Random(seed)
    allocator = _shuffled_allocator(world, 4 + 2 * (num_tokens // block_size + 1) * (forks + 1))
    table = PageTable(allocator, block_size)
    table.append_tokens(num_tokens)
    for _ in range(forks):
        table.fork()
    return allocator, table


def _ref_counts(allocator: BlockAllocator) -> dict[str, int]:
    blocks = range(allocator.num_blocks)
    return {str(b): allocator.ref_count(b) for b in blocks if allocator.ref_count(b)}


@driver
def cow_run(state: dict, objects: tuple, seed: float, block_size: int, num_tokens: int, forks: int) -> dict:
    """The student's ``copy_on_write`` in a world built by :func:`cow_world`: what it returned, the
    block ids after, every block's reference count after, and the free queue's length."""
    allocator, table = cow_world(seed, block_size, num_tokens, forks)
    ids = list(table.block_ids)
    got = objects[0](ids, num_tokens, block_size, allocator)
    returned = list(got) if isinstance(got, (tuple, list)) else got
    return {
        "returned": returned,
        "ids": ids,
        "ref_counts": _ref_counts(allocator),
        "free": allocator.num_free_blocks,
    }


def copy_on_write(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``copy_on_write(block_ids, num_tokens, block_size, allocator)``, called before token
    ``num_tokens`` is written, vs what :meth:`PageTable.append_tokens` does: the same returned copy
    ``(src, dst)`` or None, the same block ids after, the same reference count of every block and
    the same number of free blocks."""
    rng = random.Random(seed)
    cases = [(4, 6, 1), (4, 8, 1), (4, 6, 2), (4, 6, 0), (1, 3, 1), (16, 22, 1), (16, 22, 3)]
    cases += [(rng.randint(1, 16), rng.randint(1, 60), rng.randint(0, 3)) for _ in range(_cases(thorough))]
    for block_size, num_tokens, forks in cases:
        world = rng.random()
        allocator, table = cow_world(world, block_size, num_tokens, forks)
        owners = allocator.ref_count(table.block_ids[-1])
        case = (
            f"block_size={block_size}, {num_tokens} tokens in blocks {table.block_ids}, last block held by "
            f"{owners} table(s), next write at position {num_tokens}"
        )
        got = student.call(
            f"copy_on_write({table.block_ids}, {num_tokens}, {block_size}, allocator) ({case})",
            "checks_memory:cow_run",
            world,
            block_size,
            num_tokens,
            forks,
        )
        expected = None
        if table.needs_copy_on_write():  # then appending one token copies and takes no other block
            copy = table.append_tokens(1).copy
            expected = [copy.src, copy.dst]
        expect(
            case + ": the copy returned",
            expected,
            got["returned"],
            "copy only a partly filled last block that another table shares",
        )
        expect(case + ": block ids after", list(table.block_ids), got["ids"])
        expect(
            case + ": {block: ref count} after",
            _ref_counts(allocator),
            got["ref_counts"],
            "the table must drop its reference to the shared block (allocator.free)",
        )
        expect(
            case + ": free blocks after",
            allocator.num_free_blocks,
            got["free"],
            "take exactly one private block, and only when a copy is needed",
        )
    return len(cases)


# -- 08.block_hashes -------------------------------------------------------------------------------


@driver
def hashes_run(state: dict, objects: tuple, tokens: list[int], block_size: int, salt: str | None) -> Any:
    """The student's hashes as hex strings (or whatever came back, if not a list of bytes)."""
    got = objects[0](tokens, block_size, salt) if salt is not None else objects[0](tokens, block_size)
    if not isinstance(got, (list, tuple)):
        return None if got is None else repr(got)[:80]
    return [bytes(h).hex() if isinstance(h, (bytes, bytearray)) else repr(h)[:80] for h in got]


def block_hashes(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``block_hashes(token_ids, block_size, cache_salt=None)`` vs :func:`extend_block_hashes`."""
    rng = random.Random(seed)
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
        cases.append((tokens, block_size, rng.choice((None, None, f"salt-{rng.randint(0, 99)}"))))
    for tokens, block_size, salt in cases:
        expected = [h.hex() for h in extend_block_hashes([], tokens, block_size, salt)]
        case = f"token_ids={tokens}, block_size={block_size}" + (f", cache_salt={salt!r}" if salt else "")
        got = student.call(f"block_hashes({case})", "checks_memory:hashes_run", tokens, block_size, salt)
        if not isinstance(got, list) or len(got) != len(expected):
            raise CheckFailed(
                case + ": number of hashes",
                len(expected),
                got if not isinstance(got, list) else len(got),
                "one hash per FULL block",
            )
        for index, (want, have) in enumerate(zip(expected, got, strict=True)):
            expect(
                f"{case}: hash of block {index}",
                want[:12],
                have[:12],
                "block i's parent is block i-1's hash (None for block 0); the salt is an extra key of "
                "block 0 only: extra_keys=(cache_salt,)",
            )
    return len(cases)
