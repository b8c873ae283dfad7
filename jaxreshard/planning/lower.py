"""From a schedule to the programs that run it: every step of a plan as pure data.

Lowering is the last pure stage. Each bucket of the schedule becomes a `Step` of three kinds of
program, each a frozen dataclass whose value *is* its structural identity, so that sharing a
compiled program is a lookup by value:

- `PackProgram`: runs SPMD over a mesh of senders. Each device copies boxes of its source
  shards (or, for relays, of its destination shards), cast to the destination dtype, into its
  staging slots (buffers of unsigned words, one per round it sends in; held as rows where
  every box is whole rows, `Slot.width`);
- `TransferProgram`: one collective-permute per round over the plan's *union* mesh (every
  device that sends or receives), nothing else;
- `UnpackProgram`: runs SPMD over a mesh of receivers. Each device copies words of its received
  slots into boxes of its destination shards, and copies the parts it already holds from its
  own source shards (local copies).

*Gathers.* Pieces of small leaves (`schedule.gathered`) are not copies of their own: a pack
program reads all of them with one gather over the words of their arrays laid end to end, into
the head of each slot (the lowering lays a message's gathered segments first), and an unpack
program rebuilds each small destination shard with one gather over the slots' heads, its local
sources and its own old words. The gathers' word indices go in the table, after the box starts.

Devices run one program together when they do the same copies up to where the boxes start
(every device of a regular ``NamedSharding`` usually does). Box starts are therefore not part
of a program: each call carries a table of them, one row per device, so the programs of a
model's repeated layers, and of the slabs of a large leaf, are the same values and compile
once. A program whose devices form a whole mesh of the plan's arrays takes those arrays as
they are; any other group of devices runs over a 1-D mesh of its own, onto which the arrays'
per-device buffers are re-wrapped without copying (``Operand.spec`` is then None).

`staging` simulates the staging-buffer pool the runtime keeps (the same policy, `plan_pool`),
so the plan reports exactly the staging memory a call holds.

Nothing here imports JAX. tests/reference.py runs a `Lowered` on virtual devices with NumPy.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from jaxreshard.planning.layout import AxisSpec, Box, Layout, MeshSpec, box_shape, box_size
from jaxreshard.planning.route import LeafSpec, LocalCopy
from jaxreshard.planning.schedule import (
    Bucket,
    PlanStats,
    Schedule,
    Segment,
    end_to_end,
    gathered,
    plan_pool,
)

GROUP_AXIS = "jaxreshard"
"""Axis name of the 1-D meshes of device groups (and of the union mesh of transfers)."""

Starts = tuple[int, ...]


MAX_SLOT_WIDTH = 256
"""The widest row of a staging slot held as rows (`Slot.width`), in words."""

MIN_SLOT_WIDTH = 128
"""A slot whose boxes allow no rows this wide is held flat (`Slot.width` 1): measured on XLA
CPU (one device, boxes of half a shard's columns), rows of 64 words copied no faster than a
flat slot (3.3-5.4 GB/s against 3.0-5.9, and half its speed on small boxes), rows of 128 or
256 words 1.7-6x faster (8.6-20.5 GB/s)."""

REWRAP_BYTES = 1 << 16
"""The bytes whose extra copy on each device costs about as much as re-wrapping one operand
over a group's mesh (`_host_work`): 15-30 us of Python a leaf, where a copy of 64 KiB on each
of 8 CPU devices sharing 2 cores takes about 25 us (measured on this project's machine)."""

DISPATCH_OPERANDS = 4
"""A program run's host cost, in re-wrapped operands (`_host_work`)."""

KEEP_HELD_PARTS = True
"""Whether a step may pass devices' held parts through slots of their own (`Step.kept`) to
make their copies alike; off, every held part is a local copy of the unpack (for A/B runs
and the tests that specify the plain lowering)."""

JOIN_STEPS = True
"""Whether steps of one kind (the same rounds and slots) are joined into steps of at most half
a bucket of slots a device (`_joined`); off, every bucket of the schedule is a step of its own (for
A/B runs and the tests that specify each bucket's step)."""

MIN_CAST_SLOT_WIDTH = 64
"""`MIN_SLOT_WIDTH` for slots whose every message casts: their packs compile with XLA's newer
CPU fusion emitters (`runtime.program_options`), under which a flat slot is slower still and
rows of 64 words already pay (the `cast` bench tree's pack: 31.0 -> 17.7 ms)."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """A staging buffer of ``words`` unsigned integers of type ``word`` (e.g. ``"uint32"``),
    held as rows of ``width`` words (1: flat); or, *typed* (a ``shard`` shape), a spare of one
    whole shard of dtype ``word`` (``words`` elements of ``itemsize`` bytes) that a device
    passes to a whole-shard step where it sends or receives nothing (`planning.whole`).

    Rows are for the pack's sake: XLA's CPU loop that copies a strided box into a flat buffer
    computes each element's place from its flat index (per element, 2-4 GB/s), while a box
    written as rows of a 2-D buffer, read from its shard viewed with rows of the same width,
    copies row by row (12-22 GB/s). The words are the same, in the same order, either way: a
    slot has rows of the width that lets the most of its strided boxes copy so
    (`_slot_widths`); a box that is whole rows of the slot and of its shard viewed as rows of
    that width is copied row by row (`Read.rows`), any other is read as its own shape and
    laid across the rows, starting and ending mid-row where it falls so.
    """

    words: int
    word: str
    width: int = 1
    shard: tuple[int, ...] = ()
    itemsize: int = 0

    @property
    def nbytes(self) -> int:
        if self.shard:
            return self.words * self.itemsize
        return self.words * int(self.word.removeprefix("uint")) // 8

    def shape(self, devices: int) -> tuple[int, ...]:
        """The shape of the array of this slot on ``devices`` devices (split on rows)."""
        if self.shard:
            return (devices * self.shard[0], *self.shard[1:])
        if self.width == 1:
            return (devices * self.words,)
        return (devices * self.words // self.width, self.width)

    def __lt__(self, other: Slot) -> bool:
        """An order among slots of equal bytes, so that `plan_pool` frees them alike
        wherever it runs (runtime and lowering)."""
        return (self.word, self.words, self.width, self.shard) < (
            other.word,
            other.words,
            other.width,
            other.shard,
        )


@dataclasses.dataclass(frozen=True)
class Operand:
    """An array argument of a program, as every device of the program's mesh holds it.

    Attributes:
      shard: the per-device shard shape.
      dtype: its dtype name.
      spec: the array's ``PartitionSpec`` over the program's mesh; None when the per-device
        buffers are re-wrapped onto the program's mesh, split on dimension 0 over all of its
        axes (a rank-0 shard is re-wrapped as replicated: every device reads its own buffer).
    """

    shard: tuple[int, ...]
    dtype: str
    spec: AxisSpec | None


@dataclasses.dataclass(frozen=True)
class Read:
    """Pack: the box of ``shape`` of operand ``operand`` starting at table columns
    ``column ..``, cast to ``wire``, laid as words from word ``offset`` of slot ``slot``.
    With ``rows``, the box is whole rows of its shard viewed as rows of the slot's width, on
    every device of the program, and is copied row by row; else it is read as its own shape
    and laid flat (cut into the slot's rows, if it has them)."""

    slot: int
    operand: int
    shape: tuple[int, ...]
    offset: int
    wire: str
    column: int
    rows: bool = False


@dataclasses.dataclass(frozen=True)
class Write:
    """Unpack: words from ``offset`` of slot ``slot`` into the box of ``shape`` of target
    ``target`` starting at table columns ``column ..``."""

    slot: int
    target: int
    shape: tuple[int, ...]
    offset: int
    column: int


@dataclasses.dataclass(frozen=True)
class Copy:
    """Unpack: a local copy, the box of ``shape`` of source ``source`` (starts at table
    columns ``source_column ..``), cast to the target's dtype, into target ``target`` (starts
    at ``target_column ..``)."""

    source: int
    target: int
    shape: tuple[int, ...]
    source_column: int
    target_column: int


@dataclasses.dataclass(frozen=True)
class Gather:
    """Pack: the first ``words`` words of slot ``slot`` are the words at table columns
    ``column ..`` of the program's gather source (`PackProgram.flat`)."""

    slot: int
    words: int
    column: int


@dataclasses.dataclass(frozen=True)
class Rebuild:
    """Unpack: target ``target``'s whole shard, as words of the program's ``word``, is the
    words at table columns ``column ..`` of the program's gather source (`UnpackProgram`)."""

    target: int
    column: int


@dataclasses.dataclass(frozen=True)
class PackProgram:
    """Every device of ``mesh`` fills ``slots`` (donated staging buffers) with ``reads`` and
    ``gathers``.

    The gather source is the operands ``flat`` names, each ``(operand, wire)`` cast to ``wire``
    and flattened into words of the slots' word type, end to end.

    With ``based``, the last ``len(slots)`` table columns are each slot's base: the word its
    part of the slot starts at (several joined steps share one slot per round, `_join`), to
    which every offset into that slot is relative (a multiple of the slot's width).
    """

    mesh: MeshSpec
    operands: tuple[Operand, ...]
    slots: tuple[Slot, ...]
    reads: tuple[Read, ...]
    columns: int
    flat: tuple[tuple[int, str], ...] = ()
    gathers: tuple[Gather, ...] = ()
    based: bool = False


@dataclasses.dataclass(frozen=True)
class UnpackProgram:
    """Every device of ``mesh`` writes its received ``slots`` into ``targets`` (its destination
    shards, donated) and does its local ``copies`` from ``sources`` (its source shards); the
    targets of ``rebuilds`` are made whole by one gather each instead.

    The gather source, in words of ``word``: the first ``prefix[k]`` words of each slot ``k``
    (in the slots' own words), then each source of ``flat_sources`` cast to its target's dtype,
    then the old words of each target of ``flat_targets`` (those this step does not fill).
    """

    mesh: MeshSpec
    slots: tuple[Slot, ...]
    sources: tuple[Operand, ...]
    targets: tuple[Operand, ...]
    writes: tuple[Write, ...]
    copies: tuple[Copy, ...]
    columns: int
    word: str = "uint8"
    prefix: tuple[int, ...] = ()
    flat_sources: tuple[tuple[int, str], ...] = ()
    flat_targets: tuple[int, ...] = ()
    rebuilds: tuple[Rebuild, ...] = ()
    based: bool = False


@dataclasses.dataclass(frozen=True)
class TransferProgram:
    """One collective-permute per slot over the union mesh ``devices``: slot ``t`` moves from
    position ``s`` to position ``d`` for every ``(s, d)`` in ``perms[t]``."""

    devices: tuple[int, ...]
    slots: tuple[Slot, ...]
    perms: tuple[tuple[tuple[int, int], ...], ...]


Arg = tuple[int, str]
"""``(leaf, side)``: the leaf's source arrays (``"src"``) or destination arrays (``"dst"``)."""


@dataclasses.dataclass(frozen=True)
class PackCall:
    """One run of a pack program in a step.

    Attributes:
      program: what runs.
      args: the array behind each operand.
      slots: per device of ``program.mesh`` (in mesh order), the step's slot behind each
        program slot. Devices lay their messages in a canonical order, not in round order, so
        devices that send alike in different rounds share one program.
      table: per device of ``program.mesh`` (in mesh order), its box starts.
    """

    program: PackProgram
    args: tuple[Arg, ...]
    slots: tuple[tuple[int, ...], ...]
    table: tuple[Starts, ...]


@dataclasses.dataclass(frozen=True)
class UnpackCall:
    """One run of an unpack program in a step: the leaves behind its sources and targets, and
    per device of ``program.mesh`` the step's slot behind each program slot and its box starts
    (as in `PackCall`)."""

    program: UnpackProgram
    sources: tuple[int, ...]
    targets: tuple[int, ...]
    slots: tuple[tuple[int, ...], ...]
    table: tuple[Starts, ...]


@dataclasses.dataclass(frozen=True)
class Step:
    """One bucket: packs, then the transfer, then unpacks.

    Attributes:
      unit: the schedule unit the step belongs to (joined steps, `_joined`: the first's).
      fresh: leaves whose destination arrays are created before this step when the caller
        donates none (those of each unit, before the first step that writes it).
      slots: the step's staging slots (one per round).
      packs, transfer, unpacks: the program runs. A step of local copies only has no packs and
        no transfer.
      shared: ``(device, step slot, packed slot)`` for every round in which a device sends
        what it sends in another round of the step (the same segments into the same slot
        shape: one source shard to several replicas of a destination shard, one relay to
        several peers): its pack fills only ``packed slot``, and the transfer sends that
        buffer in both rounds. Packed once, sent many times; not where sharing would take
        more pack programs than packing every message.
      packed_bytes: the payload its packs write for its rounds (its messages' bytes, less
        those of the rounds in ``shared``).
      kept: ``(device, step slot)`` of every message a device passes itself: parts it holds
        of its own destination shards, packed into a slot of the step after its rounds'
        (``slots[len(transfer.slots):]``) and unpacked from that same buffer, never
        transferred: devices that hold some of what they need then do the same copies as
        those that hold none, and run programs with them (`_kept`); only where that costs
        the host less than the extra copy (`_host_work`).
      kept_bytes: the payload of the ``kept`` messages (packed and unpacked, where a local
        copy would copy it once).
      buckets: the schedule buckets (indices into ``schedule.buckets``) whose messages the
        step sends: one, several where steps are joined (`_joined`), none for a step of
        local copies only. The cost model prices a call's steps from them.
      whole: for a whole-shard step (`planning.whole`), the leaf each round of the transfer
        moves: its senders send their source shards as they are and its receivers receive
        into their destination shards (donated); the step has no packs or unpacks, and its
        slots are typed (`Slot.shard`), the spares of devices idle in a round.
    """

    unit: int
    fresh: tuple[int, ...]
    slots: tuple[Slot, ...]
    packs: tuple[PackCall, ...]
    transfer: TransferProgram | None
    unpacks: tuple[UnpackCall, ...]
    shared: tuple[tuple[int, int, int], ...] = ()
    packed_bytes: int = 0
    kept: tuple[tuple[int, int], ...] = ()
    kept_bytes: int = 0
    buckets: tuple[int, ...] = ()
    whole: tuple[int, ...] = ()

    def senders(self) -> dict[tuple[int, int], tuple[int, int]]:
        """``(device, step slot) -> (pack call index, program slot)`` for every sent slot."""
        out = {}
        for c, call in enumerate(self.packs):
            for device, slots in zip(call.program.mesh.devices, call.slots, strict=True):
                for k, slot in enumerate(slots):
                    out[device, slot] = (c, k)
        return out


@dataclasses.dataclass(frozen=True)
class Lowered:
    """Every step of a plan, and the staging it needs.

    Attributes:
      union: the devices of every transfer (sorted ids). A transfer's positions index its
        own `TransferProgram.devices`: for the staged steps, the devices of every staged
        message; for a whole-shard step, its leaves' (which may add devices to the union).
      steps: in execution order.
      staging_cap: the most staging bytes the pool keeps per device (``2 * bucket_bytes``).
    """

    union: tuple[int, ...]
    steps: tuple[Step, ...]
    staging_cap: int

    def programs(self) -> set[PackProgram | TransferProgram | UnpackProgram]:
        """The distinct programs (each is compiled once)."""
        out: set[PackProgram | TransferProgram | UnpackProgram] = set()
        for step in self.steps:
            out.update(call.program for call in step.packs)
            out.update(call.program for call in step.unpacks)
            if step.transfer is not None:
                out.add(step.transfer)
        return out

    @property
    def packed_bytes(self) -> int:
        """The payload the pack programs write in one call: ``bytes_sent`` less what senders
        send again from a buffer they packed for another round (`Step.shared`)."""
        return sum(step.packed_bytes for step in self.steps)

    @property
    def kept_bytes(self) -> int:
        """The bytes devices pass themselves through slots in one call (`Step.kept`)."""
        return sum(step.kept_bytes for step in self.steps)

    def whole_rounds(self) -> Iterator[tuple[Slot, tuple[tuple[int, int], ...]]]:
        """Every round of the whole-shard steps (`Step.whole`): its slot and its ``(sender,
        receiver)`` device pairs (`step_rounds_of`)."""
        for step in self.steps:
            if step.whole:
                yield from step_rounds_of(step)

    @property
    def whole_bytes(self) -> int:
        """The destination bytes whole-shard steps write in one call (`Step.whole`: shards
        received, and those a device copies from itself), which no unpack writes."""
        return sum(slot.nbytes * len(pairs) for slot, pairs in self.whole_rounds())

    def dispatches(self) -> int:
        """Program runs of one call with donated destinations (no allocation)."""
        return sum(len(s.packs) + len(s.unpacks) + (s.transfer is not None) for s in self.steps)


# ----------------------------------------------------------------------------------- lowering


def lower(
    leaves: Sequence[LeafSpec],
    schedule: Schedule,
    *,
    bucket_bytes: int,
    gather_bytes: int | None = None,
    whole: Sequence[Step] = (),
) -> Lowered:
    """Lower a unit schedule (`schedule.build_plan_schedule`) into steps of programs.

    ``gather_bytes`` (`schedule.gathered`) says which leaves move by gathers; pass the value
    the schedule was built with. ``whole``: the whole-shard steps (`planning.whole`) of the
    leaves the schedule sends nothing of; they run first, and make those leaves' fresh
    destinations.
    """
    small = frozenset(i for i, leaf in enumerate(leaves) if gathered(leaf, gather_bytes))
    union = tuple(sorted({d for b in schedule.buckets for m in b.messages for d in (m.src, m.dst)}))
    position = {d: i for i, d in enumerate(union)}
    laid = [_Laid.of(leaves, small, b) for b in schedule.buckets]
    by_unit: dict[int, list[tuple[int, _Laid]]] = defaultdict(list)  # (schedule bucket, laid)
    for k, b in enumerate(laid):
        by_unit[b.bucket.unit].append((k, b))
    widths = _slot_widths(leaves, small, laid)
    cap = 2 * int(bucket_bytes)
    steps: list[Step] = []
    for u, unit in enumerate(schedule.units):
        buckets = by_unit.get(u, [])
        if not buckets and (unit.local or unit.fresh):
            steps.append(
                _step(leaves, small, None, unit.local, u, unit.fresh, position, widths, cap)
            )
        for i, (k, bucket) in enumerate(buckets):
            local = unit.local if i == 0 else ()
            fresh = unit.fresh if i == 0 else ()
            step = _step(leaves, small, bucket, local, u, fresh, position, widths, cap)
            steps.append(dataclasses.replace(step, buckets=(k,)))
    if JOIN_STEPS:
        # Half a bucket: a step holds a send and a receive buffer of each slot, so two
        # steps in flight (a step's packs beside the previous step's transfer) stay within
        # the pool's cap. Measured on CPU, whole buckets ran slower than halves (the LoRA
        # bench tree: 2 steps 1.11-1.28x the unjoined call, 3 steps 0.82-0.97x).
        steps = _joined(steps, int(bucket_bytes) // 2)
    if whole:
        moved = {i for step in whole for i in step.fresh}
        steps = [*whole, *_without_fresh(steps, moved)]
        devices = {d for step in whole if step.transfer for d in step.transfer.devices}
        union = tuple(sorted({*union, *devices}))
    return Lowered(union, tuple(steps), cap)


def _without_fresh(steps: Sequence[Step], leaves: set[int]) -> list[Step]:
    """``steps`` with ``leaves`` out of their fresh destinations (a whole-shard step makes
    them), and the steps left with nothing to do dropped."""
    out = []
    for step in steps:
        fresh = tuple(i for i in step.fresh if i not in leaves)
        if fresh != step.fresh:
            step = dataclasses.replace(step, fresh=fresh)
        if step.fresh or step.transfer or step.packs or step.unpacks:
            out.append(step)
    return out


def _joined(steps: Sequence[Step], most_bytes: int) -> list[Step]:
    """``steps`` with steps of one kind (the same rounds and slots, `_kind`) joined (`_join`),
    in groups whose slots hold at most ``most_bytes`` (or one step).

    A schedule cuts its units small so that their programs compile quickly (a model's layers:
    `schedule.MAX_REPEAT_COPIES`), which leaves buckets far below the bucket size where the
    leaves are small, each a step of its own: its own collective-permutes, transfer program
    run and (on CPU) host sync. Joined steps send their messages in the same rounds, each
    step's messages in a part of each slot of its own (`PackProgram.based`): as many
    collective-permutes as one of them, of larger messages. The steps of a kind are cut into
    groups of one size where a divisor of their number allows it (`_group_size`): joined
    programs differ from plain ones, and so do those of groups of another size, each
    compiled once.

    Where no pack reads a destination array (no relays), steps commute: each writes bytes of
    the destinations no other step writes, and reads a destination only to keep the words it
    does not write (a small leaf's rebuild, `UnpackProgram.flat_targets`). A group takes its
    kind's steps wherever they sit (the layers of LoRA adapters alternate between two sets of
    rounds) and runs where its first step stood; each unit's fresh destinations are made
    before the first group that writes them. With relays only consecutive steps join.
    """
    relays = any(side == "dst" for step in steps for c in step.packs for _, side in c.args)
    runs: list[list[int]] = []
    kinds: dict[tuple[object, ...], list[int]] = {}
    for i, step in enumerate(steps):
        if step.transfer is None:
            runs.append([i])
        elif not relays:
            kinds.setdefault(_kind(step), []).append(i)
        elif runs and _joins([steps[j] for j in runs[-1]], step):
            runs[-1].append(i)
        else:
            runs.append([i])
    runs += kinds.values()
    groups: list[tuple[int, list[Step]]] = []  # (where it runs, its steps)
    for run in runs:
        members = [steps[i] for i in run]
        most = max(sum(s.nbytes for s in x.slots) for x in members)
        k = _group_size(len(run), max(1, most_bytes // max(most, 1)))
        groups += [(run[i], members[i : i + k]) for i in range(0, len(run), k)]
    fresh: dict[int, list[int]] = defaultdict(list)
    for step in steps:
        fresh[step.unit] += step.fresh
    # A leaf cut into slabs is made by its first slab's unit, and a group may hold a later
    # slab's step ahead of it: the unit that makes each leaf a group writes is made too.
    maker = {i: u for u, made in fresh.items() for i in made}
    out = []
    for _, group in sorted(groups, key=lambda g: g[0]):
        units = [x.unit for x in group]
        units += [maker[i] for x in group for call in x.unpacks for i in call.targets if i in maker]
        made = [i for u in units for i in fresh.pop(u, [])]
        out.append(_join(group, tuple(dict.fromkeys(made))))
    return out


def _kind(step: Step) -> tuple[object, ...]:
    """What steps that join share (`_joins`)."""
    transfer = step.transfer
    assert transfer is not None
    return (step.slots, step.shared, step.kept, transfer.devices, transfer.perms)


def _group_size(n: int, most: int) -> int:
    """How many of a run of ``n`` steps to join, at most ``most``: the largest divisor of
    ``n`` that is at least half of ``most`` (every group then runs the same programs), else
    ``most`` (a shorter last group)."""
    if n <= most:
        return n
    for k in range(most, (most + 1) // 2 - 1, -1):
        if n % k == 0:
            return k
    return most


def _joins(run: Sequence[Step], step: Step) -> bool:
    """Whether ``step`` may run in one step with those of ``run`` (which precede it): the
    same kind (`_kind`: the rounds' pairs, the slots, the messages devices pass themselves,
    `Step.kept`, and the rounds sent from another's buffer, `Step.shared`, as a whole buffer
    is sent again), and no pack of it reading what an unpack of ``run`` writes (a relay
    forwards what it received in an earlier step). (Alike slots keep one program slot alike
    on every device of it, whether a round's or a kept one.)"""
    if step.transfer is None or run[0].transfer is None or _kind(step) != _kind(run[0]):
        return False
    written = {i for x in run for call in x.unpacks for i in call.targets}
    return not any(i in written for call in step.packs for i, side in call.args if side == "dst")


def _join(run: Sequence[Step], fresh: tuple[int, ...]) -> Step:
    """One step of ``run`` (steps of the same rounds and slots, `_joins`) that makes the
    ``fresh`` destinations first: each slot holds the messages of every step of the run, one
    after the other, and each program finds its step's part by the slot's base in its table
    (`PackProgram.based`)."""
    if len(run) == 1:
        return dataclasses.replace(run[0], fresh=fresh)
    first = run[0]
    assert first.transfer is not None
    slots = tuple(dataclasses.replace(s, words=s.words * len(run)) for s in first.slots)

    def based(call, j: int):
        program = call.program
        bases = [tuple(j * first.slots[t].words for t in row) for row in call.slots]
        return dataclasses.replace(
            call,
            program=dataclasses.replace(
                program,
                slots=tuple(slots[t] for t in call.slots[0]),
                columns=program.columns + len(program.slots),
                based=True,
            ),
            table=tuple((*r, *b) for r, b in zip(call.table, bases, strict=True)),
        )

    return Step(
        first.unit,
        fresh,
        slots,
        tuple(based(c, j) for j, x in enumerate(run) for c in x.packs),
        dataclasses.replace(first.transfer, slots=slots[: len(first.transfer.slots)]),
        tuple(based(c, j) for j, x in enumerate(run) for c in x.unpacks),
        first.shared,
        sum(x.packed_bytes for x in run),
        first.kept,
        sum(x.kept_bytes for x in run),
        tuple(b for x in run for b in x.buckets),
    )


def _word_bytes(leaves: Sequence[LeafSpec], segments: Iterable[Segment]) -> int:
    """The widest unsigned word every element of the bucket is made of (complex: per part)."""
    sizes = [_bits_itemsize(leaves[s.leaf]) for s in segments]
    return min(sizes, default=1)


def _bits_itemsize(leaf: LeafSpec) -> int:
    return leaf.itemsize // 2 if leaf.dst_dtype.startswith("complex") else leaf.itemsize


@dataclasses.dataclass(frozen=True)
class _Laid:
    """A bucket with what both its slot widths and its step read: its word size in bytes
    (`_word_bytes`) and each message's segments as the slot lays them (`_gathered_first`)."""

    bucket: Bucket
    w: int
    segments: tuple[list[Segment], ...]

    @classmethod
    def of(cls, leaves: Sequence[LeafSpec], small: frozenset[int], bucket: Bucket) -> _Laid:
        w = _word_bytes(leaves, (seg for m in bucket.messages for seg in m.segments))
        return cls(bucket, w, tuple(_gathered_first(m.segments, small) for m in bucket.messages))

    @property
    def word(self) -> str:
        return f"uint{8 * self.w}"


def _step(
    leaves: Sequence[LeafSpec],
    small: frozenset[int],
    laid: _Laid | None,
    local: Sequence[LocalCopy],
    unit: int,
    fresh: tuple[int, ...],
    position: Mapping[int, int],
    widths: Mapping[tuple[int, str], int],
    cap: int,
) -> Step:
    if laid is None:
        unpacks = _unpacks(leaves, small, {}, local, 1)
        return Step(unit, fresh, (), (), None, unpacks)
    bucket, w, word = laid.bucket, laid.w, laid.word
    slots = tuple(Slot(n // w, word, widths[n // w, word]) for n in bucket.slot_bytes)
    step = _exchange(leaves, small, laid, local, unit, fresh, position, slots)
    if KEEP_HELD_PARTS and local and len(step.packs) + len(step.unpacks) > 2:
        # Devices that hold part of what they need copy it locally, the others receive it:
        # their copies differ, so each kind runs programs of its own (over meshes of their
        # own, every leaf re-wrapped). Passed through a slot as a message to itself, a
        # held part makes them alike: a copy more of those bytes, fewer programs and
        # re-wrapped leaves (taken where those cost the host more than the copy).
        kept = _kept(leaves, small, laid, local, slots, cap)
        if kept is not None:
            more, messages, rest = kept
            alike = _exchange(
                leaves, small, laid, rest, unit, fresh, position, (*slots, *more), messages
            )
            # (the devices copy at once: the extra copy costs the one that copies the most)
            most = max(sum(g.nbytes for _, gs in m for g in gs) for m in messages.values())
            if _host_work(alike) * REWRAP_BYTES + most < _host_work(step) * REWRAP_BYTES:
                return alike
    return step


def _exchange(
    leaves: Sequence[LeafSpec],
    small: frozenset[int],
    laid: _Laid,
    local: Sequence[LocalCopy],
    unit: int,
    fresh: tuple[int, ...],
    position: Mapping[int, int],
    slots: tuple[Slot, ...],
    kept: Kept | None = None,
) -> Step:
    """The step of a bucket with transfers, its ``slots`` the rounds' and then those of the
    ``kept`` messages (what devices pass themselves)."""
    bucket, w = laid.bucket, laid.w
    every: dict[int, dict[int, list[Segment]]] = defaultdict(dict)
    sent: dict[int, dict[int, list[Segment]]] = defaultdict(dict)
    got: dict[int, dict[int, list[Segment]]] = defaultdict(dict)
    shared = []
    packed_bytes = total = 0
    # A message a sender already packs in this step, into a slot of the same shape, is sent
    # again from that buffer rather than packed twice (`Step.shared`).
    packed_slots = bucket.packed_slots()
    for m, segments, t in zip(bucket.messages, laid.segments, packed_slots, strict=True):
        got[m.dst][m.slot] = segments
        every[m.src][m.slot] = segments
        total += m.nbytes
        if t == m.slot:
            sent[m.src][m.slot] = segments
            packed_bytes += m.nbytes
        else:
            shared.append((m.src, m.slot, t))
    passed = [(d, t, segments) for d, messages in (kept or {}).items() for t, segments in messages]
    for d, t, segments in passed:
        got[d][t] = every[d][t] = sent[d][t] = segments
    kept_bytes = sum(g.nbytes for _, _, segments in passed for g in segments)
    perms = tuple(
        tuple(sorted((position[s], position[d]) for s, d in perm)) for perm in bucket.perms()
    )
    transfer = TransferProgram(tuple(position), slots[: bucket.slots], perms)
    packs = _packs(leaves, small, sent, slots, w)
    if shared:
        # Only where it splits no pack program: senders that share unlike each other no
        # longer pack alike, and a program more (a launch, arrays re-wrapped over a mesh of
        # its own) costs more than a few small messages' copies (the bench's 576 norm scales
        # and biases: two pack programs a step, 9 -> 29 ms to pack).
        alone = _packs(leaves, small, every, slots, w)
        if len(alone) < len(packs):
            packs, shared, packed_bytes = alone, [], total
    unpacks = _unpacks(leaves, small, got, local, w, slots)
    return Step(
        unit,
        fresh,
        slots,
        packs,
        transfer,
        unpacks,
        tuple(sorted(shared)),
        packed_bytes,
        tuple(sorted((d, t) for d, t, _ in passed)),
        kept_bytes,
    )


def _host_work(step: Step) -> int:
    """What a step costs the host beyond its bytes, in re-wrapped operands: each program run
    (`DISPATCH_OPERANDS`), and each operand over a mesh of its own group (re-wrapped from its
    array's buffers; an unpack's targets twice: in, and split back out)."""
    work = 0
    for pack in step.packs:
        work += DISPATCH_OPERANDS + sum(o.spec is None for o in pack.program.operands)
    for unpack in step.unpacks:
        program = unpack.program
        work += DISPATCH_OPERANDS + sum(o.spec is None for o in program.sources)
        work += 2 * sum(o.spec is None for o in program.targets)
    return work


Kept = dict[int, list[tuple[int, list[Segment]]]]
"""Per device, the messages it passes itself: ``(step slot, segments)`` (`Step.kept`)."""


def _kept(
    leaves: Sequence[LeafSpec],
    small: frozenset[int],
    laid: _Laid,
    local: Sequence[LocalCopy],
    slots: Sequence[Slot],
    cap: int,
) -> tuple[tuple[Slot, ...], Kept, list[LocalCopy]] | None:
    """As messages to themselves (`Step.kept`), the local copies of the leaves that some
    devices receive in this step without holding any of them (where every receiver of a leaf
    holds part of it, its copies are alike already), on the devices that receive in the step.

    A device's copies are cut as a peer that holds none of those leaves receives them: one
    message per message of the peer's that carries some of them (so that the device then
    does what the peer does), or one message where no peer takes them all. Each is laid as a
    stream is (`schedule.end_to_end`, gathered leaves first), in a slot as large as the
    smallest round's it fits in, after the rounds' slots. Returns the new slots, each
    device's messages and the copies left, or None where no device's copies fit (or keep to
    the bucket's word). A device's staging in the step (at most a receive and a send buffer
    a round, and these slots) stays within the pool's ``cap``, as every step's does."""
    bucket, w = laid.bucket, laid.w
    receivers: dict[int, set[int]] = defaultdict(set)  # leaf -> devices that receive of it
    carried: dict[int, list[set[int]]] = defaultdict(list)  # device -> leaves of each message
    for m, segments in sorted(
        zip(bucket.messages, laid.segments, strict=True), key=lambda x: x[0].slot
    ):
        carried[m.dst].append({g.leaf for g in segments})
        for g in segments:
            receivers[g.leaf].add(m.dst)
    holders: dict[int, set[int]] = defaultdict(set)
    for c in local:
        holders[c.leaf].add(c.device)
    by_device: dict[int, list[LocalCopy]] = defaultdict(list)
    for c in local:
        if c.device in carried and receivers[c.leaf] - holders[c.leaf]:
            by_device[c.device].append(c)
    fits = sorted({(slot.nbytes, slot) for slot in slots[: bucket.slots]})
    rounds_bytes = 2 * sum(slot.nbytes for slot in slots[: bucket.slots])
    more: list[Slot] = []
    kept: Kept = {}
    for d, copies in sorted(by_device.items()):
        if any(_bits_itemsize(leaves[c.leaf]) % w for c in copies):
            continue  # an element narrower than the bucket's word
        messages = []
        for part in _as_a_peer_gets(copies, holders, receivers, carried):
            segments = end_to_end(leaves, part)
            at = sum(g.nbytes for g in segments)
            messages.append((next((s for n, s in fits if at <= n), None), segments))
        if any(slot is None for slot, _ in messages):
            continue
        if rounds_bytes + sum(slot.nbytes for slot, _ in messages) > cap:
            continue
        taken: list[int] = []
        kept[d] = []
        for slot, segments in messages:
            t = next((i for i, s in enumerate(more) if s == slot and i not in taken), None)
            if t is None:
                t = len(more)
                more.append(slot)
            taken.append(t)
            kept[d].append((bucket.slots + t, _gathered_first(segments, small)))
    if not kept:
        return None
    moved = {id(c) for d in kept for c in by_device[d]}
    return tuple(more), kept, [c for c in local if id(c) not in moved]


def _as_a_peer_gets(
    copies: Sequence[LocalCopy],
    holders: Mapping[int, set[int]],
    receivers: Mapping[int, set[int]],
    carried: Mapping[int, Sequence[set[int]]],
) -> list[list[LocalCopy]]:
    """``copies`` cut as the first peer that receives all of their leaves and holds none of
    them gets those leaves: a part per message of the peer's that carries some, where every
    leaf is in one message only; else all of them as one part."""
    mine = {c.leaf for c in copies}
    peers = set.intersection(*(receivers[i] - holders[i] for i in mine))
    for peer in sorted(peers):
        parts = [mine & leaves for leaves in carried[peer] if mine & leaves]
        if sum(len(p) for p in parts) == len(mine):
            return [[c for c in copies if c.leaf in p] for p in parts]
    return [list(copies)]


def _slot_widths(
    leaves: Sequence[LeafSpec], small: frozenset[int], buckets: Iterable[_Laid]
) -> dict[tuple[int, str], int]:
    """The row width (`Slot.width`) of the slots of each size ``(words, word)``: of the
    powers of two from `MIN_SLOT_WIDTH` (`MIN_CAST_SLOT_WIDTH` where every message casts) to
    `MAX_SLOT_WIDTH`, the one under which the most bytes of strided boxes (not one run of
    their shard's words) are whole rows of the slot and of their shards, and so copy row by
    row (`_box_rows`), the wider on a tie; 1 (flat) where no box would.

    Any other box is read as its own shape and laid flat, wherever it falls in the slot, so
    one leaf whose columns do not split into wide rows (a vocabulary of 32,000 over 4
    devices: rows of 8,000 elements, cut by the chunks mid-row) leaves the other boxes their
    rows (until 2026-12-05 it made every slot of the plan flat: a scanned fp32 tree's packs
    took twice as long).

    One width per size, not per slot, so that the staging pool (which keeps buffers by
    `Slot`) hands a later step, and the next call, the buffers of an earlier one as before.
    """
    strided: dict[tuple[int, str], Counter[int]] = defaultdict(Counter)  # rows gcd -> bytes
    casts: dict[tuple[int, str], bool] = {}
    for laid in buckets:
        bucket, w, word = laid.bucket, laid.w, laid.word
        for m, segments in zip(bucket.messages, laid.segments, strict=True):
            key = (bucket.slot_bytes[m.slot] // w, word)
            for seg in segments:
                g = _box_rows(leaves, small, m.src, seg, w)
                if g is not None:
                    strided[key][g] += seg.nbytes
            casts[key] = casts.get(key, True) and any(_casts(leaves[g.leaf], g) for g in segments)
    widths = {}
    for bucket in buckets:
        for n in bucket.bucket.slot_bytes:
            key = (n // bucket.w, bucket.word)
            if key in widths:
                continue
            floor = MIN_CAST_SLOT_WIDTH if casts.get(key) else MIN_SLOT_WIDTH
            fast = {
                width: sum(b for rows, b in strided[key].items() if _whole_rows(rows, width))
                for width in _powers_of_two(floor, MAX_SLOT_WIDTH)
                if key[0] % width == 0
            }
            best = max(fast, key=lambda width: (fast[width], width), default=1)
            widths[key] = best if fast.get(best) else 1
    return widths


def _powers_of_two(low: int, high: int) -> list[int]:
    """The powers of two from ``low`` to ``high``."""
    return [1 << k for k in range(high.bit_length()) if low <= 1 << k <= high]


def _casts(leaf: LeafSpec, segment: Segment) -> bool:
    """Whether the sender converts ``segment`` to another dtype (a relay forwards it as is)."""
    return not segment.from_dst and leaf.src_dtype != leaf.dst_dtype


def _box_rows(
    leaves: Sequence[LeafSpec], small: frozenset[int], device: int, seg: Segment, w: int
) -> int | None:
    """For a copied box that ``device`` packs and that is not one run of its shard's words
    (`contiguous`), a number of words every row width it can be copied by, row by row, must
    divide (0: any): its offset and its words, so that it is whole rows of the slot, and its
    last dimension, its start in the sender's shard and that shard's last dimension in
    words, so that it is whole rows of its shard viewed as rows of that width. None for a box
    read as its own shape whatever the width (one run of words, a gathered leaf's, a box of
    no dimension)."""
    shape = box_shape(seg.box)
    if seg.leaf in small or not shape:
        return None
    held = _layout(leaves, _arg(seg))
    if contiguous(shape, held.shard_shape):
        return None
    per = leaves[seg.leaf].itemsize // w
    start = _relative(seg.box, held.box_of[device])[-1]
    return math.gcd(
        seg.offset // w,
        per * math.prod(shape),
        per * shape[-1],
        per * start,
        per * held.shard_shape[-1],
    )


def _whole_rows(rows: int | None, width: int) -> bool:
    """Whether a box of row gcd ``rows`` (`_box_rows`) is whole rows of its shard viewed as
    rows of ``width`` words."""
    return rows is not None and rows % width == 0


def contiguous(shape: Sequence[int], shard: Sequence[int]) -> bool:
    """Whether a box of ``shape`` is one run of words of a shard of shape ``shard`` (C order):
    every dimension after its first of more than one element is whole."""
    rest = list(zip(shape, shard, strict=True))
    while rest and rest[0][0] == 1:
        rest.pop(0)
    return all(n == m for n, m in rest[1:])


def _gathered_first(segments: Sequence[Segment], small: frozenset[int]) -> list[Segment]:
    """A message's segments re-laid with those of gathered leaves first, back to back from
    offset 0 (a pack's gather fills the head of the slot), the others after them in their
    order. Sender and receiver both lower from this layout. Every segment's size is a
    multiple of the bucket's word, so every offset stays on a word."""
    if not any(g.leaf in small for g in segments):
        return list(segments)
    ordered = sorted(segments, key=lambda g: (g.leaf not in small, g.offset))
    out, at = [], 0
    for g in ordered:
        out.append(dataclasses.replace(g, offset=at))
        at += g.nbytes
    return out


def _word_indices(
    start: Sequence[int], shape: Sequence[int], shard: Sequence[int], per: int
) -> np.ndarray:
    """Positions, in a shard of shape ``shard`` laid out in C order as ``per`` words an
    element, of the words of its box of ``shape`` from ``start`` (box elements in C order)."""
    if shape:
        grid = np.indices(tuple(shape), dtype=np.int64).reshape(len(shape), -1)
        grid += np.asarray(start, dtype=np.int64).reshape(-1, 1)
        elements = np.ravel_multi_index(tuple(grid), tuple(shard))
    else:
        elements = np.zeros(1, np.int64)
    return (elements[:, None] * per + np.arange(per, dtype=np.int64)).reshape(-1)


def _groups(signature: Mapping[int, object]) -> list[list[int]]:
    """Devices with equal signatures, each group sorted, groups in order of their first id."""
    by: dict[object, list[int]] = defaultdict(list)
    for device in sorted(signature):
        by[signature[device]].append(device)
    return list(by.values())


def _mesh_for(
    group: Sequence[int], meshes: set[MeshSpec | None], name: str
) -> tuple[MeshSpec, bool]:
    """The mesh a group's program runs over: the arrays' own mesh when they all live on one
    and the group is all of it (no re-wrapping), else a 1-D mesh of the group."""
    if len(meshes) == 1:
        (mesh,) = meshes
        if mesh is not None and set(mesh.devices) == set(group):
            return mesh, True
    return MeshSpec.line(group, name), False


def _operand(leaf: LeafSpec, side: str, native: bool) -> Operand:
    layout = leaf.src if side == "src" else leaf.dst
    dtype = leaf.src_dtype if side == "src" else leaf.dst_dtype
    return Operand(layout.shard_shape, dtype, layout.spec if native else None)


def _origin(box: Box) -> tuple[int, ...]:
    return tuple(start for start, _ in box)


def _relative(box: Box, held: Box) -> Starts:
    return tuple(b - h for (b, _), (h, _) in zip(box, held, strict=True))


Message = tuple[int, tuple[Segment, ...]]
"""``(step slot, segments)``: what one device sends (or receives) in one round."""


def _messages(
    by_slot: Mapping[int, list[Segment]], slots: Sequence[Slot], key, small: frozenset[int]
) -> list[Message]:
    """A device's messages in canonical order: by size and structure (``key`` of each segment
    that is copied, and the bytes of those gathered), then by round, so that devices doing the
    same copies in different rounds have equal programs."""
    messages = [(t, tuple(segs)) for t, segs in by_slot.items()]
    return sorted(messages, key=lambda m: (_slot_key(slots[m[0]]), _shape(m[1], key, small), m[0]))


def _shape(segments: Sequence[Segment], key, small: frozenset[int]) -> tuple[object, ...]:
    """A message's structure as a program sees it: the ``key`` of each copied segment, and how
    many bytes its gathered head holds (which leaves those are is only in the table)."""
    copied = tuple(key(g) for g in segments if g.leaf not in small)
    return copied, _head_bytes(segments, small)


def _head_bytes(segments: Sequence[Segment], small: frozenset[int]) -> int:
    """The bytes of a message's gathered head: its segments of small leaves."""
    return sum(g.nbytes for g in segments if g.leaf in small)


def _split_unless_held(
    leaves: Sequence[LeafSpec],
    group: list[int],
    union: Sequence[Arg],
    exact: Mapping[int, object],
) -> list[list[int]]:
    """``group`` as one program, if every device of it holds a shard of every array of
    ``union`` (the gathered leaves any of them moves); else its devices grouped by ``exact``
    signature (the gathered leaves named), each then with its own arrays."""
    if all(d in _layout(leaves, a).box_of for a in union for d in group):
        return [group]
    return _groups({d: exact[d] for d in group})


def _slot_key(slot: Slot) -> tuple[int, str, int]:
    return slot.words, slot.word, slot.width


def _packs(
    leaves: Sequence[LeafSpec],
    small: frozenset[int],
    sent: Mapping[int, Mapping[int, list[Segment]]],
    slots: Sequence[Slot],
    w: int,
) -> tuple[PackCall, ...]:
    def key(seg: Segment) -> tuple[object, ...]:
        return _arg(seg), box_shape(seg.box), seg.offset

    def gathered_args(d: int) -> list[Arg]:
        return [_arg(g) for _, segs in messages[d] for g in segs if g.leaf in small]

    messages = {d: _messages(by_slot, slots, key, small) for d, by_slot in sent.items()}
    signature = {
        d: tuple((slots[t], _shape(segs, key, small)) for t, segs in ms)
        for d, ms in messages.items()
    }
    exact = {
        d: tuple((slots[t], tuple(key(g) for g in segs)) for t, segs in ms)
        for d, ms in messages.items()
    }
    calls = []
    for loose in _groups(signature):
        union = list(dict.fromkeys(a for d in loose for a in gathered_args(d)))
        for group in _split_unless_held(leaves, loose, union, exact):
            canonical = messages[group[0]]
            copied = [_arg(g) for _, segs in canonical for g in segs if g.leaf not in small]
            # The gather source: every array of a gathered leaf any device of the group sends
            # from, cast to the wire, end to end (the same arrays on every device).
            flat = list(dict.fromkeys(a for d in group for a in gathered_args(d)))
            args = tuple(dict.fromkeys([*copied, *flat]))
            meshes = {_layout(leaves, a).mesh for a in args}
            mesh, native = _mesh_for(group, meshes, GROUP_AXIS)
            index = {a: i for i, a in enumerate(args)}
            base, at = {}, 0
            for a in flat:
                base[a] = at
                at += math.prod(_layout(leaves, a).shard_shape) * leaves[a[0]].itemsize // w
            reads, gathers, column = [], [], 0
            for k, (t, segs) in enumerate(canonical):
                copied = [
                    [g for g in messages[d][k][1] if g.leaf not in small] for d in group
                ]  # each device's boxes of this message, in the canonical order
                for i, g in enumerate(g for g in segs if g.leaf not in small):
                    shape = box_shape(g.box)
                    wire = leaves[g.leaf].dst_dtype
                    rows = slots[t].width > 1 and all(
                        _whole_rows(_box_rows(leaves, small, d, boxes[i], w), slots[t].width)
                        for d, boxes in zip(group, copied, strict=True)
                    )
                    offset = g.offset // w
                    reads.append(Read(k, index[_arg(g)], shape, offset, wire, column, rows))
                    column += len(shape)
            for k, (_, segs) in enumerate(canonical):
                words = _head_bytes(segs, small) // w
                if words:
                    gathers.append(Gather(k, words, column))
                    column += words
            program = PackProgram(
                mesh,
                tuple(_operand(leaves[leaf], side, native) for leaf, side in args),
                tuple(slots[t] for t, _ in canonical),
                tuple(reads),
                column,
                tuple((index[a], leaves[a[0]].dst_dtype) for a in flat),
                tuple(gathers),
            )
            table = tuple(_pack_row(leaves, small, d, messages[d], base, w) for d in mesh.devices)
            per_device = tuple(tuple(t for t, _ in messages[d]) for d in mesh.devices)
            calls.append(PackCall(program, args, per_device, table))
    return tuple(calls)


def _pack_row(
    leaves: Sequence[LeafSpec],
    small: frozenset[int],
    device: int,
    messages: Sequence[Message],
    base: Mapping[Arg, int],
    w: int,
) -> Starts:
    """``device``'s table row of a pack: its box starts, then its gathers' word indices."""
    starts: list[int] = []
    picks: list[np.ndarray] = []
    for _, segs in messages:
        for g in segs:
            held = _layout(leaves, _arg(g))
            start = _relative(g.box, held.box_of[device])
            if g.leaf not in small:
                starts.extend(start)
                continue
            per = leaves[g.leaf].itemsize // w
            at = _word_indices(start, box_shape(g.box), held.shard_shape, per)
            picks.append(base[_arg(g)] + at)
    return (*starts, *_ints(picks))


def _arg(seg: Segment) -> Arg:
    return seg.leaf, "dst" if seg.from_dst else "src"


def _ints(parts: Sequence[np.ndarray]) -> list[int]:
    return np.concatenate(parts).tolist() if parts else []


def _layout(leaves: Sequence[LeafSpec], arg: Arg) -> Layout:
    leaf, side = arg
    return leaves[leaf].src if side == "src" else leaves[leaf].dst


def _unpacks(
    leaves: Sequence[LeafSpec],
    small: frozenset[int],
    got: Mapping[int, Mapping[int, list[Segment]]],
    local: Sequence[LocalCopy],
    w: int,
    slots: Sequence[Slot] = (),
) -> tuple[UnpackCall, ...]:
    def key(seg: Segment) -> tuple[object, ...]:
        return seg.leaf, box_shape(seg.box), seg.offset

    def gathered(d: int) -> list[Arg]:
        """The arrays a device's rebuilds read: its small targets, and small local sources."""
        into = [(g.leaf, "dst") for _, segs in messages[d] for g in segs if g.leaf in small]
        own = [c.leaf for c in copies.get(d, ()) if c.leaf in small]
        return into + [(i, "dst") for i in own] + [(i, "src") for i in own]

    copies: dict[int, list[LocalCopy]] = defaultdict(list)
    for c in sorted(local, key=lambda c: (c.leaf, box_shape(c.box), c.box)):
        copies[c.device].append(c)
    devices = set(got) | set(copies)
    messages = {d: _messages(got.get(d, {}), slots, key, small) for d in devices}
    signature = {
        d: (
            tuple((slots[t], _shape(segs, key, small)) for t, segs in messages[d]),
            tuple((c.leaf, box_shape(c.box)) for c in copies.get(d, ()) if c.leaf not in small),
        )
        for d in devices
    }
    exact = {
        d: (
            tuple((slots[t], tuple(key(g) for g in segs)) for t, segs in messages[d]),
            tuple((c.leaf, box_shape(c.box)) for c in copies.get(d, ())),
        )
        for d in devices
    }
    calls = []
    for loose in _groups(signature):
        union = list(dict.fromkeys(a for d in loose for a in gathered(d)))
        for group in _split_unless_held(leaves, loose, union, exact):
            calls.append(_unpack_call(leaves, small, messages, copies, group, w, slots))
    return tuple(calls)


def _unpack_call(
    leaves: Sequence[LeafSpec],
    small: frozenset[int],
    messages: Mapping[int, list[Message]],
    copies: Mapping[int, list[LocalCopy]],
    group: Sequence[int],
    w: int,
    slots: Sequence[Slot],
) -> UnpackCall:
    """The unpack of one group of receivers: the copies of the first device's messages (the
    same on every device of the group), and rebuilds of every small leaf any of them gets."""
    canonical = messages[group[0]]
    copies_in = [c for c in copies.get(group[0], []) if c.leaf not in small]
    rebuilt = list(
        dict.fromkeys(
            i
            for d in group
            for i in [
                *(g.leaf for _, segs in messages[d] for g in segs if g.leaf in small),
                *(c.leaf for c in copies.get(d, ()) if c.leaf in small),
            ]
        )
    )
    copied = [g.leaf for _, segs in canonical for g in segs if g.leaf not in small]
    targets = tuple(dict.fromkeys([*copied, *(c.leaf for c in copies_in), *rebuilt]))
    local_sources = [c.leaf for d in group for c in copies.get(d, ()) if c.leaf in small]
    sources = tuple(dict.fromkeys([*(c.leaf for c in copies_in), *local_sources]))
    mesh, native = _mesh_for(group, {leaves[i].dst.mesh for i in targets}, GROUP_AXIS)
    target_of = {leaf: k for k, leaf in enumerate(targets)}
    source_of = {leaf: k for k, leaf in enumerate(sources)}
    writes, column = [], 0
    for k, (_, segs) in enumerate(canonical):
        for g in segs:
            if g.leaf not in small:
                shape = box_shape(g.box)
                writes.append(Write(k, target_of[g.leaf], shape, g.offset // w, column))
                column += len(shape)
    program_copies = []
    for c in copies_in:
        shape = box_shape(c.box)
        program_copies.append(
            Copy(source_of[c.leaf], target_of[c.leaf], shape, column, column + len(shape))
        )
        column += 2 * len(shape)
    rebuild = _Rebuild(leaves, small, canonical, rebuilt, list(dict.fromkeys(local_sources)), w)
    for d in group:
        rebuild.fill(d, messages[d], copies.get(d, ()))
    columns_of = rebuild.columns_from(column)
    program = UnpackProgram(
        mesh,
        tuple(slots[t] for t, _ in canonical),
        tuple(_operand(leaves[i], "src", native and leaves[i].src.mesh == mesh) for i in sources),
        tuple(_operand(leaves[i], "dst", native) for i in targets),
        tuple(writes),
        tuple(program_copies),
        column + sum(rebuild.words(i, "dst") for i in rebuilt),
        f"uint{8 * rebuild.u}",
        rebuild.prefix,
        tuple((source_of[i], leaves[i].dst_dtype) for i in rebuild.sources),
        tuple(target_of[i] for i in rebuild.keep),
        tuple(Rebuild(target_of[i], at) for i, at in zip(rebuilt, columns_of, strict=True)),
    )
    table = tuple(
        (
            *_unpack_row(leaves, small, d, messages[d], copies.get(d, ())),
            *rebuild.row(d, messages[d], copies.get(d, ())),
        )
        for d in mesh.devices
    )
    per_device = tuple(tuple(t for t, _ in messages[d]) for d in mesh.devices)
    return UnpackCall(program, sources, targets, per_device, table)


class _Rebuild:
    """The gathers of one unpack program: which of its targets are rebuilt (the small leaves
    any device of the group gets), the gather source's layout, and each device's word indices.

    The source is laid in words of ``u`` bytes (the slots' word, or narrower where a rebuilt
    target's elements are): the gathered head of each slot, then each small leaf's local
    source cast to its destination dtype, then the old words of each rebuilt target some
    device of the group does not fill in this step (``keep``: its other parts arrive in other
    steps, or that device gets none of it here and keeps its shard as it is). Call `fill` for
    every device of the group before `columns_from` and `row`.
    """

    def __init__(
        self,
        leaves: Sequence[LeafSpec],
        small: frozenset[int],
        canonical: Sequence[Message],
        targets: Sequence[int],
        sources: Sequence[int],
        w: int,
    ) -> None:
        self.leaves = leaves
        self.small = small
        self.targets = list(targets)
        self.sources = list(sources)
        sizes = [_bits_itemsize(leaves[i]) for i in self.targets]
        self.u = min([w] * bool(canonical) + sizes, default=w)
        self.w = w
        self.prefix = tuple(_head_bytes(segs, small) // w for _, segs in canonical)
        self.keep: list[int] = []
        self.base: dict[tuple[str, int], int] = {}

    def fill(self, device: int, messages: Sequence[Message], copies: Sequence[LocalCopy]) -> None:
        """Mark the targets ``device`` does not fill whole in this step as kept."""
        filled: dict[int, int] = defaultdict(int)
        for _, segs in messages:
            for g in segs:
                if g.leaf in self.small:
                    filled[g.leaf] += box_size(g.box)
        for c in copies:
            if c.leaf in self.small:
                filled[c.leaf] += box_size(c.box)
        shards = {i: math.prod(self.leaves[i].dst.shard_shape) for i in self.targets}
        short = {i for i in self.targets if filled[i] < shards[i]}
        self.keep = [i for i in self.targets if i in short or i in self.keep]

    def columns_from(self, column: int) -> list[int]:
        """Lay the gather source out, and return each target's first table column."""
        at = sum(self.prefix) * self.w // self.u
        for i in self.sources:
            self.base["src", i] = at
            at += self.words(i, "src")
        for i in self.keep:
            self.base["dst", i] = at
            at += self.words(i, "dst")
        out = []
        for i in self.targets:
            out.append(column)
            column += self.words(i, "dst")
        return out

    def words(self, leaf: int, side: str) -> int:
        shard = _layout(self.leaves, (leaf, side)).shard_shape
        return math.prod(shard) * self.leaves[leaf].itemsize // self.u

    def row(
        self, device: int, messages: Sequence[Message], copies: Sequence[LocalCopy]
    ) -> list[int]:
        """``device``'s word indices, target after target."""
        if not self.targets:
            return []
        leaves, u = self.leaves, self.u
        picks: dict[int, np.ndarray] = {}
        for i in self.targets:
            n = self.words(i, "dst")
            picks[i] = (
                self.base["dst", i] + np.arange(n) if i in self.keep else np.zeros(n, np.int64)
            )
        head = 0
        for _, segs in messages:
            for g in segs:
                if g.leaf in self.small:
                    per = leaves[g.leaf].itemsize // u
                    dst = leaves[g.leaf].dst
                    at = _word_indices(
                        _relative(g.box, dst.box_of[device]), box_shape(g.box), dst.shard_shape, per
                    )
                    picks[g.leaf][at] = head + g.offset // u + np.arange(at.size)
            head += _head_bytes(segs, self.small) // u
        for c in copies:
            if c.leaf in self.small:
                per = leaves[c.leaf].itemsize // u
                src, dst = leaves[c.leaf].src, leaves[c.leaf].dst
                shape = box_shape(c.box)
                at = _word_indices(
                    _relative(c.box, dst.box_of[device]), shape, dst.shard_shape, per
                )
                picks[c.leaf][at] = self.base["src", c.leaf] + _word_indices(
                    _relative(c.box, src.box_of[device]), shape, src.shard_shape, per
                )
        return _ints([picks[i] for i in self.targets])


def _unpack_row(
    leaves: Sequence[LeafSpec],
    small: frozenset[int],
    device: int,
    messages: Sequence[Message],
    copies: Sequence[LocalCopy],
) -> Starts:
    row: list[int] = []
    for _, segs in messages:
        for g in segs:
            if g.leaf not in small:
                row.extend(_relative(g.box, leaves[g.leaf].dst.box_of[device]))
    for c in copies:
        if c.leaf not in small:
            row.extend(_relative(c.box, leaves[c.leaf].src.box_of[device]))
            row.extend(_relative(c.box, leaves[c.leaf].dst.box_of[device]))
    return tuple(row)


# ------------------------------------------------------------------------------------ staging


Shape = Slot
"""A staging buffer is identified by its `Slot` (word count and word type)."""


@dataclasses.dataclass(frozen=True)
class Roles:
    """The staging buffers one device uses in one step.

    Attributes:
      recv: ``(slot index, slot)`` of every round: the buffer it receives into (donated to
        the transfer).
      send: ``(slot index, slot)`` of every round whose buffer its pack fills (donated to
        the pack): every round it sends in but those it sends from another's (`Step.shared`),
        and every slot of a message it passes itself (`Step.kept`: its unpack reads it).
      idle: the distinct slots of the rounds it sends nothing in: a buffer of that size is
        passed to the transfer and never read (one per size, shared by its rounds).
    """

    recv: tuple[tuple[int, Slot], ...]
    send: tuple[tuple[int, Slot], ...]
    idle: tuple[Slot, ...]

    def need(self) -> Counter[Slot]:
        return Counter([*(s for _, s in self.recv), *(s for _, s in self.send), *self.idle])


def step_roles(step: Step, union: Sequence[int]) -> dict[int, Roles]:
    """The staging buffers each device of ``union`` uses in ``step`` (none without a
    transfer; none on a device outside the step's transfer)."""
    if step.transfer is None:
        return {}
    if step.whole:
        return _whole_roles(step.transfer, union)
    senders = step.senders()
    shared = {(d, t) for d, t, _ in step.shared}  # sent from another round's buffer
    out = {}
    rounds = len(step.transfer.slots)
    mine = set(step.transfer.devices)
    for d in (d for d in union if d in mine):
        recv = tuple(enumerate(step.slots[:rounds]))
        # (and the slots of the messages it passes itself, `Step.kept`, which it packs)
        send = tuple((t, s) for t, s in enumerate(step.slots) if (d, t) in senders)
        idle = tuple(
            dict.fromkeys(s for t, s in recv if (d, t) not in senders and (d, t) not in shared)
        )
        out[d] = Roles(recv, send, idle)
    return out


def _whole_roles(program: TransferProgram, union: Sequence[int]) -> dict[int, Roles]:
    """The spares of a whole-shard step (`Step.whole`) on each of its devices in ``union``:
    a receive buffer for each round the device receives nothing in (it comes back zeroed),
    and a buffer of each slot it sends nothing in some round of (only read). Its shards are
    the caller's, not staging."""
    out = {}
    at = {d: k for k, d in enumerate(program.devices)}
    for d in union:
        if d not in at:
            continue
        k = at[d]
        recv = tuple(
            (t, s)
            for t, (s, perm) in enumerate(zip(program.slots, program.perms, strict=True))
            if all(b != k for _, b in perm)
        )
        idle = tuple(
            dict.fromkeys(
                s
                for s, perm in zip(program.slots, program.perms, strict=True)
                if all(a != k for a, _ in perm)
            )
        )
        out[d] = Roles(recv, (), idle)
    return out


def step_rounds_of(step: Step) -> Iterator[tuple[Slot, tuple[tuple[int, int], ...]]]:
    """Each round of a step's transfer: its slot and its ``(sender, receiver)`` pairs as
    device ids (the program's are positions in its devices)."""
    program = step.transfer
    assert program is not None
    ids = program.devices
    for slot, perm in zip(program.slots, program.perms, strict=True):
        yield slot, tuple((ids[a], ids[b]) for a, b in perm)


def whole_wire_bytes(lowered: Lowered) -> int:
    """Bytes the whole-shard steps' collective-permutes carry between devices (a pair of a
    device with itself is a local copy)."""
    return sum(
        slot.nbytes * sum(1 for a, b in pairs if a != b) for slot, pairs in lowered.whole_rounds()
    )


def staging(lowered: Lowered) -> dict[int, int]:
    """Peak staging bytes per device over one call, starting from an empty pool (the first
    call) and, since the pool is kept, also over a second call starting from the first's."""
    pools: dict[int, Counter[Slot]] = {d: Counter() for d in lowered.union}
    peak = dict.fromkeys(lowered.union, 0)
    for _ in range(2):
        for step in lowered.steps:
            for d, roles in step_roles(step, lowered.union).items():
                free, allocate = plan_pool(pools[d], roles.need(), lowered.staging_cap)
                pools[d] = pools[d] - free + allocate
                peak[d] = max(peak[d], sum(s.nbytes * n for s, n in pools[d].items()))
    return peak


def with_lowered(
    stats: PlanStats,
    lowered: Lowered,
    host_syncs: int = 0,
    runtime_programs: tuple[int, int] = (0, 0),
) -> PlanStats:
    """``stats`` with what the lowering knows: rounds and buckets as a call runs them (joined
    buckets run their rounds together, `_joined`), staging as the runtime's pool holds it
    (the peak over two calls, see `staging`), programs and dispatches per call; ``host_syncs``
    and ``runtime_programs`` (programs and dispatches per call the runtime adds on this
    backend) are the runtime's."""
    programs, dispatches = runtime_programs
    moving = [step.transfer for step in lowered.steps if step.transfer is not None]
    return dataclasses.replace(
        stats,
        # (joined steps run their buckets' rounds together: `_joined`)
        rounds=sum(len(t.slots) for t in moving),
        buckets=len(moving),
        bytes_wire=stats.bytes_wire + whole_wire_bytes(lowered),
        staging_bytes=max(staging(lowered).values(), default=0),
        programs=len(lowered.programs()) + programs,
        dispatches=lowered.dispatches() + dispatches,
        host_syncs=host_syncs,
    )
