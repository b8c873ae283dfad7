"""Every leaf a real training state holds: typed PRNG keys, memory kinds, any destination
sharding, non-floating leaves under a cast, non-JAX leaves (refused or sent by device_put).

Expected values come from NumPy copies of the sources taken before any reshard.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import assert_exact, random_array, sharding
from compiles import COMPILES
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import jaxreshard as jr

SRC = (tuple(range(4)), (2, 2), ("dp", "tp"))  # trainer: devices 0-3
DST = (tuple(range(4, 8)), (4,), ("tp",))  # sampler: devices 4-7


def keys(n: int, impl: str = "threefry2x32", seed: int = 0) -> jax.Array:
    return jax.random.split(jax.random.key(seed, impl=impl), n)


def key_bits(x: jax.Array) -> np.ndarray:
    return np.asarray(jax.random.key_data(x))


def test_typed_prng_keys_move_as_their_data_and_arrive_as_keys():
    src = {
        "fry": jax.device_put(keys(8), sharding(*SRC, "dp")),
        "rbg": jax.device_put(keys(4, "rbg", 1), sharding(*SRC, "tp")),
        "one": jax.device_put(jax.random.key(7), sharding(*SRC)),
    }
    want = {k: key_bits(v) for k, v in src.items()}
    dst = {"fry": sharding(*DST, "tp"), "rbg": sharding(*DST), "one": sharding(*DST)}
    plan = jr.plan(src, dst)
    assert "['rbg']: typed PRNG key, moved as its key data" in plan.describe()
    out = plan(src)
    out = plan(src, donate=out)  # donation of key leaves reuses their data buffers
    for k, v in out.items():
        assert v.dtype == src[k].dtype and v.shape == src[k].shape, k
        assert jax.random.key_impl(v) == jax.random.key_impl(src[k])
        assert v.sharding.is_equivalent_to(dst[k], v.ndim)
        assert key_bits(v).tobytes() == want[k].tobytes(), k
    # they are usable keys on the sampler: the same draws as the trainer's keys
    np.testing.assert_array_equal(
        np.asarray(jax.random.uniform(out["one"])), np.asarray(jax.random.uniform(src["one"]))
    )
    # uint32 key data, each destination device receiving what it holds: "fry" split 4 ways,
    # "rbg" (4 x 4 words) and "one" (2 words) on all four sampler devices
    assert plan.stats.bytes_sent == 4 * (8 * 2 + 4 * (4 * 4) + 4 * 2)


def test_a_typed_key_is_not_cast():
    src = {"w": jax.device_put(random_array((8, 8), "float32"), sharding(*SRC, "dp"))}
    src["rng"] = jax.device_put(keys(4), sharding(*SRC, "dp"))
    out = jr.plan(src, sharding(*DST), dtype=jnp.bfloat16)(src)  # one dtype: floats only
    assert out["w"].dtype == jnp.bfloat16 and out["rng"].dtype == src["rng"].dtype
    with pytest.raises(jr.ReshardError, match=r"\['rng'\].*typed PRNG key.*cannot be cast"):
        jr.plan(src, sharding(*DST), dtype={"w": None, "rng": jnp.uint32})


@pytest.mark.parametrize("spec", [(None, "tp"), (None, None), ("tp", None)])
def test_a_key_destination_is_checked_against_the_key_arrays_own_rank(spec):
    """Regression: a key array's destination was checked against its key data's shape (one
    dimension more), so a spec one entry too long was accepted or refused for a shape the
    user never had."""
    src = {"k": jax.device_put(keys(8), sharding(*SRC, "dp"))}
    with pytest.raises(jr.ReshardError, match=r"\['k'\].*does not fit shape \(8,\).*rank 1"):
        jr.plan(src, sharding(*DST, *spec))


def test_a_whole_nnx_state_with_rng_streams_moves():
    nnx = pytest.importorskip("flax.nnx")

    class Tiny(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.dense = nnx.Linear(8, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.count = nnx.BatchStat(jnp.array(1001, jnp.int32))

    model = Tiny(nnx.Rngs(params=0, dropout=1))
    trainer = sharding(*SRC)
    state = jax.device_put(nnx.state(model), trainer)
    want = [
        key_bits(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.asarray(x)
        for x in jax.tree.leaves(state)
    ]
    assert any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in jax.tree.leaves(state))
    out = jr.reshard(state, sharding(*DST), dtype=jnp.bfloat16)
    for x, y, w in zip(jax.tree.leaves(state), jax.tree.leaves(out), want, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert y.dtype == x.dtype and key_bits(y).tobytes() == w.tobytes()
        elif jnp.issubdtype(x.dtype, jnp.floating):
            assert y.dtype == jnp.bfloat16
            assert np.asarray(y).tobytes() == w.astype(jnp.bfloat16).tobytes()
        else:  # counters, RNG counts: kept exactly
            assert y.dtype == x.dtype and np.asarray(y).tobytes() == w.tobytes()
    sampler = nnx.merge(nnx.graphdef(model), out)
    assert int(sampler.count[...]) == 1001
    dropped = sampler.drop(jnp.ones((4, 16)))  # draws from the moved stream
    assert dropped.shape == (4, 16)


def test_one_dtype_casts_floating_leaves_and_a_dtype_tree_casts_what_it_names():
    host = {
        "w": random_array((8, 8), "float32"),
        "step": np.array([1001, 7, -3, 2**24 + 1], np.int32),
        "mask": random_array((4, 4), "bool"),
    }
    src = {k: jax.device_put(v, sharding(*SRC)) for k, v in host.items()}
    dst = sharding(*DST)
    out = jr.plan(src, dst, dtype=jnp.bfloat16)(src)
    assert out["w"].dtype == jnp.bfloat16
    assert_exact(out["step"], host["step"], dst)  # 1001 stays 1001 (bf16 would make it 1000)
    assert_exact(out["mask"], host["mask"], dst)
    named = jr.plan(src, dst, dtype={"w": None, "step": jnp.int16, "mask": None})(src)
    assert_exact(named["step"], host["step"].astype(np.int16), dst)
    assert_exact(named["w"], host["w"], dst)
    # a dtype standing for a subtree casts only the floating leaves below it
    nested = {"params": {"w": src["w"], "step": src["step"]}}
    out = jr.plan(nested, dst, dtype={"params": jnp.bfloat16})(nested)
    assert out["params"]["w"].dtype == jnp.bfloat16 and out["params"]["step"].dtype == jnp.int32


def test_a_dtype_for_a_subtree_leaves_its_complex_leaves_complex():
    """A ``dtype=`` entry standing for a subtree casts only its floating leaves: under
    ``{"params": bfloat16}`` a float32 leaf arrives as NumPy's ``astype`` to bfloat16 gives
    it, and a complex64 leaf keeps its dtype and every bit (NaN payloads included), as
    ``jax.device_put`` moves it. Mutation check: complex leaves were taken as floating and
    cast to bfloat16 (their imaginary parts dropped)."""
    w = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    c = random_array((8, 8), "complex64", seed=1)  # every bit pattern
    params = {"w": jax.device_put(w, sharding(*SRC, "dp")), "c": jax.device_put(c, sharding(*SRC))}
    src = {"params": params}
    dst = sharding(*DST, None, "tp")
    out = jr.plan(src, dst, dtype={"params": jnp.bfloat16})(src)
    assert_exact(out["params"]["w"], w.astype(jnp.bfloat16), dst)
    assert out["params"]["c"].dtype == np.complex64
    assert_exact(out["params"]["c"], c, dst)
    by_jax = np.asarray(jax.device_put(src["params"]["c"], dst))
    assert np.asarray(out["params"]["c"]).tobytes() == by_jax.tobytes()


def test_a_single_array_with_one_dtype_is_cast_whatever_its_dtype():
    x = jax.device_put(np.arange(16, dtype=np.int32).reshape(4, 4), sharding(*SRC, "dp"))
    out = jr.plan(x, sharding(*DST), dtype=jnp.int8)(x)
    assert out.dtype == jnp.int8


def test_a_samplers_own_nnx_state_of_other_annotations_is_taken_as_donate():
    """Regression (a probe of real model trees): the sampler's own ``nnx.State``, whose
    Params carry the sampler's logical axis names, was refused as ``donate=`` (its tree
    differs from the trainer's only in that metadata), though the same tree is taken as
    ``dst_shardings``. A donate= tree is matched leaf by leaf, by path."""
    nnx = pytest.importorskip("flax.nnx")

    def model(axes, seed):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)
        with nnx.use_eager_sharding(False):  # (annotations only: placed below)
            return nnx.Linear(8, 16, use_bias=False, kernel_init=init, rngs=nnx.Rngs(seed))

    src, dst = sharding(*SRC, "dp", "tp"), sharding(*DST, None, "tp")
    params = jax.device_put(nnx.state(model(("embed", "mlp"), 0), nnx.Param), src)
    sampler = jax.device_put(nnx.state(model(("embed_s", "mlp_s"), 1), nnx.Param), dst)
    assert jax.tree.structure(params) != jax.tree.structure(sampler)
    shardings = jax.tree.map(lambda _: dst, sampler)
    plan = jr.plan(params, shardings)
    kernel = sampler["kernel"].value
    out = plan(params, donate=sampler)
    assert kernel.is_deleted()
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(params), strict=True):
        assert_exact(got, np.asarray(want), dst)
    with pytest.raises(jr.ReshardError, match=r"donate= tree"):
        plan(params, donate={"other": out["kernel"]})  # other paths: refused by name
    assert not out["kernel"].value.is_deleted()


def test_weakly_typed_leaves_arrive_weakly_typed_as_device_put_keeps_them():
    """A weakly typed source (``jnp.asarray(1.5)``, a scalar from a Python number) arrives
    weakly typed, as ``jax.device_put`` gives it, so JAX's type promotion is unchanged
    (``bf16_array * scale`` stays bf16); cast, it arrives strongly typed, as ``astype`` makes
    it, even to its own dtype (regression, a probe: a ``dtype=`` entry of the leaf's own dtype
    left it weak). Into host memory and a single-device sharding too, and with ``donate=``."""
    weak = {
        "scale": jnp.asarray(1.5),
        "steps": jnp.arange(8) * 1.0,
        "cast": jnp.asarray(2.5),
        "own": jnp.asarray(3.5),
        "strong": jnp.ones((8,), jnp.float32),
    }
    assert weak["scale"].weak_type and weak["steps"].weak_type
    src = {k: jax.device_put(v, sharding(*SRC)) for k, v in weak.items()}
    dst = {k: sharding(*DST) for k in weak}
    dst["scale"] = SingleDeviceSharding(jax.devices()[5], memory_kind="pinned_host")
    dtype = {"scale": None, "steps": None, "cast": jnp.bfloat16, "own": "float32", "strong": None}
    plan = jr.plan(src, dst, dtype=dtype)
    out = plan(src)
    out = plan(src, donate=out)
    for k, x in out.items():
        want = jax.device_put(src[k], dst[k]) if dtype[k] is None else src[k].astype(dtype[k])
        assert x.weak_type == want.weak_type, k
        assert x.sharding == dst[k] and np.asarray(x).tobytes() == np.asarray(want).tobytes()
    bf16 = jax.device_put(jnp.ones((8,), jnp.bfloat16), sharding(*DST))
    assert (bf16 * out["steps"]).dtype == jnp.bfloat16


def test_a_fallback_leaf_taking_its_own_dtype_is_strongly_typed_too(caplog):
    """(A review.) A Python float going through ``jax.device_put`` (``fallback=``) with a
    ``dtype=`` entry of its own dtype stayed weak, where a moved leaf's cast makes it strong,
    as ``astype`` does; without an entry it stays weak, as ``jax.device_put`` gives it."""
    dst = sharding(*DST)
    src = {"moved": jax.device_put(jnp.asarray(1.5), dst), "fb": 0.5, "plain": 2.5}
    dtype = {"moved": "float32", "fb": "float32", "plain": None}
    out = jr.plan(src, {k: dst for k in src}, dtype=dtype, fallback="device_put")(src)
    assert not out["moved"].weak_type and not out["fb"].weak_type
    assert out["plain"].weak_type == jax.device_put(2.5, dst).weak_type
    assert float(out["fb"]) == 0.5 and out["fb"].sharding == dst


def test_each_call_gets_its_own_sources_weak_type():
    """Regression: the weak type was the plan's (or the ``jr.reshard`` cache's first
    caller's): a strong source called through a plan made from a weak one came back weak, so
    ``strong_f32 + bf16`` promoted to bf16 where ``jax.device_put``'s result gives f32."""
    weak = jax.device_put(jnp.asarray(1.5), sharding(*SRC))
    strong = jax.device_put(jnp.asarray(2.5, jnp.float32), sharding(*SRC))
    dst = sharding(*DST)
    assert weak.weak_type and not strong.weak_type
    for first, second in ((weak, strong), (strong, weak)):
        plan = jr.plan(first, dst)
        jr.clear_cache()
        for x in (first, second, first):
            assert plan(x).weak_type == x.weak_type
            assert jr.reshard(x, dst).weak_type == x.weak_type
    bf16 = jax.device_put(jnp.ones((), jnp.bfloat16), dst)
    assert (jr.reshard(strong, dst) + bf16).dtype == (jax.device_put(strong, dst) + bf16).dtype
    assert jr.plan(weak, dst, dtype=jnp.bfloat16)(weak).weak_type is False  # cast: astype's


def test_a_call_of_the_other_weak_type_compiles_nothing():
    """Regression: programs compiled for the planned source's weak type compiled again for
    the other (a pack for the source, an unpack for a donated result of the other type)."""
    weak = jax.device_put(jnp.asarray(1.5), sharding(*SRC))
    strong = jax.device_put(jnp.asarray(2.5, jnp.float32), sharding(*SRC))
    for first, second in ((weak, strong), (strong, weak)):
        plan = jr.plan(first, sharding(*DST))
        out = plan(first)
        out = plan(first, donate=out)
        with COMPILES:
            out = plan(second, donate=out)
            out = plan(first, donate=out)
            out = plan(second)
        assert COMPILES.count == 0
        assert out.weak_type == second.weak_type and float(out) == float(second)


def test_a_destination_over_manual_mesh_axes_gets_the_sharding_it_asked_for():
    """``jax.device_put`` takes a NamedSharding whose mesh axes are Manual; so does a plan
    (it crashed compiling its unpack): the result carries that sharding and can be donated."""
    manual = jax.sharding.AxisType.Manual
    host = random_array((8, 8), "float32")
    src = jax.device_put(host, sharding(*SRC, "dp", "tp"))
    for ids in (tuple(range(4, 8)), tuple(range(8))):
        mesh = jax.make_mesh(
            (len(ids),), ("e",), axis_types=(manual,), devices=[jax.devices()[i] for i in ids]
        )
        dst = NamedSharding(mesh, jax.sharding.PartitionSpec("e"))
        plan = jr.plan(src, dst)
        out = plan(src)
        out = plan(src, donate=out)
        assert_exact(out, host, dst)


def test_a_source_over_manual_mesh_axes_moves_as_over_auto_ones():
    """A source whose mesh axes are Manual (all or some) moves, as ``jax.device_put`` moves it
    (a probe: the pack program, traced over Manual axes, failed in XLA with a raw error)."""
    manual, auto = jax.sharding.AxisType.Manual, jax.sharding.AxisType.Auto
    host = random_array((8, 8), "float32")
    dst = sharding(*DST, None, "tp")
    for types in ((manual, manual), (manual, auto)):
        mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=types, devices=jax.devices()[:4])
        src = jax.device_put(host, NamedSharding(mesh, jax.sharding.PartitionSpec("dp", "tp")))
        plan = jr.plan({"w": src}, {"w": dst}, dtype=jnp.bfloat16)
        out = plan({"w": src})
        out = plan({"w": src}, donate=out)
        assert_exact(out["w"], host.astype(jnp.bfloat16), dst)


def test_destinations_in_host_memory_land_there_under_the_transfer_guard():
    host = random_array((16, 8), "float32")
    src = {
        "w": jax.device_put(host, sharding(*SRC, "dp", "tp")),
        "v": jax.device_put(host[:8], sharding(*SRC, "tp")),
    }
    pinned = sharding(*DST, "tp").with_memory_kind("pinned_host")
    dst = {"w": pinned, "v": sharding(*DST, None, "tp")}
    plan = jr.plan(src, dst, dtype=jnp.bfloat16)
    with jax.transfer_guard("disallow"):
        out = plan(src)
        out = plan(src, donate=out)  # the host result is freed, not reused
        jax.block_until_ready(out)
    assert out["w"].sharding.memory_kind == "pinned_host"
    assert out["v"].sharding.memory_kind in (None, "device")
    assert_exact(out["w"], host.astype(jnp.bfloat16), pinned)
    assert_exact(out["v"], host[:8].astype(jnp.bfloat16), dst["v"])


def test_sources_in_host_memory_are_read_from_there_and_kept():
    host = random_array((16, 8), "float32")
    offloaded = sharding(*SRC, "dp").with_memory_kind("pinned_host")
    src = {"w": jax.device_put(host, offloaded), "k": jax.device_put(keys(4), offloaded)}
    want_k = key_bits(src["k"])
    dst = sharding(*DST, "tp")
    with jax.transfer_guard("disallow"):
        out = jr.plan(src, dst)(src)
        jax.block_until_ready(out)
    assert_exact(out["w"], host, dst)
    assert key_bits(out["k"]).tobytes() == want_k.tobytes()
    assert not src["w"].is_deleted() and src["w"].sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(src["w"]), host)


def test_a_numpy_leafs_result_keeps_its_values_when_the_numpy_array_changes_afterwards():
    """Regression (a probe of `Plan.start`): jax 0.10.2's ``device_put`` of a NumPy array onto
    CPU devices other than the first returned arrays that went on reading its buffer, so a
    fallback leaf's result changed with the caller's NumPy array after the call had
    returned (``block_until_ready`` and ``may_alias=False`` notwithstanding)."""
    plan = jr.plan({"h": np.zeros(1024, np.float32)}, {"h": sharding(*DST)}, fallback="device_put")
    for _ in range(20):  # (the reads went one way or the other, at random)
        host = np.arange(1024, dtype=np.float32)
        out = jax.block_until_ready(plan({"h": host}))
        host[:] = -1
        np.testing.assert_array_equal(np.asarray(out["h"]), np.arange(1024))


def test_a_refit_loop_with_host_memory_destinations_compiles_nothing_after_its_first_call():
    """Regression (an edge-case probe): a call with donate= still makes fresh arrays for the
    destinations in host memory (their buffers cannot be written in place), a list of
    leaves the first call, which allocates all of them, had not compiled: the second call of
    a refit loop compiled a zero-filling program."""
    host = random_array((64,), "float32", 4)
    src = {
        "host": jax.device_put(host, sharding(*SRC, "dp").with_memory_kind("pinned_host")),
        "w": jax.device_put(random_array((256,), "float32", 5), sharding(*SRC, "tp")),
    }
    dst = {"host": sharding(*DST, "tp").with_memory_kind("unpinned_host"), "w": sharding(*DST)}
    plan = jr.plan(src, dst)
    out = plan(src)
    with COMPILES:
        for _ in range(3):
            out = plan(src, donate=out)
    assert COMPILES.count == 0, COMPILES.events
    assert out["host"].sharding == dst["host"]
    assert np.asarray(out["host"]).tobytes() == host.tobytes()


def test_whole_shards_into_host_memory_on_devices_in_two_orders_compile_once():
    """Regression (a review): leaves that move as whole shards share a step whatever the
    order of their destinations' devices; the first call compiled their host-memory
    destinations' allocation (made again by every call with donate=) as one program, which
    cannot lay out arrays over two orders of devices, so the first call with donate=
    compiled the per-order programs that run."""
    tp, flipped = sharding(*DST, "tp"), sharding(DST[0][::-1], *DST[1:], "tp")
    src = {
        k: jax.device_put(
            random_array((4096, 1024), "float32", i), sharding(*SRC[:1], (4,), ("x",), "x")
        )
        for i, k in enumerate("abc")
    }
    dst = {
        "a": tp,
        "b": tp.with_memory_kind("pinned_host"),
        "c": flipped.with_memory_kind("pinned_host"),
    }
    plan = jr.plan(src, dst, bucket_bytes=64 << 20)
    assert [sorted(s.whole) for s in plan.lowered.steps] == [[0, 1, 2]]  # (one step)
    out = plan(src)
    with COMPILES:
        for _ in range(2):
            out = plan(src, donate=out)
    assert COMPILES.count == 0, COMPILES.events
    for k in "abc":
        assert out[k].sharding == dst[k]
        assert np.asarray(out[k]).tobytes() == np.asarray(src[k]).tobytes()


def test_a_refused_call_keeps_donated_leaves_in_host_memory_and_a_done_one_takes_them():
    """Regression (a review, 2026-12-07): a donated leaf whose destination is in host memory
    (freed, not written in place) was deleted before the runtime could still refuse the call
    (here: compiler options XLA refuses on the first call); a donation is taken whole, once
    the move is done, or not at all."""
    src = {
        "host": jax.device_put(random_array((64,), "float32", 4), sharding(*SRC, "dp")),
        "w": jax.device_put(random_array((256,), "float32", 5), sharding(*SRC, "tp")),
    }
    dst = {"host": sharding(*DST, "tp").with_memory_kind("pinned_host"), "w": sharding(*DST)}
    old = jax.tree.map(lambda x, s: jax.device_put(jnp.zeros_like(x), s), src, dst)
    refused = jr.plan(src, dst, compiler_options={"no_such_xla_option": True})
    with pytest.raises(jr.ReshardError, match="no_such_xla_option"):
        refused(src, donate=old)
    assert not any(x.is_deleted() for x in jax.tree.leaves(old))
    out = jr.plan(src, dst)(src, donate=old)
    assert all(x.is_deleted() for x in jax.tree.leaves(old))
    assert out["host"].sharding.memory_kind == "pinned_host"
    assert np.asarray(out["host"]).tobytes() == np.asarray(src["host"]).tobytes()


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_host_memory_to_host_memory(kind):
    host = random_array((8, 8), "float32")
    src = jax.device_put(host, sharding(*SRC, "dp").with_memory_kind(kind))
    dst = sharding(*DST, "tp").with_memory_kind(kind)
    plan = jr.plan(src, dst)
    assert "    <root>: destination in host memory" in plan.describe()  # a bare array, named
    out = plan(src)
    assert out.sharding.memory_kind == kind
    assert_exact(out, host, dst)


def test_a_single_device_destination_gets_the_sharding_it_asked_for():
    host = random_array((16, 8), "float32")
    src = {"w": jax.device_put(host, sharding(*SRC, "dp", "tp")), "k": keys(2)}
    src["k"] = jax.device_put(src["k"], sharding(*SRC))
    want_k = key_bits(src["k"])
    one = SingleDeviceSharding(jax.devices()[6])
    plan = jr.plan(src, one)
    with jax.transfer_guard("disallow"):
        out = plan(src)
        out = plan(src, donate=out)
    assert out["w"].sharding == one and out["k"].sharding == one
    assert_exact(out["w"], host, one)
    assert key_bits(out["k"]).tobytes() == want_k.tobytes()
    back = jr.reshard(out["w"], sharding(*SRC, None, "tp"))  # and back from one device
    assert_exact(back, host, sharding(*SRC, None, "tp"))


def test_a_destination_sharding_of_another_class_is_planned_as_its_named_equivalent():
    from jax._src.sharding_impls import GSPMDSharding  # a sharding that is not named

    host = random_array((16, 8), "float32")
    src = jax.device_put(host, sharding(*SRC, "dp", "tp"))
    named = sharding((4, 6, 5, 7), (2, 2), ("a", "b"), "b")  # rows split 2 ways, 2 copies
    other = GSPMDSharding(tuple(named._device_assignment), named._to_xla_hlo_sharding(2))
    assert not isinstance(other, NamedSharding)
    out = jr.plan(src, other)(src)
    assert out.sharding == other
    for shard in out.addressable_shards:
        assert np.asarray(shard.data).tobytes() == host[shard.index].tobytes()


def test_a_typed_key_to_a_sharding_that_is_not_named_is_refused_or_sent_by_device_put(caplog):
    """Regression (JAX's ``test_device_put_sharding_prng``): a typed key sent to a
    GSPMDSharding tiling the key's rank was planned as its named equivalent, and its key data
    re-wrapped into that tiling, which splits no key-data dimension: reading the result raised
    JAX's AssertionError. It is refused naming the leaf, and ``fallback="device_put"`` sends
    it as ``jax.device_put`` does (the root leaf named ``<root>``)."""
    from jax._src.sharding_impls import GSPMDSharding

    src = jax.device_put(keys(8), sharding(*SRC))
    named = sharding(tuple(range(8)), (8,), ("x",), "x")
    other = GSPMDSharding(tuple(named._device_assignment), named._to_xla_hlo_sharding(1))
    with pytest.raises(jr.ReshardError, match=r"<root>: .*typed PRNG key with a GSPMDSharding"):
        jr.plan(src, other)
    with caplog.at_level(logging.WARNING, logger="jaxreshard"):
        out = jr.plan(src, other, fallback="device_put")(src)
    assert "device_put (fallback='device_put'): <root>" in caplog.text
    want = jax.device_put(src, other)
    assert out.sharding == want.sharding
    assert key_bits(out).tobytes() == key_bits(want).tobytes() == key_bits(src).tobytes()


def test_a_fallback_leaf_already_in_place_is_copied_so_donating_it_spares_the_source():
    """Regression: ``jax.device_put`` returns its input where the sharding is already the
    destination's, so a fallback leaf's result was the source array itself, and the refit
    loop's ``donate=`` deleted the source (and the result). Donating a source, or calling
    with a deleted one, is refused for fallback leaves as for the others."""
    from jax._src.sharding_impls import GSPMDSharding

    named = sharding(tuple(range(8)), (8,), ("x",), "x")
    gspmd = GSPMDSharding(tuple(named._device_assignment), named._to_xla_hlo_sharding(1))
    src = {"k": jax.device_put(jax.device_put(keys(8), named), gspmd)}
    plan = jr.plan(src, {"k": gspmd}, fallback="device_put")
    out = plan(src)
    assert out["k"] is not src["k"]
    again = plan(src, donate=out)
    assert not src["k"].is_deleted() and out["k"].is_deleted()
    assert key_bits(again["k"]).tobytes() == key_bits(src["k"]).tobytes()
    with pytest.raises(jr.ReshardError, match=r"\['k'\]: is also passed as a source array"):
        plan(src, donate=src)
    gone = {"k": jax.device_put(jax.device_put(keys(8), named), gspmd)}
    gone["k"].delete()
    with pytest.raises(jr.ReshardError, match=r"\['k'\]: is deleted"):
        plan(gone)


def test_a_donated_fallback_leaf_is_checked_like_a_moved_one_before_anything_is_deleted():
    """Regression (a probe): the ``donate=`` leaf of a fallback leaf was never checked, then
    deleted after the call: an array made over a source's own buffers was accepted (and the
    source destroyed), and so was any array of any shape. It is checked as a moved leaf's is:
    the fallback result's shape, dtype and sharding, no source's buffers, no leaf twice;
    nothing is deleted by a refused call."""
    src, dst = sharding(*SRC, "dp", "tp"), sharding(*DST, None, "tp")
    values = random_array((8, 8), np.float32, 0)
    a, b = jax.device_put(values, src), jax.device_put(values, dst)  # b: already in place
    tree = {"a": a, "b": b, "n": np.ones((8, 8), np.float32)}
    plan = jr.plan(tree, {"a": dst, "b": dst, "n": dst}, fallback="device_put")
    out = plan(tree)
    over_b = jax.make_array_from_single_device_arrays(
        b.shape, b.sharding, [s.data for s in b.addressable_shards]
    )
    unrelated = jax.device_put(np.zeros((3,), np.int32), jax.devices()[0])
    for bad, why in [
        (over_b, r"holds a source array's own buffers"),
        (b, r"is also passed as a source array"),
        (unrelated, r"expected float32\[8, 8\], got int32\[3\]"),
        (a, r"expected sharding"),
        (out["a"], r"is the same array as \['a'\]"),
    ]:
        with pytest.raises(jr.ReshardError, match=r"\['n'\]: " + why):
            plan(tree, donate={"a": out["a"], "b": out["b"], "n": bad})
        assert not any(x.is_deleted() for x in (bad, a, b, *out.values()))
    again = plan(tree, donate=out)  # the fallback's own previous result is taken
    assert all(x.is_deleted() for x in out.values()) and not (a.is_deleted() or b.is_deleted())
    for name in tree:
        assert_exact(again[name], np.asarray(tree[name]), dst)


def test_a_source_sharding_refusal_gives_a_fix_for_the_sharding_not_the_destination():
    """Regression: refusals of a sharding jaxreshard does not move (reduced, unreduced, a
    typed key's GSPMD source) printed the fix for destination PartitionSpecs that do not fit;
    the fallback is offered only where ``jax.device_put`` takes the leaf."""
    explicit = jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((2,), ("x",), axis_types=(explicit,), devices=jax.devices()[:2])
    dst = jax.sharding.NamedSharding(
        jax.make_mesh((2,), ("x",), axis_types=(explicit,), devices=jax.devices()[2:4]),
        PartitionSpec(),
    )
    with jax.set_mesh(mesh):
        reduced = jax.device_put(jnp.arange(4.0), PartitionSpec(reduced={"x"}))
        unreduced = jax.device_put(jnp.arange(4.0), PartitionSpec(unreduced={"x"}))
    for x in (reduced, unreduced):
        with pytest.raises(jr.ReshardError, match="How to fix: give such leaves layouts") as e:
            jr.plan(x, dst)
        assert "destination PartitionSpec" not in str(e.value)
    out = jr.plan(reduced, dst, fallback="device_put")(reduced)
    np.testing.assert_array_equal(np.asarray(out), np.arange(4.0))
    # Regression: a destination with reduced axes, sent by the fallback the error offers,
    # failed planning on JAX's refusal to read such a spec entry by entry.
    to_reduced = NamedSharding(dst.mesh, PartitionSpec(reduced={"x"}))
    out = jr.plan(reduced, to_reduced, fallback="device_put")(reduced)
    np.testing.assert_array_equal(np.asarray(out), np.arange(4.0))
    for fallback in (None, "device_put"):  # device_put cannot move it either: not offered
        with pytest.raises(jr.ReshardError, match="unreduced axes") as e:
            jr.plan(unreduced, dst, fallback=fallback)
        assert "fallback" not in str(e.value), str(e.value)
    with pytest.raises(jr.ReshardError, match="reduced axes") as e:
        jr.plan(reduced, dst)
    assert 'fallback="device_put"' in str(e.value)


def test_non_jax_leaves_are_refused_by_default_and_sent_by_device_put_on_request(caplog):
    host = random_array((8, 8), "float32")
    src = {"w": jax.device_put(host, sharding(*SRC, "dp")), "lr": np.float32(3e-4), "n": 7}
    dst = {"w": sharding(*DST, "tp"), "lr": sharding(*DST), "n": sharding(*DST)}
    with pytest.raises(jr.ReshardTypeError, match=r"\['lr'\].*float32.*\n.*\['n'\].*int"):
        jr.plan(src, dst)
    with caplog.at_level(logging.WARNING, logger="jaxreshard"):
        plan = jr.plan(src, dst, fallback="device_put")
    assert "['lr']" in caplog.text and "['n']" in caplog.text and "device_put" in caplog.text
    assert "['w']" not in caplog.text
    out = plan(src)
    assert_exact(out["w"], host, dst["w"])
    assert float(out["lr"]) == np.float32(3e-4) and int(out["n"]) == 7
    assert out["lr"].sharding == dst["lr"]
    assert plan.stats.bytes_total == host.nbytes  # the fallback leaves are not the plan's
    assert "['lr']: through jax.device_put" in plan.describe()
    with pytest.raises(jr.ReshardError, match="fallback"):
        jr.plan(src, dst, fallback="yes")


def test_fallback_leaves_take_the_cast_and_are_checked_before_anything_moves():
    """Regression: ``fallback="device_put"`` leaves ignored ``dtype=``, a destination that
    does not fit them failed in the call (after the donated buffers were consumed), and a
    call with another shape or dtype was accepted."""
    host = random_array((8, 8), "float32")
    src = {"w": jax.device_put(host, sharding(*SRC, "dp")), "m": np.ones((8, 4), np.float32)}
    dst = {"w": sharding(*DST, "tp"), "m": sharding(*DST, "tp")}
    plan = jr.plan(src, dst, dtype=jnp.bfloat16, fallback="device_put")
    out = plan(src)
    assert out["m"].dtype == jnp.bfloat16 and out["m"].sharding == dst["m"]
    np.testing.assert_array_equal(np.asarray(out["m"], np.float32), np.ones((8, 4)))
    with pytest.raises(jr.ReshardError, match=r"\['m'\]: expected float32\[8, 4\], got int32"):
        plan(dict(src, m=np.ones((8, 4), np.int32)), donate=out)
    assert not any(x.is_deleted() for x in out.values())  # refused: nothing consumed
    misfit = dict(src, m=np.ones((7, 4), np.float32))  # 7 rows split 4 ways
    with pytest.raises(jr.ReshardError, match=r"\['m'\]: through jax.device_put.*4 times"):
        jr.plan(misfit, dst, fallback="device_put")


def test_fallback_leaves_device_put_cannot_take_are_refused_when_planning():
    """Regression: with ``fallback="device_put"`` a spec longer than the leaf's rank failed
    with a bare IndexError from inside JAX, and NumPy arrays of strings or objects were
    planned, then failed in the call with a raw TypeError."""
    host = random_array((8, 8), "float32")
    w = jax.device_put(host, sharding(*SRC, "dp"))
    dst = {"w": sharding(*DST, "tp"), "s": sharding(*DST, None, "tp")}
    for rank_zero in (7, np.float32(1.0)):
        with pytest.raises(jr.ReshardError, match=r"\['s'\]: .*2 entries but the array has rank 0"):
            jr.plan({"w": w, "s": rank_zero}, dst, fallback="device_put")
    dst = {"w": sharding(*DST, "tp"), "s": sharding(*DST)}
    for bad, dtype in ((np.array(["a", "b"]), "<U1"), (np.array([object()]), "object")):
        with pytest.raises(jr.ReshardTypeError, match=rf"\['s'\]: .*dtype {dtype} cannot be on"):
            jr.plan({"w": w, "s": bad}, dst, fallback="device_put")
    # (A fuzz: NumPy reads these as the dtypes they name, so they were planned, then every
    # call failed in jax.device_put.)
    for named in ("f4", jnp.float32, np.dtype("int32")):
        with pytest.raises(jr.ReshardTypeError, match=r"\['s'\]: .*is not an array or a number"):
            jr.plan({"w": w, "s": named}, dst, fallback="device_put")


def test_a_call_with_a_fallback_leaf_device_put_cannot_take_is_refused_naming_it():
    """(A fuzz.) A call whose fallback leaf is a string or another object raised NumPy's raw
    TypeError from the call's checks; it is refused naming the leaf, nothing donated."""
    dst = sharding(*DST)
    plan = jr.plan({"v": 3.5}, dst, fallback="device_put")
    out = plan({"v": 3.5})
    for bad in ("3.5", "abc", object()):
        with pytest.raises(jr.ReshardError, match=r"\['v'\]: jax.device_put cannot take it"):
            plan({"v": bad}, donate=out)
        assert not out["v"].is_deleted()
    assert float(plan({"v": 2.5}, donate=out)["v"]) == 2.5


@contextlib.contextmanager
def process_wide(setting: str, value) -> Iterator[None]:
    """``jax.config.update`` of ``jax_<setting>`` for the block (every thread's value)."""
    name = f"jax_{setting}"
    old = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, old)


@pytest.mark.parametrize("scope", ["thread", "process"])
@pytest.mark.parametrize(
    "setting, value",
    [
        ("debug_nans", True),
        ("debug_infs", True),
        ("disable_jit", True),
        ("numpy_rank_promotion", "raise"),
    ],
)
def test_debugging_settings_neither_stop_a_refit_nor_cost_the_donated_tree(setting, value, scope):
    """Regression: under ``jax.debug_nans`` / ``jax.debug_infs`` JAX re-ran an unpack whose
    result held a NaN (data, here) op by op on buffers it had consumed, so the call failed
    and the ``donate=`` tree was lost; under ``jax.disable_jit`` every call raised JAX's
    error about its AOT path; under ``jax.numpy_rank_promotion("raise")`` the same programs
    were traced and compiled again (the setting is part of their cache key). A plan runs its
    programs compiled, bit for bit, whatever the caller's debugging settings, and compiles
    nothing more for them: set for the calling thread (``with jax.debug_nans(True)``) or
    for the process (``jax.config.update``)."""
    host = random_array((8, 8), "float32")  # NaN payloads and infinities included
    host[1, 1], host[2, 2] = np.nan, np.inf
    src = jax.device_put(host, sharding(*SRC, "dp"))
    dst = sharding(*DST, None, "tp")
    plan = jr.plan(src, dst)
    out = plan(src)
    scoped = getattr(jax, setting)(value) if scope == "thread" else process_wide(setting, value)
    with scoped, COMPILES:
        out = plan(src, donate=out)
        jax.block_until_ready(out)
        assert COMPILES.count == 0
        refit = plan.start(src, donate=out).result()
    assert_exact(refit, host, dst)


def test_a_fallback_leaf_device_put_refuses_is_named_and_nothing_is_donated(monkeypatch):
    """Where ``jax.device_put`` itself refuses a fallback leaf at call time (a review found a
    typed key on a destination with reduced axes), the call raises `ReshardError` naming the
    leaf, not JAX's error, before anything is donated (fallback leaves go first)."""
    src = {"n": np.arange(8, dtype=np.float32), "w": jax.device_put(np.ones((8,), np.float32))}
    dst = sharding(*DST, "tp")
    plan = jr.plan(src, {"n": dst, "w": dst}, fallback="device_put")
    out = plan(src)

    def refusing(self, i, value, dst):
        raise ValueError("device_put: no")

    monkeypatch.setattr(jr.Plan, "_fallback_copy", refusing)
    with pytest.raises(jr.ReshardError, match=r"\['n'\]: device_put: no"):
        plan(src, donate=out)
    assert not any(x.is_deleted() for x in jax.tree.leaves(out))


def test_a_named_sharding_with_permuted_logical_devices_places_data_as_jax_does():
    """JAX's NamedSharding may permute its devices (``_logical_device_ids``, private; some of
    JAX's own code paths make such shardings): as a destination the plan placed data by mesh
    and spec alone and dropped the permutation; as a source, its layout came from mesh and
    spec too (wrong local copies beside destinations on its devices), and ``jr.reshard``'s
    cache took it for the unpermuted sharding's plan and refused the call. All now follow
    ``devices_indices_map``, and the result carries the sharding given."""
    host = random_array((16, 4), "float32", 3)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[4:8]), ("a",))
    try:
        permuted = NamedSharding(mesh, PartitionSpec("a"), _logical_device_ids=(3, 2, 1, 0))
    except TypeError:  # pragma: no cover - a JAX without the argument
        pytest.skip("this JAX's NamedSharding takes no _logical_device_ids")
    plain = sharding(*SRC, "dp")
    out = jr.plan(jax.device_put(host, plain), permuted)(jax.device_put(host, plain))
    assert out.sharding == permuted
    want = jax.device_put(host, permuted)
    for a, b in zip(out.addressable_shards, want.addressable_shards, strict=True):
        assert a.device == b.device and np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes()
    jr.clear_cache()
    unpermuted = NamedSharding(mesh, PartitionSpec("a"))
    jr.reshard(jax.device_put(host, unpermuted), plain)
    again = jr.reshard(want, plain)  # the permuted source: a plan of its own
    assert_exact(again, host, plain)
    # As a source beside destinations on its own devices (local copies): its layout is read
    # from devices_indices_map too (planned by mesh and spec, these came out wrong).
    other = jax.sharding.Mesh(np.array(jax.devices()[4:8]), ("b",))  # its devices, unpermuted
    for dst in (
        NamedSharding(other, PartitionSpec()),
        NamedSharding(other, PartitionSpec(None, "b")),
        NamedSharding(other, PartitionSpec("b")),
        unpermuted,
    ):
        plan = jr.plan(want, dst)
        assert_exact(plan(want), host, dst)
        assert plan.stats.bytes_sent == plan.stats.bytes_lower_bound


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_host_memory_to_host_memory_on_the_same_devices_lands_in_host_memory(kind):
    """A source in host memory moved to host memory of the same devices (the copy into
    device memory and the copy back have the same shapes on the same devices) arrives in
    host memory, as ``jax.device_put`` places it."""
    host = random_array((16, 8), "float32", 7)
    src_s = sharding(*SRC, "dp", "tp").with_memory_kind(kind)
    dst_s = sharding(*SRC, "tp", "dp").with_memory_kind(kind)
    src = jax.device_put(host, src_s)
    out = jr.plan(src, dst_s)(src)
    want = jax.device_put(src, dst_s)
    assert out.sharding.memory_kind == want.sharding.memory_kind == kind
    assert out.sharding == dst_s
    assert np.asarray(out).tobytes() == host.tobytes()


def test_numpy_boolean_leaves_go_through_device_put_as_it_places_them():
    """A NumPy boolean mask (a host leaf) is sent by ``jax.device_put`` on request, and a
    leaf may take ``bool`` as its ``dtype=`` entry, as ``astype`` casts it."""
    dst = sharding(*DST, "tp")
    mask = np.array([True, False, True, True, False, False, True, False])
    src = {"mask": mask, "w": jax.device_put(random_array((8,), "float32"), sharding(*SRC))}
    out = jr.plan(src, {"mask": dst, "w": dst}, fallback="device_put")(src)
    want = jax.device_put(mask, dst)
    assert out["mask"].dtype == want.dtype == jnp.bool_ and out["mask"].sharding == dst
    assert np.array_equal(np.asarray(out["mask"]), mask)
    ints = jax.device_put(np.array([0, 1, 2, 0, 3, 0, 0, 5], np.int32), sharding(*SRC))
    cast = jr.plan(ints, dst, dtype=bool)(ints)
    assert cast.dtype == jnp.bool_
    assert np.array_equal(np.asarray(cast), np.asarray(ints.astype(bool)))


def test_zero_size_leaves_of_two_dtypes_arrive_with_their_own_dtypes():
    """Empty leaves of one shard shape but different dtypes each get a fresh destination of
    their own dtype, as ``jax.device_put`` gives them."""
    dst = sharding(*DST, None, "tp")
    host = {
        "f": np.zeros((0, 8), np.float32),
        "i": np.zeros((0, 8), np.int32),
        "h": np.zeros((0, 8), jnp.bfloat16),
    }
    src = {k: jax.device_put(v, sharding(*SRC, None, "tp")) for k, v in host.items()}
    out = jr.plan(src, {k: dst for k in host})(src)
    for k, x in out.items():
        want = jax.device_put(src[k], dst)
        assert x.dtype == want.dtype == host[k].dtype, k
        assert x.shape == (0, 8) and x.sharding == dst, k
