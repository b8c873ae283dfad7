"""A NumPy model of the executor: runs a plan's schedule byte for byte, without JAX.

It lets the pure planner and scheduler be checked on any cluster size: every destination
shard it produces must equal NumPy slicing of the global array.
"""

from __future__ import annotations

import numpy as np

from jaxreshard.planning.layout import Box, Layout, box_shape, box_size, shift
from jaxreshard.planning.lower import Lowered, PackProgram, Read
from jaxreshard.planning.route import Assignment, LeafSpec
from jaxreshard.planning.schedule import Schedule


def leaf_spec(shape, src, dst, dtype="float32", dst_dtype=None, path="x") -> LeafSpec:
    """A virtual leaf: ``src`` and ``dst`` are ``(mesh_shape, axis_names, device_ids, spec)``
    tuples (as `Layout.from_mesh` takes them after the array's shape)."""
    dst_dtype = dst_dtype or dtype
    return LeafSpec(
        path,
        Layout.from_mesh(shape, *src),
        Layout.from_mesh(shape, *dst),
        dtype,
        dst_dtype,
        max(1, np.dtype(dst_dtype).itemsize),
    )


def slot_widths(lowered: Lowered) -> set[int]:
    """The row widths (`Slot.width`) of every staging slot of a lowered plan (1: flat)."""
    return {slot.width for step in lowered.steps for slot in step.slots}


def pack_reads(lowered: Lowered) -> list[tuple[Read, PackProgram]]:
    """Every box a lowered plan's packs read (`Read`), with the program that reads it (its
    slots' widths, its operands' shards)."""
    return [(r, c.program) for step in lowered.steps for c in step.packs for r in c.program.reads]


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


# ---------------------------------------------------------------------- the lowered programs


def run_lowered(
    leaves: list[LeafSpec], globals_: list[np.ndarray], lowered: Lowered, seed: int = 0
) -> list[dict[int, np.ndarray]]:
    """Destination shards (device id -> array) per leaf, produced by running every program of
    ``lowered`` as the runtime does: pack, transfer, unpack, with NumPy on virtual devices.

    Staging buffers start as random bytes (the runtime recycles buffers whose contents are
    garbage), and destination shards start as random bytes too (donated buffers): a plan is
    correct only if it writes every byte it delivers.
    """
    rng = np.random.default_rng(seed)
    src = [
        {d: g[_slices(box)] for d, box in zip(lf.src.devices, lf.src.boxes, strict=True)}
        for lf, g in zip(leaves, globals_, strict=True)
    ]
    dst = []
    for lf in leaves:
        dtype = np.dtype(lf.dst_dtype)
        shards = {}
        for d, box in zip(lf.dst.devices, lf.dst.boxes, strict=True):
            raw = rng.integers(0, 256, size=box_size(box) * dtype.itemsize, dtype=np.uint8)
            shards[d] = raw.view(dtype).reshape(box_shape(box))
        dst.append(shards)
    union = lowered.union
    made: set[int] = set()  # destinations made so far (a call without donate= allocates them)
    for step in lowered.steps:
        made.update(step.fresh)
        send: dict[tuple[int, int], np.ndarray] = {}
        filled: dict[tuple[int, int], np.ndarray] = {}
        for call in step.packs:
            program = call.program
            assert len(call.table) == len(program.mesh.devices)
            for row, d in zip(call.table, program.mesh.devices, strict=True):
                assert len(row) == program.columns
                slots = call.slots[program.mesh.devices.index(d)]
                base = _bases(program, row)
                # (a joined step's packs each fill their part of one buffer: `based`)
                bufs = [
                    send[d, t] if (d, t) in send else rng.integers(0, 256, s.nbytes, np.uint8)
                    for t, s in zip(slots, program.slots, strict=True)
                ]
                for r in program.reads:
                    shard = _shard(src, dst, call.args[r.operand], d)
                    operand = program.operands[r.operand]
                    assert tuple(shard.shape) == operand.shard, (shard.shape, operand)
                    assert np.dtype(operand.dtype) == shard.dtype
                    start = row[r.column : r.column + len(r.shape)]
                    part = shard[
                        tuple(slice(a, a + n) for a, n in zip(start, r.shape, strict=True))
                    ]
                    assert part.shape == tuple(r.shape), "a read leaves its shard"
                    raw = np.ascontiguousarray(part.astype(np.dtype(r.wire))).reshape(-1)
                    raw = raw.view(np.uint8)
                    at = (base[r.slot] + r.offset) * _word(program.slots[r.slot])
                    assert at + raw.size <= bufs[r.slot].size, "a read overflows its slot"
                    _fill(filled, (d, slots[r.slot]), bufs[r.slot].size, at, raw.size)
                    bufs[r.slot][at : at + raw.size] = raw
                if program.gathers:
                    word = _word(program.slots[0])
                    flat = _flat_words(
                        [
                            _shard(src, dst, call.args[i], d).astype(np.dtype(wire))
                            for i, wire in program.flat
                        ],
                        word,
                    )
                    for g in program.gathers:
                        picks = row[g.column : g.column + g.words]
                        at = base[g.slot] * word
                        _fill(filled, (d, slots[g.slot]), bufs[g.slot].size, at, g.words * word)
                        bufs[g.slot][at : at + g.words * word] = flat[list(picks)].view(np.uint8)
                for k, t in enumerate(slots):
                    assert program.based or (d, t) not in send, "two packs fill one slot"
                    assert program.slots[k] == step.slots[t]
                    send[d, t] = bufs[k]
        for d, t, packed in step.shared:  # sent again from the buffer packed for a round
            assert (d, t) not in send, "a shared round is also packed"
            assert step.slots[t] == step.slots[packed]
            send[d, t] = send[d, packed]
        recv: dict[tuple[int, int], np.ndarray] = {}
        for d, t in step.kept:  # a message a device passes itself: its own packed buffer
            assert step.transfer is not None and t >= len(step.transfer.slots)
            recv[d, t] = send[d, t]
        if step.transfer is not None:
            rounds = step.slots[: len(step.transfer.slots)]
            assert step.transfer.devices == union and step.transfer.slots == rounds
            for t, perm in enumerate(step.transfer.perms):
                assert len({s for s, _ in perm}) == len(perm), "a device sends twice in a round"
                assert len({r for _, r in perm}) == len(perm), "a device receives twice"
                for s, r in perm:
                    assert s != r
                    recv[union[r], t] = send[union[s], t].copy()
        for call in step.unpacks:
            program = call.program
            assert made.issuperset(call.targets), "an unpack writes a destination not made yet"
            for row, d in zip(call.table, program.mesh.devices, strict=True):
                base = _bases(program, row)
                for w in program.writes:
                    leaf = call.targets[w.target]
                    target = dst[leaf][d]
                    assert tuple(target.shape) == program.targets[w.target].shard
                    buf = recv[d, call.slots[program.mesh.devices.index(d)][w.slot]]
                    at = (base[w.slot] + w.offset) * _word(program.slots[w.slot])
                    n = int(np.prod(w.shape)) * target.dtype.itemsize
                    start = row[w.column : w.column + len(w.shape)]
                    box = tuple(slice(a, a + m) for a, m in zip(start, w.shape, strict=True))
                    target[box] = buf[at : at + n].view(target.dtype).reshape(w.shape)
                for c in program.copies:
                    leaf = call.targets[c.target]
                    assert call.sources[c.source] == leaf
                    rank = len(c.shape)
                    s0 = row[c.source_column : c.source_column + rank]
                    t0 = row[c.target_column : c.target_column + rank]
                    part = src[leaf][d][
                        tuple(slice(a, a + m) for a, m in zip(s0, c.shape, strict=True))
                    ]
                    box = tuple(slice(a, a + m) for a, m in zip(t0, c.shape, strict=True))
                    dst[leaf][d][box] = part.astype(dst[leaf][d].dtype)
                if program.rebuilds:
                    word = int(program.word.removeprefix("uint")) // 8
                    slots = call.slots[program.mesh.devices.index(d)]
                    heads = [
                        recv[d, slots[k]][
                            base[k] * _word(program.slots[k]) : (base[k] + n)
                            * _word(program.slots[k])
                        ]
                        for k, n in enumerate(program.prefix)
                        if n
                    ]
                    flat = _flat_words(
                        heads
                        + [
                            src[call.sources[i]][d].astype(np.dtype(dtype))
                            for i, dtype in program.flat_sources
                        ]
                        + [dst[call.targets[t]][d] for t in program.flat_targets],
                        word,
                    )
                    for r in program.rebuilds:
                        target = dst[call.targets[r.target]][d]
                        n = target.nbytes // word
                        picks = row[r.column : r.column + n]
                        target[...] = flat[list(picks)].view(target.dtype).reshape(target.shape)
    return dst


def _bases(program, row) -> list[int]:
    """Each program slot's base word in the table row (0 where the program has none)."""
    n = len(program.slots)
    if not program.based:
        return [0] * n
    bases = list(row[program.columns - n :])
    for base, slot in zip(bases, program.slots, strict=True):
        assert 0 <= base < slot.words and base % slot.width == 0, "a base leaves its slot"
    return bases


def _fill(filled: dict, key, size: int, at: int, n: int) -> None:
    """Mark bytes ``at .. at + n`` of a device's slot of ``size`` bytes as packed; each byte
    is packed once."""
    mask = filled.setdefault(key, np.zeros(size, bool))
    assert not mask[at : at + n].any(), "two packs fill the same words of a slot"
    mask[at : at + n] = True


def _shard(src, dst, arg, device) -> np.ndarray:
    leaf, side = arg
    return (src if side == "src" else dst)[leaf][device]


def _flat_words(parts: list[np.ndarray], word: int) -> np.ndarray:
    """Arrays' bytes end to end, as unsigned words of ``word`` bytes."""
    raw = np.concatenate([np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in parts])
    return raw.view(f"uint{8 * word}")


def _word(slot) -> int:
    return int(slot.word.removeprefix("uint")) // 8


def assert_lowered_exact(leaves: list[LeafSpec], lowered: Lowered, seed: int = 0) -> None:
    """Random bytes through the lowered programs: every destination shard equals NumPy slicing
    of the global array (cast to the destination dtype)."""
    rng = np.random.default_rng(seed)
    globals_ = []
    for lf in leaves:
        dtype = np.dtype(lf.src_dtype)
        n = int(np.prod(lf.shape))
        if lf.src_dtype == lf.dst_dtype:
            raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
            globals_.append(raw.view(dtype).reshape(lf.shape))
        else:  # a cast: finite values, so NumPy's cast is the reference
            globals_.append(rng.standard_normal(lf.shape).astype(dtype))
    shards = run_lowered(leaves, globals_, lowered, seed)
    for lf, g, got in zip(leaves, globals_, shards, strict=True):
        want_all = g.astype(np.dtype(lf.dst_dtype))
        for device, box in zip(lf.dst.devices, lf.dst.boxes, strict=True):
            want = want_all[_slices(box)]
            assert got[device].tobytes() == want.tobytes(), (lf.path, device)
