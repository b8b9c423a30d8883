"""Quantized pages in the engine: sizes, the cache's scales, and requests served from 8-bit pages.

Swap, copy-on-write and the prefix cache move or share pages; their scales must travel with them.
Each test compares a run that moves pages with one that does not (or with another backend) on the
embedded tiny model in float32, where the only difference left is the one under test.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from paged_attention import LLM, EngineArgs, SamplingParams
from paged_attention.engine.worker import model_runner
from paged_attention.engine.worker.kv_cache import KVCache, KVCacheSpec
from paged_attention.memory.page_table import BlockCopy

FORMATS = ["fp8", "fp8_e5m2", "int8"]
PROMPTS = [[5, 6, 7], [17, 99, 4, 250, 31] * 3, list(range(40, 77)), [7, 300, 12] * 9]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny():
    engine = LLM(num_kv_blocks=8).llm_engine
    return engine.model, engine.tokenizer


def make(tiny, **kwargs) -> LLM:
    return LLM(tiny[0], tokenizer=tiny[1], **kwargs)


# -- sizes ---------------------------------------------------------------------------------------
def test_bytes_and_blocks_follow_the_format():
    """SmolLM2's shapes: 30 layers, 3 KV heads of 64; a budget buys 2x the blocks of bfloat16 in fp8,
    4x float32's, and int8 a little less than fp8 (each block carries its 720 bytes of scales)."""
    spec = {name: KVCacheSpec(30, 3, 64, dtype) for name, dtype in
            (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn),
             ("int8", torch.int8))}  # fmt: skip
    assert spec["bfloat16"].bytes_per_token == 23_040 and spec["fp8"].bytes_per_token == 11_520
    assert spec["int8"].scale_bytes_per_block == 2 * 30 * 3 * 4 and spec["fp8"].scale_bytes_per_block == 0
    assert spec["int8"].bytes_per_block(16) == 16 * 11_520 + 720
    budget = 64 * spec["bfloat16"].bytes_per_block(16)  # the demo's: 64 bfloat16 blocks
    blocks = {name: s.num_blocks_for_budget(budget, 16) for name, s in spec.items()}
    assert blocks == {"float32": 32, "bfloat16": 64, "fp8": 128, "int8": 127}


def test_the_format_names_are_vllms_and_checked():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    assert KVCacheSpec.from_config(config, torch.bfloat16, "fp8").dtype == torch.float8_e4m3fn
    assert KVCacheSpec.from_config(config, torch.bfloat16, "fp8_e4m3").dtype == torch.float8_e4m3fn
    assert KVCacheSpec.from_config(config, torch.bfloat16, "fp8_e5m2").dtype == torch.float8_e5m2
    assert KVCacheSpec.from_config(config, torch.bfloat16, "auto").dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto'.*'int8'\), got 'int4'"):
        KVCacheSpec.from_config(config, torch.bfloat16, "int4")


def test_calculate_kv_scales_goes_with_fp8_only(tiny):
    with pytest.raises(
        ValueError, match="calculate_kv_scales=True sets the per-tensor scales of an fp8 cache"
    ):
        make(tiny, num_kv_blocks=8, kv_cache_dtype="int8", calculate_kv_scales=True)
    with pytest.raises(TypeError, match="calculate_kv_scales must be a bool"):
        make(tiny, num_kv_blocks=8, kv_cache_dtype="fp8", calculate_kv_scales="yes")


# -- the cache's scales move with its pages --------------------------------------------------------
def test_copies_reads_and_swaps_take_the_scales_along():
    spec = KVCacheSpec(2, 2, 8, torch.int8)
    cache = KVCache(spec, num_blocks=4, block_size=4)
    cache.data.random_(-100, 100)
    cache.scales.uniform_(0.1, 1.0)
    assert cache.nbytes == cache.data.numel() + cache.scales.numel() * 4
    cache.copy_blocks([BlockCopy(src=1, dst=3)])
    assert torch.equal(cache.data[:, :, 3], cache.data[:, :, 1]) and torch.equal(
        cache.scales[:, :, 3], cache.scales[:, :, 1]
    )
    saved = cache.read_blocks([0, 2])
    cache.data[:, :, 0] = 0
    cache.scales[:, :, 2] = 0
    cache.write_blocks([0, 2], saved)
    assert torch.equal(cache.read_blocks([0, 2])[1], saved[1]) and torch.equal(
        cache.read_blocks([0, 2])[0], saved[0]
    )
    host = KVCache(spec, num_blocks=2, block_size=4)
    cache.copy_blocks_to(host, [(2, 1)])
    assert torch.equal(host.data[:, :, 1], cache.data[:, :, 2]) and torch.equal(
        host.scales[:, :, 1], cache.scales[:, :, 2]
    )
    fp8 = KVCache(KVCacheSpec(2, 2, 8, torch.float8_e4m3fn), num_blocks=2, block_size=4)
    assert fp8.scales.shape == (2, 2) and bool((fp8.scales == 1.0).all())  # per tensor, 1.0 until set
    fp8.scales.fill_(0.25)
    fp8_host = KVCache(fp8.spec, num_blocks=2, block_size=4)
    fp8.copy_blocks_to(fp8_host, [(0, 1)])
    assert bool((fp8_host.scales == 0.25).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_swapped_pages_come_back_with_their_scales(tiny, fmt):
    """Swap preemption moves blocks to the host and back; the tokens are those of a run whose cache
    is large enough never to preempt."""
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(4)]
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    calculated = {"calculate_kv_scales": fmt != "int8"}  # fp8: scales other than 1.0 go with the pages
    roomy = tokens(
        make(tiny, num_kv_blocks=64, block_size=4, kv_cache_dtype=fmt, **calculated), prompts, long
    )
    swap = {"preemption_mode": "swap", "num_cpu_blocks": 40}
    small = make(tiny, num_kv_blocks=12, block_size=4, kv_cache_dtype=fmt, **swap, **calculated)
    assert tokens(small, prompts, long) == roomy
    assert small.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefix_cache_hits_and_copy_on_write_read_the_same_pages(tiny, fmt):
    """A shared prefix served from the prefix cache, and parallel samples that share then copy
    their last block, give the tokens of runs that share nothing."""
    prefix = list(range(100, 132))  # two full blocks of 16
    prompts = [[*prefix, 5, 6], [*prefix, 7]]
    alone = [
        tokens(make(tiny, num_kv_blocks=32, kv_cache_dtype=fmt, enable_prefix_caching=False), [p])[0]
        for p in prompts
    ]
    shared = make(tiny, num_kv_blocks=32, kv_cache_dtype=fmt)
    tokens(shared, prompts[:1])
    assert tokens(shared, prompts[1:]) == alone[1:]
    seeded = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10)
    forked = make(tiny, num_kv_blocks=32, kv_cache_dtype=fmt).generate([prompts[0]], seeded, use_tqdm=False)[
        0
    ]
    single = make(tiny, num_kv_blocks=32, kv_cache_dtype=fmt, enable_prefix_caching=False)
    for i, sample in enumerate(forked.outputs):
        one = SamplingParams(temperature=1.0, seed=5 + i, max_tokens=10)  # sample i draws with seed + i
        assert single.generate([prompts[0]], one, use_tqdm=False)[0].outputs[0].token_ids == sample.token_ids


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_cpu_backend_serves_the_same_tokens_from_quantized_pages(tiny, fmt):
    """The compiled kernels, the eager reference and (for int8: the interpreter is slow) the Triton
    kernels read the same 8-bit pages and give the same greedy tokens."""
    runs = {}
    for backend in ("compiled", "torch", "triton") if fmt == "int8" else ("compiled", "torch"):
        llm = make(tiny, num_kv_blocks=32, kv_cache_dtype=fmt, attention_backend=backend)
        params = SamplingParams(temperature=0, max_tokens=4 if backend == "triton" else 12, ignore_eos=True)
        runs[backend] = tokens(llm, PROMPTS[:2], params)
    assert runs["compiled"] == runs["torch"]
    assert runs.get("triton", [t[:4] for t in runs["torch"]]) == [t[:4] for t in runs["torch"]]


def test_fp8_drafts_change_no_token_and_int8_drafts_keep_the_pages_sound(tiny, monkeypatch):
    """n-gram drafts are written into the pages, then refused ones overwritten. fp8 quantizes each
    value alone: the tokens are those of decoding without drafts. An int8 block's scale may have
    grown for a refused draft (its rows then carry one more rounding), so the check there is that
    after every step each computed token's keys and values, read back from its block, are within
    two steps of that block's scale of the values the model last handed to the store for its slot
    (half a step for the rounding, half more for each growth of the scale after it)."""
    draft = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    repetitive = [[7, 300, 12] * 9, [5, 6, 7, 8] * 6]
    plain = tokens(make(tiny, num_kv_blocks=32, kv_cache_dtype="fp8"), repetitive)
    drafted = make(tiny, num_kv_blocks=32, kv_cache_dtype="fp8", speculative_config=draft)
    assert tokens(drafted, repetitive) == plain
    assert drafted.llm_engine.speculator.stats.num_draft_tokens > 0
    # the eager backend stores through kernels.store_kv in every layer, where the values are seen
    engine = make(tiny, num_kv_blocks=32, kv_cache_dtype="int8", speculative_config=draft,
                  attention_backend="torch").llm_engine  # fmt: skip
    cache = engine.kv_cache
    handed: dict[tuple[int, int, int], torch.Tensor] = {}  # (layer, K or V, slot) -> float32 values
    store = model_runner.kernels.store_kv
    layer_bytes = cache.data.stride(0) * cache.data.element_size()

    def recording(key, value, key_cache, value_cache, slot_mapping, **kwargs):
        layer = (key_cache.data_ptr() - cache.data.data_ptr()) // layer_bytes
        for t, slot in enumerate(slot_mapping.tolist()):
            handed[layer, 0, slot], handed[layer, 1, slot] = key[t].float(), value[t].float()
        return store(key, value, key_cache, value_cache, slot_mapping, **kwargs)

    monkeypatch.setattr(model_runner.kernels, "store_kv", recording)
    engine.add_request("0", {"prompt_token_ids": repetitive[0]}, SamplingParams(temperature=0, max_tokens=16))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        if not engine.has_unfinished_requests():
            break
        seq = engine.sequences("0")[0]
        table = engine.cache_manager.block_table(seq.seq_id)
        for position in range(seq.num_computed_tokens):
            block, offset = table[position // cache.block_size], position % cache.block_size
            slot = block * cache.block_size + offset
            for layer in range(cache.spec.num_layers):
                for kv in (0, 1):
                    scale = cache.scales[layer, kv, block][:, None]  # [kv_heads, 1]
                    stored = cache.data[layer, kv, block, offset].float() * scale
                    assert bool(((stored - handed[layer, kv, slot]).abs() <= 2 * scale * 1.0001).all())
                    checked += 1
    assert checked > 0 and engine.speculator.stats.num_draft_tokens > 0


def test_calculate_kv_scales_sets_each_layers_scales_from_the_first_step(tiny):
    llm = make(tiny, num_kv_blocks=32, kv_cache_dtype="fp8", calculate_kv_scales=True)
    cache = llm.llm_engine.kv_cache
    assert cache.calibrating and bool((cache.scales == 1.0).all())
    tokens(llm, PROMPTS[:1])
    assert not cache.calibrating
    assert bool((cache.scales != 1.0).all()) and bool((cache.scales > 0).all())
    first = cache.scales.clone()
    tokens(llm, PROMPTS[1:2])
    assert torch.equal(cache.scales, first)  # set once, by the first step only


def test_the_engine_takes_kv_cache_dtype_from_keywords_and_the_command_line(tiny):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "int8", "--num-kv-blocks", "8"]))
    assert args.kv_cache_dtype == "int8" and args.calculate_kv_scales is False
    llm = make(tiny, num_kv_blocks=8, kv_cache_dtype="fp8_e5m2")
    assert llm.llm_engine.kv_cache.data.dtype == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        make(tiny, num_kv_blocks=8, kv_cache_dtype="fp4")


def test_restarting_calibration_lets_the_next_step_set_the_scales_again(tiny):
    """A warm-up step (the engine core's, a benchmark's) must not leave its scales behind."""
    llm = make(tiny, num_kv_blocks=32, kv_cache_dtype="fp8", calculate_kv_scales=True)
    cache = llm.llm_engine.kv_cache
    tokens(llm, [[0] * 8])  # a warm-up's dummy prompt
    dummy = cache.scales.clone()
    cache.restart_calibration()
    assert cache.calibrating and bool((cache.scales == 1.0).all())
    tokens(llm, PROMPTS[3:])
    fresh = make(tiny, num_kv_blocks=32, kv_cache_dtype="fp8", calculate_kv_scales=True)
    tokens(fresh, PROMPTS[3:])
    assert torch.equal(cache.scales, fresh.llm_engine.kv_cache.scales) and not torch.equal(
        cache.scales, dummy
    )
    plain = make(tiny, num_kv_blocks=8, kv_cache_dtype="int8").llm_engine.kv_cache
    plain.restart_calibration()  # nothing to restart: int8's scales are its stores'
    assert not plain.calibrating


def test_serve_takes_the_kv_cache_dtype():
    from paged_attention.cli.serve import build_engine, parser

    opts = parser().parse_args(["--model", "tiny", "--num-kv-blocks", "8", "--kv-cache-dtype", "fp8",
                                "--calculate-kv-scales"])  # fmt: skip
    engine = build_engine(opts)
    assert engine.kv_cache.data.dtype == torch.float8_e4m3fn and engine.kv_cache.calibrating
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parser().parse_args(["--kv-cache-dtype", "int4"])
