"""Test setup: 8 simulated CPU devices, asked for before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

# A script (the mutation check, tests/mutants.md), not a test module: never collect it.
collect_ignore = ["mutants.py"]


@pytest.fixture(scope="session")
def devices() -> list:
    """The 8 CPU devices every executor test runs on."""
    devs = jax.devices()
    assert len(devs) >= 8, "tests need 8 devices: XLA_FLAGS was set after JAX started"
    return devs[:8]
