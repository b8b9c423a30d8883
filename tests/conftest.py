"""Shared test settings: deterministic hypothesis runs in CI, no deadline on a slow 2-core runner,
and figures drawn during tests (the notebooks under nbval) kept out of the checkout's ``figures/``:
those are written by ``make figures`` alone, so a test run never replaces a measured figure."""

import functools
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import paged_attention  # noqa: F401  first: it chooses Triton's interpreter before anything imports triton

os.environ.setdefault(
    "PAGED_ATTENTION_FIGURES", str(Path(tempfile.gettempdir()) / "paged-attention-test-figures")
)
# litellm fetches its model price list from GitHub when imported, unless told to use its own copy:
# tests send traffic to 127.0.0.1 only.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

settings.register_profile("dev", deadline=None, max_examples=100)
settings.register_profile(
    "ci", deadline=None, max_examples=100, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# -- every engine a test builds gives every block back ---------------------------------------------
_built_engines: list = []


def _record_engines() -> None:
    """Remember every LLMEngine built (weakly), so that each test's engines can be checked after it."""
    import weakref

    from paged_attention.engine.llm_engine import LLMEngine

    init = LLMEngine.__init__

    @functools.wraps(init)  # its signature stays the engine's (tests read it)
    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _built_engines.append(weakref.ref(self))

    LLMEngine.__init__ = recording_init


_record_engines()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """After each test: every live engine (built by it or by a fixture) that has no unfinished
    request holds no block, so a leaked reference count or a sequence never freed fails the test
    that caused it."""
    outcome = yield
    _built_engines[:] = [ref for ref in _built_engines if ref() is not None]
    if outcome.excinfo is not None:
        return
    for ref in _built_engines:
        engine = ref()
        if engine is None or engine.has_unfinished_requests():
            continue
        manager = engine.cache_manager
        assert manager.num_free_blocks == manager.num_blocks, (
            f"{item.nodeid}: an engine with no unfinished request holds "
            f"{manager.num_blocks - manager.num_free_blocks} of its {manager.num_blocks} blocks"
        )


#: Seconds each of the slowest files takes on one core (measured 2026-12-07, an Ice Lake Xeon, two
#: workers): ``make test`` runs them first.
#: With two workers that each take a whole file (``--dist loadfile``: a notebook's cells share one
#: kernel), starting with the longest leaves no long file to run alone at the end.
SLOWEST_FIRST = {
    "notebooks/07_throughput.ipynb": 118,
    "tests/test_lab_notebooks.py": 96,
    "tests/test_kernels.py": 92,
    "notebooks/09_serving.ipynb": 89,
    "notebooks/06_fragmentation.ipynb": 70,
    "tests/test_engine_core.py": 66,
    "tests/test_smollm2.py": 60,
    "tests/test_speculative.py": 60,
    "tests/test_vllm_examples.py": 57,
    "notebooks/10_speculative_decoding.ipynb": 56,
    "notebooks/08_sharing.ipynb": 51,
    "tests/test_lab.py": 49,
    "tests/test_serving.py": 45,
    "notebooks/05_engine.ipynb": 42,
    "notebooks/11_quantized_pages.ipynb": 40,
    "tests/test_lab_sandbox.py": 40,
    "tests/test_rollback_state.py": 38,
    "notebooks/12_structured_outputs.ipynb": 35,
    "tests/test_engine.py": 34,
    "tests/test_gpu_compile.py": 34,  # (without a Triton cache, as on a fresh machine; ~3 s with one)
    "tests/test_lab_browser.py": 33,
    "tests/test_lm_eval.py": 26,
    "tests/test_cli.py": 22,
}


def pytest_collection_modifyitems(config, items):
    """The slowest files first (:data:`SLOWEST_FIRST`), each file's tests in their own order."""
    root = config.rootpath
    weight = {}
    for item in items:
        name = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else str(item.path)
        weight[item.nodeid] = SLOWEST_FIRST.get(name, 0)
    items.sort(key=lambda item: -weight[item.nodeid])  # stable: each file keeps its order
