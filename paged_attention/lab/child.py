"""The grader's child process: ``python -m paged_attention.lab.child REQUESTS ANSWERS TIME MEMORY ROOT``.

It reads one JSON request per line from file descriptor ``REQUESTS`` and writes one JSON answer per
line, carrying the request's ``number``, to ``ANSWERS`` (see :mod:`.sandbox`, the parent):

* ``hello``: imports what the exercise needs (the module of its drivers, its ``setup``, and torch
  where the request asks: the cell names it), in the start-up time, not the student's; answers
  ``{"confined": bool}``, whether ``ROOT`` (the package) is read-only here, found out before any
  student code runs;
* ``load``: runs the exercise's imports and then the cell's code, limited from then on to ``TIME``
  seconds of CPU and ``MEMORY`` bytes of address space beyond the imports (not where CUDA is
  available, whose context reserves far more than it uses: torch says so where it is loaded, an
  NVIDIA device node where not); answers ``{}``, or
  ``{"missing": [names]}``, ``{"unfinished": message}``, ``{"raised": error}``, ``{"exited": code}``;
* ``call``: runs a driver (:mod:`.student`) on the cell's objects; answers ``{"value": result}`` or
  one of the above.

Nothing here decides a grade: the parent does, from these answers. Nothing is imported that the
exercise does not need: a child for a bookkeeping exercise (the free queue, the scheduling policy,
the n-gram proposer) starts without torch, in a fraction of the time.
"""

from __future__ import annotations

import errno
import importlib
import json
import linecache
import os
import resource
import sys
from pathlib import Path
from typing import Any

from .student import DRIVER_MODULES, describe, find_driver, to_json, unfinished


def _writable(root: str) -> bool:
    probe = Path(root) / f".lab-probe-{os.getpid()}"
    try:
        probe.touch()
    except OSError as err:
        return err.errno not in (errno.EROFS, errno.EACCES, errno.EPERM)
    probe.unlink()
    return True


def _address_space() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _limit(seconds: float, memory: int) -> None:
    cpu = int(seconds) + 5
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    # Not where CUDA is available: its context reserves far more address space than it uses. Where torch
    # is not loaded (the cell names none), an NVIDIA device node is what could make one.
    torch = sys.modules.get("torch")
    if not (torch.cuda.is_available() if torch is not None else os.path.exists("/dev/nvidiactl")):
        space = _address_space() + memory
        resource.setrlimit(resource.RLIMIT_AS, (space, space))


class _Session:
    def __init__(self, seconds: float, memory: int, root: str) -> None:
        self.seconds, self.memory, self.root = seconds, memory, root
        self.objects: tuple[Any, ...] = ()
        self.state: dict[str, Any] = {}
        self.filename, self.offset = "", 0

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "hello":
            reply = self._run(lambda: self._prepare(request))
            return {**reply, "confined": not _writable(self.root)}
        if op == "load":
            return self._run(lambda: self._load(request))
        if op == "call":
            function = find_driver(request["driver"])
            return self._run(lambda: {"value": function(self.state, self.objects, *request["args"])})
        return {"raised": {"type": "ValueError", "message": f"unknown op {op!r}", "line": None}}

    @staticmethod
    def _prepare(request: dict[str, Any]) -> dict[str, Any]:
        drivers = request["drivers"]
        if drivers not in DRIVER_MODULES:
            raise ValueError(f"drivers must be one of {DRIVER_MODULES}, got {drivers!r}")
        importlib.import_module(f"{__package__}.{drivers}")
        if request["torch"]:
            import torch  # noqa: F401
        exec(compile(request["setup"], "<setup>", "exec"), {"__name__": "__lab__"})
        return {}

    def _load(self, request: dict[str, Any]) -> dict[str, Any]:
        setup, code = request["setup"], request["code"]
        self.filename, self.offset = request["filename"], setup.count("\n")
        namespace: dict[str, Any] = {"__name__": "__lab__"}
        exec(compile(setup, "<setup>", "exec"), namespace)  # the exercise's imports, before the limits
        source = setup + code
        # Triton reads a kernel's source through linecache: register the cell's text under its name.
        linecache.cache[self.filename] = (len(source), None, source.splitlines(keepends=True), self.filename)
        _limit(self.seconds, self.memory)
        exec(compile(source, self.filename, "exec"), namespace)  # the student's code, in this process only
        missing = [name for name in request["names"] if name not in namespace]
        if missing:
            return {"missing": missing}
        self.objects = tuple(namespace[name] for name in request["names"])
        return {}

    def _run(self, action: Any) -> dict[str, Any]:
        try:
            return action()
        except SystemExit as err:
            return {"exited": err.code if isinstance(err.code, int) else str(err.code)}
        except Exception as err:
            stub = unfinished(err)
            if stub is not None:
                return {"unfinished": str(stub) or "NotImplementedError"}
            return {"raised": describe(err, {self.filename}, self.offset)}


def main(argv: list[str]) -> int:
    requests_fd, answers_fd, seconds, memory, root = argv
    requests = os.fdopen(int(requests_fd), "rb")
    answers = os.fdopen(int(answers_fd), "wb")
    session = _Session(float(seconds), int(memory), root)
    for line in requests:
        request = json.loads(line)
        reply = session.answer(request)
        reply["number"] = request.get("number")
        try:
            answers.write(to_json(reply).encode() + b"\n")
        except MemoryError:
            answers.write(
                to_json(
                    {
                        "number": reply["number"],
                        "raised": {"type": "MemoryError", "message": "", "line": None},
                    }
                ).encode()
                + b"\n"
            )
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
