"""A cost model for reshard schedules on a cluster: modeled time, physical bound, baselines.

Pure arithmetic on integer device ids (no devices). Bandwidths and costs come from a
`Topology` (the fabric the planner saw) and a `Profile` (what a run pays beyond the wire).

- **Modeled time** (`modeled_time`) prices a schedule the way the executor runs it: bucket after
  bucket, each a pack (senders copy into staging), its collective-permute rounds, and an
  unpack (receivers copy out), plus launches, host work per bucket and the local copies; on
  GPUs with a clock per device (the next bucket's packs run beside the last one's unpacks on
  other devices), on CPU one bucket after the other. A round lasts as long as its slowest
  message at the link's *efficiency* (a fraction of peak), plus the round latency.
  `schedule_cost` is the rounds alone at peak bandwidth: the planner's own objective, not a
  prediction.
- **Physical bound** (`physical_bound`) holds for *any* schedule on the hardware, at peak
  bandwidth, every link of every device running at once:

  ``max( need(d) / (B_nvl + B_nic)`` over destination devices ``d``,
  ``only(s) / (B_nvl + B_nic)`` over source devices ``s`` (bytes only ``s`` holds that another
  device needs), ``import(g) / (N(g) B_nic)`` and ``export(g) / (N(g) B_nic)`` over domains
  ``g`` ``)``

  where ``import(g)`` counts the distinct bytes some destination device of ``g`` lacks and no
  device of ``g`` holds, ``export(g)`` the distinct bytes only ``g`` holds that another domain
  needs, and ``N(g)`` every device of ``g`` in the cluster (trainer GPUs' NICs may import too).
  `round_model_bound` is a bound only for schedules whose receivers are the destination devices
  and take one message at a time: it is kept, under that name, for the planner's tests.
- **Executor floor** (`executor_floor`) holds for any plan *this executor* runs, links at the
  profile's efficiency ``e`` and copies at ``C`` bytes/s per device. Pack and unpack are
  programs of their own on a device's one stream, so a device's copies add to its rounds:

  ``max( max(need(d), only(d)) / (e B_nvl + e B_nic) + (need(d) + only(d)) / C`` over
  devices ``d``, and over domains ``g`` the least over ``m >= import(g)`` of
  ``max(m, export(g)) / (N(g) e B_nic) + (needs(g) + max(0, needs(g) - m) / (N(g) - 1) +
  export(g)) / (N(g) C)`` ``)``

  where ``m`` is what the domain's NICs bring in and ``needs(g)`` the sum of ``need(d)`` over
  its devices: every byte a device lacks is unpacked by it, what the NICs did not bring came
  from the domain's own devices (each message packed by its sender, once however many of
  its ``N(g) - 1`` peers it goes to: `lower.Step.shared`), exports are packed, and the
  busiest device of a domain does at least the average. Where the backend runs a
  program's collective-permutes one after another (`Profile.permutes_overlap` false: XLA GPU,
  CPU) a device takes one message at a time, so its links add instead of sharing the load:
  the device term's ``e B_nvl + e B_nic`` becomes the faster link alone, and the domain term
  adds ``max(0, needs(g) - m) / (N(g) e B_nvl)``, the bytes its devices send each other after
  (or before) their NICs' share. Above `physical_bound` by the links' efficiency, the copies
  and (serial permutes) the lanes in turn; below `modeled_time`, which adds latency,
  launches, host work and the plan's own unevenness.
- **Baselines**, each the best its own scheme can do in the same model (links at the same
  efficiency; no pack or per-bucket costs unless said), so the ratios against them are
  conservative: `allgather_broadcast` (every trainer NIC a root, pipelined chunks),
  `direct_round_robin` (point-to-point, sources in turn), `m2n_like` (balanced senders, one
  fan-out inside each domain, stages in order: the NCCL M2N scheme), and `rank0_broadcast`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from jaxreshard.planning.layout import box_shape, box_size, contiguous_runs
from jaxreshard.planning.route import Assignment, LeafSpec, LocalCopy
from jaxreshard.planning.schedule import RoundPlan, Schedule, Unit
from jaxreshard.planning.topology import Profile, Topology

Pair = tuple[int, int]
"""``(sender, receiver)`` device ids."""

WholeStep = Sequence[tuple[int, Sequence[Pair]]]
"""A whole-shard step's rounds (`planning.whole.step_rounds`): each its slot's bytes and its
``(sender, receiver)`` device pairs."""


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
    for bucket in _buckets(schedule):
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


def round_model_bound(leaves: Sequence[LeafSpec], topology: Topology) -> LowerBound:
    """A bound for the schedules this planner's round model makes (destination devices are the
    only receivers, each takes one message at a time, and a domain takes bytes in only through
    its destination devices' NICs): not a hardware bound (see `physical_bound`). The largest
    of:

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


def physical_bound(
    leaves: Sequence[LeafSpec], topology: Topology, profile: Profile | None = None
) -> LowerBound:
    """A floor under any schedule on this hardware (formula in the module docstring).

    Every device's NVLink and NIC run at peak at once; any NIC of a domain may import (a
    byte can enter through one device and be relayed over NVLink); a byte needed in several
    domains must enter each of them but leaves its own domain once (it could be relayed on
    outside). No latency or per-bucket cost is added: it is a pure bandwidth bound. With a
    ``profile``, the same bound with every link at that profile's efficiency (what no
    schedule beats once links run at the speed the profile says they reach).
    """
    return _physical(_profile(leaves, topology), topology, profile)


def executor_floor(leaves: Sequence[LeafSpec], topology: Topology, profile: Profile) -> LowerBound:
    """A floor under any plan *this executor* can run, with links at ``profile``'s
    efficiencies and copies at its bandwidth (formula in the module docstring).

    The executor's pack and unpack are programs of their own, and a device runs its programs
    one after the other (one stream), so a device's copies never overlap its rounds: every
    byte a device sends was packed by it into staging, every byte it lacks is unpacked by it
    out of staging, and its rounds take at least its bytes over its links (over both at once
    only where the profile's collective-permutes overlap, `_lanes_at_once`; else one message
    at a time). A domain's NICs share its imports and exports, so its average device does at
    least the average of that work, and the busiest at least as much. Latency, launches and
    host work are left out, and copies are priced at the profile's fastest rate in one run,
    so it bounds `modeled_time` from below whatever the plan. Between it and
    `physical_bound` lie the links' efficiency, the copies and the lanes in turn: what
    copies beside the rounds (inside the transfer program) and collectives in flight at once
    could win back, and no plan can.
    """
    return _floor(_profile(leaves, topology), topology, profile)


@dataclasses.dataclass(frozen=True)
class LowerBounds:
    """The bounds of one set of leaves on one cluster (`lower_bounds`)."""

    physical: LowerBound  # `physical_bound` at peak
    at_efficiency: LowerBound  # `physical_bound` with links at the profile's efficiency
    executor: LowerBound  # `executor_floor`


def lower_bounds(leaves: Sequence[LeafSpec], topology: Topology, profile: Profile) -> LowerBounds:
    """`physical_bound` at peak and at ``profile``'s efficiency, and `executor_floor`,
    counting the leaves' bytes once (at 4,096 GPUs the count takes about a second)."""
    p = _profile(leaves, topology)
    return LowerBounds(
        _physical(p, topology, None), _physical(p, topology, profile), _floor(p, topology, profile)
    )


def _physical(p: _Profile, topology: Topology, profile: Profile | None) -> LowerBound:
    bi, bx = topology.intra_bandwidth, topology.inter_bandwidth
    if profile is not None:
        bi, bx = bi * profile.intra_efficiency, bx * profile.inter_efficiency
    terms: list[tuple[float, str]] = [(0.0, "nothing to move")]
    terms += [
        (n / (bi + bx), f"device {d} receives {n / 1e9:.2f} GB over NVLink + NIC")
        for d, n in p.need.items()
    ]
    terms += [
        (n / (bi + bx), f"device {s} sends {n / 1e9:.2f} GB only it holds")
        for s, n in p.sole_out.items()
    ]
    for g, n in p.cross_in.items():
        nics = len(topology.members[g])
        terms.append((n / (nics * bx), f"domain {g} imports {n / 1e9:.2f} GB over its {nics} NICs"))
    for g, n in p.cross_out.items():
        nics = len(topology.members[g])
        terms.append((
            n / (nics * bx),
            f"domain {g} exports {n / 1e9:.2f} GB only it holds over its {nics} NICs",
        ))  # fmt: skip
    seconds, binding = max(terms)
    return LowerBound(seconds, binding, sum(p.cross_in.values()))


def _lanes_at_once(profile: Profile) -> bool:
    """Whether a device's NIC and NVLink rounds run at the same time in the executor: the
    links allow it and the backend keeps two collective-permutes in flight."""
    return profile.overlap_links and profile.permutes_overlap


def _floor(p: _Profile, topology: Topology, profile: Profile) -> LowerBound:
    bi = topology.intra_bandwidth * profile.intra_efficiency
    bx = topology.inter_bandwidth * profile.inter_efficiency
    at_once = _lanes_at_once(profile)
    # One message at a time (serial permutes): a device's bytes take at least the faster link.
    links = bi + bx if at_once else max(bi, bx)
    # A device's copies at the fastest rate the profile gives any of them: its host's where
    # a host's devices share one (then one device alone may have it all).
    copy = profile.host_copy_bandwidth or profile.copy_bandwidth
    copy = max(copy, profile.narrow_copy_bandwidth or 0.0, profile.contiguous_copy_bandwidth or 0.0)
    terms: list[tuple[float, str]] = [(0.0, "nothing to move")]
    for d in p.need.keys() | p.sole_out.keys():
        need, only = p.need.get(d, 0), p.sole_out.get(d, 0)
        terms.append((
            max(need, only) / links + (need + only) / copy,
            f"device {d} takes {need / 1e9:.2f} GB in and sends {only / 1e9:.2f} GB only it "
            "holds, copying both",
        ))  # fmt: skip
    for g, members in topology.members.items():
        nics = len(members)
        imports, exports = p.cross_in.get(g, 0), p.cross_out.get(g, 0)
        needs = sum(p.need.get(d, 0) for d in members)
        seconds, copies = _domain_floor(
            imports,
            exports,
            needs,
            nics * bx,
            nics * copy,
            None if at_once else nics * bi,
            peers=nics - 1,
        )
        if not seconds:
            continue
        terms.append((
            seconds,
            f"domain {g} takes {imports / 1e9:.2f} GB in and sends {exports / 1e9:.2f} GB "
            f"out over its {nics} NICs, packing and unpacking {copies / 1e9:.2f} GB",
        ))  # fmt: skip
    seconds, binding = max(terms)
    return LowerBound(seconds, binding, sum(p.cross_in.values()))


def _domain_floor(
    imports: int,
    exports: int,
    needs: int,
    nic_rate: float,
    copy_rate: float,
    nvl_rate: float | None = None,
    peers: int = 1,
) -> tuple[float, int]:
    """`executor_floor`'s term of one domain, with its NICs' and its copies' combined rates:
    ``(seconds, bytes copied)``.

    Its NICs carry some ``moved`` bytes in (at least its imports) and its exports out. What
    its devices lack beyond what their NICs brought came from each other, so its devices
    unpack ``needs``, pack the exports, and pack the ``needs - moved`` bytes they send each
    other (at least nothing) at least once for every ``peers`` receivers: a sender packs a
    message once however many peers of its domain it sends it to (`lower.Step.shared`). With
    ``nvl_rate`` (its NVLink's combined rate, where a device takes one message at a time)
    those messages inside the domain add their time to the NICs'. The time is piecewise
    linear in ``moved``, so its least is at a breakpoint: the imports, the exports or the
    needs.
    """

    def priced(moved: int) -> tuple[float, int]:
        inside = max(0, needs - moved)
        copies = needs + -(-inside // max(1, peers)) + exports
        wire = max(moved, exports) / nic_rate + (inside / nvl_rate if nvl_rate else 0.0)
        return wire + copies / copy_rate, copies

    return min(priced(m) for m in (imports, exports, needs) if m >= imports)


# ----------------------------------------------------------------------------- modeled time


@dataclasses.dataclass(frozen=True)
class ModeledTime:
    """A schedule priced as the executor runs it (`modeled_time`), in seconds.

    Attributes:
      seconds: the total: the sum of the parts below.
      transfer: the collective-permute rounds (links at their efficiency, plus latency).
      pack: senders copying into staging, on the critical path.
      unpack: receivers copying out of staging, likewise.
      local: the bytes destination devices copy from their own source shards.
      overhead: what launch gaps and host work add to the devices' copies and rounds.
      buckets: buckets priced.
      rounds: rounds priced.
      latency: the part of ``transfer`` that is the rounds' latency.
    """

    seconds: float
    transfer: float
    pack: float
    unpack: float
    local: float
    overhead: float
    buckets: int
    rounds: int
    latency: float = 0.0

    def parts(self) -> dict[str, float]:
        """The parts of ``seconds`` by name (JSON records)."""
        return {
            "transfer": self.transfer,
            "pack": self.pack,
            "unpack": self.unpack,
            "local": self.local,
            "bucket_overhead": self.overhead,
        }


def modeled_time(
    schedule: Schedule | RoundPlan,
    topology: Topology,
    profile: Profile,
    *,
    leaves: Sequence[LeafSpec] | None = None,
    local: Sequence[LocalCopy] = (),
    units: Sequence[Unit] | None = None,
    steps: Sequence[Sequence[int]] | None = None,
    whole: Sequence[WholeStep] = (),
) -> ModeledTime:
    """Price ``schedule`` bucket by bucket, as the executor runs it.

    A bucket is three kinds of programs (`jaxreshard.run.runtime`): packs over its senders,
    one transfer over the plan's union of devices, unpacks over its receivers, each program a
    launch gap on the devices it runs on. Its rounds are independent collective-permutes of
    the transfer: where the profile has ``overlap_links`` and ``permutes_overlap``, the rounds
    with a cross-domain message (the NIC lane) run beside those inside domains (the NVLink
    lane), and the bucket's transfer is the longer lane; else (XLA GPU, CPU) every round in
    turn. The host does
    ``bucket_overhead`` of work per bucket, plus ``argument_overhead`` per array its programs
    take. How the buckets follow each other depends on the profile:

    - ``host_runs_ahead`` (GPUs): the executor never waits between buckets, and each device
      runs its programs in order (one stream). So a device's clock advances by its own
      copies only: the next bucket's pack on a sender runs while a receiver still unpacks
      the last one. A transfer starts once every device of the union is ready (priced as a
      barrier, though a collective-permute waits only for its pairs), and a device's programs
      start no earlier than the host has dispatched them (`_Timeline`);
    - else (CPU, where the executor waits before each transfer): a bucket is its pack, its
      rounds and its unpack one after the other (the busiest device, or host, for each), plus
      its host work; nothing of one bucket overlaps the next.

    The ``local`` copies come last.

    A round takes ``latency + slot / (bandwidth x efficiency)`` of its slowest link; where the
    profile says a host's devices share its cores (CPU), also at least the round's bytes
    between that host's devices over ``host_link_bandwidth``. Pack and unpack copy, per
    device, what it sends or receives in the bucket (`_Copies`). With a `Schedule` and its
    ``leaves``, each message's segments are counted (bytes, narrow elements, boxes, and the
    rows pack reads and unpack writes: `layout.contiguous_runs`); a `RoundPlan` has no
    segments, so its slots are counted in one box each, as narrow bytes in the share of its
    bucket's unit that narrow leaves make up (with ``units``, the plan's: a bf16 slot copies
    at the bf16 speed, as its segments would), else as wide bytes.

    With ``steps`` (the schedule buckets each step of a call sends, `lower.Step.buckets`),
    buckets a call runs as one joined step are priced as one: the sum of their copies and
    programs' arrays, one host cost, and each round once, as long as the sum of its slots
    (a joined step's slots hold every joined bucket's messages one after the other).

    ``whole``: the plan's whole-shard steps (`planning.whole`), run before the buckets, each
    priced as a bucket of rounds with no copies (its rounds send shards as they are).

    The parts reported add up to ``seconds``: ``pack`` and ``unpack`` are the copies on the
    critical path, and ``overhead`` what launches and host work add to it.
    """
    return modeled_times(
        schedule,
        topology,
        [profile],
        leaves=leaves,
        local=local,
        units=units,
        steps=steps,
        whole=whole,
    )[0]


def modeled_times(
    schedule: Schedule | RoundPlan,
    topology: Topology,
    profiles: Sequence[Profile],
    *,
    leaves: Sequence[LeafSpec] | None = None,
    local: Sequence[LocalCopy] = (),
    units: Sequence[Unit] | None = None,
    steps: Sequence[Sequence[int]] | None = None,
    whole: Sequence[WholeStep] = (),
) -> list[ModeledTime]:
    """`modeled_time` under each of ``profiles``, counting the schedule's copies and rounds
    once (`_counted_buckets`) and pricing that count under every profile: on thousands of
    GPUs the count is most of the cost model's work (the 4,096-GPU plan's six pricings took
    27 s counted once each)."""
    host = topology.host_of
    ids = _DeviceArrays(topology)
    clocks: list[_Timeline | _InTurn] = [
        _Timeline() if p.host_runs_ahead else _InTurn() for p in profiles
    ]
    buckets = rounds = 0
    narrow = _narrow_shares(leaves, units) if leaves is not None and units is not None else None
    counts: Iterable[_Counted] = _counted_buckets(schedule, ids, leaves, narrow)
    if steps is not None:
        every = list(counts)
        counts = [_Counted.joined([every[b] for b in step]) for step in steps if step]
    if whole:
        counts = [*(_counted_whole(step, ids) for step in whole), *counts]
    for counted in counts:
        for clock, p in zip(clocks, profiles, strict=True):
            clock.add(counted.priced(topology, ids, p), p)
        buckets += 1
        rounds += counted.rounds
    copies = _Copies()
    for c in local:
        leaf = leaves[c.leaf] if leaves is not None else None
        if leaf is None:
            copies.add(c.device, box_size(c.box), narrow=False)
            continue
        runs = max(  # a local copy reads rows of its source shard into rows of its destination
            contiguous_runs(c.box, _shard_shape(leaf, from_dst=False)),
            contiguous_runs(c.box, _shard_shape(leaf, from_dst=True)),
        )
        nbytes = box_size(c.box) * leaf.itemsize
        copies.add(c.device, nbytes, narrow=_narrow(leaf), runs=runs, casts=_casts(leaf))
    out = []
    for clock, profile in zip(clocks, profiles, strict=True):
        local_s = copies.time(host, profile)
        path = clock.critical_path()
        out.append(
            ModeledTime(
                path.total + local_s,
                path.transfer,
                path.pack,
                path.unpack,
                local_s,
                path.overhead,
                buckets,
                rounds,
                path.latency,
            )
        )
    return out


@dataclasses.dataclass
class _Bucket:
    """What one bucket makes the devices and the host do under a profile (`_Counted.priced`)."""

    packs: dict[int, float]  # seconds of copies per device (or host: `_Copies.device_times`)
    unpacks: dict[int, float]
    lanes: tuple[float, float]  # rounds inside domains, rounds with a cross-domain message
    waits: tuple[float, float]  # their latency
    host_work: float
    rounds: int

    def transfer(self, profile: Profile) -> tuple[float, float]:
        """The bucket's rounds' time and the latency in it. Its rounds are independent
        collective-permutes (`runtime._build_transfer`): where they run at once
        (`_lanes_at_once`), its cross-domain rounds and its rounds inside domains take the
        longer of the two, else their sum."""
        if _lanes_at_once(profile):
            longer = int(self.lanes[1] > self.lanes[0])
            return self.lanes[longer], self.waits[longer]
        return sum(self.lanes), sum(self.waits)


@dataclasses.dataclass
class _Counted:
    """What one bucket moves and copies, whatever the profile (`_counted_buckets`): its
    rounds' slot sizes, whether each has a cross-domain message, the most of each round's
    messages between devices of one host, each side's copies and the arrays its programs
    take. `priced` turns it into a `_Bucket` under a profile."""

    sizes: list[int]
    cross: list[bool]
    on_host: list[int]
    packs: _Slots | _Copies
    unpacks: _Slots | _Copies
    arrays: int

    @property
    def rounds(self) -> int:
        return len(self.sizes)

    @staticmethod
    def joined(buckets: Sequence[_Counted]) -> _Counted:
        """Buckets run as one step (`lower._joined`: the same rounds, each slot holding
        every bucket's messages one after the other): each round once, its slot the sum of
        theirs; their copies and arrays summed."""
        first = buckets[0]
        if len(buckets) == 1:
            return first
        assert all(b.rounds == first.rounds for b in buckets), "joined steps share rounds"
        return _Counted(
            [sum(sizes) for sizes in zip(*(b.sizes for b in buckets), strict=True)],
            first.cross,
            first.on_host,
            _merged([b.packs for b in buckets]),
            _merged([b.unpacks for b in buckets]),
            sum(b.arrays for b in buckets),
        )

    def priced(self, topology: Topology, ids: _DeviceArrays, profile: Profile) -> _Bucket:
        """The bucket's copies per device, its rounds' time in each lane (`modeled_time`)
        and its host work, under ``profile``."""
        bw = {
            True: topology.inter_bandwidth * profile.inter_efficiency,
            False: topology.intra_bandwidth * profile.intra_efficiency,
        }
        lanes = [0.0, 0.0]  # rounds inside domains, rounds with a cross-domain message
        waits = [0.0, 0.0]  # their latency
        for size, cross, on_host in zip(self.sizes, self.cross, self.on_host, strict=True):
            link = size / bw[cross]
            if profile.host_link_bandwidth is not None:
                link = max(link, on_host * size / profile.host_link_bandwidth)
            lanes[cross] += profile.round_latency + link
            waits[cross] += profile.round_latency
        host, sides = topology.host_of, (self.packs, self.unpacks)
        packs, unpacks = (
            c.device_times(host, profile) if isinstance(c, _Copies) else c.times(ids, profile)
            for c in sides
        )
        return _Bucket(
            packs,
            unpacks,
            (lanes[0], lanes[1]),
            (waits[0], waits[1]),
            profile.bucket_overhead + self.arrays * profile.argument_overhead,
            self.rounds,
        )


def _merged(sides: Sequence[_Slots | _Copies]) -> _Slots | _Copies:
    """The copies of several buckets' packs (or unpacks) run in one step."""
    if all(isinstance(c, _Copies) for c in sides):
        out = _Copies()
        for c in sides:
            out.merge(c)  # type: ignore[arg-type]
        return out
    slots = [c for c in sides if isinstance(c, _Slots)]
    assert len(slots) == len(sides), "a step's buckets are counted alike"
    nbytes = [float(c.nbytes.sum()) for c in slots]
    narrow = sum(c.narrow * n for c, n in zip(slots, nbytes, strict=True)) / max(1.0, sum(nbytes))
    return _Slots(
        np.concatenate([c.devices for c in slots]),
        np.concatenate([c.nbytes for c in slots]),
        narrow,
    )


def _narrow_shares(leaves: Sequence[LeafSpec], units: Sequence[Unit]) -> list[float]:
    """Per unit, the share of its leaves' destination bytes that copy as narrow elements
    (`_narrow`): what of a `RoundPlan` bucket's slots to count as narrow bytes."""
    out = []
    for unit in units:
        sizes = [(math.prod(leaves[i].shape) * leaves[i].itemsize, i) for i in unit.leaves]
        total = sum(n for n, _ in sizes)
        out.append(sum(n for n, i in sizes if _narrow(leaves[i])) / total if total else 0.0)
    return out


def _counted_buckets(
    schedule: Schedule | RoundPlan,
    ids: _DeviceArrays,
    leaves: Sequence[LeafSpec] | None,
    narrow: Sequence[float] | None = None,
) -> Iterator[_Counted]:
    """Each bucket's rounds and copies, counted (`_Counted`); ``narrow``: per unit, the share
    of a `RoundPlan` bucket's slot bytes counted as narrow (`_narrow_shares`)."""
    with_segments = leaves is not None and isinstance(schedule, Schedule)
    for b, bucket in enumerate(_buckets(schedule)):
        rounds = [(size, np.array(pairs, np.int64).reshape(-1, 2)) for size, pairs in bucket]
        cross, on_host = _links(rounds, ids)
        # Arrays the bucket's programs take: staging (pack writes it, the transfer reads and
        # receives into it, unpack reads it), and the leaves pack reads and unpack writes.
        arrays = 4 * len(bucket)
        packs: _Slots | _Copies
        unpacks: _Slots | _Copies
        if not with_segments:  # each slot one box (by arrays: millions of pairs at scale)
            sizes = np.repeat([size for size, _ in rounds], [len(p) for _, p in rounds])
            every = np.concatenate([p for _, p in rounds] or [np.zeros((0, 2), np.int64)])
            share = 0.0
            if narrow is not None and isinstance(schedule, RoundPlan):
                share = narrow[schedule.buckets[b].unit]
            packs = _Slots(every[:, 0], sizes, share)
            unpacks = _Slots(every[:, 1], sizes, share)
        else:
            assert leaves is not None and isinstance(schedule, Schedule)
            packs, unpacks = _Copies(), _Copies()
            read, written = set(), set()
            full = schedule.buckets[b]
            # A message its sender already packs in this step is sent again from that buffer
            # (`lower.Step.shared`): not packed twice. (The lowering declines where sharing
            # would split a pack program, small gathered messages: their copies are counted
            # once here all the same.)
            for m, packed_slot in zip(full.messages, full.packed_slots(), strict=True):
                again = packed_slot != m.slot
                for seg in m.segments:
                    leaf = leaves[seg.leaf]
                    narrow = _narrow(leaf)
                    src_shard = _shard_shape(leaf, from_dst=seg.from_dst)
                    runs = contiguous_runs(seg.box, src_shard)  # pack reads the box's rows
                    if not again:
                        # the senders cast (a relay reads its destination shard's dtype)
                        casts = _casts(leaf) and not seg.from_dst
                        packs.add(m.src, seg.nbytes, narrow=narrow, runs=runs, casts=casts)
                    runs = contiguous_runs(seg.box, _shard_shape(leaf, from_dst=True))
                    unpacks.add(m.dst, seg.nbytes, narrow=narrow, runs=runs)  # unpack writes
                    read.add((seg.leaf, seg.from_dst))
                    written.add(seg.leaf)
            arrays += len(read) + len(written)
        yield _Counted([size for size, _ in rounds], cross, on_host, packs, unpacks, arrays)


def _links(
    rounds: Sequence[tuple[int, np.ndarray]], ids: _DeviceArrays
) -> tuple[list[bool], list[int]]:
    """Per round (its slot size and its ``(src, dst)`` pairs as an array): whether a message
    crosses domains, and the most messages one host's devices carry between each other."""
    cross, on_host = [], []
    for _, pairs in rounds:
        src, dst = pairs.T
        cross.append(bool((ids.domain[src] != ids.domain[dst]).any()))
        inside = ids.host[src][ids.host[src] == ids.host[dst]]
        on_host.append(int(np.bincount(inside).max()) if len(inside) else 0)
    return cross, on_host


def _counted_whole(step: WholeStep, ids: _DeviceArrays) -> _Counted:
    """A whole-shard step counted as a bucket: its rounds (a pair of a device with itself,
    a local copy, counts as a message on its host), no pack or unpack copies, and two arrays
    a round (the shards sent, the shards received into)."""
    rounds = [(size, np.array(pairs, np.int64).reshape(-1, 2)) for size, pairs in step]
    cross, on_host = _links(rounds, ids)
    sizes = [size for size, _ in rounds]
    return _Counted(sizes, cross, on_host, _Copies(), _Copies(), 2 * len(rounds))


class _DeviceArrays:
    """A topology's domain and host of every device id, as arrays indexed by id."""

    def __init__(self, topology: Topology) -> None:
        size = max(topology.domain_of, default=-1) + 1
        self.domain = np.full(size, -1, np.int64)
        self.host = np.full(size, -1, np.int64)
        for d, g in topology.domain_of.items():
            self.domain[d] = g
        for d, h in topology.host_of.items():
            self.host[d] = h


class _Path(NamedTuple):
    """Seconds of a critical path by part (`ModeledTime`'s parts; ``latency`` is in
    ``transfer``)."""

    transfer: float = 0.0
    latency: float = 0.0
    pack: float = 0.0
    unpack: float = 0.0
    overhead: float = 0.0

    @property
    def total(self) -> float:
        return self.transfer + self.pack + self.unpack + self.overhead


class _InTurn:
    """Buckets one after the other, each its pack, rounds and unpack in turn (the busiest
    device or host for each copy), three launches and its host work, added (CPU)."""

    def __init__(self) -> None:
        self.path = _Path()

    def add(self, b: _Bucket, profile: Profile) -> None:
        tr, lat, pk, up, ov = self.path
        moved, latency = b.transfer(profile)
        self.path = _Path(
            tr + moved,
            lat + latency,
            pk + max(b.packs.values(), default=0.0),
            up + max(b.unpacks.values(), default=0.0),
            ov + 3 * profile.launch_overhead + b.host_work,
        )

    def critical_path(self) -> _Path:
        return self.path


class _Timeline:
    """Per-device clocks (GPUs: one stream a device, the host dispatching ahead).

    Each device's clock is the critical path that led to it, by part, so the parts of the
    last clock add up to the total. A device packs when the host has dispatched the bucket
    and its own earlier programs are done; the transfer starts when every device seen so far
    is ready (a barrier, which is conservative); then each receiver unpacks.

    The clocks of the devices that did something since the last transfer are kept as one
    array of parts per `_Path` field, in the order the devices did it (ties on the critical
    path go to the earliest, as a list of clocks would), and every other device's clock is
    that transfer's end: a bucket costs a few array operations, not a `_Path` per device (the
    4,096-GPU scenario's two pricings took 49 s with one `_Path` per device, 7 s so).
    """

    def __init__(self) -> None:
        self.end = _Path()  # the last transfer's end: every device's clock then
        self.devices = np.zeros(0, np.int64)  # the devices that did something since
        self.parts = np.zeros((len(_Path._fields), 0))  # their clocks, a row per field
        self.host = 0.0

    def _ready(self, parts: np.ndarray) -> np.ndarray:
        """Clocks (columns), or the host's dispatch of the bucket where that comes later (the
        device idles until then: the host's work is the critical path)."""
        late = _totals(parts) < self.host
        if late.any():
            parts = parts.copy()
            parts[:, late] = np.array(_Path(overhead=self.host))[:, None]
        return parts

    def _latest(self) -> _Path:
        """The clock every device waits for: the first largest total of the end's and the
        clocks since, each `_ready`."""
        parts = self._ready(np.column_stack([np.array(self.end), self.parts]))
        return _Path(*(float(x) for x in parts[:, int(np.argmax(_totals(parts)))]))

    def add(self, b: _Bucket, profile: Profile) -> None:
        self.host += b.host_work
        launch = profile.launch_overhead
        packers = np.fromiter(b.packs, np.int64, len(b.packs))
        # Each packer starts from its own clock, or the end's where it has none since.
        at = np.full(len(packers), -1)
        if len(self.devices) and len(packers):
            order = np.argsort(self.devices, kind="stable")
            i = np.minimum(np.searchsorted(self.devices, packers, sorter=order), len(order) - 1)
            at = np.where(self.devices[order[i]] == packers, order[i], -1)
        known = at >= 0
        base = np.repeat(np.array(self.end)[:, None], len(packers), axis=1)
        base[:, known] = self.parts[:, at[known]]
        clocks = self._ready(base)
        clocks[_PACK] += np.fromiter(b.packs.values(), float, len(b.packs))
        clocks[_OVERHEAD] += launch
        self.parts[:, at[known]] = clocks[:, known]  # (``base`` took copies of these columns)
        self.devices = np.concatenate([self.devices, packers[~known]])
        self.parts = np.concatenate([self.parts, clocks[:, ~known]], axis=1)
        c = self._latest()
        moved, latency = b.transfer(profile)
        self.end = c._replace(
            transfer=c.transfer + moved,
            latency=c.latency + latency,
            overhead=c.overhead + launch,
        )
        self.devices = np.fromiter(b.unpacks, np.int64, len(b.unpacks))
        self.parts = np.repeat(np.array(self.end)[:, None], len(self.devices), axis=1)
        self.parts[_UNPACK] += np.fromiter(b.unpacks.values(), float, len(b.unpacks))
        self.parts[_OVERHEAD] += launch

    def critical_path(self) -> _Path:
        return self._latest()


_PACK, _UNPACK, _OVERHEAD = (_Path._fields.index(f) for f in ("pack", "unpack", "overhead"))


def _totals(parts: np.ndarray) -> np.ndarray:
    """`_Path.total` of each column, added in the same order (so equal to the last bit)."""
    transfer, _, pack, unpack, overhead = parts
    return transfer + pack + unpack + overhead


def _buckets(schedule: Schedule | RoundPlan) -> Iterator[Sequence[tuple[int, Sequence[Pair]]]]:
    """Per bucket, its rounds as ``(slot_bytes, pairs)``: `rounds_by_bucket`, without sorting
    a `RoundPlan`'s pairs (the cost model does not need their order; a 4,096-GPU plan has
    millions)."""
    if isinstance(schedule, RoundPlan):
        for b in schedule.buckets:
            yield [(size, [p for p, _ in entries]) for size, entries in b.rounds]
    else:
        yield from schedule.rounds_by_bucket()


def _shard_shape(leaf: LeafSpec, *, from_dst: bool) -> tuple[int, ...]:
    """The shape of every shard of the leaf's destination (``from_dst``) or source layout
    (JAX shards evenly)."""
    return box_shape((leaf.dst if from_dst else leaf.src).boxes[0])


def _narrow(leaf: LeafSpec) -> bool:
    """Whether the leaf's copies take the narrow-element path (below 4 bytes, or a cast)."""
    return leaf.itemsize < 4 or _casts(leaf)


def _casts(leaf: LeafSpec) -> bool:
    """Whether the leaf changes dtype on its way: its packs from the source shards (and its
    local copies) then cast; its unpacks write the destination's dtype as it arrives."""
    return leaf.src_dtype != leaf.dst_dtype


class _Copies:
    """What each device copies in one step: wide bytes (those of boxes that are one
    contiguous run apart, ``flat``), narrow bytes (those of boxes of one contiguous run that
    do not cast apart, ``narrow_flat``), boxes and the contiguous runs (rows) of its boxes in
    the shards it reads or writes. A box added without its runs counts as one run, at the
    wide speed."""

    def __init__(self) -> None:
        self.wide: dict[int, int] = defaultdict(int)
        self.flat: dict[int, int] = defaultdict(int)
        self.narrow: dict[int, int] = defaultdict(int)
        self.narrow_flat: dict[int, int] = defaultdict(int)
        self.boxes: dict[int, int] = defaultdict(int)
        self.runs: dict[int, int] = defaultdict(int)

    def add(
        self,
        device: int,
        nbytes: int,
        *,
        narrow: bool,
        runs: int | None = None,
        casts: bool = False,
    ) -> None:
        """One box of ``nbytes`` on ``device``, of ``runs`` contiguous runs (None: not
        counted); a box counted as one run copies at the contiguous speed, narrow elements
        too unless the copy ``casts`` (measured on CPU: 16-bit words written into whole rows
        of a bf16 shard copy as fast as float32 rows, 12.2-12.7 GB/s, into half its columns
        at 3.8-3.9 GB/s; a cast at 6.5-6.6 GB/s either way)."""
        if narrow and runs == 1 and not casts:
            self.narrow_flat[device] += nbytes
        elif narrow:
            self.narrow[device] += nbytes
        elif runs == 1:
            self.flat[device] += nbytes
        else:
            self.wide[device] += nbytes
        self.boxes[device] += 1
        self.runs[device] += 1 if runs is None else runs

    def merge(self, other: _Copies) -> None:
        """Add ``other``'s copies (another step's, run in the same step)."""
        for mine, theirs in (
            (self.wide, other.wide),
            (self.flat, other.flat),
            (self.narrow, other.narrow),
            (self.narrow_flat, other.narrow_flat),
            (self.boxes, other.boxes),
            (self.runs, other.runs),
        ):
            for device, n in theirs.items():
                mine[device] += n

    def time(self, host: Mapping[int, int], profile: Profile) -> float:
        """Seconds for every device's copies at once: the slowest device, or where a host's
        devices share it (``host_copy_bandwidth``), the slowest host doing all of its own."""
        return max(self.device_times(host, profile).values(), default=0.0)

    def device_times(self, host: Mapping[int, int], profile: Profile) -> dict[int, float]:
        """Seconds of copies per device, or per host where a host's devices share it."""
        if not self.boxes:
            return {}
        wide, flat, narrow, narrow_flat = self.wide, self.flat, self.narrow, self.narrow_flat
        boxes, runs = self.boxes, self.runs
        wide_bw = profile.copy_bandwidth
        if profile.host_copy_bandwidth is not None:  # sum each host's devices
            wide_bw = profile.host_copy_bandwidth
            wide, flat, narrow, narrow_flat, boxes, runs = (
                _by_host(x, host) for x in (wide, flat, narrow, narrow_flat, boxes, runs)
            )
        narrow_bw = (
            wide_bw if profile.narrow_copy_bandwidth is None else profile.narrow_copy_bandwidth
        )
        flat_bw = profile.contiguous_copy_bandwidth or wide_bw
        # (a profile that measured no contiguous speed keeps narrow elements at theirs)
        narrow_flat_bw = profile.contiguous_copy_bandwidth or narrow_bw
        per, per_run = profile.copy_overhead, profile.run_overhead
        return {
            k: wide.get(k, 0) / wide_bw
            + flat.get(k, 0) / flat_bw
            + narrow.get(k, 0) / narrow_bw
            + narrow_flat.get(k, 0) / narrow_flat_bw
            + n * per
            + runs.get(k, 0) * per_run
            for k, n in boxes.items()
        }


def _by_host(per_device: Mapping[int, int], host: Mapping[int, int]) -> dict[int, int]:
    out: dict[int, int] = defaultdict(int)
    for d, n in per_device.items():
        out[host[d]] += n
    return out


class _Slots:
    """`_Copies` of a `RoundPlan`'s slots, ``nbytes[i]`` on ``devices[i]``: each slot one box
    whose rows are not known, ``narrow`` of its bytes narrow elements (a share), the rest
    wide. Their sums per device (or per host) are made once and priced under any profile
    (`times`)."""

    def __init__(self, devices: np.ndarray, nbytes: np.ndarray, narrow: float = 0.0) -> None:
        self.devices, self.nbytes, self.narrow = devices, nbytes, narrow
        self._sums: dict[bool, tuple[list[int], np.ndarray, np.ndarray]] = {}

    def _summed(
        self, ids: _DeviceArrays, by_host: bool
    ) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Per device (or host), in the order they first occur as `_Copies` adds them: its
        id, its bytes and its boxes."""
        if by_host not in self._sums:
            devices = ids.host[self.devices] if by_host else self.devices
            unique, first, inverse = np.unique(devices, return_index=True, return_inverse=True)
            order = np.argsort(first, kind="stable")
            wide = np.bincount(inverse, weights=self.nbytes)  # integer sums: exact below 2**53
            boxes = np.bincount(inverse)
            self._sums[by_host] = (unique[order].tolist(), wide[order], boxes[order])
        return self._sums[by_host]

    def times(self, ids: _DeviceArrays, profile: Profile) -> dict[int, float]:
        """`_Copies.device_times` of the slots (no rows)."""
        by_host = profile.host_copy_bandwidth is not None
        bandwidth = profile.host_copy_bandwidth if by_host else profile.copy_bandwidth
        narrow_bw = profile.narrow_copy_bandwidth or bandwidth
        keys, nbytes, boxes = self._summed(ids, by_host)
        seconds = (
            nbytes * (1 - self.narrow) / bandwidth
            + nbytes * self.narrow / narrow_bw
            + boxes * profile.copy_overhead
        )
        return dict(zip(keys, seconds.tolist(), strict=True))


# -------------------------------------------------------------------------------- baselines


def allgather_broadcast(
    leaves: Sequence[LeafSpec], topology: Topology, profile: Profile, *, chunk_bytes: int
) -> float:
    """All-gather, then broadcast, as a competent engineer builds it: the source devices
    all-gather the full arrays, and every source device is the root of ``1/S`` of them (all
    trainer NICs send); the broadcast is a pipelined tree of chunks, so each byte enters each
    destination domain once and is spread inside it over NVLink, and every destination device
    receives the full arrays (it keeps its slice). The two phases are pipelined by chunks:
    the time is the slower phase, plus a round latency per chunk of the roots' share.

    Each phase is priced at its tightest link, all links at their efficiency and at once:

    - gather: each source device's missing bytes over its NVLink + NIC; each domain's missing
      bytes over its source devices' NICs;
    - broadcast: each destination device's full arrays over its NVLink + NIC; each destination
      domain's import over its devices' NICs; the export over every source NIC.
    """
    full = sum(math.prod(leaf.shape) * leaf.itemsize for leaf in leaves)
    bi, bx = _effective(topology, profile)
    both = bi + bx if profile.overlap_links else bi
    dom = topology.domain_of
    src = sorted({d for leaf in leaves for d in leaf.src.devices})
    dst = sorted({d for leaf in leaves for d in leaf.dst.devices})
    own: dict[int, int] = defaultdict(int)
    held_in: dict[int, int] = defaultdict(int)
    for leaf in leaves:
        for box, replicas in leaf.src.replicas.items():
            nbytes = box_size(box) * leaf.itemsize
            for s in replicas:
                own[s] += nbytes
            for g in {dom[s] for s in replicas}:
                held_in[g] += nbytes
    src_nics: dict[int, int] = defaultdict(int)
    for s in src:
        src_nics[dom[s]] += 1
    gather = max(
        [0.0]
        + [(full - own[s]) / both for s in src]
        + [(full - held_in[g]) / (n * bx) for g, n in src_nics.items() if len(src_nics) > 1]
    )
    dst_nics: dict[int, int] = defaultdict(int)
    for d in dst:
        dst_nics[dom[d]] += 1
    remote = [g for g in dst_nics if g not in src_nics]
    broadcast = max(
        [0.0]  # colocated: after the all-gather every destination device holds everything
        + [full / both for d in dst if d not in src]
        + [full / (len(topology.members[g]) * bx) for g in remote]
        + ([full / (len(src) * bx)] if remote else [])
    )
    chunks = math.ceil(full / len(src) / chunk_bytes)
    return max(gather, broadcast) + 2 * chunks * topology.round_latency


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


def direct_round_robin(
    leaves: Sequence[LeafSpec], topology: Topology, profile: Profile, *, chunk_bytes: int
) -> float:
    """Direct point-to-point, no fan-out: every destination device fetches each part it lacks
    from the replicas that hold it in turn (destination devices in id order take the next
    replica, the turn carried on from one part to the next of the same replicas, so the first
    replicas do not take every part's first share), whatever its domain.

    Priced generously as the busiest device's link time (NIC and NVLink at once where the
    profile allows, each at its efficiency), sending or receiving, plus a round latency per
    ``chunk_bytes`` of that device's traffic: no schedule of these messages is shorter.
    """
    bi, bx = _effective(topology, profile)
    load: dict[tuple[int, bool], int] = defaultdict(int)  # (device, crosses) -> bytes
    turn: dict[tuple[int, ...], int] = defaultdict(int)  # replicas -> the next one's index
    for leaf in leaves:
        for dst_box, holders in leaf.dst.replicas.items():
            for _, replicas, common in leaf.src.overlapping(dst_box):
                nbytes = box_size(common) * leaf.itemsize
                wanting = [d for d in holders if d not in replicas]
                group = tuple(replicas)
                first = turn[group]
                turn[group] = first + len(wanting)
                for k, d in enumerate(wanting):
                    s = replicas[(first + k) % len(replicas)]
                    cross = topology.crosses(s, d)
                    load[s, cross] += nbytes
                    load[-1 - d, cross] += nbytes  # receivers keyed apart from senders
    return _busiest_link_time(load, bi, bx, profile, topology.round_latency, chunk_bytes)


def m2n_like(
    leaves: Sequence[LeafSpec],
    assignment: Assignment,
    topology: Topology,
    profile: Profile,
    *,
    staging_bytes: int = 256 << 20,
) -> float:
    """An NCCL-M2N-like schedule: balanced senders and one fan-out inside each domain (the
    pieces of a `route(..., fan_out=True)` assignment), its stages one after the other, each
    priced at its busiest device's links (NIC and NVLink at once, at their efficiency), plus
    pack and unpack of every byte at ``copy_bandwidth`` (the fastest copy rate, whatever the
    dtype) and a round latency per ``staging_bytes`` of the busiest device's traffic (M2N
    stages 256 MiB per communicator). No host cost per bucket: the profile's
    ``bucket_overhead`` is JAX's dispatch, measured for this executor, not NCCL's (an audit:
    charged in turn here, where the plan's host work runs beside its devices' work, it
    favoured the plan).
    """
    bi, bx = _effective(topology, profile)
    seconds = 0.0
    stages: dict[int, dict[tuple[int, bool], int]] = defaultdict(lambda: defaultdict(int))
    for p in (*assignment.sent, *assignment.fans):
        nbytes = box_size(p.box) * leaves[p.leaf].itemsize
        for d in p.dsts:
            cross = topology.crosses(p.src, d)
            stages[p.stage][p.src, cross] += nbytes
            stages[p.stage][-1 - d, cross] += nbytes
    for load in stages.values():
        seconds += _busiest_link_time(load, bi, bx, profile, topology.round_latency, staging_bytes)
        per_device: dict[int, int] = defaultdict(int)
        for (d, _), n in load.items():
            per_device[d] += n
        busiest = max(per_device.values(), default=0)
        seconds += 2 * busiest / profile.copy_bandwidth  # pack on the sender, unpack on arrival
    return seconds


def _effective(topology: Topology, profile: Profile) -> tuple[float, float]:
    return (
        topology.intra_bandwidth * profile.intra_efficiency,
        topology.inter_bandwidth * profile.inter_efficiency,
    )


def _busiest_link_time(
    load: Mapping[tuple[int, bool], int],
    bi: float,
    bx: float,
    profile: Profile,
    latency: float,
    chunk_bytes: int,
) -> float:
    """The busiest device's time over its NVLink (``bi``) and NIC (``bx``): at once where the
    profile allows, else one after the other; plus a latency per chunk of its bytes."""
    per: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for (d, cross), n in load.items():
        per[d][int(cross)] += n
    if not per:
        return 0.0
    times, chunks = [], 0
    for intra, cross in per.values():
        a, b = intra / bi, cross / bx
        times.append(max(a, b) if profile.overlap_links else a + b)
        chunks = max(chunks, math.ceil((intra + cross) / chunk_bytes))
    return max(times) + chunks * latency


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
