"""A NumPy model of the executor: runs a plan's schedule byte for byte, without JAX.

It lets the pure planner and scheduler be checked on any cluster size: every destination
shard it produces must equal NumPy slicing of the global array.
"""

from __future__ import annotations

import numpy as np

from jaxreshard.plan.layout import Box, box_shape, shift
from jaxreshard.plan.route import Assignment, LeafSpec
from jaxreshard.plan.schedule import Schedule


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def run_reference(
    leaves: list[LeafSpec], globals_: list[np.ndarray], assignment: Assignment, schedule: Schedule
) -> list[dict[int, np.ndarray]]:
    """Destination shards (device id -> array) per leaf, produced by following the schedule."""
    dst: list[dict[int, np.ndarray]] = []
    for leaf, g in zip(leaves, globals_, strict=True):
        shards = {}
        for device, box in zip(leaf.dst.devices, leaf.dst.boxes, strict=True):
            shards[device] = np.zeros(box_shape(box), g.dtype)
        dst.append(shards)
    for c in assignment.local:
        leaf = leaves[c.leaf]
        origin = [a for a, _ in leaf.dst.box_of[c.device]]
        dst[c.leaf][c.device][_slices(shift(c.box, origin))] = globals_[c.leaf][_slices(c.box)]
    for bucket in schedule.buckets:
        send: dict[int, np.ndarray] = {}
        for m in bucket.messages:
            buf = send.setdefault(m.src, np.zeros(bucket.buffer_bytes, np.uint8))
            base = bucket.slot_offset(m.slot)
            assert m.nbytes <= bucket.slot_bytes[m.slot], "a message overflows its chunk"
            for seg in m.segments:
                leaf = leaves[seg.leaf]
                if seg.from_dst:
                    origin = [a for a, _ in leaf.dst.box_of[m.src]]
                    data = dst[seg.leaf][m.src][_slices(shift(seg.box, origin))]
                else:
                    assert m.src in leaf.src.box_of, "a sender does not hold the source shard"
                    held = leaf.src.box_of[m.src]
                    pairs = zip(held, seg.box, strict=True)
                    inside = all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in pairs)
                    assert inside, "a sender sends bytes it does not hold"
                    data = globals_[seg.leaf][_slices(seg.box)]
                raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
                assert raw.size == seg.nbytes
                buf[base + seg.offset : base + seg.offset + seg.nbytes] = raw
        for m in bucket.messages:
            base = bucket.slot_offset(m.slot)
            for seg in m.segments:
                leaf = leaves[seg.leaf]
                raw = send[m.src][base + seg.offset : base + seg.offset + seg.nbytes]
                origin = [a for a, _ in leaf.dst.box_of[m.dst]]
                target = dst[seg.leaf][m.dst]
                target[_slices(shift(seg.box, origin))] = raw.view(target.dtype).reshape(
                    box_shape(seg.box)
                )
    return dst


def assert_reference_exact(
    leaves: list[LeafSpec], assignment: Assignment, schedule: Schedule
) -> None:
    """Random bytes through the NumPy model: every destination shard equals NumPy slicing."""
    rng = np.random.default_rng(0)
    globals_ = [
        rng.integers(0, 255, size=int(np.prod(lf.shape)) * lf.itemsize, dtype=np.uint8)
        .view(lf.dst_dtype)
        .reshape(lf.shape)
        for lf in leaves
    ]
    shards = run_reference(leaves, globals_, assignment, schedule)
    for lf, g, got in zip(leaves, globals_, shards, strict=True):
        for device, box in zip(lf.dst.devices, lf.dst.boxes, strict=True):
            want = g[tuple(slice(a, b) for a, b in box)]
            assert got[device].tobytes() == want.tobytes(), (lf.path, device)
