"""The Flax RL example (examples/flax_rl_refit.py): it runs, refits, and checkpoints exactly.

A tiny model keeps each run to a few seconds plus compilation.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flax_rl_refit.py"
TINY = [
    *("--d-model", "16", "--heads", "2", "--layers", "1", "--mlp", "32"),
    *("--prompts", "4", "--group", "4", "--compare-reps", "2"),
]


@pytest.fixture(scope="module")
def example():
    """The example script imported as a module (its `main(argv)` returns a `Result`)."""
    spec = importlib.util.spec_from_file_location("flax_rl_refit", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _bits(tree) -> list[np.ndarray]:
    return [np.asarray(x).view(f"u{np.dtype(x.dtype).itemsize}") for x in jax.tree.leaves(tree)]


def assert_bit_identical(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and x.sharding == y.sharding
    for x, y in zip(_bits(a), _bits(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_the_script_runs_on_its_own_devices_and_reports_the_refit_share():
    # As a user runs it: a fresh interpreter without XLA_FLAGS; the script asks for 8 devices.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "3", *TINY],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3
    assert all("reward" in s and "refit share" in s for s in steps)
    # Disjoint submeshes by default: trainer on devices 0-3, sampler on 4-7.
    assert "devices [0, 1, 2, 3], fp32" in out and "devices [4, 5, 6, 7], bf16" in out
    assert "refit share" in out.split("summary")[1]
    assert "jax.device_put" in out and "bit-identical results: yes" in out
    assert "plan.describe():" in out and "(100% of bound)" in out


@pytest.fixture(scope="module")
def checkpointed(example, tmp_path_factory):
    """Two iterations with a checkpoint after each, in-process: (result, checkpoint dir)."""
    ckpt = str(tmp_path_factory.mktemp("example") / "ckpt")
    return example.main(["--steps", "2", "--ckpt-every", "1", "--ckpt-dir", ckpt, *TINY]), ckpt


def test_the_refit_moves_exactly_the_annotated_layouts(checkpointed):
    result, _ = checkpointed
    assert [row["step"] for row in result.history] == [1, 2]
    assert 0 < result.summary["refit_share"] < 1
    assert result.summary["device_put_identical"]
    for param, sampled in zip(
        jax.tree.leaves(result.params), jax.tree.leaves(result.sampler_params), strict=True
    ):
        assert param.dtype == np.float32 and sampled.dtype == jax.numpy.bfloat16
        assert {d.id for d in param.sharding.device_set} == {0, 1, 2, 3}
        assert {d.id for d in sampled.sharding.device_set} == {4, 5, 6, 7}
    # Both layouts come from the annotations: the MLP kernel is ("embed", "mlp").
    up = result.params["blocks"][0]["up"]["kernel"]
    assert up.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tp")
    assert result.sampler_params["blocks"][0]["up"]["kernel"].sharding.spec == (
        jax.sharding.PartitionSpec(None, "tp")
    )
    assert result.plan.stats.bytes_sent == result.plan.stats.bytes_lower_bound


def test_orbax_round_trip_is_bit_exact(example, checkpointed):
    result, ckpt = checkpointed
    # The script's own checks: restored == live, and restored-into-sampler == refit.
    assert result.summary["orbax_roundtrip_exact"]
    assert result.summary["orbax_sampler_matches_refit"]

    # Independently: the whole trainer state of step 2, restored onto the trainer mesh.
    def target(tree):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
        )

    mngr = example.checkpoint_manager(ckpt)
    assert mngr.all_steps() == [1, 2]
    params, opt_state = example.restore_trainer_state(
        mngr, 2, target(result.params), target(result.opt_state)
    )
    mngr.close()
    assert_bit_identical(params, result.params)
    assert_bit_identical(opt_state, result.opt_state)


@pytest.mark.slow
def test_resume_continues_exactly_as_an_uninterrupted_run(example, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = example.main(["--steps", "3", *TINY])
    example.main(["--steps", "2", "--ckpt-dir", ckpt, *TINY])
    resumed = example.main(["--steps", "3", "--ckpt-dir", ckpt, "--resume", *TINY])
    assert [row["step"] for row in resumed.history] == [3]
    assert resumed.history[0]["reward"] == straight.history[-1]["reward"]
    assert_bit_identical(resumed.params, straight.params)
    assert_bit_identical(resumed.opt_state, straight.opt_state)


def test_async_refit_samples_one_step_behind_and_ends_on_the_last_weights(example):
    """--async-refit: step k samples with the weights refit after step k-2's update (one step
    off-policy) and the sampler holds the final weights, bit for bit, at the end."""
    result = example.main(["--steps", "3", "--async-refit", *TINY])
    assert [row["step"] for row in result.history] == [1, 2, 3]
    assert result.summary["exposed_refit_median_s"] >= 0
    assert_bit_identical(result.sampler_params, result.plan(result.params))
