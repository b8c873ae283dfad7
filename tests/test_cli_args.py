"""Bad command-line options of the examples and of `python -m jaxreshard.bench` end in a usage
error: exit status 2 and one ``error:`` line that names the option and what it takes, before
any model is built or any array moves (never a traceback from deep inside JAX, orbax or Tunix).

Every case runs the script as ``python script ...`` would, on 8 simulated CPU devices. The cases
of one script share a fresh interpreter (`run_each`): importing JAX, Flax or Tunix takes most of
the few seconds a case takes, and a refusal happens before anything the next case could see.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
FLAX_TINY = ("--d-model", "16", "--heads", "2", "--layers", "1", "--mlp", "32")


def run(*command: str) -> subprocess.CompletedProcess:
    """``python *command`` from the repository root on 8 CPU devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )


# Runs each command line of a JSON list through `runpy` as ``__main__``, in this one interpreter,
# and writes what each printed and its exit status to a JSON file (an interpreter's own output,
# such as XLA's log lines, cannot mix into it).
_RUN_EACH = """
import contextlib, io, json, runpy, sys, traceback
target, cases, out_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
results = []
for argv in cases:
    out, err, status = io.StringIO(), io.StringIO(), 0
    sys.argv = [target, *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if target.startswith("-m"):
                runpy.run_module(target[2:], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        except SystemExit as e:  # as the interpreter maps sys.exit's argument to a status
            status = e.code if isinstance(e.code, int) else int(e.code is not None)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            status = 1
    results.append({"returncode": status, "stdout": out.getvalue(), "stderr": err.getvalue()})
with open(out_path, "w") as f:
    json.dump(results, f)
"""


def run_each(
    target: str,
    cases: Sequence[Any],
    tmp: pathlib.Path,
    argv: Callable[[tuple[str, ...]], Sequence[str]] = tuple,
) -> dict[tuple[str, ...], types.SimpleNamespace]:
    """``python target *argv(args)`` for the ``args`` of each of ``cases`` (`case` params;
    ``target`` a script, or ``-mNAME`` for a module), all in one fresh interpreter as `run`
    starts it. Keyed by each case's ``args``: the ``returncode``, ``stdout`` and ``stderr``
    of its command line."""
    args = [c.values[0] for c in cases]
    out = tmp / "results.json"
    lines = json.dumps([list(argv(a)) for a in args])
    proc = run("-c", _RUN_EACH, target, lines, str(out))
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-3000:]
    results = json.loads(out.read_text())
    return {a: types.SimpleNamespace(**r) for a, r in zip(args, results, strict=True)}


def case(args: tuple[str, ...], option: str, *words: str):
    """A bad command line, the option its error names, and words of the message."""
    return pytest.param(args, option, words, id=" ".join(args))


def assert_usage_error(proc: subprocess.CompletedProcess, option: str, *words: str) -> None:
    """argparse's usage error: status 2, no traceback, an ``error:`` line naming ``option``."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, proc.stderr
    assert option in errors[0], errors[0]
    for word in words:
        assert word in errors[0], errors[0]


FLAX_BAD_SIZES = [
    case(("--compare-reps", "0"), "--compare-reps", "at least 1"),
    case(("--ckpt-dir", "{tmp}", "--ckpt-every", "0"), "--ckpt-every", "at least 1"),
    case(("--heads", "3"), "--heads", "--d-model (64)", "multiple"),
    case(("--prompts", "0"), "--prompts", "at least 1"),
    case(("--steps", "-1"), "--steps", "at least 0"),
    case(("--group", "0"), "--group", "at least 1"),
    case(("--d-model", "-16"), "--d-model", "at least 1"),
    case(("--layers", "-1"), "--layers", "at least 0"),
    case(("--mlp", "0"), "--mlp", "at least 1"),
    case(("--vocab", "1"), "--vocab", "at least 2"),
    case(("--max-stride", "0"), "--max-stride", "at least 1"),
    case(("--seed", "-1"), "--seed", "at least 0"),
    case(("--lr", "nan"), "--lr", "finite"),
    # Sizes a layout splits over a mesh axis must divide by its size.
    case(("--vocab", "17"), "--vocab", "multiple of 2", "--trainer-mesh 2x2"),
    case(("--mlp", "30", "--sampler-mesh", "1x4"), "--mlp", "multiple of 4", "--sampler-mesh"),
    case(
        ("--d-model", "6", "--heads", "2", "--trainer-mesh", "4x1", "--colocate"),
        "--d-model",
        "multiple of 4",
        "fsdp axis",
    ),
]


@pytest.fixture(scope="module")
def flax_runs(tmp_path_factory):
    """Every case of FLAX_BAD_SIZES, run in one interpreter; ``{tmp}`` is a fresh folder."""
    for module in ("flax", "optax", "orbax.checkpoint"):  # imported before the options are read
        pytest.importorskip(module)
    tmp = tmp_path_factory.mktemp("flax_cli")
    ckpt = str(tmp / "ckpt")
    runs = run_each(
        str(EXAMPLES / "flax_rl_refit.py"),
        FLAX_BAD_SIZES,
        tmp,
        lambda args: [a.replace("{tmp}", ckpt) for a in args],
    )
    return tmp, runs


@pytest.mark.parametrize(("args", "option", "words"), FLAX_BAD_SIZES)
def test_flax_example_refuses_bad_sizes_before_building_the_model(args, option, words, flax_runs):
    """examples/flax_rl_refit.py: counts and sizes out of range, heads that do not divide
    d_model, and sizes that a mesh cannot split evenly are usage errors."""
    tmp, runs = flax_runs
    proc = runs[args]
    assert_usage_error(proc, option, *words)
    assert "policy:" not in proc.stdout  # refused before the model is described or built
    assert not (tmp / "ckpt").exists()


def test_flax_example_refuses_to_resume_a_checkpoint_of_another_model_shape(tmp_path):
    """--resume with a checkpoint saved by another model shape ends in one line that says so
    and names the options that must match (orbax's own error is a long traceback)."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    ocp = pytest.importorskip("orbax.checkpoint")
    import numpy as np

    ckpt = tmp_path / "ckpt"
    with ocp.CheckpointManager(ckpt) as mngr:  # a "model" of one (10, 8) leaf
        mngr.save(
            1,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave({"pos": np.zeros((10, 8), np.float32)}),
                opt_state=ocp.args.StandardSave({"count": np.zeros((), np.int32)}),
            ),
        )
        mngr.wait_until_finished()
    args = ("--steps", "2", *FLAX_TINY, "--ckpt-dir", str(ckpt), "--resume")
    proc = run(str(EXAMPLES / "flax_rl_refit.py"), *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("--resume: checkpoint 1 in ") and "another model shape" in last
    assert all(flag in last for flag in ("--vocab", "--d-model", "--layers", "--mlp"))


TUNIX_BAD_COUNTS = [
    case(("--reps", "0"), "--reps", "at least 1"),
    case(("--steps", "0"), "--steps", "at least 1"),
    case(("--generations", "1"), "--generations", "at least 2"),
    case(("--batch", "0"), "--batch", "at least 1"),
    case(("--seed", "-1"), "--seed", "at least 0"),
    case(("--lr", "inf"), "--lr", "finite"),
]


@pytest.fixture(scope="module")
def tunix_runs(tmp_path_factory):
    pytest.importorskip("tunix")  # the script imports Tunix before it parses its options
    pytest.importorskip("qwix")
    tmp = tmp_path_factory.mktemp("tunix_cli")
    return run_each(str(EXAMPLES / "tunix_grpo.py"), TUNIX_BAD_COUNTS, tmp)


@pytest.mark.parametrize(("args", "option", "words"), TUNIX_BAD_COUNTS)
def test_tunix_example_refuses_bad_counts_before_building_the_cluster(
    args, option, words, tunix_runs
):
    """examples/tunix_grpo.py: a run needs a step, a prompt, a group of 2 or more answers (GRPO
    compares them) and a timed refit; each refusal is a usage error, not an error inside
    Tunix."""
    proc = tunix_runs[args]
    assert_usage_error(proc, option, *words)
    assert "GRPO steps" not in proc.stdout
    assert "GRPO steps" not in proc.stdout


@pytest.mark.parametrize(
    ("args", "option", "words"),
    [
        # 2 processes of 3 devices: trainer tp3 and sampler tp3 cannot split 1024.
        case(("--local", "2", "--devices", "3"), "--width 1024", "multiple of 3", "--width 1023"),
        # one process of 6 devices: two halves of 3.
        case(("--local", "1", "--devices", "6"), "--width 1024", "multiple of 3", "--width 1023"),
        # 4 processes of 2 devices: fsdp2 x tp2 and tp2; an odd width does not split.
        case(("--local", "4", "--devices", "2", "--width", "99"), "--width 99", "--width 98"),
        case(("--local", "1", "--devices", "1"), "--devices", "at least 2"),
        case(("--local", "0"), "--local", "at least 1"),
        case(("--local", "2", "--steps", "-1"), "--steps", "at least 0"),
        case(("--local", "2", "--width", "0"), "--width", "at least 1"),
        case(("--num-processes", "2", "--process-id", "2"), "--process-id", "below"),
    ],
)
def test_multihost_example_checks_the_width_before_launching(args, option, words):
    """examples/multihost_refit.py: the parent checks that --width divides by every mesh axis
    that splits it (and the other counts) before it starts any process."""
    proc = run(str(EXAMPLES / "multihost_refit.py"), *args)
    assert_usage_error(proc, option, *words)
    assert "process 0" not in proc.stdout and "Gloo" not in proc.stderr


def test_multihost_example_checks_the_width_of_a_single_process_too():
    """Run as one process (no --local), the same check runs on the meshes it builds: here two
    halves of the 8 CPU devices, tp4 each."""
    proc = run(str(EXAMPLES / "multihost_refit.py"), "--num-processes", "1", "--width", "6")
    assert_usage_error(proc, "--width 6", "multiple of 4", "--width 4")


BENCH_BAD_SIZES = [
    case(("--bucket-bytes", "0"), "--bucket-bytes", "4096"),
    case(("--bucket-bytes", "7"), "--bucket-bytes", "4096"),
    case(("--bucket-bytes", "-4096"), "--bucket-bytes", "4096"),
    case(("--size-mib", "0"), "--size-mib", "positive"),
    case(("--size-mib", "-4"), "--size-mib", "positive"),
    case(("--size-mib", "nan"), "--size-mib", "positive"),
    case(("--big-leaf-mib", "0"), "--big-leaf-mib", "positive"),
    case(("--layers", "0"), "--layers", "at least 1"),
    case(("--async-work", "-1"), "--async-work", "0 or more"),
]
BENCH = ("--scenario", "disjoint", "--no-progress")


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_cli")
    return run_each("-mjaxreshard.bench", BENCH_BAD_SIZES, tmp, lambda args: (*BENCH, *args))


@pytest.mark.parametrize(("args", "option", "words"), BENCH_BAD_SIZES)
def test_bench_refuses_buckets_and_sizes_it_cannot_run(args, option, words, bench_runs):
    """`python -m jaxreshard.bench`: --bucket-bytes takes 4 KiB to 2**48 (smaller buckets make a
    run of a few MiB take many minutes) and the tree sizes must be positive."""
    assert_usage_error(bench_runs[args], option, *words)


def test_bench_help_states_the_smallest_bucket():
    proc = run("-m", "jaxreshard.bench", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "at least 4096" in " ".join(proc.stdout.split())
