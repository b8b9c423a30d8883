"""vLLM's own offline-inference examples run here with only their import lines and model names changed.

The scripts are copies of ``examples/offline_inference/`` in https://github.com/vllm-project/vllm
(Apache-2.0), kept under ``tests/vllm_examples/`` byte for byte except the lines listed in each copy's
header (``from vllm... import X`` -> ``from paged_attention import X``; the model name ->
``"paged-attention/tiny-llama"``). ``tests/vllm_examples/README.md`` says which scripts were taken,
which were left out and why, and the API each one needs.

How they run: every script as ``python script.py`` would (``__name__ == "__main__"``, ``sys.argv ==
[script]``, its folder first on ``sys.path``, in a fresh working folder, with ``HF_HUB_OFFLINE=1``
and ``OMP_NUM_THREADS=1``),
but several in one process, because importing torch and transformers costs several seconds and the
scripts themselves take about a second each on the tiny model. :func:`_run_scripts` (this file run
as a program) gives each script its own stdout and stderr files (at the file-descriptor level, so
C code and handlers made by an earlier script write there too), restores the environment, the
working folder, ``sys.argv`` and ``sys.path`` after it, and stops it after :data:`SCRIPT_TIMEOUT_S`.

Two such processes run at once: one for most scripts, one for the two profiling scripts (each ends
in vLLM's ``time.sleep(10)``, which then overlaps the other process's work) and for a second run
of ``reproducibility.py``. Each process runs ``reproducibility.py`` first, so the two runs start
from the same fresh state, and their outputs must be equal: that is the script's promise (same
text, and the same ``random.randint`` after it, across runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE / "vllm_examples"
TINY = '"paged-attention/tiny-llama"'
#: The real model, for the scripts that need a chat template or a prompt longer than the tiny
#: model's 1,024 positions (chat.py, basic/chat.py, context_extension.py, automatic_prefix_caching.py).
SMOLLM2 = '"HuggingFaceTB/SmolLM2-135M-Instruct"'
#: vLLM's argparse subclass (vllm.utils.FlexibleArgumentParser) becomes the standard library's.
STDLIB_PARSER = "from argparse import ArgumentParser as FlexibleArgumentParser"
MARK = "# --- original file follows ---"

SCRIPT_TIMEOUT_S = 120

#: The runs of the profiling process (the rest go to the main process); reproducibility.py runs first in both.
PROFILING = ("simple_profiling.py", "simple_profiling_26d25d4.py")


# -- the runner: `python tests/test_vllm_examples.py JOBS.json RESULTS.json` -----------------------------
def _run_scripts(jobs_file: str, results_file: str) -> None:
    """Run each job's script as ``__main__`` in this process, one after another (see the module
    docstring); write ``{"rc", "seconds"}`` per job to ``results_file`` after each one, so that a
    crash of the whole process still leaves the results of the scripts before it."""
    import gc
    import runpy
    import signal
    import traceback

    class ScriptTimeout(BaseException):  # not an Exception: a script's `except Exception` must not swallow it
        pass

    def on_alarm(signum, frame):
        raise ScriptTimeout(f"the script ran past {SCRIPT_TIMEOUT_S} s")

    signal.signal(signal.SIGALRM, on_alarm)
    jobs = json.loads(Path(jobs_file).read_text())
    results: list[dict] = []
    for job in jobs:
        script = job["script"]
        saved_env, saved_cwd = dict(os.environ), os.getcwd()
        saved_argv, saved_path = sys.argv[:], sys.path[:]
        sys.stdout.flush()
        sys.stderr.flush()
        saved_fds = os.dup(1), os.dup(2)
        with open(job["out"], "wb") as out, open(job["err"], "wb") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            os.chdir(job["cwd"])
            sys.argv = [script]
            sys.path[0] = str(Path(script).parent)
            start = time.perf_counter()
            signal.alarm(SCRIPT_TIMEOUT_S)
            try:
                runpy.run_path(script, run_name="__main__")
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
                rc = 1
            finally:
                signal.alarm(0)
            seconds = time.perf_counter() - start
            sys.stdout.flush()
            sys.stderr.flush()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv, sys.path[:] = saved_argv, saved_path
        gc.collect()
        results.append({"rc": rc, "seconds": round(seconds, 2)})
        Path(results_file).write_text(json.dumps(results))


# -- the copies and what each promises ---------------------------------------------------------------
def _prompt_lines(out: str) -> list[str]:
    return re.findall(r"^Prompt: ['\"].*['\"], Generated text: .*$", out, re.M)


def _check_four_prompts(out: str, cwd: Path) -> None:
    assert len(_prompt_lines(out)) == 4, "expected one 'Prompt: ..., Generated text: ...' line per prompt"


def _check_basic_basic(out: str, cwd: Path) -> None:
    assert len(re.findall(r"^Prompt:    ['\"]", out, re.M)) == 4
    assert len(re.findall(r"^Output:    ", out, re.M)) == 4


def _check_chat(out: str, cwd: Path) -> None:
    # One conversation, then a batch of ten.
    assert len(re.findall(r"^Generated text: ", out, re.M)) == 11


def _check_context_extension(out: str, cwd: Path) -> None:
    assert len(re.findall(r"^Generated text: ", out, re.M)) == 1


def _check_old_chat(out: str, cwd: Path) -> None:
    assert len(_prompt_lines(out)) == 11


def _check_cpu_weight_loading(out: str, cwd: Path) -> None:
    # Example 2 may fail and say so (the script allows it); examples 1 and 3 may not.
    assert "=== Example 1" in out and "=== Example 3" in out
    assert len(re.findall(r"^Output: ", out, re.M)) >= 2


def _check_apc(out: str, cwd: Path) -> None:
    # Both queries answered (the second is meant to be faster; timings are not checked on a shared CPU).
    assert len(re.findall(r"^Output: ", out, re.M)) == 2
    assert len(re.findall(r"^Generation time: [0-9.e-]+ seconds\.$", out, re.M)) == 2


def _check_prefix_caching(out: str, cwd: Path) -> None:
    # The script's own comparison: the same greedy answers with and without prefix caching.
    assert "Generated answers are the same: True" in out
    assert len(_prompt_lines(out)) == 8


def _check_reproducibility(out: str, cwd: Path) -> None:
    assert len(re.findall(r"^Generated text: ", out, re.M)) == 4
    assert re.search(r"^\d+$", out, re.M), "the random.randint(0, 100) line is missing"


def _request_outputs(out: str) -> list[str]:
    return re.findall(r"^RequestOutput\(.*$", out, re.M)


def _finished(printed: list[str], request_id: int) -> list[str]:
    # vLLM prints request_id=0; a repr'd string id ('0') is as good.
    return [line for line in printed if re.match(rf"RequestOutput\(request_id='?{request_id}'?,", line)]


def _check_llm_engine_example(out: str, cwd: Path) -> None:
    printed = _request_outputs(out)
    assert len(printed) == 3, "expected one finished RequestOutput per request"
    for i in range(3):
        assert _finished(printed, i), f"request {i} never finished"
    assert "CompletionOutput(index=1" in _finished(printed, 2)[0], "request 2 asked for n=2 samples"


def _check_reset_kv(out: str, cwd: Path) -> None:
    assert "Resetting prefix cache at 10" in out
    printed = _request_outputs(out)
    assert len(printed) == 4, "expected one finished RequestOutput per request"
    for i in range(4):
        assert _finished(printed, i), f"request {i} never finished"
    assert "CompletionOutput(index=1" in _finished(printed, 3)[0], "request 3 asked for n=2 samples"


def _check_metrics(out: str, cwd: Path) -> None:
    for kind in ("(gauge) = ", "(counter) = ", "(histogram)"):
        assert kind in out, f"no metric printed as {kind.strip()}"
    generated = re.search(r"^vllm:generation_tokens \(counter\) = ([0-9.]+)$", out, re.M)
    assert generated and float(generated.group(1)) > 0, "vllm:generation_tokens counted nothing"


def _check_profiling(prompt_lines: Callable[[str], int]) -> Callable[[str, Path], None]:
    def check(out: str, cwd: Path) -> None:
        assert prompt_lines(out) == 4
        folder = cwd / "vllm_profile"
        assert folder.is_dir() and any(folder.iterdir()), f"no trace written in {folder}"

    return check


#: Every copy under tests/vllm_examples/ (a test keeps this list and the folder equal), with its check.
SCRIPTS: dict[str, Callable[[str, Path], None]] = {
    "reproducibility.py": _check_reproducibility,
    "automatic_prefix_caching.py": _check_apc,
    "basic.py": _check_four_prompts,
    "basic/basic.py": _check_basic_basic,
    "basic/chat.py": _check_chat,
    "basic/cpu_weight_loading.py": _check_cpu_weight_loading,
    "basic/generate.py": _check_four_prompts,
    "basic_with_model_default_sampling.py": _check_four_prompts,
    "chat.py": _check_old_chat,
    "cli.py": _check_four_prompts,
    "context_extension.py": _check_context_extension,
    "llm_engine_example.py": _check_llm_engine_example,
    "llm_engine_reset_kv.py": _check_reset_kv,
    "metrics.py": _check_metrics,
    "prefix_caching.py": _check_prefix_caching,
    "simple_profiling.py": _check_profiling(lambda out: len(re.findall(r"^Prompt: ['\"]", out, re.M))),
    "simple_profiling_26d25d4.py": _check_profiling(lambda out: len(_prompt_lines(out))),
}


def _copies() -> list[str]:
    return sorted(p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*.py"))


def test_every_copy_is_run() -> None:
    assert sorted(SCRIPTS) == _copies()


# -- each copy is vLLM's file with only the listed lines changed --------------------------------------
def _header(text: str) -> tuple[dict[str, str], list[tuple[str, str]], str]:
    head, sep, body = text.partition(MARK + "\n")
    assert sep, f"no {MARK!r} line"
    fields = dict(re.findall(r"^# (source|commit|sha256 of the original): (.*)$", head, re.M))
    signs = re.findall(r"^#   ([-+]) (.*)$", head, re.M)
    assert [s for s, _ in signs] == ["-", "+"] * (len(signs) // 2), "changes must be - / + pairs"
    pairs = [(signs[i][1], signs[i + 1][1]) for i in range(0, len(signs), 2)]
    return fields, pairs, body


def _allowed(old: str, new: str) -> bool:
    """An import moved from vllm (any submodule) to paged_attention's top level (vLLM's
    ``FlexibleArgumentParser``: to the standard library's ``ArgumentParser``), or a model name (one
    string literal) replaced by the tiny model's or SmolLM2's."""
    moved = re.fullmatch(r"from vllm(\.\w+)* import (.+)", old)
    if moved:
        if moved.group(2) == "FlexibleArgumentParser":
            return new == STDLIB_PARSER
        return new == f"from paged_attention import {moved.group(2)}"
    return any(
        old.replace(lit, model, 1) == new for lit in re.findall(r'"[^"]*"', old) for model in (TINY, SMOLLM2)
    )


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_copy_is_vllms_file_with_only_the_listed_changes(name: str) -> None:
    fields, pairs, body = _header((EXAMPLES / name).read_text())
    assert fields["source"].startswith("examples/offline_inference/")
    assert re.fullmatch(r"[0-9a-f]{40}", fields["commit"])
    assert pairs, "no change listed"
    for old, new in pairs:
        assert _allowed(old, new), f"not an import or model-name change: {old!r} -> {new!r}"
    # Undo the changes, in order, and the original must come back byte for byte.
    lines, todo = body.split("\n"), list(pairs)
    for i, line in enumerate(lines):
        if todo and line == todo[0][1]:
            lines[i] = todo.pop(0)[0]
    assert not todo, f"listed changes not found in the file: {todo}"
    original = "\n".join(lines)
    assert hashlib.sha256(original.encode()).hexdigest() == fields["sha256 of the original"]
    assert not re.search(r"^\s*(from|import)\s+vllm\b", body, re.M), "a vllm import is left"


# -- running them ----------------------------------------------------------------------------------------
def _launch(jobs: list[dict], folder: Path) -> tuple[subprocess.Popen, Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    jobs_file, results_file, log = folder / "jobs.json", folder / "results.json", folder / "runner.log"
    jobs_file.write_text(json.dumps(jobs))
    # One thread each, as the notebook tests do: with torch's default on a busy two-core runner, each
    # script takes ~9 s instead of ~0.7 s.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(jobs_file), str(results_file)],
            cwd=folder, env=env, stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return proc, results_file, log


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Run every copy once (reproducibility.py twice, as "reproducibility.py#2"); per run: rc,
    seconds, stdout, stderr, cwd."""
    root = tmp_path_factory.mktemp("vllm_examples")

    def job(name: str, key: str) -> dict:
        cwd = root / key.replace("/", "__").replace("#", "_run")
        cwd.mkdir()
        return {"key": key, "script": str(EXAMPLES / name), "cwd": str(cwd),
                "out": str(cwd / "stdout.txt"), "err": str(cwd / "stderr.txt")}  # fmt: skip

    main = [job(n, n) for n in SCRIPTS if n not in PROFILING]
    side = [job("reproducibility.py", "reproducibility.py#2")] + [job(n, n) for n in PROFILING]
    launched = [(_launch(jobs, root / f"runner{i}"), jobs) for i, jobs in enumerate((main, side))]
    runs: dict[str, dict] = {}
    for (proc, results_file, log), jobs in launched:
        try:
            proc.wait(timeout=SCRIPT_TIMEOUT_S * len(jobs) + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        results = json.loads(results_file.read_text()) if results_file.exists() else []
        runner_log = log.read_text(errors="replace")[-3000:]
        for i, j in enumerate(jobs):
            result = results[i] if i < len(results) else {"rc": None, "seconds": None}
            runs[j["key"]] = {
                **result,
                "stdout": Path(j["out"]).read_text(errors="replace") if Path(j["out"]).exists() else "",
                "stderr": Path(j["err"]).read_text(errors="replace") if Path(j["err"]).exists() else "",
                "cwd": Path(j["cwd"]),
                "runner_log": runner_log if i >= len(results) else "",
            }
    return runs


def _explain(run: dict) -> str:
    if run["rc"] is None:
        return f"the runner process died or hung before this script finished:\n{run['runner_log']}"
    return f"exit status {run['rc']} after {run['seconds']} s; stderr ends:\n{run['stderr'][-3000:]}"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_vllm_example_runs(name: str, runs: dict[str, dict]) -> None:
    run = runs[name]
    assert run["rc"] == 0, _explain(run)
    SCRIPTS[name](run["stdout"], run["cwd"])


def test_reproducibility_gives_the_same_output_across_runs(runs: dict[str, dict]) -> None:
    first, second = runs["reproducibility.py"], runs["reproducibility.py#2"]
    assert first["rc"] == 0 and second["rc"] == 0, _explain(first if first["rc"] != 0 else second)
    assert first["stdout"] == second["stdout"]


if __name__ == "__main__":
    _run_scripts(sys.argv[1], sys.argv[2])
