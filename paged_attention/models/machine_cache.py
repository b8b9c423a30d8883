"""Measurements that hold for one machine, cached on disk: what this CPU runs fastest.

Some choices can only be measured (whether bfloat16 beats float32 here, :mod:`.cpu_dtype`; which
kernel multiplies a few rows faster, ``engine.worker.tuning``). Each is measured once and kept in a
JSON file of the package's cache folder, under a key naming what the result depends on: this
processor's name and flags (hashed), torch's version, the thread count, ``ONEDNN_MAX_CPU_ISA`` (which
caps the instructions oneDNN may use), and the caller's own terms (shapes, a probe version). The same
machine then makes the same choice every run; delete the file to measure again.

Invariants: a damaged, foreign or missing file reads as "not measured"; a file is written whole to
a temporary file and renamed into place (two processes writing at once may lose one's entry, which
is then measured again); a read-only cache folder leaves the result cached in the process only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

from .embedded import cache_dir


def machine_key(*terms: object) -> str:
    """The key of a measurement on this machine, ending with the caller's ``terms``."""
    cpu = f"{platform.machine()} {platform.processor()}"
    try:
        with open("/proc/cpuinfo") as info:
            lines = [ln for ln in info if ln.startswith(("model name", "flags", "Features"))][:2]
        cpu += "".join(lines)
    except OSError:
        pass
    digest = hashlib.sha256(cpu.encode()).hexdigest()[:16]
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    fixed = [digest, f"torch {torch.__version__}", f"{torch.get_num_threads()} threads"]
    return "|".join([*fixed, *(str(t) for t in terms), isa])


def cache_file(name: str) -> Path:
    """Where the measurements called ``name`` are kept (``<cache folder>/<name>.json``)."""
    return cache_dir() / f"{name}.json"


_memory: dict[tuple[Path, str], Any] = {}  # what this process stored, by file (kept where it cannot be)


def load(name: str, key: str) -> Any:
    """The entry ``key`` of the file ``name``, else what this process stored under it (a read-only
    cache folder), else ``None``; a damaged file reads as ``None`` (measure again)."""
    path = cache_file(name)
    try:
        known = json.loads(path.read_text())
    except OSError:  # no file
        return _memory.get((path, key))
    except ValueError:  # damaged
        return None
    if isinstance(known, dict) and key in known:
        return known[key]
    return _memory.get((path, key))


def store(name: str, key: str, value: Any) -> None:
    """Add the entry ``key`` (plain JSON) to the file ``name`` (see the module's invariants)."""
    path = cache_file(name)
    _memory[path, key] = json.loads(json.dumps(value))  # as a file would give it back
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    known[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{name}-", delete=False) as out:
            json.dump(known, out, indent=1)
        os.replace(out.name, path)
    except OSError:  # a read-only cache folder: the result is still cached in the process
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(out.name)
