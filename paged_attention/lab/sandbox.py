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
  seconds by the parent's clock, counted once the child has started (Python and its imports get
  :data:`STARTUP_LIMIT` of their own), or the child is killed: ``timeout``;
* **memory**: the child may take ``memory_limit`` bytes of address space beyond what its imports
  took (``RLIMIT_AS``; not where CUDA is available, whose context reserves far more address space
  than it uses); beyond, allocations fail: ``memory``;
* **files**: where the operating system allows it (root, or unprivileged user namespaces), the
  child runs in a mount namespace in which every file system is read-only but its own temporary
  folder, so a cell cannot patch the package, Python or anything else on disk for a later run;
  :attr:`ChildStudent.confined` says whether that held. In any case the child keeps no
  capability and may gain none, and the parent makes itself non-dumpable while children live, so
  that no child can read or write its memory;
* **the pipe**: requests and answers travel on two pipes of their own; the child's stdout and
  stderr go to a file (its last lines are quoted on an error), and answers carry the request's
  number, so nothing printed or written early can pass for an answer.

What it cannot stop on its own: code in the child that reaches the package's reference (the child
must import the package to build the cases' objects) and reports its answers, or that starts a
process in a session of its own, which outlives the kill. The grader's screen
(:func:`~.grader.screen`) refuses the cells that try either before anything runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .checking import CheckFailed
from .registry import Exercise
from .student import Student, raised

TIME_LIMIT = 300.0  # seconds per exercise, from the moment the child has started
STARTUP_LIMIT = 120.0  # seconds for the child to start Python and import what the exercise needs
#: An exercise whose setup or cell names torch gets it imported in the child's start-up, before the
#: limits (as the exercise's own imports are); the others start without it (see :mod:`.child`).
NAMES_TORCH = re.compile(r"\btorch\b")
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


_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
# mount options a read-only remount must keep (a user namespace may not drop them)
_KEPT = {
    "nosuid": 2,
    "nodev": 4,
    "noexec": 8,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
    "strictatime": 1 << 24,
}
_VIRTUAL = ("/proc", "/sys", "/dev")


def mount_points() -> list[tuple[str, int]]:
    """Every mount point but the kernel's virtual ones, with the options a remount must keep: what
    the child makes read-only (read here, before the fork)."""
    found = []
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        if any(point == v or point.startswith(v + "/") for v in _VIRTUAL):
            continue
        flags = sum(_KEPT.get(option, 0) for option in fields[3].split(","))
        found.append((point, flags))
    return found


def _confine(
    libc: Any, mounts: list[tuple[str, int]], writable: str, uid: int, gid: int
) -> None:  # pragma: no cover
    """Runs in the child between fork and exec: die with the parent; where allowed, a mount namespace
    in which every file system is read-only but ``writable`` (the child's own folder); then, in any
    case, every capability dropped and no new privileges (see the module docstring)."""
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if _namespace(libc, uid, gid):
        target = writable.encode()
        libc.mount(target, target, None, _MS_BIND, None)  # its own mount, left writable
        for point, flags in mounts:
            path = point.encode()
            libc.mount(None, path, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | flags, None)
    for capability in range(64):  # an empty bounding set: exec grants no capability, even to root
        libc.prctl(24, capability, 0, 0, 0)  # PR_CAPBSET_DROP
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS


def _namespace(libc: Any, uid: int, gid: int) -> bool:  # pragma: no cover - in the child
    """A mount namespace of the child's own (through a user namespace where plain unsharing is not
    allowed), with mounts private to it; False where neither is allowed."""
    if libc.unshare(_CLONE_NEWNS) != 0:
        if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS) != 0:
            return False
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with contextlib.suppress(OSError), open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    return libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) == 0


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
        if not (0 < time_limit < 1e6):
            raise ValueError(f"time_limit must be a number of seconds in (0, 1e6), got {time_limit!r}")
        self.exercise = exercise
        self.time_limit, self.memory_limit = time_limit, memory_limit
        self.deadline = time.monotonic() + STARTUP_LIMIT  # starting Python and the exercise's imports
        self.confined = False
        self._number = 0
        self._closed = False
        self.process: subprocess.Popen | None = None
        self._selector: selectors.BaseSelector | None = None
        self._buffer = b""
        self._tmp = tempfile.TemporaryDirectory(prefix="lab-child-")
        self._log = open(Path(self._tmp.name) / "output.txt", "w+b")  # noqa: SIM115 - closed in close()
        self._requests = self._answers = -1
        try:
            self._start(exercise, code)
        except BaseException:
            self.close()
            raise

    def _start(self, exercise: Exercise, code: str) -> None:
        requests_read, self._requests = os.pipe()
        self._answers, answers_write = os.pipe()
        env = dict(os.environ)  # with TRITON_INTERPRET where this process set it: the child needs no torch
        env.update(
            PYTHONPATH=os.pathsep.join([str(PACKAGE_ROOT), *_absolute(env.get("PYTHONPATH", ""))]),
            OMP_NUM_THREADS="1",
            PYTHONDONTWRITEBYTECODE="1",
            PYTHONNOUSERSITE="1",
            HOME=self._tmp.name,
            TMPDIR=self._tmp.name,
            MPLCONFIGDIR=self._tmp.name,
        )
        libc = _libc()
        mounts, writable, uid, gid = mount_points(), self._tmp.name, os.getuid(), os.getgid()
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "paged_attention.lab.child",
                    str(requests_read),
                    str(answers_write),
                    str(self.time_limit),
                    str(self.memory_limit),
                    str(PACKAGE_ROOT),
                ],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                pass_fds=(requests_read, answers_write),
                cwd=self._tmp.name,
                env=env,
                start_new_session=True,
                preexec_fn=(lambda: _confine(libc, mounts, writable, uid, gid)) if libc is not None else None,
            )
        finally:
            os.close(requests_read)
            os.close(answers_write)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._answers, selectors.EVENT_READ)
        needs = {  # imported by the child in its start-up time, not the student's
            "drivers": exercise.checker.partition(":")[0],
            "setup": exercise.setup,
            "torch": bool(NAMES_TORCH.search(exercise.setup + code)),
        }
        hello = self._exchange({"op": "hello", **needs}, "starting the grader's child process")
        self.confined = bool(hello.get("confined"))
        self.deadline = time.monotonic() + self.time_limit  # the student's time starts here
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
            raise CellError(f"the cell defines no {', '.join(map(str, reply['missing']))}")
        if "raised" in reply:
            error = reply["raised"]
            self._limit(error)
            where = f" at line {error.get('line')}" if error.get("line") else ""
            raise CellError(f"the cell raised {error.get('type')}{where}: {error.get('message')}")
        if "exited" in reply:
            raise CellError(
                f"the cell called exit({reply['exited']}) while loading: a cell must only define "
                f"{', '.join(exercise.names)}"
            )

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
            except (ValueError, RecursionError):
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
            if fd >= 0:
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
