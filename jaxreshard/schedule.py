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

    Every participating device holds a send buffer and a receive buffer of
    ``slots * chunk_bytes`` bytes; slot ``t`` of a buffer is the chunk of round ``t``.
    """

    slots: int
    chunk_bytes: int
    messages: tuple[Message, ...]

    @property
    def buffer_bytes(self) -> int:
        return self.slots * self.chunk_bytes

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
      chunk_bytes: the uniform message size of one round.
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
        rounds = colour_rounds({pair: len(c) for pair, c in chunks.items()})
        per_bucket = max(1, cap // chunk)
        for first in range(0, len(rounds), per_bucket):
            group = rounds[first : first + per_bucket]
            messages = []
            for slot, pairs_in_round in enumerate(group):
                for pair, k in pairs_in_round:
                    messages.append(Message(slot, pair[0], pair[1], chunks[pair][k]))
            buckets.append(Bucket(len(group), chunk, tuple(messages)))
    return Schedule(chunk, tuple(buckets))


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
    """The uniform chunk size minimising ``rounds * (chunk + latency)``.

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
        return (_rounds(sizes, c) * (c + latency_bytes), -c)

    return min(candidates, key=cost)


def _rounds(sizes: Mapping[tuple[int, tuple[int, int]], int], chunk: int) -> int:
    per_stage: dict[int, int] = {}
    degree: dict[tuple[int, str, int], int] = defaultdict(int)
    for (stage, (src, dst)), size in sizes.items():
        n = math.ceil(size / chunk)
        degree[stage, "send", src] += n
        degree[stage, "recv", dst] += n
    for (stage, _, _), d in degree.items():
        per_stage[stage] = max(per_stage.get(stage, 0), d)
    return sum(per_stage.values())


def _align(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


def colour_rounds(
    multiplicity: Mapping[tuple[int, int], int],
) -> list[list[tuple[tuple[int, int], int]]]:
    """Colour a bipartite multigraph's edges with as many colours as its maximum degree.

    ``multiplicity[(s, d)]`` is the number of chunks ``s`` sends ``d``. Returns, per round, the
    ``((s, d), k)`` entries meaning "chunk ``k`` of pair ``(s, d)`` moves in this round"; every
    round is a partial permutation. Konig's alternating-path method: give an edge a colour free
    at both ends, first swapping two colours along an alternating path when needed.
    """
    send_deg: dict[int, int] = defaultdict(int)
    recv_deg: dict[int, int] = defaultdict(int)
    for (s, d), n in multiplicity.items():
        send_deg[s] += n
        recv_deg[d] += n
    colours = max([*send_deg.values(), *recv_deg.values(), 0])
    at_src: dict[int, dict[int, int]] = defaultdict(dict)  # sender -> colour -> receiver
    at_dst: dict[int, dict[int, int]] = defaultdict(dict)  # receiver -> colour -> sender
    for (s, d), n in sorted(multiplicity.items()):
        for _ in range(n):
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
    wire = sum(b.chunk_bytes * len(b.messages) for b in schedule.buckets)
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
