"""Choose, once and early, whether Triton kernels are compiled (GPU) or interpreted (CPU).

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` decorator runs, and ``import triton``
itself decorates Triton's own helpers (``tl.zeros``, ``tl.max`` ...). So on a machine without a
GPU the variable must be set before Triton is first imported. ``import paged_attention`` does it.
If Triton was imported earlier, whatever the variable said then is what Triton uses for good; we
take a snapshot of it, so that the backend choice can refuse the interpreter with a clear message
instead of failing deep inside a kernel.
"""

from __future__ import annotations

import os
import sys


def _env_says_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


_TRITON_IMPORTED_BEFORE_US = "triton" in sys.modules
if not _TRITON_IMPORTED_BEFORE_US and "TRITON_INTERPRET" not in os.environ:
    import torch  # only to decide: a process started with the variable set (the lab's children) needs none

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
_SNAPSHOT = _env_says_interpret() if _TRITON_IMPORTED_BEFORE_US else None


def triton_interpreted() -> bool:
    """True when Triton kernels run in the interpreter (on CPU tensors) instead of compiled.

    If Triton was imported before this package, the answer is the variable's value at that time
    (our best knowledge of what Triton saw); otherwise its current value, which Triton will read
    when our kernel modules import it.
    """
    return _SNAPSHOT if _SNAPSHOT is not None else _env_says_interpret()
