"""Multi-process layouts: one process per device, interleaved device sets, hundreds of leaves.

Each launch starts local ``jax.distributed`` processes (127.0.0.1, CPU devices, gloo) running
tests/multiprocess_layouts_worker.py. Every process regenerates the full global arrays from a
seed, checks the destination shards it holds bit for bit against NumPy slices of them, and
checks ``plan.stats.bytes_sent`` against the lower bound of tests/oracles.py. A test passes
when every process exits 0 within the timeout and reports each case.

- 8 processes x 1 device (the usual GPU launch): trainer on processes 0-3, sampler on 4-7; and
  a colocated layout pair over all eight;
- 2 processes x 4 devices, trainer = global devices 0, 1, 4, 5 and sampler = 2, 3, 6, 7; and
  four declared domains of two devices with the sampler replicated over three (chained
  destination domains forwarding to each other across the processes);
- 300 leaves (30 repeated layers of 10 leaves of mixed shapes and dtypes) over those
  interleaved meshes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from launch import run_local

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multiprocess_layouts_worker.py"
LAUNCH_TIMEOUT_S = 240  # generous: the machine running the tests may be loaded
MANY_LEAVES_TIMEOUT_S = 900  # its first call compiles ~100-200 programs per process


@dataclasses.dataclass
class Launch:
    scenario: str
    returncodes: list[int]
    outputs: list[str]
    seconds: float
    timed_out: bool
    timeout_s: float

    def report(self) -> str:
        return "\n".join(
            f"--- process {i} (rc {rc})\n{out[-3000:]}"
            for i, (rc, out) in enumerate(zip(self.returncodes, self.outputs, strict=True))
        )

    def assert_ok(self, *cases: str) -> None:
        assert not self.timed_out, (
            f"{self.scenario}: still running after {self.timeout_s} s (hung?)\n{self.report()}"
        )
        bad = [i for i, rc in enumerate(self.returncodes) if rc != 0]
        assert not bad, f"{self.scenario}: processes {bad} failed\n{self.report()}"
        for pid, out in enumerate(self.outputs):
            for case in cases:
                assert f"CASE {case} OK" in out, f"process {pid} did not report {case}\n{out}"


def launch(
    scenario: str, processes: int, devices: int, timeout_s: float = LAUNCH_TIMEOUT_S
) -> Launch:
    """Run the worker as ``processes`` local jax.distributed processes of ``devices`` each;
    once one fails (or the timeout passes) the others are killed."""
    run = run_local(WORKER, scenario, processes, devices, timeout_s=timeout_s, grace_s=0)
    # Killed at the deadline (rather than after a peer's failure): no process failed on its own.
    timed_out = run.killed and not any(rc > 0 for rc in run.returncodes)
    return Launch(scenario, run.returncodes, run.outputs, run.seconds, timed_out, timeout_s)


@pytest.fixture(scope="module")
def run_8x1() -> Launch:
    return launch("8x1", 8, 1)


@pytest.fixture(scope="module")
def run_2x4() -> Launch:
    return launch("2x4", 2, 4)


@pytest.mark.multiprocess
def test_eight_processes_of_one_device_trainer_on_four_sampler_on_four(run_8x1):
    run_8x1.assert_ok("disjoint_8x1")


@pytest.mark.multiprocess
def test_eight_processes_of_one_device_colocated(run_8x1):
    run_8x1.assert_ok("colocated_8x1")


@pytest.mark.multiprocess
def test_trainer_and_sampler_interleaved_over_two_processes(run_2x4):
    run_2x4.assert_ok("interleaved_2x4")


@pytest.mark.multiprocess
def test_interleaved_back_to_the_trainer_from_an_alternating_order(run_2x4):
    run_2x4.assert_ok("interleaved_reversed_2x4")


@pytest.mark.multiprocess
def test_chained_destination_domains_forward_across_processes(run_2x4):
    run_2x4.assert_ok("chained_2x4")


@pytest.mark.multiprocess
def test_colocated_small_leaves_pass_held_parts_through_slots_across_processes(run_2x4):
    run_2x4.assert_ok("colocated_adapters_2x4")


@pytest.mark.multiprocess
def test_whole_shards_move_across_processes_without_staging(run_2x4):
    run_2x4.assert_ok("whole_shards_2x4")


@pytest.mark.multiprocess
def test_whole_shard_steps_beside_staged_ones_on_other_processes(run_2x4):
    run_2x4.assert_ok("whole_beside_staged_2x4")


@pytest.mark.multiprocess
def test_three_hundred_leaves_of_mixed_shapes_and_dtypes_across_processes():
    run = launch("2x4_many", 2, 4, timeout_s=MANY_LEAVES_TIMEOUT_S)
    run.assert_ok("many_leaves_2x4")
