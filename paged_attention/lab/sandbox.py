"""The grader's student: the cell's code in a fresh interpreter of its own, behind a pipe.

The grader (the *parent*) never imports or executes the student's code. For each exercise it starts
a child process (``python -m paged_attention.lab.child``), sends it the exercise's imports and the
cell's text, and then, case by case, the name of a driver and its plain inputs (see
:mod:`.student`); the child answers with plain data, which the parent checks against the reference
it holds itself, on cases it drew itself. So whatever the cell does, patching the grader, the
checks or the package's reference, printing a fake pass line or exiting early, changes only what
the child reports; and a wrong report fails a case.

Limits and walls, each reported with a status of its own:

* **time**: the whole exercise (loading the cell and every case) must end within ``time_limit``
  seconds by the parent's clock, or the child is killed: ``timeout``;
* **memory**: the child may take ``memory_limit`` bytes of address space beyond what its imports
  took (``RLIMIT_AS``); beyond, allocations fail: ``memory``;
* **files**: where the operating system allows it (root, or unprivileged user namespaces), the
  child runs in a mount namespace in which the package, the Python installation and its
  site-packages are read-only, with no capabilities left, so a cell cannot patch them on disk for a
  later run either; :attr:`ChildStudent.confined` says whether that held. The parent also makes
  itself non-dumpable while children live, so that no child can read or write its memory;
* **the pipe**: requests and answers travel on two pipes of their own; the child's stdout and
  stderr go to a file (its last lines are quoted on an error), and answers carry the request's
  number, so nothing printed or written early can pass for an answer.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import signal
import site
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .checking import CheckFailed
from .registry import Exercise
from .student import Student, raised

TIME_LIMIT = 300.0  # seconds per exercise
MEMORY_LIMIT = 2 << 30  # bytes of address space beyond the child's imports
MAX_ANSWER = 64 << 20  # bytes of one answer
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds paged_attention/


class LimitExceeded(Exception):
    """The student's code went past a limit: ``kind`` is ``"timeout"`` or ``"memory"``."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class CellError(Exception):
    """The cell cannot be graded: it raised while loading, defines too little, or ended its process."""


def protected_paths() -> list[str]:
    """The folders a child may read but not change: the package, Python, its site-packages."""
    candidates = {str(PACKAGE_ROOT), sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages()}
    user = site.getusersitepackages()
    candidates.add(user)
    found = sorted({os.path.realpath(p) for p in candidates if os.path.isdir(p)})
    return [p for p in found if not any(p != q and p.startswith(q + os.sep) for q in found)]


_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 32, 4096, 16384, 1 << 18


def _confine(libc: Any, paths: list[str], uid: int, gid: int) -> None:  # pragma: no cover - in the child
    """Runs in the child between fork and exec: die with the parent, then, where allowed, a mount
    namespace with ``paths`` read-only and every capability dropped (see the module docstring)."""
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if libc.unshare(_CLONE_NEWNS) != 0:
        if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS) != 0:
            return
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with contextlib.suppress(OSError), open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return
    for path in paths:
        target = path.encode()
        if libc.mount(target, target, None, _MS_BIND | _MS_REC, None) == 0:
            libc.mount(None, target, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID, None)
    for capability in range(64):  # an empty bounding set: exec grants no capability, even to root
        libc.prctl(24, capability, 0, 0, 0)  # PR_CAPBSET_DROP
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS


@contextlib.contextmanager
def undumpable():
    """While children live, this process is not dumpable: no process without CAP_SYS_PTRACE (no
    child, which has none) may trace it or open its memory and files under /proc."""
    libc = _libc()
    if libc is None:
        yield
        return
    before = libc.prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    try:
        yield
    finally:
        libc.prctl(4, max(before, 0), 0, 0, 0)


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


class ChildStudent(Student):
    """An exercise cell's objects in a child process (see the module docstring); a context manager.

    Construction loads the cell: it raises the exercise's ``NotImplementedError`` if the cell
    raises it at the top, :class:`CellError` if the cell raises anything else, defines too little
    or ends its process, and :class:`LimitExceeded` past a limit."""

    def __init__(
        self,
        exercise: Exercise,
        code: str,
        time_limit: float = TIME_LIMIT,
        memory_limit: int = MEMORY_LIMIT,
    ) -> None:
        self.exercise = exercise
        self.time_limit, self.memory_limit = time_limit, memory_limit
        self.deadline = time.monotonic() + time_limit
        self.confined = False
        self._number = 0
        self._closed = False
        self.process: subprocess.Popen | None = None
        self._selector: selectors.BaseSelector | None = None
        self._buffer = b""
        self._tmp = tempfile.TemporaryDirectory(prefix="lab-child-")
        self._log = open(Path(self._tmp.name) / "output.txt", "w+b")  # noqa: SIM115 - closed in close()
        requests_read, self._requests = os.pipe()
        self._answers, answers_write = os.pipe()
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(PACKAGE_ROOT), *_absolute(env.get("PYTHONPATH", ""))]),
            OMP_NUM_THREADS="1",
            PYTHONDONTWRITEBYTECODE="1",
            HOME=self._tmp.name,
            TMPDIR=self._tmp.name,
            MPLCONFIGDIR=self._tmp.name,
        )
        libc = _libc()
        paths, uid, gid = protected_paths(), os.getuid(), os.getgid()
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "paged_attention.lab.child",
                    str(requests_read),
                    str(answers_write),
                    str(time_limit),
                    str(memory_limit),
                    str(PACKAGE_ROOT),
                ],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                pass_fds=(requests_read, answers_write),
                cwd=self._tmp.name,
                env=env,
                start_new_session=True,
                preexec_fn=(lambda: _confine(libc, paths, uid, gid)) if libc is not None else None,
            )
        finally:
            os.close(requests_read)
            os.close(answers_write)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._answers, selectors.EVENT_READ)
        try:
            hello = self._exchange({"op": "hello"}, "starting the grader's child process")
            self.confined = bool(hello.get("confined"))
            reply = self._exchange(
                {
                    "op": "load",
                    "setup": exercise.setup,
                    "code": code,
                    "names": list(exercise.names),
                    "filename": f"<lab {exercise.exercise_id}>",
                },
                "loading the cell",
            )
            if "unfinished" in reply:
                raise NotImplementedError(reply["unfinished"])
            if "missing" in reply:
                raise CellError(f"the cell defines no {', '.join(reply['missing'])}")
            if "raised" in reply:
                error = reply["raised"]
                self._limit(error)
                where = f" at line {error['line']}" if error.get("line") else ""
                raise CellError(f"the cell raised {error['type']}{where}: {error['message']}")
            if "exited" in reply:
                raise CellError(
                    f"the cell called exit({reply['exited']}) while loading: a cell must only define "
                    f"{', '.join(exercise.names)}"
                )
        except BaseException:
            self.close()
            raise

    # -- the protocol -----------------------------------------------------------------------------
    def call(self, case: str, name: str, *args: Any, hint: str = "") -> Any:
        reply = self._exchange({"op": "call", "driver": name, "args": list(args)}, case)
        if "unfinished" in reply:
            raise NotImplementedError(reply["unfinished"])
        if "raised" in reply:
            self._limit(reply["raised"])
            raise raised(case, reply["raised"], hint)
        if "exited" in reply:
            raise CellError(f"{case}: the student's code called exit({reply['exited']})")
        if "value" not in reply:
            raise CellError(f"{case}: the child process answered {str(reply)[:200]!r}")
        return reply["value"]

    def _limit(self, error: dict[str, Any]) -> None:
        """An exception that says the memory limit was reached becomes :class:`LimitExceeded`."""
        text = f"{error.get('type')}: {error.get('message')}"
        if error.get("type") == "MemoryError" or "can't allocate memory" in text.lower():
            raise LimitExceeded(
                "memory", f"went past the memory limit of {self._memory_text()} ({text[:200]})"
            )

    def _memory_text(self) -> str:
        return f"{self.memory_limit / 2**20:,.0f} MiB"

    def _exchange(self, request: dict[str, Any], what: str) -> dict[str, Any]:
        self._number += 1
        request["number"] = self._number
        try:
            os.write(self._requests, (json.dumps(request) + "\n").encode())
        except (BrokenPipeError, OSError):
            self._ended(what)
        while True:
            line = self._line(what)
            try:
                reply = json.loads(line)
            except ValueError:
                raise CellError(f"{what}: the child process answered something that is not JSON") from None
            if isinstance(reply, dict) and reply.get("number") == self._number:
                return reply
            # anything else (a line the student's code wrote early, say) is not an answer: skip it

    def _line(self, what: str) -> bytes:
        while b"\n" not in self._buffer:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0 or not self._selector.select(remaining):
                self._kill()
                raise LimitExceeded("timeout", f"took longer than {self.time_limit:g} s ({what})")
            chunk = os.read(self._answers, 1 << 20)
            if not chunk:
                self._ended(what)
            self._buffer += chunk
            if len(self._buffer) > MAX_ANSWER:
                self._kill()
                raise CellError(f"{what}: an answer longer than {MAX_ANSWER >> 20} MB")
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _ended(self, what: str) -> None:
        """The child is gone before answering: say how it ended, and what it printed last."""
        try:
            status = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._kill()
            status = self.process.wait()
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        if status == -signal.SIGXCPU:
            raise LimitExceeded("timeout", f"used more than {self.time_limit:g} s of CPU ({what})")
        if status == -signal.SIGKILL:
            raise LimitExceeded("memory", f"was killed (the system's memory ran out?) while {what}")
        raise CellError(
            f"the process running the cell {how} while {what}, before it answered: a cell must only "
            f"define {', '.join(self.exercise.names)}{self._printed()}"
        )

    def _printed(self) -> str:
        self._log.flush()
        self._log.seek(0)
        lines = self._log.read()[-2000:].decode(errors="replace").strip().splitlines()[-3:]
        return f"; it printed last: {' | '.join(lines)}" if lines else ""

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def close(self) -> None:
        """Kill the child (and anything it started), and remove its files; once."""
        if self._closed:
            return
        self._closed = True
        if self.process is not None:
            self._kill()
            self.process.wait()
        for fd in (self._requests, self._answers):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._selector is not None:
            self._selector.close()
        self._log.close()
        self._tmp.cleanup()

    def __enter__(self) -> ChildStudent:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _absolute(pythonpath: str) -> list[str]:
    return [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]


__all__ = ["CellError", "CheckFailed", "ChildStudent", "LimitExceeded", "undumpable"]
