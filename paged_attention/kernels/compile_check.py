"""Compile every Triton kernel of the package for an NVIDIA GPU, on a machine without one.

The interpreter runs kernels as Python, so it forgives things the real compiler rejects (a plain
Python global inside a kernel, a ``tl.dot`` whose inner dimension is below 16, a dtype mix). Triton can
compile ahead of time for a named target with no GPU present: this module builds each kernel to a
``cubin`` for an H100/H200 (``sm_90``) in the configurations the launchers use, so that a CPU-only
test run still proves the GPU build.

    python -m paged_attention.kernels.compile_check          # prints one line per kernel build

It must run in a process where Triton was imported with ``TRITON_INTERPRET`` unset (the tests start
it as a subprocess).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def _signature(
    fn: object, dtype: str, constexprs: dict[str, object], cache: str | None = None
) -> dict[str, str]:
    """Argument types: ``dtype`` for the queries, keys and outputs, ``cache`` (default ``dtype``) for
    the cache's pages, float32 for scales and partial results, integers for the index tensors."""
    int32_ptrs = {"block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"}
    int64_ptrs = {"slot_mapping_ptr", "blocks_ptr", "tokens_ptr"}
    fp32_ptrs = {"m_ptr", "l_ptr", "partial_ptr", "k_scale_ptr", "v_scale_ptr", "scale_ptr"}
    cache_ptrs = {"key_cache_ptr", "value_cache_ptr", "cache_ptr"}
    sig = {}
    for name in fn.arg_names:  # type: ignore[attr-defined]
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = (
                "*i32" if name in int32_ptrs else "*i64" if name in int64_ptrs else
                "*fp32" if name in fp32_ptrs else (cache or dtype) if name in cache_ptrs else dtype
            )  # fmt: skip
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    return sig


def builds(arch: int = 90) -> list[tuple[str, Callable[[], object]]]:
    """(name, thunk) pairs; calling a thunk compiles one kernel configuration."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import decode, prefill, store

    target = GPUTarget("cuda", arch, 32)
    jobs: list[tuple[str, object, dict[str, object]] | tuple[str, object, dict[str, object], str]] = []
    for dtype, native in (("*bf16", True), ("*fp32", False)):  # fp16 takes the bf16 path
        for head_dim, group in ((128, 4), (80, 1)):
            head_pad = max(16, triton.next_power_of_2(head_dim))
            common = dict(
                GROUP=group,
                HEAD_DIM=head_dim,
                HEAD_PAD=head_pad,
                BLOCK_SIZE=16,
                TILE=16,
                NATIVE_DOT=native,
                QUANT=False,
            )
            jobs += [
                (dtype, decode._decode_kernel, dict(common, GROUP_PAD=16)),
                (
                    dtype,
                    decode._decode_split_kernel,
                    dict(common, GROUP_PAD=16, PARTITION=decode.PARTITION_SIZE),
                ),
                (
                    dtype,
                    prefill._prefill_kernel,
                    dict(common, GROUP_PAD=triton.next_power_of_2(group), BLOCK_M=64),
                ),
            ]
        jobs += [
            (dtype, decode._reduce_kernel, dict(HEAD_DIM=128, HEAD_PAD=128, SPLITS_PAD=8, PARTITION=512)),
            (dtype, store._store_kernel, dict(ROW=8 * 128, ROW_PAD=1024, FP8_MAX=0.0, MANTISSA=0, MIN_EXP=0)),
        ]
    # quantized pages: 8-bit caches read (dequantized to float32) and written beside bf16 queries;
    # each kernel once (a build costs ~2 s without a cache), the formats shared among them
    quant = dict(GROUP=4, HEAD_DIM=128, HEAD_PAD=128, BLOCK_SIZE=16, TILE=16, NATIVE_DOT=False, QUANT=True)
    for cache, (limit, mantissa, min_exp) in (("*fp8e4nv", (448.0, 3, -6)), ("*fp8e5", (57344.0, 2, -14))):
        store_meta = dict(ROW=2 * 128, ROW_PAD=256, FP8_MAX=limit, MANTISSA=mantissa, MIN_EXP=min_exp)
        jobs.append(("*bf16", store._store_kernel, store_meta, cache))
    jobs += [
        ("*bf16", decode._decode_kernel, dict(quant, GROUP_PAD=16), "*fp8e4nv"),
        ("*bf16", decode._decode_split_kernel, dict(quant, GROUP_PAD=16, PARTITION=512), "*i8"),
        ("*bf16", prefill._prefill_kernel, dict(quant, GROUP_PAD=4, BLOCK_M=64), "*fp8e5"),
        (
            "*bf16",
            store._store_int8_kernel,
            dict(HEAD_DIM=128, HEAD_PAD=128, BLOCK_SIZE=16, ROWS_PAD=16),
            "*i8",
        ),
    ]
    out = []
    for dtype, fn, constexprs, *cache in jobs:
        kind = f"{dtype[1:]}" + (f" over {cache[0][1:]}" if cache else "")
        name = f"{fn.__name__}[{kind}, {', '.join(f'{k}={v}' for k, v in constexprs.items())}]"
        signature = _signature(fn, dtype, constexprs, *cache)
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        out.append((name, lambda source=source: triton.compile(source, target=target)))
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check needs TRITON_INTERPRET unset (the interpreter replaces the compiler)")
        return 2
    failures = 0
    for name, build in builds():
        try:
            kernel = build()
            ok = "cubin" in kernel.asm
        except Exception as err:  # report every failing build, not just the first
            ok, failures = False, failures + 1
            print(f"FAILED {name}: {type(err).__name__}: {str(err)[:2000]}")
            continue
        print(f"{'ok' if ok else 'NO CUBIN'} {name}")
        failures += not ok
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
