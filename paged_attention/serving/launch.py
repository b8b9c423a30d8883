"""Running the server: in the foreground (the ``serve`` command), in a thread, or as a child process.

* :func:`run` blocks until SIGINT/SIGTERM (uvicorn's handlers); the app's lifespan then aborts
  what is running and stops the engine loop, so the process ends cleanly.
* :class:`ServerThread` runs the same app in a background thread of this process (tests: one
  model load, many requests); ``stop()`` ends it.
* :class:`ServerProcess` starts ``python -m paged_attention serve ...`` as a child (a notebook, the
  measured experiment): it waits for ``/health``, and ``stop()`` (or leaving its ``with`` block,
  even on an error) sends SIGINT, then kills it if it has not ended in time.

All of them listen on 127.0.0.1 unless told otherwise; :func:`free_port` asks the OS for a port.
"""

from __future__ import annotations

import atexit
import contextlib
import os
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


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port nobody listens on now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def run(app: FastAPI, host: str = LOCALHOST, port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then return (the process exits 0 after either)."""
    # uvicorn shuts down cleanly on either signal, then raises it again against the handler it found:
    # SIGINT's KeyboardInterrupt it catches itself, but SIGTERM's default handler would kill the
    # process (status -15) after its clean shutdown. A SIGTERM handler that does nothing lets run return.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
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
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(
            app, host=self.host, port=self.port, log_level="warning", timeout_graceful_shutdown=5
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60) -> ServerThread:
        self.thread.start()
        wait_healthy(self.url, timeout)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


class ServerProcess:
    """``python -m paged_attention serve <args>`` as a child process on 127.0.0.1 and a free port.

    Its output goes to ``log`` (a file path) or is discarded. Use it in a ``with`` block, so that
    the server is stopped however the block ends; a started server is also stopped when this
    process exits, and (on Linux, started from the main thread) gets SIGTERM if this process dies."""

    def __init__(
        self,
        args: Sequence[str] = (),
        port: int | None = None,
        log: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 180,
    ) -> None:
        self.port = port or free_port()
        self.args = [
            sys.executable,
            "-m",
            "paged_attention",
            "serve",
            "--host",
            LOCALHOST,
            "--port",
            str(self.port),
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
            # the kernel sends it when the *thread* that started the child ends: only the main thread
            preexec_fn=die_with_parent if sys.platform == "linux" and _in_main_thread() else None,
        )
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
