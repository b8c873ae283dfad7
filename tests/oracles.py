"""Independent oracles for plan tests: what a plan must achieve, from the layouts alone.

Nothing here imports jaxreshard. Expectations computed with the planner's own helpers would
let a planner bug and its check agree; these compute boxes, byte lower bounds and sender-load
optima from first principles (mesh arithmetic, JAX's ``devices_indices_map``, element masks
and brute force), so they are only for the small cases tests use.

A *box* is ``((start, stop), ...)``, one pair per dimension, as in the rest of the library;
a scalar's box is ``()`` and holds one element.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

Box = tuple[tuple[int, int], ...]
Boxes = dict[int, Box]
"""Device id -> the box of the global array it holds."""


# ----------------------------------------------------------------------------------- boxes


def mesh_boxes(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    device_ids: Sequence[int],
    spec: Sequence[Any],
) -> Boxes:
    """The box each device of ``NamedSharding(Mesh(ids.reshape(mesh_shape), names), P(*spec))``
    holds, by plain mesh arithmetic.

    A dimension split over axes ``(a, b)`` has ``size(a) * size(b)`` blocks; the device at mesh
    coordinate ``c`` holds block ``c[a] * size(b) + c[b]`` (the first axis is the major one,
    as in JAX). Unnamed dimensions are whole. Checked against JAX in tests/test_route.py.
    """
    positions = np.arange(len(device_ids)).reshape(tuple(mesh_shape))
    entries = list(spec) + [None] * (len(shape) - len(spec))
    per_dim = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]
    out: Boxes = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        device = int(device_ids[int(positions[coord])])
        box = []
        for n, names in zip(shape, per_dim, strict=True):
            axes = [list(axis_names).index(a) for a in names]
            blocks = [int(mesh_shape[i]) for i in axes]
            block = int(np.ravel_multi_index([coord[i] for i in axes], blocks)) if axes else 0
            width = n // math.prod(blocks)
            box.append((block * width, block * width + width))
        out[device] = tuple(box)
    return out


def jax_boxes(sharding: Any, shape: Sequence[int]) -> Boxes:
    """The box each device of a JAX sharding holds, from ``sharding.devices_indices_map``."""
    shape = tuple(shape)
    return {
        device.id: tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        for device, index in sharding.devices_indices_map(shape).items()
    }


def size(box: Box) -> int:
    """Elements in a box (1 for a scalar)."""
    return math.prod(b - a for a, b in box)


def common(a: Box, b: Box) -> Box | None:
    """The elements two boxes share, or None."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def mask(shape: Sequence[int], box: Box) -> np.ndarray:
    """A boolean array of ``shape``, True on the box's elements."""
    out = np.zeros(tuple(shape), bool)
    out[tuple(slice(a, b) for a, b in box)] = True
    return out


# --------------------------------------------------------------------------- byte bounds


def lower_bound_bytes(src: Mapping[int, Box], dst: Mapping[int, Box], itemsize: int) -> int:
    """Bytes no scheme can avoid moving into the destination devices.

    Each destination device must receive its shard's elements except those it already holds
    in the source layout (a device holds at most one source box).
    """
    total = 0
    for device, box in dst.items():
        held = common(box, src[device]) if device in src else None
        total += size(box) - (0 if held is None else size(held))
    return total * itemsize


def jax_lower_bound_bytes(src: Any, dst: Any, shape: Sequence[int], itemsize: int) -> int:
    """`lower_bound_bytes` for two JAX shardings of an array of ``shape``."""
    return lower_bound_bytes(jax_boxes(src, shape), jax_boxes(dst, shape), itemsize)


# ------------------------------------------------------------------------- sender loads


def candidate_demands(
    shape: Sequence[int],
    src: Mapping[int, Box],
    dst: Mapping[int, Box],
    itemsize: int,
    domains: Sequence[Iterable[int]] | None = None,
) -> dict[tuple[int, frozenset[int]], int]:
    """``(receiver, candidate senders) -> bytes`` for every byte a receiver lacks.

    An element's candidates are the devices holding it in the source layout; with ``domains``
    (groups of device ids), those in the receiver's own domain when there is one (the
    planner's documented "closest sources"), else all of them.
    """
    senders = sorted(src)
    bit = {s: 1 << i for i, s in enumerate(senders)}
    holders = np.zeros(tuple(shape), np.int64)
    for s, box in src.items():
        holders[tuple(slice(a, b) for a, b in box)] |= bit[s]
    domain_of = {d: g for g, group in enumerate(domains or [senders]) for d in group}
    domain_bits: dict[int, int] = defaultdict(int)
    for s in senders:
        domain_bits[domain_of.get(s, -1)] |= bit[s]
    out: dict[tuple[int, frozenset[int]], int] = defaultdict(int)
    for d, box in dst.items():
        need = mask(shape, box)
        if d in src:
            need &= ~mask(shape, src[d])
        bits = holders[need]
        near = bits & domain_bits.get(domain_of.get(d, -2), 0)
        chosen = np.where(near != 0, near, bits)
        values, counts = np.unique(chosen, return_counts=True)
        for value, count in zip(values.tolist(), counts.tolist(), strict=True):
            group = frozenset(s for s in senders if value & bit[s])
            out[d, group] += count * itemsize
    return dict(out)


def hall_optimum(groups: Mapping[frozenset[int], int]) -> Fraction:
    """The least possible busiest-sender load when each group's bytes may be split in any
    proportion over its candidate senders (brute force over sender subsets).

    For a subset S of senders, the bytes whose candidates all lie in S must leave through S,
    so some sender of S carries at least ``bytes(S) / |S|``. The largest such ratio is also
    attainable (Hall's theorem for flows), so it is the fractional optimum. 2**senders
    subsets: keep to a dozen senders or so.
    """
    senders = sorted({s for group in groups for s in group})
    assert len(senders) <= 14, "brute force over 2**senders subsets"
    best = Fraction(0)
    for k in range(1, len(senders) + 1):
        for subset in itertools.combinations(senders, k):
            inside = set(subset)
            nbytes = sum(b for group, b in groups.items() if group <= inside)
            best = max(best, Fraction(nbytes, k))
    return best


def min_pairs(regions: Sequence[tuple[int, frozenset[int], int]], cap: int) -> int | None:
    """The fewest distinct (sender, receiver) pairs of any assignment that sends each region
    ``(receiver, candidates, bytes)`` whole from one candidate with no sender above ``cap``
    bytes; None if none fits. Brute force: keep to a few million combinations."""
    choices = [sorted(c) for _, c, _ in regions]
    assert math.prod(len(c) for c in choices) <= 5_000_000, "brute force too large"
    best: int | None = None
    for pick in itertools.product(*choices):
        load: dict[int, int] = defaultdict(int)
        for s, (_, _, nbytes) in zip(pick, regions, strict=True):
            load[s] += nbytes
        if max(load.values(), default=0) > cap:
            continue
        pairs = len({(s, d) for s, (d, _, _) in zip(pick, regions, strict=True)})
        best = pairs if best is None else min(best, pairs)
    return best


def regions(
    src: Mapping[int, Box], dst: Mapping[int, Box], itemsize: int
) -> list[tuple[int, frozenset[int], int, Box]]:
    """``(receiver, holders, bytes, box)`` for each part of a destination shard that one
    distinct source box covers and the receiver does not hold (the natural unit of a send)."""
    by_box: dict[Box, set[int]] = defaultdict(set)
    for s, box in src.items():
        by_box[box].add(s)
    out = []
    for d, box in sorted(dst.items()):
        for held, holders in sorted(by_box.items()):
            part = common(box, held)
            if part is None or d in holders:
                continue
            out.append((d, frozenset(holders), size(part) * itemsize, part))
    return out


def row_bytes(box: Box, itemsize: int) -> int:
    """Bytes of one row of ``box``: a slice along its first dimension longer than one (the
    finest whole-row cut of a piece)."""
    lengths = [b - a for a, b in box]
    longer = [n for n in lengths if n > 1]
    return size(box) // (longer[0] if longer else 1) * itemsize
