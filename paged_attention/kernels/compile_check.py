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


def _signature(fn: object, dtype: str, constexprs: dict[str, object]) -> dict[str, str]:
    int32_ptrs = {"block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"}
    fp32_ptrs = {"m_ptr", "l_ptr", "partial_ptr"}
    sig = {}
    for name in fn.arg_names:  # type: ignore[attr-defined]
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = (
                "*i32" if name in int32_ptrs else "*i64" if name == "slot_mapping_ptr" else
                "*fp32" if name in fp32_ptrs else dtype
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
    jobs: list[tuple[str, object, dict[str, object]]] = []
    for dtype, native in (("*bf16", True), ("*fp32", False)):  # fp16 takes the bf16 path
        for head_dim, group in ((128, 4), (80, 1)):
            head_pad = max(16, triton.next_power_of_2(head_dim))
            common = dict(
                GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=16, TILE=16, NATIVE_DOT=native
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
            (dtype, store._store_kernel, dict(ROW=8 * 128, ROW_PAD=1024)),
        ]
    out = []
    for dtype, fn, constexprs in jobs:
        name = f"{fn.__name__}[{dtype[1:]}, {', '.join(f'{k}={v}' for k, v in constexprs.items())}]"
        source = ASTSource(fn=fn, signature=_signature(fn, dtype, constexprs), constexprs=constexprs)
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
