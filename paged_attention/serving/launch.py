"""Running the server: in the foreground (the ``serve`` command), in a thread, or as a child process.

* :func:`run` blocks until SIGINT/SIGTERM (uvicorn's handlers); the app's lifespan then aborts
  what is running and stops the engine loop, so the process ends cleanly.
* :class:`ServerThread` runs the same app in a background thread of this process (tests: one
  model load, many requests); ``stop()`` ends it.
* :class:`ServerProcess` starts ``python -m paged_attention serve ...`` as a child (a notebook, the
  measured experiment): it waits for ``/health``, and ``stop()`` (or leaving its ``with`` block,
  even on an error) sends SIGINT, then kills it if it has not ended in time.

All of them listen on 127.0.0.1 unless told otherwise. Given no port, the thread and the child serve
on a socket this process has already bound (:func:`listening_socket`; the child inherits it, ``serve
--fd``): a port chosen first and bound seconds later, by a child still importing torch, can be taken
in between by anyone's outgoing connection (``address already in use``). :func:`free_port` is for
servers that cannot take a socket (the real vLLM): it picks a port outside the range the OS hands to
outgoing connections, which shrinks that window's risk without closing it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from ..engine.engine_core import die_with_parent

LOCALHOST = "127.0.0.1"


def listening_socket(host: str = LOCALHOST, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``0``: a free port, the OS's choice) and listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except BaseException:
        sock.close()
        raise
    return sock


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port nobody uses now, below the range of ports the OS gives outgoing connections
    (the OS's choice when that range cannot be read or no port below it is free)."""
    low = _ephemeral_low()
    for port in random.SystemRandom().sample(range(1024, low), min(64, max(0, low - 1024))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of Linux's ``ip_local_port_range`` (1024 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 1024


def run(
    app: FastAPI, host: str = LOCALHOST, port: int = 8000, log_level: str = "info", fd: int | None = None
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then return (the process exits 0 after either).

    ``fd``: serve on this inherited, already listening socket (``host``/``port`` then only name it)."""
    # uvicorn shuts down cleanly on either signal, then raises it again against the handler it found:
    # SIGINT's KeyboardInterrupt it catches itself, but SIGTERM's default handler would kill the
    # process (status -15) after its clean shutdown. A SIGTERM handler that does nothing lets run return.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        if fd is None:
            uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
            return
        sock = socket.socket(fileno=fd)  # family and type read from the descriptor
        sock.set_inheritable(False)  # the engine core's process need not hold it
        server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
        )
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[sock])
        if not server.started:
            raise SystemExit(3)  # uvicorn's status for a server that never started
    finally:
        signal.signal(signal.SIGTERM, previous)


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Wait until ``url/health`` answers 200; raise ``TimeoutError`` (or ``RuntimeError`` if
    ``process`` ended first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before it was healthy")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=1) as answer:
            if answer.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"no healthy server at {url} after {timeout:.0f} s")


class ServerThread:
    """``app`` served by uvicorn in a daemon thread of this process, on ``host:port``."""

    def __init__(self, app: FastAPI, host: str = LOCALHOST, port: int | None = None) -> None:
        self.socket = listening_socket(host, port or 0)  # bound now: no one can take the port
        self.host, self.port = host, self.socket.getsockname()[1]
        config = uvicorn.Config(
            app, host=self.host, port=self.port, log_level="warning", timeout_graceful_shutdown=5
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="uvicorn", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60) -> ServerThread:
        self.thread.start()
        wait_healthy(self.url, timeout)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        self.socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


class ServerProcess:
    """``python -m paged_attention serve <args>`` as a child process on 127.0.0.1 and a free port.

    Given no ``port``, the child serves on a socket bound here and handed over (``--fd``), so the
    port is the child's from the start. Its output goes to ``log`` (a file path) or is discarded.
    Use it in a ``with`` block, so that the server is stopped however the block ends; a started
    server is also stopped when this process exits, and (on Linux, started from the main thread)
    gets SIGTERM if this process dies."""

    def __init__(
        self,
        args: Sequence[str] = (),
        port: int | None = None,
        log: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 180,
    ) -> None:
        self.socket = None if port else listening_socket()
        self.port = port or self.socket.getsockname()[1]
        handover = ["--fd", str(self.socket.fileno())] if self.socket else []
        self.args = [
            sys.executable,
            "-m",
            "paged_attention",
            "serve",
            "--host",
            LOCALHOST,
            "--port",
            str(self.port),
            *handover,
            *args,
        ]
        self.log, self.env, self.startup_timeout = log, env, startup_timeout
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    def start(self) -> ServerProcess:
        output = open(self.log, "w") if self.log else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
        self.process = subprocess.Popen(
            self.args,
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(self.env or {})},
            pass_fds=(self.socket.fileno(),) if self.socket else (),
            # the kernel sends it when the *thread* that started the child ends: only the main thread
            preexec_fn=die_with_parent if sys.platform == "linux" and _in_main_thread() else None,
        )
        if self.socket:
            self.socket.close()  # the child holds its copy; the port is free again when it ends
        try:
            wait_healthy(self.url, self.startup_timeout, self.process)
        except BaseException:
            self.stop()
            tail = Path(self.log).read_text()[-2000:] if self.log else ""
            raise RuntimeError(f"the server did not start: {' '.join(self.args)}\n{tail}") from None
        atexit.register(self.stop)  # a notebook kernel that ends (or dies) takes its server along
        return self

    def stop(self, timeout: float = 20) -> int | None:
        """SIGINT, then SIGKILL if it has not ended within ``timeout`` s; returns its exit status."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
