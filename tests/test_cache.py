"""The plan cache of `jr.reshard` and `jr.cached_plan`: what its key tells apart.

A cached plan is reused only for arguments it was made for: a hit on a plan made for another
memory kind, bucket size or shape hands back a plan that moves other data than asked, or
stages more than asked. Expected values come from NumPy copies of the sources; bounds from the
arguments themselves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import assert_exact, random_array, sharding

import jaxreshard as jr

SRC = (tuple(range(4)), (4,), ("f",))  # trainer: devices 0-3
DST = (tuple(range(4, 8)), (4,), ("t",))  # sampler: devices 4-7


def test_a_source_in_host_memory_gets_a_plan_of_its_own_beside_one_in_device_memory():
    """The same values on the same mesh and spec, once in device memory and once in
    ``pinned_host`` memory, each move exactly and each get their own cached plan (a plan reads
    its sources where they are). Mutation check: with the memory kind left out of the cache
    key, the host-memory source was handed the device-memory plan, whose call refused it as a
    source it was not made for."""
    host = random_array((64, 32), "float32")
    src = sharding(tuple(range(4)), (2, 2), ("a", "b"), "a", "b")
    dst = sharding(*DST, None, "t")
    jr.clear_cache()
    in_device = jax.device_put(host, src)
    in_host = jax.device_put(host, src.with_memory_kind("pinned_host"))
    assert in_host.sharding.memory_kind == "pinned_host"
    assert_exact(jr.reshard(in_device, dst), host, dst)
    assert_exact(jr.reshard(in_host, dst), host, dst)
    assert jr.cached_plan(in_host, dst) is not jr.cached_plan(in_device, dst)


def test_a_plan_asked_for_with_smaller_buckets_is_not_the_default_buckets_plan():
    """``bucket_bytes`` bounds a call's staging (`PlanStats.staging_bytes`: a send and a
    receive buffer of the largest bucket, so at most 2 x 4096 bytes here), so it is part of
    the cache key: after a reshard with the default buckets (16 MiB on CPU), asking for
    4096-byte buckets gives another plan, which keeps that bound. Each destination device
    receives a 256 x 16 float32 block (16 KiB) from the others, so the small plan needs at
    least 16384 / 4096 = 4 buckets. Mutation check: with ``bucket_bytes`` left out of the key,
    the default plan came back (32 KiB of staging per device)."""
    host = random_array((256, 64), "float32")
    src = jax.device_put(host, sharding(*SRC, "f"))
    dst = sharding(*DST, None, "t")
    jr.clear_cache()
    assert_exact(jr.reshard(src, dst), host, dst)
    default = jr.cached_plan(src, dst)
    small = jr.cached_plan(src, dst, bucket_bytes=4096)
    assert small is not default
    assert small.stats.staging_bytes <= 2 * 4096, small.stats
    assert small.stats.buckets >= 4, small.stats
    assert_exact(small(src), host, dst)
    assert_exact(jr.reshard(src, dst, bucket_bytes=4096), host, dst)


def test_sources_of_two_shapes_on_one_sharding_each_get_their_plan():
    """Two sources of one dtype and sharding, 64 x 16 and then 128 x 16, each move exactly:
    the shape is part of the cache key. Mutation check: with the shape left out of it, the
    second reshard was handed the 64-row plan, whose call refused the 128-row source."""
    src = sharding(*SRC, "f")
    dst = sharding(*DST, None, "t")
    jr.clear_cache()
    for rows in (64, 128):
        host = np.arange(rows * 16, dtype=np.float32).reshape(rows, 16)
        assert_exact(jr.reshard(jax.device_put(host, src), dst), host, dst)


def test_a_plan_cached_with_the_device_put_fallback_is_not_given_to_a_call_without_it():
    """A typed key to a GSPMDSharding is sent by ``jax.device_put`` only on request: asked
    for without ``fallback=``, after a call with it, it is still refused."""
    from jax._src.sharding_impls import GSPMDSharding

    jr.clear_cache()
    src = jax.device_put(jax.random.split(jax.random.key(0), 8), sharding(*SRC))
    named = sharding(tuple(range(8)), (8,), ("x",), "x")
    other = GSPMDSharding(tuple(named._device_assignment), named._to_xla_hlo_sharding(1))
    jr.reshard(src, other, fallback="device_put")
    with pytest.raises(jr.ReshardError, match="typed PRNG key with a GSPMDSharding"):
        jr.reshard(src, other)
    jr.clear_cache()


def test_a_plan_cached_without_compiler_options_is_not_given_to_a_call_with_them():
    jr.clear_cache()
    src = jax.device_put(random_array((16, 8), "float32"), sharding(*SRC, "f"))
    dst = sharding(*DST, "t")
    options = {"xla_cpu_enable_fast_math": False}
    plain = jr.cached_plan(src, dst)
    tuned = jr.cached_plan(src, dst, compiler_options=options)
    assert tuned is not plain and tuned.compiler_options == options
    assert plain.compiler_options == {}
    assert jr.cached_plan(src, dst, compiler_options=dict(options)) is tuned
    jr.clear_cache()


def test_the_reshard_cache_keeps_its_256_most_recently_used_plans():
    """256 plans are kept (README: "the 256 most recently used"); a 257th pushes out the
    least recently used one only."""
    jr.clear_cache()
    src_s, dst = sharding(*SRC, "f"), sharding(*DST, "t")
    structs = [
        jax.ShapeDtypeStruct((8 * (i + 1), 4), jnp.float32, sharding=src_s) for i in range(257)
    ]
    plans = [jr.cached_plan(s, dst) for s in structs[:256]]
    assert jr.cached_plan(structs[0], dst) is plans[0]  # all 256 kept; the first used again
    jr.cached_plan(structs[256], dst)  # pushes out the least recently used: the second
    assert jr.cached_plan(structs[2], dst) is plans[2]
    assert jr.cached_plan(structs[0], dst) is plans[0]
    assert jr.cached_plan(structs[1], dst) is not plans[1]
    jr.clear_cache()
