"""Random layouts on the 8 CPU devices, checked against NumPy and the lower bound."""

from __future__ import annotations

import math

import jax
import numpy as np
from arrays import assert_exact, random_array
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr

DTYPES = ["float32", "bfloat16", "int8", "uint16", "bool", "float8_e4m3fn", "int32"]


@st.composite
def named_sharding(draw, prefix: str, rank: int):
    """A NamedSharding over a random subset of the devices, in random order, 1-4 axes."""
    n = draw(st.sampled_from([1, 2, 4, 8]))
    ids = draw(st.permutations(range(8)))[:n]
    sizes: list[int] = []
    left = n
    while left > 1 and len(sizes) < 4:
        size = draw(st.sampled_from([d for d in (2, 4, 8) if left % d == 0]))
        sizes.append(size)
        left //= size
    if left > 1:
        sizes.append(left)
    if not sizes or draw(st.booleans()):
        sizes.insert(draw(st.integers(0, len(sizes))), 1)  # a size-1 axis now and then
    sizes = sizes[:4]
    while math.prod(sizes) != n:
        sizes[-1] *= n // math.prod(sizes)
    names = [f"{prefix}{i}" for i in range(len(sizes))]
    free = draw(st.permutations(names))
    spec = []
    for _ in range(rank):
        k = draw(st.integers(0, min(2, len(free))))
        spec.append(tuple(free[:k]) if k > 1 else (free[0] if k == 1 else None))
        free = free[k:]
    devs = jax.devices()
    mesh = Mesh(np.array([devs[i] for i in ids]).reshape(sizes), tuple(names))
    return NamedSharding(mesh, P(*spec))


def _ways(s: NamedSharding, dim: int) -> int:
    entry = s.spec[dim] if dim < len(s.spec) else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return math.prod(s.mesh.shape[a] for a in axes)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    data=st.data(),
    rank=st.integers(0, 3),
    dtype=st.sampled_from(DTYPES),
    cast=st.sampled_from([None, "float32", "bfloat16"]),
    bucket=st.sampled_from([64, 1000, None]),
)
def test_random_layouts_are_exact_and_minimal(data, rank, dtype, cast, bucket):
    src = data.draw(named_sharding("s", rank))
    dst = data.draw(named_sharding("d", rank))
    mult = data.draw(st.lists(st.integers(0, 2), min_size=rank, max_size=rank))
    shape = tuple(m * math.lcm(_ways(src, d), _ways(dst, d)) for d, m in enumerate(mult))
    if cast is not None and dtype in ("bool", "float8_e4m3fn"):
        cast = None
    host = random_array(shape, dtype, seed=rank)
    if cast is not None and dtype.startswith(("float", "bfloat")):
        host = np.random.default_rng(0).standard_normal(shape).astype(host.dtype)
    x = jax.device_put(host, src)
    plan = jr.plan(x, dst, dtype=cast, bucket_bytes=bucket)
    out = plan(x)
    expected = host if cast is None else host.astype(cast)
    assert_exact(out, expected, dst)
    assert_exact(x, host, src)
    stats = plan.stats
    assert stats.bytes_sent == stats.bytes_lower_bound
    assert stats.staging_bytes <= 2 * plan.bucket_bytes
