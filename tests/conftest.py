"""Shared test settings: deterministic hypothesis runs in CI, no deadline on a slow 2-core runner."""

import os

from hypothesis import HealthCheck, settings

import paged_attention  # noqa: F401  first: it chooses Triton's interpreter before anything imports triton

settings.register_profile("dev", deadline=None, max_examples=100)
settings.register_profile(
    "ci", deadline=None, max_examples=100, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))
