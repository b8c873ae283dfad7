"""The cost model on small hand-computed cases, and the cluster simulator.

Bandwidths in the hand-computed cases are tiny round numbers (bytes per second) so every
expected time can be checked on paper.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from jaxreshard.planning.layout import Layout
from jaxreshard.planning.route import LeafSpec
from jaxreshard.planning.route import route as topology_assign
from jaxreshard.planning.schedule import PlannedBucket, RoundPlan, build_schedule
from jaxreshard.planning.topology import Topology
from jaxreshard.tools import costmodel
from jaxreshard.tools import simulate as sim


def topo(latency=0.0):
    """Domains {0, 1, 2, 3} and {4, 5, 6, 7}: 100 B/s inside, 10 B/s across."""
    return Topology.from_groups(
        [[0, 1, 2, 3], [4, 5, 6, 7]], intra_bandwidth=100, inter_bandwidth=10,
        round_latency=latency,
    )  # fmt: skip


def uint8_leaf(n, src_ids, src_spec, dst_ids, dst_spec):
    src = Layout.from_mesh((n,), (len(src_ids),), ("s",), src_ids, src_spec)
    dst = Layout.from_mesh((n,), (len(dst_ids),), ("d",), dst_ids, dst_spec)
    return LeafSpec("x", src, dst, "uint8", "uint8", 1)


# ------------------------------------------------------------------------------ cost model


def test_a_round_costs_its_slowest_message_plus_latency():
    rounds = RoundPlan(
        chunk_bytes=100,
        class_chunk_bytes=(),
        buckets=(
            PlannedBucket(0, ((100, (((0, 1), 0),)),)),  # inside a domain: 100 / 100 + 1
            PlannedBucket(0, ((50, (((0, 4), 0), ((1, 2), 0))),)),  # one crosses: 50 / 10 + 1
        ),
    )
    cost = costmodel.schedule_cost(rounds, topo(latency=1.0))
    assert cost.seconds == pytest.approx(2.0 + 6.0)
    assert (cost.rounds, cost.slow_rounds) == (2, 1)
    assert (cost.wire_bytes_cross, cost.wire_bytes_intra) == (50, 150)


def test_fan_out_plan_and_its_lower_bound_by_hand():
    """128 bytes on device 0 only; devices 4 and 5 (the other domain) each need all of it.

    Plan: 64 bytes cross to 4 and 64 to 5 (device 0 sends both: two slow rounds of 64 B at
    10 B/s), then 4 and 5 swap halves (one fast round, 64 B at 100 B/s): 12.8 + 0.64 s plus
    three round latencies. Bound: domain 0 must export 128 B through its one device's NIC:
    12.8 s, plus one latency."""
    t = topo(latency=0.1)
    lf = uint8_leaf(128, (0,), (), (4, 5), ())
    assignment = topology_assign([lf], t)
    schedule = build_schedule(
        [lf],
        assignment.pieces,
        bucket_bytes=1 << 20,
        link_class=t.link_class,
        class_latency_bytes=t.class_latency_bytes(),
    )
    cost = costmodel.schedule_cost(schedule, t)
    assert cost.seconds == pytest.approx(2 * 6.4 + 0.64 + 3 * 0.1)
    bound = costmodel.lower_bound([lf], t)
    assert bound.seconds == pytest.approx(12.8 + 0.1)
    assert bound.binding.startswith("domain 0 sends out")
    assert bound.bytes_cross_needed == 128


def test_lower_bound_domain_ingress_by_hand():
    """The same 128 bytes held by all four devices of domain 0; devices 4..7 each need it.
    Domain 1 must take 128 B in over 4 NICs and its devices receive 3 x 128 B more over
    NVLink: (128 / 10 + 384 / 100) / 4 = 4.16 s. Every device's own 128 B at 100 B/s is
    1.28 s; export is not bound (each byte has four holders... but only domain 0 has it:
    128 B over 4 NICs = 3.2 s)."""
    lf = uint8_leaf(128, (0, 1, 2, 3), (), (4, 5, 6, 7), ())
    bound = costmodel.lower_bound([lf], topo())
    assert bound.seconds == pytest.approx((128 / 10 + 384 / 100) / 4)
    assert bound.binding.startswith("domain 1's 4 receivers take")


def test_baselines_by_hand():
    """A 128-byte array split in halves over devices 0, 1 (domain 0); devices 4, 5 (domain 1)
    each need all of it. No latency.

    - all-gather + broadcast: 0 and 1 each fetch the other half inside the domain (64 / 100);
      device 0 then broadcasts 128 B, leaving its domain through its one NIC (128 / 10):
      0.64 + 12.8.
    - rank-0 broadcast: device 0 fetches the other half (64 / 100), then sends 128 B to each of
      4 and 5 over its NIC (2 x 12.8): 0.64 + 25.6.
    - direct: 4 and 5 each fetch a half from 0 and a half from 1; the busiest device (each
      sender, each receiver) carries 128 B across: 12.8."""
    lf = uint8_leaf(128, (0, 1), ("s",), (4, 5), ())
    t = topo()
    assert costmodel.allgather_broadcast([lf], t) == pytest.approx(0.64 + 12.8)
    assert costmodel.rank0_broadcast([lf], t) == pytest.approx(0.64 + 25.6)
    assert costmodel.direct([lf], t, chunk_bytes=1 << 20) == pytest.approx(12.8)


def test_nothing_to_move_costs_nothing():
    lf = uint8_leaf(64, (0, 1), ("s",), (0, 1), ("d",))
    assert costmodel.lower_bound([lf], topo(latency=1.0)).seconds == 0
    assert costmodel.direct([lf], topo(latency=1.0), chunk_bytes=16) == 0


# ------------------------------------------------------------------------------- simulator


def test_inventories_match_the_published_parameter_counts():
    counts = {name: make().num_params / 1e9 for name, make in sim.MODELS.items()}
    assert counts["deepseek-v3"] == pytest.approx(671.0, abs=0.1)
    assert counts["qwen3-235b-a22b"] == pytest.approx(235.1, abs=0.1)
    assert counts["llama-3.1-70b"] == pytest.approx(70.55, abs=0.1)
    assert counts["qwen3-4b"] == pytest.approx(4.02, abs=0.01)


def test_parse_strategy_folds_ep_and_fills_dp():
    s = sim.parse_strategy("EP16 DP2 PP4")
    assert s.axes == (("pp", 4), ("dp", 2), ("ep", 16)) and s.ep_axes == ("ep",)
    folded = sim.parse_strategy("TP2 EP16 PP4", devices=64)
    assert folded.axes == (("pp", 4), ("dp", 8), ("tp", 2)) and folded.ep_axes == ("dp", "tp")
    assert sim.parse_strategy("TP8 DP16").num_devices == 128
    with pytest.raises(ValueError, match="unknown axis"):
        sim.parse_strategy("XP4")
    with pytest.raises(ValueError, match="does not fit"):
        sim.parse_strategy("TP3", devices=8)


def test_pipeline_stages_split_the_stacked_layer_axis_unevenly():
    assert sim.stage_layers(61, 4) == [(0, 16), (16, 31), (31, 46), (46, 61)]
    model = sim.deepseek_v3()
    s = sim.parse_strategy("EP16 DP2 PP4")
    q_a = next(p for p in model.params if p.name == "attn.q_a")
    lay = sim.layout(q_a, model, s, range(128))
    assert lay.box_of[0][0] == (0, 16) and lay.box_of[127][0] == (46, 61)
    dense = next(p for p in model.params if p.name == "dense.up")
    assert set(sim.layout(dense, model, s, range(128)).devices) == set(range(32))  # stage 0
    experts = next(p for p in model.params if p.name == "moe.experts.up")
    lay = sim.layout(experts, model, s, range(128))
    assert lay.box_of[0] == ((0, 13), (0, 16), (0, 7168), (0, 2048))  # layers 3..15, EP rank 0
    assert lay.box_of[17][1] == (16, 32)  # DP rank 1, EP rank 1


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    model = sim.qwen3_235b()
    k = next(p for p in model.params if p.name == "attn.k")  # 4 KV heads of 128
    lay = sim.layout(k, model, sim.parse_strategy("TP8"), range(8))
    assert [lay.box_of[i][2] for i in range(8)] == [
        (0, 128), (0, 128), (128, 256), (128, 256),
        (256, 384), (256, 384), (384, 512), (384, 512),
    ]  # fmt: skip


def test_small_scenario_meets_the_targets():
    r = sim.run_scenario("qwen3-4b", materialize=True)
    assert r.stats.bytes_sent == r.stats.bytes_lower_bound > 0
    assert r.cost.seconds <= 1.15 * r.bound.seconds
    assert r.allgather_broadcast >= 2 * r.cost.seconds
    assert r.full_planning_seconds is not None


def test_fan_out_scenario_on_a_small_virtual_cluster():
    """Qwen3-4B from FSDP8 (ids 0..7, one H100 domain) to TP4 DP2 (ids 8..15, one domain):
    each byte crosses once, split over both replicas, then each relays its half to the other."""
    r = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100")
    s = r.stats
    full = sum(math.prod(p.shape) for p in r.model.params) * 2
    assert s.bytes_cross_domain == full == r.bound.bytes_cross_needed
    assert s.bytes_relayed == s.bytes_lower_bound - full
    assert s.bytes_sent == s.bytes_lower_bound  # 2 replicas (norms are held by every TP rank)
    assert r.cost.seconds <= 1.15 * r.bound.seconds


def test_two_destination_domains_are_bound_by_the_source_nics():
    """A known limit: bytes leave the source domain once per destination domain (no relaying
    between destination domains), so when the source has few NICs its export binds; the bound
    counts each byte leaving once. Here 8 source NICs export the model twice."""
    r = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP4", "h100")
    full = sum(math.prod(p.shape) for p in r.model.params) * 2
    assert r.stats.bytes_cross_domain == 2 * full
    export = 2 * full / (8 * r.topology.inter_bandwidth)
    assert r.cost.seconds >= export > 1.5 * r.bound.seconds


def test_cli_prints_the_table(capsys):
    assert sim.main(["--model", "qwen3-4b", "--src", "FSDP8", "--dst", "TP8", "--colocated"]) == 0
    out = capsys.readouterr().out
    for row in ("modeled time", "lower bound", "all-gather + broadcast", "rank-0 broadcast",
                "direct p2p", "bytes: per link class", "rounds", "planning"):  # fmt: skip
        assert row in out


def test_cli_runs_as_a_module():
    done = subprocess.run(
        [sys.executable, "-m", "jaxreshard.simulate", "--scenario", "qwen3-4b"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "qwen3-4b: FSDP8 -> TP8" in done.stdout and "modeled time" in done.stdout


@pytest.mark.parametrize("name", sorted(sim.SCENARIOS))
def test_every_scenario_meets_the_targets(name):
    """The issue's targets, on the four published setups (about 4 s in all)."""
    r = sim.run_scenario(name)
    assert r.stats.bytes_sent == r.stats.bytes_lower_bound
    assert r.cost.seconds <= 1.15 * r.bound.seconds
    assert r.allgather_broadcast >= 2 * r.cost.seconds
    assert r.planning_seconds < 10


def test_results_are_deterministic():
    a = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100")
    b = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100")
    assert a.rounds == b.rounds and a.stats == b.stats
    assert np.isclose(a.cost.seconds, b.cost.seconds)
