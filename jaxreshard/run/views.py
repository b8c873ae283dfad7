"""Zero-copy views between one array and its per-device buffers.

The runtime hands buffers from one program to the next over another mesh: a pack's outputs
become the transfer's inputs, the transfer's outputs the unpack's. `jax.Array` has public ways
to do this (``addressable_shards``, `jax.make_array_from_single_device_arrays`), but they
check and re-sort every buffer on every call: about 30 us per array here, which adds up to
milliseconds per step on a tree of many leaves. The runtime knows the device order of every
view it makes, so `View` builds the array directly (JAX's own constructor, the way JAX builds
the outputs of its programs) and reads buffers back in device order. Where JAX's internals
differ from what this module expects (another JAX version), it falls back to the public
functions, checked once at import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

try:  # JAX's array constructor and avals (private API; see the module docstring)
    from jax._src import core as _core
    from jax._src.array import ArrayImpl as _ArrayImpl

    _FAST = hasattr(_ArrayImpl, "_arrays")
except ImportError:  # pragma: no cover - another JAX layout
    _FAST = False


class View:
    """Makes arrays of one shape, dtype and sharding from per-device buffers, zero-copy.

    ``view(buffers)`` takes this process's buffers in `devices` order (the sharding's own
    order of its addressable devices) and returns one `jax.Array`, weakly typed with
    ``weak_type`` (as ``jnp.asarray(1.5)`` is, and ``jax.device_put`` keeps).
    """

    def __init__(
        self, shape: Sequence[int], dtype: Any, sharding: Sharding, weak_type: bool = False
    ) -> None:
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.sharding = sharding
        self.weak_type = weak_type
        self.devices = [d.id for d in _addressable_order(sharding)]
        self._aval = None
        if _FAST:
            base = _core.ShapedArray(self.shape, self.dtype, weak_type=weak_type)
            self._aval = _core.update_aval_with_sharding(base, sharding)

    @property
    def aval(self) -> jax.ShapeDtypeStruct:
        """The arrays this view makes, as a `jax.ShapeDtypeStruct` (to compile for them)."""
        return jax.ShapeDtypeStruct(
            self.shape, self.dtype, sharding=self.sharding, weak_type=self.weak_type
        )

    def of(self, x: jax.Array) -> jax.Array:
        """``x``'s buffers (same boxes on the same devices) as an array of this view, zero-copy:
        ``x`` in this view's sharding object, where its own is an equivalent one."""
        return self(ordered(by_device(x), self.sharding))

    def __call__(self, buffers: Sequence[jax.Array]) -> jax.Array:
        if self._aval is not None:
            return _ArrayImpl(
                self._aval, self.sharding, list(buffers), committed=True, _skip_checks=True
            )
        # (A weak type is lost here: JAX has no public way to make a weakly typed array.)
        return jax.make_array_from_single_device_arrays(
            self.shape, self.sharding, list(buffers), dtype=self.dtype
        )


def buffers(x: jax.Array) -> list[jax.Array]:
    """This process's buffers of ``x``, in its sharding's order of addressable devices."""
    if _FAST and isinstance(x, _ArrayImpl) and x._arrays is not None:
        return list(x._arrays)
    by_device = {s.device.id: s.data for s in x.addressable_shards}
    return [by_device[d.id] for d in _addressable_order(x.sharding)]


def by_device(x: jax.Array) -> dict[int, jax.Array]:
    """This process's buffers of ``x`` by device id."""
    return dict(zip((d.id for d in _addressable_order(x.sharding)), buffers(x), strict=True))


def ordered(bufs: dict[int, jax.Array], sharding: Sharding) -> list[jax.Array]:
    """Buffers by device id, in ``sharding``'s order of this process's devices (what a
    `View` of that sharding takes)."""
    return [bufs[d.id] for d in _addressable_order(sharding)]


def by_device_order(shardings: Sequence[Sharding]) -> list[list[int]]:
    """The positions of ``shardings`` grouped by their order of devices (groups in order of
    their first member): the arrays and outputs of one jitted program must share one."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, s in enumerate(shardings):
        groups.setdefault(tuple(d.id for d in s._device_assignment), []).append(k)
    return list(groups.values())


def _addressable_order(sharding: Sharding) -> list[Any]:
    order = getattr(sharding, "_addressable_device_assignment", None)
    if order is None:  # pragma: no cover - another JAX layout
        here = jax.process_index()
        order = [d for d in sharding._device_assignment if d.process_index == here]
    return list(order)
