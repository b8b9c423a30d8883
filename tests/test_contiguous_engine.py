"""The real engine over contiguous KV memory and with static batching: the same tokens as paged memory.

The baselines must differ from paged memory only in *where* K/V live and *when* requests run, never in
what the model computes: every configuration below serves the same greedy requests to the same tokens.
"""

import random

import pytest
import torch

from paged_attention.baselines import ContiguousKVCacheManager
from paged_attention.baselines.engines import baseline_engine
from paged_attention.engine.sample.sampling import SamplingParams
from paged_attention.memory.paged_manager import PagedKVCacheManager
from paged_attention.models import DEFAULT_MODEL_NAME, load_model
from tests.streaming import finished_only

NUM_KV_BLOCKS = 48  # 768 slots: three 256-slot Max reservations at a time, so requests queue
MAX_MODEL_LEN = 256

_rng = random.Random(0)
REQUESTS = [  # (prompt token ids, max_tokens): 8 requests, 2..60 prompt tokens, 3..24 outputs
    ([_rng.randrange(3, 500) for _ in range(prompt_len)], max_tokens)
    for prompt_len, max_tokens in [(2, 12), (17, 3), (60, 20), (5, 24), (33, 8), (9, 18), (48, 14), (1, 16)]
]

CONFIGS = {
    "paged": dict(kv_manager="paged"),
    "max": dict(kv_manager="max"),
    "pow2": dict(kv_manager="pow2"),
    "oracle": dict(kv_manager="oracle"),
    "oracle-first-fit": dict(kv_manager="oracle", placement="first-fit"),
    "max-first-fit": dict(kv_manager="max", placement="first-fit"),
    "static-paged": dict(kv_manager="paged", static_batching=True),
    "static-max": dict(kv_manager="max", static_batching=True),
}


@pytest.fixture(scope="module")
def model_and_tokenizer():
    # One thread: the model is tiny, and two threads on a shared 2-core runner spend their time waiting
    # for each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(DEFAULT_MODEL_NAME)
    torch.set_num_threads(threads)


def make_engine(model_and_tokenizer, **kwargs):
    model, tokenizer = model_and_tokenizer
    settings = dict(num_kv_blocks=NUM_KV_BLOCKS, block_size=16, max_model_len=MAX_MODEL_LEN) | kwargs
    return baseline_engine(model, tokenizer, **settings)


def serve(engine) -> tuple[dict[str, list[int]], list[int]]:
    """All requests at once; returns the outputs by request id and the batch size of every step."""
    for i, (prompt, max_tokens) in enumerate(REQUESTS):
        engine.add_request(
            str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )
    outputs, batch_sizes = {}, []
    while engine.has_unfinished_requests():
        for out in finished_only(engine.step()):
            outputs[out.request_id] = out.outputs[0].token_ids
            assert out.outputs[0].finish_reason == "length"
        batch_sizes.append(engine.last_step.num_scheduled_seqs)
    return outputs, batch_sizes


@pytest.fixture(scope="module")
def served(model_and_tokenizer):
    results = {}
    for name, kwargs in CONFIGS.items():
        engine = make_engine(model_and_tokenizer, **kwargs)
        outputs, batch_sizes = serve(engine)
        results[name] = (engine, outputs, batch_sizes)
    return results


def test_every_memory_manager_and_batching_mode_gives_the_same_tokens(served):
    reference = served["paged"][1]
    assert sorted(reference, key=int) == [str(i) for i in range(len(REQUESTS))]
    assert [len(reference[str(i)]) for i in range(len(REQUESTS))] == [m for _, m in REQUESTS]
    assert len({tuple(t) for t in reference.values()}) == len(REQUESTS)  # not one degenerate answer
    for name, (_, outputs, _) in served.items():
        assert outputs == reference, name


def test_contiguous_engines_use_one_slot_blocks_of_the_same_bytes(served):
    paged = served["paged"][0]
    for name in ("max", "pow2", "oracle", "oracle-first-fit", "static-max"):
        engine = served[name][0]
        assert isinstance(engine.cache_manager, ContiguousKVCacheManager)
        assert engine.kv_cache.block_size == 1
        assert engine.kv_cache.num_slots == paged.kv_cache.num_slots == NUM_KV_BLOCKS * 16
        assert engine.kv_cache.nbytes == paged.kv_cache.nbytes
    assert isinstance(paged.cache_manager, PagedKVCacheManager) and paged.kv_cache.block_size == 16
    assert served["oracle-first-fit"][0].cache_manager.placement_name == "first-fit"
    assert served["max"][0].cache_manager.placement_name == "buddy"


def test_every_slot_is_free_afterwards_and_nothing_was_preempted(served):
    for name, (engine, _, _) in served.items():
        manager = engine.cache_manager
        assert manager.num_free_blocks == manager.num_blocks, name
        assert not engine.request_ids and not engine.scheduler.running and not engine.scheduler.waiting
        if isinstance(manager, ContiguousKVCacheManager):
            assert not manager.reservations and engine.scheduler.num_preemptions == 0
            assert manager.memory_report().free_slots == manager.num_slots


def test_the_reservation_policy_limits_the_batch(served):
    peak = {name: max(sizes) for name, (_, _, sizes) in served.items()}
    assert peak["max"] == peak["static-max"] == 3  # 768 slots / 256 per request
    assert peak["paged"] == peak["oracle"] == len(REQUESTS)
    steps = {name: len(sizes) for name, (_, _, sizes) in served.items()}
    assert steps["max"] > steps["oracle"]
    assert steps["static-max"] > steps["max"]  # a batch waits for its longest member


def test_an_unknown_kv_manager_is_rejected(model_and_tokenizer):
    with pytest.raises(ValueError, match=r"kv_manager must be 'paged' or one of \('max', 'pow2', 'oracle'\)"):
        make_engine(model_and_tokenizer, kv_manager="nope")
    with pytest.raises(ValueError, match="placement must be one of"):
        make_engine(model_and_tokenizer, kv_manager="max", placement="best-fit")


def test_an_arena_that_cannot_hold_one_max_model_len_request_is_refused_when_built(model_and_tokenizer):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    message = (
        r"max_model_len=256 does not fit the KV cache: .*the .max. policy reserves 256 slots for it "
        r".* longest contiguous range of the arena holds 128\); pass max_model_len <= 128"
    )
    with pytest.raises(ValueError, match=message):
        make_engine(model_and_tokenizer, kv_manager="max", num_kv_blocks=8)  # 128 slots < 256
    oracle = make_engine(
        model_and_tokenizer, kv_manager="oracle", placement="first-fit", num_kv_blocks=4, max_model_len=64
    )
    with pytest.raises(ValueError, match=r"exceeds max_model_len=64"):
        oracle.add_request("b", list(range(3, 64)), params)  # 61 + 4 > 64 slots
    oracle.add_request("c", list(range(3, 63)), params)  # 60 + 4 == 64: exactly fits
    outputs = []
    while oracle.has_unfinished_requests():
        outputs += finished_only(oracle.step())
    assert [o.request_id for o in outputs] == ["c"] and len(outputs[0].outputs[0].token_ids) == 4
    assert oracle.cache_manager.num_free_blocks == 64
