"""Topologies, topology-aware planning and hierarchical fan-out.

Plans over two declared domains must send exactly the lower bound, cross domains once per
destination domain, and rebuild every destination shard bit for bit: on virtual devices through
the NumPy model of the executor, and for real on the 8 CPU devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import assert_reference_exact, leaf_spec

import jaxreshard as jr
from jaxreshard.planning.layout import box_size
from jaxreshard.planning.route import Piece, _min_max_quotas
from jaxreshard.planning.route import route as topology_assign
from jaxreshard.planning.schedule import build_schedule, plan_rounds, plan_stats
from jaxreshard.planning.topology import PROFILES, Topology
from jaxreshard.tools.costmodel import executor_floor, modeled_time, physical_bound

TWO_BY_FOUR = Topology.from_groups([[0, 1, 2, 3], [4, 5, 6, 7]])


def check_virtual(leaves, topology, bucket_bytes=1 << 20, **route_options):
    """Plan with the topology, run the NumPy executor model, check every invariant."""
    assignment = topology_assign(leaves, topology, **route_options)
    options = dict(
        bucket_bytes=bucket_bytes,
        link_class=topology.link_class,
        class_latency_bytes=topology.class_latency_bytes(),
    )
    schedule = build_schedule(leaves, assignment.pieces, **options)
    stats = plan_stats(leaves, assignment, schedule, crosses=topology.crosses)
    assert (
        plan_stats(
            leaves,
            assignment,
            plan_rounds(leaves, assignment.pieces, **options),
            crosses=topology.crosses,
        )
        == stats
    ), "plan_rounds must make the rounds build_schedule makes"
    assert_reference_exact(leaves, assignment, schedule)
    assert stats.bytes_sent == stats.bytes_lower_bound
    for bucket in schedule.buckets:
        for perm in bucket.perms():
            assert len({s for s, _ in perm}) == len(perm), "a device sends twice in a round"
            assert len({d for _, d in perm}) == len(perm), "a device receives twice in a round"
    return stats, assignment, schedule


# ------------------------------------------------------------------------------ topologies


def test_from_groups_places_devices_in_domains():
    t = Topology.from_groups([[0, 1], [2, 3]], intra_bandwidth=10, inter_bandwidth=1)
    assert t.domain_of == {0: 0, 1: 0, 2: 1, 3: 1}
    assert t.crosses(1, 2) and not t.crosses(2, 3)
    assert (t.tier(0, 1), t.tier(0, 3)) == (0, 1)
    assert (t.bandwidth(0, 1), t.bandwidth(0, 3)) == (10, 1)
    assert t.members == {0: (0, 1), 1: (2, 3)}
    assert hash(t) == hash(Topology.from_groups([[0, 1], [2, 3]], intra_bandwidth=10,
                                                inter_bandwidth=1))  # fmt: skip


def test_from_groups_accepts_jax_devices(devices):
    t = Topology.from_groups([devices[:4], devices[4:]])
    assert [t.domain_of[d.id] for d in devices] == [0] * 4 + [1] * 4


def test_from_devices_uses_process_index_on_one_host(devices):
    t = Topology.from_devices(devices)
    assert set(t.domains) == {0} and set(t.hosts) == {0}
    assert t.devices == tuple(d.id for d in devices)


@pytest.mark.parametrize(("name", "size", "intra", "inter"), [
    ("h100", 8, 450e9, 50e9),
    ("gb200-nvl72", 72, 900e9, 50e9),
])  # fmt: skip
def test_profiles(name, size, intra, inter):
    t = Topology.profile(name, 2 * size + 3)
    assert (t.intra_bandwidth, t.inter_bandwidth) == (intra, inter)
    assert [len(m) for m in t.members.values()] == [size, size, 3]
    assert PROFILES[name].source  # every profile says where its numbers come from


def test_profile_domain_size_override_and_unknown_name():
    assert [
        len(m) for m in Topology.profile("gb200-nvl72", 128, domain_size=64).members.values()
    ] == [64, 64]
    with pytest.raises(ValueError, match="unknown topology profile"):
        Topology.profile("a100", 8)


def test_profile_domains_and_hosts_count_from_the_first_device():
    """``Topology.profile(name, n, first_device=f)`` numbers its devices f, f + 1, ... and
    groups them into domains and hosts of the profile's sizes counted from f (a sampler whose
    ids start at 4 fills whole domains): 16 h100 devices from id 4 are two domains (and hosts)
    of 8, ids 4-11 and 12-19. Mutation check: domains counted from id 0 made three, of 4, 8
    and 4 devices."""
    t = Topology.profile("h100", 16, first_device=4)
    assert t.devices == tuple(range(4, 20))
    assert t.members == {0: tuple(range(4, 12)), 1: tuple(range(12, 20))}
    assert t.domains == t.hosts == (0,) * 8 + (1,) * 8


def test_profile_domains_smaller_than_its_hosts_are_hosts_of_their_own():
    """A host's devices are in one fast domain: with domains of 4 where an h100 host holds
    8 devices, each domain is a host of its own (16 devices: 4 domains, 4 hosts, alike).
    Mutation check: hosts kept the profile's 8 devices, each spanning two domains."""
    t = Topology.profile("h100", 16, domain_size=4)
    assert t.domains == t.hosts == (0,) * 4 + (1,) * 4 + (2,) * 4 + (3,) * 4


def test_bad_topologies_are_rejected():
    with pytest.raises(ValueError, match="twice"):
        Topology.from_groups([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="positive"):
        Topology.from_groups([[0]], inter_bandwidth=0)
    # Regression: these were taken and failed later inside planning (OverflowError,
    # ZeroDivisionError), or placed a device on the last of two hosts silently.
    for bad in ({"inter_bandwidth": float("inf")}, {"intra_bandwidth": float("nan")}):
        with pytest.raises(jr.ReshardError, match="positive and finite"):
            Topology.from_groups([[0]], **bad)
    with pytest.raises(jr.ReshardError, match="round_latency must be finite"):
        Topology.from_groups([[0]], round_latency=float("nan"))
    for size in (0, -2):
        with pytest.raises(jr.ReshardError, match="domain_size must be at least 1"):
            Topology.profile("h100", 8, domain_size=size)
    with pytest.raises(jr.ReshardError, match="places device 1 on two hosts"):
        Topology.from_groups([[0, 1], [2]], hosts=[[0, 1], [1, 2]])


def test_a_topology_missing_a_device_names_it():
    lf = leaf_spec((8,), ((2,), ("x",), (0, 1), ("x",)), ((1,), ("y",), (9,), ()))
    with pytest.raises(jr.ReshardError, match=r"does not place devices \[9\]"):
        topology_assign([lf], TWO_BY_FOUR)


# -------------------------------------------------------------------- planning (virtual)

# A (64, 32) array sharded in halves on devices 0, 1 (domain A = 0..3); the destination is
# TP2 x DP3 on devices 2..7: replica {2, 3} in A, replicas {4, 5} and {6, 7} in B = 4..7.
SRC = ((2,), ("x",), (0, 1), ("x",))
DST = ((3, 2), ("dp", "tp"), (2, 3, 4, 5, 6, 7), (None, "tp"))
ARRAY_BYTES = 64 * 32 * 4
TP_SLICE = ARRAY_BYTES // 2


def test_fan_out_crosses_once_per_domain_and_relays_inside():
    stats, assignment, _ = check_virtual([leaf_spec((64, 32), SRC, DST)], TWO_BY_FOUR)
    # Devices 2, 3 lack their TP slice; so do 4, 5, 6, 7: six slices.
    assert stats.bytes_lower_bound == 6 * TP_SLICE
    # Domain B needs the whole array once: each of its four devices takes half its slice
    # across, then forwards it to the other replica of its slice.
    assert stats.bytes_cross_domain == ARRAY_BYTES
    assert stats.bytes_relayed == ARRAY_BYTES
    cross = defaultdict(int)
    for p in assignment.pieces:
        n = box_size(p.box) * 4
        if TWO_BY_FOUR.crosses(p.src, p.dst):
            assert p.stage == 0 and p.src in (0, 1) and p.dst in (4, 5, 6, 7)
            cross[p.dst] += n
        elif p.from_dst:
            assert p.stage == 1 and {p.src, p.dst} in ({4, 6}, {5, 7})
        else:  # replica {2, 3} is served inside A, read from the source, beside the relays
            assert p.src in (0, 1) and p.dst in (2, 3)
    assert dict(cross) == {d: TP_SLICE // 2 for d in (4, 5, 6, 7)}


# Replicated over all of domain B, or over 4, 5, 6 of it.
ON_B = ((4,), ("dp",), (4, 5, 6, 7), ())
ON_456 = ((3,), ("dp",), (4, 5, 6), ())


def _imports(assignment, leaf=None):
    """Bytes each device takes across domains (of one leaf, or all)."""
    out = defaultdict(int)
    for p in assignment.pieces:
        if TWO_BY_FOUR.crosses(p.src, p.dst) and leaf in (None, p.leaf):
            out[p.dst] += box_size(p.box) * 4
    return dict(out)


def test_a_leaf_smaller_than_a_share_per_device_is_imported_by_fewer_devices_in_turn():
    """Every share is relayed to all the others of its domain, so tiny shares only multiply
    pieces: with ``min_share_bytes`` a whole-array share, one device imports each leaf (the
    next leaf the next device) and relays it to the other three."""
    leaves = [leaf_spec((64, 32), SRC, ON_B, path=f"norm{i}") for i in range(2)]
    stats, assignment, _ = check_virtual(leaves, TWO_BY_FOUR, min_share_bytes=ARRAY_BYTES)
    assert _imports(assignment, 0) == {4: ARRAY_BYTES}
    assert _imports(assignment, 1) == {5: ARRAY_BYTES}
    assert stats.bytes_relayed == 2 * 3 * ARRAY_BYTES
    halves, _, _ = check_virtual(leaves[:1], TWO_BY_FOUR, min_share_bytes=ARRAY_BYTES // 2)
    assert halves.bytes_cross_domain == ARRAY_BYTES and halves.max_device_recv_bytes == ARRAY_BYTES


def test_small_leaves_are_pooled_into_one_share_per_device():
    """With ``pool_bytes``, consecutive leaves are shared out as one: each of the four devices
    imports a quarter of the two leaves, half a leaf each, so each leaf has two importers (per
    leaf, all four would import a quarter of each)."""
    leaves = [leaf_spec((64, 32), SRC, ON_B, path=f"norm{i}") for i in range(2)]
    _, assignment, _ = check_virtual(leaves, TWO_BY_FOUR, pool_bytes=2 * ARRAY_BYTES)
    assert _imports(assignment) == {d: ARRAY_BYTES // 2 for d in (4, 5, 6, 7)}
    assert len(_imports(assignment, 0)) == len(_imports(assignment, 1)) == 2
    _, per_leaf, _ = check_virtual(leaves, TWO_BY_FOUR)
    assert len(_imports(per_leaf, 0)) == len(_imports(per_leaf, 1)) == 4


def test_a_share_spanning_adjacent_regions_is_relayed_as_one_box():
    """Four sources hold a quarter of the rows each; 4 and 5 import half the array each (two
    regions, from two senders) and each forwards its half to the other as one box."""
    src = ((4,), ("x",), (0, 1, 2, 3), ("x",))
    lf = leaf_spec((64, 32), src, ((2,), ("dp",), (4, 5), ()))
    _, assignment, _ = check_virtual([lf], TWO_BY_FOUR)
    relays = sorted((p.src, p.dst, p.box) for p in assignment.pieces if p.from_dst)
    assert relays == [(4, 5, ((0, 32), (0, 32))), (5, 4, ((32, 64), (0, 32)))]


def test_a_share_relayed_inside_a_domain_is_one_fan_listed_as_a_piece_per_receiver():
    """Devices 4-7 (one domain) each lack the whole array: each imports a quarter and relays
    it to the three others. The assignment holds that as four fans of three receivers; its
    ``pieces`` list twelve relays, one per (sender, receiver), sorted like every piece (by
    stage, sender, receiver, leaf, box), and the statistics count 3/4 of the array relayed
    into each of the four devices."""
    src = ((4,), ("x",), (0, 1, 2, 3), ("x",))
    lf = leaf_spec((64, 32), src, ((4,), ("dp",), (4, 5, 6, 7), ()))
    stats, assignment, _ = check_virtual([lf], TWO_BY_FOUR)
    fans = {(f.src, f.dsts) for f in assignment.fans}
    assert fans == {(d, tuple(o for o in (4, 5, 6, 7) if o != d)) for d in (4, 5, 6, 7)}
    assert all(box_size(f.box) * 4 == ARRAY_BYTES // 4 and f.stage == 1 for f in assignment.fans)
    relays = [p for p in assignment.pieces if p.from_dst]
    assert sorted((p.src, p.dst) for p in relays) == [
        (s, d) for s in (4, 5, 6, 7) for d in (4, 5, 6, 7) if s != d
    ]
    order = [(p.stage, p.src, p.dst, p.leaf, p.box) for p in assignment.pieces]
    assert order == sorted(order)
    assert stats.bytes_relayed == 4 * ARRAY_BYTES * 3 // 4


def test_leaves_with_the_same_demands_get_the_same_senders():
    """Two leaves laid out alike (a model's layers) are balanced alike, each over its own
    pieces: the second leaf's pieces are the first's, for its own index."""
    src = ((2, 2), ("dp", "x"), (0, 1, 2, 3), (None, "x"))
    leaves = [leaf_spec((64, 32), src, ((4,), ("x",), (4, 5, 6, 7), ("x",))) for _ in range(2)]
    _, assignment, _ = check_virtual(leaves, TWO_BY_FOUR)
    sent = [{(p.src, p.dst, p.box) for p in assignment.pieces if p.leaf == i} for i in (0, 1)]
    assert sent[0] == sent[1] and len({s for s, _, _ in sent[0]}) == 4


def test_shares_end_on_whole_rows_when_a_row_is_small():
    """Three importers of 256 rows: a share of 85.3 rows ends on a row (85 or 86 rows, one
    box each), not in the middle of one (two boxes); balance within a row."""
    lf = leaf_spec((256, 8), SRC, ON_456)
    _, assignment, _ = check_virtual([lf], TWO_BY_FOUR)
    crossing = [p for p in assignment.pieces if TWO_BY_FOUR.crosses(p.src, p.dst)]
    assert all(p.box[1] == (0, 8) for p in crossing)
    imports = _imports(assignment)
    assert sorted(imports) == [4, 5, 6]
    assert max(imports.values()) - min(imports.values()) <= 2 * 8 * 4


# Four domains of two devices: the sources in A, the destination replicated over B, C and D.
FOUR_BY_TWO = Topology.from_groups([[0, 1], [2, 3], [4, 5], [6, 7]])
ON_BCD = ((6,), ("dp",), (2, 3, 4, 5, 6, 7), ())
CHAIN_BYTES = 48 * 32 * 4
SHARE_ROWS = 8  # 48 rows in 3 domains x 2 positions


def _sent(assignment, stage, crossing):
    """Bytes each device sends in ``stage``, across domains or inside them."""
    out = defaultdict(int)
    for p in assignment.pieces:
        if p.stage == stage and FOUR_BY_TWO.crosses(p.src, p.dst) == crossing:
            out[p.src] += box_size(p.box) * 4
    return dict(out)


def test_destination_domains_that_outnumber_the_sources_forward_to_each_other():
    """Three destination domains need the whole array, held by two source devices: sent
    into every domain, each source would send 1.5 arrays while a destination device takes in
    half of one. Chained, the array leaves the sources once, as six shares of 8 rows: share
    ``s`` is imported by domain ``s mod 3`` at position ``s // 3`` (stage 0), which relays
    it to its peer and forwards it to the same position of the two other domains (stage 1);
    those relay it to their peer (stage 2), the two shares of one position as one box where
    they are adjacent."""
    lf = leaf_spec((48, 32), SRC, ON_BCD)
    stats, assignment, _ = check_virtual([lf], FOUR_BY_TWO, chain=True)
    imports = {p.dst: p.box[0] for p in assignment.pieces if p.stage == 0 and p.src in (0, 1)}
    rows = [(SHARE_ROWS * s, SHARE_ROWS * (s + 1)) for s in range(6)]
    assert imports == {2: rows[0], 4: rows[1], 6: rows[2], 3: rows[3], 5: rows[4], 7: rows[5]}
    assert sum(_sent(assignment, 0, True).values()) == CHAIN_BYTES  # once, not three times
    share = CHAIN_BYTES // 6
    assert _sent(assignment, 1, True) == {d: 2 * share for d in range(2, 8)}  # forwards
    assert _sent(assignment, 1, False) == {d: share for d in range(2, 8)}  # own share to peer
    assert _sent(assignment, 2, False) == {d: 2 * share for d in range(2, 8)}
    forwards = {(p.src, p.dst) for p in assignment.pieces if p.stage == 1}
    assert (2, 4) in forwards and (2, 6) in forwards and (2, 5) not in forwards  # position 0
    stage2 = [(p.src, p.dst, p.box[0]) for p in assignment.pieces if p.stage == 2]
    assert (2, 3, (8, 24)) in stage2  # shares 1 and 2, adjacent: one box
    assert sorted(b for s, _, b in stage2 if s == 4) == [(0, 8), (16, 24)]  # around its own
    # Every domain still takes in each byte once.
    assert stats.bytes_cross_domain == 3 * CHAIN_BYTES
    unchained, plain, _ = check_virtual([lf], FOUR_BY_TWO)
    assert unchained.bytes_cross_domain == stats.bytes_cross_domain
    assert sum(_sent(plain, 0, True).values()) == 3 * CHAIN_BYTES
    assert {p.stage for p in plain.pieces} == {0, 1}


def test_devices_alone_in_their_domain_are_chained_as_groups_of_one():
    """The destination's TP pairs lie inside domains B, C and D (one data-parallel replica
    each), so no two devices of a domain lack the same bytes: there is nothing to fan out in
    a domain. Sent directly, source 0 would send its half of the array to three devices
    (1.5 arrays) while each takes in half of one. Chained, each half leaves its source once,
    in three shares, one imported by each domain's device at that TP rank (stage 0), which
    forwards it to the same TP rank in the two other domains (stage 1); there is no stage 2
    (no peer inside a domain needs it)."""
    src = ((2,), ("x",), (0, 1), ("x",))
    dst = ((3, 2), ("dp", "tp"), (2, 3, 4, 5, 6, 7), ("tp",))
    lf = leaf_spec((48, 32), src, dst)
    stats, assignment, _ = check_virtual([lf], FOUR_BY_TWO, chain=True)  # exact, by NumPy
    half = CHAIN_BYTES // 2
    assert _sent(assignment, 0, True) == {0: half, 1: half}  # each half leaves once
    assert {p.stage for p in assignment.pieces} == {0, 1}
    assert _sent(assignment, 1, True) == {d: 2 * half // 3 for d in range(2, 8)}  # forwards
    tp_rank = {2: 0, 4: 0, 6: 0, 3: 1, 5: 1, 7: 1}
    assert all(tp_rank[p.src] == tp_rank[p.dst] for p in assignment.pieces if p.stage == 1)
    assert stats.bytes_cross_domain == 3 * CHAIN_BYTES  # every domain takes in each byte once
    assert stats.bytes_sent == stats.bytes_lower_bound
    _, plain, _ = check_virtual([lf], FOUR_BY_TWO)  # without chaining: directly, thrice
    assert _sent(plain, 0, True) == {0: 3 * half, 1: 3 * half}


def test_domains_are_not_chained_where_the_sources_keep_up():
    """Four source devices in two domains and two destination domains: sending every domain
    its bytes loads a source device with half an array, as much as a destination device
    takes in, so nothing is forwarded between domains (a stage for nothing)."""
    src = ((4,), ("x",), (0, 1, 2, 3), ("x",))
    lf = leaf_spec((48, 32), src, ((4,), ("dp",), (4, 5, 6, 7), ()))
    _, assignment, _ = check_virtual([lf], FOUR_BY_TWO, chain=True)
    assert {p.stage for p in assignment.pieces} == {0, 1}
    assert not any(p.from_dst and FOUR_BY_TWO.crosses(p.src, p.dst) for p in assignment.pieces)


def test_without_fan_out_every_destination_device_crosses():
    assignment = topology_assign([leaf_spec((64, 32), SRC, DST)], TWO_BY_FOUR, fan_out=False)
    cross = sum(box_size(p.box) * 4 for p in assignment.pieces if TWO_BY_FOUR.crosses(p.src, p.dst))
    assert cross == 4 * TP_SLICE and all(p.stage == 0 for p in assignment.pieces)


def test_senders_in_the_receivers_domain_are_preferred():
    """Replicas on 0 (A) and 4 (B): every receiver is served from its own domain."""
    lf = leaf_spec(
        (16, 16), ((2,), ("dp",), (0, 4), ()), ((4,), ("tp",), (1, 2, 5, 6), (None, "tp"))
    )
    stats, assignment, _ = check_virtual([lf], TWO_BY_FOUR)
    assert stats.bytes_cross_domain == 0
    assert all(not TWO_BY_FOUR.crosses(p.src, p.dst) for p in assignment.pieces)


def test_cross_domain_sends_are_balanced_over_replicas():
    """Four replicas in A feed four devices of B, one receiver each."""
    lf = leaf_spec(
        (64, 8), ((4,), ("dp",), (0, 1, 2, 3), ()), ((4,), ("tp",), (4, 5, 6, 7), ("tp",))
    )
    stats, _, _ = check_virtual([lf], TWO_BY_FOUR)
    assert stats.max_device_send_bytes == 64 * 8 * 4 // 4


def test_many_leaves_and_dtypes_fan_out_exactly():
    dst = ((2, 2, 2), ("dp", "fsdp", "tp"), (0, 4, 1, 5, 2, 6, 3, 7), ("fsdp", "tp"))
    leaves = [
        leaf_spec((24, 16), ((2, 2), ("a", "b"), (0, 1, 2, 3), ("a", "b")), dst, dtype=dt, path=dt)
        for dt in ("float32", "int8", "float16", "float64")
    ]
    stats, _, _ = check_virtual(leaves, TWO_BY_FOUR, bucket_bytes=256)
    assert stats.bytes_relayed > 0


def test_slow_rounds_are_as_few_as_the_busiest_device_needs():
    """With link classes, cross-domain chunks get rounds of their own: exactly the busiest
    device's count of cross-domain chunks (plus tail rounds)."""
    lf = leaf_spec((256, 64), SRC, DST)
    assignment = topology_assign([lf], TWO_BY_FOUR)
    schedule = build_schedule(
        [lf], assignment.pieces, bucket_bytes=4096, link_class=TWO_BY_FOUR.link_class
    )
    degree = defaultdict(int)
    slow_rounds = 0
    for bucket in schedule.buckets:
        crossing = set()
        for m in bucket.messages:
            if TWO_BY_FOUR.crosses(m.src, m.dst):
                crossing.add(m.slot)
                degree["s", m.src] += 1
                degree["r", m.dst] += 1
        slow_rounds += len(crossing)
    assert slow_rounds == max(degree.values())


def test_min_max_quotas_when_the_largest_group_alone_is_not_feasible():
    """Regression: the bisection's upper end was the largest group's bytes, which is not
    always feasible (here 0 and 1 must each carry 10 of their own, plus half of the shared)."""
    quotas = _min_max_quotas({(0,): 10, (1,): 10, (0, 1): 10, (2, 3): 1})
    assert quotas[0, 1][0] + quotas[0, 1][1] == 10
    a = leaf_spec((10,), ((1,), ("x",), (0,), ()), ((1,), ("y",), (4,), ()), dtype="uint8")
    b = leaf_spec((10,), ((1,), ("x",), (1,), ()), ((1,), ("y",), (4,), ()), dtype="uint8")
    c = leaf_spec((10,), ((2,), ("x",), (0, 1), ()), ((1,), ("y",), (5,), ()), dtype="uint8")
    d = leaf_spec((1,), ((2,), ("x",), (2, 3), ()), ((1,), ("y",), (5,), ()), dtype="uint8")
    pieces = topology_assign([a, b, c, d], Topology.from_groups([range(6)]), fan_out=False).pieces
    assert sum(box_size(p.box) for p in pieces) == 31


def test_a_relay_needs_a_later_stage():
    with pytest.raises(ValueError, match="stage > 0"):
        Piece(0, 0, 1, ((0, 1),), stage=0, relay=True)
    assert Piece(0, 0, 1, ((0, 1),), stage=1, relay=False).from_dst is False
    assert Piece(0, 0, 1, ((0, 1),), stage=1).from_dst is True


# ------------------------------------------------------------------ real run, 8 CPU devices


def _mesh(devices, ids, shape, names):
    return Mesh(np.array([devices[i] for i in ids]).reshape(shape), names)


def _check_real(out, want):
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def test_hierarchical_plan_runs_bit_exact_on_cpu_devices(devices):
    topo = Topology.from_groups([devices[:4], devices[4:]])
    src = NamedSharding(_mesh(devices, (0, 1), (2,), ("x",)), P("x"))
    dst = NamedSharding(_mesh(devices, (2, 3, 4, 5, 6, 7), (3, 2), ("dp", "tp")), P(None, "tp"))
    value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) * 1.5 - 7
    x = jax.device_put(value, src)
    plan = jr.plan({"w": x}, {"w": dst}, topology=topo)
    s = plan.stats
    assert s.bytes_sent == s.bytes_lower_bound == 6 * TP_SLICE
    assert s.bytes_cross_domain == ARRAY_BYTES and s.bytes_relayed == ARRAY_BYTES
    assert {p.stage for p in plan.assignment.pieces} == {0, 1}
    out = plan({"w": x})["w"]
    assert out.sharding == dst
    _check_real(out, value)
    again = plan({"w": x}, donate={"w": out})["w"]  # donated buffers receive the relays too
    _check_real(again, value)


def _three_domains_from_one(devices, seed):
    """Four domains of two devices; three float32 (48, 32) leaves split over the first
    domain, to be replicated over the other three (chained: they forward to each other).
    Returns the topology, the destination sharding, the host values and the source arrays."""
    topo = Topology.from_groups([devices[i : i + 2] for i in range(0, 8, 2)])
    src = NamedSharding(_mesh(devices, (0, 1), (2,), ("x",)), P("x"))
    dst = NamedSharding(_mesh(devices, (2, 3, 4, 5, 6, 7), (6,), ("dp",)), P())
    rng = np.random.default_rng(seed)
    tree = {f"w{i}": rng.standard_normal((48, 32)).astype(np.float32) for i in range(3)}
    return topo, dst, tree, {k: jax.device_put(v, src) for k, v in tree.items()}


def test_chained_plan_runs_bit_exact_under_the_transfer_guard(devices):
    """`jaxreshard.plan` chains destination domains (three domains, one source domain of two
    devices): relays of stage 2 forward what a stage-1 relay brought from another domain,
    pipelined unit after unit. Exact on real buffers, donated ones too, with no host
    transfer."""
    topo, dst, tree, x = _three_domains_from_one(devices, seed=1)
    plan = jr.plan(x, {k: dst for k in tree}, topology=topo, bucket_bytes=4096)
    assert {p.stage for p in plan.assignment.pieces} == {0, 1, 2}
    assert plan.stats.bytes_sent == plan.stats.bytes_lower_bound
    _runs_bit_exact_under_the_guard(plan, x, tree)


def test_transfer_programs_take_the_callers_xla_options_and_none_of_their_own(devices):
    """jaxreshard asks XLA for no option of its own for the transfer programs, on any backend
    (XLA GPU compiles their collective-permutes one after another whatever
    ``xla_gpu_experimental_parallel_collective_overlap_limit`` says: README, "GPUs"). A
    caller's ``compiler_options`` reach them, and ``describe()`` names them."""
    topo, dst, tree, x = _three_domains_from_one(devices, seed=2)
    plain = jr.plan(x, {k: dst for k in tree}, topology=topo, bucket_bytes=4096)
    assert plain.runtime.transfer_options == {} and "ask for" not in plain.describe()
    mine = jr.plan(
        x,
        {k: dst for k in tree},
        topology=topo,
        bucket_bytes=4096,
        compiler_options={"xla_cpu_enable_fast_math": False},
    )
    assert "ask for {'xla_cpu_enable_fast_math': False}" in mine.describe()
    _runs_bit_exact_under_the_guard(mine, x, tree)


def _runs_bit_exact_under_the_guard(plan, x, tree) -> None:
    """``plan(x)`` is ``tree`` to the bit with no host transfer, into fresh buffers and into
    donated ones (which receive the forwarded bytes too)."""
    with jax.transfer_guard("disallow"):
        out = plan(x)
    for k, v in tree.items():
        _check_real(out[k], v)
    with jax.transfer_guard("disallow"):
        again = plan(x, donate=out)
    for k, v in tree.items():
        _check_real(again[k], v)


def test_devices_alone_in_their_domain_chained_run_bit_exact(devices):
    """The same on real buffers where each destination domain holds one TP pair (a device
    alone in its domain to lack each half): chained as groups of one, stages 0 and 1 only."""
    topo = Topology.from_groups([devices[i : i + 2] for i in range(0, 8, 2)])
    src = NamedSharding(_mesh(devices, (0, 1), (2,), ("x",)), P("x"))
    dst = NamedSharding(_mesh(devices, (2, 3, 4, 5, 6, 7), (3, 2), ("dp", "tp")), P("tp"))
    rng = np.random.default_rng(2)
    tree = {f"w{i}": rng.standard_normal((48, 32)).astype(np.float32) for i in range(3)}
    x = {k: jax.device_put(v, src) for k, v in tree.items()}
    plan = jr.plan(x, {k: dst for k in tree}, topology=topo, bucket_bytes=4096)
    assert {p.stage for p in plan.assignment.pieces} == {0, 1}
    assert plan.stats.bytes_relayed_cross_domain > 0  # the replicas forward to each other
    assert plan.stats.bytes_sent == plan.stats.bytes_lower_bound
    _runs_bit_exact_under_the_guard(plan, x, tree)


def test_hierarchical_plan_with_several_leaves_and_a_cast(devices):
    topo = Topology.from_groups([devices[:4], devices[4:]])
    src_mesh = _mesh(devices, (0, 1, 2, 3), (2, 2), ("fsdp", "tp"))
    dst_mesh = _mesh(devices, (0, 4, 1, 5, 2, 6, 3, 7), (2, 4), ("dp", "tp"))
    rng = np.random.default_rng(0)
    tree = {
        "a": rng.standard_normal((32, 16)).astype(np.float32),
        "b": rng.integers(-100, 100, (8, 24)).astype(np.int32),
        "c": rng.standard_normal((16,)).astype(np.float32),
    }
    src = {
        "a": NamedSharding(src_mesh, P("fsdp", "tp")),
        "b": NamedSharding(src_mesh, P(None, "tp")),
        "c": NamedSharding(src_mesh, P("fsdp")),
    }
    dst = {
        "a": NamedSharding(dst_mesh, P(None, "tp")),
        "b": NamedSharding(dst_mesh, P("tp")),
        "c": NamedSharding(dst_mesh, P()),
    }
    x = {k: jax.device_put(v, src[k]) for k, v in tree.items()}
    plan = jr.plan(x, dst, topology=topo, dtype={"a": jnp.bfloat16, "b": None, "c": None},
                   bucket_bytes=512)  # fmt: skip
    assert plan.stats.bytes_sent == plan.stats.bytes_lower_bound
    assert plan.stats.bytes_relayed > 0 and plan.stats.bytes_cross_domain > 0
    out = plan(x)
    _check_real(out["a"], tree["a"].astype(jnp.bfloat16))
    _check_real(out["b"], tree["b"])
    _check_real(out["c"], tree["c"])


def test_reshard_caches_plans_per_topology(devices):
    jr.clear_cache()
    two = Topology.from_groups([devices[:4], devices[4:]])
    one = Topology.from_groups([devices])
    src = NamedSharding(_mesh(devices, (0, 1), (2,), ("x",)), P("x"))
    dst = NamedSharding(_mesh(devices, (2, 3, 4, 5, 6, 7), (3, 2), ("dp", "tp")), P(None, "tp"))
    value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    x = jax.device_put(value, src)
    for topo in (two, one, two):
        _check_real(jr.reshard(x, dst, topology=topo), value)
    from jaxreshard import api

    assert len(api._CACHE) == 2
    jr.clear_cache()


@st.composite
def mesh_layouts(draw, prefix):
    devices = draw(st.permutations(range(12)))
    sizes = draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3))
    while math.prod(sizes) > 12:
        sizes = sizes[:-1] or [1]
    names = tuple(f"{prefix}{i}" for i in range(len(sizes)))
    free, spec = list(names), []
    for _ in range(2):
        k = draw(st.integers(0, min(2, len(free))))
        spec.append(tuple(free[:k]))
        free = free[k:]
    return tuple(sizes), names, tuple(devices[: math.prod(sizes)]), tuple(spec)


@settings(max_examples=120, deadline=None)
@given(
    src=mesh_layouts("s"),
    dst=mesh_layouts("d"),
    groups=st.sampled_from([[range(12)], [range(6), range(6, 12)], [range(3), range(3, 12)],
                            [range(0, 12, 2), range(1, 12, 2)], [[i] for i in range(12)],
                            [range(i, i + 3) for i in range(0, 12, 3)]]),
    bucket=st.sampled_from([16, 100, 1 << 20]),
    dtype=st.sampled_from(["uint8", "float16", "float64"]),
    min_share=st.sampled_from([0, 16, 1 << 20]),
    pool=st.sampled_from([0, 1 << 20]),
    chain=st.booleans(),
)  # fmt: skip
def test_random_layouts_and_domains_on_virtual_devices(
    src, dst, groups, bucket, dtype, min_share, pool, chain
):
    size = dict(zip(src[1], src[0], strict=True)) | dict(zip(dst[1], dst[0], strict=True))
    shape = tuple(
        2 * math.lcm(*(math.prod(size[a] for a in s[3][d]) for s in (src, dst))) for d in range(2)
    )
    topology = Topology.from_groups(groups)
    leaves = [leaf_spec(shape, src, dst, dtype=dtype, path=p) for p in ("x", "y")]
    stats, assignment, schedule = check_virtual(
        leaves, topology, bucket, min_share_bytes=min_share, pool_bytes=pool, chain=chain
    )
    # Each domain takes in each byte it lacks exactly once, however shares are cut.
    assert stats.bytes_cross_domain == physical_bound(leaves, topology).bytes_cross_needed
    # No plan priced as the executor runs it beats the executor's floor, on GPUs or on CPU,
    # even with no latency, launch or host cost (the floor counts bandwidth alone).
    fixed = ("round_latency", "copy_overhead", "run_overhead", "launch_overhead",
             "bucket_overhead", "argument_overhead")  # fmt: skip
    for p in (PROFILES["h100"], PROFILES["cpu"]):
        profile = dataclasses.replace(p, **dict.fromkeys(fixed, 0.0))
        modeled = modeled_time(schedule, topology, profile, leaves=leaves, local=assignment.local)
        assert modeled.seconds >= executor_floor(leaves, topology, profile).seconds * (1 - 1e-12)


def test_leaves_are_pooled_only_up_to_the_pool_bytes():
    """With ``pool_bytes`` of two leaves, the first two of three consecutive leaves are
    shared out as one (two importers each, a quarter of the pair per device); the third,
    which would take the pool past its bytes, is shared out on its own (four importers)."""
    leaves = [leaf_spec((64, 32), SRC, ON_B, path=f"norm{i}") for i in range(3)]
    _, assignment, _ = check_virtual(leaves, TWO_BY_FOUR, pool_bytes=2 * ARRAY_BYTES)
    assert len(_imports(assignment, 0)) == len(_imports(assignment, 1)) == 2
    assert _imports(assignment, 2) == {d: ARRAY_BYTES // 4 for d in (4, 5, 6, 7)}
