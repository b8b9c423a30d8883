"""``python -m paged_attention bench kernel``: is the paged kernel correct on this device, and how
close to the memory bandwidth does it run?

The checks against the PyTorch reference and the timed contenders (``paged``, ``contiguous``,
``sdpa`` and, when installed, ``flash_attn``, over a Llama-3-8B layer's shapes) are
:mod:`paged_attention.experiments.kernel_timing`; the figure and table
:mod:`paged_attention.viz.kernels`. On a GPU the numbers are absolute. On a CPU the Triton kernels
run in the interpreter, so only a tiny smoke run makes sense (``--smoke``): it proves the command
works; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ... import viz
from ...experiments import kernel_timing


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench kernel", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (the default without a GPU)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096, 8192, 32768])
    parser.add_argument(
        "--max-tokens", type=int, default=4 * 1024 * 1024, help="skip batch x context above this"
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for kernel_bandwidth.{png,json}")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="measure nothing: print the table and draw the figure of a stored kernel_bandwidth.json "
        "(a GPU machine's run, redrawn where matplotlib is)",
    )
    opts = parser.parse_args(args)
    if opts.from_json is not None:
        return redraw(opts.from_json, opts.out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    smoke = opts.smoke or device.type != "cuda"
    if smoke:
        opts.batches, opts.contexts, opts.max_tokens = [1, 2], [32, 64], 128
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"device: {name}{'  [smoke run: times are meaningless]' if smoke else ''}")
    passed, total = kernel_timing.check_correctness(device, smoke)
    print(f"correctness vs the PyTorch reference: {passed}/{total} kernel runs agree")
    rows = kernel_timing.measure_bandwidth(device, opts.batches, opts.contexts, opts.max_tokens)
    peak = kernel_timing.hbm_peak(device)
    print(viz.kernels.bandwidth_table(rows, peak))
    out_dir = opts.out or viz.figures_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = kernel_timing.payload(name, smoke, peak, (passed, total), rows)
    (out_dir / "kernel_bandwidth.json").write_text(json.dumps(payload, indent=2))
    viz.save(viz.kernels.kernel_bandwidth(rows, peak, title=name), "kernel_bandwidth", out_dir)
    print(f"wrote {out_dir / 'kernel_bandwidth.png'} and kernel_bandwidth.json")
    if passed != total:
        raise SystemExit(f"{total - passed} kernel runs disagree with the reference")


def redraw(path: Path, out_dir: Path | None) -> None:
    """The table and figure of a stored run, with nothing measured (the JSON is left as it is)."""
    payload = json.loads(path.read_text())
    rows = kernel_timing.rows_from_payload(payload)
    peak = payload["hbm_peak_bytes_per_second"]
    passed, total = payload["correct"]
    print(f"device: {payload['device']}; correctness vs the PyTorch reference: {passed}/{total}")
    print(viz.kernels.bandwidth_table(rows, peak))
    out_dir = out_dir or viz.figures_dir()
    viz.save(viz.kernels.kernel_bandwidth(rows, peak, title=payload["device"]), "kernel_bandwidth", out_dir)
    print(f"wrote {out_dir / 'kernel_bandwidth.png'}")
