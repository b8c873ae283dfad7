"""Helpers for executor tests: meshes over chosen devices, random data, exact checks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def mesh(ids: Sequence[int], shape: Sequence[int], names: Sequence[str]) -> Mesh:
    """A mesh over ``jax.devices()[i] for i in ids``, in that order."""
    devs = jax.devices()
    return Mesh(np.array([devs[i] for i in ids]).reshape(tuple(shape)), tuple(names))


def sharding(ids, shape, names, *spec) -> NamedSharding:
    return NamedSharding(mesh(ids, shape, names), P(*spec))


def random_array(shape: Sequence[int], dtype, seed: int = 0) -> np.ndarray:
    """Random values with every bit pattern the dtype allows (NaN payloads included)."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(dtype)
    n = math.prod(shape)
    if dtype == jnp.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if jax.dtypes.itemsize_bits(dtype) < 8:
        info = jnp.iinfo(dtype) if jnp.issubdtype(dtype, jnp.integer) else None
        if info is not None:
            return rng.integers(int(info.min), int(info.max) + 1, size=shape).astype(dtype)
        return rng.choice(
            np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -1, -6], np.float32), size=shape
        ).astype(dtype)
    raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def assert_exact(out: jax.Array, expected: np.ndarray, dst: NamedSharding) -> None:
    """``out`` has sharding ``dst`` and each of its shards equals NumPy slicing, bit for bit."""
    assert out.sharding == dst, (out.sharding, dst)
    assert out.shape == expected.shape and jnp.dtype(out.dtype) == jnp.dtype(expected.dtype)
    for shard in out.addressable_shards:
        got = np.asarray(shard.data)
        want = np.array(expected[shard.index])  # a copy, 0-d stays 0-d
        assert got.shape == want.shape, (shard.device, got.shape, want.shape)
        assert got.tobytes() == want.tobytes(), f"shard on {shard.device} differs"
