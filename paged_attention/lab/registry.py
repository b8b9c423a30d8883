"""The exercises: what each one asks, where it lives, what its cell must define, how it is graded.

Each exercise is graded by a check function (``module:function`` under :mod:`paged_attention.lab`)
that takes the objects the exercise cell defines, in :attr:`Exercise.names` order, and compares
them with the package's own implementation. ``setup`` is the code the grader runs before the cell
(its imports), so that an exercise cell graded on its own sees what it saw in the notebook.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    """One graded exercise (see the module docstring)."""

    exercise_id: str
    notebook: str
    title: str
    task: str  # one line: what the student writes (it becomes the NotImplementedError message)
    names: tuple[str, ...]  # what the cell must define, passed to the check in this order
    checker: str  # "module:function" under paged_attention.lab
    setup: str = ""
    points: int = 1
    minutes: int = 20
    # the package's own implementation of the exercise: a cell that names one is not graded
    references: tuple[str, ...] = ()
    # for a class exercise, the methods the student writes (``super().<method>`` is the package's)
    names_overridden: tuple[str, ...] = ()


TORCH = "import torch\n"
BLOCKS = "from paged_attention.memory.allocator import KVCacheBlock\n"
TRITON = "import torch\nimport triton\nimport triton.language as tl\n"

_ALL = (
    Exercise(
        "01.kv_bytes",
        "01_kv_cache.ipynb",
        "KV bytes per token",
        "return the bytes one token's keys and values take in every layer",
        ("kv_bytes_per_token",),
        "checks_memory:kv_bytes",
        minutes=10,
        references=("KVCacheSpec", "bytes_per_token"),
    ),
    Exercise(
        "02.free_queue",
        "02_allocator_and_page_table.ipynb",
        "The O(1) free queue",
        "link the free blocks into a doubly linked list with O(1) popleft, append and remove",
        ("FreeQueue",),
        "checks_memory:free_queue",
        BLOCKS,
        points=2,
        minutes=30,
        references=("FreeBlockQueue", "BlockAllocator"),
    ),
    Exercise(
        "02.slot_mapping",
        "02_allocator_and_page_table.ipynb",
        "Slot mapping",
        "return the cache slot of each position start .. start + num_tokens - 1",
        ("slot_mapping",),
        "checks_memory:slot_mapping",
        minutes=10,
        references=("PageTable", "build_slot_mapping", "written_slots"),
    ),
    Exercise(
        "02.copy_on_write",
        "02_allocator_and_page_table.ipynb",
        "Copy-on-write of a shared last block",
        "before a write, give the table a private copy of a shared, partly filled last block",
        ("copy_on_write",),
        "checks_memory:copy_on_write",
        points=2,
        minutes=20,
        references=("PageTable", "append_tokens", "needs_copy_on_write"),
    ),
    Exercise(
        "03.online_softmax",
        "03_triton_kernel.ipynb",
        "The online-softmax update",
        "fold one tile of scores and values into the running max, sum and accumulator",
        ("online_softmax_update",),
        "checks_kernels:online_softmax",
        TORCH,
        minutes=20,
    ),
    Exercise(
        "03.block_table",
        "03_triton_kernel.ipynb",
        "Reading K through a block table in Triton",
        "load each logical block's keys from its physical block and store q . k for every token",
        ("paged_scores_kernel",),
        "checks_kernels:block_table",
        TRITON,
        points=3,
        minutes=30,
    ),
    Exercise(
        "03.split_k_merge",
        "03_triton_kernel.ipynb",
        "The split-K merge",
        "combine the partitions' outputs, weighting each by its sum rescaled to the global max",
        ("merge_partitions",),
        "checks_kernels:split_k_merge",
        TORCH,
        minutes=15,
    ),
    Exercise(
        "04.scheduling_policy",
        "04_scheduler.ipynb",
        "Admission and the preemption victim",
        "admit only what fits above the watermark; preempt the latest arrival",
        ("Policy",),
        "checks_serving:scheduling_policy",
        "from paged_attention.engine.core.scheduler import SchedulingPolicy\n",
        points=2,
        minutes=25,
        references=("can_admit", "_blocks_to_start"),
        names_overridden=("admits", "victim"),
    ),
    Exercise(
        "06.first_fit",
        "06_fragmentation.ipynb",
        "First-fit placement with hole merging",
        "place a range in the lowest hole that fits; on free, merge the hole with the holes it touches",
        ("FirstFit",),
        "checks_serving:first_fit",
        points=2,
        minutes=20,
        references=("FirstFitAllocator",),
    ),
    Exercise(
        "08.block_hashes",
        "08_sharing.ipynb",
        "The block-hash chain for prefix caching",
        "hash every full block with its parent's hash; the salt is an extra key of block 0 only",
        ("block_hashes",),
        "checks_memory:block_hashes",
        "from paged_attention.memory.prefix_cache import hash_block_tokens\n",
        minutes=15,
        references=("extend_block_hashes",),
    ),
    Exercise(
        "09.stream_metrics",
        "09_serving.ipynb",
        "TTFT, ITL, TPOT and end-to-end latency from a stream's timestamps",
        "return (ttft, itl, tpot, e2el): a chunk may carry several tokens, tpot is None for one token",
        ("stream_metrics",),
        "checks_load:stream_metrics",
        minutes=15,
        references=("latency_stats",),
    ),
    Exercise(
        "09.arrivals",
        "09_serving.ipynb",
        "Poisson arrivals with a burstiness knob",
        "return the send times: gamma gaps of shape burstiness and mean 1 / rate; all 0 when rate is inf",
        ("arrival_times",),
        "checks_load:arrivals",
        points=2,
        minutes=20,
        references=("loadgen",),
    ),
    Exercise(
        "10.ngram",
        "10_speculative_decoding.ipynb",
        "The n-gram (prompt-lookup) proposer",
        "return up to k tokens that followed the first earlier occurrence of the longest repeated suffix",
        ("propose_drafts",),
        "checks_spec:ngram",
        minutes=20,
        references=("propose",),
    ),
    Exercise(
        "10.verify",
        "10_speculative_decoding.ipynb",
        "Accepting drafts: greedy, and sampled so that the output is the target's",
        "greedy: keep matching drafts, then the argmax; sampled: accept x with probability p(x), "
        "else draw from p without x",
        ("accept_drafts",),
        "checks_spec:verify",
        TORCH,
        points=2,
        minutes=25,
        references=("verify_greedy", "verify_sampled"),
    ),
    Exercise(
        "11.quantize_block",
        "11_quantized_pages.ipynb",
        "An int8 block with a scale per KV head",
        "quantize a block [block_size, num_kv_heads, head_dim] to int8 with one scale per KV head (its "
        "largest |x| over 127, halves rounded up); return (values, scales)",
        ("quantize_block",),
        "checks_quantization:quantize_block",
        TORCH,
        minutes=20,
        references=("store_block_scaled",),
    ),
    Exercise(
        "12.token_mask",
        "12_structured_outputs.ipynb",
        "A grammar's token mask, by brute force",
        "return the ids whose text keeps a match of pattern possible after text, and the stop ids after a "
        "whole match",
        ("token_mask",),
        "checks_structured:token_mask",
        "import regex\n",
        minutes=20,
        references=("allowed_tokens",),
    ),
)

EXERCISES: dict[str, Exercise] = {e.exercise_id: e for e in _ALL}

# Checks written ahead of their notebook cells ("id": "module:function"), tested against right and
# wrong answers and registered above once their cells exist. None wait now.
UNPLACED_CHECKS: dict[str, str] = {}
