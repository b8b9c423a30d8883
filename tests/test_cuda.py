"""On an NVIDIA GPU: the compiled Triton kernels against the PyTorch reference, and the engine's
Triton backend against transformers' own ``generate``, token for token.

Skipped where there is no CUDA device (the CPU suite proves the same kernels under Triton's
interpreter, and ``test_gpu_compile.py`` compiles them for sm_90 without a GPU). On a GPU machine:
``python -m pytest tests/test_cuda.py`` (``.ci/gpu`` runs it with the kernel benchmark).

The caches are the CPU tests' NaN caches (``kernel_cases``): every slot a kernel must not read holds
NaN, so a finite, correct output proves the compiled kernel's masks, which the interpreter forgives
(an unmasked load past an allocation reads garbage on a GPU, nothing on a CPU).
"""

import itertools

import pytest
import torch

from paged_attention import kernels
from paged_attention.engine.llm import LLM
from paged_attention.engine.sample.sampling import SamplingParams
from paged_attention.kernels import decode, prefill, reference, store
from tests.kernel_cases import TOLERANCE, make_paged_case, query_start_loc
from tests.test_engine import PROMPTS, _random_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Llama's and Mistral's 128, GPT-2's 64, Phi's 80 (not a power of two), and the extremes; the first
# and last rows are also `bench kernel`'s correctness grid, so Triton's cache compiles them once.
GRID = [(h, d, 16, torch.bfloat16) for h, d in itertools.product([(8, 8), (8, 2), (16, 1)], (64, 80, 128))]
GRID += [((32, 8), 128, 16, dtype) for dtype in DTYPES]
GRID += [((8, 2), 32, 8, torch.bfloat16), ((8, 2), 128, 128, torch.bfloat16)]
GRID += [((8, 2), d, 8, dtype) for d in (96, 256) for dtype in (torch.float16, torch.float32)]


def _on_cuda(case, q: torch.Tensor, *extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
    tensors = (q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, *extra)
    return tuple(t.to(CUDA) for t in tensors)


@pytest.mark.parametrize(("heads", "head_dim", "block_size", "dtype"), GRID)
def test_decode_and_prefill_kernels_match_the_reference_on_cuda(heads, head_dim, block_size, dtype):
    seq_lens = [1, block_size, block_size + 1, 700, 2100]  # split-K: one to five partitions of 512
    case = make_paged_case(seq_lens, block_size, heads[1], head_dim, dtype, seed=head_dim + block_size)
    gen = torch.Generator().manual_seed(block_size)
    args = _on_cuda(case, torch.randn(len(seq_lens), heads[0], head_dim, generator=gen).to(dtype))
    want = reference.paged_decode(*args)
    for split_k in (False, True):
        out = decode.paged_decode(*args, split_k=split_k)
        assert out.dtype == dtype and torch.isfinite(out).all(), f"split_k={split_k}"
        torch.testing.assert_close(out, want, **TOLERANCE[dtype])
    # Whole prompts and chunks after a cached prefix, causal inside each chunk.
    q_lens = [1, block_size, 1, 37, 300]
    q = torch.randn(sum(q_lens), heads[0], head_dim, generator=gen).to(dtype)
    args = _on_cuda(case, q, query_start_loc(q_lens))
    out = prefill.paged_prefill(*args)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference.paged_prefill(*args), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kernel_writes_what_the_torch_store_writes_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(6, 16, 2, 64, generator=gen).to(dtype).to(CUDA) for _ in range(2)]
    new = torch.randn(5, 2, 64, generator=gen).to(dtype).to(CUDA)
    slots = torch.tensor([0, -1, 95, 17, 40], device=CUDA)  # -1: a padding token, written nowhere
    ours, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
    store.store_kv(new, new, ours[0], ours[1], slots)
    kernels.store_kv(new, new, theirs[0], theirs[1], slots, backend="torch")
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.fixture(scope="module")
def models():
    from paged_attention.models import DEFAULT_MODEL_NAME, load_model, load_tokenizer

    tokenizer = load_tokenizer(None)
    default, _ = load_model(DEFAULT_MODEL_NAME)
    built = {"llama": default} | {k: _random_model(k, tokenizer) for k in ("qwen2", "gpt2")}
    return {k: m.to(CUDA) for k, m in built.items()}, tokenizer


def _generate_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=CUDA)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_engine_on_cuda_matches_generate_under_preemption_chunks_and_drafts(arch, models):
    built, tokenizer = models
    model = built[arch]
    expected = [_generate_greedy(model, p, 16) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    # 16 blocks of 4 slots cannot hold all four requests: preemption and recomputation; 8 tokens
    # a step split the long prompts into chunks read back through the prefill kernel.
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=16, max_num_batched_tokens=8)
    assert llm.llm_engine.runner.backend == "triton"
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert got == expected
    assert llm.llm_engine.scheduler.num_preemptions > 0
    # Again, the prompts now cached; then with n-gram drafts verified by the prefill kernel.
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert again == expected
    spec = LLM(
        model,
        tokenizer=tokenizer,
        block_size=16,
        num_kv_blocks=64,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    drafted = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy, use_tqdm=False)]
    assert drafted == expected


def test_gpu_memory_utilization_sizes_the_cache_from_free_device_memory(models):
    built, tokenizer = models
    llm = LLM(built["llama"], tokenizer=tokenizer, gpu_memory_utilization=0.05)
    engine = llm.llm_engine
    total = torch.cuda.mem_get_info()[1]
    assert 0 < engine.kv_cache.nbytes <= 0.05 * total
    assert engine.cache_manager.num_free_blocks > 1000
