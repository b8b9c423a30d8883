"""``make lab`` opens JupyterLab on the notebooks, as root too (course containers run as root)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from paged_attention.serving.launch import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("make") is None or not (ROOT / ".venv" / ".installed").exists(),
                    reason="needs make and the Makefile's .venv")  # fmt: skip
def test_make_lab_serves_the_notebooks_headless() -> None:
    port = free_port()
    args = f"--no-browser --port={port} --ServerApp.ip=127.0.0.1 --IdentityProvider.token="
    server = subprocess.Popen(["make", "-s", "lab", f"LAB_ARGS={args}"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        listing = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents", timeout=5) as reply:
                    listing = json.load(reply)
                    break
            except OSError:
                time.sleep(0.5)
        printed = server.stdout.read() if server.poll() is not None else "(still running)"
        assert listing is not None, f"JupyterLab did not answer; it printed:\n{printed}"
        names = {item["name"] for item in listing["content"]}
        assert {p.name for p in (ROOT / "notebooks").glob("*.ipynb")} <= names
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
