"""Numba's on-disk cache of the compiled loops: an inconsistent one recognised and rebuilt.

Numba keeps each loop's machine code beside its module (or in ``NUMBA_CACHE_DIR``): an index of the
signatures met so far, and one numbered file of code per signature. Two processes compiling the
same loop for the first time at once (two notebooks, the test suite's workers, an engine core beside
its caller) can take the same number for two signatures, each writing the index and the file; the
index may then name one signature's file while the file holds the other's code. A later process
that loads it stops before the loop runs: ``TypeError: can't unbox array from PyObject into native
value`` (an argument's array is not what the loaded code expects). Seen once in this project's
test suite, run twice on one fresh checkout: the second run failed on the first run's cache, and the
code from before and after the change under test failed alike.

Nothing in that cache can be trusted then, so :func:`repair` recompiles, with Numba's documented
``Dispatcher.recompile``, every signature this process loaded of this package's loops (which also
drops each one's index on disk and writes the fresh code back): the call that met the error takes
the eager recipe, and the calls after it the loops again. Invariant: nothing is written before the
error (it is raised while the arguments are converted, before the loop's first instruction).
"""

from __future__ import annotations

import sys
import threading
import warnings

#: The start of the error Numba raises when loaded code does not fit its arguments.
UNBOX = "can't unbox"

_lock = threading.Lock()


def inconsistent(error: BaseException) -> bool:
    """Whether ``error`` is a loaded loop not fitting its arguments (an inconsistent cache)."""
    return isinstance(error, TypeError) and str(error).startswith(UNBOX)


def repair(error: BaseException, package: str = __name__.rsplit(".", 1)[0]) -> int:
    """Recompile every loop of ``package`` (this one's kernels) that this process has loaded, each
    for the signatures it loaded, and say so once with a warning naming ``error``; returns how many
    loops were recompiled. Errors of the recompilation itself propagate (the caller gives the loops
    up then)."""
    from numba.core.dispatcher import Dispatcher

    with _lock:
        loaded: dict[int, Dispatcher] = {}
        for name, module in list(sys.modules.items()):
            if module is None or not (name == package or name.startswith(package + ".")):
                continue
            for value in list(vars(module).values()):
                if isinstance(value, Dispatcher) and value.overloads:
                    loaded[id(value)] = value
        for dispatcher in loaded.values():
            dispatcher.recompile()
    warnings.warn(
        f"Numba's on-disk cache of the compiled loops did not fit ({str(error).splitlines()[0][:120]}; two "
        f"processes compiling the same loop at once can leave it so): {len(loaded)} loops recompiled and "
        "cached afresh; that one call took the eager recipe (the same numbers up to rounding)",
        RuntimeWarning,
        stacklevel=4,
    )
    return len(loaded)
