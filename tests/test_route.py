"""Routing (`jaxreshard.planning.route.route`) against independent oracles.

The specification of a routing, checked with tests/oracles.py and never with planner code:

- every destination byte is delivered exactly once: by a local copy of bytes the device holds
  in the source layout, or by one piece (stage 0 from a source shard, stage 1 relayed inside
  a domain from bytes received in stage 0);
- nothing is sent that need not be: no piece has ``src == dst``, no piece carries bytes its
  receiver already holds, and the bytes sent equal the lower bound computed from the layouts;
- senders hold what they send; a part with a replica in the receiver's domain is sent from
  inside the domain; with fan-out, each domain imports each byte it lacks once;
- the busiest sender is within one row (of the plan's largest piece) of the fractional
  min-max optimum (Hall's bound, brute force): the planner balances exactly, then cuts whole
  rows. Symmetric and hand-made cases must hit the row-granular optimum exactly;
- routing is deterministic.

Random cases come from hypothesis on virtual devices (pure Python, no JAX execution), built to
be non-trivial: non-zero sizes, several senders and receivers, replicated sources. Degenerate
cases (zero-size, scalar, nothing to send) are named table cases.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import subprocess
import sys
import weakref
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from oracles import (
    Box,
    Boxes,
    candidate_demands,
    hall_optimum,
    jax_boxes,
    lower_bound_bytes,
    mask,
    mesh_boxes,
    min_pairs,
    regions,
    row_bytes,
    size,
)

from jaxreshard.planning import route as route_module
from jaxreshard.planning.layout import Layout
from jaxreshard.planning.route import Assignment, LeafSpec, Piece, gc_paused, route
from jaxreshard.planning.topology import Topology

ROOT = Path(__file__).resolve().parents[1]

Mesh_ = tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]
"""A virtual mesh: (mesh shape, axis names, device ids in row-major mesh order)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One leaf, described once: the planner gets `Layout.from_mesh`, the oracle its own boxes."""

    shape: tuple[int, ...]
    src: Mesh_
    src_spec: tuple[Any, ...]
    dst: Mesh_
    dst_spec: tuple[Any, ...]
    itemsize: int = 4

    def leaf(self, path: str) -> LeafSpec:
        src = Layout.from_mesh(self.shape, *self.src, self.src_spec)
        dst = Layout.from_mesh(self.shape, *self.dst, self.dst_spec)
        return LeafSpec(path, src, dst, "x", "x", self.itemsize)

    @property
    def src_boxes(self) -> Boxes:
        return mesh_boxes(self.shape, *self.src, self.src_spec)

    @property
    def dst_boxes(self) -> Boxes:
        return mesh_boxes(self.shape, *self.dst, self.dst_spec)


def route_cases(
    cases: Sequence[Case], groups: Sequence[Sequence[int]] | None = None, fan_out=False
):
    """Route the cases; one fast domain over every device unless ``groups`` are given."""
    leaves = [c.leaf(f"leaf{i}") for i, c in enumerate(cases)]
    if groups is None:
        groups = [sorted({d for c in cases for d in (*c.src[2], *c.dst[2])})]
    return route(leaves, Topology.from_groups(groups), fan_out=fan_out)


def inside(part: Box, box: Box) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(box, part, strict=True))


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


@dataclasses.dataclass
class Checked:
    """What `check_routing` measured, for the balance checks and the distribution."""

    bytes_sent: int
    lower_bound: int
    relays: int


def check_routing(
    cases: Sequence[Case], a: Assignment, groups: Sequence[Sequence[int]] | None = None
) -> Checked:
    """Assert the routing specification of the module docstring (all but balance)."""
    domain = {d: g for g, group in enumerate(groups or []) for d in group}
    sent = lower = 0
    for i, c in enumerate(cases):
        src, dst = c.src_boxes, c.dst_boxes
        lower += lower_bound_bytes(src, dst, c.itemsize)
        # got[device]: how often each element has reached the device's destination shard so
        # far (local copies first, then pieces stage by stage); by_stage[stage][device]: the
        # part of that from pieces of one stage (a relay may forward only earlier stages').
        got = {d: np.zeros(c.shape, np.int64) for d in dst}
        by_stage: dict[int, dict[int, np.ndarray]] = defaultdict(dict)
        for copy in (x for x in a.local if x.leaf == i):
            assert copy.device in src and inside(copy.box, src[copy.device]), copy
            assert inside(copy.box, dst[copy.device]), copy
            got[copy.device][slices(copy.box)] += 1
        pieces = sorted((p for p in a.pieces if p.leaf == i), key=lambda p: p.stage)
        for p in pieces:
            assert p.src != p.dst, f"a piece sent to its own sender: {p}"
            assert size(p.box) > 0 and inside(p.box, dst[p.dst]), p
            held = src.get(p.dst)
            overlap = held is not None and mask(c.shape, held)[slices(p.box)].any()
            assert not overlap, f"a piece carries bytes its receiver holds: {p}"
            if p.from_dst:  # a relay: the sender forwards bytes it got in an earlier stage
                assert p.stage > 0 and p.src in dst and inside(p.box, dst[p.src]), p
                earlier = got[p.src] - by_stage[p.stage].get(p.src, 0)
                assert (earlier[slices(p.box)] >= 1).all(), f"relays bytes not yet there: {p}"
                if groups:
                    assert domain[p.src] == domain[p.dst], f"a relay leaves its domain: {p}"
            else:
                assert p.src in src and inside(p.box, src[p.src]), f"sender lacks bytes: {p}"
                holders = {s for s, box in src.items() if inside(p.box, box)}
                if groups and any(domain[s] == domain[p.dst] for s in holders):
                    assert domain[p.src] == domain[p.dst], f"not the closest source: {p}"
            sent += size(p.box) * c.itemsize
            got[p.dst][slices(p.box)] += 1
            stage_counts = by_stage[p.stage].setdefault(p.dst, np.zeros(c.shape, np.int64))
            stage_counts[slices(p.box)] += 1
        for d, box in dst.items():
            want = mask(c.shape, box).astype(np.int64)
            assert (got[d] == want).all(), f"leaf {i} device {d}: not every byte exactly once"
    assert sent == lower, (sent, lower)
    relays = sum(p.from_dst for p in a.pieces)
    return Checked(sent, lower, relays)


def largest_row(cases: Sequence[Case]) -> int:
    """The bytes of the widest row of any part a receiver lacks: the rounding unit."""
    rows = [
        row_bytes(box, c.itemsize)
        for c in cases
        for _, _, _, box in regions(c.src_boxes, c.dst_boxes, c.itemsize)
    ]
    return max(rows, default=0)


def demand_groups(
    cases: Sequence[Case], groups: Sequence[Sequence[int]] | None = None
) -> dict[str, dict[frozenset[int], int]]:
    """Bytes per candidate-sender set, split into the classes the planner balances apart:
    "near" (served inside the receiver's domain) and "far" (crossing domains)."""
    domain = {d: g for g, group in enumerate(groups or []) for d in group}
    out: dict[str, dict[frozenset[int], int]] = {"near": defaultdict(int), "far": defaultdict(int)}
    for c in cases:
        demands = candidate_demands(c.shape, c.src_boxes, c.dst_boxes, c.itemsize, groups)
        for (receiver, candidates), nbytes in demands.items():
            near = not groups or all(domain[s] == domain[receiver] for s in candidates)
            out["near" if near else "far"][candidates] += nbytes
    return out


def busiest(a: Assignment, cases: Sequence[Case], pairs: set[tuple[int, int]] | None = None) -> int:
    """The most bytes any device sends (only over ``pairs``, if given)."""
    load: dict[int, int] = defaultdict(int)
    for p in a.pieces:
        if pairs is None or (p.src, p.dst) in pairs:
            load[p.src] += size(p.box) * cases[p.leaf].itemsize
    return max(load.values(), default=0)


# ------------------------------------------------------------------- the oracles themselves


@pytest.mark.parametrize(
    ("mesh_shape", "names", "spec"),
    [
        ((8,), ("x",), ("x", None)),
        ((2, 4), ("a", "b"), ("b", "a")),
        ((2, 4), ("a", "b"), (("b", "a"), None)),
        ((2, 2, 2), ("p", "q", "r"), (("r", "p"),)),
        ((4, 2), ("f", "t"), (None, "t")),
        ((2, 1, 4), ("a", "b", "c"), ("b", ("c", "a"))),
    ],
)
def test_oracle_boxes_and_from_mesh_agree_with_jax(devices, mesh_shape, names, spec):
    """The oracle's mesh arithmetic and `Layout.from_mesh` both give JAX's own boxes
    (``devices_indices_map``) on meshes over shuffled devices: the oracle is trustworthy and
    the layouts the planner starts from are right."""
    order = [int(i) for i in np.random.default_rng(len(names)).permutation(8)]
    mesh = Mesh(np.array([devices[i] for i in order]).reshape(mesh_shape), names)
    shape = (16, 24)
    expected = jax_boxes(NamedSharding(mesh, P(*spec)), shape)
    assert mesh_boxes(shape, mesh_shape, names, order, spec) == expected
    layout = Layout.from_mesh(shape, mesh_shape, names, order, spec)
    assert dict(zip(layout.devices, layout.boxes, strict=True)) == expected


def test_hall_optimum_on_known_instances():
    """The brute-force optimum on instances solved by hand."""
    a, b, ab = frozenset({0}), frozenset({1}), frozenset({0, 1})
    assert hall_optimum({ab: 10}) == 5  # two replicas share evenly
    assert hall_optimum({a: 8, ab: 2}) == 8  # the sole holder is the bottleneck
    assert hall_optimum({a: 4, ab: 8}) == 6  # the shared bytes even the load out
    assert hall_optimum({a: 3, b: 1, frozenset({2}): 7}) == 7
    assert hall_optimum({}) == 0


def test_min_pairs_on_a_known_instance():
    """Two receivers, two replicas: one sender each is the fewest pairs; a tight cap forces
    every receiver to use both senders."""
    both = frozenset({0, 1})
    rs = [(5, both, 4), (5, both, 4), (6, both, 4), (6, both, 4)]
    assert min_pairs(rs, cap=8) == 2
    assert min_pairs(rs, cap=7) is None
    assert min_pairs([(5, both, 4), (5, both, 4), (5, both, 4), (6, both, 4)], cap=8) == 3


# --------------------------------------------------------------------------- table cases

DP2 = ((2,), ("dp",), (0, 1))
TP4 = ((4,), ("tp",), (4, 5, 6, 7))
FSDP_TP = ((2, 2), ("fsdp", "tp"), (0, 1, 2, 3))

DEGENERATE = {  # name -> (leaves, bytes that must be sent, counted by hand)
    "zero-size": ([Case((0, 8), FSDP_TP, ("fsdp", "tp"), TP4, (None, "tp"))], 0),
    "zero-size-among-others": (
        [
            Case((0, 8), FSDP_TP, ("fsdp",), TP4, ("tp",)),
            Case((8, 8), FSDP_TP, ("fsdp", "tp"), TP4, ("tp",)),
        ],
        8 * 8 * 4,
    ),
    # A scalar is one element: each of the four receivers gets it once.
    "scalar": ([Case((), DP2, (), TP4, ())], 4 * 4),
    "scalar-partly-held": (
        [Case((), ((4,), ("x",), (0, 1, 2, 3)), (), ((4,), ("y",), (2, 3, 4, 5)), ())],
        2 * 4,
    ),
    "identical-layouts": (
        [Case((8, 8), FSDP_TP, ("fsdp", "tp"), FSDP_TP, ("fsdp", "tp"))],
        0,
    ),
    # Every destination device holds a replica of all of it: a refit that needs 0 bytes.
    "replicated-colocated": (
        [Case((16, 4), ((4,), ("dp",), (0, 1, 2, 3)), (), ((4,), ("tp",), (0, 1, 2, 3)), ("tp",))],
        0,
    ),
    "replicated-on-some-replicas": (
        [Case((16, 4), ((4,), ("dp",), (0, 1, 2, 3)), (), ((2,), ("tp",), (3, 1)), ("tp",))],
        0,
    ),
}


@pytest.mark.parametrize("name", list(DEGENERATE))
def test_degenerate_cases(name):
    """Zero-size leaves send nothing; a scalar is one element; a device that holds what it
    needs (also when other replicas hold it too) copies it and receives nothing."""
    cases, expected = DEGENERATE[name]
    a = route_cases(cases)
    checked = check_routing(cases, a)
    assert checked.bytes_sent == checked.lower_bound == expected
    if expected == 0:
        assert a.pieces == ()


# Balancing cases where the row-granular optimum is known: rows are one unit each, so the
# least busiest load is ``row * max over sender sets S of ceil(rows only S holds / |S|)``.
EXACT = {
    # Each of two replicas sends half of the whole array to the one receiver.
    "two-replicas-one-receiver": ([Case((64, 16), DP2, (), ((1,), ("x",), (2,)), ())], 64 * 32),
    # Two replicas serve four quarter shards: two whole shards each.
    "two-replicas-four-receivers": ([Case((64, 16), DP2, (), TP4, ("tp",))], 64 * 32),
    # Four replicas, four receivers of a quarter each: one whole shard each.
    "four-replicas-four-receivers": (
        [Case((32, 8), ((4,), ("dp",), (0, 1, 2, 3)), (), TP4, ("tp",))],
        8 * 8 * 4,
    ),
    # A leaf only device 0 holds loads it; the replicated leaf then goes mostly to device 1:
    # the split of the replicated rows is uneven (16 : 48), and must go the right way round.
    "uneven-split": (
        [
            Case((32, 4), ((1,), ("one",), (0,)), (), ((1,), ("x",), (2,)), ()),
            Case((64, 4), DP2, (), ((1,), ("x",), (2,)), ()),
        ],
        48 * 16,
    ),
    # Ten rows over four replicas to five receivers of two rows: some sender must carry
    # three rows, none more. The rows left after each sender's rounded share are handed out
    # one at a time (all to one sender would make it four).
    "rounding-remainder": (
        [Case((10,), ((4,), ("dp",), (0, 1, 2, 3)), (), ((5,), ("x",), (4, 5, 6, 7, 8)), ("x",))],
        3 * 4,
    ),
    # The same with rows of 8 bytes and receivers that hold part of what they need.
    "rounding-remainder-colocated": (
        [Case((12, 2), ((3,), ("dp",), (0, 1, 2)), (), ((6,), ("x",), (2, 3, 4, 5, 6, 7)), ("x",))],
        4 * 8,
    ),
}


@pytest.mark.parametrize("name", list(EXACT))
def test_balance_hits_the_row_optimum(name):
    """In these cases the busiest sender carries exactly the row-granular optimum (known by
    hand, and at least the brute-force fractional optimum)."""
    cases, optimum = EXACT[name]
    a = route_cases(cases)
    check_routing(cases, a)
    fractional = hall_optimum(demand_groups(cases)["near"])
    assert fractional <= optimum < fractional + largest_row(cases)
    assert busiest(a, cases) == optimum


def test_small_replicated_leaves_ride_on_pairs_already_in_use():
    """A norm scale split over fsdp, replicated over tp, goes to receivers that each already
    get kernel pieces from one holder of each half: sending it from those holders needs no
    new (sender, receiver) pair and keeps the load optimal. The routing uses the fewest pairs
    any min-max-optimal whole-region assignment can (brute force), each pair being a message
    and possibly a round."""
    trainer = ((2, 2), ("fsdp", "tp"), (0, 1, 2, 3))
    sampler = ((2, 2), ("dp", "tp"), (4, 5, 6, 7))
    cases = [
        Case((64, 64), trainer, ("fsdp", "tp"), sampler, (None, "tp")),
        Case((64,), trainer, ("fsdp",), sampler, ()),
    ]
    a = route_cases(cases)
    check_routing(cases, a)
    optimum = hall_optimum(demand_groups(cases)["near"])
    assert busiest(a, cases) == optimum
    units = [(d, c, n) for case in cases for d, c, n, _ in regions(*boxes(case), case.itemsize)]
    fewest = min_pairs(units, cap=int(optimum))
    assert fewest == 8  # the kernel alone forces 8 pairs; the scale fits on them
    assert len({(p.src, p.dst) for p in a.pieces}) == fewest


WITHOUT_COVER = pytest.mark.parametrize("cover", [True, False], ids=["cover", "without-cover"])
"""Runs a test with the cover choice (`route._cover`) and without it, as where it does not run
(receivers with more than `route.COVER_SENDERS` candidate senders: clusters): the other
choices must reach the same on their own."""


def cover_or_not(cover: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not cover:
        monkeypatch.setattr(route_module, "COVER_SENDERS", 0)


@WITHOUT_COVER
def test_a_replicated_leaf_rides_on_the_pairs_of_a_split_leaf(cover, monkeypatch):
    """Leaf ``b`` is split over devices 0 and 1 and its halves go crosswise (0 -> 3, 1 -> 2);
    leaf ``a`` is replicated on both and wanted whole by 2 and 3. Sending ``a`` along the same
    pairs (0 -> 3, 1 -> 2) balances the load exactly and needs 2 pairs; a sender choice that
    ignores existing pairs (the lowest id first) sends 0 -> 2 and 1 -> 3: 4 pairs."""
    cover_or_not(cover, monkeypatch)
    cases = [
        Case((64, 8), DP2, (), ((2,), ("r",), (2, 3)), ()),
        Case((64, 8), DP2, ("dp",), ((2,), ("r",), (3, 2)), ("r",)),
    ]
    a = route_cases(cases)
    check_routing(cases, a)
    optimum = hall_optimum(demand_groups(cases)["near"])
    assert busiest(a, cases) == optimum == 64 * 8 * 4 * 3 // 2
    units = [(d, c, n) for case in cases for d, c, n, _ in regions(*boxes(case), case.itemsize)]
    assert min_pairs(units, cap=int(optimum)) == 2
    assert {(p.src, p.dst) for p in a.pieces} == {(0, 3), (1, 2)}


def test_replicas_of_a_destination_shard_get_their_bytes_from_one_sender():
    """fsdp2 x tp2 -> dp2 x tp2: each kernel quarter has one holder, which sends it to both
    replicas of its destination shard; the biases, replicated over fsdp, ride on those pairs.
    Both replicas take each bias from the same holder, so every sender sends the two
    replicas the same bytes (packed once, `lower.Step.shared`), and the load stays optimal.
    Taking the holders in turn per receiver gave the replicas different senders for the
    biases, and every sender different bytes for each replica."""
    trainer = ((2, 2), ("fsdp", "tp"), (0, 1, 2, 3))
    sampler = ((2, 2), ("dp", "tp"), (4, 5, 6, 7))
    cases = [Case((64, 64), trainer, ("fsdp", "tp"), sampler, (None, "tp"))]
    cases += [Case((64,), trainer, ("tp",), sampler, ("tp",)) for _ in range(4)]
    a = route_cases(cases)
    check_routing(cases, a)
    assert busiest(a, cases) == hall_optimum(demand_groups(cases)["near"])
    senders: dict[tuple[int, Box], set[int]] = defaultdict(set)
    streams: dict[tuple[int, int], set[tuple[int, Box]]] = defaultdict(set)
    for p in a.pieces:
        senders[p.leaf, p.box].add(p.src)
        streams[p.src, p.dst].add((p.leaf, p.box))
    assert all(len(s) == 1 for s in senders.values())
    replica = {4: 6, 5: 7}  # (dp0, tp) -> (dp1, tp)
    assert all(streams[s, d] == streams[s, replica[d]] for s, d in streams if d in replica)


@WITHOUT_COVER
def test_replicas_taking_one_holder_never_cost_the_balance_the_plain_rotation_reaches(
    cover, monkeypatch
):
    """(A fuzz.) Every device of a fully replicated destination wants a matrix split over one
    source axis and a bias split over another: the replicas all taking one holder is far
    from balanced, and it replaced the plain rotation among the choices, which alone was
    optimal: the busiest sender was 17.6% above the optimum (and a round more). Both
    rotations are choices now; the balance is the optimum again."""
    cover_or_not(cover, monkeypatch)
    src = ((2, 2, 2), ("a", "b", "c"), (5, 4, 1, 0, 7, 3, 2, 6))
    dst = ((8,), ("x",), (6, 5, 3, 1, 7, 4, 2, 0))
    cases = [Case((4, 8, 8), src, (None, None, "a"), dst, ()), Case((16,), src, ("c",), dst, ())]
    a = route_cases(cases)
    check_routing(cases, a)
    assert busiest(a, cases) == hall_optimum(demand_groups(cases)["near"])


def test_a_receiver_is_served_by_as_few_senders_as_the_balance_allows():
    """Four receivers each need a quarter of two leaves that both replicas hold: each replica
    serving two receivers whole is optimal in load and in pairs (four); a receiver served by
    both replicas costs an extra message."""
    dst = ((4,), ("x",), (4, 5, 6, 7))
    cases = [Case((16, 8), DP2, (), dst, ("x",)), Case((8, 16), DP2, (), dst, (None, "x"))]
    a = route_cases(cases)
    check_routing(cases, a)
    optimum = hall_optimum(demand_groups(cases)["near"])
    assert busiest(a, cases) == optimum
    units = [(d, c, n) for case in cases for d, c, n, _ in regions(*boxes(case), case.itemsize)]
    assert min_pairs(units, cap=int(optimum)) == 4
    assert len({(p.src, p.dst) for p in a.pieces}) == 4


def test_per_leaf_balance_splits_every_leaf_over_its_replicas():
    """Two leaves on both replicas, both wanted whole by one receiver. Balanced over the plan,
    each leaf may come from one replica (the load is even in total); a plan runs unit after
    unit, so on clusters (``per_leaf``, the default with fan-out) each leaf is balanced on its
    own: half of each from each replica, to one row."""
    cases = [Case((64, 8), DP2, (), ((1,), ("r",), (4,)), ())] * 2
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    leaves = [c.leaf(f"leaf{i}") for i, c in enumerate(cases)]
    for per_leaf, most in ((True, 32 * 8 * 4), (False, 64 * 8 * 4)):
        a = route(leaves, Topology.from_groups(groups), fan_out=True, per_leaf=per_leaf)
        check_routing(cases, a, groups)
        for leaf in (0, 1):
            sent = Counter()
            for p in a.pieces:
                if p.leaf == leaf:
                    sent[p.src] += size(p.box) * 4
            assert max(sent.values()) == most, (per_leaf, sent)


def boxes(case: Case) -> tuple[Boxes, Boxes]:
    return case.src_boxes, case.dst_boxes


def test_replicas_in_the_receivers_domain_are_preferred():
    """Two replicas, one per domain: receivers in the second domain read from its replica
    only, and the check of closest sources holds for every piece."""
    cases = [Case((16, 16), ((2,), ("dp",), (0, 4)), (), ((2,), ("tp",), (5, 6)), (None, "tp"))]
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    a = route_cases(cases, groups)
    check_routing(cases, a, groups)
    assert {p.src for p in a.pieces} == {4}


def test_fan_out_imports_each_byte_once_per_domain():
    """A trainer domain sends to two sampler domains of four replicas each: with fan-out each
    domain imports the array once (split over its devices) and relays inside."""
    groups = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    dst = ((2, 4), ("dp", "tp"), (4, 8, 5, 9, 6, 10, 7, 11))
    cases = [Case((32, 16), FSDP_TP, ("fsdp", "tp"), dst, (None, "tp"))]
    a = route_cases(cases, groups, fan_out=True)
    checked = check_routing(cases, a, groups)
    assert checked.relays > 0
    assert crossing_bytes(a, cases, groups) == distinct_imports(cases, groups)


def crossing_bytes(a: Assignment, cases: Sequence[Case], groups) -> dict[int, int]:
    """Bytes each domain receives from other domains."""
    domain = {d: g for g, group in enumerate(groups) for d in group}
    out: dict[int, int] = defaultdict(int)
    for p in a.pieces:
        if domain[p.src] != domain[p.dst]:
            out[domain[p.dst]] += size(p.box) * cases[p.leaf].itemsize
    return dict(out)


def distinct_imports(cases: Sequence[Case], groups) -> dict[int, int]:
    """Per domain, the bytes some device of it needs and no device of it holds: what must
    cross into the domain, counted once (the oracle of hierarchical fan-out)."""
    out: dict[int, int] = {}
    for g, group in enumerate(groups):
        total = 0
        for c in cases:
            src, dst = c.src_boxes, c.dst_boxes
            needed = np.zeros(c.shape, bool)
            held = np.zeros(c.shape, bool)
            for d in group:
                if d in dst:
                    needed |= mask(c.shape, dst[d])
                if d in src:
                    held |= mask(c.shape, src[d])
            total += int((needed & ~held).sum()) * c.itemsize
        if total:
            out[g] = total
    return out


# ------------------------------------------------------------------------- random cases


DEVICES = 16
"""Virtual device ids 0..15: room for two meshes of 8 that overlap anywhere from fully to not."""


@st.composite
def mesh_shape(draw) -> tuple[int, ...]:
    """1-3 axes of size 2-4 (a size-1 axis now and then), at most 8 devices."""
    sizes: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        size_ = draw(st.sampled_from([2, 2, 3, 4, 1]))
        if math.prod(sizes) * size_ <= 8:
            sizes.append(size_)
    return tuple(sizes) if math.prod(sizes) > 1 else (2,)


@st.composite
def spec_for(draw, mesh: Mesh_, rank: int, replicate: bool = False) -> tuple[Any, ...]:
    """Up to two mesh axes per dimension; unused axes replicate. ``replicate`` leaves
    dimensions unsplit more often, so that sources have replicas and balancing matters."""
    free = list(draw(st.permutations(mesh[1])))
    spec: list[Any] = []
    for _ in range(rank):
        k = draw(st.sampled_from([0, 0, 1, 2] if replicate else [0, 1, 2]))
        k = min(k, len(free))
        spec.append(None if k == 0 else free[0] if k == 1 else tuple(free[:k]))
        free = free[k:]
    return tuple(spec)


@st.composite
def random_cases(draw) -> list[Case]:
    """1-3 leaves on one source and one destination mesh, each leaf with its own rank (1-3),
    specs, non-zero shape and itemsize. The meshes share ``overlap`` devices, from none (the
    simplest case hypothesis shrinks to: everything is sent) to all (colocated)."""
    src_shape, dst_shape = draw(mesh_shape()), draw(mesh_shape())
    n_src, n_dst = math.prod(src_shape), math.prod(dst_shape)
    overlap = draw(st.integers(0, min(n_src, n_dst)))
    ids = draw(st.permutations(range(DEVICES)))
    src_ids, dst_ids = ids[:n_src], ids[n_src - overlap : n_src - overlap + n_dst]
    dst_ids = draw(st.permutations(dst_ids))  # shared devices anywhere in the destination mesh
    src = (src_shape, tuple(f"s{i}" for i in range(len(src_shape))), tuple(src_ids))
    dst = (dst_shape, tuple(f"d{i}" for i in range(len(dst_shape))), tuple(dst_ids))
    sizes = dict(zip(src[1], src[0], strict=True)) | dict(zip(dst[1], dst[0], strict=True))
    out = []
    for _ in range(draw(st.integers(1, 3))):
        rank = draw(st.integers(1, 3))
        src_spec, dst_spec = draw(spec_for(src, rank, replicate=True)), draw(spec_for(dst, rank))
        shape = []
        for d in range(rank):
            ways = [
                math.prod(sizes[a] for a in ((e,) if isinstance(e, str) else e or ()))
                for e in (src_spec[d], dst_spec[d])
            ]
            shape.append(draw(st.integers(1, 3 if rank < 3 else 2)) * math.lcm(*ways))
        itemsize = draw(st.sampled_from([1, 2, 4]))
        out.append(Case(tuple(shape), src, src_spec, dst, dst_spec, itemsize))
    return out


def describe(cases: Sequence[Case], checked: Checked) -> dict[str, bool]:
    """What makes an example worth having (from the oracle, not from the plan)."""
    receivers: set[int] = set()
    senders: set[int] = set()
    replicated = False
    for c in cases:
        for (d, cands), nbytes in candidate_demands(
            c.shape, c.src_boxes, c.dst_boxes, c.itemsize
        ).items():
            if nbytes:
                receivers.add(d)
                senders |= cands
                replicated |= len(cands) > 1
    return {
        "sends": checked.bytes_sent > 0,
        "several receivers": len(receivers) > 1,
        "several senders": len(senders) > 1,
        "replicated source": replicated,
        "several leaves": len(cases) > 1,
    }


def record(seen: Counter, facts: dict[str, bool]) -> None:
    seen["examples"] += 1
    for name, value in facts.items():
        seen[name] += value
        event(f"{name}: {value}")
    if all(facts[k] for k in ("sends", "several receivers", "several senders")):
        seen["non-trivial"] += 1


def assert_mostly_non_trivial(seen: Counter) -> None:
    """The generators are built so that most examples exercise balancing; if they drift
    towards empty cases, this fails instead of the tests silently testing nothing."""
    n = seen["examples"]
    assert n >= 20, seen
    # Measured over 30 runs of each test (100-150 examples): 70-94% non-trivial, 44-77%
    # replicated, 35-67% several leaves; the bounds leave room for hypothesis's draws.
    assert seen["non-trivial"] >= 0.6 * n, seen
    assert seen["replicated source"] >= 0.3 * n, seen
    assert seen["several leaves"] >= 0.15 * n, seen


EXAMPLES = int(os.environ.get("JAXRESHARD_ROUTE_EXAMPLES", "1"))
"""A multiplier of the random tests' example counts, for a long local run (e.g. 20)."""

RANDOM = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,  # the examples are a fixed budget of fresh cases, not a replay of old ones
)


def test_random_plans_in_one_domain():
    """Random plans over one fast domain: the full routing specification, and the busiest
    sender within one row of the brute-force optimum."""
    seen: Counter = Counter()

    @settings(RANDOM, max_examples=150 * EXAMPLES)
    @given(cases=random_cases())
    def check(cases: list[Case]) -> None:
        a = route_cases(cases)
        checked = check_routing(cases, a)
        groups = demand_groups(cases)
        optimum = hall_optimum(groups["near"])
        most = busiest(a, cases)
        # The planner balances bytes exactly (max-flow over replica groups), then cuts split
        # demands at whole rows. The documented slack is one row of the widest piece: what
        # rounding one sender's share can add. (Held on 15,000 examples of this generator
        # and 2,000 seeded plans; before the fix of `_split`'s remainder, which gave every
        # leftover row to one sender, plans reached 2.6 rows above the optimum.)
        assert optimum <= most <= optimum + largest_row(cases), (most, optimum)
        event(f"busiest above optimum: {'no' if most <= math.ceil(optimum) else 'within a row'}")
        record(seen, describe(cases, checked))

    check()
    print(f"distribution: {dict(seen)}")  # shown with pytest -s or -rP
    assert_mostly_non_trivial(seen)


def test_random_plans_over_domains():
    """Random plans over 2-3 fast domains, with and without fan-out: the routing
    specification, closest sources, each domain importing a byte once with fan-out, and
    without fan-out the busiest sender of each class (inside domains, across domains) within
    one row of that class's optimum."""
    seen: Counter = Counter()

    @settings(RANDOM, max_examples=100 * EXAMPLES)
    @given(
        cases=random_cases(),
        n_domains=st.sampled_from([2, 3]),
        fan_out=st.booleans(),
    )
    def check(cases: list[Case], n_domains: int, fan_out: bool) -> None:
        width = -(-DEVICES // n_domains)
        groups = [list(range(g * width, min(DEVICES, (g + 1) * width))) for g in range(n_domains)]
        a = route_cases(cases, groups, fan_out=fan_out)
        checked = check_routing(cases, a, groups)
        demands = demand_groups(cases, groups)
        if fan_out:
            assert crossing_bytes(a, cases, groups) == distinct_imports(cases, groups)
            event(f"relays: {checked.relays > 0}")
        else:
            domain = {d: g for g, group in enumerate(groups) for d in group}
            row = largest_row(cases)
            for cls in ("near", "far"):
                pairs = {
                    (p.src, p.dst)
                    for p in a.pieces
                    if (domain[p.src] == domain[p.dst]) == (cls == "near")
                }
                optimum = hall_optimum(demands[cls])
                assert optimum <= busiest(a, cases, pairs) <= optimum + row, cls
        record(seen, describe(cases, checked))

    check()
    print(f"distribution: {dict(seen)}")  # shown with pytest -s or -rP
    assert_mostly_non_trivial(seen)


# -------------------------------------------------------------------------- determinism


DETERMINISM_CASES = [
    Case((48, 24), ((2, 3), ("a", "b"), (5, 0, 3, 1, 4, 2)), ("a", "b"), TP4, ("tp",)),
    Case((24, 12), ((3, 2), ("a", "b"), (5, 0, 3, 1, 4, 2)), (), TP4, (None, "tp"), 2),
]


def test_routing_is_deterministic():
    """The same leaves give the same assignment: planned twice from fresh layouts, and with
    the domains' devices listed in another order (routing depends on the domains only)."""
    groups = [[0, 1, 2, 3, 4, 5], [6, 7]]
    first = route_cases(DETERMINISM_CASES, groups)
    check_routing(DETERMINISM_CASES, first, groups)
    assert route_cases(DETERMINISM_CASES, groups) == first
    assert route_cases(DETERMINISM_CASES, [g[::-1] for g in groups[::-1]]) == first


def test_routing_does_not_depend_on_the_hash_seed():
    """Processes with different hash seeds (as on different hosts) route identically."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2]);"
        "from test_route import DETERMINISM_CASES, route_cases;"
        "print(repr(route_cases(DETERMINISM_CASES, [[0, 1, 2, 3, 4, 5], [6, 7]])))"
    )
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, JAX_PLATFORMS="cpu")
        argv = [sys.executable, "-c", script, str(ROOT), str(ROOT / "tests")]
        result = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
        outs.add(result.stdout)
    assert len(outs) == 1 and "Piece(" in next(iter(outs))


def test_gc_paused_leaves_the_collector_as_it_found_it():
    """`gc_paused` (around `route` and the schedule's planners) pauses the cyclic collector
    and restores it after, on errors and nested too, and leaves a paused one paused."""

    @gc_paused()
    def fails() -> None:
        assert not gc.isenabled()
        raise ValueError("inside")

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError, match="inside"):
        fails()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_gc_paused_ages_what_it_made_and_keeps_frozen_objects_frozen():
    """On the way out, the objects made inside join the oldest generation and the young
    generation's count restarts (no catch-up pass over them at the next allocation); a
    cycle made inside is still collected by a full collection; objects the process froze
    itself stay frozen (then nothing is moved: CPython 3.12 starts every process with a few
    hundred frozen objects, so there the young generation's count is left as it is)."""
    ages = not gc.get_freeze_count()

    class Node:
        pass

    starts: list[int] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            starts.append(info["generation"])

    gc.callbacks.append(record)
    try:
        with gc_paused():
            made = [[i] for i in range(5000)]  # past the young generation's threshold
            cycle = Node()
            cycle.self = cycle  # type: ignore[attr-defined]
            ref = weakref.ref(cycle)
            del cycle
        assert gc.isenabled()
        scratch = [[i] for i in range(100)]  # fewer than the threshold: no pass
        # Aged, the cycle is in the oldest generation; not aged (frozen objects), the first
        # allocation's young pass may already have collected it.
        assert (ref() is not None or not ages) and gc.is_tracked(made[0])
        assert starts == [] or not ages, starts
        del scratch
    finally:
        gc.callbacks.remove(record)
    gc.collect()
    assert ref() is None  # a full collection still finds the cycle
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            more = [[i] for i in range(1000)]
        assert gc.get_freeze_count() == frozen and gc.isenabled()
        del more
    finally:
        gc.unfreeze()


def test_piece_init_checks_and_freezes_as_a_dataclass_would():
    """`Piece` sets its fields itself (faster than a frozen dataclass's ``__init__``): the
    same fields, defaults, keywords, equality, hash, replace and refusals."""
    p = Piece(1, 2, 3, ((0, 4),), 1)
    assert p == Piece(leaf=1, src=2, dst=3, box=((0, 4),), stage=1, relay=None)
    assert hash(p) == hash(Piece(1, 2, 3, ((0, 4),), stage=1))
    assert (p.stage, p.relay, p.from_dst) == (1, None, True)
    assert Piece(1, 2, 3, ((0, 4),)).stage == 0
    assert dataclasses.replace(p, stage=2, relay=False) == Piece(1, 2, 3, ((0, 4),), 2, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.src = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match="stage > 0"):
        Piece(1, 2, 3, ((0, 4),), 0, True)
