"""Promises that used to be guarded only by numbers a notebook printed: the sampler's filters draw
from the distribution they describe, ``min_tokens`` bans the stop tokens, the watermark holds
admission back, and freed blocks are evicted tail first (the LRU intent of prefix caching)."""

from __future__ import annotations

import math

import pytest
import torch

from paged_attention import LLM, SamplingParams
from paged_attention.engine.sample.sampling import Sampler
from paged_attention.engine.sequence import Sequence
from paged_attention.memory.page_table import PageTable
from paged_attention.memory.paged_manager import PagedKVCacheManager
from paged_attention.memory.prefix_cache import PrefixCachingBlockAllocator, extend_block_hashes

# -- the sampler's filters against a renormalisation written apart ------------------------------
LOGITS = [2.0, 1.6, 1.5, 0.9, 0.2, -0.3, -1.0, -2.5]
DRAWS = 3000
# Upper 0.1% points of the chi-square distribution, by degrees of freedom (a table, not scipy).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def expected(logits: list[float], params: SamplingParams) -> list[float]:
    """Temperature, then min-p, then top-k, then top-p, each followed by renormalising: plain Python."""
    scaled = [x / params.temperature for x in logits]
    top = max(scaled)
    p = [math.exp(x - top) for x in scaled]
    p = [x / sum(p) for x in p]
    p = [x if x >= params.min_p * max(p) else 0.0 for x in p]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    if params.top_k > 0:
        for i in order[params.top_k :]:
            p[i] = 0.0
    p = [x / sum(p) for x in p]
    kept, mass = [], 0.0
    for i in order:
        if mass < params.top_p and p[i] > 0:
            kept.append(i)
        mass += p[i]
    p = [x if i in kept else 0.0 for i, x in enumerate(p)]
    return [x / sum(p) for x in p]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.8, min_p=0.05),
    ],
    ids=["temperature-0.7", "temperature-1.3", "min-p", "top-k", "top-p", "all-four"],
)
def test_each_filter_draws_from_its_renormalised_distribution(params: SamplingParams) -> None:
    want = expected(LOGITS, params)
    generator = torch.Generator().manual_seed(1234)
    logits = torch.tensor([LOGITS] * DRAWS)
    tokens = Sampler()(logits, [params] * DRAWS, [generator] * DRAWS).tokens
    counts = [tokens.count(i) for i in range(len(LOGITS))]
    removed = [i for i, q in enumerate(want) if q == 0]
    assert all(counts[i] == 0 for i in removed), f"removed tokens {removed} were drawn: {counts}"
    kept = [i for i, q in enumerate(want) if q > 0]
    chi2 = sum((counts[i] - DRAWS * want[i]) ** 2 / (DRAWS * want[i]) for i in kept)
    assert len(kept) == 1 or chi2 < CHI2_999[len(kept) - 1], (counts, [round(DRAWS * q) for q in want])


def test_the_filters_remove_what_they_say() -> None:
    """The reference itself, on numbers worked by hand (so that both cannot be wrong alike)."""
    assert sum(q > 0 for q in expected(LOGITS, SamplingParams(top_k=3))) == 3
    assert sum(q > 0 for q in expected(LOGITS, SamplingParams(min_p=0.3))) == 4  # e^-1.2 = 0.30 of the top
    assert sum(q > 0 for q in expected(LOGITS, SamplingParams(top_p=0.6))) == 3


# -- min_tokens ---------------------------------------------------------------------------------
def test_min_tokens_bans_eos_even_when_it_is_the_greedy_token() -> None:
    llm = LLM(num_kv_blocks=32, block_size=4, max_model_len=64)
    engine = llm.llm_engine
    eos = sorted(engine.stop_rules.eos_token_ids)[0]
    execute = engine.runner.execute

    def eos_first(*args, **kwargs):  # EOS becomes every step's most likely token
        logits = execute(*args, **kwargs).clone()
        logits[:, eos] = logits.max() + 10.0
        return logits

    engine.runner.execute = eos_first
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert free[0].outputs[0].token_ids == [eos] and free[0].outputs[0].finish_reason == "stop"
    for params in (SamplingParams(temperature=0, max_tokens=8, min_tokens=4),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=8, min_tokens=4)):  # fmt: skip
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
        assert eos not in out.token_ids[:4] and len(out.token_ids) == 5, out.token_ids
        assert out.token_ids[4] == eos and out.finish_reason == "stop"


# -- the watermark, and tail-first freeing --------------------------------------------------------
def sequence(seq_id: int, num_tokens: int, max_tokens: int = 1) -> Sequence:
    return Sequence(seq_id, str(seq_id), list(range(num_tokens)), SamplingParams(max_tokens=max_tokens), 0.0)


def test_admission_leaves_the_watermark_free_and_growth_may_use_it() -> None:
    cache = PagedKVCacheManager(num_blocks=20, block_size=4, watermark=0.1)  # 2 blocks kept free
    assert cache.watermark_blocks == 2
    assert cache.can_admit(sequence(0, 72), 72)  # 18 blocks: 2 stay free
    assert not cache.can_admit(sequence(0, 73), 73)  # 19 blocks: 1 would stay free
    running = sequence(1, 40, max_tokens=40)
    assert cache.allocate_slots(running, 40) is not None  # 10 blocks, 10 free
    running.num_computed_tokens = 40
    assert cache.can_admit(sequence(2, 32), 32) and not cache.can_admit(sequence(2, 33), 33)
    assert cache.allocate_slots(running, 40) is not None  # a running sequence grows into the watermark
    assert cache.num_free_blocks == 0


def test_a_freed_sequence_is_evicted_tail_first() -> None:
    """Its blocks go back last block first, so memory pressure evicts the end of a prompt before its
    beginning, the part other requests are likelier to share."""
    allocator = PrefixCachingBlockAllocator(6)
    table = PageTable(allocator, block_size=2)
    table.append_tokens(8)  # 4 full blocks
    hashes = extend_block_hashes([], list(range(8)), 2)
    for block_id, block_hash in zip(table.block_ids, hashes, strict=True):
        allocator.cache_block(block_id, block_hash)
    prompt_blocks = list(table.block_ids)
    table.free()
    assert allocator.free_block_ids()[-4:] == prompt_blocks[::-1]
    allocator.allocate_many(2)  # the two never-used blocks
    for still_cached in (3, 2, 1, 0):
        assert allocator.lookup(hashes) == prompt_blocks[: still_cached + 1]
        allocator.allocate()  # evicts the least recently freed: the tail
    assert allocator.lookup(hashes) == []
