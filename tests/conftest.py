"""Shared test settings: deterministic hypothesis runs in CI, no deadline on a slow 2-core runner,
and figures drawn during tests (the notebooks under nbval) kept out of the checkout's ``figures/``:
those are written by ``make figures`` alone, so a test run never replaces a measured figure."""

import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings

import paged_attention  # noqa: F401  first: it chooses Triton's interpreter before anything imports triton

os.environ.setdefault(
    "PAGED_ATTENTION_FIGURES", str(Path(tempfile.gettempdir()) / "paged-attention-test-figures")
)

settings.register_profile("dev", deadline=None, max_examples=100)
settings.register_profile(
    "ci", deadline=None, max_examples=100, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))
