"""Choose, once and early, whether Triton kernels are compiled (GPU) or interpreted (CPU).

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` decorator runs, and ``import triton``
itself decorates Triton's own helpers (``tl.zeros``, ``tl.max`` ...). So on a machine without a
GPU the variable must be set before Triton is first imported. ``import paged_attention`` does it;
if Triton was imported earlier without it, the interpreter cannot work in this process, and
:func:`interpreter_usable` says so instead of failing deep inside a kernel.
"""

from __future__ import annotations

import os
import sys

import torch

TRITON_IMPORTED_BEFORE_US = "triton" in sys.modules

if "TRITON_INTERPRET" not in os.environ and not TRITON_IMPORTED_BEFORE_US and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def triton_interpreted() -> bool:
    """True when Triton kernels run in the interpreter (on CPU tensors) instead of compiled."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
