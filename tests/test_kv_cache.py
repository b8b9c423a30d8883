from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, OPTConfig

from paged_attention.engine.worker.kv_cache import KVCache, KVCacheSpec, kv_bytes_per_token, zeroed
from paged_attention.kernels.reference import store_kv
from paged_attention.memory.page_table import BlockCopy

KiB = 1024


def opt_13b() -> OPTConfig:
    # facebook/opt-13b's published config, built locally (no download).
    return OPTConfig(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, ffn_dim=20480)


def llama_2_7b() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008
    )


def llama_3_8b() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
    )


def test_bytes_per_token_of_real_model_configs():
    assert kv_bytes_per_token(opt_13b(), torch.float16) == 800 * KiB
    assert kv_bytes_per_token(llama_2_7b(), torch.float16) == 512 * KiB
    assert kv_bytes_per_token(llama_3_8b(), torch.bfloat16) == 128 * KiB  # GQA: 8 KV heads
    assert kv_bytes_per_token(GPT2Config(), "float32") == 2 * 12 * 768 * 4


def test_spec_reads_declared_dtype_and_defaults_to_fp16():
    config = llama_2_7b()
    assert KVCacheSpec.from_config(config).dtype == torch.float16
    config.dtype = torch.bfloat16
    assert KVCacheSpec.from_config(config).dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype or its name"):
        KVCacheSpec.from_config(config, "float99")


def test_blocks_for_a_budget_opt_13b_on_a100():
    spec = KVCacheSpec.from_config(opt_13b(), torch.float16)
    budget = 12 * 1024**3  # the paper's 12 GiB of KV cache
    assert spec.num_blocks_for_budget(budget, block_size=1) == 15_728
    assert spec.num_blocks_for_budget(budget, block_size=16) == 15_728 // 16
    with pytest.raises(ValueError, match="holds no block"):
        spec.num_blocks_for_budget(1000, block_size=16)
    with pytest.raises(ValueError, match="budget_bytes must be an int >= 0"):
        spec.num_blocks_for_budget(-1, block_size=16)


def test_spec_rejects_bad_fields():
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        KVCacheSpec(2, 2, 0)
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        KVCacheSpec(2, 2, 4, "float16")


def test_cache_tensor_layout_and_views():
    cache = KVCache(KVCacheSpec(3, 2, 8, torch.float32), num_blocks=5, block_size=4)
    assert cache.data.shape == (3, 2, 5, 4, 2, 8)
    assert cache.key_cache(1).shape == (5, 4, 2, 8)
    assert cache.key_cache(1).data_ptr() == cache.data[1, 0].data_ptr()  # a view, not a copy
    assert cache.num_slots == 20 and cache.nbytes == 3 * 2 * 5 * 4 * 2 * 8 * 4


def test_store_kv_writes_each_token_into_its_slot_and_skips_minus_one():
    torch.manual_seed(0)
    key_cache = torch.zeros(4, 2, 3, 5)
    value_cache = torch.zeros(4, 2, 3, 5)
    key, value = torch.randn(3, 3, 5), torch.randn(3, 3, 5)
    store_kv(key, value, key_cache, value_cache, torch.tensor([7, -1, 0]))
    assert torch.equal(key_cache[3, 1], key[0]) and torch.equal(value_cache[3, 1], value[0])
    assert torch.equal(key_cache[0, 0], key[2])
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 2  # only two slots written


def test_store_kv_casts_to_cache_dtype_and_checks_shapes():
    key_cache = torch.zeros(2, 2, 1, 4, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(1, 1, 4)
    store_kv(key, key, key_cache, value_cache, torch.tensor([3]))
    assert torch.equal(key_cache[1, 1], key[0].to(torch.bfloat16))
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        store_kv(key, key, key_cache, value_cache, torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"slot_mapping holds slot 4: slots are 0\.\.3, or -1"):
        store_kv(key, key, key_cache, value_cache, torch.tensor([4]))
    with pytest.raises(ValueError, match="slot_mapping holds slot -2"):
        store_kv(key, key, key_cache, value_cache, torch.tensor([-2]))
    with pytest.raises(ValueError, match="num_kv_heads, head_dim"):
        store_kv(torch.randn(1, 2, 4), torch.randn(1, 2, 4), key_cache, value_cache, torch.tensor([0]))
    with pytest.raises(ValueError, match="key and value must both be"):
        store_kv(key, torch.randn(2, 1, 4), key_cache, value_cache, torch.tensor([0]))


def test_cache_store_and_copy_blocks_across_layers():
    cache = KVCache(KVCacheSpec(2, 1, 4, torch.float32), num_blocks=4, block_size=2)
    k = torch.arange(8.0).view(2, 1, 4)
    for layer in range(2):
        cache.store(layer, k + layer, -k, torch.tensor([2, 3]))  # block 1, both slots
    cache.copy_blocks([BlockCopy(src=1, dst=3)])
    assert torch.equal(cache.data[:, :, 3], cache.data[:, :, 1])
    assert torch.equal(cache.key_cache(1)[3], k + 1)
    cache.copy_blocks([])  # nothing to do
    with pytest.raises(ValueError, match="block copy -1 -> 3 is out of range"):
        cache.copy_blocks([BlockCopy(src=-1, dst=3)])


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_a_cpu_cache_is_zeros_that_take_memory_only_where_written(dtype: torch.dtype) -> None:
    """256 MiB of cache: zeros, and the process's resident memory grows by the pages written, not
    by the cache's size, even after every byte was read (torch.zeros would write all of it up front;
    a shared mapping would take a page for each one read)."""
    shape = (4, 2, 1024, 16, 4, 64 * 4 // dtype.itemsize)  # 256 MiB in every dtype
    before = _rss()
    cache = zeroed(shape, dtype, "cpu")
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.view(torch.uint8).any()
    cache[0, 0, 7] = torch.ones(16, 4, shape[-1]).to(dtype)  # one block's keys of one layer
    assert _rss() - before < 32 << 20
    written = cache.view(torch.uint8).view(-1, dtype.itemsize).any(-1).sum()  # elements not all-zero bytes
    assert written == 16 * 4 * shape[-1]
