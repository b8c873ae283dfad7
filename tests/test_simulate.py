"""The cost model on small hand-computed cases, and the cluster simulator.

Bandwidths in the hand-computed cases are tiny round numbers (bytes per second) so every
expected time can be checked on paper.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from jaxreshard.planning import schedule
from jaxreshard.planning.layout import Layout
from jaxreshard.planning.route import LeafSpec, LocalCopy
from jaxreshard.planning.route import route as topology_assign
from jaxreshard.planning.schedule import PlannedBucket, RoundPlan, build_schedule
from jaxreshard.planning.topology import GB, PROFILES, Profile, Topology
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


def profile(**overrides):
    """A profile over `topo`'s bandwidths with round numbers: links at half their peak, copies
    at 50 B/s, 1 s per bucket, GPU-like (each device copies on its own)."""
    fields = dict(
        name="hand", domain_size=4, host_size=4, intra_bandwidth=100, inter_bandwidth=10,
        round_latency=0.0, source="by hand", intra_efficiency=0.5, inter_efficiency=0.5,
        copy_bandwidth=50, bucket_overhead=1.0,
    )  # fmt: skip
    fields.update(overrides)
    return Profile(**fields)


TWO_BUCKETS = RoundPlan(
    chunk_bytes=100,
    class_chunk_bytes=(),
    buckets=(
        PlannedBucket(0, ((100, (((0, 1), 0),)),)),  # inside a domain
        PlannedBucket(0, ((50, (((0, 4), 0), ((1, 2), 0))),)),  # one message crosses
    ),
)


def test_a_round_costs_its_slowest_message_plus_latency():
    cost = costmodel.schedule_cost(TWO_BUCKETS, topo(latency=1.0))
    assert cost.seconds == pytest.approx((100 / 100 + 1) + (50 / 10 + 1))
    assert (cost.rounds, cost.slow_rounds) == (2, 1)
    assert (cost.wire_bytes_cross, cost.wire_bytes_intra) == (50, 150)


def test_a_rounds_latency_in_bytes_is_what_each_link_class_moves_meanwhile():
    """`Topology.class_latency_bytes` (how the schedule weighs an extra round against padding
    when it sizes chunks, per link class): a 2 s round latency is 200 B at 100 B/s inside a
    domain (class 0) and 20 B at 10 B/s across (class 1). Mutation check: the class across
    was priced at NVLink speed (200 B)."""
    assert topo(latency=2.0).class_latency_bytes() == {0: 200, 1: 20}


def test_modeled_time_adds_pack_unpack_buckets_and_local_copies_by_hand():
    """Links at half their peak: 100 B inside at 50 B/s (2 s), then 50 B across at 5 B/s (10 s).
    Pack: device 0 copies 100 B, then devices 0 and 1 50 B each at once: 2 + 1 s; unpack
    likewise 2 + 1 s. Device 4 copies 100 B of its own: 2 s. The host's 1 s per bucket adds
    when it waits for the devices (CPU): 2 s."""
    p = profile(host_runs_ahead=False)
    own = LocalCopy(leaf=0, device=4, box=((0, 100),))
    lf = uint8_leaf(100, (0,), (), (4,), ())
    m = costmodel.modeled_time(TWO_BUCKETS, topo(), p, leaves=[lf], local=[own])
    assert (m.transfer, m.pack, m.unpack, m.overhead, m.local) == pytest.approx((12, 3, 3, 2, 2))
    assert m.seconds == pytest.approx(22) and (m.buckets, m.rounds) == (2, 2)


def test_a_round_plans_slots_copy_at_the_narrow_speed_in_the_share_of_narrow_leaves():
    """The same two buckets as a `RoundPlan` of two units, each slot one box: unit 0 moves a
    bf16 leaf of 100 elements (200 B), unit 1 a float32 leaf of 50 (200 B) and a bf16 one of
    100 (200 B). With the plan's ``units`` each bucket's slots copy at the narrow speed (10
    B/s) in its unit's share of narrow bytes, the rest at 50 B/s, as a `Schedule`'s segments
    would: pack 100 / 10 + (50 / 2) / 50 + (50 / 2) / 10 = 13 s, unpack alike. Without the
    units, every slot copies as wide bytes (3 s each)."""
    p = profile(host_runs_ahead=False, narrow_copy_bandwidth=10)

    def leaf(n, dtype, itemsize):
        return dataclasses.replace(
            uint8_leaf(n, (0,), (), (4,), ()), src_dtype=dtype, dst_dtype=dtype, itemsize=itemsize
        )

    bf16, f32 = leaf(100, "bfloat16", 2), leaf(50, "float32", 4)
    plan = RoundPlan(
        chunk_bytes=100,
        class_chunk_bytes=(),
        buckets=tuple(dataclasses.replace(b, unit=u) for u, b in enumerate(TWO_BUCKETS.buckets)),
    )
    units = [
        schedule.Unit((0,), (), (), ()),
        schedule.Unit((1, 2), (), (), ()),
    ]
    leaves = [bf16, f32, bf16]
    m = costmodel.modeled_time(plan, topo(), p, leaves=leaves, units=units)
    assert (m.pack, m.unpack) == pytest.approx((13, 13))
    m = costmodel.modeled_time(plan, topo(), p, leaves=leaves)
    assert (m.pack, m.unpack) == pytest.approx((3, 3))


def test_modeled_time_hides_host_work_behind_the_devices_when_the_host_runs_ahead():
    """GPU-like: each device runs its programs in order, the host dispatching ahead. With
    launch gaps of 1/6 s per program and 1 s of host work per bucket:

    - bucket 1: device 0 waits for the host's first second, packs 100 B (2 s), the transfer
      takes 2 s (100 B inside at 50 B/s), device 1 unpacks 2 s;
    - bucket 2: device 1 packs 50 B (1 s) after its unpack, device 0 packed its 50 B while
      1 unpacked; the transfer (50 B across at 5 B/s: 10 s) waits for device 1; devices 2
      and 4 unpack 1 s each.

    Rounds 12 s, pack 2 + 1 s, unpack 2 + 1 s on the critical path (device 1's), 1 s of host
    and six launches (1 s): 20 s, where buckets in turn take 6.5 + 12.5 s plus the host's first
    second. With 10 s of host work a bucket, bucket 2 is dispatched at 20 s: 20 + 1 + 10 + 1."""
    hidden = costmodel.modeled_time(TWO_BUCKETS, topo(), profile(launch_overhead=1 / 6))
    assert (hidden.transfer, hidden.pack, hidden.unpack) == pytest.approx((12, 3, 3))
    assert hidden.overhead == pytest.approx(2.0) and hidden.seconds == pytest.approx(20)
    slow = costmodel.modeled_time(TWO_BUCKETS, topo(), profile(bucket_overhead=10))
    assert (slow.transfer, slow.pack, slow.unpack) == pytest.approx((10, 1, 1))
    assert slow.overhead == pytest.approx(20) and slow.seconds == pytest.approx(32)


def test_the_next_buckets_pack_runs_while_the_receivers_unpack_when_the_host_runs_ahead():
    """Two buckets of 100 B from device 0 to device 1 (inside a domain, 2 s a round), copies
    of 2 s each way, no host or launch cost. Device 0 packs bucket 2 while device 1 unpacks
    bucket 1: 2 + 2 + 2 + 2 + 2 = 10 s, where the CPU's buckets in turn take 12 s."""
    twice = RoundPlan(
        chunk_bytes=100,
        class_chunk_bytes=(),
        buckets=(PlannedBucket(0, ((100, (((0, 1), 0),)),)),) * 2,
    )
    gpu = profile(bucket_overhead=0.0)
    m = costmodel.modeled_time(twice, topo(), gpu)
    assert (m.transfer, m.pack + m.unpack, m.seconds) == pytest.approx((4, 6, 10))
    in_turn = costmodel.modeled_time(twice, topo(), dataclasses.replace(gpu, host_runs_ahead=False))
    assert in_turn.seconds == pytest.approx(12)


def test_buckets_a_call_runs_as_one_joined_step_are_priced_as_one_step():
    """Two buckets of 100 B from device 0 to device 1, run as one joined step (`steps`, from
    `lower.Step.buckets`): one round of both slots one after the other (200 B at 50 B/s: 4 s,
    its 1 s latency once), the copies of both (4 s each way) and the host's 1 s once: 14 s,
    where the buckets apart take (2 + 1) + 2 + 2 + 1 s each, 16 s. Mutation check: joined
    buckets priced apart, or their rounds' slots not summed."""
    twice = RoundPlan(
        chunk_bytes=100,
        class_chunk_bytes=(),
        buckets=(PlannedBucket(0, ((100, (((0, 1), 0),)),)),) * 2,
    )
    cpu = profile(host_runs_ahead=False, round_latency=1.0)
    apart = costmodel.modeled_time(twice, topo(), cpu)
    assert (apart.seconds, apart.buckets, apart.rounds) == pytest.approx((16, 2, 2))
    joined = costmodel.modeled_time(twice, topo(), cpu, steps=[(0, 1)])
    assert (joined.transfer, joined.pack, joined.unpack) == pytest.approx((5, 4, 4))
    assert (joined.seconds, joined.buckets, joined.rounds) == pytest.approx((14, 1, 1))
    assert costmodel.modeled_time(twice, topo(), cpu, steps=[(0,), (1,)]).seconds == 16


class _ClockPerDevice:
    """The GPU timeline written plainly, one `_Path` per device (the cost model's previous
    revision): the oracle for `costmodel._Timeline`, which keeps the clocks as arrays."""

    def __init__(self):
        self.end, self.clock, self.host = costmodel._Path(), {}, 0.0

    def ready(self, clock):
        return clock if clock.total >= self.host else costmodel._Path(overhead=self.host)

    def add(self, b, profile):
        self.host += b.host_work
        launch = profile.launch_overhead
        for d, t in b.packs.items():
            c = self.ready(self.clock.get(d, self.end))
            self.clock[d] = c._replace(pack=c.pack + t, overhead=c.overhead + launch)
        c = self.critical_path()
        moved, latency = b.transfer(profile)
        self.end = c._replace(
            transfer=c.transfer + moved, latency=c.latency + latency, overhead=c.overhead + launch
        )
        self.clock = {
            d: self.end._replace(unpack=self.end.unpack + t, overhead=self.end.overhead + launch)
            for d, t in b.unpacks.items()
        }

    def critical_path(self):
        return max(map(self.ready, [self.end, *self.clock.values()]), key=lambda p: p.total)


def test_the_gpu_timeline_equals_a_clock_per_device_to_the_bit():
    """Random buckets over 12 devices, copy times drawn from a few values (so totals tie and
    the tie-break decides which parts the critical path reports), host work sometimes longer
    than the devices' work; then a real plan's buckets. Every part equal, not approximately."""
    rng = np.random.default_rng(0)
    p = profile(launch_overhead=0.25, round_latency=0.5)
    buckets = []
    for _ in range(300):
        times = lambda: {  # noqa: E731
            int(d): float(rng.choice([0.5, 1.0, 1.5, 0.1 + 0.2]))
            for d in rng.choice(12, rng.integers(0, 7), replace=False)
        }
        lanes = tuple(float(x) for x in rng.choice([0.0, 1.0, 2.5], 2))
        work = float(rng.choice([0.0, 0.3, 4.0]))
        buckets.append(costmodel._Bucket(times(), times(), lanes, (0.5, 0.5), work, 2))
    r = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100")
    ids = costmodel._DeviceArrays(r.topology)
    counted = costmodel._counted_buckets(r.rounds, ids, None)
    buckets += [c.priced(r.topology, ids, r.profile) for c in counted]
    for prof in (p, r.profile, dataclasses.replace(r.profile, overlap_links=False)):
        ours, oracle = costmodel._Timeline(), _ClockPerDevice()
        for i, b in enumerate(buckets):
            ours.add(b, prof)
            oracle.add(b, prof)
            assert ours.critical_path() == oracle.critical_path(), i


def test_a_buckets_rounds_overlap_only_where_links_and_the_backend_both_allow():
    """One bucket, two rounds (independent collective-permutes): 50 B from 0 to 4 across
    (5 B/s: 10 s) and 100 B from 1 to 2 inside (50 B/s: 2 s), 1 s latency each. Where the
    NIC and NVLink run at once and the backend keeps both collective-permutes in flight, the
    bucket's transfer is the longer lane (11 s); else both (14 s): XLA GPU compiles them one
    after the other (the GPU profiles' default), and separate permutes cannot share a link
    the hardware runs one way at a time."""
    both = RoundPlan(
        chunk_bytes=100,
        class_chunk_bytes=(),
        buckets=(PlannedBucket(0, ((50, (((0, 4), 0),)), (100, (((1, 2), 0),))), (0, 1)),),
    )

    def transfer(**kwargs):
        return costmodel.modeled_time(both, topo(), profile(round_latency=1.0, **kwargs)).transfer

    assert transfer(permutes_overlap=True) == pytest.approx(11)
    assert transfer() == pytest.approx(14)  # permutes in turn (XLA GPU)
    assert transfer(permutes_overlap=True, overlap_links=False) == pytest.approx(14)
    assert not PROFILES["h100"].permutes_overlap and not PROFILES["gb200-nvl72"].permutes_overlap


def test_modeled_time_on_a_shared_host_adds_its_devices_copies_and_messages():
    """CPU-like: a host's devices copy 25 B/s together and its messages carry 20 B/s together.
    Second bucket: devices 0 and 1 (one host) pack 50 B each: 100 B at 25 B/s = 4 s, not 1 s;
    its intra-host message (1 -> 2, 50 B) alone takes 50 / 20 = 2.5 s but the crossing one
    is slower (10 s)."""
    p = profile(host_copy_bandwidth=25, host_link_bandwidth=20)
    m = costmodel.modeled_time(TWO_BUCKETS, topo(), p)
    assert m.pack == pytest.approx(4 + 4)  # first bucket: 100 B on host 0 at 25 B/s
    assert m.unpack == pytest.approx(4 + 2)  # second: 50 B on each host
    assert m.transfer == pytest.approx(100 / 20 + 10)


def test_modeled_time_counts_a_schedules_segments_by_hand():
    """128 one-byte elements from device 0 to device 4: one round across at 5 B/s (25.6 s).
    With the schedule's segments the copies take the narrow path (16 B/s) plus 0.5 s per box:
    8.5 s to pack, 8.5 s to unpack. The host works 0.25 s per array the programs take: the
    staging buffers of the round (4) and the leaf read and written (2): 1.5 s, added (CPU)."""
    lf = uint8_leaf(128, (0,), (), (4,), ())
    schedule = build_schedule([lf], topology_assign([lf], topo()).pieces, bucket_bytes=1 << 20)
    p = profile(
        narrow_copy_bandwidth=16, copy_overhead=0.5, argument_overhead=0.25, bucket_overhead=0.0,
        host_runs_ahead=False,
    )  # fmt: skip
    m = costmodel.modeled_time(schedule, topo(), p, leaves=[lf])
    assert (m.transfer, m.pack, m.unpack, m.overhead) == pytest.approx((25.6, 8.5, 8.5, 1.5))
    rounds_only = costmodel.modeled_time(schedule, topo(), p)  # no leaves: wide, one box per slot
    assert rounds_only.pack == pytest.approx(128 / 50 + 0.5)


def test_modeled_time_packs_once_what_a_sender_sends_alike_to_several_receivers():
    """128 one-byte elements on device 0 go whole to devices 1 and 2 (its domain): two
    messages alike, in two rounds of one bucket. The executor packs them once and sends that
    buffer twice (`lower.Step.shared`): 128 B to pack (2.56 s at 50 B/s), not 256 B; each
    receiver unpacks its own 128 B."""
    lf = uint8_leaf(128, (0,), (), (1, 2), ())
    schedule = build_schedule(
        [lf], topology_assign([lf], topo(), fan_out=False).pieces, bucket_bytes=1 << 20
    )
    assert [m.segments for m in schedule.buckets[0].messages] == 2 * [
        schedule.buckets[0].messages[0].segments
    ]
    m = costmodel.modeled_time(schedule, topo(), profile(bucket_overhead=0.0), leaves=[lf])
    assert (m.pack, m.unpack) == pytest.approx((128 / 50, 128 / 50))


def test_modeled_time_charges_the_rows_copies_read_and_write():
    """A (4, 8) uint8 leaf split over its columns on devices 0 and 1 goes to devices 4 and 5
    split over its rows. Each sender sends half of its (4, 4) shard to each receiver: whole
    rows of it, one run read per piece (2 s a sender at 1 s a run). Each receiver writes two
    pieces of 2 half rows into its (2, 8) shard: 4 runs (4 s). Copies cost nothing else."""
    src = Layout.from_mesh((4, 8), (2,), ("s",), (0, 1), (None, "s"))
    dst = Layout.from_mesh((4, 8), (2,), ("d",), (4, 5), ("d", None))
    lf = LeafSpec("x", src, dst, "uint8", "uint8", 1)
    schedule = build_schedule([lf], topology_assign([lf], topo()).pieces, bucket_bytes=1 << 20)
    free = profile(copy_bandwidth=math.inf, bucket_overhead=0.0, run_overhead=1.0)
    m = costmodel.modeled_time(schedule, topo(), free, leaves=[lf])
    assert (m.pack, m.unpack) == pytest.approx((2.0, 4.0))
    rows_free = costmodel.modeled_time(
        schedule, topo(), dataclasses.replace(free, run_overhead=0.0), leaves=[lf]
    )
    assert (rows_free.pack, rows_free.unpack) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("src_dtype", "pack_s", "pack_s_without"),
    [("bfloat16", 8.0, 32.0), ("float32", 32.0, 32.0)],
    ids=["bf16 copies", "a cast on the senders"],
)
def test_narrow_copies_of_whole_rows_take_the_contiguous_speed_unless_they_cast(
    src_dtype, pack_s, pack_s_without
):
    """A (4, 8) bf16 leaf split over its rows on devices 0 and 1 goes to devices 4 and 5,
    split over its rows again: each sender packs 32 B of whole rows and each receiver
    unpacks them, one contiguous run each. Narrow copies run at 1 B/s, contiguous ones at
    4 B/s: a bf16 box of one run copies at 4 B/s (8 s), as measured on CPU, where a cast
    (a float32 source, cast by its senders) keeps the narrow speed (32 s) and its unpack,
    which writes bf16 as it arrived, does not. Without a contiguous speed in the profile
    every narrow copy keeps the narrow one."""
    src = Layout.from_mesh((4, 8), (2,), ("s",), (0, 1), ("s", None))
    dst = Layout.from_mesh((4, 8), (2,), ("d",), (4, 5), ("d", None))
    lf = LeafSpec("x", src, dst, src_dtype, "bfloat16", 2)
    schedule = build_schedule([lf], topology_assign([lf], topo()).pieces, bucket_bytes=1 << 20)
    p = profile(
        copy_bandwidth=1000, narrow_copy_bandwidth=1, contiguous_copy_bandwidth=4,
        bucket_overhead=0.0,
    )  # fmt: skip
    m = costmodel.modeled_time(schedule, topo(), p, leaves=[lf])
    assert (m.pack, m.unpack) == pytest.approx((pack_s, 8.0))
    without = dataclasses.replace(p, contiguous_copy_bandwidth=None)
    m = costmodel.modeled_time(schedule, topo(), without, leaves=[lf])
    assert (m.pack, m.unpack) == pytest.approx((pack_s_without, 32.0))


def test_fan_out_plan_and_its_round_model_bound_by_hand():
    """128 bytes on device 0 only; devices 4 and 5 (the other domain) each need all of it.

    Plan: 64 bytes cross to 4 and 64 to 5 (device 0 sends both: two slow rounds of 64 B at
    10 B/s), then 4 and 5 swap halves (one fast round, 64 B at 100 B/s): 12.8 + 0.64 s plus
    three round latencies. Round-model bound: domain 0 exports 128 B through its one device's
    NIC: 12.8 s, plus one latency."""
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
    bound = costmodel.round_model_bound([lf], t)
    assert bound.seconds == pytest.approx(12.8 + 0.1)
    assert bound.binding.startswith("domain 0 sends out")
    assert bound.bytes_cross_needed == 128


def test_round_model_bound_domain_ingress_by_hand():
    """The same 128 bytes held by all four devices of domain 0; devices 4..7 each need it.
    Through destination NICs only, one message at a time: domain 1 takes 128 B in over 4 NICs
    and its devices receive 3 x 128 B more over NVLink: (128 / 10 + 384 / 100) / 4 = 4.16 s."""
    lf = uint8_leaf(128, (0, 1, 2, 3), (), (4, 5, 6, 7), ())
    bound = costmodel.round_model_bound([lf], topo())
    assert bound.seconds == pytest.approx((128 / 10 + 384 / 100) / 4)
    assert bound.binding.startswith("domain 1's 4 receivers take")


def test_physical_bound_by_hand():
    """The same case on the hardware: each device of domain 1 can take its 128 B over NVLink
    and NIC at once (128 / 110 s), domain 1 imports 128 B over 4 NICs (3.2 s), domain 0
    exports it over 4 (3.2 s): 3.2 s, below the round model's 4.16 s."""
    lf = uint8_leaf(128, (0, 1, 2, 3), (), (4, 5, 6, 7), ())
    bound = costmodel.physical_bound([lf], topo())
    assert bound.seconds == pytest.approx(3.2)
    assert bound.seconds < costmodel.round_model_bound([lf], topo()).seconds


def test_physical_bound_lets_every_nic_of_a_domain_import():
    """Device 0 holds 128 B that only device 4 needs. Devices 5..7 are in 4's domain, so their
    NICs may import too (4 x 10 B/s), and device 0's domain may export over its 4 NICs: the
    bound is 3.2 s, the device's own NVLink + NIC 128 / 110 s; through device 4's NIC alone
    it would be 12.8 s."""
    lf = uint8_leaf(128, (0,), (), (4,), ())
    bound = costmodel.physical_bound([lf], topo())
    assert bound.seconds == pytest.approx(3.2)
    assert costmodel.round_model_bound([lf], topo()).seconds == pytest.approx(12.8)


def test_physical_bound_lets_a_sole_holder_send_over_nvlink_and_nic_at_once():
    """Device 0 alone holds 1100 B that devices 1 and 2 (its domain) want in halves: however
    the halves travel, device 0 sends all 1100 B, at best over its NVLink and NIC at once
    (100 + 10 B/s): 10 s, the binding term (each receiver takes 550 B in 5 s). Mutation
    check: the sole holder was priced over NVLink alone (11 s)."""
    lf = uint8_leaf(1100, (0,), (), (1, 2), ("d",))
    bound = costmodel.physical_bound([lf], topo())
    assert bound.seconds == pytest.approx(10.0)
    assert bound.binding.startswith("device 0 sends")


def test_executor_floor_by_hand():
    """The same 128 B from domain 0 to each device of domain 1, links at half their peak
    (NVLink 50 B/s, NIC 5 B/s), copies at 50 B/s. Domain 1's NICs take the 128 B in
    (128 / (4 x 5) = 6.4 s); its devices lack 4 x 128 B, which they unpack, and of which their
    NICs brought 128 B: the other 384 B came from each other, packed by their senders, each
    message at best once for its 3 peers (`lower.Step.shared`): 128 B. A device takes one
    message at a time (the permutes in turn, as XLA GPU runs them), so those 384 B add 384 /
    (4 x 50) = 1.92 s to the NICs' time, and copies never run beside a device's rounds:
    (512 + 128) / (4 x 50) = 3.2 s more, 11.52 s. Domain 0 exports the 128 B and packs them
    (6.4 + 128 / 200 = 7.04 s); a device of domain 1 takes 128 B over its faster link and
    unpacks it (128 / 50 + 128 / 50 = 5.12 s). Where the backend kept both lanes in flight the
    1.92 s would hide under the NICs' 6.4 s: 9.6 s. The plan's own modeled time lies above
    the floor, and the floor above the bound at the links' efficiency."""
    lf = uint8_leaf(128, (0, 1, 2, 3), (), (4, 5, 6, 7), ())
    p = profile(bucket_overhead=0.0)
    floor = costmodel.executor_floor([lf], topo(), p)
    assert floor.seconds == pytest.approx(6.4 + 1.92 + 3.2)
    assert floor.binding.startswith("domain 1 takes")
    assert floor.seconds > costmodel.physical_bound([lf], topo(), p).seconds == pytest.approx(6.4)
    bounds = costmodel.lower_bounds([lf], topo(), p)
    assert (bounds.physical.seconds, bounds.executor.seconds) == pytest.approx((3.2, 11.52))
    two_lanes = dataclasses.replace(p, permutes_overlap=True)
    assert costmodel.executor_floor([lf], topo(), two_lanes).seconds == pytest.approx(9.6)
    schedule = build_schedule(
        [lf], topology_assign([lf], topo()).pieces, bucket_bytes=1 << 20,
        link_class=topo().link_class, class_latency_bytes=topo().class_latency_bytes(),
    )  # fmt: skip
    for prof in (p, two_lanes):
        modeled = costmodel.modeled_time(schedule, topo(), prof, leaves=[lf]).seconds
        assert modeled >= costmodel.executor_floor([lf], topo(), prof).seconds


def test_executor_floor_lets_the_nics_carry_more_where_copies_are_slower():
    """The same case with copies at 1 B/s, slower than a NIC: domain 1's devices do better to
    take everything over their own NICs (512 / (4 x 5) + 512 / (4 x 1) = 153.6 s) than to
    pass 384 B to each other (128 / 20 + 384 / 200 + 640 / 4 = 168.32 s); the floor takes the
    lesser."""
    lf = uint8_leaf(128, (0, 1, 2, 3), (), (4, 5, 6, 7), ())
    floor = costmodel.executor_floor([lf], topo(), profile(copy_bandwidth=1))
    assert floor.seconds == pytest.approx(25.6 + 128)


def test_executor_floor_charges_a_sole_holders_packs():
    """Device 0 alone holds 100 B that device 1 (same domain) needs: it packs them and device
    1 unpacks them, each beside its rounds: 100 / 50 + 100 / 50 s over the faster link (links
    at half peak), or 100 / 55 + 100 / 50 s where both links could carry it at once."""
    lf = uint8_leaf(100, (0,), (), (1,), ())
    floor = costmodel.executor_floor([lf], topo(), profile())
    assert floor.seconds == pytest.approx(100 / 50 + 100 / 50)
    assert floor.binding.startswith("device ")
    floor = costmodel.executor_floor([lf], topo(), profile(permutes_overlap=True))
    assert floor.seconds == pytest.approx(100 / 55 + 100 / 50)


def test_baselines_by_hand():
    """A 128-byte array split in halves over devices 0, 1 (domain 0); devices 4, 5 (domain 1)
    each need all of it. Links at peak, no latency, NIC and NVLink at once.

    - all-gather + broadcast: 0 and 1 each fetch the other half ((128 - 64) / 110 s); both are
      roots, exporting 128 B over their 2 NICs (6.4 s), pipelined with the gather: 6.4 s.
    - direct, round-robin: each half has one holder, which sends it to 4 and to 5 across:
      128 B over its NIC, 12.8 s.
    - M2N-like: each half crosses once (6.4 s, device 0 and 1 in parallel), then 4 and 5 swap
      halves over NVLink (0.64 s); copies at 64 B/s add 2 x 64 / 64 s per stage.
    - rank-0 broadcast: device 0 fetches the other half (64 / 100), then sends 128 B to each
      of 4 and 5 over its NIC (2 x 12.8): 0.64 + 25.6."""
    lf = uint8_leaf(128, (0, 1), ("s",), (4, 5), ())
    t = topo()
    p = profile(intra_efficiency=1.0, inter_efficiency=1.0, bucket_overhead=0.0)
    assert costmodel.allgather_broadcast([lf], t, p, chunk_bytes=1 << 20) == pytest.approx(6.4)
    assert costmodel.direct_round_robin([lf], t, p, chunk_bytes=1 << 20) == pytest.approx(12.8)
    m2n = costmodel.m2n_like(
        [lf], topology_assign([lf], t), t, dataclasses.replace(p, copy_bandwidth=64)
    )
    assert m2n == pytest.approx(6.4 + 2 + 0.64 + 2)
    assert costmodel.rank0_broadcast([lf], t) == pytest.approx(0.64 + 25.6)
    assert costmodel.physical_bound([lf], t).seconds <= 6.4


def test_baselines_charge_no_host_cost_and_round_robin_carries_its_turn():
    """(An audit.) M2N-like was charged the executor's JAX dispatch per 256 MiB one after the
    other, where the plan's host work runs beside its devices': no host cost now, whatever the
    profile's. Round-robin restarted at the first replica for every part, so the first
    replicas sent every part's first share: four quarters of an array held whole by devices 0
    and 1, each wanted by one of devices 4-7 (another domain), now come two from each (64 B
    over a NIC at 10 B/s: 6.4 s), not all four from device 0 (12.8 s)."""
    lf = uint8_leaf(128, (0, 1), ("s",), (4, 5), ())
    t = topo()
    p = profile(intra_efficiency=1.0, inter_efficiency=1.0, copy_bandwidth=64)
    plan = topology_assign([lf], t)
    free = costmodel.m2n_like([lf], plan, t, dataclasses.replace(p, bucket_overhead=0.0))
    assert costmodel.m2n_like([lf], plan, t, dataclasses.replace(p, bucket_overhead=99.0)) == free
    quarters = uint8_leaf(128, (0, 1), (), (4, 5, 6, 7), ("d",))
    assert costmodel.direct_round_robin([quarters], t, p, chunk_bytes=1 << 20) == pytest.approx(6.4)


def test_round_robin_prices_a_device_that_sends_and_receives_as_full_duplex():
    """Links are full duplex (`Topology`: a device sends and, at the same time, receives):
    devices 0 and 1 (one domain) swapping the halves of a 128-byte array each send 64 B and
    receive 64 B over NVLink at 100 B/s, so the direct round-robin baseline takes 0.64 s, not
    1.28 s. Mutation check: a device's received bytes were added to its sent ones."""
    swap = uint8_leaf(128, (0, 1), ("s",), (1, 0), ("d",))
    p = profile(intra_efficiency=1.0, inter_efficiency=1.0, bucket_overhead=0.0)
    seconds = costmodel.direct_round_robin([swap], topo(), p, chunk_bytes=1 << 20)
    assert seconds == pytest.approx(0.64)


def test_nothing_to_move_costs_nothing():
    lf = uint8_leaf(64, (0, 1), ("s",), (0, 1), ("d",))
    assert costmodel.physical_bound([lf], topo(latency=1.0)).seconds == 0
    assert costmodel.round_model_bound([lf], topo(latency=1.0)).seconds == 0
    assert costmodel.direct_round_robin([lf], topo(), profile(), chunk_bytes=16) == 0


def test_every_profile_says_where_each_figure_comes_from():
    for p in PROFILES.values():
        for field in ("round_latency", "copy_bandwidth", "launch_overhead", "bucket_overhead",
                      "host_runs_ahead", "overlap_links", "host_copy_bandwidth",
                      "host_link_bandwidth"):  # fmt: skip
            assert p.source_of(field), (p.name, field)
        if p.name != "cpu":
            assert dict(p.sources).keys() >= {"intra_efficiency", "inter_efficiency"}


# ------------------------------------------------------------------------------- simulator


def test_inventories_match_the_published_parameter_counts():
    counts = {name: make().num_params / 1e9 for name, make in sim.MODELS.items()}
    assert counts["deepseek-v3"] == pytest.approx(671.0, abs=0.1)
    assert counts["kimi-k2"] == pytest.approx(1026.4, abs=0.1)  # "1T" (1.04T with its MTP)
    assert counts["qwen3-235b-a22b"] == pytest.approx(235.1, abs=0.1)
    assert counts["llama-3.1-70b"] == pytest.approx(70.55, abs=0.1)
    assert counts["qwen3-4b"] == pytest.approx(4.02, abs=0.01)


def test_parse_strategy_multiplies_written_axes_and_folds_ep_to_fit():
    s = sim.parse_strategy("EP16 DP2 PP4")
    assert s.axes == (("pp", 4), ("dp", 2), ("ep", 16)) and s.ep_axes == ("ep",)
    assert sim.parse_strategy("EP16 DP16 PP4").num_devices == 1024  # EP is not folded into DP
    assert sim.parse_strategy("EP32 DP16 PP4").num_devices == 2048
    folded = sim.parse_strategy("TP2 EP16 PP4", devices=64)
    assert folded.axes == (("pp", 4), ("dp", 8), ("tp", 2)) and folded.ep_axes == ("dp", "tp")
    filled = sim.parse_strategy("EP16 PP4", devices=128)  # DP32 per stage, expert DP 2
    assert filled.axes == (("pp", 4), ("dp", 32)) and filled.ep == 16
    assert sim.parse_strategy("TP8 DP16").num_devices == 128
    with pytest.raises(ValueError, match="unknown axis"):
        sim.parse_strategy("XP4")
    with pytest.raises(ValueError, match="does not fit"):
        sim.parse_strategy("TP3", devices=8)
    with pytest.raises(ValueError, match="lays out 1024 devices, not 128"):
        sim.parse_strategy("EP16 DP16 PP4", devices=128)
    with pytest.raises(ValueError, match="EP16 must divide the 8 devices"):
        sim.parse_strategy("EP16 PP4", devices=32)
    for text in ("FSDP0", "TP0 DP4"):  # a size-0 axis is an error, not an axis left out
        with pytest.raises(ValueError, match="has size 0"):
            sim.parse_strategy(text)


def test_folded_ep_repeats_expert_ranks_over_the_stage():
    model = sim.deepseek_v3()
    experts = next(p for p in model.params if p.name == "moe.experts.up")
    lay = sim.layout(experts, model, sim.parse_strategy("EP16 PP4", devices=128), range(128))
    assert lay.box_of[0][1] == lay.box_of[16][1] == (0, 16)  # expert DP: ranks 0 and 16
    assert lay.box_of[15][1] == (240, 256)


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


def test_placements():
    """72-GPU racks. Rack-aligned, a 128-GPU trainer takes 64 GPUs of racks 0 and 1 and the
    sampler 64 of racks 2 and 3; 512 GPUs take 8 racks of 64. Contiguous, the trainer fills
    rack 0 and 56 slots of rack 1, and 16 of the sampler's GPUs share rack 1 with it."""
    src, dst = sim.device_ids(128, 128, 72, colocated=False, placement="rack-aligned")
    assert src == [*range(64), *range(72, 136)]
    assert dst == [*range(144, 208), *range(216, 280)]
    _, dst = sim.device_ids(128, 512, 72, colocated=False, placement="rack-aligned")
    assert [sum(d // 72 == r for d in dst) for r in range(2, 10)] == [64] * 8
    _, dst = sim.device_ids(8, 200, 72, colocated=False, placement="rack-aligned", dst_unit=4)
    assert [sum(d // 72 == r for d in dst) for r in range(1, 4)] == [68, 68, 64]
    _, dst = sim.device_ids(8, 2048, 72, colocated=False, placement="rack-aligned", dst_unit=8)
    counts = [sum(d // 72 == r for d in dst) for r in range(1, 30)]
    assert sorted(set(counts)) == [64, 72] and all(c % 8 == 0 for c in counts)  # no TP8 split
    _, dst = sim.device_ids(128, 128, 72, colocated=False, placement="contiguous")
    assert dst[0] == 128 and sum(d // 72 == 1 for d in dst) == 16
    _, dst = sim.device_ids(8, 8, 8, colocated=True, placement="rack-aligned")
    assert dst == list(range(8))
    r = sim.simulate("qwen3-4b", "FSDP8", "TP8", "h100", placement="rack-aligned")
    assert set(r.topology.devices) == set(range(16))
    t = Topology.profile("gb200-nvl72", ids=[0, 71, 72, 144])
    assert t.domains == (0, 0, 1, 2)


def test_small_scenario_respects_its_bounds():
    r = sim.run_scenario("qwen3-4b", materialize=True)
    assert r.stats.bytes_sent == r.stats.bytes_lower_bound > 0
    assert r.modeled.seconds >= r.rounds_only.seconds * 0.85  # overheads only add
    # The executor's plan runs unit after unit (each capped at MAX_UNIT_COPIES copies per
    # device for compile time), and every unit's rounds pay a latency: on this small model
    # the rounds are latency-bound, so they stay within 2x of the round-model bound (the
    # rounds of each unit meet Konig's count: tests/test_lower.py).
    assert r.rounds_only.seconds <= 2.0 * r.round_model_bound.seconds
    assert r.full_planning_seconds is not None


def test_fan_out_scenario_on_a_small_virtual_cluster():
    """Qwen3-4B from FSDP8 (one H100 domain) to TP4 DP2 (the next domain): each byte crosses
    once, split over both replicas, then each relays its half to the other."""
    r = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100")
    s = r.stats
    full = sum(math.prod(p.shape) for p in r.model.params) * 2
    assert s.bytes_cross_domain == full == r.bound.bytes_cross_needed
    assert s.bytes_relayed == s.bytes_lower_bound - full
    assert s.bytes_sent == s.bytes_lower_bound  # 2 replicas (norms are held by every TP rank)
    # Were each unit's relays to run beside the next unit's imports (two lanes at once), the
    # rounds would take about the import over the NICs at their 90% efficiency; run in turn,
    # as XLA GPU runs them, the relays add.
    assert r.two_lanes.transfer <= 1.35 * r.bound.seconds < r.round_model_bound.seconds * 1.25
    assert r.modeled.transfer > r.two_lanes.transfer


def test_the_plan_is_also_priced_with_two_lanes_at_once():
    """XLA GPU runs a bucket's rounds in turn (the modeled time); the same plan priced as if
    a bucket's rounds across and inside domains ran at once is reported beside it, and is
    that profile's modeled time."""
    r = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100")
    assert r.profile.overlap_links and not r.profile.permutes_overlap
    assert r.two_lanes is not None
    overlapped = dataclasses.replace(r.profile, permutes_overlap=True)
    at_once = costmodel.modeled_time(r.rounds, r.topology, overlapped)
    assert r.two_lanes.seconds < r.modeled.seconds  # relays hide under the imports
    assert r.two_lanes.transfer == pytest.approx(at_once.transfer)
    assert r.record()["modeled_two_lanes_s"] == r.two_lanes.seconds
    # Priced in one pass over the schedule (counted once), each is its profile's own modeled
    # time, to the bit, whatever else the profiles change.
    others = [
        dataclasses.replace(overlapped, round_latency=0.0),
        dataclasses.replace(r.profile, copy_bandwidth=1e9, copy_overhead=1e-3),
        sim.PROFILES["cpu"],
    ]
    profiles = [r.profile, overlapped, *others]
    each = [costmodel.modeled_time(r.rounds, r.topology, p) for p in profiles]
    assert costmodel.modeled_times(r.rounds, r.topology, profiles) == each
    assert len(set(each)) == len(each)
    cpu = sim.simulate("qwen3-4b", "FSDP8", "TP8", "cpu", colocated=True)
    assert cpu.two_lanes is None and cpu.record()["modeled_two_lanes_s"] is None  # one lane there


def test_the_plan_is_also_priced_without_each_overhead():
    """What each overhead costs: the same plan re-priced with copies free, without round
    latency, both, and also without host work and launch gaps. Each figure is the modeled
    time under the profile without those costs, whose parts for them are zero."""
    r = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100")  # (no local copies)
    w = r.without
    assert list(w) == list(sim.WITHOUT) and r.record()["modeled_without_s"] == w
    for name, costs in sim.WITHOUT.items():
        m = costmodel.modeled_time(
            r.rounds, r.topology, sim._without(r.profile, costs), leaves=r.leaves, units=r.units
        )
        assert w[name] == m.seconds
        if "copies" in costs:
            assert m.pack == m.unpack == m.local == 0.0
        if "round_latency" in costs:
            assert m.latency == 0.0
        if "host" in costs:
            assert m.overhead == 0.0
    assert w["copies_latency_host"] < w["copies_and_latency"]
    assert w["copies_and_latency"] < min(w["copies"], w["round_latency"])
    assert max(w["copies"], w["round_latency"]) < r.modeled.seconds
    assert "without overheads" in sim.format_result(r)


def test_destination_domains_forward_to_each_other_where_the_source_nics_would_bind():
    """Two destination hosts need the whole model from one source host of 8 NICs. Sent into
    each destination domain, the model would leave the source twice and the source's export
    would bind (1.5x the physical bound and more). The plan chains the two domains instead:
    the model leaves the source once, half into each, and each forwards its half to the
    other, so the rounds (at peak) take less than the source's double export."""
    r = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP4", "h100")
    full = sum(math.prod(p.shape) for p in r.model.params) * 2
    assert r.stats.bytes_cross_domain == 2 * full  # each domain still takes in each byte once
    assert r.stats.bytes_relayed_cross_domain == full  # half of it from the other domain
    twice = 2 * full / (8 * r.topology.inter_bandwidth)
    assert twice > 1.5 * r.bound.seconds
    assert r.bound.seconds <= r.rounds_only.seconds < twice


def test_chained_plans_leave_room_for_two_faster_rounds_beside_a_slow_one(monkeypatch):
    """A chained plan (stage 2: relays inside domains of what crossed between them) asks the
    chunk choice for two faster chunks beside one of the slowest links' in a bucket; a plan
    that is not chained keeps its chunks as large as they come (its lanes' rounds do not
    outnumber each other the same way)."""
    asked = []
    real = schedule._class_chunks  # (the chunk choice over a plan's streams as arrays)

    def spy(*args, **kwargs):
        asked.append(kwargs.get("beside_slowest", 0))
        return real(*args, **kwargs)

    monkeypatch.setattr(schedule, "_class_chunks", spy)
    chained = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP4", "h100")
    fanned = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100")
    assert chained.stats.bytes_relayed_cross_domain > 0 == fanned.stats.bytes_relayed_cross_domain
    assert asked == [2, 0]
    room = dict(chained.rounds.class_chunk_bytes)
    assert 2 * room[0] + room[1] <= sim.GPU_BUCKET_BYTES


def _lanes_per_bucket(r: sim.Result) -> list[set[bool]]:
    """Per bucket, which lanes its rounds use (True: a round with a cross-domain message)."""
    return [
        {any(r.topology.crosses(s, d) for (s, d), _ in entries) for _, entries in b.rounds}
        for b in r.rounds.buckets
    ]


@pytest.mark.parametrize("bucket_mib", [32, 64, 128])
def test_where_lanes_overlap_a_bucket_holds_a_round_of_each(bucket_mib, monkeypatch):
    """On GPUs, where a whole-bucket chunk of the faster links and one of the slowest's would
    not fit one bucket together (Qwen3-4B FSDP8 -> TP4 DP2 on H100: 90 + 45 MiB chunks in
    128 MiB buckets), the faster chunks shrink to fit beside the slowest's, and buckets hold
    both lanes (fewer buckets; two lanes at once, were XLA to run them so); without
    ``lanes_overlap`` (CPU), they stay as large as they come."""
    bucket = bucket_mib * sim.MiB
    r = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100", bucket_bytes=bucket)
    chunk = dict(r.rounds.class_chunk_bytes)
    assert chunk[0] + chunk[1] <= bucket
    assert any(lanes == {True, False} for lanes in _lanes_per_bucket(r))

    def taking_turns(*args):
        return {**schedule.platform_options(*args), "lanes_overlap": False}

    monkeypatch.setattr(sim, "platform_options", taking_turns)
    r = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100", bucket_bytes=bucket)
    assert sum(dict(r.rounds.class_chunk_bytes).values()) > bucket


def test_a_sliver_beside_the_slowest_chunks_is_not_taken():
    """With 8 MiB buckets the slowest links' chunks leave a sliver (0.4 MiB): NVLink rounds that
    small would each cost far more latency than moving their bytes, which the overlap does not
    win back, so the faster chunks stay whole and the lanes take separate buckets."""
    bucket = 8 * sim.MiB
    r = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100", bucket_bytes=bucket)
    chunk = dict(r.rounds.class_chunk_bytes)
    assert chunk[0] + chunk[1] > bucket
    assert chunk[0] > bucket // 2


def test_the_gap_to_the_bound_adds_up_by_cause():
    """The causes add up to ``modeled - bound``; links at their efficiency cost exactly the
    bound at that efficiency; latency is what the rounds' latencies add: without them the
    rounds take that much less (to within a bucket whose longer lane changes)."""
    r = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100")
    gap = r.gap()
    assert sum(gap.values()) == pytest.approx(r.modeled.seconds - r.bound.seconds)
    eff = PROFILES["h100"].inter_efficiency  # the import over the NICs binds
    assert gap["link_efficiency"] == pytest.approx(r.bound.seconds * (1 / eff - 1))
    assert gap["round_latency"] == pytest.approx(r.modeled.latency) and gap["round_latency"] > 0
    fast = dataclasses.replace(r.profile, round_latency=0.0)
    no_latency = costmodel.modeled_time(r.rounds, r.topology, fast)
    assert no_latency.latency == 0.0  # (a bucket's longer lane may change without latency)
    assert no_latency.transfer == pytest.approx(r.modeled.transfer - r.modeled.latency, rel=0.01)


def test_cli_prints_the_table_and_writes_json(capsys, tmp_path):
    path = tmp_path / "out.json"
    argv = ["--model", "qwen3-4b", "--src", "FSDP8", "--dst", "TP8", "--colocated"]
    assert sim.main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    for row in ("modeled time", "physical bound", "round-model bound", "all-gather + broadcast",
                "direct p2p (round-robin)", "M2N-like", "rank-0 broadcast",
                "bytes: per link class", "rounds", "planning"):  # fmt: skip
        assert row in out
    (record,) = json.loads(path.read_text())
    assert record.keys() >= {
        "scenario", "placement", "params", "bytes", "modeled_s", "lower_bound_s", "baselines",
        "planning_s", "buckets", "gap_to_bound_s",
    }  # fmt: skip
    assert record["placement"] == "colocated" and record["params"] == sim.qwen3_4b().num_params
    assert record["bytes"]["cross_domain"] == 0
    assert record["modeled_s"] >= record["lower_bound_s"] > 0


def test_units_span_the_buckets_asked_for(capsys, tmp_path):
    """``--unit-buckets N``: units of at most ``N`` buckets' bytes a device (and the relays
    pipelined into them); the default is what `jaxreshard.plan` takes on GPUs
    (`GPU_UNIT_BUCKETS`). Smaller units, more of them. The record counts the plan's distinct
    transfer programs."""
    argv = ["--model", "qwen3-4b", "--src", "FSDP8", "--dst", "TP8", "--colocated"]
    argv += ["--bucket-mib", "4"]
    records = {}
    for n in (None, 1, 2):
        path = tmp_path / f"{n}.json"
        assert (
            sim.main([*argv, *(("--unit-buckets", str(n)) if n else ()), "--json", str(path)]) == 0
        )
        (records[n],) = json.loads(path.read_text())
    assert "distinct transfer programs" in capsys.readouterr().out
    r = sim.simulate("qwen3-4b", "FSDP8", "TP8", "h100", colocated=True, bucket_bytes=4 << 20)
    assert records[None]["units"] == len(r.units)
    assert records[None]["transfer_programs"] == len(set(r.rounds.rounds_by_bucket())) >= 1
    assert records[1]["units"] > records[2]["units"] > records[None]["units"]
    assert records[None]["program_copies"] is None  # (counted with --materialize only)
    cut = sim.simulate(
        "qwen3-4b", "FSDP8", "TP8", "h100", colocated=True, bucket_bytes=4 << 20, materialize=True
    )
    total, most = cut.program_copies
    # Every bucket of this plan's distinct units has some device copy at least one segment.
    assert total >= most >= 1 and total >= cut.transfer_programs
    # Priced as cut, the same rounds: only the copies are counted otherwise (packs shared,
    # rows known).
    assert records[None]["modeled_as_cut_s"] is None
    assert cut.modeled_as_cut.transfer == pytest.approx(cut.modeled.transfer)
    assert cut.record()["modeled_as_cut_s"] == cut.modeled_as_cut.seconds > 0


def test_the_summary_reads_each_scenarios_record():
    """`--all` keeps only each scenario's record (its plan is let go once printed): the
    summary line shows the record's modeled time, bound, ratios and baselines."""
    r = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "gb200-nvl72", title="small: x")
    (line,) = sim.summary([r.record("small")]).splitlines()[1:]
    ag = r.baselines["all-gather + broadcast"] / r.modeled.seconds
    two_lanes = r.two_lanes.seconds / r.bound.seconds
    floor = r.executor_floor.seconds / r.bound.seconds
    for figure in (sim._ms(r.modeled.seconds), sim._ms(r.bound.seconds), f"{r.ratio:.2f}",
                   f"{floor:.2f}", f"{two_lanes:.2f}", f"{ag:.2f}x"):  # fmt: skip
        assert f" {figure} " in f" {line} "
    ratio, floor_column = line.split()[6:8]  # after the scenario, placement, two times
    assert (ratio, floor_column) == (f"{r.ratio:.2f}", f"{floor:.2f}")
    assert line.startswith("small ")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--dst", "TP3"], "32 units of 128 cannot be split 3 ways"),
        (["--dst", "XX8"], "unknown axis 'XX'"),
        (["--dst", "TP8", "--dst-devices", "12"], "does not fit 12 devices"),
        (["--dst", "TP8", "--bucket-mib", "0"], "--bucket-mib: must be above 0"),
        (["--dst", "TP8", "--src-devices", "-8"], "--src-devices: must be above 0"),
        (["--dst", "TP8", "--bytes-per-param", "3"], "invalid choice: 3"),
        (["--dst", "TP3"], "--dst 'TP3': attn.q"),  # which side, which layout
        (["--dst", "TP8", "--bucket-mib", "1e-9"], "--bucket-mib: 1e-09 MiB is not 16 bytes"),
        (["--dst", "TP8", "--bucket-mib", "inf"], "--bucket-mib: inf MiB is not 16 bytes"),
        (["--dst", "TP8", "--json", "/nonexistent/folder/x.json"], "no folder"),
        (["--dst", "TP8", "--json", "."], "is a directory"),
        # Axes that would split nothing (taken as data parallelism without a word):
        (["--dst", "FSDP3", "--dst-devices", "3"], "FSDP3 divides no dimension"),
        (["--dst", "EP8"], "EP8, but the model has no routed experts"),
        (["--dst", "PP64"], "PP64 stages for 36 layers"),
        # Layouts no framework makes (an audit): query heads replicated by a TP beyond them,
        # a matrix FSDP divides nowhere.
        (["--dst", "TP64", "--dst-devices", "64"], "attn.q: 32 units of 128 cannot be split"),
        (["--dst", "FSDP3 TP2", "--dst-devices", "6"], "FSDP3 divides no dimension of"),
    ],
)
def test_cli_refuses_a_bad_setup_with_its_reason_not_a_traceback(capsys, argv, says):
    with pytest.raises(SystemExit) as exited:
        sim.main(["--model", "qwen3-4b", "--src", "FSDP8", *argv])
    assert exited.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize(
    "fixed", [["--scenario", "qwen3-4b"], ["--all"], ["--calibrate"], ["--calibrate-device"]]
)
def test_cli_refuses_setup_arguments_a_scenario_would_ignore(capsys, fixed):
    """(An audit: --placement and --bytes-per-param were taken beside a scenario, which then
    printed its published comparison beside another setup; two modes at once ran one.)"""
    with pytest.raises(SystemExit) as exited:
        sim.main([*fixed, "--topology", "gb200-nvl72", "--colocated"])
    assert exited.value.code == 2
    assert "drop --topology, --colocated" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim.main([*fixed, "--placement", "contiguous", "--bytes-per-param", "2"])
    assert "drop --placement, --bytes-per-param" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim.main([*fixed, "--all" if "--all" not in fixed else "--calibrate"])
    assert "choose one" in capsys.readouterr().err


def test_an_expert_parallelism_beyond_the_experts_is_refused(capsys):
    """(An audit: EP512 over DeepSeek-V3's 256 experts held each expert twice.)"""
    with pytest.raises(SystemExit):
        sim.main(["--model", "deepseek-v3", "--src", "EP512", "--dst", "TP8 DP64"])
    assert "moe.experts.gate: 256 units of 1 cannot be split 512 ways" in capsys.readouterr().err


def test_a_colocated_sampler_larger_than_the_trainer_keeps_every_replica():
    """Regression: rack-aligned, the sampler's GPUs were cut to the trainer's (DP2 lost a
    replica while the report said 16 GPUs). The bytes by hand: the second replica's 8 GPUs
    hold nothing, so they receive the whole model; the shared 8 receive what they lack."""
    one = sim.simulate("qwen3-4b", "FSDP8", "TP8", "h100", colocated=True)
    two = sim.simulate("qwen3-4b", "FSDP8", "TP8 DP2", "h100", colocated=True)
    replica = one.stats.bytes_total  # one TP8 copy (KV heads replicated over TP)
    assert len(set(two.topology.devices)) == 16
    assert two.stats.bytes_total == 2 * replica
    assert two.stats.bytes_sent == one.stats.bytes_sent + replica


def test_cli_runs_as_a_module():
    done = subprocess.run(
        [sys.executable, "-m", "jaxreshard.simulate", "--scenario", "qwen3-4b"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "qwen3-4b: FSDP8 -> TP8" in done.stdout and "modeled time" in done.stdout


# Scenarios whose planning and pricing take several seconds to a minute here (Kimi-K2 and
# NeMo-RL's setup about 2-3 s to plan, 512 GPUs 3 s, 4,096 GPUs 8-12 s, then priced with
# both lanes and one in a pass and four more times without overheads) run in
# `python -m jaxreshard.simulate --all` (the README's table), not in the suite, which must
# stay within ~10 minutes on 2 cores.
SLOW_SCENARIOS = {"deepseek-v3-4096", "deepseek-v3-512", "nemo-rl-deepseek-v3", "kimi-k2-fp8"}
FAST_SCENARIOS = sorted(set(sim.SCENARIOS) - SLOW_SCENARIOS)


@pytest.mark.parametrize("name", FAST_SCENARIOS)
def test_every_scenario_respects_the_physical_bound(name):
    """On every scenario the plan moves exactly the bytes it must, and no modeled schedule,
    ours or a baseline's, beats the physical bound (which would make it no bound)."""
    r = sim.run_scenario(name)
    assert r.stats.bytes_sent == r.stats.bytes_lower_bound
    assert r.stats.bytes_cross_domain >= r.bound.bytes_cross_needed
    assert r.modeled.seconds >= r.bound.seconds > 0
    assert r.executor_floor is not None and r.bound_at_efficiency is not None
    assert r.modeled.seconds >= r.executor_floor.seconds >= r.bound_at_efficiency.seconds
    for baseline, seconds in r.baselines.items():
        assert seconds >= r.bound.seconds, baseline


def test_results_are_deterministic():
    a = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100")
    b = sim.simulate("qwen3-4b", "FSDP8", "TP4 DP2", "h100")
    assert a.rounds == b.rounds and a.stats == b.stats
    assert np.isclose(a.modeled.seconds, b.modeled.seconds)


def test_calibration_prices_a_real_plans_schedule(devices):
    """`--calibrate` prices `jr.plan`'s own schedule: every bucket and round of it, each
    message's segments (a cast leaf takes the narrow path), and the parts add up."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxreshard as jr
    from jaxreshard.tools import calibrate

    src = NamedSharding(Mesh(np.array(devices[:4]).reshape(2, 2), ("f", "t")), P("f", "t"))
    dst = NamedSharding(Mesh(np.array(devices[4:]), ("t",)), P(None, "t"))
    tree = {"w": jax.jit(lambda: jnp.ones((256, 512), jnp.float32), out_shardings=src)()}
    plan = jr.plan(tree, {"w": dst}, bucket_bytes=64 << 10)
    slow = dataclasses.replace(PROFILES["cpu"], narrow_copy_bandwidth=1e6)
    m = calibrate.modeled(plan, slow)
    assert (m.buckets, m.rounds) == (plan.stats.buckets, plan.stats.rounds) and m.buckets > 1
    assert m.seconds == pytest.approx(m.transfer + m.pack + m.unpack + m.local + m.overhead)
    cast = jr.plan(tree, {"w": dst}, bucket_bytes=64 << 10, dtype=jnp.bfloat16)
    assert calibrate.modeled(cast, slow).pack > 10 * calibrate.modeled(cast, PROFILES["cpu"]).pack
    # buckets a call runs as one joined step (`lower.Step.buckets`) are priced as that step
    many = {f"w{i}": jax.device_put(np.ones((64, 64), np.float32), src) for i in range(128)}
    joined = jr.plan(many, dict.fromkeys(many, dst))
    m = calibrate.modeled(joined, PROFILES["cpu"])
    assert len(joined.schedule.buckets) > joined.stats.buckets == m.buckets
    assert m.rounds == joined.stats.rounds


def test_device_calibration_measures_every_figure_a_gpu_profile_assumes(devices, capsys):
    """`--calibrate-device` (here on one CPU device, small): every copy and launch figure
    measured, finite and of the right sign, and each set beside the GPU profiles'
    assumption."""
    from jaxreshard.tools import calibrate

    copies = calibrate.measure_device(devices[0], nbytes=1 << 20, reps=2, boxes=(2, 6))
    assert copies.nbytes == 1 << 20  # half the columns of a 2 MiB matrix
    rates = (copies.flat_copy, copies.box_copy, copies.narrow_copy)
    for rate in (*rates, copies.cast_copy, copies.bf16_copy):
        assert 0 < rate < float("inf")
    # the average of the cast and the plain bf16 copy (harmonic: the same bytes each)
    both = 2 / (1 / copies.cast_copy + 1 / copies.bf16_copy)
    assert copies.narrow_copy == pytest.approx(both)
    times = (copies.per_row, copies.per_box, copies.per_argument, copies.per_program)
    assert all(0 <= t < 1 for t in times) and copies.compile_per_box >= 0
    fields = [f for f, _, _ in calibrate.device_profiles_against(copies)]
    assert fields == [
        "copy_bandwidth",
        "narrow_copy_bandwidth",
        "run_overhead",
        "copy_overhead",
        "argument_overhead",
        "launch_overhead",
    ]
    h200 = dataclasses.replace(copies, device="NVIDIA H200", box_copy=1200 * GB)
    assert calibrate.device_profiles_against(h200)[0][2] == "50% of HBM peak / 2"


def test_boxes_of_one_contiguous_run_copy_at_the_contiguous_speed(devices, monkeypatch):
    """`Profile.contiguous_copy_bandwidth` prices a box that is one run of the shard it reads
    or writes; a box of many rows keeps the box copy's speed. By hand, one bucket on one host
    of 8 CPU devices, no per-box or per-row cost: rows -> rows, every box is whole rows of
    both shards (pack and unpack at 4 GB/s); columns over 4 -> columns over 2, each box is
    half the columns of its destination shard (unpack at 1 GB/s: 256 rows of each). (Staged:
    rows -> rows would move as whole shards, `test_a_whole_shard_step_is_priced_as_rounds`.)"""
    import jax

    from jaxreshard.planning import whole

    monkeypatch.setattr(whole, "MOVE_WHOLE_SHARDS", False)
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxreshard as jr
    from jaxreshard.tools import calibrate

    profile = dataclasses.replace(
        PROFILES["cpu"],
        copy_bandwidth=1e9,
        host_copy_bandwidth=1e9,
        contiguous_copy_bandwidth=4e9,
        copy_overhead=0.0,
        run_overhead=0.0,
    )
    first = Mesh(np.array(devices[:4]), ("x",))
    nbytes = 256 * 512 * 4
    for src_spec, dst_mesh, dst_spec, unpack_bw in (
        (P("x"), Mesh(np.array(devices[4:]), ("x",)), P("x"), 4e9),
        (P(None, "x"), Mesh(np.array(devices[4:6]), ("x",)), P(None, "x"), 1e9),
    ):
        src = NamedSharding(first, src_spec)
        tree = {"w": jax.jit(lambda: jnp.ones((256, 512), jnp.float32), out_shardings=src)()}
        plan = jr.plan(tree, {"w": NamedSharding(dst_mesh, dst_spec)}, bucket_bytes=8 << 20)
        assert plan.stats.buckets == 1 and plan.stats.bytes_sent == nbytes
        m = calibrate.modeled(plan, profile)
        assert m.pack == pytest.approx(nbytes / 4e9)  # every source shard whole
        assert m.unpack == pytest.approx(nbytes / unpack_bw)
        without = calibrate.modeled(
            plan, dataclasses.replace(profile, contiguous_copy_bandwidth=None)
        )
        assert without.pack == pytest.approx(nbytes / 1e9)
        # the floor takes the fastest copy speed the profile gives: still under the plan
        topology = dataclasses.replace(
            plan.topology,
            intra_bandwidth=profile.intra_bandwidth,
            inter_bandwidth=profile.inter_bandwidth,
        )
        floor = costmodel.executor_floor(plan.leaves, topology, profile)
        assert 0 < floor.seconds <= m.seconds


def test_a_whole_shard_step_is_priced_as_rounds_with_no_copies(devices, monkeypatch):
    """A leaf moved as whole shards (`planning.whole`) is priced as its rounds only: no pack,
    no unpack, no local copy; each round is a shard over the profile's link, plus its
    latency. By hand: 4 -> 4 devices of one host, one round of 128 KiB shards."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxreshard as jr
    from jaxreshard.planning import whole
    from jaxreshard.tools import calibrate

    monkeypatch.setattr(whole, "LATENCY_MARGIN", 0.0)  # (a small leaf, whole all the same)
    profile = dataclasses.replace(
        PROFILES["cpu"], host_link_bandwidth=None, bucket_overhead=0.0, argument_overhead=0.0
    )
    src = NamedSharding(Mesh(np.array(devices[:4]), ("x",)), P("x"))
    dst = NamedSharding(Mesh(np.array(devices[4:]), ("x",)), P("x"))
    tree = {"w": jax.jit(lambda: jnp.ones((256, 512), jnp.float32), out_shardings=src)()}
    plan = jr.plan(tree, {"w": dst})
    assert [step.whole for step in plan.lowered.steps] == [(0,)]
    m = calibrate.modeled(plan, profile)
    shard = 256 * 512 * 4 // 4
    link = profile.intra_bandwidth * profile.intra_efficiency
    assert m.pack == m.unpack == m.local == 0.0
    assert m.rounds == 1 and m.buckets == 1
    assert m.transfer == pytest.approx(profile.round_latency + shard / link)
    assert m.seconds == pytest.approx(m.transfer + m.overhead)
