"""From sent pieces to collective-permute rounds and bounded buckets.

Pure Python on integer device ids. Every (sender, receiver) pair's pieces are laid end to end in
one byte stream, cut into chunks of one uniform size, and the chunks are coloured into rounds:
in a round each device sends at most one chunk and receives at most one, which is exactly what
one `jax.lax.ppermute` (a partial permutation) can carry. Bipartite edge colouring needs only as
many rounds as the busiest device's chunk count (Konig), which is optimal. Consecutive rounds
form a bucket: one staging buffer per device per direction, at most ``bucket_bytes`` each.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from jaxreshard.layout import Box, box_size, split_flat
from jaxreshard.planner import Assignment, LeafSpec, Piece

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

    def recvs(self, device: int) -> tuple[Message, ...]:
        return tuple(m for m in self.messages if m.dst == device)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """All buckets in execution order (relay stages after the stages they forward from)."""

    chunk_bytes: int
    buckets: tuple[Bucket, ...]

    @property
    def rounds(self) -> int:
        return sum(b.slots for b in self.buckets)


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


def build_schedule(
    leaves: Sequence[LeafSpec],
    pieces: Iterable[Piece],
    *,
    bucket_bytes: int,
    latency_bytes: int | None = None,
) -> Schedule:
    """Lay pieces into chunked streams, colour the chunks into rounds, group rounds in buckets.

    Args:
      leaves: the plan's leaves (for element sizes).
      pieces: what to send; stages run in order, each stage's buckets after the previous one's.
      bucket_bytes: the largest per-device staging buffer (one direction).
      latency_bytes: the fixed cost of one round in byte-equivalents, used to pick the chunk
        size (fewer, larger rounds against padding). Defaults to ``bucket_bytes // 16``.
    """
    by_stage: dict[int, list[Piece]] = defaultdict(list)
    for piece in pieces:
        by_stage[piece.stage].append(piece)
    streams = {
        stage: _streams(leaves, stage_pieces) for stage, stage_pieces in sorted(by_stage.items())
    }
    sizes = {
        (stage, pair): sum(seg.nbytes for seg in stream)
        for stage, pairs in streams.items()
        for pair, stream in pairs.items()
    }
    cap = max(ALIGN, bucket_bytes // ALIGN * ALIGN)
    latency = bucket_bytes // 16 if latency_bytes is None else latency_bytes
    chunk = choose_chunk_bytes(sizes, cap=cap, latency_bytes=latency)
    buckets: list[Bucket] = []
    for _, pairs in sorted(streams.items()):
        chunks = {pair: _cut(stream, chunk) for pair, stream in pairs.items()}
        rounds = _stage_rounds(chunks, chunk)
        group: list[tuple[int, list[tuple[tuple[int, int], int]]]] = []
        for size, entries in rounds:
            if group and sum(s for s, _ in group) + size > cap:
                buckets.append(_bucket(group, chunks))
                group = []
            group.append((size, entries))
        if group:
            buckets.append(_bucket(group, chunks))
    return Schedule(chunk, tuple(buckets))


def _stage_rounds(
    chunks: Mapping[tuple[int, int], list[tuple[Segment, ...]]], chunk: int
) -> list[tuple[int, list[tuple[tuple[int, int], int]]]]:
    """Rounds of one stage as ``(slot_bytes, [((src, dst), chunk_index), ...])``.

    Full chunks are coloured together into rounds of ``chunk`` bytes. Each stream's last,
    partial chunk (its tail) is coloured separately, largest tails first, into rounds sized to
    their largest tail: tails of small leaves then ride in small rounds instead of being padded
    to a full chunk.
    """
    full = {pair: sum(1 for c in cs if _nbytes(c) == chunk) for pair, cs in chunks.items()}
    tails = {pair: _nbytes(cs[-1]) for pair, cs in chunks.items() if _nbytes(cs[-1]) < chunk}
    out = [(chunk, entries) for entries in colour_rounds({p: n for p, n in full.items() if n})]
    order = sorted(tails, key=lambda p: (-tails[p], p))
    for entries in colour_rounds({p: 1 for p in order}, order=order):
        located = [(pair, full[pair]) for pair, _ in entries]
        out.append((_align(max(tails[pair] for pair, _ in entries)), located))
    return out


def _nbytes(segments: Sequence[Segment]) -> int:
    return sum(s.nbytes for s in segments)


def _bucket(
    group: Sequence[tuple[int, list[tuple[tuple[int, int], int]]]],
    chunks: Mapping[tuple[int, int], list[tuple[Segment, ...]]],
) -> Bucket:
    messages = [
        Message(slot, pair[0], pair[1], chunks[pair][k])
        for slot, (_, entries) in enumerate(group)
        for pair, k in entries
    ]
    return Bucket(tuple(size for size, _ in group), tuple(messages))


def _streams(
    leaves: Sequence[LeafSpec], pieces: Iterable[Piece]
) -> dict[tuple[int, int], list[Segment]]:
    """Each pair's pieces end to end, widest elements first so every element stays aligned."""
    pairs: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for p in pieces:
        pairs[p.src, p.dst].append(p)
    out = {}
    for pair, ps in sorted(pairs.items()):
        ps.sort(key=lambda p: (-leaves[p.leaf].itemsize, p.leaf, p.box))
        offset, stream = 0, []
        for p in ps:
            nbytes = box_size(p.box) * leaves[p.leaf].itemsize
            stream.append(Segment(p.leaf, p.box, offset, nbytes, p.from_dst))
            offset += nbytes
        out[pair] = stream
    return out


def _cut(stream: Sequence[Segment], chunk: int) -> list[tuple[Segment, ...]]:
    """Cut a stream into chunks of ``chunk`` bytes; a piece crossing a boundary is split into
    boxes (``split_flat``) so each part is still a plain slice of its shard."""
    total = sum(s.nbytes for s in stream)
    chunks: list[list[Segment]] = [[] for _ in range(math.ceil(total / chunk))]
    for seg in stream:
        item = seg.nbytes // box_size(seg.box)
        start = seg.offset
        while start < seg.offset + seg.nbytes:
            k = start // chunk
            stop = min(seg.offset + seg.nbytes, (k + 1) * chunk)
            first, last = (start - seg.offset) // item, (stop - seg.offset) // item
            at = start - k * chunk
            for part in split_flat(seg.box, first, last):
                n = box_size(part) * item
                chunks[k].append(Segment(seg.leaf, part, at, n, seg.from_dst))
                at += n
            start = stop
    return [tuple(c) for c in chunks]


def choose_chunk_bytes(
    sizes: Mapping[tuple[int, tuple[int, int]], int], *, cap: int, latency_bytes: int
) -> int:
    """The chunk size minimising the modeled time: per round, its size plus a latency.

    ``sizes`` maps ``(stage, (sender, receiver))`` to stream bytes. Candidates are even
    divisions of the largest streams (so equal streams split with no padding) and the cap.
    Every candidate is a multiple of `ALIGN` and at most ``cap``.
    """
    if not sizes:
        return cap
    distinct = sorted(set(sizes.values()), reverse=True)[:8]
    candidates = {cap}
    for size in distinct:
        for k in range(1, 65):
            c = _align(math.ceil(size / k))
            if c <= cap:
                candidates.add(c)

    def cost(c: int) -> tuple[int, int]:
        return (_modeled_time(sizes, c, latency_bytes), -c)

    return min(candidates, key=cost)


def _modeled_time(
    sizes: Mapping[tuple[int, tuple[int, int]], int], chunk: int, latency: int
) -> int:
    """Byte-equivalent time of the rounds `_stage_rounds` would make with this chunk size."""
    full: dict[tuple[int, str, int], int] = defaultdict(int)
    tail: dict[tuple[int, str, int], int] = defaultdict(int)
    largest_tail: dict[int, int] = defaultdict(int)
    for (stage, (src, dst)), size in sizes.items():
        n, rest = divmod(size, chunk)
        full[stage, "send", src] += n
        full[stage, "recv", dst] += n
        if rest:
            tail[stage, "send", src] += 1
            tail[stage, "recv", dst] += 1
            largest_tail[stage] = max(largest_tail[stage], rest)
    total = 0
    for stage in {key[0] for key in (*full, *tail)}:
        n_full = max((v for k, v in full.items() if k[0] == stage), default=0)
        n_tail = max((v for k, v in tail.items() if k[0] == stage), default=0)
        total += n_full * (chunk + latency) + n_tail * (_align(largest_tail[stage]) + latency)
    return total


def _align(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


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
    """
    send_deg: dict[int, int] = defaultdict(int)
    recv_deg: dict[int, int] = defaultdict(int)
    for (s, d), n in multiplicity.items():
        send_deg[s] += n
        recv_deg[d] += n
    colours = max([*send_deg.values(), *recv_deg.values(), 0])
    at_src: dict[int, dict[int, int]] = defaultdict(dict)  # sender -> colour -> receiver
    at_dst: dict[int, dict[int, int]] = defaultdict(dict)  # receiver -> colour -> sender
    for s, d in order if order is not None else sorted(multiplicity):
        for _ in range(multiplicity[s, d]):
            a = _free(at_src[s], colours)
            b = _free(at_dst[d], colours)
            if a not in at_dst[d]:
                c = a
            elif b not in at_src[s]:
                c = b
            else:
                _swap_path(at_src, at_dst, d, a, b)
                c = a
            at_src[s][c] = d
            at_dst[d][c] = s
    rounds: list[list[tuple[int, int]]] = [[] for _ in range(colours)]
    for s, by_colour in at_src.items():
        for c, d in by_colour.items():
            rounds[c].append((s, d))
    seen: dict[tuple[int, int], int] = defaultdict(int)
    out = []
    for pairs in rounds:
        entries = []
        for pair in sorted(pairs):
            entries.append((pair, seen[pair]))
            seen[pair] += 1
        out.append(entries)
    return out


def _free(used: dict[int, int], colours: int) -> int:
    return next(c for c in range(colours) if c not in used)


def _swap_path(
    at_src: dict[int, dict[int, int]], at_dst: dict[int, dict[int, int]], d: int, a: int, b: int
) -> None:
    """Swap colours a and b along the path leaving receiver ``d`` by its ``a`` edge."""
    path: list[tuple[int, int, int]] = []  # (sender, receiver, colour)
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
    for s, r, c in path:
        del at_src[s][c]
        del at_dst[r][c]
    for s, r, c in path:
        other = b if c == a else a
        at_src[s][other] = r
        at_dst[r][other] = s


def plan_stats(leaves: Sequence[LeafSpec], assignment: Assignment, schedule: Schedule) -> PlanStats:
    """Count bytes and rounds of a plan (pure arithmetic over the plan's parts)."""
    total = sum(box_size(b) * leaf.itemsize for leaf in leaves for b in leaf.dst.boxes)
    local = sum(box_size(c.box) * leaves[c.leaf].itemsize for c in assignment.local)
    sent_by: dict[int, int] = defaultdict(int)
    recv_by: dict[int, int] = defaultdict(int)
    relayed = 0
    for p in assignment.pieces:
        n = box_size(p.box) * leaves[p.leaf].itemsize
        sent_by[p.src] += n
        recv_by[p.dst] += n
        relayed += n if p.from_dst else 0
    wire = sum(b.slot_bytes[m.slot] for b in schedule.buckets for m in b.messages)
    staging = 2 * max((b.buffer_bytes for b in schedule.buckets), default=0)
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
    )
