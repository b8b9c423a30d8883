"""The student flow in a real browser: JupyterLab (started as ``make lab`` starts it) driven by
headless Chromium through Selenium.

A student opens a notebook of the student build, clicks Run > Run All Cells, and every cell after
the unfinished exercise still runs (the build tags exercise and check cells ``raises-exception``,
and TEACHING.md promises that Run All goes on past them). Then the student types an answer into
the exercise cell, runs it and its check cell, and sees the pass line.

Needs Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them with apt-get) and
the ``selenium`` package; where either is missing the test skips, saying which.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from paged_attention.lab.notebook import build
from paged_attention.serving.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "01_kv_cache.ipynb"
ANSWER = "return 2 * num_layers * num_kv_heads * head_dim * bytes_per_value"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install -e .[dev])")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="BROWSER TEST SKIPPED: Debian's chromium and chromium-driver are not installed "
    "(apt-get install chromium chromium-driver; .ci/run does it)",
)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture()
def lab(tmp_path: Path):
    """JupyterLab on a student build of the notebook, as ``make lab`` runs it (``--allow-root`` as
    root), headless on a free 127.0.0.1 port, with every cell kept in the page (no windowing)."""
    student = tmp_path / "student"
    build([ROOT / "notebooks" / NOTEBOOK], student)
    settings = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port = free_port()
    jupyter = Path(sys.executable).with_name("jupyter")
    args = [
        str(jupyter),
        "lab",
        "--no-browser",
        f"--port={port}",
        "--ServerApp.ip=127.0.0.1",
        "--IdentityProvider.token=",
        f"--ServerApp.root_dir={student}",
        f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
        f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
    ]
    if os.getuid() == 0:
        args.append("--allow-root")
    log = open(tmp_path / "jupyter.log", "w+")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    log.seek(0)
                    pytest.fail(f"JupyterLab did not start:\n{log.read()[-3000:]}")
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", student
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


@pytest.fixture()
def browser(tmp_path: Path):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        yield driver
    except BaseException:
        driver.save_screenshot(str(tmp_path / "failure.png"))
        raise
    finally:
        driver.quit()


def prompts(driver) -> list[str]:
    """Each code cell's input prompt, e.g. ``[3]:``, ``[*]:`` (running or queued) or ``[ ]:``."""
    return [p.text.strip() for p in driver.find_elements(By.CSS_SELECTOR, ".jp-CodeCell .jp-InputPrompt")]


def code_cells(driver) -> list:
    return driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")


def wait_idle(driver, timeout: float) -> None:
    """Until no cell is queued or running and the kernel is idle."""

    def idle(d) -> bool:
        shown = prompts(d)
        status = d.find_elements(By.CSS_SELECTOR, ".jp-Notebook-ExecutionIndicator[data-status='idle']")
        return bool(shown) and not any("*" in p for p in shown) and bool(status)

    WebDriverWait(driver, timeout, poll_frequency=0.5).until(idle)


def click_menu(driver, menu: str, label: str) -> None:
    """Click ``menu`` in the menu bar, then its item whose label is ``label``."""
    items = driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-item")
    next(i for i in items if i.text.strip() == menu).click()

    def item(d):
        found = d.find_elements(By.CSS_SELECTOR, ".lm-Menu-item .lm-Menu-itemLabel")
        return next((i for i in found if i.text.strip() == label), None)

    WebDriverWait(driver, 10).until(item).click()


def test_run_all_goes_past_the_unfinished_exercise_and_a_typed_answer_passes(lab, browser) -> None:
    url, student = lab
    nb = json.loads((student / NOTEBOOK).read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    exercise = next(i for i, c in enumerate(code) if "lab:01.kv_bytes" in c["metadata"].get("tags", []))
    check = next(i for i, c in enumerate(code) if i > exercise and "check(" in "".join(c["source"]))

    browser.get(f"{url}/lab/tree/{NOTEBOOK}")
    WebDriverWait(browser, 120).until(lambda d: len(code_cells(d)) == len(code))
    WebDriverWait(browser, 120).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, ".jp-Notebook-ExecutionIndicator[data-status='idle']")
    )

    click_menu(browser, "Run", "Run All Cells")
    wait_idle(browser, 300)
    shown = prompts(browser)
    unrun = [i for i, p in enumerate(shown) if p in ("[ ]:", "")]
    assert not unrun, f"Run All stopped: code cells {unrun} never ran (prompts {shown})"
    cells = code_cells(browser)
    assert "NotImplementedError" in cells[exercise].text and "Exercise 01.kv_bytes" in cells[check].text
    assert len(code) - 1 > check, "the notebook goes on after the check cell"
    assert all(p.startswith("[") and p[1:-2].isdigit() for p in shown[check + 1 :]), shown

    editor = cells[exercise].find_element(By.CSS_SELECTOR, ".cm-content")
    editor.click()
    actions = webdriver.ActionChains(browser)
    actions.key_down(Keys.CONTROL).send_keys(Keys.END).key_up(Keys.CONTROL)  # the stub's raise: the last line
    actions.key_down(Keys.SHIFT).send_keys(Keys.HOME).key_up(Keys.SHIFT).send_keys(ANSWER)
    actions.key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT)  # run it, move to the next cell
    actions.perform()
    wait_idle(browser, 60)
    assert ANSWER in code_cells(browser)[exercise].text
    code_cells(browser)[check].find_element(By.CSS_SELECTOR, ".cm-content").click()
    webdriver.ActionChains(browser).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    wait_idle(browser, 60)
    WebDriverWait(browser, 30).until(lambda d: "✓ 01.kv_bytes" in code_cells(d)[check].text)
    assert "NotImplementedError" not in code_cells(browser)[check].text
