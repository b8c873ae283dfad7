"""Layouts as per-device boxes, and box arithmetic.

Pure code: no JAX devices are needed to build or compare a `Layout`, so the planner can run on
virtual clusters of any size. `Layout.from_sharding` is the one bridge from a JAX sharding.

A *box* is a hyper-rectangle of a global array: one ``(start, stop)`` pair per dimension. A scalar's
box is ``()`` and holds one element.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

Box = tuple[tuple[int, int], ...]
"""A hyper-rectangle of a global array: ``((start, stop), ...)``, one pair per dimension."""

AxisSpec = tuple[tuple[str, ...], ...]
"""A normalised PartitionSpec: for every dimension, the mesh axes it is split over (major first)."""


class LayoutError(ValueError):
    """A layout that cannot be built; the caller adds which leaf it belongs to."""


def box_shape(box: Box) -> tuple[int, ...]:
    """The shape of the elements a box covers."""
    return tuple([stop - start for start, stop in box])  # a list is faster than a generator


def box_size(box: Box) -> int:
    """Number of elements in a box (1 for the scalar box ``()``)."""
    n = 1
    for start, stop in box:  # called millions of times when planning thousands of GPUs
        n *= stop - start
    return n


def contiguous_runs(box: Box, shape: Sequence[int]) -> int:
    """How many contiguous runs of memory (C order) a box covers in an array of ``shape``
    that holds it: the box's extents before its innermost dimension that is not whole, where
    every dimension after that one is whole (1 for a box that is one run, or a scalar)."""
    extents = box_shape(box)
    j = len(extents) - 1
    while j > 0 and extents[j] == shape[j]:
        j -= 1
    return math.prod(extents[:j]) if j > 0 else 1  # one run, or a scalar


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or None when it holds no element."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def shift(box: Box, origin: Sequence[int]) -> Box:
    """Re-express a global box relative to ``origin`` (the start of the shard that holds it)."""
    return tuple((s - o, e - o) for (s, e), o in zip(box, origin, strict=True))


def full_box(shape: Sequence[int]) -> Box:
    """The box of a whole array."""
    return tuple((0, n) for n in shape)


def split_rows(box: Box, sizes: Sequence[int]) -> list[Box]:
    """Split a box along its first dimension of extent > 1 into consecutive parts.

    ``sizes`` are element counts that must add up to the box's size and be multiples of one
    row along that dimension (the caller rounds them). Zero sizes yield no part. Splitting the
    outermost dimension keeps every part contiguous in row-major order.
    """
    dim = next((i for i, (s, e) in enumerate(box) if e - s > 1), None)
    if dim is None:
        return [box] if any(sizes) else []
    row = box_size(box) // (box[dim][1] - box[dim][0])
    parts, start = [], box[dim][0]
    for size in sizes:
        if size == 0:
            continue
        assert size % row == 0, (size, row)
        stop = start + size // row
        parts.append((*box[:dim], (start, stop), *box[dim + 1 :]))
        start = stop
    assert start == box[dim][1], (box, sizes)
    return parts


def split_flat(box: Box, start: int, stop: int) -> list[Box]:
    """Boxes covering elements ``[start, stop)`` of ``box`` in row-major order.

    A flat range of a box is a "staircase": at most ``2 * ndim - 1`` boxes. Used where a chunk
    boundary cuts a piece, so every part that travels is still a box (sliceable without gathers).
    """
    shape = box_shape(box)
    return [part for part, _ in split_flat_sized(box, shape, strides(shape), start, stop)]


def strides(shape: Sequence[int]) -> list[int]:
    """Row-major element strides of ``shape``."""
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return out


def split_flat_sized(
    box: Box, shape: Sequence[int], steps: Sequence[int], start: int, stop: int
) -> list[tuple[Box, int]]:
    """`split_flat` with each part's element count, given the box's ``shape`` and ``strides``
    (callers cutting one box many times compute them once).

    From ``start``, climb from the innermost dimension outward, each time taking whole units of
    that dimension up to the next unit of the one outside it; then whole outermost rows; then
    descend inward to ``stop``. Each part varies in one dimension (and those inside it) only.
    """
    nd = len(shape)
    if start >= stop:
        return []
    if nd == 0:
        return [(box, 1)]
    cuts = []  # (lo, hi, d): elements [lo, hi) differ only in dimension d and inward
    lo, level = start, 1
    for d in range(nd - 1, 0, -1):
        up = steps[d - 1]
        if lo % up == 0:
            continue
        row_end = lo - lo % up + up
        hi = min(stop, row_end)
        hi -= hi % steps[d]
        if hi > lo:
            cuts.append((lo, hi, d))
            lo = hi
        if stop < row_end:
            level = d + 1
            break
    else:
        hi = stop - stop % steps[0]
        if hi > lo:
            cuts.append((lo, hi, 0))
            lo = hi
    for d in range(level, nd):
        hi = stop - stop % steps[d]
        if hi > lo:
            cuts.append((lo, hi, d))
            lo = hi
    out = []
    for lo, hi, d in cuts:
        fixed = []
        for i in range(d):
            c = box[i][0] + lo // steps[i] % shape[i]
            fixed.append((c, c + 1))
        step, b0 = steps[d], box[d][0]
        span = (b0 + lo // step % shape[d], b0 + (hi - 1) // step % shape[d] + 1)
        out.append(((*fixed, span, *box[d + 1 :]), hi - lo))
    return out


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A device mesh by integer device ids: what a program runs over (pure data).

    Attributes:
      devices: device ids in row-major mesh order.
      shape: the mesh shape.
      axes: the axis names.
      kinds: the axes' types by name (``"Explicit"``, ``"Manual"``, ``"Auto"``; JAX's
        ``AxisType``), or ``()`` where every axis is Auto: two meshes of the same devices and
        names whose axes differ in type are different meshes (an array carries its mesh's
        axis types, and a program over one cannot take or make arrays of the other).
    """

    devices: tuple[int, ...]
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    kinds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if math.prod(self.shape) != len(self.devices) or len(self.shape) != len(self.axes):
            raise LayoutError(f"mesh shape {self.shape} / axes {self.axes} do not fit the devices")
        if self.kinds and len(self.kinds) != len(self.axes):
            raise LayoutError(f"axis types {self.kinds} do not fit the axes {self.axes}")
        if all(k == "Auto" for k in self.kinds):  # one spelling of an all-Auto mesh
            object.__setattr__(self, "kinds", ())

    @classmethod
    def line(cls, devices: Sequence[int], axis: str) -> MeshSpec:
        """A 1-D mesh over ``devices`` (in that order) with one axis."""
        return cls(tuple(devices), (len(devices),), (axis,))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which box of a global array each device holds.

    Attributes:
      shape: the global shape.
      devices: integer device ids, in the sharding's device order.
      boxes: ``boxes[i]`` is the box held by ``devices[i]``. Replicas hold equal boxes.
      mesh: the mesh of a ``NamedSharding`` layout (None for other shardings).
      spec: the normalised ``PartitionSpec`` over ``mesh`` (None without a mesh).

    Hashable and comparable, so plans built from layouts can be cached and checked across
    processes. Building one allocates nothing on any device.
    """

    shape: tuple[int, ...]
    devices: tuple[int, ...]
    boxes: tuple[Box, ...]
    mesh: MeshSpec | None = None
    spec: AxisSpec | None = None

    def __post_init__(self) -> None:
        if len(self.devices) != len(self.boxes):
            raise LayoutError("a layout needs one box per device")
        if len(set(self.devices)) != len(self.devices):
            raise LayoutError(f"a device appears twice in the layout: {self.devices}")

    @functools.cached_property
    def box_of(self) -> dict[int, Box]:
        """Device id -> the box it holds."""
        return dict(zip(self.devices, self.boxes, strict=True))

    @functools.cached_property
    def shard_shape(self) -> tuple[int, ...]:
        """The shape every device holds (JAX shards are even, so one shape for all)."""
        return box_shape(self.boxes[0]) if self.boxes else tuple(self.shape)

    @functools.cached_property
    def replicas(self) -> dict[Box, tuple[int, ...]]:
        """Each distinct box -> the sorted ids of the devices that hold it."""
        groups: dict[Box, list[int]] = {}
        for device, box in zip(self.devices, self.boxes, strict=True):
            groups.setdefault(box, []).append(device)
        return {box: tuple(sorted(ids)) for box, ids in sorted(groups.items())}

    def overlapping(self, box: Box) -> Iterator[tuple[Box, tuple[int, ...], Box]]:
        """``(held_box, replica_ids, common_part)`` for each distinct held box meeting ``box``.

        The distinct boxes of a mesh layout form a grid, so a per-dimension interval search
        finds the overlaps without scanning every device (this matters at 256+ devices).
        """
        for held in self._grid_candidates(box):
            common = intersect(held, box)
            if common is not None:
                yield held, self.replicas[held], common

    def _grid_candidates(self, box: Box) -> Iterator[Box]:
        per_dim = self._grid
        if per_dim is None:  # not a grid (hand-built layout): scan.
            yield from self.replicas
            return
        choices = []
        for (lo, hi), intervals in zip(box, per_dim, strict=True):
            choices.append([iv for iv in intervals if iv[0] < hi and lo < iv[1]])
        yield from (b for b in itertools.product(*choices) if b in self.replicas)

    @functools.cached_property
    def _grid(self) -> tuple[tuple[tuple[int, int], ...], ...] | None:
        if not self.boxes or box_size(self.boxes[0]) == 0:
            return None
        per_dim = tuple(
            tuple(sorted({box[d] for box in self.replicas})) for d in range(len(self.shape))
        )
        if math.prod(len(v) for v in per_dim) != len(self.replicas):
            return None
        return per_dim

    @classmethod
    def from_mesh(
        cls,
        shape: Sequence[int],
        mesh_shape: Sequence[int],
        axis_names: Sequence[str],
        device_ids: Sequence[int],
        spec: Sequence[Any],
        kinds: Sequence[str] = (),
    ) -> Layout:
        """The layout of a ``NamedSharding(Mesh(ids.reshape(mesh_shape), axis_names), P(*spec))``.

        Pure: works on virtual devices. ``device_ids`` lists the mesh's devices in row-major mesh
        order. ``spec`` entries are None, an axis name, or a tuple of axis names, as in
        ``PartitionSpec``; ``kinds`` the axes' types (`MeshSpec.kinds`). Raises `LayoutError`
        when the spec does not fit the shape or mesh.
        """
        shape, mesh_shape = tuple(int(n) for n in shape), tuple(int(n) for n in mesh_shape)
        if len(mesh_shape) != len(axis_names) or len(set(axis_names)) != len(axis_names):
            raise LayoutError(
                f"a mesh needs one distinct name per axis: shape {mesh_shape}, names "
                f"{tuple(axis_names)}"
            )
        if any(n < 0 for n in shape) or any(n < 1 for n in mesh_shape):
            raise LayoutError(f"negative or empty sizes: array {shape}, mesh {mesh_shape}")
        axes = normalize_spec(spec, len(shape), tuple(axis_names))
        size = dict(zip(axis_names, mesh_shape, strict=True))
        if math.prod(mesh_shape) != len(device_ids):
            raise LayoutError(f"mesh shape {mesh_shape} does not hold {len(device_ids)} devices")
        for dim, (n, dim_axes) in enumerate(zip(shape, axes, strict=True)):
            ways = math.prod(size[a] for a in dim_axes)
            if n % ways:
                raise LayoutError(
                    f"dimension {dim} of size {n} is split {ways} ways over mesh axes "
                    f"{dim_axes}, which does not divide it"
                )
        strides = {name: math.prod(mesh_shape[i + 1 :]) for i, name in enumerate(axis_names)}
        boxes = []
        for flat in range(len(device_ids)):
            coord = {a: (flat // strides[a]) % size[a] for a in axis_names}
            box = []
            for n, dim_axes in zip(shape, axes, strict=True):
                index, ways = 0, 1
                for a in dim_axes:  # the first axis is the major one, as in JAX
                    index, ways = index * size[a] + coord[a], ways * size[a]
                step = n // ways
                box.append((index * step, (index + 1) * step))
            boxes.append(tuple(box))
        ids = tuple(int(i) for i in device_ids)
        mesh = MeshSpec(ids, mesh_shape, tuple(axis_names), tuple(kinds))
        return cls(shape, ids, tuple(boxes), mesh, axes)

    @classmethod
    def from_sharding(cls, sharding: Any, shape: Sequence[int]) -> Layout:
        """The layout of any JAX sharding, via ``devices_indices_map`` (allocates nothing)."""
        shape = tuple(int(n) for n in shape)
        index_map = sharding.devices_indices_map(shape)
        items = sorted(index_map.items(), key=lambda kv: kv[0].id)
        if hasattr(sharding, "mesh"):  # keep the mesh's own device order for NamedSharding
            order = {d.id: i for i, d in enumerate(sharding.mesh.devices.flat)}
            items = sorted(index_map.items(), key=lambda kv: order[kv[0].id])
        boxes = tuple(
            tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True)) for _, index in items
        )
        return cls(shape, tuple(d.id for d, _ in items), boxes)


def normalize_spec(spec: Sequence[Any], ndim: int, axis_names: tuple[str, ...]) -> AxisSpec:
    """PartitionSpec entries -> a tuple of axis-name tuples, one per dimension (padded)."""
    entries = tuple(spec)
    if len(entries) > ndim:
        raise LayoutError(
            f"the spec {tuple(spec)} has {len(entries)} entries but the array has rank {ndim}"
        )
    out = []
    for entry in entries + (None,) * (ndim - len(entries)):
        if entry is not None and not isinstance(entry, (str, tuple, list)):
            raise LayoutError(
                f"the spec {tuple(spec)} has the entry {entry!r}: each entry is None, a mesh "
                "axis name or a tuple of them (an unconstrained entry does not say a layout)"
            )
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for name in names:
            if name not in axis_names:
                raise LayoutError(
                    f"the spec names axis {name!r}, not in the mesh axes {axis_names}"
                )
        out.append(names)
    used = [a for names in out for a in names]
    if len(used) != len(set(used)):
        raise LayoutError(f"the spec {tuple(spec)} uses a mesh axis twice")
    return tuple(out)
