"""An inconsistent Numba cache (:mod:`paged_attention.kernels.numba_cache`): recognised, rebuilt,
and the call that met it falls back instead of failing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from paged_attention.kernels import compiled, numba_cache

pytest.importorskip("numba")

UNBOX_ERROR = TypeError(
    "can't unbox array from PyObject into native value.  The object maybe of a different type"
)

LOOP = """
import numpy as np
from numba import njit


@njit(cache=True)
def total(values, out):
    out[0] = values.sum()
"""

RUN = """
import sys, warnings
import numpy as np
sys.path.insert(0, {folder!r})
import cachedloop
from paged_attention.kernels import numba_cache

small, wide = np.arange(4, dtype=np.int16), np.arange(4, dtype=np.float64)
if sys.argv[1] == "compile":
    cachedloop.total(small, np.zeros(1, np.int16))
    cachedloop.total(wide, np.zeros(1, np.float64))
else:
    try:
        cachedloop.total(small, np.zeros(1, np.int16))
        print("loaded")
    except TypeError as error:
        assert numba_cache.inconsistent(error), error
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            count = numba_cache.repair(error, package="cachedloop")
        said = [w for w in caught if "did not fit" in str(w.message)]
        print("recompiled", count, len(said))
        out = np.zeros(1, np.int16)
        cachedloop.total(small, out)
        print("total", int(out[0]))
"""


def _run(folder: Path, mode: str) -> str:
    script = RUN.format(folder=str(folder))
    done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_cache_whose_index_names_another_signatures_code_is_recompiled(tmp_path: Path) -> None:
    """The race's outcome made by hand: two signatures' code files swapped under one index. A new
    process then fails before the loop runs, with Numba's unboxing error; repair recompiles what it
    loaded, and the loop runs right; the process after it loads the rewritten cache."""
    (tmp_path / "cachedloop.py").write_text(textwrap.dedent(LOOP))
    _run(tmp_path, "compile")
    first, second = sorted((tmp_path / "__pycache__").glob("cachedloop.total-*.nbc"))
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)
    second.write_bytes(a)
    assert _run(tmp_path, "load").split() == ["recompiled", "1", "1", "total", "6"]
    assert _run(tmp_path, "load").split() == ["loaded"]


def test_give_up_repairs_an_inconsistent_cache_and_keeps_the_loops(monkeypatch) -> None:
    repaired: list[BaseException] = []
    monkeypatch.setattr(numba_cache, "repair", lambda error: repaired.append(error) or 3)
    monkeypatch.setattr(compiled, "_failed", None)
    assert compiled.give_up(UNBOX_ERROR) is None
    assert repaired == [UNBOX_ERROR] and compiled.available()
    with pytest.raises(TypeError, match="other"):  # any other TypeError is a bug: raised
        compiled.give_up(TypeError("other"))


def test_a_repair_that_fails_gives_the_loops_up(monkeypatch) -> None:
    from numba.core.errors import TypingError

    def fail(error: BaseException) -> int:
        raise TypingError("cannot compile")

    monkeypatch.setattr(numba_cache, "repair", fail)
    monkeypatch.setattr(compiled, "_failed", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled.give_up(UNBOX_ERROR)
    assert not compiled.available() and "cannot compile" in compiled._failed
    assert any("falls back" in str(w.message) for w in caught)


def test_only_the_unboxing_type_error_is_taken_for_an_inconsistent_cache() -> None:
    assert numba_cache.inconsistent(UNBOX_ERROR)
    assert not numba_cache.inconsistent(TypeError("unsupported operand"))
    assert not numba_cache.inconsistent(ValueError(str(UNBOX_ERROR)))
