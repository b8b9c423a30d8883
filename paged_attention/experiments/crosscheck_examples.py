"""vLLM's offline examples run on both engines: the copies in ``tests/vllm_examples/``.

Each copy is this package's version of one of vLLM's ``examples/offline_inference`` scripts: its
header lists every changed line (imports moved to ``paged_attention``, the model name). For the
cross-check both engines run the copy with its model set to the same local folder (SmolLM2); vLLM
runs it with its original imports put back. The scripts leave the dtype to ``auto``, which is
bfloat16 for SmolLM2 on vLLM's CPU backend (and here where this CPU computes it faster), and two
engines' bfloat16 kernels round differently: so their answers are counted, not compared; what is
compared is what must not depend on the engine (the prompts, and a script's own verdict such as
"Generated answers are the same: True").

vLLM's runs use a ``sitecustomize`` that makes ``LLM(...)`` default to ``enforce_eager=True``: an
eager start takes a third of a compiled one here. A script without an ``if __name__ == "__main__":``
guard (vLLM's older examples) cannot start vLLM's engine core, which is spawned and re-imports the
script; such a script runs on vLLM with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core in the
script's own process, as this package always runs), and its note says so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

MARK = "# --- original file follows ---"
MODEL_NAMES = ('"paged-attention/tiny-llama"', '"HuggingFaceTB/SmolLM2-135M-Instruct"')

#: copy -> (printed lines that must be equal, printed lines whose number must be equal): regular expressions
EXAMPLES: dict[str, tuple[str | None, str]] = {
    "prefix_caching.py": (r"^Generated answers are the same", r"^Prompt: "),
    "automatic_prefix_caching.py": (None, r"^Output: "),
    "basic/basic.py": (r"^Prompt: ", r"^Output: "),
}

EAGER_SITECUSTOMIZE = '''\
"""Cross-check runs only: vLLM's LLM(...) defaults to enforce_eager=True."""
import importlib.abc
import importlib.util
import sys


class _Eager(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.entrypoints.llm":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            init = module.LLM.__init__

            def eager_init(self, *args, **kwargs):
                kwargs.setdefault("enforce_eager", True)
                init(self, *args, **kwargs)

            module.LLM.__init__ = eager_init

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Eager())
'''


def variants(copy: str, model: str) -> tuple[str, str]:
    """The copy's text for this engine and for vLLM: its model names replaced by ``model``; for
    vLLM its ``paged_attention`` imports (and the standard-library parser) put back as listed."""
    head, _, body = copy.partition(MARK + "\n")
    signs = re.findall(r"^#   ([-+]) (.*)$", head, re.M)
    pairs = [(signs[i][1], signs[i + 1][1]) for i in range(0, len(signs), 2)]
    ours = body
    for name in MODEL_NAMES:
        ours = ours.replace(name, json.dumps(model))
    theirs = ours
    for old, new in pairs:
        if new.startswith(("from paged_attention import", "from argparse import")):
            theirs = theirs.replace(new + "\n", old + "\n", 1)
    if "paged_attention" in theirs:
        raise ValueError("the copy's header does not list every line it changed: vLLM's version still "
                         "names paged_attention")  # fmt: skip
    return ours, theirs


@dataclass
class ExampleRun:
    name: str
    ok: bool
    compared: int  # lines compared
    note: str = ""


def run_examples(folder: Path, model: str, vllm_python: str, ours_python: str, vllm_env: dict[str, str],
                 out: Path, timeout: float = 900) -> list[ExampleRun]:  # fmt: skip
    """Run each of :data:`EXAMPLES` on both engines (``folder``: ``tests/vllm_examples``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "sitecustomize.py").write_text(EAGER_SITECUSTOMIZE)
    base = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    runs = []
    for name, (equal, counted) in EXAMPLES.items():
        ours, theirs = variants((folder / name).read_text(), model)
        guarded = re.search(r"^if __name__ == .__main__.:", theirs, re.M) is not None
        in_process = {} if guarded else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        printed = {}
        for engine, text, python, env in (
            ("vllm", theirs, vllm_python, {**base, **vllm_env, **in_process, "PYTHONPATH": str(out)}),
            ("ours", ours, ours_python, {**base, "OMP_NUM_THREADS": "1"}),
        ):
            script = out / f"{engine}-{name.replace('/', '-')}"
            script.write_text(text)
            done = subprocess.run([python, str(script)], cwd=out, env=env, capture_output=True, text=True,
                                  timeout=timeout)  # fmt: skip
            if done.returncode != 0:
                printed[engine] = None
                runs.append(ExampleRun(name, False, 0, f"{engine} failed: {done.stderr[-300:]}"))
                break
            lines = done.stdout.splitlines()
            printed[engine] = (
                [line for line in lines if equal and re.match(equal, line)],
                sum(1 for line in lines if re.match(counted, line)),
            )
        else:
            (a, count_a), (b, count_b) = printed["ours"], printed["vllm"]
            same = a == b and count_a == count_b > 0
            note = "" if same else f"here {a[:2]} and {count_a} answers, vLLM {b[:2]} and {count_b}"
            note = note or f"{len(b)} lines equal, {count_b} answers each (dtype auto: counted, not compared)"
            if not guarded:
                note += "; no __main__ guard: vLLM ran it with VLLM_ENABLE_V1_MULTIPROCESSING=0"
            runs.append(ExampleRun(name, same, count_b, note))
    return runs
