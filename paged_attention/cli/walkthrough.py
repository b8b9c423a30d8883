"""``python -m paged_attention walkthrough``: paged KV memory at work, one step at a time.

Three requests share a small KV cache of 16 blocks x 4 slots. We prefill their prompts, decode a
few tokens, fork one request into two samples (parallel sampling), let the fork write so that
copy-on-write splits the shared last block, finish a request and watch its blocks return. After
each step the memory map (see :mod:`paged_attention.viz.memory_map`) shows every slot. Every token's key
is really written into a :class:`~paged_attention.engine.worker.kv_cache.KVCache` and read back
through the page tables at the end, so the picture is checked, not just drawn.
"""

from __future__ import annotations

import torch

from ..engine.worker.kv_cache import KVCache, KVCacheSpec
from ..experiments.traces import uniform_trace
from ..memory.accounting import paged_memory_report
from ..memory.allocator import BlockAllocator
from ..memory.page_table import PageTable
from ..viz.memory_map import format_memory_map

NUM_BLOCKS, BLOCK_SIZE, MAX_LEN = 16, 4, 24


class _Walkthrough:
    def __init__(self, seed: int) -> None:
        self.allocator = BlockAllocator(NUM_BLOCKS)
        self.cache = KVCache(KVCacheSpec(1, 1, 1, torch.float32), NUM_BLOCKS, BLOCK_SIZE)
        self.tables: dict[str, PageTable] = {}
        self.written: dict[str, list[float]] = {}
        self.trace = uniform_trace(3, prompt_len=(3, 10), output_len=(2, 8), seed=seed)
        self.next_token = 1.0

    def append(self, name: str, n: int) -> str:
        table = self.tables[name]
        result = table.append_tokens(n)
        note = ""
        if result.copy:
            self.cache.copy_blocks([result.copy])
            note = f"  copy-on-write: block {result.copy.src} -> block {result.copy.dst}"
        values = [self.next_token + i for i in range(n)]
        self.next_token += n
        kv = torch.tensor(values).view(n, 1, 1)
        self.cache.store(0, kv, kv, torch.tensor(result.slot_mapping, dtype=torch.int64))
        self.written[name] += values
        return f"{name}: +{n} token(s) -> slots {result.slot_mapping}{note}"

    def show(self, title: str) -> None:
        names = list(self.tables)
        print(f"\n== {title}")
        print(format_memory_map(self.allocator, [self.tables[n] for n in names], BLOCK_SIZE, names))
        print(
            f"   free blocks: {self.allocator.num_free_blocks}/{NUM_BLOCKS}   "
            f"block tables: " + "  ".join(f"{n}={self.tables[n].block_ids}" for n in names)
        )

    def check_reads(self) -> None:
        keys = self.cache.key_cache(0).reshape(-1)
        for name, table in self.tables.items():
            slots = [table.slot(p) for p in range(table.num_tokens)]
            assert keys[slots].tolist() == self.written[name], f"{name} reads back wrong keys"


def run_walkthrough(seed: int = 0) -> None:
    w = _Walkthrough(seed)
    print(f"Three requests, one KV cache of {NUM_BLOCKS} blocks x {BLOCK_SIZE} slots (seed {seed}).")
    print(
        "\nLegend: A = a token of request A, a = a slot A holds but has not written, "
        "* = a token in a shared block, . = free"
    )

    for name, request in zip("ABC", w.trace, strict=True):
        w.tables[name] = PageTable(w.allocator, BLOCK_SIZE)
        w.written[name] = []
        print(w.append(name, request.prompt_len))
    w.show("after prefill: each prompt took cdiv(prompt_len, 4) blocks, wherever they were free")

    for step in range(1, 3):
        for name in list(w.tables):
            print(f"step {step}  " + w.append(name, 1))
    w.show("after 2 decode steps: a new block only when a last block was full")

    # Fork a request whose last block is partly filled, so that copy-on-write has work to do.
    parent = next((n for n in "BC" if w.tables[n].num_unfilled_slots), "B")
    w.tables["D"] = w.tables[parent].fork()
    w.written["D"] = list(w.written[parent])
    w.show(f"fork: D is a second sample of {parent}; it shares all of {parent}'s blocks (ref count 2)")

    print(w.append("D", 1))
    print(w.append(parent, 1))
    w.show("D wrote first: a shared, partly filled last block is copied before it is written")

    finished = w.tables.pop("A")
    finished_blocks = list(finished.block_ids)
    finished.free()
    del w.written["A"]
    w.show(f"A finished: blocks {finished_blocks} went to the back of the free queue")
    print(f"   free queue (front first): {w.allocator.free_block_ids()}")

    w.check_reads()
    report = paged_memory_report(list(w.tables.values()), w.allocator, BLOCK_SIZE)
    print("\nEvery sequence read its keys back through its page table: OK\n")
    print(report)
    print(
        f"\nUnder contiguous max-length reservation ({MAX_LEN} slots per request) the same "
        f"{len(w.tables)} sequences would hold {len(w.tables) * MAX_LEN} slots; paging holds "
        f"{w.allocator.num_used_blocks * BLOCK_SIZE} for {report.token_slots} token states "
        f"({report.token_fraction_of_used:.0%} of what it holds is in use)."
    )
    for table in w.tables.values():
        table.free()
    assert w.allocator.num_free_blocks == NUM_BLOCKS
    print(f"All sequences freed: {w.allocator.num_free_blocks}/{NUM_BLOCKS} blocks free again.")
