"""Leaves that move as whole shards: no staging, no pack, no unpack.

Where every destination shard of a leaf is one whole source shard (the same spec on other
devices, the same devices in another order, replicas of the source's layout), the planner's
pieces of that leaf are whole shards, each sent by one device that holds it. Such a leaf needs
no staging: a collective-permute sends each source shard as it is and receives it straight
into the destination shard (donated), so every byte is copied once, by the collective, where
the staged path copies it three times (pack, permute, unpack).

This module picks those leaves (`whole_leaves`) and lowers them into transfer steps of their
own (`whole_steps`): steps with no packs and no unpacks, whose `TransferProgram` slots are
*typed* (`Slot.shard`: one whole shard of the leaf's dtype, where a staged slot is words).
A device that sends nothing in a round passes a spare buffer of the shard's shape, and one
that receives nothing passes a spare that comes back zeroed: those spares are the only staging
such a step holds, taken from the same pool, under the same cap, as the staged steps' buffers
(`lower.step_roles`, `lower.staging`). A leaf whose spares would not fit half a bucket stays
staged.

The bytes a whole-shard leaf sends are its assignment's pieces, unchanged: ``bytes_sent`` still
equals the lower bound, and the senders are those the router balanced.

Pure: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Collection, Sequence

from jaxreshard.planning.layout import box_shape
from jaxreshard.planning.lower import Slot, Step, TransferProgram, step_roles, step_rounds_of
from jaxreshard.planning.route import Assignment, LeafSpec
from jaxreshard.planning.topology import Profile

STAGED_DTYPES = frozenset(
    {"int2", "uint2", "int4", "uint4", "float4_e2m1fn", "complex64", "complex128"}
)
"""Dtypes never moved as whole shards. Sub-byte types: XLA packs them below a byte in some
layouts, which the staged path handles through their bits (`run.codec`). Complex types: the
transfer moves floating shards as their bits (`runtime._build_transfer`), and JAX bitcasts no
complex value."""

MOVE_WHOLE_SHARDS = True
"""Whether leaves move as whole shards where they can; off, every leaf is staged (for A/B runs
and the tests that specify the staged path)."""

LATENCY_MARGIN = 2.0
"""Round latencies the copies a whole-shard round saves must be worth (`_pays`). A leaf moved
whole takes rounds of its own, where a staged leaf shares its rounds with others: each round
costs a collective-permute's latency and saves the pack and the unpack of what it carries.
Measured on CPU (the bench's `same_layout`, 2026-12-06): with every leaf whole, 83 rounds took
the transfer from 39 to 94 ms and the call from 95 to 92 ms, where the eight 32 MiB leaves of
`scripts/probes/whole_shards.py` went from 79 to 43 ms. 0 takes every leaf that qualifies
(the tests that specify the path on small leaves)."""

MAX_ROUNDS_PER_STEP = 64
"""The most rounds (collective-permutes) one whole-shard step joins: a model's small leaves
(biases, norms) share one program run, while programs stay quick to compile."""


@dataclasses.dataclass(frozen=True)
class WholeLeaf:
    """How one leaf moves as whole shards.

    Attributes:
      leaf: the leaf's index.
      shard: the shape of its shards (the same on both sides).
      rounds: the ``(sender, receiver)`` device pairs of each round: every device sends at most
        one shard and receives at most one per round. A pair ``(d, d)`` is a local copy (the
        device holds the shard it needs), done by the same collective-permute.
    """

    leaf: int
    shard: tuple[int, ...]
    rounds: tuple[tuple[tuple[int, int], ...], ...]

    def devices(self) -> set[int]:
        return {d for pairs in self.rounds for pair in pairs for d in pair}


def typed_slot(leaf: LeafSpec, shard: Sequence[int]) -> Slot:
    """The slot of one whole shard of ``leaf`` (its dtype, its shard's shape)."""
    return Slot(math.prod(shard), leaf.dst_dtype, shard=tuple(shard), itemsize=leaf.itemsize)


def whole_leaves(
    leaves: Sequence[LeafSpec],
    assignment: Assignment,
    bucket_bytes: int,
    profile: Profile | None = None,
) -> dict[int, WholeLeaf]:
    """The leaves that move as whole shards, by index (none unless `MOVE_WHOLE_SHARDS`).

    A leaf does where (with a ``profile``: the backend's, `topology.PROFILES`) every round of
    it saves copies worth `LATENCY_MARGIN` round latencies (`_pays`), and:

    - it has elements and a rank, no cast, a dtype of a byte or wider (`STAGED_DTYPES`),
      and all of its shards, source and destination, have one shape;
    - every piece the router assigned it is a whole destination shard sent from a device
      whose source shard is that same box, read from the source (no relay); every local copy
      is a whole destination shard the device holds as its own source shard; and something
      is sent (a leaf every device copies from itself is a local copy of the staged path,
      with no collective at all);
    - the spares its rounds need (`_fits`) fit half a bucket on every device, as a joined
      staged step's slots do (`lower._joined`).
    """
    by_leaf: dict[int, list[tuple[int, int, object]]] = defaultdict(list)
    relayed = {f.leaf for f in assignment.fans}
    for p in assignment.sent:
        if p.stage or p.relay:
            relayed.add(p.leaf)
        by_leaf[p.leaf].append((p.src, p.dst, p.box))
    for c in assignment.local:
        by_leaf[c.leaf].append((c.device, c.device, c.box))
    out = {}
    for i, leaf in enumerate(leaves):
        if not MOVE_WHOLE_SHARDS or i in relayed or not _shaped_alike(leaf):
            continue
        pairs = _whole_pairs(leaf, by_leaf.get(i, []))
        if pairs is None or all(s == d for s, d in pairs):
            continue
        moved = WholeLeaf(i, box_shape(leaf.dst.boxes[0]), _rounds(pairs))
        if _fits([moved], leaves, bucket_bytes) and _pays(moved, leaf, profile):
            out[i] = moved
    return out


def _pays(moved: WholeLeaf, leaf: LeafSpec, profile: Profile | None) -> bool:
    """Whether each round of ``moved`` saves copies worth `LATENCY_MARGIN` round latencies
    under ``profile``: the pack and the unpack of what it carries between devices, at the
    host's copy bandwidth where a host's devices share its cores (CPU), else of one shard at a
    device's (each device copies its own at once)."""
    if profile is None or not LATENCY_MARGIN:
        return True
    shard = math.prod(moved.shard) * leaf.itemsize
    for pairs in moved.rounds:
        if profile.host_copy_bandwidth is not None:
            moved_bytes = shard * sum(1 for s, d in pairs if s != d)
            saved = 2 * moved_bytes / profile.host_copy_bandwidth
        else:
            saved = 2 * shard / profile.copy_bandwidth
        if saved < LATENCY_MARGIN * profile.round_latency:
            return False
    return True


def without_leaves(assignment: Assignment, leaves: Collection[int]) -> Assignment:
    """``assignment`` without the pieces and local copies of ``leaves`` (what the staged
    schedule moves when those go as whole shards)."""
    if not leaves:
        return assignment
    return Assignment(
        local=tuple(c for c in assignment.local if c.leaf not in leaves),
        sent=tuple(p for p in assignment.sent if p.leaf not in leaves),
        fans=assignment.fans,
    )


def _shaped_alike(leaf: LeafSpec) -> bool:
    """Elements, a rank, a byte or more each, and one shard shape on both sides."""
    if not leaf.shape or not math.prod(leaf.shape) or leaf.dst_dtype in STAGED_DTYPES:
        return False
    shapes = {box_shape(b) for b in (*leaf.src.boxes, *leaf.dst.boxes)}
    return len(shapes) == 1 and leaf.src_dtype == leaf.dst_dtype


def _whole_pairs(leaf: LeafSpec, moves: Sequence[tuple[int, int, object]]) -> list | None:
    """``(sender, receiver)`` of each destination shard, where each is one whole source
    shard sent (or copied) once; None otherwise."""
    src_box, dst_box = leaf.src.box_of, leaf.dst.box_of
    pairs, covered = [], set()
    for s, d, box in moves:
        if box != dst_box.get(d) or box != src_box.get(s) or d in covered:
            return None
        covered.add(d)
        pairs.append((s, d))
    return sorted(pairs) if covered == set(leaf.dst.devices) else None


def _rounds(pairs: Sequence[tuple[int, int]]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``pairs`` in rounds: each pair in the first round where its sender sends nothing yet
    (each receiver is in one pair). As many rounds as the busiest sender sends shards."""
    rounds: list[list[tuple[int, int]]] = []
    sent: dict[int, int] = defaultdict(int)
    for s, d in pairs:
        r = sent[s]
        sent[s] += 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append((s, d))
    return tuple(tuple(r) for r in rounds)


def whole_steps(
    leaves: Sequence[LeafSpec], moved: dict[int, WholeLeaf], bucket_bytes: int
) -> list[Step]:
    """The transfer steps of the whole-shard leaves, in tree order: consecutive leaves of the
    same source and destination devices join one step (one program run, one
    collective-permute a round; their fresh destinations made by one program) while its
    spares fit half a bucket on every device and it holds at most `MAX_ROUNDS_PER_STEP`
    rounds."""
    steps: list[Step] = []
    group: list[WholeLeaf] = []
    for i in sorted(moved):
        if group and (
            _sides(leaves[i]) != _sides(leaves[group[0].leaf])
            or not _fits([*group, moved[i]], leaves, bucket_bytes)
        ):
            steps.append(_step(group, leaves))
            group = []
        group.append(moved[i])
    if group:
        steps.append(_step(group, leaves))
    return steps


def _sides(leaf: LeafSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(sorted(leaf.src.devices)), tuple(sorted(leaf.dst.devices))


def _fits(group: Sequence[WholeLeaf], leaves: Sequence[LeafSpec], bucket_bytes: int) -> bool:
    """Whether one step of ``group`` holds at most `MAX_ROUNDS_PER_STEP` rounds and spares
    of at most half a bucket on each device: the buffers the staging pool hands its devices
    for it (`lower.step_roles`: a shard for every round a device receives nothing in, one of
    each slot it sends nothing in some round of)."""
    if sum(len(w.rounds) for w in group) > MAX_ROUNDS_PER_STEP:
        return False
    step = _step(group, leaves)
    assert step.transfer is not None
    roles = step_roles(step, step.transfer.devices)
    return all(
        sum(slot.nbytes * n for slot, n in r.need().items()) <= bucket_bytes // 2
        for r in roles.values()
    )


def _step(group: Sequence[WholeLeaf], leaves: Sequence[LeafSpec]) -> Step:
    """One step moving ``group``'s leaves: a round per leaf round, over the devices of all."""
    devices = tuple(sorted(set().union(*(w.devices() for w in group))))
    at = {d: k for k, d in enumerate(devices)}
    slots, perms, moves = [], [], []
    for w in group:
        slot = typed_slot(leaves[w.leaf], w.shard)
        for r in w.rounds:
            slots.append(slot)
            perms.append(tuple((at[s], at[d]) for s, d in r))
            moves.append(w.leaf)
    return Step(
        unit=-1,
        fresh=tuple(w.leaf for w in group),
        slots=tuple(slots),
        packs=(),
        transfer=TransferProgram(devices, tuple(slots), tuple(perms)),
        unpacks=(),
        whole=tuple(moves),
    )


def step_rounds(step: Step) -> list[tuple[int, list[tuple[int, int]]]]:
    """A whole-shard step's rounds as the cost model prices them: each its shard's bytes and
    its ``(sender, receiver)`` device pairs."""
    assert step.whole
    return [(slot.nbytes, list(pairs)) for slot, pairs in step_rounds_of(step)]
