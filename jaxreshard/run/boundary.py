"""The caller's leaves as the runtime moves them, and back.

The runtime moves arrays of plain dtypes, in device memory, into ``NamedSharding`` layouts. A
real training state holds more than that, so each leaf gets a `Boundary` that says how it
crosses into the runtime and out again:

- **typed PRNG keys** (``jax.random.key``, every ``nnx.Rngs`` stream) move as their key data
  (``uint32`` with the key's trailing dimensions) and are wrapped again on arrival. Both steps
  are zero-copy (JAX's own ``key_data`` / ``wrap_key_data``).
- **memory kinds**: a source in another memory than the device's default (``pinned_host``,
  ``unpinned_host``) is first copied into device memory; a destination in another memory is
  filled in device memory and then copied there. Each copy is one compiled program per local
  device (no host transfer, so it runs under ``jax.transfer_guard("disallow")``). On an
  accelerator these are the host <-> device copies the move needs anyway; the device-memory
  copy lives for one call, at most the size of those leaves' shards.
- **other destination shardings** (``SingleDeviceSharding`` and the like) are planned as the
  equivalent ``NamedSharding``; the result carries the sharding the caller asked for
  (re-wrapped, zero-copy).

Everything here is process-local (per-device programs, no collective), so processes of a
multi-controller job need not agree on which leaves take which path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jaxreshard.planning.layout import Layout, LayoutError
from jaxreshard.run import views

SINGLE_AXIS = "jaxreshard_single"
"""Axis name of the one-device mesh a ``SingleDeviceSharding`` destination is planned on."""


def is_key(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key dtype (``key<fry>`` and the like)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def key_data_shape(x: Any) -> tuple[tuple[int, ...], Any]:
    """The shape and dtype of a key leaf's data (array or ``ShapeDtypeStruct``)."""
    out = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return tuple(out.shape), np.dtype(out.dtype)


def default_memory_kind(sharding: Sharding) -> str | None:
    """The default memory kind of the sharding's devices (``"device"`` on CPU and GPU), read
    from a device of this process of the same platform (remote devices do not say)."""
    platform = next(iter(sharding.device_set)).platform
    try:
        local = jax.local_devices(backend=platform)
    except RuntimeError:  # pragma: no cover - a platform with no local device
        return None
    return local[0].default_memory().kind if local else None


def in_device_memory(sharding: Sharding) -> bool:
    """Whether the sharding places its data in the devices' default memory."""
    kind = sharding.memory_kind
    return kind is None or kind == default_memory_kind(sharding)


def on_device_memory(sharding: Sharding) -> Sharding:
    """The same sharding in the devices' default memory."""
    if in_device_memory(sharding):
        return sharding
    return sharding.with_memory_kind(default_memory_kind(sharding))


def _manual(sharding: NamedSharding) -> bool:
    """Whether ``sharding``'s mesh has an axis of type Manual."""
    manual = getattr(jax.sharding.AxisType, "Manual", None)
    return manual is not None and manual in getattr(sharding.mesh, "axis_types", ())


def as_auto(sharding: NamedSharding) -> NamedSharding:
    """``sharding`` over the same devices and axes typed Auto (itself where they are): a
    program that reshapes its operands (the fp8 quantizer, `QuantizedArray.dequantize`)
    cannot run over Explicit axes, whose arrays carry their sharding in their types and
    refuse a reshape without an explicit output sharding. Arrays move onto it zero-copy
    (`views.View`)."""
    kinds = getattr(sharding.mesh, "axis_types", ())
    auto = getattr(jax.sharding.AxisType, "Auto", None)
    if all(k == auto for k in kinds):
        return sharding
    mesh = Mesh(sharding.mesh.devices, sharding.mesh.axis_names)
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def logical_ids(sharding: NamedSharding) -> Any:
    """JAX's private device permutation of a NamedSharding (None for almost every one): such
    a sharding places data other than its mesh and spec say (`api._layout` reads it from
    ``devices_indices_map``)."""
    return getattr(sharding, "_logical_device_ids", None)


def as_named(sharding: Sharding, shape: Sequence[int]) -> NamedSharding:
    """The ``NamedSharding`` equivalent to ``sharding`` for arrays of ``shape``.

    A ``NamedSharding`` over Manual mesh axes becomes the same over Auto ones. A
    ``SingleDeviceSharding`` becomes a one-device mesh. Any other sharding with a device set
    becomes a mesh with one axis per split dimension and one for replicas, built from its
    ``devices_indices_map``; raises `LayoutError` when no mesh describes it (devices that do
    not form a grid of boxes).
    """
    if isinstance(sharding, NamedSharding):
        # Programs cannot lay out results over Manual axes (jit refuses them outside a
        # shard_map): the same devices and axes, typed Auto; the result is re-wrapped.
        return as_auto(sharding) if _manual(sharding) else sharding
    kind = sharding.memory_kind
    if isinstance(sharding, SingleDeviceSharding):
        (device,) = sharding.device_set
        mesh = Mesh(np.array([device]), (SINGLE_AXIS,))
        return NamedSharding(mesh, PartitionSpec(), memory_kind=kind)
    shape = tuple(int(n) for n in shape)
    layout = Layout.from_sharding(sharding, shape)
    # The distinct start of each dimension's boxes indexes that dimension of the mesh.
    starts = [sorted({box[d][0] for box in layout.boxes}) for d in range(len(shape))]
    split = [d for d in range(len(shape)) if len(starts[d]) > 1]
    copies = len(layout.devices) // max(1, math.prod(len(starts[d]) for d in split))
    by_cell: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for device, box in zip(layout.devices, layout.boxes, strict=True):
        by_cell[tuple(starts[d].index(box[d][0]) for d in split)].append(device)
    grid = tuple(len(starts[d]) for d in split)
    if len(by_cell) != math.prod(grid) or any(len(v) != copies for v in by_cell.values()):
        raise LayoutError(f"{sharding} is not a grid of equal boxes; pass a NamedSharding")
    device_of = {d.id: d for d in sharding.device_set}
    cells = np.empty((*grid, copies), dtype=object)
    for cell, ids in by_cell.items():
        for r, i in enumerate(ids):
            cells[(*cell, r)] = device_of[i]
    axes = (*(f"jaxreshard_dim{d}" for d in split), "jaxreshard_replica")
    spec = [None] * len(shape)
    for d, axis in zip(split, axes, strict=False):
        spec[d] = axis
    named = NamedSharding(Mesh(cells, axes), PartitionSpec(*spec), memory_kind=kind)
    # Equivalent as data placement (each device holds the same box); the device order may
    # differ, which the result does not show: it is re-wrapped into ``sharding`` itself.
    if named.devices_indices_map(shape) != sharding.devices_indices_map(shape):
        raise LayoutError(f"no NamedSharding found equivalent to {sharding}; pass a NamedSharding")
    return named


def key_data_sharding(sharding: Sharding) -> Sharding:
    """The sharding of a typed key array's data (trailing key dimensions unsplit): the key's
    own sharding, since a ``PartitionSpec`` leaves dimensions past its entries unsplit."""
    if isinstance(sharding, (NamedSharding, SingleDeviceSharding)):
        return sharding
    raise LayoutError(
        f"a typed PRNG key with a {type(sharding).__name__} is not supported; give it a "
        "NamedSharding"
    )


@dataclasses.dataclass(frozen=True)
class Boundary:
    """How one leaf crosses into the runtime and back.

    Attributes:
      key_impl: the PRNG implementation of a typed key leaf (moved as its key data), else None.
      src: the source sharding the runtime reads (device memory, key-data rank).
      dst: the destination ``NamedSharding`` the runtime writes (device memory).
      user_dst: the destination sharding the caller asked for (what the result carries).
      shape: the caller's shape of the leaf.
      weak_type: the result is weakly typed, as the source is (``jnp.asarray(1.5)``) when
        not cast: ``jax.device_put`` keeps a weak type, and JAX's type promotion reads it.
        What the plan was made from; a call whose source differs gets its own (`results`).
      casts: the leaf takes a ``dtype=`` entry, its own dtype included (its result is never
        weakly typed, as ``astype`` makes it).
    """

    key_impl: Any
    src: Sharding
    dst: NamedSharding
    user_src: Sharding
    user_dst: Sharding
    shape: tuple[int, ...]
    weak_type: bool = False
    casts: bool = False

    @functools.cached_property
    def stages_in(self) -> bool:
        """The source is not in device memory: copied there first."""
        return not in_device_memory(self.user_src)

    @functools.cached_property
    def stages_out(self) -> bool:
        """The destination is not in device memory: filled there, then copied."""
        return not in_device_memory(self.user_dst)

    @functools.cached_property
    def rewraps(self) -> bool:
        """The result is re-wrapped: into the caller's sharding (not named, over Manual axes,
        or in other memory), or weakly typed."""
        named = isinstance(self.user_dst, NamedSharding) and not _manual(self.user_dst)
        return self.stages_out or self.weak_type or not named


class Crossing:
    """The per-call side of a plan's boundaries: into the runtime, and out of it."""

    def __init__(self, boundaries: Sequence[Boundary]) -> None:
        self.boundaries = tuple(boundaries)
        self.plain = all(
            b.key_impl is None and not b.stages_in and not b.rewraps for b in boundaries
        )
        self._copies = _MemoryCopies()
        self._views: dict[Any, views.View] = {}
        self._staged_in = [i for i, b in enumerate(self.boundaries) if b.stages_in]
        self._staged_out = [i for i, b in enumerate(self.boundaries) if b.stages_out]

    def sources(self, src: Sequence[Any]) -> list[Any]:
        """What the runtime reads: key data, sources copied into device memory, and every
        array in exactly the planned sharding object. (An equivalent sharding spelled
        otherwise, ``P("a", None)`` for ``P("a")``, would make ``jax.jit`` compile the
        programs again: such arrays are re-wrapped, zero-copy.)"""
        out = list(src) if self.plain else [_unwrap(x) for x in src]
        for i, (x, b) in enumerate(zip(out, self.boundaries, strict=True)):
            if not isinstance(x, jax.Array) or b.stages_in:
                continue
            # Strongly typed, whatever the call's source: programs compiled for one weak type
            # would compile again for the other (`results` gives each call its own back).
            if (x.sharding is not b.src and x.sharding != b.src) or x.weak_type:
                out[i] = self._view(x, b.src)
        if not self.plain:
            self._copy(out, self._staged_in, [self.boundaries[i].src for i in self._staged_in])
        return out

    def donations(self, old: Sequence[jax.Array]) -> list[jax.Array | None]:
        """The runtime's view of ``donate=`` leaves; None where a destination lives in another
        memory (its buffers cannot receive device-memory writes: `free_unused` frees it once
        the move is done, not here, as the runtime may still refuse the call)."""
        if self.plain:  # (weakly typed ones viewed strongly, as in `sources`)
            return [
                self._view(x, b.dst) if x.weak_type else x
                for x, b in zip(old, self.boundaries, strict=True)
            ]
        out: list[jax.Array | None] = []
        for x, b in zip(old, self.boundaries, strict=True):
            if b.stages_out:
                out.append(None)
                continue
            x = _unwrap(x)
            if x.sharding != b.dst or x.weak_type:  # (strongly typed, as in `sources`)
                x = self._view(x, b.dst)
            out.append(x)
        return out

    def free_unused(self, old: Sequence[jax.Array]) -> None:
        """Delete the ``donate=`` leaves `donations` left out (destinations in another
        memory), after a move that took the rest: a donation is consumed whole or not at all."""
        if self.plain:
            return
        for x, b in zip(old, self.boundaries, strict=True):
            if b.stages_out and not x.is_deleted():
                x.delete()

    def inner(self, out: Sequence[jax.Array]) -> list[jax.Array]:
        """The runtime's view of results (`results` undone): key data, in device memory."""
        if self.plain:
            return list(out)
        inner = [_unwrap(x) for x in out]
        self._copy(inner, self._staged_out, [self.boundaries[i].dst for i in self._staged_out])
        return inner

    def results(
        self, out: Sequence[jax.Array], weak: Sequence[bool] | None = None
    ) -> list[jax.Array]:
        """The caller's arrays: copied into their memory, in their sharding, keys wrapped.

        ``weak``: whether each of the call's sources is weakly typed; an uncast result then
        is too, whatever the plan was made from (a plan is made once, from one tree, and
        called with others of the same shapes and dtypes). Default: as planned."""
        flips = set()
        if weak is not None:
            flips = {
                i
                for i, (b, w) in enumerate(zip(self.boundaries, weak, strict=True))
                if (w and not b.casts) != b.weak_type
            }
        if self.plain and not flips:
            return list(out)
        out = list(out)
        staged = self._staged_out
        self._copy(out, staged, [self.boundaries[i].user_dst for i in staged])
        for i, b in enumerate(self.boundaries):
            x = out[i]
            weak_type = b.weak_type != (i in flips)
            if (b.rewraps or i in flips) and (weak_type or not b.stages_out):
                x = self._view(x, b.user_dst, weak_type)
            if b.key_impl is not None:
                x = jax.random.wrap_key_data(x, impl=b.key_impl)
            out[i] = x
        return out

    def _copy(
        self, arrays: list[Any], staged: Sequence[int], shardings: Sequence[Sharding]
    ) -> None:
        """Replace ``arrays[i]`` for each ``i`` of ``staged`` by its copy in the memory kind of
        the matching sharding (one program per local device)."""
        moved = self._copies.copy([arrays[i] for i in staged], shardings)
        for i, x in zip(staged, moved, strict=True):
            arrays[i] = x

    def _view(self, x: jax.Array, sharding: Sharding, weak_type: bool = False) -> jax.Array:
        """``x``'s buffers as an array of ``sharding`` (same boxes on the same devices)."""
        key = (x.shape, x.dtype, sharding, weak_type)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = views.View(x.shape, x.dtype, sharding, weak_type)
        return view.of(x)


def _unwrap(x: Any) -> Any:
    if isinstance(x, jax.Array) and is_key(x.dtype):
        return jax.random.key_data(x)
    if isinstance(x, jax.ShapeDtypeStruct) and is_key(x.dtype):
        shape, dtype = key_data_shape(x)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=key_data_sharding(x.sharding))
    return x


class _MemoryCopies:
    """Copies arrays into another memory kind of the same devices and layout: one compiled
    identity program per local device, cached by what it copies."""

    def __init__(self) -> None:
        self._fns: dict[Any, Any] = {}

    def copy(self, arrays: Sequence[Any], shardings: Sequence[Sharding]) -> list[Any]:
        if not arrays:
            return []
        per_device: dict[Any, list[tuple[int, jax.Array]]] = defaultdict(list)
        live = [i for i, x in enumerate(arrays) if isinstance(x, jax.Array)]
        devices_of: dict[int, list[int]] = {}
        for i in live:
            bufs = views.by_device(arrays[i])
            devices_of[i] = list(bufs)
            for d, buf in bufs.items():
                per_device[d].append((i, buf))
        moved: dict[tuple[int, int], jax.Array] = {}
        for d, items in per_device.items():
            kinds = tuple(shardings[i].memory_kind for i, _ in items)
            device = next(iter(items[0][1].devices()))
            key = (d, kinds, tuple((b.shape, b.dtype) for _, b in items))
            fn = self._fns.get(key)
            if fn is None:
                outs = tuple(SingleDeviceSharding(device, memory_kind=k) for k in kinds)
                fn = self._fns[key] = jax.jit(lambda *xs: xs, out_shardings=outs)
            for (i, _), y in zip(items, fn(*(b for _, b in items)), strict=True):
                moved[i, d] = y
        out = list(arrays)
        for i in live:
            x, s = arrays[i], shardings[i]
            mine = {d: moved[i, d] for d in devices_of[i]}
            out[i] = views.View(x.shape, x.dtype, s)(views.ordered(mine, s))
        return out
