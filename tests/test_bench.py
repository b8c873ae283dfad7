"""The benchmark harness (`python -m jaxreshard.bench`) on tiny scenarios.

Not a timing test: no figure is compared with a wall-clock threshold. It checks that the harness
runs from the command line on 8, 2 and 1 CPU devices, that every strategy's result equals
`jax.device_put`'s, that the JSON record carries every documented field, and the honesty
invariants the printed tables rest on: equal warm-ups, a fresh source for every timed call, the
statistic behind every ratio (recomputed here from the raw times), host bytes measured or
labelled, plan arithmetic apart from measured figures, targets named by what they are.
"""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from jaxreshard.tools import bench

ROOT = Path(__file__).resolve().parents[1]

RESULT_FIELDS = {
    "strategy",
    "output",
    "times_s",
    "min_s",
    "median_s",
    "max_s",
    "paired_jr_times_s",
    "jr_over_this_median_of_pairs",
    "jr_over_this_ratio_of_medians",
    "plan_s",
    "first_call_s",
    "compile_s",
    "compiles",
    "untimed_calls",
    "host_bytes",
    "host_method",
    "peak_rss_bytes",
    "transient_bytes",
    "transient_first_bytes",
    "verified",
}
PLAN_FIELDS = {
    "bytes_packed",
    "bytes_kept",
    "bytes_whole",
    "bytes_total",
    "bytes_local",
    "bytes_lower_bound",
    "bytes_sent",
    "bytes_wire",
    "rounds",
    "buckets",
    "staging_bytes",
    "programs",
    "dispatches",
    "host_syncs",
    "host_syncs_counted",
    "sent_equals_lower_bound",
}
TINY = ("--size-mib", "0.5", "--layers", "1", "--big-leaf-mib", "0.25", "--many-leaves", "16")
TINY_FIRST_CALL = (
    *("--first-call-layers", "1,2", "--first-call-d", "32"),
    *("--first-call-mlp", "64", "--first-call-vocab", "128"),
)


def run_bench(tmp_path: Path, *args: str) -> tuple[dict, str]:
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
    assert "== targets" in proc.stdout
    return json.loads(out.read_text()), proc.stdout


def by_strategy(record: dict) -> dict:
    return {r["strategy"]: r for r in record["results"]}


def check_timing_record(rec: dict, pairs: int) -> None:
    """Invariants of one timing scenario's record."""
    results = by_strategy(rec)
    jr = results["jaxreshard"]
    untimed = {r["untimed_calls"] for r in results.values()}
    assert untimed == {rec["warmup"] + 1}, untimed  # equal warm-ups for every strategy
    others = [r for r in results.values() if r is not jr]
    for r in results.values():
        assert RESULT_FIELDS <= set(r), RESULT_FIELDS - set(r)
        # jaxreshard is timed in one interleaved pass against every other strategy.
        assert len(r["times_s"]) == (pairs * max(1, len(others)) if r is jr else pairs)
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["median_s"] == pytest.approx(statistics.median(r["times_s"]))
        assert r["verified"] in (True, None), r["strategy"]  # None: device_put, the reference
        assert r["peak_rss_bytes"] is not None and r["host_method"] in ("guard", "watched")
        if r["strategy"].startswith("jaxreshard"):
            assert r["output"] == "donated"
            # Measured under the transfer guard, not assumed.
            assert r["host_bytes"] == 0 and r["host_method"] == "guard"
            assert r["transient_first_bytes"] is not None
        else:
            assert r["output"] == "fresh" and r["transient_first_bytes"] is None
        if r is jr:
            assert r["jr_over_this_ratio_of_medians"] is None
            continue
        # Both statistics, recomputed from the raw times of the same pass.
        mine = r["paired_jr_times_s"]
        assert len(mine) == pairs and set(mine) <= set(jr["times_s"])
        pairwise = [a / b for a, b in zip(mine, r["times_s"], strict=True)]
        assert r["jr_over_this_median_of_pairs"] == pytest.approx(statistics.median(pairwise))
        assert r["jr_over_this_ratio_of_medians"] == pytest.approx(
            statistics.median(mine) / r["median_s"]
        )
    assert results["device_put"]["verified"] is None
    plans = {p["strategy"]: p for p in rec["plans"]}
    assert set(plans) == {n for n in results if n.startswith("jaxreshard")}
    for p in plans.values():
        assert PLAN_FIELDS <= set(p), PLAN_FIELDS - set(p)
        assert p["sent_equals_lower_bound"] == (p["bytes_sent"] == p["bytes_lower_bound"])
        assert p["bytes_sent"] == p["bytes_lower_bound"] > 0
    for st in rec["stage_profile"]:
        stages = {s["stage"]: s for s in st["stages"]}
        assert set(stages) == {"pack", "transfer", "unpack"}
        assert {"pack", "transfer", "unpack"} <= set(st["phases_s"])
        plan = plans[st["strategy"]]
        # (a message sent alike to several receivers is packed once: `Step.shared`; a held
        # part a device passes itself is packed too: `Step.kept`)
        assert plan["bytes_packed"] <= plan["bytes_sent"]
        assert stages["pack"]["bytes"] == plan["bytes_packed"] + plan["bytes_kept"]
        assert stages["transfer"]["bytes"] == plan["bytes_wire"]
        # (whole-shard steps receive straight into the destination: no unpack)
        assert stages["unpack"]["bytes"] == plan["bytes_total"] - plan["bytes_whole"]
        for s in stages.values():
            if s["bytes"]:
                assert s["memcpy_s"] > 0 and s["memcpy_bytes"] >= s["bytes"]
    for d in rec["derived_bytes"]:
        assert d["formula"] and d["bytes_between_devices"] > 0


def check_goals(report: dict) -> dict:
    """Goals are named by what they measure (never by issue number), with a status."""
    text = json.dumps(report["goals"])
    assert "issue" not in text.lower()
    goals = {g["goal"]: g for g in report["goals"]}
    for g in goals.values():
        assert g["met"] in (True, False, None)
        if g["met"] is not None and "limit" in g:
            assert g["met"] == (g["value"] <= g["limit"])
    return goals


def test_tiny_timing_scenarios(tmp_path):
    """cast, big_leaf and many_leaves in one process: every measured and derived field."""
    report, stdout = run_bench(
        tmp_path,
        *("--scenario", "cast", "--scenario", "big_leaf", "--scenario", "many_leaves"),
        *("--in-process", *TINY, "--pairs", "2", "--warmup", "1", "--profile-reps", "1"),
    )
    assert report["config"]["devices"] == 8 and report["config"]["pairs"] == 2
    assert report["config"]["xla_flags"].endswith("--xla_force_host_platform_device_count=8")
    scenarios = {s["scenario"]: s for s in report["scenarios"]}
    assert list(scenarios) == ["cast", "big_leaf", "many_leaves"]
    for rec in scenarios.values():
        check_timing_record(rec, pairs=2)
        # Different device sets: device_put pulls the array through host memory (measured).
        dp = by_strategy(rec)["device_put"]
        assert dp["host_method"] == "watched" and dp["host_bytes"] > 0
        gs = by_strategy(rec)["gather_slice"]
        assert rec["derived_bytes"][0]["bytes_between_devices"] > rec["plans"][0]["bytes_sent"]
        assert gs["transient_bytes"] == gs["peak_rss_bytes"] - rec["dst_bytes_total"]
    cast = scenarios["cast"]
    assert cast["dst_dtype"] == "bfloat16" and cast["cast_halves_bytes_sent"] is True
    assert cast["bytes_sent_without_cast"] == 2 * cast["plans"][0]["bytes_sent"]
    many = scenarios["many_leaves"]
    plans = {p["strategy"]: p for p in many["plans"]}
    assert plans["jaxreshard_8_leaves"]["bytes_sent"] == plans["jaxreshard"]["bytes_sent"]
    goals = check_goals(report)
    assert goals["cast: bf16 plan sends exactly half of the fp32 plan (plan arithmetic)"]["met"]
    many_jr = by_strategy(many)
    overhead = goals["many-leaf overhead: 16 leaves <= 1.2x the same bytes in 8 leaves"]
    ratio = many_jr["jaxreshard_8_leaves"]["jr_over_this_ratio_of_medians"]
    assert overhead["value"] == pytest.approx(ratio)  # targets use the ratio of medians
    put = goals["many-leaf overhead: jaxreshard (16 leaves) <= 1.0x device_put"]
    assert put["value"] == pytest.approx(many_jr["device_put"]["jr_over_this_ratio_of_medians"])
    big = goals["big-leaf memory: peak transient <= 0.25 of a replica (first call at that shape)"]
    big_jr = by_strategy(scenarios["big_leaf"])["jaxreshard"]
    first = max(big_jr["transient_first_bytes"], big_jr["transient_bytes"])
    assert big["value"] == pytest.approx(first / scenarios["big_leaf"]["bytes"])
    assert goals["first call: 32-layer tree <= 3 s (plan + compile + move)"]["met"] is None
    # The printed tables: ratio columns say their statistic, plan arithmetic has its own.
    for text in ("jr/x pairs", "jr/x medians", "ratio of the medians", "plan arithmetic"):
        assert text in stdout
    assert "derived (not measured)" in stdout and "issue" not in stdout.lower()


def test_first_call_and_scaled_devices(tmp_path):
    """first_call in fresh processes, and the disjoint layouts scaled to 2 devices."""
    report, stdout = run_bench(
        tmp_path,
        *("--devices", "2", "--scenario", "disjoint", "--scenario", "first_call"),
        *(*TINY, *TINY_FIRST_CALL, "--pairs", "1", "--warmup", "1", "--profile-reps", "1"),
    )
    assert report["config"]["devices"] == 2 and report["complete"]
    disjoint, first = report["scenarios"]
    assert disjoint["layouts"] == "1 device on device 0 -> 1 device on device 1"
    check_timing_record(disjoint, pairs=1)
    assert first["kind"] == "first_call" and not first["failed"]
    rows = {r["layers"]: r for r in first["rows"]}
    assert sorted(rows) == [1, 2]
    for layers, r in rows.items():
        assert r["leaves"] == 9 * layers + 2 and r["verified"] is True
        assert r["first_call_s"] >= r["plan_s"] > 0
        assert r["programs"] > 0 and r["xla_compiles"] >= r["programs"]
        assert r["device_put_first_call_s"] > 0
    goals = check_goals(report)
    top = goals["first call: 2-layer tree <= 3 s (plan + compile + move)"]
    assert top["value"] == rows[2]["first_call_s"]
    rel = goals["first call: 2-layer tree <= 1.5x the 1-layer tree"]
    assert rel["value"] == pytest.approx(rows[2]["first_call_s"] / rows[1]["first_call_s"])
    assert "XLA compiles" in stdout


def test_one_device(tmp_path):
    """One device: what one device can measure (the default scenarios there)."""
    assert bench.default_scenarios(1) == ["one_device", "first_call"]
    assert bench.first_call_layouts(1).describe() == "1 device on device 0 -> 1 device on device 0"
    report, stdout = run_bench(
        tmp_path, "--devices", "1", "--scenario", "one_device", "--in-process", *TINY
    )
    assert report["config"]["devices"] == 1 and report["complete"]
    (one,) = report["scenarios"]
    assert {k["kernel"] for k in one["kernels"]} == {"pack", "unpack"}
    for k in one["kernels"]:
        assert k["bytes"] > 0 and k["s"] > 0 and k["memcpy_s"] > 0
    local = one["all_local_plan"]
    assert local["verified"] is True and local["bytes_sent"] == 0 and local["bytes_local"] > 0
    assert "not the library's compiled programs" in stdout


def test_import_changes_no_flags():
    """Importing the harness as a module leaves XLA_FLAGS alone (only `main` sets it)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    code = "import os, jaxreshard.tools.bench; print(os.environ.get('XLA_FLAGS'))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "None"


def test_trees_and_layouts():
    """The scenario trees and layouts, pure (no devices)."""
    args = bench.parse_args([])
    parts = ["all", "blocks", "embed"]
    sizes = {part: round(bench.gpt32k(args, part).nbytes_f32 / bench.MiB) for part in parts}
    assert sizes == {"all": 416, "blocks": 288, "embed": 128}
    assert len(bench.gpt32k(args, "all").leaves) == 63
    assert bench.gpt32k(args, "embed").leaves["embed"][0] == (32768, 1024)
    scanned = bench.scanned_gpt(1024, 6, 32000).leaves
    assert len(scanned) == 14 and scanned["layers.attn.qkv"] == ((6, 1024, 3072), "stacked_col")
    assert scanned["head"] == ((1024, 32000), "col")  # untied: 8,000 columns a tp4 device
    for role in {role for _, role in scanned.values()}:
        for specs in (bench.TRAINER, bench.SAMPLER_TP, bench.FSDP_ONLY):
            assert role in specs
    lora = bench.lora_tree(1024, 28, 16).leaves
    assert len(lora) == 392 and lora["layers.00.down.lora_a"] == ((4096, 16), "lora_a_row")
    for role in {role for _, role in lora.values()}:
        for specs in (bench.TRAINER, bench.SAMPLER_TP, bench.FSDP_ONLY):
            assert role in specs
    for layers, leaves in [(2, 20), (8, 74), (32, 290)]:
        assert len(bench.llama_tree(layers, 256, 688, 32000).leaves) == leaves
    assert len(bench.gpt_tree(256, 8).leaves) == 83
    many = bench.matrices_tree(256, 1024)
    few = bench.matrices_tree(256, 8, like=1024)
    assert many.nbytes_f32 == few.nbytes_f32
    eight = {n: bench.SCENARIOS[n].layouts(8).describe() for n in ("disjoint", "first_call")}
    assert eight["disjoint"] == "fsdp2 x tp2 on devices 0-3 -> tp4 on devices 4-7"
    assert eight["first_call"] == "fsdp2 x tp2 on devices 0-3 -> dp2 x tp2 on devices 4-7"
    colocated = bench.colocated_layouts(8)
    assert colocated.dst_devices == (0, 2, 4, 6, 1, 3, 5, 7)
    assert bench.disjoint_layouts(4).describe() == "fsdp2 on devices 0-1 -> tp2 on devices 2-3"
    same = bench.SCENARIOS["same_layout"]
    assert same.layouts(8).describe() == "tp4 on devices 0-3 -> tp4 on devices 4-7"
    assert same.family == "disjoint"  # under the same <= 1.5x device_put target
    assert bench.default_scenarios(1) == ["one_device", "first_call"]
    assert "one_device" not in bench.default_scenarios(8)
    family = [n for n, s in bench.SCENARIOS.items() if s.family == "disjoint"]
    assert len(family) >= 3  # the bench's tree and the 32k-vocabulary ones
    # The 8-device disjoint shards of a matrix: fsdp2 x tp2 -> tp4 columns.
    (src, dst, piece), *_ = bench.bench_shard_shapes(bench.Tree({"w": ((64, 32), "col")}))
    assert (src, dst, piece) == ((32, 16), (64, 8), (32, 8))
    assert bench._blocks(src, piece) == [(0, 0), (0, 8)]


def test_targets_and_tables():
    """Targets from records: ratio of medians, n/a where not run; tables aligned."""
    rec = {
        "scenario": "colocated",
        "kind": "timing",
        "family": "",
        "plans": [],
        "results": [
            {"strategy": "jaxreshard", "jr_over_this_ratio_of_medians": None},
            {"strategy": "xla_reshard", "jr_over_this_ratio_of_medians": 0.4},
        ],
    }
    goals = {g["goal"]: g for g in bench.targets([rec])}
    colocated = goals["colocated speed: jaxreshard <= 0.5x XLA's own reshard"]
    assert colocated["met"] is True and colocated["value"] == 0.4
    assert goals["disjoint speed (disjoint): jaxreshard <= 1.5x device_put"]["met"] is None
    text = bench.format_targets(list(goals.values()))
    assert "met" in text and "n/a" in text and "issue" not in text
    lines = bench.table(["name", "value ms"], [["a", "1.0"], ["longer name", "10.25"]])
    assert len({len(line) for line in lines}) == 1  # every line the same width
    assert lines[2].endswith("  1.0") and lines[3].startswith("   longer name")
    assert math.isclose(float(lines[3].split()[-1]), 10.25)


@pytest.mark.slow
def test_tiny_other_scenarios(tmp_path):
    """The scenarios the tests above leave out, in this one process (``--in-process``: the
    default, a child process per scenario, runs in `test_first_call_and_scaled_devices`).

    The other two 32k-vocabulary trees are the same code path as ``disjoint_gpt32k`` (their
    trees are checked in `test_trees_and_layouts`); gather_slice runs only where it is
    compared with XLA's own reshard, to keep compile time down.
    """
    names = ["disjoint", "disjoint_gpt32k", "disjoint_scanned_bf16", "same_layout", "colocated"]
    names += ["replicated_src", "replicated_dst", "lora"]
    report, _ = run_bench(
        tmp_path,
        *[arg for n in names for arg in ("--scenario", n)],
        *(*TINY, "--gpt-d", "64", "--gpt-vocab", "256", "--gpt-layers", "1"),
        *("--lora-layers", "2", "--lora-rank", "4"),
        *("--strategies", "jaxreshard,device_put,xla_reshard", "--in-process"),
        *("--pairs", "1", "--warmup", "1", "--profile-reps", "1"),
    )
    assert [s["scenario"] for s in report["scenarios"]] == names and report["complete"]
    for rec in report["scenarios"]:
        check_timing_record(rec, pairs=1)
    colocated = by_strategy(report["scenarios"][names.index("colocated")])
    assert colocated["xla_reshard"]["verified"] is True
    assert colocated["device_put"]["host_bytes"] == 0  # one device set: no host round trip
    goals = check_goals(report)
    lora = goals["LoRA adapters: jaxreshard <= 1.5x device_put (many leaves of tens of KiB)"]
    assert (
        lora["value"]
        == by_strategy(report["scenarios"][names.index("lora")])["device_put"][
            "jr_over_this_ratio_of_medians"
        ]
    )
    for name in ("disjoint", "disjoint_gpt32k", "same_layout"):
        goal = goals[f"disjoint speed ({name}): jaxreshard <= 1.5x device_put"]
        rec = by_strategy(report["scenarios"][names.index(name)])
        assert goal["value"] == rec["device_put"]["jr_over_this_ratio_of_medians"]


def test_tiny_async_refit(tmp_path):
    """The async scenario: exposed time = start + wait, beside the synchronous refit, and the
    started refit's result is the call's, bit for bit."""
    report, out = run_bench(
        tmp_path, "--scenario", "async_refit", "--in-process", *TINY, "--pairs", "2"
    )
    (rec,) = report["scenarios"]
    assert rec["kind"] == "async" and rec["bit_identical"] is True
    assert rec["exposed_s"] == pytest.approx(rec["start_s"] + rec["wait_s"], rel=0.5, abs=5e-3)
    assert rec["exposed_over_sync"] == pytest.approx(rec["exposed_s"] / rec["sync_refit_s"])
    assert rec["decode_steps"] >= 1
    goal = check_goals(report)[
        "async refit: exposed time (start + wait in result) <= 0.2x the synchronous refit, "
        "with 3x its time of sampler work between"
    ]
    assert goal["value"] == rec["exposed_over_sync"]
    assert "plan.start + result" in out
