"""From sent pieces to collective-permute rounds and bounded buckets.

Pure Python on integer device ids. Every (sender, receiver) pair's pieces are laid end to end in
one byte stream, cut into chunks of one uniform size, and the chunks are coloured into rounds:
in a round each device sends at most one chunk and receives at most one, which is exactly what
one `jax.lax.ppermute` (a partial permutation) can carry. Bipartite edge colouring needs only as
many rounds as the busiest device's chunk count (Konig), which is optimal. Consecutive rounds
form a bucket: one staging buffer per device per direction, at most ``bucket_bytes`` each.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import itertools
import math
import operator
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from jaxreshard.planning.layout import (
    Box,
    box_shape,
    box_size,
    split_flat_sized,
    strides,
)
from jaxreshard.planning.route import (
    Assignment,
    Fan,
    LeafSpec,
    LocalCopy,
    Piece,
    Sent,
    each_piece,
    gc_paused,
)

ALIGN = 16
"""Chunk sizes are multiples of the widest element (complex128), so no chunk cuts an element."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """A box of one leaf, laid at ``offset`` bytes into a chunk.

    ``box`` is global. The sender reads its source shard, or its destination shard when
    ``from_dst`` (a relay); the receiver writes its destination shard.
    """

    leaf: int
    box: Box
    offset: int
    nbytes: int
    from_dst: bool = False


@dataclasses.dataclass(frozen=True)
class Message:
    """One chunk: sent by ``src`` to ``dst`` in slot ``slot`` of its bucket."""

    slot: int
    src: int
    dst: int
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A run of rounds executed as one compiled transfer over per-device staging buffers.

    Every participating device holds a send buffer and a receive buffer of ``buffer_bytes``:
    slot ``t`` (``slot_bytes[t]`` bytes at ``slot_offset(t)``) carries the chunk of round ``t``.
    Rounds of full chunks all have the plan's chunk size; the tails of streams travel in
    rounds sized to their largest tail, so padding stays small.
    """

    slot_bytes: tuple[int, ...]
    messages: tuple[Message, ...]
    unit: int = 0

    @property
    def slots(self) -> int:
        return len(self.slot_bytes)

    @property
    def buffer_bytes(self) -> int:
        return sum(self.slot_bytes)

    def slot_offset(self, slot: int) -> int:
        return sum(self.slot_bytes[:slot])

    def perms(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """For each slot, the (sender, receiver) device-id pairs of its permutation."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.slots)]
        for m in self.messages:
            out[m.slot].append((m.src, m.dst))
        return tuple(tuple(sorted(p)) for p in out)

    def sends(self, device: int) -> tuple[Message, ...]:
        return tuple(m for m in self.messages if m.src == device)

    def packed_slots(self) -> list[int]:
        """Per message, the slot whose buffer its sender sends it from: its own, or that of
        the first message its sender sends alike in this bucket (the same segments in a slot
        of the same size), which it packs once (`lower.Step.shared`)."""
        first: dict[tuple[object, ...], int] = {}
        return [
            first.setdefault((m.src, self.slot_bytes[m.slot], m.segments), m.slot)
            for m in self.messages
        ]

    def recvs(self, device: int) -> tuple[Message, ...]:
        return tuple(m for m in self.messages if m.dst == device)


@dataclasses.dataclass(frozen=True)
class Unit:
    """Leaves scheduled together, apart from the others: a run of consecutive leaves, or one
    slab of a leaf too large for a bucket.

    Units are what makes compiled programs reusable: two units with the same leaf shapes,
    layouts and dtypes get the same rounds and message layouts, so the executor runs them with
    the same programs (a model's repeated layers compile once, however many there are).

    Attributes:
      leaves: the leaves whose bytes (or a slab of them) the unit moves, in tree order.
      local: the local copies done with the unit (a slab unit: only its leaf's first slab).
      listed: what the unit sends that is listed one by one (every stage): pieces, and
        relays to several receivers each (`Fan`).
      fresh: the leaves whose destination arrays the unit's first step creates when the
        caller donates none (all of ``leaves``; for a leaf cut into slabs, its first slab).
      overlap: whether the unit runs several stages that depend on nothing of each other (a
        pipelined plan: its later stages forward bytes that arrived in earlier units), so all
        run in the same buckets.
      slabs: slabs of large leaves the unit also sends, cut from their leaf's pieces only
        when asked (`Slab`): on large clusters a leaf has hundreds of thousands of pieces and
        tens of slabs, too many to hold cut.
      parts: where known, what ``listed`` is made of: ``(leaf, stage)`` for every piece of
        that leaf of that stage (None: of every stage), in order; `PreparedPlan.streams`
        sums its streams from them. Not compared: it restates ``listed``.
    """

    leaves: tuple[int, ...]
    local: tuple[LocalCopy, ...]
    listed: tuple[Sent, ...]
    fresh: tuple[int, ...]
    overlap: bool = False
    slabs: tuple[Slab, ...] = ()
    parts: tuple[tuple[int, int | None], ...] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """Everything the unit sends as pieces: ``listed`` (fans expanded), then each slab's
        pieces (cut anew on every access; hold on to the result rather than asking twice)."""
        return (*each_piece(self.listed), *(p for slab in self.slabs for p in slab.pieces()))

    def stream_bytes(self, leaves: Sequence[LeafSpec]) -> dict[tuple[int, tuple[int, int]], int]:
        """Bytes of each ``(stage, (sender, receiver))`` stream, without cutting the slabs
        (a fresh dict)."""
        if not self.listed and len(self.slabs) == 1:  # most large units: one slab, as it is
            return self.slabs[0].stream_bytes()
        return _add_slabs(_stream_bytes(leaves, self.listed), self.slabs)


def _add_slabs(
    sizes: dict[tuple[int, tuple[int, int]], int], slabs: Iterable[Slab]
) -> dict[tuple[int, tuple[int, int]], int]:
    """``sizes`` (a unit's listed streams) with the bytes ``slabs`` put on each stream added."""
    for slab in slabs:
        for key, n in slab.stream_bytes().items():
            sizes[key] = sizes.get(key, 0) + n
    return sizes


@dataclasses.dataclass(frozen=True)
class Slab:
    """Slab ``j`` of a leaf's pieces cut into slabs (`SlabCut`), of stage ``stage`` only, or of
    every stage (None). A pipelined plan runs each stage ``s`` of a slab ``s`` units later."""

    cut: SlabCut
    j: int
    stage: int | None = None

    def pieces(self) -> list[Piece]:
        return self.cut.pieces(self.j, self.stage)

    def stream_bytes(self) -> dict[tuple[int, tuple[int, int]], int]:
        return self.cut.stream_bytes(self.j, self.stage)

    def stages(self) -> list[int]:
        """The stages this slab sends bytes of, in order."""
        return self.cut.stages(self.j, self.stage)

    def __bool__(self) -> bool:
        return bool(self.stages())


@dataclasses.dataclass(frozen=True, eq=False)
class SlabCut:
    """The pieces of one leaf cut into ``k`` slabs along dimension ``dim``, kept uncut.

    Each entry ``(piece, box, whole)`` is cut into ``k`` runs of rows of ``box`` (`_run`), run
    ``j`` in slab ``j`` (a relay may enter several times, once per box its sender received); a
    ``whole`` entry goes uncut into the last slab. An entry's piece may be a `Fan`: its runs
    go to each of its receivers. The bytes every slab puts on each stream
    are computed from per-entry arrays, so the cost model never needs the cut pieces. Pure
    data (plans are fingerprinted); compared by identity, as its entries are many."""

    dim: int
    k: int
    itemsize: int
    entries: tuple[tuple[Sent, Box, bool], ...]

    @functools.cached_property
    def _arrays(self) -> tuple[np.ndarray, ...]:
        """Per entry: rows along ``dim``, bytes per row, whole, stage, and its group (the
        entries of one stage, sender and receivers: a domain's fans to the same others);
        per (group, receiver): the group and the stream index. A slab's bytes are summed
        per group, then handed to the group's streams: at thousands of GPUs a leaf's
        relays are 20,000 entries but 1.4 million (entry, receiver) pairs."""
        _, boxes, wholes = zip(*self.entries, strict=True) if self.entries else ((), (), ())
        group, _, slot_group, slot_stream = self._numbered
        extent = _extents(boxes, len(boxes[0]) if boxes else 0)
        size = extent.prod(axis=1)
        rows = np.maximum(extent[:, self.dim], 1)
        whole = np.fromiter(wholes, bool, len(wholes))
        stage = self._entry_stages
        return rows, size // rows * self.itemsize, whole, stage, group, slot_group, slot_stream

    @functools.cached_property
    def _entry_stages(self) -> np.ndarray:
        """Each entry's stage (its piece's), read once for `_arrays` and `_numbered`."""
        pieces = (p for p, _, _ in self.entries)
        return np.fromiter(map(operator.attrgetter("stage"), pieces), np.int64, len(self.entries))

    @functools.cached_property
    def _numbered(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Each entry's group (see `_arrays`), the groups numbered in the order the entries
        first reach them; each ``(stage, (sender, receiver))`` stream of the entries as a row
        (stage, sender, receiver), in the order the groups' receivers first reach it; per
        (group, receiver), the group and its stream's number.

        Numbered in arrays (`_first_seen`), not in dicts keyed by tuples: at 4,096 GPUs a
        leaf's 50,000 entries are 35,000 groups and 50,000 (group, receiver) pairs, and the
        three large leaves' cuts took 0.35 s to lay out (`_arrays`) that way, 0.27 s so. An
        entry's receivers are one number here: its receiver where it has one, else its fan's
        tuple of receivers, numbered past every device."""
        pieces = [p for p, _, _ in self.entries]
        fanned: dict[tuple[int, ...], int] = {}  # fans' tuples of receivers, numbered
        receiver: list[int] = []  # the receiver, or -1 - the number of the tuple
        for p in pieces:
            if type(p) is not Fan:
                receiver.append(p.dst)
            elif len(p.dsts) == 1:
                receiver.append(p.dsts[0])
            else:
                receiver.append(-1 - fanned.setdefault(p.dsts, len(fanned)))
        stage = self._entry_stages
        src = np.fromiter(map(operator.attrgetter("src"), pieces), np.int64, len(pieces))
        to = np.array(receiver, np.int64)
        m = 1 + max(  # device ids are below m
            int(src.max(initial=0)),
            int(to.max(initial=0)),
            max((max(dsts, default=0) for dsts in fanned), default=0),
        )
        group, first = _first_seen(
            (stage * m + src) * (m + len(fanned)) + np.where(to < 0, m - 1 - to, to)
        )
        # Each group's receivers, groups in order: one slot per (group, receiver).
        tuples = list(fanned)
        lead = to[first].tolist()  # (the receivers of the group's first entry)
        count = np.array([1 if d >= 0 else len(tuples[-1 - d]) for d in lead], np.int64)
        slot_group = np.repeat(np.arange(len(first)), count)
        slot_to = np.fromiter(
            itertools.chain.from_iterable((d,) if d >= 0 else tuples[-1 - d] for d in lead),
            np.int64,
            int(count.sum()),
        )
        slot_stage, slot_src = stage[first][slot_group], src[first][slot_group]
        slot_stream, first_slot = _first_seen((slot_stage * m + slot_src) * m + slot_to)
        ids = np.stack([slot_stage[first_slot], slot_src[first_slot], slot_to[first_slot]], 1)
        return group, ids, slot_group, slot_stream

    @functools.cached_property
    def _streams(self) -> dict[tuple[int, tuple[int, int]], int]:
        """Each ``(stage, (sender, receiver))`` stream of the entries, numbered."""
        return {(st, (s, d)): i for i, (st, s, d) in enumerate(self.stream_ids.tolist())}

    @property
    def stream_ids(self) -> np.ndarray:
        """Each stream of `_streams` as a row (stage, sender, receiver), in index order."""
        return self._numbered[1]

    def _rows(self, j: int, stage: int | None) -> np.ndarray:
        """Rows of every entry in slab ``j`` (0 for entries of other stages)."""
        all_rows, _, whole, stages, *_ = self._arrays
        rows = all_rows // self.k + (j < all_rows % self.k)
        rows = np.where(whole, all_rows if j == self.k - 1 else 0, rows)
        if stage is not None:
            rows = np.where(stages == stage, rows, 0)
        return rows

    def stages(self, j: int, stage: int | None) -> list[int]:
        """The stages slab ``j`` (of stage ``stage``, or all) sends bytes of, in order."""
        # (counted, not sorted: a large leaf's slab has 50,000 entries at 4,096 GPUs)
        return np.flatnonzero(np.bincount(self._arrays[3][self._rows(j, stage) > 0])).tolist()

    def stream_totals(self, j: int, stage: int | None) -> np.ndarray:
        """Bytes slab ``j`` (of stage ``stage``, or all) puts on each stream of `_streams`,
        in index order (float64: exact below 2**53 bytes per stream)."""
        _, row_bytes, _, _, group, slot_group, slot_stream = self._arrays
        # (every group has an entry: the sums cover every group)
        per_group = np.bincount(group, weights=self._rows(j, stage) * row_bytes)
        streams = len(self.stream_ids)
        return np.bincount(slot_stream, weights=per_group[slot_group], minlength=streams)

    def stream_bytes(self, j: int, stage: int | None) -> dict[tuple[int, tuple[int, int]], int]:
        totals = self.stream_totals(j, stage)
        keys = list(self._streams)  # in index order
        return {keys[i]: int(totals[i]) for i in np.flatnonzero(totals)}

    def pieces(self, j: int, stage: int | None) -> list[Piece]:
        out = []
        last = j == self.k - 1
        for piece, box, whole in self.entries:
            if stage is not None and piece.stage != stage:
                continue
            if whole:
                if last:
                    out.extend(each_piece((piece,)))
                continue
            run = _run(box, self.dim, self.k, j)
            if run is None:
                continue
            if type(piece) is Fan:
                out.extend(piece.pieces(run))
            else:  # (the constructor: dataclasses.replace is 3x slower)
                out.append(Piece(piece.leaf, piece.src, piece.dst, run, piece.stage, piece.relay))
        return out


class _StreamKeys:
    """Keys of units' streams that are equal only where `Unit.stream_bytes` is (a key may
    miss equal streams of units built differently; that costs time, never a wrong plan).

    A unit of slabs only (most large units: one slab, or a pipelined unit's two) is keyed by
    each slab's cut's list of streams, interned, and the bytes the slab puts on each: a few
    array bytes instead of a frozenset of up to a million ``(stream, bytes)`` items (hashing
    those took about 8 s of a 4,096-GPU plan). A unit whose listed pieces are known by their
    `Unit.parts` (and that has no slab) by the arrays of `PreparedPlan.streams` (sorted codes
    and bytes: equal exactly where the streams are); any other unit by its streams' arrays
    too, tagged apart: equal exactly where frozensets of their streams would be, and summed
    without a dict (a dict and a frozenset took 0.25 s for the two pipelined units of
    deepseek-v3-4096 that send slabs beside listed pieces). Cuts are held as dict keys
    (compared by identity), so an id is never reused while its key lives."""

    def __init__(self, leaves: Sequence[LeafSpec], prepared: PreparedPlan | None = None) -> None:
        self.leaves = leaves
        self.prepared = prepared
        self.interned: dict[bytes, int] = {}
        self.cut_ids: dict[SlabCut, int] = {}
        self.codes_of: dict[SlabCut, tuple[np.ndarray, np.ndarray]] = {}

    def of(self, unit: Unit) -> tuple[object, dict[tuple[int, tuple[int, int]], int] | None]:
        """The unit's key, and its `Unit.stream_bytes` where keying it summed them, else None:
        with ``prepared``, the key `codes` gives; without, a unit with listed pieces (or
        without slabs) is keyed by a frozenset of its streams."""
        if self.prepared is not None:
            return self.codes(unit)[0], None
        if unit.listed or not unit.slabs:
            streams = unit.stream_bytes(self.leaves)
            return frozenset(streams.items()), streams
        return self._slab_key(_slab_totals(unit)), None

    def codes(self, unit: Unit) -> tuple[object, np.ndarray, np.ndarray]:
        """The unit's key and its streams as `PreparedPlan` codes and bytes (needs
        ``prepared``)."""
        prepared = self.prepared
        assert prepared is not None, "stream codes are numbered over a prepared plan's devices"
        if unit.listed and unit.parts is not None:
            codes, sizes = prepared.streams(unit.parts)
            if not unit.slabs:
                return _parts_key(codes, sizes), codes, sizes
            codes, sizes = self._streams_of(_slab_totals(unit), codes, sizes)
        elif unit.listed or not unit.slabs:
            codes, sizes = _encoded(unit.stream_bytes(self.leaves), prepared.n)
        else:
            slabs = _slab_totals(unit)
            return self._slab_key(slabs), *self._streams_of(slabs)
        return ("streams", codes.tobytes(), sizes.tobytes()), codes, sizes

    def _streams_of(
        self,
        slabs: Sequence[tuple[SlabCut, np.ndarray]],
        codes: np.ndarray | None = None,
        sizes: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The streams that ``slabs`` (and listed pieces' ``codes`` and ``sizes``, if given)
        put bytes on, as sorted codes and bytes (`_summed`). Each cut's codes come sorted
        (`_cut_codes`), so the stable sort of their concatenation merges sorted runs."""
        all_codes, all_sizes = [] if codes is None else [codes], [] if sizes is None else [sizes]
        for cut, totals in slabs:
            cut_codes, order = self._cut_codes(cut)
            totals = totals[order].astype(np.int64)
            keep = totals > 0
            all_codes.append(cut_codes[keep])
            all_sizes.append(totals[keep])
        return _summed(np.concatenate(all_codes), np.concatenate(all_sizes))

    def _slab_key(self, slabs: Sequence[tuple[SlabCut, np.ndarray]]) -> tuple[object, ...]:
        """The key of a unit of slabs only, from each slab's cut and stream totals: equal
        slabs put equal bytes on equal streams, so their sums are equal too."""
        return tuple((self._cut_id(cut), totals.tobytes()) for cut, totals in slabs)

    def _cut_codes(self, cut: SlabCut) -> tuple[np.ndarray, np.ndarray]:
        """The codes of ``cut``'s streams, sorted, and the order of its streams they are in."""
        if cut not in self.codes_of:
            n = self.prepared.n  # type: ignore[union-attr]
            stage, src, dst = cut.stream_ids.T
            codes = (stage * n + src) * n + dst
            order = np.argsort(codes, kind="stable")
            self.codes_of[cut] = codes[order], order
        return self.codes_of[cut]

    def _cut_id(self, cut: SlabCut) -> int:
        """``cut``'s list of streams, interned (equal ids: equal lists)."""
        if cut not in self.cut_ids:
            ids = cut.stream_ids.tobytes()
            self.cut_ids[cut] = self.interned.setdefault(ids, len(self.interned))
        return self.cut_ids[cut]


def _first_seen(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``values`` numbered 0, 1, ... in the order each first occurs: each value's number,
    and where each number first occurs."""
    unique, first, inverse = np.unique(values, return_index=True, return_inverse=True)
    order = np.argsort(first)  # (the first occurrences differ: no ties)
    number = np.empty(len(unique), np.int64)
    number[order] = np.arange(len(unique))
    return number[inverse.reshape(-1)], first[order]


def _slab_totals(unit: Unit) -> list[tuple[SlabCut, np.ndarray]]:
    """Each slab of ``unit`` as its cut and the bytes it puts on each of the cut's streams."""
    return [(slab.cut, slab.cut.stream_totals(slab.j, slab.stage)) for slab in unit.slabs]


def _parts_key(codes: np.ndarray, sizes: np.ndarray) -> tuple[object, ...]:
    """The key of a unit whose streams are known by its parts (`PreparedPlan.streams`)."""
    return ("parts", codes.tobytes(), sizes.tobytes())


def _codes(keys: Collection[tuple[int, tuple[int, int]]], n: int) -> np.ndarray:
    """``(stage, (sender, receiver))`` stream keys as `PreparedPlan`'s codes over ``n``
    device ids, in order."""
    return np.fromiter(((st * n + s) * n + d for st, (s, d) in keys), np.int64, len(keys))


def _encoded(
    streams: Mapping[tuple[int, tuple[int, int]], int], n: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(stage, (sender, receiver)) -> bytes`` as sorted codes over ``n`` device ids and the
    bytes of each (`PreparedPlan.streams`' form)."""
    return _summed(_codes(streams, n), np.fromiter(streams.values(), np.int64, len(streams)))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """All buckets in execution order (relay stages after the stages they forward from).

    ``units`` lists the plan's units; ``buckets[i].unit`` is the unit bucket ``i`` belongs to
    (a unit's buckets are consecutive). Schedules built for one set of pieces alone
    (`build_schedule`) have no units.
    """

    chunk_bytes: int
    buckets: tuple[Bucket, ...]
    units: tuple[Unit, ...] = ()

    @property
    def rounds(self) -> int:
        return sum(b.slots for b in self.buckets)

    def rounds_by_bucket(self) -> Iterator[tuple[tuple[int, tuple[tuple[int, int], ...]], ...]]:
        """Per bucket, its rounds as ``(slot_bytes, ((sender, receiver), ...))``."""
        for b in self.buckets:
            yield tuple(zip(b.slot_bytes, b.perms(), strict=True))

    def round_sizes_by_bucket(self) -> Iterator[list[tuple[int, int]]]:
        """Per bucket, ``(slot_bytes, messages)`` of each of its rounds."""
        for b in self.buckets:
            count = Counter(m.slot for m in b.messages)
            yield [(size, count[slot]) for slot, size in enumerate(b.slot_bytes)]


ALL_STAGES = -1
"""The stage label of rounds that colour every stage of a pipelined unit as one
(`_plan_code_rounds`): each pair's stream is then its pieces of all stages end to end."""

Entry = tuple[tuple[int, int], int]
"""``((sender, receiver), k)``: chunk ``k`` of that pair's stream (of one stage)."""

RELAY_CLASS = 1 << 8
"""Added to the slowest link class to make the chunk class of its relays' streams (stage 1
and later) where they take a chunk size of their own (`_split_relays`). Link classes stay
below it; a chunk class's link is ``chunk_class % RELAY_CLASS``."""


def _chunk_classes(classes: np.ndarray, relay: np.ndarray, chunks: Mapping[int, int]) -> np.ndarray:
    """The chunk class of each stream: its link class, or for a stream ``relay`` marks on the
    slowest links, that class plus `RELAY_CLASS` where ``chunks`` has a chunk for it."""
    relayed = [c for c in chunks if c >= RELAY_CLASS]
    if not relayed:
        return classes
    (key,) = relayed
    return np.where(relay & (classes == key - RELAY_CLASS), key, classes)


Round = tuple[int, tuple[Entry, ...]]
"""``(slot_bytes, entries)``: one collective-permute round."""


@dataclasses.dataclass(frozen=True)
class PlannedBucket:
    """The rounds of one bucket of stage ``stage``, before message contents are cut.

    ``stages`` gives each round's stage where a bucket mixes two (a pipelined unit: its
    relays forward bytes that arrived in earlier units, so they share buckets with its own
    first stage); empty when every round is of ``stage``. ``unit`` is the plan unit the
    bucket belongs to (`plan_unit_rounds`).
    """

    stage: int
    rounds: tuple[Round, ...]
    stages: tuple[int, ...] = ()
    unit: int = 0

    def stage_of(self, r: int) -> int:
        """The stage of round ``r``."""
        return self.stages[r] if self.stages else self.stage


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """A schedule's rounds without the contents of its messages: who sends which chunk of
    which stream to whom in which round, and each round's size.

    `build_schedule` makes one (`plan_rounds`) and then cuts the pieces into the messages'
    segments; the cost model needs only this, which stays cheap at any cluster size.

    Attributes:
      chunk_bytes: the largest full-chunk size.
      class_chunk_bytes: ``(link_class, chunk_bytes)`` per link class when planned with link
        classes; empty otherwise.
      buckets: in execution order.
    """

    chunk_bytes: int
    class_chunk_bytes: tuple[tuple[int, int], ...]
    buckets: tuple[PlannedBucket, ...]

    @property
    def rounds(self) -> int:
        return sum(len(b.rounds) for b in self.buckets)

    def rounds_by_bucket(self) -> Iterator[tuple[tuple[int, tuple[tuple[int, int], ...]], ...]]:
        """Per bucket, its rounds as ``(slot_bytes, ((sender, receiver), ...))``."""
        for b in self.buckets:
            yield tuple((size, tuple(sorted(p for p, _ in e))) for size, e in b.rounds)

    def round_sizes_by_bucket(self) -> Iterator[list[tuple[int, int]]]:
        """Per bucket, ``(slot_bytes, messages)`` of each of its rounds (no sorting: stats
        of plans with millions of entries need only the counts)."""
        for b in self.buckets:
            yield [(size, len(entries)) for size, entries in b.rounds]


@dataclasses.dataclass(frozen=True)
class PlanStats:
    """Byte and round counts of a plan (definitions in the README, all ints).

    Attributes:
      bytes_total: bytes of all destination shards, summed over destination devices.
      bytes_local: the part destination devices already hold and copy on the device.
      bytes_lower_bound: ``bytes_total - bytes_local``; no scheme moves fewer bytes in.
      bytes_sent: payload carried between devices (equals the lower bound).
      bytes_wire: bytes in the collective-permutes, padding included.
      rounds: collective-permute steps.
      buckets: compiled transfer calls (each bounded by ``bucket_bytes`` per buffer).
      chunk_bytes: the size of a full chunk; the tails of streams travel in smaller rounds.
      max_device_send_bytes: payload of the busiest sender.
      max_device_recv_bytes: payload of the busiest receiver.
      staging_bytes: largest per-device transient buffer space of one call beyond the
        destination arrays (a send and a receive buffer of the largest bucket).
      bytes_relayed: payload forwarded by destination devices (hierarchical fan-out).
      bytes_cross_domain: payload carried between fast domains (NVLink / NVL72 domains), when
        the plan was made with a topology; 0 otherwise.
      bytes_relayed_cross_domain: the part of ``bytes_relayed`` that crosses domains
        (destination domains forwarding to each other, `route` with ``chain``); it is in
        ``bytes_cross_domain`` too.
      programs: distinct compiled programs a call runs (pack, transfer and unpack; the
        one-off programs that make staging buffers, tables and fresh destinations aside).
      dispatches: program runs per call when the previous result is donated.
      host_syncs: times a call waits for the devices (0: it returns once everything is
        dispatched).
    """

    bytes_total: int
    bytes_local: int
    bytes_lower_bound: int
    bytes_sent: int
    bytes_wire: int
    rounds: int
    buckets: int
    chunk_bytes: int
    max_device_send_bytes: int
    max_device_recv_bytes: int
    staging_bytes: int
    bytes_relayed: int = 0
    bytes_cross_domain: int = 0
    bytes_relayed_cross_domain: int = 0
    programs: int = 0
    dispatches: int = 0
    host_syncs: int = 0


FAULT_COST = 2.0
"""Byte-equivalents a staging buffer costs when the pool must make it afresh, per byte: the page
faults of first touch (about 1 GB/s here, against 2-3 GB/s a collective-permute moves per
device), for the send and the receive buffer."""

GPU_UNIT_BUCKETS = 128
"""On accelerators a unit (`schedule.split_units`: a run of leaves, or a slab of a large leaf)
spans up to this many buckets per device: units run one after another, and every (sender,
receiver) pair costs a unit at least one round, so small units make short streams whose rounds
are mostly latency (a receiver of Kimi-K2's experts takes 256 streams a unit, however large the
unit). Each bucket of a unit is a program of its own (shared by equal units, such as a leaf's
slabs), so larger units trade distinct programs for rounds; a unit's copies stay capped
(`MAX_UNIT_COPIES` per bucket a device fills, `_RunLoad`), on average per program: small leaves
after a large one in a run put their pieces in its last bucket (Llama-3.1-70B: 224 copies in one
program, 96 before). Staging stays one bucket. Chosen in the cluster model (`python -m
jaxreshard.simulate --all`, 2026-12-07), modeled time over the physical bound with 32 buckets
and runs of leaves within one bucket (the rule until then) / 128 / 256 buckets, runs filling
units: DeepSeek-V3 2.41 / 2.29 / 2.29, Qwen3-235B 2.48 / 2.36 / 2.33, Kimi-K2 1.27 / 1.25 /
1.22, Llama-3.1-70B 1.27 / 1.24 / 1.24, 4,096 GPUs 2.76 / 2.45 / 2.36; distinct transfer
programs 314 / 230 / 356 on DeepSeek-V3, 389 / 312 / 452 at 4,096 GPUs, 93 / 141 / 252 on
Kimi-K2: 256 doubles the programs for the last few percent. The pack and unpack programs' copies
grow where a leaf's slabs span more buckets (over the buckets of distinct units, the busiest
device's: Kimi-K2 911 / 4,763 at 32 / 128, NeMo-RL's setup 4,690 / 10,036, DeepSeek-V3 3,118 /
2,901; `simulate --materialize`). No GPU has compiled these programs (README, Limitations). On
CPU a unit is one bucket (compile time dominates there)."""


def platform_options(
    platform: str, bucket_bytes: int, unit_buckets: int | None = None
) -> dict[str, Any]:
    """The `build_plan_schedule` options that depend on the backend (``"cpu"``, ``"gpu"``,
    ``"tpu"``): ``unit_bytes``, ``unit_buckets`` buckets where given (`jaxreshard.plan`'s
    option), else one bucket on CPU and `GPU_UNIT_BUCKETS` buckets elsewhere,
    ``fault_cost``, `FAULT_COST` on CPU only (fresh pages fault there; accelerators' allocators
    reuse device memory), and ``ladder_rungs``, the tails' ladder (`CPU_LADDER_RUNGS`,
    `ACCELERATOR_LADDER_RUNGS`), and ``lone_stretch_as_run`` (`split_units`), on CPU only,
    where each step costs a host sync (the cluster model priced it 3% slower on the 8-GPU
    qwen3-4b scenario), and ``lanes_overlap`` (`_class_chunks`) off CPU. Its criterion
    counts on a bucket's NIC and NVLink rounds running at once, which XLA GPU does not do
    (`Profile.permutes_overlap`); the plans it makes, priced with the rounds in turn, were as
    fast or faster at every bucket size tried (32 MiB-512 MiB, DeepSeek-V3 and Qwen3-235B on
    GB200; 1,821 against 2,520 ms at 32 MiB), since lanes that share buckets make fewer
    buckets (host work, launches). `jaxreshard.plan` and the cluster model both take them
    from here."""
    cpu = platform == "cpu"
    if unit_buckets is None:
        unit_buckets = 1 if cpu else GPU_UNIT_BUCKETS
    return {
        "unit_bytes": int(unit_buckets) * bucket_bytes,
        "fault_cost": FAULT_COST if cpu else 0.0,
        "ladder_rungs": CPU_LADDER_RUNGS if cpu else ACCELERATOR_LADDER_RUNGS,
        "lone_stretch_as_run": cpu,
        "lanes_overlap": not cpu,
    }


CPU_LADDER_RUNGS = 1
"""Rungs per halving of the tails' ladder on CPU (`tail_ladder`): halves only, so a plan has
few staging shapes (a fresh shape page-faults on first touch there)."""

ACCELERATOR_LADDER_RUNGS = 2
"""The same on accelerators: halves and the three quarters between them, so a tail is padded
at most 1.5x instead of 2x, for twice the staging shapes (an accelerator's allocator makes a
buffer without touching its pages). Tails are where layouts leave uneven bytes: Kimi-K2's
FP8 refit in the cluster model (1,605 -> 1,575 ms), Llama-3.1-70B (441 -> 434 ms)."""


MAX_UNIT_COPIES = 24
"""Most pieces one device sends, or receives, in one unit. A unit's pack and unpack programs hold
one copy per piece, and XLA compiles each copy on its own (about 20 ms each on this project's
CPU), so a unit's first call costs about 40 ms per piece of its busiest device. Capping it keeps
each program small; repeated units (a model's layers) share their programs, so the first call
stays flat in the number of layers, at the price of more, smaller buckets for models whose layers
are tiny."""

MAX_REPEAT_COPIES = 64
"""The same limit for the units of a repeated stretch (`_period`): they all share one program,
so its compile time is paid once for the whole stretch while each unit saves a step (three
program launches and a host sync) on every call."""

GATHER_BYTES = 16 * 1024
"""Leaves whose source and destination shards are at most this many bytes (at the destination
dtype) move by gathers: a pack program reads all of its pieces of such leaves with one gather
over their words, and an unpack program rebuilds each such destination shard with one gather,
where each piece would otherwise be a copy of its own. XLA compiles a program's copies one by
one (about 13 ms each on this project's CPU), so a bias cut into 8 pieces cost 8 copies to
each side and capped a unit at a handful of such leaves (`MAX_UNIT_COPIES` counts pieces);
gathered, a leaf counts once per device, and a program pays one operand or one output for it.
The price is a table of 4-byte word indices for every gathered word, built on the first call
and kept on the devices (as large as the gathered bytes for 32-bit dtypes, 4x for 8-bit ones),
which this bound keeps small."""


def gathered(leaf: LeafSpec, gather_bytes: int | None = None) -> bool:
    """Whether ``leaf`` moves by gathers (`GATHER_BYTES`, or ``gather_bytes`` when given)."""
    limit = GATHER_BYTES if gather_bytes is None else gather_bytes
    elements = max(math.prod(leaf.src.shard_shape), math.prod(leaf.dst.shard_shape))
    return elements * leaf.itemsize <= limit


def split_units(
    leaves: Sequence[LeafSpec],
    assignment: Assignment,
    *,
    bucket_bytes: int,
    max_copies: int = MAX_UNIT_COPIES,
    max_repeat_copies: int = MAX_REPEAT_COPIES,
    slab_bytes: int | None = None,
    pipeline: bool = False,
    unit_bytes: int | None = None,
    prepared: PreparedPlan | None = None,
    gather_bytes: int | None = None,
    lone_stretch_as_run: bool = False,
) -> tuple[Unit, ...]:
    """Cut the plan into units: runs of consecutive leaves whose bytes fit one unit
    (``unit_bytes``: one bucket on CPU, `GPU_UNIT_BUCKETS` on accelerators).

    A unit never takes some device's sending or receiving past ``unit_bytes``, never gives a
    device more than ``max_copies`` pieces to send or receive (`MAX_UNIT_COPIES`) for each
    bucket its bytes fill (`_RunLoad`), and never mixes meshes (programs run per mesh). A leaf that
    moves by gathers (`gathered`, with ``gather_bytes``) counts one copy per device it touches,
    whatever its pieces.

    *Repeats.* A model's layers make the tree periodic: the same leaf shapes, layouts and
    dtypes every ``p`` leaves. `_period` finds the longest such stretch; inside it units hold
    whole periods (as many as fit, up to ``max_repeat_copies`` pieces per device, and a number
    that divides the repeats where one is close), or, when one period does not fit, every
    period is cut the same way. Equal units lower to equal programs, so the programs, and
    the first call's compile time, do not grow with the number of layers. With
    ``lone_stretch_as_run`` (CPU, `platform_options`), a stretch that fits one unit of
    ``max_copies`` repeats nothing and is cut with the other leaves (a small model then moves
    in one step, not two: a host sync and three launches fewer). Outside the
    stretch leaves are cut greedily in tree order, the leaves of each (source mesh,
    destination mesh) pair apart from the others: a tree whose leaves alternate between
    meshes would otherwise make a unit, and a step (three launches and a host sync), per leaf.

    *Large leaves.* A leaf that alone exceeds ``unit_bytes`` (default: one bucket) for some
    device, or (outside repeated stretches) has a piece larger than ``slab_bytes``, is cut into
    ``K`` slabs (`_slabs`: runs of rows of one dimension of the array, every piece cut at the
    same rows), slab ``k`` in unit ``k``, so each slab is balanced over the devices like the
    whole leaf. The slabs share one program (their boxes differ only in where they start),
    where cutting the leaf's pieces into many chunks inside one unit would give every cut a
    copy of its own to compile. A slab's relays (stage 1) follow it in its unit. A unit larger
    than a bucket runs in several buckets: on large clusters that keeps every pair's stream,
    and so every message, long (a round costs a latency whatever it carries).

    *Pipelining* (``pipeline=True``). The relay stages of a unit then run under the next
    units' first stages: every unit's stage-``s`` pieces move ``s`` units later (units past
    the last take the final ones), into units marked ``overlap``. Their relays forward only
    bytes that arrived in an earlier unit, so they share its buckets: inside a bucket one
    round crosses domains over the NICs while another relays over NVLink (`plan_rounds` with
    ``interleave``).

    ``prepared`` (`PreparedPlan`) keeps what does not depend on the options between calls on
    the same assignment (`plan_unit_rounds` cuts twice, the second time with ``slab_bytes``).
    """
    unit_bytes = bucket_bytes if unit_bytes is None else max(unit_bytes, bucket_bytes)
    if prepared is None:
        prepared = PreparedPlan(leaves, assignment, gather_bytes)
    pieces_of, local_of, loads = prepared.pieces_of, prepared.local_of, prepared.loads
    signatures = prepared.signatures

    def cut(indices: Iterable[int]) -> list[tuple[str, list[int], int]]:
        """Greedy parts of ``indices``: ("run", leaves, 0) or ("slab", [leaf], k), the leaves
        of each mesh pair in turn (in the order the pairs first appear)."""
        parts: list[tuple[str, list[int], int]] = []
        run: list[int] = []
        load = _RunLoad(loads, bucket_bytes, max_copies, unit_bytes)  # (the run's)
        groups: dict[tuple[object, object], list[int]] = {}
        for index in indices:
            groups.setdefault(_meshes(leaves[index]), []).append(index)
        for index in itertools.chain.from_iterable(groups.values()):
            out, into, _, _ = loads[index]
            largest = max([*out.values(), *into.values(), 0])
            k = -(-largest // unit_bytes)
            if slab_bytes:
                widest = prepared.widest(index)
                k = max(k, -(-widest // slab_bytes) if widest > 2 * slab_bytes else 1)
            if not leaves[index].shape:  # a scalar has no rows to cut, whatever the bucket
                k = 1
            if k > 1:
                if run:
                    parts.append(("run", run, 0))
                    run = []
                    load.clear()
                parts.append(("slab", [index], k))
                continue
            fits = _meshes(leaves[run[0]]) == _meshes(leaves[index]) if run else True
            if run and not (fits and load.fits(index)):
                parts.append(("run", run, 0))
                run = []
                load.clear()
            run.append(index)  # (alone, a leaf with too many pieces is a unit of its own)
            load.add(index)
        if run:
            parts.append(("run", run, 0))
        return parts

    parts: list[tuple[str, list[int], int]] = []
    start, stretch = 0, _period(signatures)
    if lone_stretch_as_run and stretch is not None:
        a, p, m = stretch
        if _fits(range(a, a + p * m), loads, bucket_bytes, max_copies):
            stretch = None  # one ordinary unit holds it all: nothing repeats (see above)
    if stretch is not None:
        a, p, m = stretch
        parts += cut(range(0, a))
        whole = 0  # how many periods fit one unit
        while (
            whole < m
            and _fits(range(a, a + (whole + 1) * p), loads, bucket_bytes, max_repeat_copies)
            and len({_meshes(leaves[i]) for i in range(a, a + (whole + 1) * p)}) == 1
        ):
            whole += 1
        # As many whole periods as divide the repeats (a last, shorter unit would be one more
        # program to compile), unless that would more than double the steps.
        divisors = [k for k in range(1, whole + 1) if m % k == 0]
        if divisors and 2 * divisors[-1] >= whole:
            whole = divisors[-1]
        if whole:
            for j in range(0, m, whole):
                parts.append(("run", list(range(a + j * p, a + min(j + whole, m) * p)), 0))
        else:  # one period is too large: cut the first, and every other one alike
            pattern = cut(range(a, a + p))
            for j in range(m):
                parts += [(kind, [i + j * p for i in idx], k) for kind, idx, k in pattern]
        start = a + m * p
    parts += cut(range(start, len(leaves)))
    units: list[Unit] = []
    for kind, indices, k in parts:
        if kind == "slab":
            units.extend(prepared.slabs(indices[0], k))
        else:
            units.append(_unit(indices, pieces_of, local_of))
    return tuple(_pipelined(units) if pipeline else units)


class PreparedPlan:
    """An assignment's pieces and local copies grouped by leaf, each leaf's load, signature and
    stream columns, and the slabs cut so far: what `split_units` needs whatever its options.

    A leaf's *stream columns* are two arrays over its pieces (a fan's, one per receiver): each
    piece's stream as one integer,
    ``(stage * n + sender) * n + receiver`` over ``n`` device ids, and its bytes. Units made of
    whole leaves, or of one stage of them (`Unit.parts`), sum their streams from these
    (`streams`) instead of walking their pieces again: at thousands of GPUs a unit lists up to
    a million relays, and every plan is cut twice."""

    def __init__(
        self, leaves: Sequence[LeafSpec], assignment: Assignment, gather_bytes: int | None = None
    ) -> None:
        self.leaves = leaves
        self.pieces_of: dict[int, list[Sent]] = defaultdict(list)
        self.local_of: dict[int, list[LocalCopy]] = defaultdict(list)
        self.n = 1 + max(
            (max(layout.devices) for leaf in leaves for layout in (leaf.src, leaf.dst)), default=0
        )
        n, itemsize = self.n, [leaf.itemsize for leaf in leaves]
        codes: dict[int, list[int]] = defaultdict(list)
        sizes: dict[int, list[int]] = defaultdict(list)
        for p in assignment.sent:  # one pass: hundreds of thousands of pieces at scale
            i = p.leaf
            self.pieces_of[i].append(p)
            k = itemsize[i]
            for start, stop in p.box:  # (`box_size`, inlined)
                k *= stop - start
            sizes[i].append(k)
            codes[i].append((p.stage * n + p.src) * n + p.dst)
        # A fan's streams, one per receiver, are made as arrays: (sender, bytes) repeated
        # over its receivers (1.4 million at 4,096 GPUs).
        fans: dict[int, tuple[list[int], list[int], list[tuple[int, ...]]]] = defaultdict(
            lambda: ([], [], [])
        )
        for f in assignment.fans:
            i = f.leaf
            self.pieces_of[i].append(f)
            k = itemsize[i]
            for start, stop in f.box:
                k *= stop - start
            base, nbytes, dsts = fans[i]
            base.append((f.stage * n + f.src) * n)
            nbytes.append(k)
            dsts.append(f.dsts)
        for c in assignment.local:
            self.local_of[c.leaf].append(c)
        self.columns = []
        for i in range(len(leaves)):
            code, size = np.array(codes.get(i, ()), np.int64), np.array(sizes.get(i, ()), np.int64)
            if i in fans:
                base, nbytes, dsts = fans[i]
                times = np.fromiter(map(len, dsts), np.int64, len(dsts))
                to = np.fromiter(itertools.chain.from_iterable(dsts), np.int64, int(times.sum()))
                code = np.concatenate([code, np.repeat(np.array(base, np.int64), times) + to])
                size = np.concatenate([size, np.repeat(np.array(nbytes, np.int64), times)])
            self.columns.append((code, size))
        self.loads = [
            _load(leaf, self.columns[i], n, gathered(leaf, gather_bytes), self.local_of.get(i, ()))
            for i, leaf in enumerate(leaves)
        ]
        ids: dict[tuple[object, ...], int] = {}
        self.signatures = [ids.setdefault(_signature(leaf), len(ids)) for leaf in leaves]
        self._slabs: dict[tuple[int, int], list[Unit]] = {}
        self._streams: dict[tuple[tuple[int, int | None], ...], tuple[np.ndarray, np.ndarray]] = {}

    def widest(self, index: int) -> int:
        """The bytes of leaf ``index``'s largest piece (0 without pieces)."""
        sizes = self.columns[index][1]
        return int(sizes.max()) if len(sizes) else 0

    def streams(self, parts: Iterable[tuple[int, int | None]]) -> tuple[np.ndarray, np.ndarray]:
        """The streams of ``parts`` (leaf, stage or None for all) as sorted codes (see the
        class) and the bytes each carries (made once for each ``parts``: both cuts of
        `plan_unit_rounds` ask for most units; the arrays are shared, not to be changed)."""
        parts = tuple(parts)
        if parts not in self._streams:
            self._streams[parts] = self._summed_streams(parts)
        return self._streams[parts]

    def _summed_streams(
        self, parts: Sequence[tuple[int, int | None]]
    ) -> tuple[np.ndarray, np.ndarray]:
        codes, sizes = [], []
        for leaf, stage in parts:
            c, s = self.columns[leaf]
            if stage is not None:
                keep = c // (self.n * self.n) == stage
                c, s = c[keep], s[keep]
            codes.append(c)
            sizes.append(s)
        if not codes or not sum(len(c) for c in codes):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return _summed(np.concatenate(codes), np.concatenate(sizes))

    def stream_bytes(
        self, codes: np.ndarray, sizes: np.ndarray
    ) -> dict[tuple[int, tuple[int, int]], int]:
        """`streams`' arrays as `Unit.stream_bytes` gives them (a fresh dict)."""
        n = self.n
        stage, pair = np.divmod(codes, n * n)
        src, dst = np.divmod(pair, n)
        keys = zip(stage.tolist(), zip(src.tolist(), dst.tolist(), strict=True), strict=True)
        return dict(zip(keys, sizes.tolist(), strict=True))

    def slabs(self, index: int, k: int) -> list[Unit]:
        """The units of leaf ``index`` cut into ``k`` slabs (`_slabs`), cut once."""
        key = (index, k)
        if key not in self._slabs:
            self._slabs[key] = _slabs(
                index, k, self.leaves[index].itemsize, self.pieces_of, self.local_of
            )
        return self._slabs[key]


def _summed(codes: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``codes`` sorted, each once, with the sum of its ``sizes`` (int64: exact)."""
    if not len(codes):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.argsort(codes, kind="stable")
    code, size = codes[order], sizes[order]
    starts = np.flatnonzero(np.concatenate(([True], code[1:] != code[:-1])))
    if len(starts) == len(code):  # each code once (a slab's streams): nothing to add up
        return code, size
    return code[starts], np.add.reduceat(size, starts)


def _pipelined(units: Sequence[Unit]) -> list[Unit]:
    """Move every unit's stage-``s`` pieces ``s`` units later (units past the last take the
    final ones), marking the units that run several stages at once.

    A stage-``s`` relay forwards bytes that arrived in stage ``s - 1`` of its own unit, which
    then ran one unit earlier: whatever a unit runs depends only on earlier units."""
    out: list[Unit] = []
    # Unit index -> the pieces, slabs and leaves that later stages bring into it, and the
    # parts those pieces are (None once a unit without known parts brought some).
    arriving: dict[int, _Arriving] = defaultdict(_Arriving)

    def send_on(i: int, unit: Unit, listed: Mapping[int, list[Sent]]) -> None:
        for stage in sorted(s for s in listed if s > 0):
            into = arriving[i + stage]
            into.pieces.extend(listed[stage])
            into.leaves.update(unit.leaves)
            into.add_parts(unit.parts, stage)
        for slab in unit.slabs:
            for stage in slab.stages():
                if stage > 0:
                    later = arriving[i + stage]
                    later.slabs.append(_staged(slab, stage))
                    later.leaves.update(unit.leaves)

    for i, unit in enumerate(units):
        # The unit's listed pieces by stage, in order, in one pass (10^5 pieces at scale).
        listed: dict[int, list[Sent]] = defaultdict(list)
        for p in unit.listed:
            listed[p.stage].append(p)
        send_on(i, unit, listed)
        own = tuple(listed.get(0, ()))
        own_slabs = tuple(s for s in (_staged(s, 0) for s in unit.slabs) if s)
        now = arriving.pop(i, _Arriving())
        parts = now.parts
        if parts is not None:
            whole = unit.parts is not None and all(s is None for _, s in unit.parts)
            parts = [(leaf, 0) for leaf, _ in unit.parts] + parts if whole else None
        out.append(
            Unit(
                tuple(sorted({*unit.leaves, *now.leaves})),
                unit.local,
                own + tuple(now.pieces),
                unit.fresh,
                _several_stages(own + tuple(now.pieces), own_slabs + tuple(now.slabs)),
                own_slabs + tuple(now.slabs),
                None if parts is None else tuple(parts),
            )
        )
    for i in sorted(arriving):
        now = arriving[i]
        overlap = _several_stages(now.pieces, now.slabs)
        parts = None if now.parts is None else tuple(now.parts)
        out.append(
            Unit(
                tuple(sorted(now.leaves)),
                (),
                tuple(now.pieces),
                (),
                overlap,
                tuple(now.slabs),
                parts,
            )
        )
    return out


class _Arriving:
    """What later stages bring into a unit (`_pipelined`)."""

    def __init__(self) -> None:
        self.pieces: list[Sent] = []
        self.slabs: list[Slab] = []
        self.leaves: set[int] = set()
        self.parts: list[tuple[int, int | None]] | None = []

    def add_parts(self, parts: Sequence[tuple[int, int | None]] | None, stage: int) -> None:
        """The stage-``stage`` pieces of a unit listing ``parts`` arrive."""
        if parts is None or any(s is not None for _, s in parts) or self.parts is None:
            self.parts = None  # only a unit of whole leaves says which of its pieces these are
        else:
            self.parts.extend((leaf, stage) for leaf, _ in parts)


def _several_stages(pieces: Iterable[Sent], slabs: Iterable[Slab]) -> bool:
    """Whether ``pieces`` and ``slabs`` (each restricted to one stage) span several stages."""
    return len({p.stage for p in pieces} | {s.stage for s in slabs}) > 1


def _staged(slab: Slab, stage: int) -> Slab:
    """``slab`` restricted to stage ``stage``."""
    assert slab.stage is None, "a slab is split by stage once"
    return dataclasses.replace(slab, stage=stage)


MAX_PERIOD = 256
"""The longest repeat (in leaves) `_period` looks for: a model layer has well under 256."""


def _period(signatures: Sequence[int]) -> tuple[int, int, int] | None:
    """The longest stretch of whole repeats in a sequence of leaf signatures.

    Returns ``(start, period, repeats)``: ``signatures[start : start + repeats * period]`` is
    ``repeats >= 2`` copies of one block of ``period`` leaves, the stretch covering the most
    leaves (the shortest period among equals); None when nothing repeats.
    """
    n = len(signatures)
    best: tuple[int, int, int, int] | None = None  # (covered, -period, start, repeats)
    for p in range(1, min(MAX_PERIOD, n // 2) + 1):
        i = 0
        while i + p < n:
            if signatures[i] != signatures[i + p]:
                i += 1
                continue
            j = i
            while j + p < n and signatures[j] == signatures[j + p]:
                j += 1
            repeats = (j + p - i) // p  # [i, j + p) has period p
            if repeats >= 2:
                key = (repeats * p, -p, i, repeats)
                if best is None or key[:2] > best[:2]:
                    best = key
            i = j + 1
    if best is None:
        return None
    _, neg_p, start, repeats = best
    return start, -neg_p, repeats


Load = tuple[dict[int, int], dict[int, int], Counter[int], Counter[int]]


def _load(
    leaf: LeafSpec,
    columns: tuple[np.ndarray, np.ndarray],
    n: int,
    by_gather: bool = False,
    local: Sequence[LocalCopy] = (),
) -> Load:
    """Bytes a leaf has each device send and receive, and how many copies that takes: one
    per piece, or one per device for a leaf that moves by gathers (``by_gather``), from the
    leaf's stream columns (`PreparedPlan`) over ``n`` device ids. The ``local`` copies are
    copies of the device's unpack program too (no bytes through staging): counted, a plan
    that copies many leaves locally (source and destination on the same devices) gets units
    of a bounded size, which repeat (a model's layers), instead of one program holding every
    leaf's copies, whose compile time grows faster than its copies (12 s for 290 leaves on an
    H200, against 1 s for 74)."""
    codes, sizes = columns
    pair = codes % (n * n)
    out, sends = _per_device(pair // n, sizes)
    into, recvs = _per_device(pair % n, sizes)
    copies = Counter(c.device for c in local)
    if by_gather:
        return out, into, Counter(out.keys()), Counter(into.keys()) | Counter(copies.keys())
    return out, into, sends, recvs + copies


def _per_device(devices: np.ndarray, sizes: np.ndarray) -> tuple[dict[int, int], Counter[int]]:
    """Bytes and pieces per device of ``devices`` (one entry per piece), in device order.

    Counted by `np.bincount` over the device ids (`np.unique` and `np.add.at`, a sort and a
    slow scatter, took 0.15 s over a 4,096-GPU plan's leaves; this, 0.06 s). Its float64 sums
    are exact: a leaf puts far fewer than 2**53 bytes on a device."""
    counts = np.bincount(devices)
    ids = np.flatnonzero(counts)
    total = np.bincount(devices, weights=sizes)[ids].astype(np.int64)
    keys = ids.tolist()
    return dict(zip(keys, total.tolist(), strict=True)), Counter(
        dict(zip(keys, counts[ids].tolist(), strict=True))
    )


def _fits(
    run: Iterable[int],
    loads: Sequence[Load],
    bucket_bytes: int,
    max_copies: int,
    unit_bytes: int | None = None,
) -> bool:
    """Whether the leaves ``run`` fit one unit (`_RunLoad`)."""
    load = _RunLoad(loads, bucket_bytes, max_copies, unit_bytes)
    for index in run:
        load.add(index)
    return load.within()


class _RunLoad:
    """The bytes and pieces a run of leaves gives each device to send and to receive, kept as
    the run grows. A run fits one unit if no device sends, or receives, more than
    ``unit_bytes`` (default: one bucket), nor more than ``max_copies`` pieces for each bucket
    those bytes fill (at least one), so that the unit's bucket programs hold ``max_copies``
    copies each on average, however many buckets the unit spans (not each: a pair's stream
    lays its pieces end to end, so small leaves after a large one land in its last bucket).
    `fits` asks about one more leaf by its own devices only: on accelerators a run holds
    hundreds of leaves, and asking about the whole run again for each leaf took time
    quadratic in its length."""

    def __init__(
        self,
        loads: Sequence[Load],
        bucket_bytes: int,
        max_copies: int,
        unit_bytes: int | None = None,
    ) -> None:
        self.loads = loads
        self.bucket_bytes = bucket_bytes
        self.max_copies = max_copies
        self.limit = bucket_bytes if unit_bytes is None else max(unit_bytes, bucket_bytes)
        self.clear()

    def clear(self) -> None:
        """Start an empty run."""
        self.over: set[tuple[int, int]] = set()  # (side, device) past the limits
        # Per side (sending, receiving): bytes and pieces per device, and where each sits
        # in a leaf's `Load`.
        self.sides = [
            (defaultdict(int), defaultdict(int), 0, 2),
            (defaultdict(int), defaultdict(int), 1, 3),
        ]

    def _ok(self, nbytes: int, copies: int) -> bool:
        return nbytes <= self.limit and copies <= self.max_copies * max(
            1, -(-nbytes // self.bucket_bytes)
        )

    def fits(self, index: int) -> bool:
        """Whether the run with leaf ``index`` added fits: every device that leaf touches
        within the limits, and no other past them (a leaf with many pieces and few bytes,
        alone past its copy cap, may be brought within it by a leaf of many bytes)."""
        load = self.loads[index]
        touched = 0
        for side, (nbytes, copies, b, c) in enumerate(self.sides):
            more_bytes, more_copies = load[b], load[c]
            for d in more_bytes.keys() | more_copies.keys():
                if not self._ok(
                    nbytes.get(d, 0) + more_bytes.get(d, 0),
                    copies.get(d, 0) + more_copies.get(d, 0),
                ):
                    return False
                touched += (side, d) in self.over
        return touched == len(self.over)

    def add(self, index: int) -> None:
        """Add leaf ``index`` to the run."""
        load = self.loads[index]
        for side, (nbytes, copies, b, c) in enumerate(self.sides):
            for d, n in load[b].items():
                nbytes[d] += n
            for d, n in load[c].items():
                copies[d] += n
            for d in load[b].keys() | load[c].keys():
                if self._ok(nbytes.get(d, 0), copies.get(d, 0)):
                    self.over.discard((side, d))
                else:
                    self.over.add((side, d))

    def within(self) -> bool:
        """Whether the whole run fits."""
        return not self.over


def _signature(leaf: LeafSpec) -> tuple[object, ...]:
    return leaf.src, leaf.dst, leaf.src_dtype, leaf.dst_dtype


def _meshes(leaf: LeafSpec) -> tuple[object, object]:
    return leaf.src.mesh, leaf.dst.mesh


def _unit(
    run: Sequence[int],
    pieces_of: Mapping[int, Sequence[Sent]],
    local_of: Mapping[int, Sequence[LocalCopy]],
) -> Unit:
    return Unit(
        tuple(run),
        tuple(c for i in run for c in local_of.get(i, ())),
        tuple(p for i in run for p in pieces_of.get(i, ())),
        tuple(run),
        parts=tuple((i, None) for i in run),
    )


def _slabs(
    index: int,
    k: int,
    itemsize: int,
    pieces_of: Mapping[int, Sequence[Sent]],
    local_of: Mapping[int, Sequence[LocalCopy]],
) -> list[Unit]:
    """Up to ``k`` units, each moving one slab of every piece of leaf ``index``.

    Every piece is cut into ``k`` near-equal runs of rows of one dimension (`_run`), slab
    ``j`` of every piece in unit ``j``, so each slab is balanced over the devices like the whole
    leaf and the slabs share one program (their boxes differ only in where they start). The
    dimension is the one along which most bytes spread over the slabs (`_slab_dimension`: one
    no layout shards, where there is one). A relay is cut so that
    slab ``j`` forwards exactly what slab ``j`` of the pieces its sender received brought:
    like those pieces where they span the relayed box along the dimension (then their runs
    and the relay's are the same rows), else piece by piece; a relay those pieces do not tile
    stays whole, in the last slab. Later stages of a slab follow its first in its unit.
    The cut itself is made only when a slab's pieces are asked for (`SlabCut`)."""
    pieces = pieces_of[index]
    dim = _slab_dimension(pieces, k)
    k = max(1, min(k, max(p.box[dim][1] - p.box[dim][0] for p in pieces)))
    entries: list[tuple[Sent, Box, bool]] = []
    # What each device can forward, by receiver: entries (box, whole) of stage-0 pieces and
    # of the relays of stages done so far.
    received: dict[int, list[tuple[Box, bool]]] = defaultdict(list)
    relays: dict[int, list[Sent]] = defaultdict(list)
    for p in pieces:
        if p.from_dst:
            relays[p.stage].append(p)
            continue
        if p.stage == 0:
            received[p.dst].append((p.box, False))
        entries.append((p, p.box, False))
    for stage in sorted(relays):  # a relay forwards what arrived in earlier stages
        feeds = _feeds(relays[stage], received, dim)
        forwarded: list[tuple[int, Box, bool]] = []  # kept only for a later stage's relays
        keep = stage < max(relays)
        for r in relays[stage]:
            boxes = feeds[r.src, r.box]
            if boxes is None:
                entries.append((r, r.box, True))
                if keep:
                    forwarded.extend((d, r.box, True) for d in r.dsts)
                continue
            entries.extend((r, box, False) for box in boxes)
            if keep:
                forwarded.extend((d, box, False) for d in r.dsts for box in boxes)
        for dst, box, whole in forwarded:
            received[dst].append((box, whole))
    cut = SlabCut(dim, k, itemsize, tuple(entries))
    local = tuple(local_of.get(index, ()))
    return [
        Unit(
            (index,),
            local if j == 0 else (),
            (),
            (index,) if j == 0 else (),
            slabs=(Slab(cut, j),),
            parts=(),
        )
        for j in range(k)
    ]


def _feeds(
    relays: Sequence[Sent], received: Mapping[int, Sequence[tuple[Box, bool]]], dim: int
) -> dict[tuple[int, Box], tuple[Box, ...] | None]:
    """How `_slabs` cuts each relay's ``(sender, box)``, from the entries ``(box, whole)`` its
    sender received (``received``, by device, in order) whose box lies within the relay's:
    None (the relay goes whole) where one of them is whole or their sizes do not add up to
    the relay's; else the relay's box where they all span it along ``dim``; else their
    boxes, in order.

    Every (relay, box its sender received) pair is tested at once, in arrays: at 4,096 GPUs
    a large leaf's 12,000 relays make 220,000 such pairs, and a bisection by start with a
    test per candidate in Python, then the checks, took 0.1 s a leaf. The sums are float64:
    exact, as a leaf has far fewer than 2**53 elements."""
    keys = list(dict.fromkeys((r.src, r.box) for r in relays))
    if not keys:
        return {}
    rank = len(keys[0][1])
    # What the relaying devices received, end to end, device after device.
    got: list[tuple[Box, bool]] = []
    first: dict[int, int] = {}  # device -> where its entries start in ``got``
    for src, _ in keys:
        if src not in first:
            first[src] = len(got)
            got.extend(received.get(src, ()))
    # Each relay against each entry its sender received: pairs (relay, entry), by relay.
    senders, boxes = zip(*keys, strict=True)
    start = np.array([first[src] for src in senders], np.int64)
    count = np.array([len(received.get(src, ())) for src in senders], np.int64)
    pair_key = np.repeat(np.arange(len(keys)), count)
    pair_got = np.repeat(start - (np.cumsum(count) - count), count) + np.arange(len(pair_key))
    got_boxes, got_whole = zip(*got, strict=True) if got else ((), ())
    outer, inner = _bounds(boxes, rank), _bounds(got_boxes, rank)
    pair_outer, pair_inner = outer[pair_key], inner[pair_got]
    within = (pair_inner[:, :, 0] >= pair_outer[:, :, 0]).all(axis=1)
    within &= (pair_inner[:, :, 1] <= pair_outer[:, :, 1]).all(axis=1)
    pair_key, pair_got = pair_key[within], pair_got[within]
    wholes = np.array(got_whole, bool)
    sizes = (inner[:, :, 1] - inner[:, :, 0]).prod(axis=1)
    # Per relay: none of the entries within is whole, and their sizes add up to its own.
    no_whole = np.bincount(pair_key, wholes[pair_got], len(keys)) == 0
    covered = np.bincount(pair_key, sizes[pair_got], len(keys))
    tiled = no_whole & (covered == (outer[:, :, 1] - outer[:, :, 0]).prod(axis=1))
    # Per relay: every entry within spans it along ``dim``.
    across = (inner[pair_got, dim] != outer[pair_key, dim]).any(axis=1)
    spans = np.bincount(pair_key, across, len(keys)) == 0
    ends = np.cumsum(np.bincount(pair_key, minlength=len(keys))).tolist()
    inside = pair_got.tolist()
    feeds: dict[tuple[int, Box], tuple[Box, ...] | None] = {}
    for k, (key, is_tiled, is_spanned) in enumerate(
        zip(keys, tiled.tolist(), spans.tolist(), strict=True)
    ):
        if not is_tiled:
            feeds[key] = None
        elif is_spanned:
            feeds[key] = (key[1],)
        else:
            feeds[key] = tuple(got_boxes[i] for i in inside[ends[k - 1] if k else 0 : ends[k]])
    return feeds


def _bounds(boxes: Sequence[Box], rank: int) -> np.ndarray:
    """Each box's bounds along each of its ``rank`` dimensions (every box has that rank), as
    one (boxes, rank, 2) array: read in one `np.fromiter` (a large leaf has 10^5 pieces at
    thousands of GPUs: a list of lists made into an array took a third longer, sums over
    them in Python several times as long)."""
    flat = itertools.chain.from_iterable(itertools.chain.from_iterable(boxes))
    return np.fromiter(flat, np.int64, 2 * rank * len(boxes)).reshape(len(boxes), rank, 2)


def _extents(boxes: Sequence[Box], rank: int) -> np.ndarray:
    """Each box's length along each of its ``rank`` dimensions, as one (boxes, rank) array
    (`_bounds`)."""
    bounds = _bounds(boxes, rank)
    return bounds[:, :, 1] - bounds[:, :, 0]


def _run(box: Box, dim: int, k: int, j: int) -> Box | None:
    """Run ``j`` of ``box`` cut into ``k`` near-equal runs of rows of dimension ``dim`` (the
    first ``rows % k`` one row longer); None where the run gets no row."""
    a, b = box[dim]
    rows = b - a
    lo = a + j * (rows // k) + min(j, rows % k)
    hi = lo + rows // k + (j < rows % k)
    return (*box[:dim], (lo, hi), *box[dim + 1 :]) if hi > lo else None


def _slab_dimension(pieces: Sequence[Sent], k: int) -> int:
    """The dimension along which most bytes spread over ``k`` slabs: each piece counts its
    size times the share of the slabs its rows reach (ties: the first dimension; a fan once
    per receiver). A dimension no layout shards gives every piece its full length there."""
    rank = len(pieces[0].box)
    extent = _extents([p.box for p in pieces], rank)
    size = extent.prod(axis=1) * np.array([len(p.dsts) for p in pieces], np.int64)
    if len(size) and int(size.max()) * k * len(size) >= 1 << 62:  # int64 could overflow
        spread = [sum(int(n) * min(int(e), k) for n, e in zip(size, extent[:, i], strict=True))
                  for i in range(rank)]  # fmt: skip
    else:
        spread = (size[:, None] * np.minimum(extent, k)).sum(axis=0).tolist()
    return max(range(rank), key=lambda i: (spread[i], -i))


@gc_paused()
def plan_unit_rounds(
    leaves: Sequence[LeafSpec],
    assignment: Assignment,
    *,
    bucket_bytes: int,
    link_class: Callable[[int, int], int] | None = None,
    class_latency_bytes: Mapping[int, int] | None = None,
    max_copies: int = MAX_UNIT_COPIES,
    pipeline: bool = True,
    unit_bytes: int | None = None,
    fault_cost: float = FAULT_COST,
    gather_bytes: int | None = None,
    ladder_rungs: int = CPU_LADDER_RUNGS,
    lone_stretch_as_run: bool = False,
    lanes_overlap: bool = False,
) -> tuple[tuple[Unit, ...], RoundPlan]:
    """The units and rounds of a whole plan, as `build_plan_schedule` makes them, without
    cutting message contents (the cost model's input at any cluster size).

    `split_units`, then each unit's rounds on their own (`plan_rounds`; a unit marked
    ``overlap`` interleaves its two stages), the buckets in unit order, each labelled with its
    unit. One chunk size per link class serves every unit (chosen over all units' streams by
    `chunk_sizes`), and tails travel in rounds of `ladder_size`: round sizes are the shapes of
    the staging buffers the runtime reuses, so a plan should have few of them. ``pipeline``
    (`split_units`) runs each unit's relays under the next unit's first stage; it changes
    nothing in a plan without relays. ``unit_bytes`` (`split_units`) lets a large leaf's slabs
    span several buckets. ``fault_cost`` is what a fresh staging byte costs the chunk choice
    (`choose_chunk_bytes`). ``gather_bytes`` (`split_units`): which leaves move by gathers.
    ``ladder_rungs``: rungs per halving of the tails' ladder (`tail_ladder`).
    ``lone_stretch_as_run``: see `split_units`. ``lanes_overlap``: the faster links' chunks
    may shrink to fit a bucket beside the slowest's (`_class_chunks`), where a model of the
    two lanes at once says so (accelerators; see `platform_options`).
    """
    prepared = PreparedPlan(leaves, assignment, gather_bytes)  # both cuts below slab alike
    units = split_units(
        leaves,
        assignment,
        bucket_bytes=bucket_bytes,
        max_copies=max_copies,
        unit_bytes=unit_bytes,
        prepared=prepared,
        lone_stretch_as_run=lone_stretch_as_run,
    )
    # Every unit's streams as arrays (`_StreamArrays`: ~10^6 streams at thousands of GPUs),
    # each (unit, stage) a stage of the chunk model, numbered in order. Units with the same
    # streams (a leaf's slabs, repeated layers) count once, weighted by how often they occur;
    # not where a fault cost makes the order of units matter.
    n = prepared.n
    classes_of = _CodeClasses(link_class, n)  # (the plan's pairs' classes, asked once each)
    codes: list[np.ndarray] = []
    nbytes: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    weight: list[int] = []  # per (unit, stage)
    label_stage: list[int] = []  # per (unit, stage): the stage
    first: dict[object, list[int]] = {}  # streams' key -> the stages of the first unit
    chained = False
    keys = _StreamKeys(leaves, prepared)
    for unit in units:
        key, unit_codes, unit_sizes = keys.codes(unit)
        if not fault_cost and key in first:
            for label in first[key]:
                weight[label] += 1
            continue
        stage = unit_codes // (n * n)
        stages, at = np.unique(stage, return_inverse=True)
        first[key] = list(range(len(weight), len(weight) + len(stages)))
        codes.append(unit_codes)
        nbytes.append(unit_sizes)
        labels.append(at.reshape(-1) + len(weight))
        weight.extend([1] * len(stages))
        label_stage.extend(stages.tolist())
        chained = chained or any(st > 1 for st in stages.tolist())
    code = np.concatenate(codes) if codes else np.zeros(0, np.int64)
    src, dst = np.divmod(code % (n * n), n)
    streams = _StreamArrays(
        np.concatenate(labels) if labels else np.zeros(0, np.int64),
        src,
        dst,
        np.concatenate(nbytes) if nbytes else np.zeros(0, np.int64),
        np.arange(len(weight)),
    )
    # Where destination domains forward to each other (relays of stage 2), the slowest links
    # carry two stages of every pipelined unit and the fastest a third: a chunk as large as a
    # bucket would leave each bucket one lane's round, so chunks stay within half a bucket
    # and a bucket holds rounds of both lanes at once (modeled DeepSeek-V3 128 -> 512: 976 ms
    # with whole-bucket chunks, 766 ms with half; the same cap costs plans without stage 2
    # up to 3%, so they keep whole-bucket chunks, unless one does not fit a bucket beside one of
    # the slowest links' and the lanes overlap: `_class_chunks`).
    # Chained, a unit's relays inside domains can outnumber its rounds across them, so the
    # faster links' chunks also leave room for two of theirs beside one of the slowest's: the
    # extra round doubles up there instead of taking a bucket where the slowest links idle
    # (modeled DeepSeek-V3 128 -> 512: 63 MiB NVLink chunks beside 10.6 MiB NIC chunks made
    # 214 buckets of two NVLink rounds and none across, 760 ms; 55.5 MiB ones, 712 ms).
    max_chunk = bucket_bytes // 2 if chained else None
    link = classes_of(code)
    relay = np.array(label_stage, np.int64)[streams.stage] > 0
    relay_chunk = (
        None  # (without link classes every stream takes the one chunk: `_cut_buckets`)
        if link_class is None
        else _split_relays(
            streams,
            np.array(weight, np.int64),
            link,
            relay,
            bucket_bytes=bucket_bytes,
            class_latency_bytes=class_latency_bytes,
            ladder=ladder_rungs,
            fault_cost=fault_cost,
            max_chunk_bytes=max_chunk,
        )
    )
    split = {} if relay_chunk is None else {int(link.max()) + RELAY_CLASS: relay_chunk}
    chunks = _class_chunks(
        streams,
        np.array(weight, np.int64),
        _chunk_classes(link, relay, split),
        bucket_bytes=bucket_bytes,
        latency_bytes=None,
        class_latency_bytes=class_latency_bytes,
        ladder=ladder_rungs,
        fault_cost=fault_cost,
        max_chunk_bytes=max_chunk,
        beside_slowest=2 if chained else 0,
        lanes_overlap=lanes_overlap,
    )
    chunks = dict(sorted({**chunks, **split}.items()))
    # Leaves whose pieces span several chunks go into slabs of about a chunk each (or as many
    # chunks as a unit spans buckets), which share one program, instead of being cut chunk by
    # chunk inside a unit (a copy per cut).
    slabs_per_bucket = max(1, (unit_bytes or bucket_bytes) // bucket_bytes)
    units = split_units(
        leaves,
        assignment,
        bucket_bytes=bucket_bytes,
        max_copies=max_copies,
        slab_bytes=max(chunks.values(), default=bucket_bytes) * slabs_per_bucket,
        pipeline=pipeline,
        unit_bytes=unit_bytes,
        prepared=prepared,
        lone_stretch_as_run=lone_stretch_as_run,
    )
    buckets: list[PlannedBucket] = []
    # The slabs of a leaf put (nearly) the same bytes on the same streams: their rounds are
    # planned once.
    planned: dict[tuple[object, ...], RoundPlan | None] = {}  # None: the unit sends nothing
    colour = _ColourMemo()  # units with other streams still share many colourings
    keys = _StreamKeys(leaves, prepared)
    for u, unit in enumerate(units):
        streams_key, codes_of_unit, bytes_of_unit = keys.codes(unit)
        key = (unit.overlap, streams_key)
        if key not in planned:
            planned[key] = (
                _plan_code_rounds(
                    codes_of_unit,
                    bytes_of_unit,
                    classes_of,
                    bucket_bytes=bucket_bytes,
                    chunks=chunks,
                    interleave=unit.overlap,
                    ladder=ladder_rungs,
                    colour=colour,
                )
                if len(codes_of_unit)
                else None
            )
        if (plan := planned[key]) is not None:
            buckets.extend(dataclasses.replace(b, unit=u) for b in plan.buckets)
    named = () if link_class is None else tuple(sorted(chunks.items()))
    return units, RoundPlan(max(chunks.values(), default=0), named, tuple(buckets))


def build_plan_schedule(
    leaves: Sequence[LeafSpec],
    assignment: Assignment,
    *,
    bucket_bytes: int,
    link_class: Callable[[int, int], int] | None = None,
    class_latency_bytes: Mapping[int, int] | None = None,
    max_copies: int = MAX_UNIT_COPIES,
    pipeline: bool = True,
    unit_bytes: int | None = None,
    fault_cost: float = FAULT_COST,
    gather_bytes: int | None = None,
    ladder_rungs: int = CPU_LADDER_RUNGS,
    lone_stretch_as_run: bool = False,
    lanes_overlap: bool = False,
) -> Schedule:
    """The schedule of a whole plan: `plan_unit_rounds` (same options), then each unit's
    streams cut into its messages' segments, as `build_schedule` does for one unit."""
    units, plan = plan_unit_rounds(
        leaves,
        assignment,
        bucket_bytes=bucket_bytes,
        link_class=link_class,
        class_latency_bytes=class_latency_bytes,
        max_copies=max_copies,
        pipeline=pipeline,
        unit_bytes=unit_bytes,
        fault_cost=fault_cost,
        gather_bytes=gather_bytes,
        ladder_rungs=ladder_rungs,
        lone_stretch_as_run=lone_stretch_as_run,
        lanes_overlap=lanes_overlap,
    )
    return cut_plan_schedule(leaves, units, plan, link_class=link_class)


@gc_paused()
def cut_plan_schedule(
    leaves: Sequence[LeafSpec],
    units: Sequence[Unit],
    plan: RoundPlan,
    *,
    link_class: Callable[[int, int], int] | None = None,
) -> Schedule:
    """The `Schedule` of ``plan_unit_rounds``'s ``(units, plan)``: each unit's streams cut into
    its messages' segments (the same rounds and buckets; ``link_class`` as planned)."""
    by_unit: dict[int, list[PlannedBucket]] = defaultdict(list)
    for b in plan.buckets:
        by_unit[b.unit].append(b)
    buckets: list[Bucket] = []
    for u, unit in enumerate(units):
        if u in by_unit:
            part = dataclasses.replace(plan, buckets=tuple(by_unit[u]))
            buckets.extend(_cut_buckets(leaves, unit.pieces, part, link_class))
    return Schedule(plan.chunk_bytes, tuple(buckets), tuple(units))


def build_schedule(
    leaves: Sequence[LeafSpec],
    pieces: Iterable[Piece],
    *,
    bucket_bytes: int,
    latency_bytes: int | None = None,
    link_class: Callable[[int, int], int] | None = None,
    class_latency_bytes: Mapping[int, int] | None = None,
    chunks: Mapping[int, int] | None = None,
    interleave: bool = False,
) -> Schedule:
    """Lay pieces into chunked streams, colour the chunks into rounds, group rounds in buckets.

    Args:
      leaves: the plan's leaves (for element sizes).
      pieces: what to send; stages run in order, each stage's buckets after the previous one's.
      bucket_bytes: the largest per-device staging buffer (one direction).
      latency_bytes: the fixed cost of one round in byte-equivalents, used to pick the chunk
        size (fewer, larger rounds against padding). Defaults to ``bucket_bytes // 16``.
      link_class: optional ``link_class(src, dst) -> int``, higher meaning a slower link (e.g.
        1 across fast domains, 0 inside one). A round lasts as long as its slowest message, so
        the classes are scheduled apart (`_class_rounds`): each has its own chunk size, and
        within each stage the slowest class is coloured first into rounds of its own (exactly
        as many as its busiest device needs); a faster class fills free slots of those rounds
        where its chunk fits, then takes rounds of its own. Every round is still a partial
        permutation; a stage may then take more rounds than its busiest device's chunk count,
        but never more slow rounds than needed. Without it, every stage takes exactly the
        busiest device's chunk count (Konig).
      class_latency_bytes: with ``link_class``, the round latency in byte-equivalents of each
        class's links (latency x bandwidth: large for fast links, small for slow ones), used to
        pick each class's chunk size. Classes not in it use ``latency_bytes``.
      chunks: the chunk size of each link class (0 without ``link_class``), chosen by the
        caller for several schedules at once (`build_plan_schedule`); the tails then travel in
        rounds of `ladder_size`. By default each schedule chooses its own.
      interleave: no stage depends on another (a pipelined unit), so they share buckets
        (`plan_rounds`).
    """
    pieces = list(pieces)
    plan = plan_rounds(
        leaves,
        pieces,
        bucket_bytes=bucket_bytes,
        latency_bytes=latency_bytes,
        link_class=link_class,
        class_latency_bytes=class_latency_bytes,
        chunks=chunks,
        interleave=interleave,
    )
    return Schedule(plan.chunk_bytes, _cut_buckets(leaves, pieces, plan, link_class))


def _cut_buckets(
    leaves: Sequence[LeafSpec],
    pieces: Sequence[Piece],
    plan: RoundPlan,
    link_class: Callable[[int, int], int] | None,
) -> tuple[Bucket, ...]:
    """The buckets of ``plan`` with their messages' contents: each stream cut into chunks."""
    chunk_of = dict(plan.class_chunk_bytes)
    by_stage: dict[int, list[Piece]] = defaultdict(list)
    merged = any(b.stage == ALL_STAGES for b in plan.buckets)  # the stages coloured as one
    for piece in pieces:
        by_stage[ALL_STAGES if merged else piece.stage].append(piece)
    # The pairs whose streams start a unit (stage 0): the others are relays, which may take
    # chunks of their own (`RELAY_CLASS`), as `_plan_code_rounds` coloured them.
    starts = {(p.src, d) for p in pieces if p.stage == 0 for d in p.dsts}

    def chunk_bytes(stage: int, pair: tuple[int, int]) -> int:
        if link_class is None:
            return plan.chunk_bytes
        cls = link_class(*pair)
        relayed = pair not in starts if stage == ALL_STAGES else stage > 0
        return chunk_of.get(cls + RELAY_CLASS, chunk_of[cls]) if relayed else chunk_of[cls]

    chunks: dict[int, dict[tuple[int, int], list[tuple[Segment, ...]]]] = {}
    cut = functools.lru_cache(maxsize=None)(_cut)  # relays send one part to several peers
    for stage, stage_pieces in sorted(by_stage.items()):
        chunks[stage] = {
            pair: cut(tuple(stream), chunk_bytes(stage, pair))
            for pair, stream in _streams(leaves, stage_pieces).items()
        }
    buckets = []
    for b in plan.buckets:
        messages = [
            Message(slot, s, d, chunks[b.stage_of(slot)][s, d][k])
            for slot, (_, entries) in enumerate(b.rounds)
            for (s, d), k in entries
        ]
        buckets.append(Bucket(tuple(size for size, _ in b.rounds), tuple(messages), b.unit))
    return tuple(buckets)


def plan_rounds(
    leaves: Sequence[LeafSpec],
    pieces: Iterable[Piece],
    *,
    bucket_bytes: int,
    latency_bytes: int | None = None,
    link_class: Callable[[int, int], int] | None = None,
    class_latency_bytes: Mapping[int, int] | None = None,
    chunks: Mapping[int, int] | None = None,
    interleave: bool = False,
) -> RoundPlan:
    """The rounds and buckets `build_schedule` makes (same arguments), without cutting pieces
    into message segments: only stream sizes are needed, so this is cheap at any scale.

    With ``interleave`` (no stage depends on another: a pipelined unit), the stages' rounds
    share buckets, each bucket taking all of them in proportion to their bytes
    (`_interleave`), so a bucket's cross-domain rounds and its relays can run at once; where
    several stages cross the slowest links, their streams are coloured as one
    (`ALL_STAGES`). Without it stages follow in order."""
    return _plan_stream_rounds(
        _stream_bytes(leaves, pieces),
        bucket_bytes=bucket_bytes,
        latency_bytes=latency_bytes,
        link_class=link_class,
        class_latency_bytes=class_latency_bytes,
        chunks=chunks,
        interleave=interleave,
    )


def _stream_bytes(
    leaves: Sequence[LeafSpec], pieces: Iterable[Sent]
) -> defaultdict[tuple[int, tuple[int, int]], int]:
    """Bytes of each ``(stage, (sender, receiver))`` stream of ``pieces`` (a fan's to each
    of its receivers)."""
    sizes: defaultdict[tuple[int, tuple[int, int]], int] = defaultdict(int)
    itemsize = [leaf.itemsize for leaf in leaves]
    for p in pieces:  # `box_size` inlined: millions of relays at thousands of GPUs
        n = itemsize[p.leaf]
        for start, stop in p.box:
            n *= stop - start
        for d in p.dsts:
            sizes[p.stage, (p.src, d)] += n
    return sizes


def _plan_stream_rounds(
    sizes: Mapping[tuple[int, tuple[int, int]], int],
    *,
    bucket_bytes: int,
    latency_bytes: int | None = None,
    link_class: Callable[[int, int], int] | None = None,
    class_latency_bytes: Mapping[int, int] | None = None,
    chunks: Mapping[int, int] | None = None,
    interleave: bool = False,
    ladder_rungs: int = CPU_LADDER_RUNGS,
) -> RoundPlan:
    """`plan_rounds` from the bytes of each ``(stage, (sender, receiver))`` stream (with
    ``chunks``, tails take `ladder_size` rounds of ``ladder_rungs`` rungs per halving; else
    each schedule chooses its own chunks, `chunk_sizes`, and pads tails to `ALIGN` only)."""
    if chunks is None:
        chunks, _ = chunk_sizes(
            sizes,
            bucket_bytes=bucket_bytes,
            latency_bytes=latency_bytes,
            link_class=link_class,
            class_latency_bytes=class_latency_bytes,
        )
        ladder_rungs = 0
    n = 1 + max((max(pair) for _, pair in sizes), default=0)
    codes, nbytes = _encoded(sizes, n)
    return _plan_code_rounds(
        codes,
        nbytes,
        _CodeClasses(link_class, n),
        bucket_bytes=bucket_bytes,
        chunks=chunks,
        interleave=interleave,
        ladder=ladder_rungs,
    )


def _plan_code_rounds(
    codes: np.ndarray,
    nbytes: np.ndarray,
    classes_of: _CodeClasses,
    *,
    bucket_bytes: int,
    chunks: Mapping[int, int],
    interleave: bool = False,
    ladder: int = 0,
    colour: Colour | None = None,
) -> RoundPlan:
    """`_plan_stream_rounds` from the streams as sorted stream codes (`PreparedPlan`) and
    their bytes: a stage is made into a dict for colouring only when its rounds are not
    known yet (at thousands of GPUs a unit has ~10^5 streams, and stages of different units
    are often alike). ``chunks``: the chunk size of each link class (tails in rounds of
    `ladder_size` with ``ladder`` rungs per halving, or 0: padded to `ALIGN`). ``colour``:
    what colours edges (default `colour_rounds`; `plan_unit_rounds` passes a `_ColourMemo`
    shared by all units, which also remembers whole stages' rounds)."""
    colour = colour_rounds if colour is None else colour
    cap = max(ALIGN, bucket_bytes // ALIGN * ALIGN)
    link_class, n = classes_of.link_class, classes_of.n
    link = classes_of(codes)
    stage, pair = np.divmod(codes, n * n)
    cls = _chunk_classes(link, stage > 0, chunks)  # (relays may take chunks of their own)
    chunk_of = {c: chunks[c] for c in sorted(set(np.unique(cls).tolist()))}
    chunk = max(chunk_of.values(), default=cap)
    slowest = max((c % RELAY_CLASS for c in chunk_of), default=0)
    parts: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []  # stage, pairs, bytes, classes
    if interleave and len(np.unique(stage[link == slowest])) > 1:
        # Several stages cross the slowest links (destination domains forwarding to each
        # other beside the sources' sends): their streams are coloured as one, so a round
        # takes a chunk of whichever stage a device can send or receive then. Coloured
        # apart, a device that both imports and forwards would spend the import rounds idle
        # on one side.
        pairs, sizes = _summed(pair, nbytes)
        relayed = ~np.isin(pairs, pair[stage == 0])  # (a pair's stream: all its stages')
        parts.append((ALL_STAGES, pairs, sizes, _chunk_classes(classes_of(pairs), relayed, chunks)))
    else:  # (codes are sorted: each stage is one run of them, its pairs in order)
        starts = np.flatnonzero(np.r_[True, stage[1:] != stage[:-1]]) if len(stage) else []
        ends = np.r_[starts[1:], len(stage)] if len(stage) else []
        for a, b in zip(list(starts), list(ends), strict=True):
            parts.append((int(stage[a]), pair[a:b], nbytes[a:b], cls[a:b]))

    def as_dicts(
        pairs: np.ndarray, sizes: np.ndarray, classes: np.ndarray
    ) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
        """A stage's streams and their classes as dicts, by (sender, receiver) in order."""
        keys = list(zip((pairs // n).tolist(), (pairs % n).tolist(), strict=True))
        return dict(zip(keys, sizes.tolist(), strict=True)), dict(
            zip(keys, classes.tolist(), strict=True)
        )

    def stage_rounds(pairs: np.ndarray, sizes: np.ndarray, classes: np.ndarray) -> Rounds:
        """`_class_rounds` of one stage; by parts (`_parted_rounds`) where it has one class
        and enough streams to pay for looking for parts."""
        if len(pairs) >= PARTED_STREAMS and len(np.unique(classes)) == 1:
            cls = int(classes[0])
            made = _parted_rounds(pairs, sizes, n, cls, chunk_of[cls], ladder, colour)
            if made is not None:
                return made
        streams, known = as_dicts(pairs, sizes, classes)
        return _class_rounds(streams, chunk_of, known, ladder, colour)

    runs: list[list[tuple[int, tuple[int, list[Entry]]]]] = []  # runs of (stage, round)
    for st, pairs, sizes, classes in parts:
        if link_class is None:
            streams, _ = as_dicts(pairs, sizes, classes)
            rounds = _stage_rounds(streams, chunk, ladder, colour)
        elif isinstance(colour, _ColourMemo):  # a stage's rounds depend on its streams only
            key = (
                pairs.tobytes(),
                sizes.tobytes(),
                classes.tobytes(),
                tuple(chunk_of.items()),
                ladder,
            )
            if key not in colour.stages:
                made = stage_rounds(pairs, sizes, classes)
                colour.stages[key] = [(size, tuple(entries)) for size, entries in made]
            rounds = colour.stages[key]
        else:
            rounds = stage_rounds(pairs, sizes, classes)
        if st == ALL_STAGES:  # the slowest links' rounds beside the others, as below
            _, known = as_dicts(pairs, sizes, classes)
            lanes: tuple[list[Any], list[Any]] = ([], [])  # (slowest links, the others)
            for r in rounds:
                lanes[not any(known[p] % RELAY_CLASS == slowest for p, _ in r[1])].append((st, r))
            runs.extend(lanes)
        else:
            runs.append([(st, r) for r in rounds])
    if interleave and len(runs) > 1:  # no stage depends on another: all share the buckets
        runs = [_interleave(runs)]
    buckets: list[PlannedBucket] = []
    for run in runs:
        group: list[tuple[int, Round]] = []
        for st, (size, entries) in run:
            if group and sum(s for _, (s, _) in group) + size > cap:
                buckets.append(_planned(group))
                group = []
            group.append((st, (size, tuple(entries))))
        if group:
            buckets.append(_planned(group))
    named = () if link_class is None else tuple(sorted(chunk_of.items()))
    return RoundPlan(chunk, named, tuple(buckets))


class _CodeClasses:
    """The link class of streams given as `PreparedPlan` stream codes over ``n`` device ids
    (0 for all without ``link_class``): ``link_class`` is asked once per pair, and the
    answers are kept in a table of every pair where that is small (up to `DENSE_PAIRS`
    pairs: 4,096 devices, 32 MiB), else looked up by bisection over the pairs asked so far
    (one table for a whole plan: its units ask for ~10^6 streams' classes)."""

    DENSE_PAIRS = 1 << 24

    def __init__(self, link_class: Callable[[int, int], int] | None, n: int) -> None:
        self.link_class, self.n = link_class, n
        self.pairs = np.zeros(0, np.int64)  # sorted
        self.classes = np.zeros(0, np.int64)
        self.dense = np.full(n * n, -1, np.int16) if n * n <= self.DENSE_PAIRS else None

    def __call__(self, codes: np.ndarray) -> np.ndarray:
        if self.link_class is None:
            return np.zeros(len(codes), np.int64)
        pair = codes % (self.n * self.n)
        if self.dense is not None:
            known = self.dense[pair]
            if (known < 0).any():
                new = np.unique(pair[known < 0])
                asked = self._ask(new)
                if max(asked, default=0) < 1 << 15 and min(asked, default=0) >= 0:
                    self.dense[new] = asked
                    return self.dense[pair].astype(np.int64)
                self.dense = None  # (classes beyond int16: keep them as pairs below)
            else:
                return known.astype(np.int64)
        at = np.searchsorted(self.pairs, pair)
        known = at < len(self.pairs)
        known[known] = self.pairs[at[known]] == pair[known]
        if not known.all():
            new = np.unique(pair[~known])
            asked = self._ask(new)
            pairs = np.concatenate([self.pairs, new])
            order = np.argsort(pairs, kind="stable")
            self.pairs = pairs[order]
            self.classes = np.concatenate([self.classes, np.array(asked, np.int64)])[order]
            at = np.searchsorted(self.pairs, pair)
        return self.classes[at]

    def _ask(self, pairs: np.ndarray) -> list[int]:
        """``link_class`` of each of ``pairs`` (codes of sender and receiver)."""
        assert self.link_class is not None
        senders, receivers = np.divmod(pairs, self.n)  # (a whole plan's pairs: ~10^5 calls)
        return list(map(self.link_class, senders.tolist(), receivers.tolist()))


def _interleave(runs: Sequence[Sequence[Any]]) -> list[Any]:
    """Runs of ``(stage, (slot_bytes, entries))`` merged in one order, each keeping its own:
    the next round is the one whose middle lies earliest in its run's bytes (ties: the
    earlier run), so every stretch of the merged run holds all of them in proportion to
    their sizes."""
    totals = [sum(size for _, (size, _) in run) or 1 for run in runs]
    # Middles compared exactly, in integers: (2 done + size) / (2 total) of run i scaled by
    # the product of all totals.
    product = math.prod(totals)
    scale = [product // t for t in totals]
    heap = [(run[0][1][0] * scale[i], i) for i, run in enumerate(runs) if run]
    heapq.heapify(heap)
    at, done = [0] * len(runs), [0] * len(runs)
    out: list[Any] = []
    while heap:
        _, i = heapq.heappop(heap)
        item = runs[i][at[i]]
        out.append(item)
        done[i] += item[1][0]
        at[i] += 1
        if at[i] < len(runs[i]):
            heapq.heappush(heap, ((2 * done[i] + runs[i][at[i]][1][0]) * scale[i], i))
    return out


def _planned(group: Sequence[tuple[int, Round]]) -> PlannedBucket:
    stages = tuple(stage for stage, _ in group)
    rounds = tuple(r for _, r in group)
    if len(set(stages)) == 1:
        return PlannedBucket(stages[0], rounds)
    return PlannedBucket(min(stages), rounds, stages)


def chunk_sizes(
    sizes: Mapping[tuple[Any, tuple[int, int]], int],
    *,
    bucket_bytes: int,
    latency_bytes: int | None = None,
    link_class: Callable[[int, int], int] | None = None,
    class_latency_bytes: Mapping[int, int] | None = None,
    ladder: int = 0,
    fault_cost: float = FAULT_COST,
    weights: Mapping[Any, int] | None = None,
    max_chunk_bytes: int | None = None,
    beside_slowest: int = 0,
) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
    """The chunk size of each link class (`choose_chunk_bytes` over the streams of that class;
    one class, 0, without ``link_class``), and the class of each (sender, receiver) pair.

    ``sizes`` maps ``(stage, (sender, receiver))`` to stream bytes; a stage is any label
    (the whole-plan schedule labels streams by unit and stage). ``weights`` counts how many
    times each stage occurs (default once). Chunks are at most a bucket, or
    ``max_chunk_bytes``; with ``beside_slowest`` (the slowest class, the largest, is chosen
    first), every other class's chunks are small enough that that many of them fit a bucket
    beside one of the slowest class's."""
    classes = {pair: link_class(*pair) if link_class else 0 for _, pair in sizes}
    streams, labels = _StreamArrays.of(sizes)
    weight = np.array([(weights or {}).get(label, 1) for label in labels], np.int64)
    cls = np.fromiter((classes[pair] for _, pair in sizes), np.int64, len(sizes))
    chunk_of = _class_chunks(
        streams,
        weight,
        cls,
        bucket_bytes=bucket_bytes,
        latency_bytes=latency_bytes,
        class_latency_bytes=class_latency_bytes,
        ladder=ladder,
        fault_cost=fault_cost,
        max_chunk_bytes=max_chunk_bytes,
        beside_slowest=beside_slowest,
    )
    return chunk_of, classes


def _class_chunks(
    streams: _StreamArrays,
    weight: np.ndarray,
    classes: np.ndarray,
    *,
    bucket_bytes: int,
    latency_bytes: int | None,
    class_latency_bytes: Mapping[int, int] | None,
    ladder: int,
    fault_cost: float,
    max_chunk_bytes: int | None,
    beside_slowest: int,
    lanes_overlap: bool = False,
) -> dict[int, int]:
    """`chunk_sizes` over streams as arrays: ``weight`` per stage, ``classes`` per stream.
    With ``lanes_overlap`` (and no ``beside_slowest``), the faster links' chunks shrink to fit
    a bucket beside one of the slowest's where that makes the two lanes' modeled time
    shorter."""
    cap = _chunk_cap(bucket_bytes, max_chunk_bytes)
    latency = bucket_bytes // 16 if latency_bytes is None else latency_bytes
    chunk_of: dict[int, int] = {}
    slowest_lane: float | None = None  # the slowest class's rounds' time, in round latencies
    links = [c for c in np.unique(classes).tolist() if c < RELAY_CLASS]  # (relays: chosen apart)
    for cls in sorted(links, reverse=True):  # the slowest first
        mine = streams.where(classes == cls)
        cls_latency = (class_latency_bytes or {}).get(cls, latency)
        model = _ChunkModel(mine, weight[mine.labels], cls_latency, fault_cost, bucket_bytes)
        choose = functools.partial(_choose_chunk, model, ladder=ladder)
        if not chunk_of:  # the slowest links: as large as they come
            chunk_of[cls] = choose(cap=cap)
            if lanes_overlap and cls_latency > 0:
                slowest_lane = model.time(chunk_of[cls], ladder) / cls_latency
            continue
        slowest = chunk_of[max(chunk_of)]
        if beside_slowest:
            room = (bucket_bytes - slowest) // beside_slowest
            chunk_of[cls] = choose(cap=min(cap, max(ALIGN, room // ALIGN * ALIGN)))
            continue
        whole = choose(cap=cap)
        chunk_of[cls] = whole
        if whole + slowest <= bucket_bytes or slowest_lane is None or cls_latency <= 0:
            continue
        # A chunk of these links and one of the slowest's do not fit one bucket, so a device
        # with both kinds to send (or receive) takes them in separate buckets, and the two
        # lanes, which could run at once, run one after the other. Chunks small enough to sit
        # beside the slowest's make more rounds of these links, but the lanes then overlap:
        # taken where the lanes' modeled time (in round latencies; the slower lane where they
        # overlap, their sum where they do not) is shorter. Modeled DeepSeek-V3 128 -> 128 on
        # GB200 with 256 MiB buckets: 244 MiB NVLink chunks beside 14 MiB NIC ones put them in
        # separate buckets (838 ms); 203 MiB ones, 658 ms. Where the room left is small the
        # extra rounds' latency loses (Qwen3-4B FSDP8 -> TP4 DP2 on H100, 8 MiB buckets).
        room = (bucket_bytes - slowest) // ALIGN * ALIGN
        if room < ALIGN:
            continue
        beside = choose(cap=min(cap, room))
        apart = model.time(whole, ladder) / cls_latency + slowest_lane
        together = max(model.time(beside, ladder) / cls_latency, slowest_lane)
        if together < apart:
            chunk_of[cls] = beside
    return dict(sorted(chunk_of.items()))


def _split_relays(
    streams: _StreamArrays,
    weight: np.ndarray,
    classes: np.ndarray,
    relay: np.ndarray,
    *,
    bucket_bytes: int,
    class_latency_bytes: Mapping[int, int] | None,
    ladder: int,
    fault_cost: float,
    max_chunk_bytes: int | None,
) -> int | None:
    """The chunk size of the slowest links' relays (``relay``: streams of stage 1 and later)
    where they take one of their own (`RELAY_CLASS`), or None where they share their links'.

    A relay forwards a whole share to each peer in one long stream, where the sources' sends
    to a device are many short ones: one chunk size for both cuts the long streams to the
    short ones' size, in many rounds, each a latency (NeMo-RL's DeepSeek-V3 setup: 406 MiB
    forwards in 10.4 MiB chunks, to fit 14 MiB imports). Apart, the relays take rounds of
    their own chunk and the imports rounds of theirs, but a round of one no longer holds a
    chunk of the other, so a device that imports and forwards does one at a time where a
    source busier than the receivers it sends to (a source-bound stage, which chaining
    answers) would have sent beside the relays. Taken where the chunk model's time of the
    two apart, plus every stage's sources' excess over its receivers, beats the one chunk's.
    """
    if not len(classes):
        return None
    slowest = int(classes.max())
    mine = classes == slowest
    relays = mine & relay
    imports = mine & ~relay
    if not relays.any() or not imports.any():
        return None
    cap = _chunk_cap(bucket_bytes, max_chunk_bytes)
    latency = (class_latency_bytes or {}).get(slowest, bucket_bytes // 16)

    def best(keep: np.ndarray) -> tuple[int, int]:
        part = streams.where(keep)
        model = _ChunkModel(part, weight[part.labels], latency, fault_cost, bucket_bytes)
        chunk = _choose_chunk(model, cap=cap, ladder=ladder)
        return chunk, model.time(chunk, ladder)

    _, together = best(mine)
    chunk, relaying = best(relays)
    _, importing = best(imports)
    return chunk if relaying + importing + _excess(streams, weight, imports) < together else None


def _excess(streams: _StreamArrays, weight: np.ndarray, keep: np.ndarray) -> int:
    """Over the stages of the streams ``keep`` selects, the busiest sender's bytes beyond the
    busiest receiver's, each stage counted ``weight`` times."""
    stage, nbytes = streams.stage[keep], streams.nbytes[keep]
    most = []
    for device in (streams.src[keep], streams.dst[keep]):
        span = int(device.max()) + 1
        key, at = np.unique(stage * span + device, return_inverse=True)
        load = np.bincount(at.reshape(-1), weights=nbytes)
        per_stage = np.zeros(len(weight))
        np.maximum.at(per_stage, key // span, load)
        most.append(per_stage)
    return int((weight * np.maximum(most[0] - most[1], 0)).sum())


def _chunk_cap(bucket_bytes: int, max_chunk_bytes: int | None) -> int:
    """The largest chunk a choice may take: a bucket, or ``max_chunk_bytes``, aligned."""
    return max(ALIGN, min(bucket_bytes, max_chunk_bytes or bucket_bytes) // ALIGN * ALIGN)


@dataclasses.dataclass(frozen=True)
class _StreamArrays:
    """Streams as arrays, one entry per stream: its stage (``0 .. stages - 1``, in the
    stages' order), sender, receiver and bytes. The chunk choice works on these: at
    thousands of GPUs a plan's units have ~10^6 streams. ``labels``: which stages of a larger
    set these are (`where`), as indices into it."""

    stage: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    labels: np.ndarray

    @staticmethod
    def of(sizes: Mapping[tuple[Any, tuple[int, int]], int]) -> tuple[_StreamArrays, list[Any]]:
        """The arrays of ``(stage, (sender, receiver)) -> bytes``, and the stages in order."""
        labels = sorted({stage for stage, _ in sizes})
        index = {label: i for i, label in enumerate(labels)}
        count = len(sizes)
        arrays = _StreamArrays(
            np.fromiter((index[st] for st, _ in sizes), np.int64, count),
            np.fromiter((pair[0] for _, pair in sizes), np.int64, count),
            np.fromiter((pair[1] for _, pair in sizes), np.int64, count),
            np.fromiter(sizes.values(), np.int64, count),
            np.arange(len(labels)),
        )
        return arrays, labels

    def where(self, keep: np.ndarray) -> _StreamArrays:
        """The streams ``keep`` selects, their stages numbered among those left."""
        labels, stage = np.unique(self.stage[keep], return_inverse=True)
        return _StreamArrays(
            stage.reshape(-1), self.src[keep], self.dst[keep], self.nbytes[keep], labels
        )


Rounds = list[tuple[int, list[Entry]]]
"""Rounds of one stage as ``(slot_bytes, [((src, dst), chunk_index), ...])``."""


def _stage_rounds(
    streams: Mapping[tuple[int, int], int],
    chunk: int,
    ladder: int = 0,
    colour: Colour | None = None,
) -> Rounds:
    """Rounds of one stage, from its streams' byte counts.

    Full chunks are coloured together into rounds of ``chunk`` bytes. Each stream's last,
    partial chunk (its tail) is coloured separately, largest tails first, into rounds sized to
    their largest tail: tails of small leaves then ride in small rounds instead of being padded
    to a full chunk. ``ladder``: 0, or the rungs per halving of `ladder_size` tails take.
    """
    colour = colour_rounds if colour is None else colour
    full, tails = _full_and_tails(streams, chunk, ladder)
    out = [(chunk, entries) for entries in colour({p: n for p, n in full.items() if n})]
    return out + _tail_rounds(tails, full, chunk, ladder, colour)


def _full_and_tails(
    streams: Mapping[tuple[int, int], int], chunk: int, ladder: int
) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """Each stream's count of chunks coloured as full ones, and its tail (the bytes after
    them) where it has one. With ``ladder``, a tail over half a chunk counts as a full chunk:
    with halves only, its `ladder_size` is the chunk anyway, and coloured with the full chunks
    it takes a free slot of theirs instead of a round of its own (apart, the rounds are the
    busiest device's full chunks plus the busiest device's tails, often two different
    devices: a receiver of a few long streams and a sender of many short ones). With
    three-quarter rungs too it is padded to the chunk rather than to three quarters of it:
    kept so, since tail rounds of their own cost more (NeMo-RL's setup in the cluster model:
    1,222 ms this way, 1,228 ms with such tails in rounds of their own)."""
    full = {pair: n // chunk for pair, n in streams.items()}
    tails = {pair: n % chunk for pair, n in streams.items() if n % chunk}
    if ladder:
        half = _align(chunk // 2)
        for pair in [p for p, t in tails.items() if t > half]:
            full[pair] += 1
            del tails[pair]
    return full, tails


def _tail_rounds(
    tails: Mapping[tuple[int, int], int],
    full: Mapping[tuple[int, int], int],
    chunk: int,
    ladder: int = 0,
    colour: Colour | None = None,
    order: Sequence[tuple[int, int]] | None = None,
) -> Rounds:
    """Each stream's tail (chunk index ``full[pair]``), largest first, in rounds sized to their
    largest tail (with ``ladder``, rounded up by `ladder_size` of ``chunk`` with that many
    rungs per halving). ``order``: the tails' pairs in that order, where the caller has it."""
    colour = colour_rounds if colour is None else colour
    if order is None:
        order = sorted(tails, key=lambda p: (-tails[p], p))
    out = []
    for entries in colour({p: 1 for p in order}, order):
        pairs = [pair for pair, _ in entries]  # (map and zip: ~10^5 tails at scale)
        located = list(zip(pairs, map(full.__getitem__, pairs), strict=True))
        largest = max(map(tails.__getitem__, pairs))
        size = ladder_size(largest, chunk, ladder) if ladder else _align(largest)
        out.append((size, located))
    return out


LADDER_STEPS = 6
"""How many halvings of the chunk size `ladder_size` offers below the chunk itself."""


@functools.cache
def tail_ladder(chunk: int, rungs: int = 1) -> tuple[tuple[int, ...], bool]:
    """The round sizes a tail of a ``chunk``-byte chunk may take, largest first: ``chunk``,
    then each of ``LADDER_STEPS`` halvings, with (``rungs=2``) the three quarters of each step
    between them; and whether the ladder went down all its steps (it stops where halving no
    longer makes an aligned size smaller)."""
    out, size = [chunk], chunk
    for _ in range(LADDER_STEPS):
        half = _align(size // 2)
        if half >= size:
            return tuple(out), False
        if rungs > 1 and half < (three_quarters := _align(size * 3 // 4)) < size:
            out.append(three_quarters)
        out.append(half)
        size = half
    return tuple(out), True


def ladder_size(nbytes: int, chunk: int, rungs: int = 1) -> int:
    """A round size for a tail of ``nbytes``: the smallest rung of `tail_ladder` that holds
    it, or the tail itself (aligned) below half the last rung.

    Round sizes are the shapes of staging buffers, which the runtime keeps and reuses between
    steps and calls only when they match: a few sizes per plan keep a refit allocation-free,
    at the price of at most 2x padding on rounds of tails (1.5x with ``rungs=2``), which is
    cheaper than a fresh buffer's page faults on CPU and allocator churn on accelerators."""
    ladder, complete = tail_ladder(chunk, rungs)
    smallest = chunk
    for size in ladder:  # largest first
        if size < nbytes:
            break
        smallest = size
    if complete and smallest == ladder[-1] and _align(smallest // 2) >= nbytes:
        return _align(nbytes)
    return smallest


def _class_rounds(
    streams: Mapping[tuple[int, int], int],
    chunk_of: Mapping[int, int],
    classes: Mapping[tuple[int, int], int],
    ladder: int = 0,
    colour: Colour | None = None,
    full_rounds: int = 0,
) -> Rounds:
    """Rounds of one stage whose pairs are on links of several speeds, slowest class first.

    Per class (with its own chunk size): its full chunks first fill the slots their devices
    have free in the full-chunk rounds made so far that are at least as large (lowest rounds
    first; a faster message in a slower round costs nothing), then the rest is coloured into
    new rounds (`colour_rounds`: as many as the class's busiest device still needs); its tails
    take a slot free at both ends in a round made so far that is at least as large (largest
    tails first, lowest round first: it costs that round nothing), and the rest get rounds of
    their own (`_tail_rounds`), so a fast tail never pads a slow round. (Modeled: NeMo-RL's
    setup 1,173 -> 1,160 ms, DeepSeek-V3 698 -> 692 ms, the 128-GPU Qwen3-235B sampler
    283 -> 278 ms.)

    ``full_rounds``: the slowest class's full-chunk rounds number at least this many (empty
    ones added after its own), as they do where these streams are one part of a stage whose
    other parts need more (`_parted_rounds`). Each round's entries are in pair order.
    """
    colour = colour_rounds if colour is None else colour
    out: Rounds = []
    busy_src: dict[int, int] = defaultdict(int)  # device -> mask of the rounds it sends in
    busy_dst: dict[int, int] = defaultdict(int)

    def add(rounds: Iterable[tuple[int, list[Entry]]], last: bool = False) -> None:
        """Append ``rounds``, marking their devices busy (not after the ``last`` rounds:
        nothing is placed after them)."""
        for size, entries in rounds:
            bit = 1 << len(out)
            out.append((size, entries))
            if last:
                continue
            for (s, d), _ in entries:  # (inlined: millions of entries at scale)
                busy_src[s] |= bit
                busy_dst[d] |= bit

    def place(r: int, pair: tuple[int, int], k: int) -> None:
        """Chunk ``k`` of ``pair`` into the free slot of round ``r``."""
        out[r][1].append((pair, k))
        busy_src[pair[0]] |= 1 << r
        busy_dst[pair[1]] |= 1 << r

    slowest_first = sorted({classes[p] for p in streams}, reverse=True)
    for cls in slowest_first:
        chunk = chunk_of[cls]
        mine = {p: n for p, n in sorted(streams.items()) if classes[p] == cls}
        full, tails = _full_and_tails(mine, chunk, ladder)
        left = dict(full)
        fits = sum(1 << r for r, (size, _) in enumerate(out) if size >= chunk)
        placed = False  # (the slowest class finds no rounds: at scale, skip ~10^5 pairs)
        for (s, d), n in full.items() if fits else ():
            free = fits & ~(busy_src[s] | busy_dst[d])
            while left[s, d] and free:
                r = (free & -free).bit_length() - 1
                free ^= 1 << r
                place(r, (s, d), n - left[s, d])
                left[s, d] -= 1
                placed = True
        new = colour({p: n for p, n in left.items() if n})
        if placed:  # some chunks went into earlier rounds
            new = [[(p, full[p] - left[p] + k) for p, k in entries] for entries in new]
        last = cls == slowest_first[-1]
        add(((chunk, entries) for entries in new), last=last and not tails)
        if cls == slowest_first[0] and len(out) < full_rounds:
            out.extend((chunk, []) for _ in range(full_rounds - len(out)))
        # A tail takes a slot free at both ends in a round at least its size, where there is
        # one (a round lasts as long as its largest message), and no round of its own.
        by_size = sorted(range(len(out)), key=lambda r: -out[r][0])
        smaller = [-out[r][0] for r in by_size]  # ascending
        masks = list(itertools.accumulate((1 << r for r in by_size), operator.or_))
        order = sorted(tails, key=lambda p: (-tails[p], p))
        for pair in order if out else ():
            large = bisect.bisect_right(smaller, -tails[pair])  # rounds by_size[:large] hold it
            free = masks[large - 1] & ~(busy_src[pair[0]] | busy_dst[pair[1]]) if large else 0
            if free:
                place((free & -free).bit_length() - 1, pair, full[pair])
                del tails[pair]
        order = [p for p in order if p in tails]  # (still largest first)
        add(_tail_rounds(tails, full, chunk, ladder, colour, order), last=last)
    return [(size, sorted(entries)) for size, entries in out]


PARTED_STREAMS = 1 << 12
"""The fewest streams of a stage that `_plan_code_rounds` plans by parts (`_parted_rounds`):
looking for parts costs a few milliseconds, which a small stage's whole rounds do not."""


def _parted_rounds(
    pairs: np.ndarray,
    sizes: np.ndarray,
    n: int,
    cls: int,
    chunk: int,
    ladder: int,
    colour: Colour | None,
) -> Rounds | None:
    """`_class_rounds` of a stage of one link class whose streams (sorted pair codes over
    ``n`` device ids, and their bytes) fall into parts that share no device, made part by
    part: parts alike up to their device ids (the racks of a cluster relaying inside
    themselves) are planned once and their rounds laid side by side, round ``r`` of the
    stage being round ``r`` of every part (None where the stage is one part).

    The same rounds as the whole stage's, entry for entry: a part's chunks and tails only
    ever wait on its own devices, the stage's full-chunk rounds are as many as its busiest
    part's (each part's tails may take the slots its devices have free in all of them:
    ``full_rounds``), and a tail round is as large as its largest tail over the parts
    (round sizes grow with the tails they hold). At 4,096 GPUs a relay stage of 142,848
    streams is 29 racks of a few kinds."""
    # Imported here: scipy.sparse takes 0.15-0.3 s to import, paid only by plans with such
    # stages (once per process).
    import scipy.sparse
    import scipy.sparse.csgraph

    src, dst = np.divmod(pairs, n)
    # Over the stage's own devices, numbered compactly (device ids may be sparse and large).
    ids, at = np.unique(np.concatenate([src, dst]), return_inverse=True)
    at = at.reshape(-1)
    graph = scipy.sparse.coo_matrix(
        (np.ones(len(pairs)), (at[: len(pairs)], at[len(pairs) :])), shape=(len(ids), len(ids))
    )
    _, label = scipy.sparse.csgraph.connected_components(graph, connection="weak")
    part = label[at[: len(pairs)]]
    order = np.argsort(part, kind="stable")  # (each part keeps its pairs in order)
    part = part[order]
    starts = np.flatnonzero(np.r_[True, part[1:] != part[:-1]])
    if len(starts) < 2:
        return None
    ends = np.r_[starts[1:], len(part)]
    # Each part ranked: its devices numbered in order of their ids, senders and receivers
    # alike (numbered apart, a sender and a receiver of the same rank would join parts of
    # the part that share no device, which are coloured apart).
    kinds: dict[tuple[bytes, bytes, bytes], int] = {}
    members: list[tuple[int, list[int]]] = []  # (kind, devices)
    ranked: list[dict[tuple[int, int], int]] = []
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        s, d, nbytes = src[order[a:b]], dst[order[a:b]], sizes[order[a:b]]
        devices = np.unique(np.concatenate([s, d]))
        rank_s, rank_d = np.searchsorted(devices, s), np.searchsorted(devices, d)
        key = (rank_s.tobytes(), rank_d.tobytes(), nbytes.tobytes())
        if key not in kinds:
            kinds[key] = len(ranked)
            ranked.append(
                dict(zip(zip(rank_s.tolist(), rank_d.tolist(), strict=True), nbytes.tolist(),
                         strict=True))
            )  # fmt: skip
        members.append((kinds[key], devices.tolist()))
    # The stage's full-chunk rounds: as many as its busiest part's chunks (Konig).
    most = max(
        _max_degree({p: k for p, k in _full_and_tails(kind, chunk, ladder)[0].items() if k})
        for kind in ranked
    )
    memo = colour if isinstance(colour, _ColourMemo) else None
    made, asked = [], []
    for kind in ranked:
        coloured = _PartColour(memo)
        made.append(
            _class_rounds(kind, {cls: chunk}, dict.fromkeys(kind, cls), ladder, coloured, most)
        )
        asked.append(coloured.asked)
    calls = {len(a) for a in asked}
    if len(calls) != 1 or any(
        sum(asked[kind][call] for kind, _ in members) == 1 for call in range(calls.pop())
    ):
        return None  # a colouring of the whole stage with edges in one part only
    rounds = max(len(m) for m in made)
    size = [max((m[r][0] for m in made if r < len(m)), default=0) for r in range(rounds)]
    # Each kind's rounds laid over all of its members at once, as arrays: the members'
    # devices are the rows of one table (a kind's members have as many devices), indexed by
    # the kind's ranked senders and receivers (1.4 million entries at 4,096 GPUs: a Python
    # loop over them took 0.5 s).
    of_kind: dict[int, list[list[int]]] = defaultdict(list)  # kind -> its members' devices
    for kind, devices in members:
        of_kind[kind].append(devices)
    columns: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in range(rounds)]
    for kind, rows in of_kind.items():
        table = np.array(rows, np.int64)
        for r, (_, got) in enumerate(made[kind]):
            if got:
                at_s, at_d, k = np.array([(a, b, k) for (a, b), k in got], np.int64).T
                senders, receivers = table[:, at_s].ravel(), table[:, at_d].ravel()
                columns[r].append((senders, receivers, np.tile(k, len(table))))
    out: Rounds = []
    for r in range(rounds):
        if not columns[r]:
            out.append((size[r], []))
            continue
        src, dst, k = (np.concatenate(c) for c in zip(*columns[r], strict=True))
        order = np.lexsort((dst, src))  # (pair order: a pair is once in a round)
        pairs = zip(src[order].tolist(), dst[order].tolist(), strict=True)
        out.append((size[r], list(zip(pairs, k[order].tolist(), strict=True))))
    return out


def _streams(
    leaves: Sequence[LeafSpec], pieces: Iterable[Piece]
) -> dict[tuple[int, int], list[Segment]]:
    """Each pair's pieces end to end (`end_to_end`)."""
    pairs: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for p in pieces:
        pairs[p.src, p.dst].append(p)
    return {pair: end_to_end(leaves, ps) for pair, ps in sorted(pairs.items())}


def end_to_end(leaves: Sequence[LeafSpec], parts: Iterable[Piece | LocalCopy]) -> list[Segment]:
    """Parts of leaves laid end to end as one stream from offset 0, widest elements first so
    every element stays aligned (then by leaf and box). A `LocalCopy` reads the source shard
    (the lowering lays the parts a device passes itself so, `lower.Step.kept`)."""
    ordered = sorted(parts, key=lambda p: (-leaves[p.leaf].itemsize, p.leaf, p.box))
    offset, stream = 0, []
    for p in ordered:
        nbytes = box_size(p.box) * leaves[p.leaf].itemsize
        from_dst = not isinstance(p, LocalCopy) and p.from_dst
        stream.append(Segment(p.leaf, p.box, offset, nbytes, from_dst))
        offset += nbytes
    return stream


def _cut(stream: Sequence[Segment], chunk: int) -> list[tuple[Segment, ...]]:
    """Cut a stream into chunks of ``chunk`` bytes; a piece crossing a boundary is split into
    boxes (``split_flat``) so each part is still a plain slice of its shard."""
    total = sum(s.nbytes for s in stream)
    chunks: list[list[Segment]] = [[] for _ in range(math.ceil(total / chunk))]
    for seg in stream:
        end = seg.offset + seg.nbytes
        k = seg.offset // chunk
        if end <= (k + 1) * chunk:  # the whole piece fits in one chunk: no split needed
            chunks[k].append(
                Segment(seg.leaf, seg.box, seg.offset - k * chunk, seg.nbytes, seg.from_dst)
            )
            continue
        shape = box_shape(seg.box)
        steps = strides(shape)
        item = seg.nbytes // math.prod(shape)
        start = seg.offset
        while start < end:
            k = start // chunk
            stop = min(end, (k + 1) * chunk)
            first, last = (start - seg.offset) // item, (stop - seg.offset) // item
            at = start - k * chunk
            for part, count in split_flat_sized(seg.box, shape, steps, first, last):
                chunks[k].append(Segment(seg.leaf, part, at, count * item, seg.from_dst))
                at += count * item
            start = stop
    return [tuple(c) for c in chunks]


def choose_chunk_bytes(
    sizes: Mapping[tuple[Any, tuple[int, int]], int],
    *,
    cap: int,
    latency_bytes: int,
    ladder: int = 0,
    fault_cost: float = FAULT_COST,
    weights: Mapping[Any, int] | None = None,
) -> int:
    """The chunk size minimising the modeled time: per round, its size plus a latency.

    ``sizes`` maps ``(stage, (sender, receiver))`` to stream bytes. Candidates are even
    divisions of the largest streams (so equal streams split with no padding) and the cap.
    Every candidate is a multiple of `ALIGN` and at most ``cap``. With ``ladder``, tail rounds
    are priced at their `ladder_size`, as `build_plan_schedule` makes them, and a change of
    round sizes between stages costs ``fault_cost`` byte-equivalents per staging byte made
    afresh (`FAULT_COST` on CPU; 0 where the allocator reuses device memory cheaply).
    ``weights`` counts how many times each stage runs (default once; the order of stages
    matters to the fault cost, so weights other than 1 are for plans without one).
    """
    streams, labels = _StreamArrays.of(sizes)
    if not len(streams.nbytes):
        return cap
    weight = np.array([(weights or {}).get(label, 1) for label in labels], np.int64)
    model = _ChunkModel(streams, weight, latency_bytes, fault_cost, cap)
    return _choose_chunk(model, cap=cap, ladder=ladder)


def _choose_chunk(model: _ChunkModel, *, cap: int, ladder: int) -> int:
    """`choose_chunk_bytes` over the streams ``model`` prices (at least one: a model needs
    them), its candidates from their distinct sizes."""
    distinct = model.sizes[::-1][:8].tolist()
    candidates = {cap}
    for size in distinct:
        for k in range(1, 65):
            c = _align(math.ceil(size / k))
            if c <= cap:
                candidates.add(c)

    # Page faults only add to a candidate's time, and pricing them replays the staging pool
    # over every unit: candidates are taken by their time without faults, and once that
    # alone ties or loses to the best so far, no later one can win (the same choice, priced
    # for few candidates: a plan of 500 units took 5.5 s, not 1.2 s, pricing all ~200).
    bare = {c: model.time(c, ladder, faults=False) for c in candidates}
    first, *rest = sorted(candidates, key=lambda c: (bare[c], -c))
    best, best_key = first, (model.time(first, ladder), -first)
    for c in rest:
        if (bare[c], -c) >= best_key:
            break
        key = (model.time(c, ladder), -c)
        if key < best_key:
            best, best_key = c, key
    return best


class _ChunkModel:
    """Byte-equivalent time of the rounds `_stage_rounds` would make with a given chunk size:
    per stage, the busiest device's full chunks times (chunk + latency), plus its tail count
    times (largest tail + latency). Vectorised, since ~200 chunk sizes are tried on plans
    with up to ~10^6 streams: what a chunk size makes of a stream depends on its bytes only,
    so each evaluation works on the distinct stream sizes, and a device's streams of one size
    count once, times how many there are (a relay goes to each peer of its domain in equal
    streams: 650,000 streams at 4,096 GPUs are 33,000 (sender, size) pairs)."""

    def __init__(
        self,
        streams: _StreamArrays,
        weight: np.ndarray,
        latency: int,
        fault_cost: float = 0.0,
        pool_bytes: int = 0,
    ) -> None:
        self.fault_cost = fault_cost
        self.pool_bytes = pool_bytes
        self.stages = len(weight)
        self.weight = weight
        self.latency = latency
        self.sizes, size_id = np.unique(streams.nbytes, return_inverse=True)  # distinct sizes
        size_id = size_id.reshape(-1)
        n = len(self.sizes)
        stage = streams.stage
        # The distinct (stage, size) pairs: each stage's largest tail.
        pairs = np.unique(stage * n + size_id)
        self.pair_stage, self.pair_size = pairs // n, pairs % n
        self.sides = []
        self.groups = []
        for device in (streams.src, streams.dst):  # senders, receivers
            row, size, times, row_stage = _alike_devices(stage, device, size_id, n)
            self.sides.append((row, size, times))
            self.groups.append(_grouped(row_stage))

    @staticmethod
    def of(
        sizes: Mapping[tuple[Any, tuple[int, int]], int],
        latency: int,
        fault_cost: float = 0.0,
        weights: Mapping[Any, int] | None = None,
    ) -> _ChunkModel:
        """The model of ``(stage, (sender, receiver)) -> bytes``, each stage run
        ``weights[stage]`` times (default once)."""
        streams, labels = _StreamArrays.of(sizes)
        weight = np.array([(weights or {}).get(label, 1) for label in labels], np.int64)
        return _ChunkModel(streams, weight, latency, fault_cost)

    def _busiest(self, per_size: np.ndarray) -> np.ndarray:
        """Per stage, the largest sum of ``per_size`` (a value per distinct stream size) over
        one sender's or receiver's streams."""
        out = np.zeros(self.stages, dtype=np.int64)
        for (device, size, count), (order, starts, present) in zip(
            self.sides, self.groups, strict=True
        ):
            degree = np.bincount(device, weights=per_size[size] * count, minlength=len(order))
            most = np.maximum.reduceat(degree[order].astype(np.int64), starts)
            out[present] = np.maximum(out[present], most)
        return out

    def time(self, chunk: int, ladder: int = 0, faults: bool = True) -> int:
        """The byte-equivalent time of rounds of ``chunk`` bytes (tails on a ``ladder`` of
        that many rungs per halving; 0: tails as they are), page faults included unless
        ``faults`` is False."""
        full, rest = np.divmod(self.sizes, chunk)
        if ladder:  # tails rounded up to a whole chunk are coloured as one (`_full_and_tails`)
            whole = rest > _align(chunk // 2)
            full, rest = full + whole, np.where(whole, 0, rest)
        n_full = self._busiest(full)
        n_tail = self._busiest((rest > 0).astype(np.int64))
        largest = np.zeros(self.stages, dtype=np.int64)
        np.maximum.at(largest, self.pair_stage, rest[self.pair_size])
        tails = _ladder_sizes(largest, chunk, ladder) if ladder else _aligned(largest)
        total = int(
            (self.weight * n_full * (chunk + self.latency)).sum()
            + (self.weight * n_tail * (tails + self.latency)).sum()
        )
        if faults and ladder and self.fault_cost and len(n_full) > 1:
            # Stages (units) one after the other whose round sizes differ can make the
            # runtime's staging pool free buffers and allocate others (cyclically: the first
            # stage after the last, on the next call). Fresh buffers page-fault on first
            # touch, which costs about twice the copy (`FAULT_COST`): priced here so the chunk
            # size favours reuse where the pool cannot keep every size.
            # A step holds at most a bucket of rounds: a stage's need is capped to that.
            needs = []
            for f, t, m in zip(n_full.tolist(), n_tail.tolist(), tails.tolist(), strict=True):
                need = Counter({chunk: min(f, max(1, self.pool_bytes // chunk))})
                need[m] += min(t, max(1, self.pool_bytes // max(m, 1)))
                needs.append(need)
            total += int(self.fault_cost * _faulted_bytes(needs, self.pool_bytes))
        return total


def _faulted_bytes(needs: Sequence[Counter[int]], cap: int) -> int:
    """Bytes a staging pool kept under ``cap`` bytes (`plan_pool`) allocates afresh in one
    call, once it runs call after call through steps that each need ``needs[i]`` (round size
    in bytes -> count). Where every size fits at once, nothing is allocated after the first
    call. (The runtime holds a send and a receive buffer per round, under twice the bucket;
    this counts one, under one bucket, and `FAULT_COST` prices both.)"""
    most: Counter[int] = Counter()
    for need in needs:
        most |= need
    if sum(size * count for size, count in most.items()) <= cap:
        return 0
    # A step needing what the step before needed does nothing: the pool holds the need, and
    # the step before freed spare buffers until the pool fit the cap or none was left. So a
    # run of equal needs counts as its first step (units of a repeated stretch are equal).
    needs = [n for k, n in enumerate(needs) if k == 0 or n != needs[k - 1]]
    pool: Counter[int] = Counter()
    fresh = 0
    for call in range(2):  # the first call fills the pool; the second is what every call pays
        for need in needs:
            free, allocate = plan_pool(pool, +need, cap, nbytes=int)
            pool = pool - free + allocate
            fresh += call * sum(size * n for size, n in allocate.items())
    return fresh


K = TypeVar("K")


def plan_pool(
    pool: Counter[K],
    need: Counter[K],
    cap: int,
    nbytes: Callable[[K], int] = operator.attrgetter("nbytes"),
) -> tuple[Counter[K], Counter[K]]:
    """The staging pool's policy: which buffers to free and which to allocate before a step.

    ``pool`` holds buffers kept from earlier steps (and calls), by kind (`lower.Slot`, or a
    round size in bytes with ``nbytes=int``). Buffers the step does not use are freed,
    largest first, while keeping them would take the pool past ``cap`` bytes once the missing
    ones are allocated. Returns ``(free, allocate)``. The runtime keeps its pool by it, the
    lowering simulates it (`lower.staging`), and the chunk choice prices it (`_faulted_bytes`).
    """
    missing = need - pool
    spare = pool - need
    held = sum(nbytes(s) * n for s, n in pool.items())
    grow = sum(nbytes(s) * n for s, n in missing.items())
    free: Counter[K] = Counter()
    for slot in sorted(spare, key=lambda s: (-nbytes(s), s)):
        while spare[slot] and held + grow > cap:
            spare[slot] -= 1
            free[slot] += 1
            held -= nbytes(slot)
    return free, missing


def _alike_devices(
    stage: np.ndarray, device: np.ndarray, size_id: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Streams (``stage[i]``, one end ``device[i]``, size ``size_id[i]`` of ``n``) as the
    rows of `_ChunkModel`'s sides: ``(row, size, count)`` entries, ``count`` streams of that
    size in that row, and the stage of each row. A row is a device of one stage; devices of
    one stage with the same stream sizes are one row, since only the busiest of each stage
    counts (a cluster's racks alike: at 4,096 GPUs the slowest links' 35,000 (stage, sender)
    rows are 2,400, each of the 22 stages' relays inside racks a handful)."""
    width = int(device.max(initial=0)) + 1
    _, member = np.unique(stage * width + device, return_inverse=True)  # (stage, device) -> id
    keys, count = np.unique(member * n + size_id, return_counts=True)  # sorted by member
    of, size = keys // n, keys % n
    starts = np.flatnonzero(np.r_[True, of[1:] != of[:-1]])
    ends = np.r_[starts[1:], len(of)]
    stage_of = np.zeros(int(member.max(initial=-1)) + 1, np.int64)
    stage_of[member] = stage
    rows: dict[tuple[int, bytes, bytes], int] = {}
    keep = []
    row_stage = []
    # Each member's key from slices of the arrays' bytes, not of the arrays (a slice and
    # `tobytes` per member cost 3 us: 145,000 members at 4,096 GPUs).
    stages, sizes, counts = stage_of.tolist(), size.tobytes(), count.tobytes()
    ws, wc = size.itemsize, count.itemsize
    for m, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        key = (stages[m], sizes[a * ws : b * ws], counts[a * wc : b * wc])
        if key not in rows:
            rows[key] = len(rows)
            keep.append(np.arange(a, b))
            row_stage.append(key[0])
    picked = np.concatenate(keep) if keep else np.zeros(0, np.int64)
    row = np.repeat(np.arange(len(keep)), [len(k) for k in keep])
    return row, size[picked], count[picked], np.array(row_stage, np.int64)


def _grouped(stage_of: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The devices of ``stage_of`` (device -> stage) ordered by stage, where each stage's run
    starts, and the stage of each run: one ``reduceat`` then takes every stage's maximum
    (``np.maximum.at`` is an unbuffered loop, far slower at thousands of stages)."""
    order = np.argsort(stage_of, kind="stable")
    grouped = stage_of[order]
    starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
    return order, starts, grouped[starts]


def _aligned(n: np.ndarray) -> np.ndarray:
    """`_align` of every element."""
    return np.maximum(ALIGN, -(-n // ALIGN) * ALIGN)


def _ladder_sizes(nbytes: np.ndarray, chunk: int, rungs: int = 1) -> np.ndarray:
    """`ladder_size` of every element (vectorised: the chunk model tries hundreds of chunk
    sizes on plans with thousands of stages)."""
    sizes, complete = tail_ladder(chunk, rungs)
    ladder = np.array(sizes, dtype=np.int64)  # decreasing
    fits = (ladder[None, :] >= nbytes[:, None]).sum(axis=1)  # rungs holding each tail
    out = ladder[np.maximum(fits, 1) - 1]
    if complete:  # below the last rung's half a tail travels in a round of its own size
        small = (fits == len(ladder)) & (_align(int(ladder[-1]) // 2) >= nbytes)
        out = np.where(small, _aligned(nbytes), out)
    return out


def _align(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


Colour = Callable[..., list[list[tuple[tuple[int, int], int]]]]
"""`colour_rounds`, or a function that answers as it does (`_ColourMemo`)."""


class _ColourMemo:
    """`colour_rounds`, remembering its answers: the units of a plan whose streams differ
    (slabs of one leaf with other tails, repeated layers beside other relays) still ask for
    many of the same colourings, the relays' inside each rack above all (modeled DeepSeek-V3
    on 4,096 GPUs: 116 colourings, 55 different, about 3 s of 5). Each answer is handed out
    as fresh lists, since callers add entries to rounds they got (`_class_rounds`).

    ``stages`` remembers whole stages' rounds for `_plan_code_rounds` (with link classes),
    keyed by the stage's streams, the chunk sizes and the ladder (the classes are the plan's):
    units whose relays inside racks are alike skip all of their work, not only the colouring
    (modeled DeepSeek-V3 on 4,096 GPUs: 58 stages, 44 different; three of 142,848 relay
    streams each, alike). Kept as tuples of entries, which no caller changes."""

    def __init__(self) -> None:
        self.known: dict[tuple[object, ...], list[list[tuple[tuple[int, int], int]]]] = {}
        self.stages: dict[tuple[object, ...], list[tuple[int, Sequence[Entry]]]] = {}

    def __call__(
        self,
        multiplicity: Mapping[tuple[int, int], int],
        order: Sequence[tuple[int, int]] | None = None,
    ) -> list[list[tuple[tuple[int, int], int]]]:
        return self.remembered(multiplicity, order, colour_rounds)

    def remembered(
        self,
        multiplicity: Mapping[tuple[int, int], int],
        order: Sequence[tuple[int, int]] | None,
        colour: Callable[..., list[list[tuple[tuple[int, int], int]]]],
    ) -> list[list[tuple[tuple[int, int], int]]]:
        """``colour(multiplicity, order)``, made once for each ``colour`` and graph."""
        # The items as they come, unsorted (sorting them cost more than it saved): the same
        # counts listed in another order only miss, since the colouring does not depend on
        # the dict's order.
        key = (colour, tuple(multiplicity.items()), None if order is None else tuple(order))
        if key not in self.known:
            self.known[key] = colour(multiplicity, order)
        return [list(entries) for entries in self.known[key]]


def colour_rounds(
    multiplicity: Mapping[tuple[int, int], int],
    order: Sequence[tuple[int, int]] | None = None,
) -> list[list[tuple[tuple[int, int], int]]]:
    """Colour a bipartite multigraph's edges with as many colours as its maximum degree.

    ``multiplicity[(s, d)]`` is the number of chunks ``s`` sends ``d``. Returns, per round, the
    ``((s, d), k)`` entries meaning "chunk ``k`` of pair ``(s, d)`` moves in this round"; every
    round is a partial permutation. Konig's alternating-path method: give an edge a colour free
    at both ends, first swapping two colours along an alternating path when needed. Edges are
    coloured in ``order`` (default: sorted), so early edges tend to share the first rounds.

    The colours used at each device are kept as one integer bit mask, so finding a free colour
    is a few integer operations even with thousands of rounds (a 256-device plan of a 671B
    model has ~10^5 chunks in ~10^3 rounds). Without ``order``, parts that share no device are
    coloured apart, and a graph whose pairs share a chunk count (or all but a remainder) is
    coloured once and repeated, in each case with no more rounds than the busiest device's
    count: thousands of GPUs' relay stages become many small colourings.
    """
    # Parts that share no device are coloured apart and their rounds laid side by side:
    # round r of the whole is round r of every part, so it still takes as many rounds as
    # its busiest device (each part needs its own busiest device's count). A relay stage
    # falls apart into its fan-out groups, each small. Each part keeps ``order``.
    # Parts alike up to their device ids (the racks of a cluster) are coloured once.
    parts = _components(multiplicity)
    if len(parts) > 1:
        return _colour_parts(parts, order)
    return _colour_connected(multiplicity, order)


def _colour_parts(
    parts: Sequence[Mapping[tuple[int, int], int]], order: Sequence[tuple[int, int]] | None
) -> list[list[tuple[tuple[int, int], int]]]:
    """`colour_rounds` of a graph in several ``parts`` (`_components`): each part ranked (its
    senders, and its receivers, numbered in order), coloured, and laid beside the others."""
    merged: list[list[tuple[tuple[int, int], int]]] = []
    alike: dict[tuple[object, ...], list[list[tuple[tuple[int, int], int]]]] = {}
    suborders: list[list[tuple[int, int]] | None] = [None] * len(parts)
    if order is not None:
        grouped: list[list[tuple[int, int]]] = [[] for _ in parts]
        part_of = {pair: i for i, part in enumerate(parts) for pair in part}
        for pair in order:
            grouped[part_of[pair]].append(pair)
        suborders = list(grouped)
    for part, suborder in zip(parts, suborders, strict=True):
        senders = sorted({s for s, _ in part})
        receivers = sorted({d for _, d in part})
        rank_s = {s: i for i, s in enumerate(senders)}
        rank_d = {d: i for i, d in enumerate(receivers)}
        # Ranks keep the ids' order, so colouring the ranked part is colouring the part.
        ranked = {(rank_s[s], rank_d[d]): n for (s, d), n in part.items()}
        ranked_order = None if suborder is None else [(rank_s[s], rank_d[d]) for s, d in suborder]
        key = (tuple(ranked.items()), None if ranked_order is None else tuple(ranked_order))
        if key not in alike:
            # Ranked, a device that sends and receives is two nodes: the ranked part may
            # fall apart again (colour_rounds looks), as a bipartite graph of sends and
            # receives does.
            alike[key] = colour_rounds(ranked, ranked_order)
        for r, entries in enumerate(alike[key]):
            if r == len(merged):
                merged.append([])
            merged[r].extend([((senders[s], receivers[d]), k) for (s, d), k in entries])
    return [sorted(entries) for entries in merged]


class _PartColour:
    """Colours one part's graphs as `colour_rounds` colours them inside a stage of several
    parts (`_parted_rounds`): by `_colour_parts` even when they are in one part (there, each
    is ranked on its own first, and may fall apart again ranked), remembered beside the
    stage's other colourings. ``asked`` records, call by call, whether a call had edges: a
    stage whose call had edges in one part only was coloured whole by `colour_rounds`
    directly, so `_parted_rounds` then gives way to the whole stage."""

    def __init__(self, memo: _ColourMemo | None) -> None:
        self.memo = memo if memo is not None else _ColourMemo()
        self.asked: list[bool] = []

    def __call__(
        self,
        multiplicity: Mapping[tuple[int, int], int],
        order: Sequence[tuple[int, int]] | None = None,
    ) -> list[list[tuple[tuple[int, int], int]]]:
        self.asked.append(bool(multiplicity))
        return self.memo.remembered(multiplicity, order, _colour_as_part)


def _colour_as_part(
    multiplicity: Mapping[tuple[int, int], int], order: Sequence[tuple[int, int]] | None = None
) -> list[list[tuple[tuple[int, int], int]]]:
    """`colour_rounds` of a graph among other parts of a larger one (`_colour_parts`)."""
    return _colour_parts(_components(multiplicity), order)


def _colour_connected(
    multiplicity: Mapping[tuple[int, int], int],
    order: Sequence[tuple[int, int]] | None = None,
) -> list[list[tuple[tuple[int, int], int]]]:
    """`colour_rounds` of a graph found to be in one part."""
    # A multigraph whose multiplicities share a factor g is g copies of a smaller one: colour
    # that once and run each of its rounds g times (the pairs of one fan-out group all carry
    # the same number of chunks: thousands of chunks become a few edges).
    g = functools.reduce(math.gcd, multiplicity.values(), 0)
    base = min(multiplicity.values(), default=0)
    if g == 1 and base > 1 and order is None:
        # Nearly equal multiplicities (one fan-out group's parts differ by a chunk): colour
        # every pair once, run those rounds ``base`` times, then colour what is left. Used only
        # where it needs no more rounds than the whole: the once-each graph is regular.
        once = {p: 1 for p in multiplicity}
        rest = {p: n - base for p, n in multiplicity.items() if n > base}
        if base * _max_degree(once) + _max_degree(rest) == _max_degree(multiplicity):
            each = _colour_connected(once)  # (the same pairs: one part)
            repeated = [[(p, copy) for p, _ in entries] for copy in range(base) for entries in each]
            left = colour_rounds(rest) if rest else []
            return repeated + [[(p, base + k) for p, k in entries] for entries in left]
    if g > 1:
        reduced = _colour_connected({p: n // g for p, n in multiplicity.items()}, order)
        return [  # copy c moves chunks c * n/g .. of each pair, in stream order
            [(p, copy * (multiplicity[p] // g) + k) for p, k in entries]
            for copy in range(g)
            for entries in reduced
        ]
    colours = _max_degree(multiplicity)
    every = (1 << colours) - 1
    g = _Colouring()
    used_src, used_dst, at_src, at_dst = g.used_src, g.used_dst, g.at_src, g.at_dst
    for s, d in order if order is not None else sorted(multiplicity):
        n = multiplicity[s, d]
        while n:
            common = every & ~(used_src[s] | used_dst[d])
            if common:  # colours free at both ends: no recolouring needed (`_Colouring.add`,
                # inlined: millions of chunks at scale)
                to_d, to_s, free = at_src[s], at_dst[d], common
                while n and common:
                    c = (common & -common).bit_length() - 1  # the lowest free colour
                    common &= common - 1
                    to_d[c] = d
                    to_s[c] = s
                    n -= 1
                used_src[s] |= free ^ common  # (the colours just taken)
                used_dst[d] |= free ^ common
            if n:  # none left: free a colour at d by swapping two along an alternating path
                a, b = _lowest_free(used_src[s]), _lowest_free(used_dst[d])
                g.swap_path(d, a, b)
                g.add(s, d, a)
                n -= 1
    # Senders in order, each its colours in order: each round's entries come out in pair
    # order (a sender sends once a round), and a pair's k-th round carries its chunk k.
    rounds: list[list[tuple[tuple[int, int], int]]] = [[] for _ in range(colours)]
    for s in sorted(g.at_src):
        by_colour = g.at_src[s]
        chunks: dict[int, int] = {}  # receiver -> chunks of (s, receiver) placed so far
        for c in sorted(by_colour):
            d = by_colour[c]
            k = chunks.get(d, 0)
            chunks[d] = k + 1
            rounds[c].append(((s, d), k))
    return rounds


def _max_degree(multiplicity: Mapping[tuple[int, int], int]) -> int:
    """The most chunks one device sends, or receives."""
    send: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    for (s, d), n in multiplicity.items():
        send[s] += n
        recv[d] += n
    return max([*send.values(), *recv.values(), 0])


def _components(
    multiplicity: Mapping[tuple[int, int], int],
) -> list[dict[tuple[int, int], int]]:
    """The pairs split into groups that share no device (union-find on device ids, with path
    halving, written out inline: a 4,096-device stage has ~10^5 pairs), each in sorted pair
    order, the groups in order of their first pair."""
    parent: dict[int, int] = {}
    pairs = sorted(multiplicity)
    for s, d in pairs:
        a = parent.setdefault(s, s)
        while a != parent[a]:
            parent[a] = a = parent[parent[a]]
        b = parent.setdefault(d, d)
        while b != parent[b]:
            parent[b] = b = parent[parent[b]]
        if a != b:
            parent[max(a, b)] = min(a, b)
    groups: dict[int, dict[tuple[int, int], int]] = {}
    for pair in pairs:
        a = pair[0]
        while a != parent[a]:
            parent[a] = a = parent[parent[a]]
        groups.setdefault(a, {})[pair] = multiplicity[pair]
    return list(groups.values())


def _lowest_free(used: int) -> int:
    return (~used & (used + 1)).bit_length() - 1


class _Colouring:
    """A partial proper edge colouring: per device, colour -> peer, and a mask of used colours."""

    def __init__(self) -> None:
        self.at_src: dict[int, dict[int, int]] = defaultdict(dict)  # sender -> colour -> receiver
        self.at_dst: dict[int, dict[int, int]] = defaultdict(dict)  # receiver -> colour -> sender
        self.used_src: dict[int, int] = defaultdict(int)
        self.used_dst: dict[int, int] = defaultdict(int)

    def add(self, s: int, d: int, c: int) -> None:
        self.at_src[s][c] = d
        self.at_dst[d][c] = s
        self.used_src[s] |= 1 << c
        self.used_dst[d] |= 1 << c

    def swap_path(self, d: int, a: int, b: int) -> None:
        """Swap colours a and b along the path leaving receiver ``d`` by its ``a`` edge."""
        path: list[tuple[int, int, int]] = []  # (sender, receiver, colour)
        at_src, at_dst = self.at_src, self.at_dst
        node, colour, at_receiver = d, a, True
        while True:
            if at_receiver:
                s = at_dst[node].get(colour)
                if s is None:
                    break
                path.append((s, node, colour))
                node, at_receiver = s, False
            else:
                r = at_src[node].get(colour)
                if r is None:
                    break
                path.append((node, r, colour))
                node, at_receiver = r, True
            colour = b if colour == a else a
        # The path's edges alternate ``a`` and ``b``: each takes the other colour. A node
        # inside the path has an edge of each, which swap, so it keeps both colours; only the
        # path's two ends change theirs: receiver ``d`` gives up ``a`` for ``b``, and the last
        # node (``node``, lacking ``colour``) its last edge's colour for ``colour``. (Edge by
        # edge removal and addition cost twice as much: 4 x 10^4 paths at 4,096 GPUs.)
        for s, r, c in path:
            c = b if c == a else a
            at_src[s][c] = r
            at_dst[r][c] = s
        flip = (1 << a) | (1 << b)
        used_src, used_dst = self.used_src, self.used_dst
        del at_dst[d][a]
        used_dst[d] ^= flip
        last = b if colour == a else a
        if at_receiver:
            del at_dst[node][last]
            used_dst[node] ^= flip
        else:
            del at_src[node][last]
            used_src[node] ^= flip


def plan_stats(
    leaves: Sequence[LeafSpec],
    assignment: Assignment,
    schedule: Schedule | RoundPlan,
    *,
    crosses: Callable[[int, int], bool] | None = None,
) -> PlanStats:
    """Count bytes and rounds of a plan (pure arithmetic over the plan's parts).

    ``schedule`` may be a `RoundPlan` (the same rounds without message contents): the counts
    are the same.

    ``crosses(src, dst)`` tells which pairs are in different fast domains; their payload is
    counted in ``bytes_cross_domain``.
    """
    total = sum(box_size(b) * leaf.itemsize for leaf in leaves for b in leaf.dst.boxes)
    local = sum(box_size(c.box) * leaves[c.leaf].itemsize for c in assignment.local)
    # Bytes per (sender, receiver, relayed) first, then everything from those: one dict
    # update per piece (millions at thousands of GPUs), `crosses` asked once per key.
    itemsize = [leaf.itemsize for leaf in leaves]
    by_pair: dict[tuple[int, int, bool], int] = defaultdict(int)
    for p in assignment.sent:
        n = itemsize[p.leaf]
        for start, stop in p.box:  # `box_size` inlined
            n *= stop - start
        by_pair[p.src, p.dst, p.stage > 0 if p.relay is None else p.relay] += n
    # Fans by sender and receivers first: a domain's relays are thousands of fans over a few
    # (importer, others) groups, so each receiver is counted once per group, not per fan.
    by_fan: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)
    for f in assignment.fans:
        n = itemsize[f.leaf]
        for start, stop in f.box:
            n *= stop - start
        by_fan[f.src, f.dsts] += n
    sent_by: dict[int, int] = defaultdict(int)
    recv_by: dict[int, int] = defaultdict(int)
    relayed = cross = relayed_cross = 0
    for (src, dst, from_dst), n in by_pair.items():
        sent_by[src] += n
        recv_by[dst] += n
        relayed += n if from_dst else 0
        if crosses is not None and crosses(src, dst):
            cross += n
            relayed_cross += n if from_dst else 0
    for (src, dsts), n in by_fan.items():
        sent_by[src] += n * len(dsts)
        for d in dsts:
            recv_by[d] += n
        relayed += n * len(dsts)
        if crosses is not None:
            crossing = n * sum(1 for d in dsts if crosses(src, d))
            cross += crossing
            relayed_cross += crossing
    wire = staging = 0
    for rounds in schedule.round_sizes_by_bucket():
        wire += sum(size * messages for size, messages in rounds)
        staging = max(staging, 2 * sum(size for size, _ in rounds))
    return PlanStats(
        bytes_total=total,
        bytes_local=local,
        bytes_lower_bound=total - local,
        bytes_sent=sum(sent_by.values()),
        bytes_wire=wire,
        rounds=schedule.rounds,
        buckets=len(schedule.buckets),
        chunk_bytes=schedule.chunk_bytes,
        max_device_send_bytes=max(sent_by.values(), default=0),
        max_device_recv_bytes=max(recv_by.values(), default=0),
        staging_bytes=staging,
        bytes_relayed=relayed,
        bytes_cross_domain=cross,
        bytes_relayed_cross_domain=relayed_cross,
    )
