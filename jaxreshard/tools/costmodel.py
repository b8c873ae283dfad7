"""A cost model for reshard schedules on a `Topology`: modeled time, lower bound, baselines.

The model (pure arithmetic, no devices):

- A *link* is a device's connection to another device: inside its fast domain it moves
  ``topology.intra_bandwidth`` bytes/s, across domains ``topology.inter_bandwidth`` (one NIC
  per device). Links are full duplex and the fabrics non-blocking.
- A schedule runs its collective-permute rounds one after the other. In a round every device
  sends at most one message and receives at most one, all of the round's slot size; the round
  lasts as long as its slowest message, ``slot_bytes / bandwidth``, plus ``round_latency``.
  Modeled time is the sum over rounds (`schedule_cost`).
- The *lower bound* (`lower_bound`) holds for any schedule in this model in which destination
  devices are the only receivers (sources only send, as in every reshard scheme here and in
  NCCL's): a device receives one message at a time, and a domain takes bytes in only through
  its destination devices' NICs. See `lower_bound` for the terms.
- The *baselines* are priced in the same model, each as the best its own scheme can do there
  (bandwidth-optimal, pipelined collectives with one channel per NIC), so the speedups reported
  against them are conservative: `allgather_broadcast`, `rank0_broadcast`, `direct`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence

from jaxreshard.planning.layout import box_size
from jaxreshard.planning.route import LeafSpec
from jaxreshard.planning.schedule import RoundPlan, Schedule
from jaxreshard.planning.topology import Topology


@dataclasses.dataclass(frozen=True)
class ScheduleCost:
    """Modeled time of a schedule and what it is made of.

    Attributes:
      seconds: sum over rounds of (slot bytes / slowest link in the round + round latency).
      rounds: collective-permute rounds.
      slow_rounds: rounds with at least one cross-domain message.
      wire_bytes_cross: bytes on cross-domain links, padding included.
      wire_bytes_intra: bytes on links inside domains, padding included.
    """

    seconds: float
    rounds: int
    slow_rounds: int
    wire_bytes_cross: int
    wire_bytes_intra: int


def schedule_cost(schedule: Schedule | RoundPlan, topology: Topology) -> ScheduleCost:
    """Price every round of ``schedule`` (or of its `RoundPlan`: the same rounds): its slot
    size over its slowest message's bandwidth, plus the round latency."""
    seconds, rounds, slow = 0.0, 0, 0
    wire = {True: 0, False: 0}
    for bucket in schedule.rounds_by_bucket():
        for size, pairs in bucket:
            n_cross = sum(topology.crosses(s, d) for s, d in pairs)
            wire[True] += n_cross * size
            wire[False] += (len(pairs) - n_cross) * size
            bandwidth = topology.inter_bandwidth if n_cross else topology.intra_bandwidth
            seconds += size / bandwidth + topology.round_latency
            slow += n_cross > 0
            rounds += 1
    return ScheduleCost(seconds, rounds, slow, wire[True], wire[False])


@dataclasses.dataclass(frozen=True)
class LowerBound:
    """A lower bound on the time of any schedule moving the leaves (see `lower_bound`).

    Attributes:
      seconds: the largest term, plus one round latency.
      binding: which term it is, in words.
      bytes_cross_needed: bytes that must enter some domain from outside: for each domain, the
        distinct bytes its destination devices lack that no device of it holds.
    """

    seconds: float
    binding: str
    bytes_cross_needed: int


def lower_bound(leaves: Sequence[LeafSpec], topology: Topology) -> LowerBound:
    """The largest of these times (each a floor under every schedule in the model):

    - each destination device's missing bytes over the intra-domain bandwidth (its fastest);
    - each source device's bytes that only it holds and someone else needs, likewise;
    - per domain ``g`` with ``n`` destination devices, lacking ``need`` bytes in total of which
      ``cross`` distinct bytes exist nowhere in ``g``: each cross byte is received over a NIC at
      least once and every other missing byte over some link, one message at a time per device:
      ``(cross / inter + (need - cross) / intra) / n``;
    - per domain, the distinct bytes only it holds that another domain needs, over the NICs of
      all its devices taking part.

    A byte needed by several domains is counted once per receiving domain (it must enter each)
    but once in total when leaving its domain (it could be relayed on outside).
    """
    p = _profile(leaves, topology)
    bi, bx = topology.intra_bandwidth, topology.inter_bandwidth
    terms: list[tuple[float, str]] = [(0.0, "nothing to move")]
    terms += [(n / bi, f"device {d} receives") for d, n in p.need.items()]
    terms += [(n / bi, f"device {s} sends what only it holds") for s, n in p.sole_out.items()]
    need_in: dict[int, int] = defaultdict(int)
    for d, n in p.need.items():
        need_in[topology.domain_of[d]] += n
    for g, receivers in p.receivers.items():
        cross = p.cross_in.get(g, 0)
        t = (cross / bx + (need_in[g] - cross) / bi) / len(receivers)
        terms.append((
            t,
            f"domain {g}'s {len(receivers)} receivers take {cross / 1e9:.2f} GB from other "
            f"domains and {(need_in[g] - cross) / 1e9:.2f} GB more inside",
        ))  # fmt: skip
    for g, n in p.cross_out.items():
        t = n / (len(p.participants[g]) * bx)
        terms.append((
            t,
            f"domain {g} sends out {n / 1e9:.2f} GB only it holds through "
            f"{len(p.participants[g])} NICs",
        ))  # fmt: skip
    seconds, binding = max(terms)
    if seconds > 0:
        seconds += topology.round_latency
    return LowerBound(seconds, binding, sum(p.cross_in.values()))


# -------------------------------------------------------------------------------- baselines


def allgather_broadcast(leaves: Sequence[LeafSpec], topology: Topology) -> float:
    """All-gather then broadcast, the common default: every source device all-gathers the full
    arrays, then the first source device broadcasts them to every destination device, which
    keeps its slice.

    Priced as bandwidth-optimal pipelined collectives: the all-gather takes the longest of each
    source device receiving what it lacks (intra bandwidth) and each domain importing what its
    source devices lack through their NICs; the broadcast the longest of each destination
    device receiving the full arrays, each destination domain importing them through its
    destination devices' NICs, and the root's domain exporting them through the NICs of the
    communicator's devices there (the root and any destination device beside it). One round
    latency per ring step.
    """
    full = sum(math.prod(leaf.shape) * leaf.itemsize for leaf in leaves)
    bi, bx = topology.intra_bandwidth, topology.inter_bandwidth
    src = sorted({d for leaf in leaves for d in leaf.src.devices})
    dst = sorted({d for leaf in leaves for d in leaf.dst.devices})
    dom = topology.domain_of
    own: dict[int, int] = defaultdict(int)
    held_in: dict[int, int] = defaultdict(int)
    for leaf in leaves:
        for box, replicas in leaf.src.replicas.items():
            nbytes = box_size(box) * leaf.itemsize
            for s in replicas:
                own[s] += nbytes
            for g in {dom[s] for s in replicas}:
                held_in[g] += nbytes
    src_in: dict[int, int] = defaultdict(int)
    for s in src:
        src_in[dom[s]] += 1
    gather = max(
        [(full - own[s]) / bi for s in src]
        + [(full - held_in[g]) / (n * bx) for g, n in src_in.items() if full > held_in[g]]
    )
    root = src[0]
    dst_in: dict[int, int] = defaultdict(int)
    for d in dst:
        dst_in[dom[d]] += d != root
    times = [full / bi]
    for g, n in dst_in.items():
        if g != dom[root] and n:
            times.append(full / (n * bx))
    if any(dom[d] != dom[root] for d in dst):
        times.append(full / ((1 + dst_in[dom[root]]) * bx))
    broadcast = max(times)
    latency = (len(src) - 1 + len(dst)) * topology.round_latency
    return gather + broadcast + latency


def rank0_broadcast(leaves: Sequence[LeafSpec], topology: Topology) -> float:
    """Everything through one device: the first source device gathers the full arrays (from a
    holder in its own domain where there is one), then sends every destination device its
    shard, one message at a time over its own links ("one link carries everything")."""
    dom = topology.domain_of
    bi, bx = topology.intra_bandwidth, topology.inter_bandwidth
    root = min(d for leaf in leaves for d in leaf.src.devices)
    seconds, messages = 0.0, 0
    for leaf in leaves:
        for box, replicas in leaf.src.replicas.items():
            if root in replicas:
                continue
            near = any(dom[s] == dom[root] for s in replicas)
            seconds += box_size(box) * leaf.itemsize / (bi if near else bx)
            messages += 1
        for d, box in zip(leaf.dst.devices, leaf.dst.boxes, strict=True):
            if d != root:
                seconds += box_size(box) * leaf.itemsize / topology.bandwidth(root, d)
                messages += 1
    return seconds + messages * topology.round_latency


def direct(leaves: Sequence[LeafSpec], topology: Topology, *, chunk_bytes: int) -> float:
    """Direct point-to-point without balancing or fan-out: every destination device fetches
    each part it lacks from the first device (lowest id) holding it, whatever its domain.

    Priced generously as the busiest device's serial link time, sending or receiving (no round
    schedule of these messages can be shorter), plus a round latency per ``chunk_bytes`` of
    that device's traffic.
    """
    send: dict[int, float] = defaultdict(float)
    recv: dict[int, float] = defaultdict(float)
    sent: dict[int, int] = defaultdict(int)
    got: dict[int, int] = defaultdict(int)
    for leaf in leaves:
        for dst_box, holders in leaf.dst.replicas.items():
            for _, replicas, common in leaf.src.overlapping(dst_box):
                nbytes = box_size(common) * leaf.itemsize
                for d in holders:
                    if d in replicas:
                        continue
                    s = replicas[0]
                    t = nbytes / topology.bandwidth(s, d)
                    send[s] += t
                    recv[d] += t
                    sent[s] += nbytes
                    got[d] += nbytes
    if not send:
        return 0.0
    busiest = max(*send.values(), *recv.values())
    rounds = max(math.ceil(n / chunk_bytes) for n in (*sent.values(), *got.values()))
    return busiest + rounds * topology.round_latency


# ------------------------------------------------------------------------------------ helpers


@dataclasses.dataclass
class _Profile:
    need: dict[int, int]
    sole_out: dict[int, int]
    cross_in: dict[int, int]
    cross_out: dict[int, int]
    receivers: dict[int, set[int]]
    participants: dict[int, set[int]]


def _profile(leaves: Sequence[LeafSpec], topology: Topology) -> _Profile:
    """Per device and per domain byte counts behind `lower_bound` (from the layouts alone)."""
    topology.check_covers(
        {d for leaf in leaves for layout in (leaf.src, leaf.dst) for d in layout.devices}
    )
    dom = topology.domain_of
    p = _Profile(
        defaultdict(int), defaultdict(int), defaultdict(int), defaultdict(int),
        defaultdict(set), defaultdict(set),
    )  # fmt: skip
    for leaf in leaves:
        for d in leaf.dst.devices:
            p.receivers[dom[d]].add(d)
            p.participants[dom[d]].add(d)
        for s in leaf.src.devices:
            p.participants[dom[s]].add(s)
        for dst_box, holders in leaf.dst.replicas.items():
            for _, replicas, common in leaf.src.overlapping(dst_box):
                nbytes = box_size(common) * leaf.itemsize
                wanting = [d for d in holders if d not in replicas]
                if not wanting:
                    continue
                for d in wanting:
                    p.need[d] += nbytes
                held = {dom[s] for s in replicas}
                for g in {dom[d] for d in wanting} - held:
                    p.cross_in[g] += nbytes
                if len(held) == 1 and any(dom[d] not in held for d in wanting):
                    p.cross_out[next(iter(held))] += nbytes
                if len(replicas) == 1:
                    p.sole_out[replicas[0]] += nbytes
    return p
