"""Test setup: 8 simulated CPU devices, asked for before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest
from hypothesis import settings

# The same examples on every run (CI and here): a property test that asserts how its examples
# are distributed, or that fails on a rare example, must not pass or fail by chance. Set
# HYPOTHESIS_PROFILE=explore to draw fresh examples.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

# A script (the mutation check, tests/mutants.md), not a test module: never collect it.
collect_ignore = ["mutants.py"]


@pytest.fixture(scope="session")
def devices() -> list:
    """The 8 CPU devices every executor test runs on."""
    devs = jax.devices()
    assert len(devs) >= 8, "tests need 8 devices: XLA_FLAGS was set after JAX started"
    return devs[:8]
