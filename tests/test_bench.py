"""Smoke test of the benchmark harness (`python -m jaxreshard.bench`) on tiny scenarios.

Not a timing test: it checks that the harness runs from the command line, that every strategy's
result equals jaxreshard's, and that the JSON record carries the documented fields.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RESULT_FIELDS = {
    "strategy",
    "times_s",
    "min_s",
    "median_s",
    "max_s",
    "ratio_vs_jaxreshard",
    "first_call_s",
    "compile_s",
    "bytes_sent",
    "bytes_lower_bound",
    "host_bytes",
    "rounds",
    "staging_bytes",
    "peak_rss_bytes",
    "transient_bytes",
    "verified",
}


def run_bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the harness must ask for its 8 CPU devices itself
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "jaxreshard.bench", "--json", str(out), "--no-progress", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy" in proc.stdout and "goals" in proc.stdout  # the terminal table
    return json.loads(out.read_text())


def by_strategy(record: dict) -> dict:
    return {r["strategy"]: r for r in record["results"]}


def test_tiny_cast_and_big_leaf(tmp_path):
    report = run_bench(
        tmp_path,
        *("--scenario", "cast", "--scenario", "big_leaf", "--in-process"),
        *("--size-mib", "0.5", "--layers", "1", "--big-leaf-mib", "0.25", "--pairs", "2"),
    )
    assert report["config"]["devices"] >= 8 and report["config"]["pairs"] == 2
    assert [s["scenario"] for s in report["scenarios"]] == ["cast", "big_leaf"]
    for scenario in report["scenarios"]:
        results = by_strategy(scenario)
        assert set(results) == {"jaxreshard", "device_put", "gather_slice"}
        for r in results.values():
            assert RESULT_FIELDS <= set(r)
            assert len(r["times_s"]) == 2 and r["min_s"] <= r["median_s"] <= r["max_s"]
            assert r["verified"] is True, r["strategy"]  # same values as jaxreshard's result
            assert r["peak_rss_bytes"] is not None
        jr = results["jaxreshard"]
        assert jr["bytes_sent"] == jr["bytes_lower_bound"] > 0
        assert jr["ratio_vs_jaxreshard"] == 1.0 and jr["host_bytes"] == 0
        # Different device sets: device_put pulls the array through host memory.
        assert results["device_put"]["host_bytes"] > 0
        assert results["gather_slice"]["bytes_sent"] > jr["bytes_sent"]
    cast = report["scenarios"][0]
    assert cast["dst_dtype"] == "bfloat16" and cast["cast_halves_bytes_sent"] is True
    assert cast["bytes_sent_without_cast"] == 2 * by_strategy(cast)["jaxreshard"]["bytes_sent"]
    goals = {g["goal"]: g["met"] for g in report["goals"]}
    assert goals["cast: bytes_sent exactly half of fp32"] is True


@pytest.mark.slow
def test_tiny_every_scenario(tmp_path):
    report = run_bench(
        tmp_path,
        *("--size-mib", "0.5", "--layers", "1", "--many-leaves", "16"),
        *("--big-leaf-mib", "0.25", "--pairs", "1"),
    )
    names = [s["scenario"] for s in report["scenarios"]]
    assert names == [
        "disjoint",
        "colocated",
        "many_leaves",
        "replicated_src",
        "replicated_dst",
        "cast",
        "big_leaf",
    ]
    for scenario in report["scenarios"]:
        for r in scenario["results"]:
            assert r["verified"] in (True, None), (scenario["scenario"], r["strategy"])
    colocated = by_strategy(report["scenarios"][1])
    assert colocated["xla_reshard"]["verified"] is True
    assert colocated["device_put"]["host_bytes"] == 0  # one device set: no host round trip
    many = by_strategy(report["scenarios"][2])
    assert many["jaxreshard_8_leaves"]["bytes_sent"] == many["jaxreshard"]["bytes_sent"]
