"""Is the paged decode kernel correct on this device, and how close to the memory bandwidth does it run?

What ``python -m paged_attention bench kernel`` and notebook 03 measure. Decode attention reads
every cached key and value once and does little arithmetic with them, so its speed is a bandwidth:
**KV bytes read / time**. :func:`measure_bandwidth` times, side by side in one run,

* ``paged``: our Triton decode kernel over a shuffled block table (pages scattered in memory);
* ``contiguous``: the same kernel over an identity block table (pages in order); both read the
  block table, so the ratio paged / contiguous prices scattered pages, not the table lookup (the
  ``sdpa``/``flash_attn`` rows, with no table at all, are nearer the paper's comparison, §7.1);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` over contiguous K/V;
* ``flash_attn``: ``flash_attn_with_kvcache`` from flash-attn, when it is installed.

Shapes follow a Llama-3-8B layer: 32 query heads over 8 KV heads of 128, bf16, block size 16.
:func:`check_correctness` first checks the kernels against the PyTorch reference on this device:
decode with and without split-K, prefill of one and of several new tokens after a cached prefix,
and the store kernel.

On a GPU the numbers are absolute. On a CPU the Triton kernels run in the interpreter, so only a
tiny smoke run makes sense: it proves the code works; its times mean nothing. The figure and the
table: :func:`paged_attention.viz.kernels.kernel_bandwidth` and
:func:`paged_attention.viz.kernels.bandwidth_table`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch

from .. import kernels
from .._checks import cdiv
from ..kernels import decode, prefill, reference, store

# Peak HBM bandwidth in bytes/s of the GPUs we know, matched against torch's device name.
HBM_PEAK = {"H200": 4.8e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12, "A100-SXM4-40GB": 1.555e12}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


@dataclass(frozen=True)
class BandwidthRow:
    """One contender at one (batch, context): ``seconds`` per call as a caller sees it (host-side
    checks and launches included), ``device_seconds`` the GPU's own busy time per call (kernels and
    copies, from the profiler; ``None`` on a CPU)."""

    method: str
    batch: int
    context: int
    seconds: float
    kv_bytes: int
    device_seconds: float | None = None

    @property
    def bytes_per_second(self) -> float:
        """KV bytes per second of a whole call."""
        return self.kv_bytes / self.seconds

    @property
    def kernel_bytes_per_second(self) -> float:
        """KV bytes per second of the GPU's busy time (of the call's where none was measured)."""
        return self.kv_bytes / (self.device_seconds or self.seconds)


def hbm_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in HBM_PEAK.items() if key in name), None)


def check_correctness(device: torch.device, smoke: bool) -> tuple[int, int]:
    """Kernels vs reference on ``device`` over the test grid; returns (passed, total)."""
    heads = [(8, 8), (8, 2), (16, 1)]
    if smoke:  # each kind of head sharing, head size and dtype once (the interpreter is slow)
        grid = [
            ((8, 8), 64, 16, torch.float32),
            ((8, 2), 80, 16, torch.bfloat16),
            ((16, 1), 64, 16, torch.float16),
        ]
    else:  # each config compiles ~5 kernels (about a second each): sized for a 15-minute GPU lease
        grid = list(itertools.product(heads, [64, 80, 128], [16, 128], [torch.bfloat16]))
        grid += [((8, 2), d, 8, dtype) for d in (96, 256) for dtype in (torch.float16, torch.float32)]
    tolerance = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
    passed = total = 0
    gen = torch.Generator().manual_seed(0)
    for (h, hkv), d, bs, dtype in grid:
        lens = [1, bs, bs + 1, 3 * bs + 5] if smoke else [1, bs, bs + 1, 700, 2000]
        max_blocks = cdiv(max(lens), bs)
        num_blocks = len(lens) * max_blocks
        kc = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype).to(device)
        vc = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype).to(device)
        bt = torch.randperm(num_blocks, generator=gen).view(len(lens), max_blocks).int().to(device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        q = torch.randn(len(lens), h, d, generator=gen).to(dtype).to(device)
        args = (q, kc, vc, bt, seq_lens)
        expected = reference.paged_decode(*args).float()
        loc = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)  # one new token each
        outs = [decode.paged_decode(*args, split_k=False), prefill.paged_prefill(*args, loc)]
        if not smoke:
            outs.append(decode.paged_decode(*args, split_k=True))
        # Causal prefill of several new tokens after a cached prefix (chunked prefill).
        q_lens = [min(n, 7) for n in lens]
        many_loc = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
        q_many = torch.randn(sum(q_lens), h, d, generator=gen).to(dtype).to(device)
        many_args = (q_many, kc, vc, bt, seq_lens, many_loc)
        pairs = [(out, expected) for out in outs]
        pairs.append((prefill.paged_prefill(*many_args), reference.paged_prefill(*many_args).float()))
        # The store kernel against the PyTorch store, bit for bit.
        new_k = torch.randn(4, hkv, d, generator=gen).to(dtype).to(device)
        slots = torch.tensor([0, -1, num_blocks * bs - 1, bs + 1], device=device)
        caches = [kc.clone(), vc.clone(), kc.clone(), vc.clone()]
        kernels.store_kv(new_k, new_k, caches[0], caches[1], slots, backend="torch")
        store.store_kv(new_k, new_k, caches[2], caches[3], slots)
        for out, want in pairs:
            total += 1
            passed += bool(torch.allclose(out.float(), want, atol=tolerance[dtype], rtol=tolerance[dtype]))
        total += 1
        passed += bool(torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]))
    return passed, total


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100) / 1e3

    def cpu_time(fn: Callable[[], object]) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return cpu_time


def device_seconds(fn: Callable[[], object], calls: int = 20) -> float:
    """The GPU's busy time per call of ``fn`` (every kernel and copy it launches), from torch's
    profiler: what the kernels cost without the host's checks, syncs and launch latency."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    busy_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return busy_us / 1e6 / calls


def _methods(batch: int, context: int, device: torch.device) -> tuple[dict[str, Callable[[], object]], int]:
    """The contenders for one (batch, context), over one bf16 cache; returns them and the KV bytes."""
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    kc = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    vc = torch.randn_like(kc)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    identity = torch.arange(num_blocks, dtype=torch.int32, device=device).view(batch, blocks_per_seq)
    shuffled = torch.randperm(num_blocks, device=device).int().view(batch, blocks_per_seq)
    # With the identity table, the cache *is* a contiguous [batch, context, kv_heads, head_dim] tensor.
    k_bshd = kc.view(batch, context, NUM_KV_HEADS, HEAD_DIM)
    v_bshd = vc.view(batch, context, NUM_KV_HEADS, HEAD_DIM)
    q_sdpa = q.view(batch, NUM_HEADS, 1, HEAD_DIM)
    k_sdpa, v_sdpa = k_bshd.transpose(1, 2), v_bshd.transpose(1, 2)
    methods: dict[str, Callable[[], object]] = {
        "paged": lambda: decode.paged_decode(q, kc, vc, shuffled, seq_lens),
        "contiguous": lambda: decode.paged_decode(q, kc, vc, identity, seq_lens),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            q_sdpa, k_sdpa, v_sdpa, enable_gqa=True
        ),
    }
    if device.type == "cuda":
        try:
            from flash_attn import flash_attn_with_kvcache  # type: ignore[import-not-found]
        except ImportError:
            pass
        else:
            q_fa = q.view(batch, 1, NUM_HEADS, HEAD_DIM)
            methods["flash_attn"] = lambda: flash_attn_with_kvcache(
                q_fa, k_bshd, v_bshd, cache_seqlens=seq_lens
            )
    return methods, 2 * kc.numel() * kc.element_size()


def measure_bandwidth(
    device: torch.device, batches: list[int], contexts: list[int], max_tokens: int
) -> list[BandwidthRow]:
    timer = _timer(device)
    rows: list[BandwidthRow] = []
    for batch, context in itertools.product(batches, contexts):
        if batch * context > max_tokens:
            continue
        methods, kv_bytes = _methods(batch, context, device)
        for name, fn in methods.items():
            seconds = timer(fn)  # first: a profiler session leaves launches slower for a while
            busy = device_seconds(fn) if device.type == "cuda" else None
            rows.append(BandwidthRow(name, batch, context, seconds, kv_bytes, busy))
        del methods
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def payload(
    device_name: str, smoke: bool, peak: float | None, correct: tuple[int, int], rows: list[BandwidthRow]
) -> dict:
    """The results as JSON-ready data: the device, the correctness count, the shape and every row."""
    import triton

    return {
        "device": device_name,
        "date": time.strftime("%Y-%m-%d"),
        "software": f"torch {torch.__version__}, triton {triton.__version__}",
        "smoke": smoke,
        "hbm_peak_bytes_per_second": peak,
        "correct": list(correct),
        "shape": dict(
            num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE
        ),
        "rows": [
            asdict(r)
            | {"bytes_per_second": r.bytes_per_second, "kernel_bytes_per_second": r.kernel_bytes_per_second}
            for r in rows
        ],
    }


def rows_from_payload(payload: dict) -> list[BandwidthRow]:
    """The rows of a stored :func:`payload` (its derived ``bytes_per_second`` recomputed)."""
    names = [f.name for f in fields(BandwidthRow)]
    return [BandwidthRow(**{n: row[n] for n in names if n in row}) for row in payload["rows"]]
