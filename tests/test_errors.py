"""Bad input is refused before any data moves, naming every bad leaf and the fix."""

from __future__ import annotations

import collections
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import assert_exact, random_array, sharding
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.sharding import PartitionSpec as P

import jaxreshard as jr

SRC = (tuple(range(4)), (2, 2), ("fsdp", "tp"), "fsdp", "tp")
DST = (tuple(range(4, 8)), (4,), ("tp",), None, "tp")


@pytest.fixture
def src():
    return {
        "a": jax.device_put(random_array((8, 8), "float32"), sharding(*SRC)),
        "b": {"c": jax.device_put(random_array((8, 4), "float32", 1), sharding(*SRC))},
    }


def dst_tree():
    return {"a": sharding(*DST), "b": {"c": sharding(*DST)}}


def test_tree_structures_that_differ_name_the_missing_leaf(src):
    with pytest.raises(jr.ReshardError, match=r"\['b'\]\['c'\].*missing") as e:
        jr.plan(src, {"a": sharding(*DST), "b": {"d": sharding(*DST)}})
    assert "How to fix" in str(e.value)


@pytest.mark.parametrize(
    "option",
    [
        {"bucket_bytes": 0},
        {"topology": "nvlink"},
        {"compiler_options": ["xla_cpu_enable_fast_math"]},
        {"fallback": "device-put"},
    ],
    ids=lambda option: next(iter(option)),
)
def test_a_bad_option_is_refused_with_its_fix(src, option):
    with pytest.raises((jr.ReshardError, TypeError), match=next(iter(option))) as e:
        jr.plan(src, dst_tree(), **option)
    assert "How to fix" in str(e.value)


@pytest.mark.parametrize(
    "option",
    [
        {"block": (0, 128)},
        {"block": 128},  # regression: raw TypeError
        {"block": "ab"},  # regression: raw ValueError
        {"block": (8.9, 8)},  # regression: truncated to (8, 8)
        {"block": (True, 8)},  # regression: taken as (1, 8)
        {"block": np.array([0, 4])},  # regression (a fuzz): raw ValueError on any array
        {"fmt": jnp.float16},
        {"fmt": "nope"},  # regression: raw TypeError
    ],
    ids=[
        "block", "block-int", "block-str", "block-float", "block-bool", "block-array", "fmt",
        "fmt-name",
    ],
)  # fmt: skip
def test_a_bad_fp8_format_is_refused_with_its_fix(option):
    with pytest.raises(jr.ReshardError, match=next(iter(option))) as e:
        jr.Fp8Blockwise(**option)
    assert "How to fix" in str(e.value)


def test_fp8_blocks_given_as_a_numpy_array_are_taken_as_sizes():
    """(A fuzz: any NumPy array raised "truth value of an array is ambiguous".)"""
    assert jr.Fp8Blockwise(block=np.array([4, 4])).block == (4, 4)


def test_shardings_as_an_nnx_state_over_a_pure_dict_source_say_so_once(src):
    """(A probe of real model trees.) Pure-dict parameters planned against an nnx.State of
    shardings listed every leaf twice ("missing here", then ".value: not in the source
    tree") and never said why; the one difference is named once, with the fix."""
    nnx = pytest.importorskip("flax.nnx")
    wrapped = nnx.State({"a": nnx.Param(sharding(*DST)), "b": {"c": nnx.Param(sharding(*DST))}})
    with pytest.raises(jr.ReshardError) as e:
        jr.plan(src, wrapped)
    message = str(e.value)
    assert "(1 leaf)" in message and "and 1 more" in message, message
    assert "holds nnx Variables where the source tree holds plain leaves" in message
    assert "to_pure_dict()" in message


def test_a_call_with_the_pure_dict_of_the_nnx_state_planned_says_so_once(src):
    """Calling (or donating to) a plan made for an nnx.State with its pure dict names the one
    difference once. Regression (a fuzz, 2026-12-06): every leaf was listed again below it ("a
    leaf here, where the tree the plan was made for has a leaf below")."""
    nnx = pytest.importorskip("flax.nnx")
    state = nnx.State({"a": nnx.Param(src["a"]), "b": {"c": nnx.Param(src["b"]["c"])}})
    plan = jr.plan(state, sharding(*DST))
    out = plan(state)
    for call in (
        lambda: plan(state.to_pure_dict()),
        lambda: plan(state, donate=out.to_pure_dict()),
    ):
        with pytest.raises(jr.ReshardError) as e:
            call()
        message = str(e.value)
        assert "holds plain leaves where the tree the plan was made for holds nnx Variables" in (
            message
        )
        assert "(1 leaf)" in message and "has a leaf below" not in message, message
    assert not any(x.is_deleted() for x in jax.tree.leaves(out))


def test_a_fallback_leaf_device_put_cannot_take_is_refused_when_planning():
    """A NumPy array in another byte order ('>f4'), which jax.device_put refuses only when
    called, is refused when planning, as a string is (a fuzz, 2026-12-06: a call refused it)."""
    dst = sharding(*DST[:3], "tp")
    with pytest.raises(jr.ReshardTypeError, match=r"\['n'\]: .*dtype >f4 is not in this machine"):
        jr.plan({"n": np.arange(8, dtype=">f4")}, {"n": dst}, fallback="device_put")


def test_masked_arrays_and_time_deltas_are_refused_when_planning_and_in_a_call():
    """A NumPy masked array (an ndarray whose copy would drop its mask) and a timedelta64
    array (an integer to NumPy, refused by jax.device_put) as fallback leaves are refused
    when planning, naming the leaf; a masked array passed to a plan made for a plain one is
    refused by the call (a review, 2026-12-07: the mask was silently dropped, and time
    deltas were refused only by each call)."""
    dst = {"n": sharding(*DST[:3], None)}
    masked = np.ma.masked_array(np.ones(4, np.float32), mask=[0, 1, 0, 0])
    for bad, why in (
        (masked, "masked array"),
        (np.arange(4).astype("timedelta64[s]"), "timedelta64"),
    ):
        with pytest.raises(jr.ReshardTypeError, match=rf"\['n'\]: .*{why}"):
            jr.plan({"n": bad}, dst, fallback="device_put")
    plan = jr.plan({"n": np.ones(4, np.float32)}, dst, fallback="device_put")
    with pytest.raises(jr.ReshardError, match=r"\['n'\]: .*masked array"):
        plan({"n": masked})


def test_compiler_options_named_by_other_than_str_are_refused_by_every_entry_point(src):
    """Regression (a review, 2026-12-07): option names that do not sort together escaped
    `jr.reshard` as a bare TypeError."""
    for call in (jr.plan, jr.reshard, jr.cached_plan):
        with pytest.raises(jr.ReshardTypeError, match=r"compiler_options.*\[1\]") as e:
            call(src, dst_tree(), compiler_options={1: True, "xla_cpu_enable_fast_math": False})
        assert "How to fix" in str(e.value)


def test_verify_of_a_fallback_leaf_device_put_refuses_names_it(src):
    """`verify` puts fallback leaves again: under a transfer guard that refuses it, it raises
    the error a call raises, naming the leaf (a fuzz, 2026-12-06: JAX's own JaxRuntimeError
    escaped)."""
    tree = {"a": src["a"], "n": np.arange(8, dtype=np.float32)}
    plan = jr.plan(
        tree, {"a": sharding(*DST), "n": sharding(*DST[:3], "tp")}, fallback="device_put"
    )
    out = plan(tree)
    with jax.transfer_guard("disallow_explicit"):
        with pytest.raises(jr.ReshardError, match=r"\['n'\]: .*Disallowed host-to-device"):
            plan(tree)
        with pytest.raises(jr.ReshardError, match=r"\['n'\]: .*Disallowed host-to-device"):
            plan.verify(tree, out)


def test_a_leaf_of_2_62_bytes_or_more_is_refused_naming_it():
    """Byte offsets are int64: a ShapeDtypeStruct of 2**62 bytes or more is refused by name (a
    fuzz, 2026-12-06: Python's OverflowError escaped from the planner)."""
    for shape in ((2**60, 4), (2**63, 4)):
        leaf = jax.ShapeDtypeStruct(shape, jnp.int8, sharding=sharding(*SRC[:3], "fsdp"))
        with pytest.raises(jr.ReshardError, match=r"\['w'\]: has shape .* at least 2\*\*62 bytes"):
            jr.plan({"w": leaf}, {"w": sharding(*DST)})


def test_nnx_mistakes_are_named_with_their_fix(src):
    """(A probe of Flax NNX usage.) An nnx.State source beside shardings as its pure dict
    (the other way round from the test above), an nnx module passed where its state belongs,
    and logical-axis PartitionSpecs (what nnx.get_partition_spec gives) each get a message
    that says what is wrong and how to fix it, not only which nodes differ."""
    nnx = pytest.importorskip("flax.nnx")
    state = nnx.State({"a": nnx.Param(src["a"]), "b": {"c": nnx.Param(src["b"]["c"])}})
    with pytest.raises(jr.ReshardError) as e:
        jr.plan(state, dst_tree())
    message = str(e.value)
    assert "holds plain leaves where the source tree holds nnx Variables" in message, message
    assert "nnx.get_named_sharding" in message

    class Model(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(src["a"])

    with pytest.raises(jr.ReshardError, match=r"(?s)nnx Module stands.*nnx\.state\(model\)"):
        jr.plan(Model(), {"a": {"value": sharding(*DST)}})
    graphdef, _ = nnx.split(Model())  # (a tree of no leaves: it would plan to move nothing)
    with pytest.raises(jr.ReshardError, match=r"(?s)holds no arrays.*GraphDef.*State alone"):
        jr.plan(graphdef, sharding(*DST))
    with pytest.raises(jr.ReshardError, match=r"logical axis names.*nnx.logical_axis_rules"):
        jr.plan(src["a"], PartitionSpec("embed", "mlp"))


def test_a_destination_that_does_not_divide_the_shape(src):
    bad = dst_tree()
    bad["b"]["c"] = sharding(tuple(range(4, 7)), (3,), ("tp",), None, "tp")
    with pytest.raises(jr.ReshardError, match=r"\['b'\]\['c'\].*does not divide"):
        jr.plan(src, bad)


def test_a_source_struct_that_does_not_divide_its_shape_is_told_to_fix_the_source(src):
    """JAX refuses arrays whose sharding does not divide them, but a ShapeDtypeStruct takes
    any sharding unchecked: the fix names the source, not the destination (found by a fuzz:
    the hint told the caller to fix the destination's PartitionSpec)."""
    struct = jax.ShapeDtypeStruct((5, 8), jnp.float32, sharding=sharding(*SRC))
    with pytest.raises(jr.ReshardError, match=r"\['a'\]: source layout.*divide") as e:
        jr.plan({"a": struct}, {"a": sharding(*DST)})
    fix = str(e.value).split("How to fix:")[1]
    assert "every source" in fix and "destination" not in fix


def test_a_spec_longer_than_the_rank(src):
    bad = dst_tree()
    bad["a"] = sharding(*DST, None)
    with pytest.raises(jr.ReshardError, match=r"\['a'\].*rank 2"):
        jr.plan(src, bad)


@pytest.mark.parametrize(
    "spec, problem",
    [
        (PartitionSpec(PartitionSpec.UNCONSTRAINED, "tp"), "an UNCONSTRAINED entry"),
        (PartitionSpec(None, None, unreduced={"tp"}), "unreduced axes"),
        (PartitionSpec(None, None, reduced={"tp"}), "reduced axes"),
    ],
)
def test_a_spec_that_names_no_layout_of_values(src, spec, problem):
    """Regression: these reached JAX's own spec handling (a TypeError, or a ValueError naming
    no leaf)."""
    kind = (
        jax.sharding.AxisType.Auto if "UNCONSTRAINED" in problem else jax.sharding.AxisType.Explicit
    )
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(kind,), devices=jax.devices()[4:])
    bad = dst_tree()
    bad["a"] = jax.sharding.NamedSharding(mesh, spec)
    with pytest.raises(jr.ReshardError, match=rf"\['a'\]: the destination sharding has {problem}"):
        jr.plan(src, bad)


def test_every_bad_leaf_is_listed_at_once(src):
    bad = {
        "a": sharding(tuple(range(4, 7)), (3,), ("tp",), "tp"),
        "b": {"c": sharding(*DST, None)},
    }
    with pytest.raises(jr.ReshardError, match="cannot plan a reshard for these leaves") as e:
        jr.plan(src, bad)
    assert "['a']" in str(e.value) and "['b']['c']" in str(e.value)
    assert "(2 leaves)" in str(e.value)


def test_a_destination_that_is_not_a_sharding(src):
    bad = dst_tree()
    bad["a"] = PartitionSpec("tp")  # a spec alone: the mesh is missing
    with pytest.raises(
        jr.ReshardTypeError,
        match=r"\['a'\].*PartitionSpec.*not a jax.sharding.Sharding.*NamedSharding\(mesh, spec\)",
    ):
        jr.plan(src, bad)
    assert issubclass(jr.ReshardTypeError, TypeError)
    assert issubclass(jr.ReshardError, ValueError)
    # An array (a previous result) where its sharding belongs: the fix names x.sharding.
    bad["a"] = jnp.zeros(src["a"].shape, src["a"].dtype)
    with pytest.raises(
        jr.ReshardTypeError,
        match=r"\['a'\].*is of type ArrayImpl, not a jax.sharding.Sharding.*x\.sharding",
    ):
        jr.plan(src, bad)


def test_a_source_that_is_not_a_jax_array(src):
    src["a"] = np.zeros((8, 8), np.float32)
    with pytest.raises(jr.ReshardTypeError, match=r"\['a'\].*ndarray, not a jax.Array"):
        jr.plan(src, dst_tree())


def test_a_tree_refused_for_a_type_and_for_a_layout_raises_the_plain_error_naming_both(src):
    """`ReshardTypeError` (a ``TypeError`` too) means every problem is one of type, so that an
    ``except TypeError`` takes only those: a tree with one leaf that is not a ``jax.Array``
    and another whose destination does not divide its shape raises exactly `ReshardError`,
    naming both leaves; the type problem alone raises `ReshardTypeError`. Mutation check: any
    type problem among others made the whole refusal a `ReshardTypeError`."""
    src["a"] = np.zeros((8, 8), np.float32)  # not a jax.Array: a type problem
    bad = dst_tree()
    bad["b"]["c"] = sharding(tuple(range(4, 7)), (3,), ("tp",), "tp")  # 8 rows over 3: a layout
    with pytest.raises(jr.ReshardError) as e:
        jr.plan(src, bad)
    assert type(e.value) is jr.ReshardError and not isinstance(e.value, TypeError)
    assert "['a']" in str(e.value) and "['b']['c']" in str(e.value)
    with pytest.raises(jr.ReshardTypeError, match=r"\['a'\].*not a jax.Array"):
        jr.plan({"a": src["a"]}, {"a": sharding(*DST)})


def test_a_deleted_source_array(src):
    src["b"]["c"].delete()
    with pytest.raises(jr.ReshardError, match=r"\['b'\]\['c'\].*deleted"):
        jr.plan(src, dst_tree())


def test_a_plan_applied_to_arrays_of_another_shape_dtype_or_sharding(src):
    plan = jr.plan(src, dst_tree())
    other = dict(src)
    other["a"] = jax.device_put(random_array((8, 8), "float16"), sharding(*SRC))
    with pytest.raises(jr.ReshardError, match=r"\['a'\].*expected float32\[8, 8\], got float16"):
        plan(other)
    other["a"] = jax.device_put(random_array((8, 8), "float32"), sharding(*DST))
    with pytest.raises(jr.ReshardError, match=r"\['a'\].*expected sharding"):
        plan(other)
    with pytest.raises(jr.ReshardError, match="structure"):
        plan({"a": src["a"]})


def test_an_equivalent_sharding_is_accepted(src):
    """A mesh of the same devices with other axis names lays the array out as planned: the
    plan takes it (the shardings are equivalent, not equal), and moves it exactly."""
    plan = jr.plan(src, dst_tree())
    same = dict(src)
    same["a"] = jax.device_put(np.asarray(src["a"]), sharding(SRC[0], SRC[1], ("p", "q"), "p", "q"))
    assert same["a"].sharding != src["a"].sharding
    out = plan(same)
    assert_exact(out["a"], np.asarray(src["a"]), dst_tree()["a"])
    assert_exact(out["b"]["c"], np.asarray(src["b"]["c"]), dst_tree()["b"]["c"])


def test_a_donate_tree_that_does_not_match_the_destination(src):
    plan = jr.plan(src, dst_tree())
    out = plan(src)
    with pytest.raises(jr.ReshardError, match="donate= tree does not match"):
        plan(src, donate={"a": out["a"]})
    wrong = {"a": out["a"], "b": {"c": src["b"]["c"]}}
    with pytest.raises(jr.ReshardError, match=r"\['b'\]\['c'\].*expected sharding"):
        plan(src, donate=wrong)
    assert not out["a"].is_deleted()  # nothing was donated by the refused call


@pytest.mark.parametrize("verify", ["yes", "no", 1, None])
def test_verify_takes_true_or_false_only(src, verify):
    """``verify="no"`` would read as true: anything but a bool is refused before data moves,
    and the donated result survives."""
    plan = jr.plan(src, dst_tree())
    out = plan(src)
    with pytest.raises(jr.ReshardError, match="verify must be True or False"):
        plan(src, donate=out, verify=verify)
    assert not out["a"].is_deleted()
    assert plan(src, donate=out, verify=np.True_)["a"].shape == out["a"].shape


def test_a_call_with_a_deleted_source_or_donate_leaf_names_it(src):
    plan = jr.plan(src, dst_tree())
    out = plan(src)
    gone = jax.device_put(np.asarray(src["a"]), src["a"].sharding)
    gone.delete()
    with pytest.raises(jr.ReshardError, match=r"\['a'\]: the array has been deleted"):
        plan({**src, "a": gone})
    gone = jax.device_put(np.asarray(out["a"]), out["a"].sharding)
    gone.delete()
    with pytest.raises(jr.ReshardError, match=r"\['a'\]: the array has been deleted"):
        plan(src, donate={**out, "a": gone})
    assert not out["b"]["c"].is_deleted()  # nothing was donated by the refused call


def test_donating_the_source_is_refused(src):
    same = {"a": sharding(*SRC), "b": {"c": sharding(*SRC)}}
    plan = jr.plan(src, same)
    with pytest.raises(jr.ReshardError, match="destroy the source"):
        plan(src, donate=src)
    assert not src["a"].is_deleted()


def test_donating_another_array_over_the_sources_own_buffers_is_refused(src):
    """Regression: only the source objects themselves were refused, so an array made over
    the source's shards (``jax.make_array_from_single_device_arrays``) went in, XLA refused
    the donation mid-call and the process crashed (SIGSEGV). With ``plan.start`` too; a
    plan's own result is still taken."""
    same = {"a": sharding(*SRC), "b": {"c": sharding(*SRC)}}
    plan = jr.plan(src, same)
    want = {k: np.asarray(x) for k, x in (("a", src["a"]), ("c", src["b"]["c"]))}

    def over(x: jax.Array) -> jax.Array:
        return jax.make_array_from_single_device_arrays(
            x.shape, x.sharding, [s.data for s in x.addressable_shards]
        )

    out = plan(src)
    for donate in (
        {"a": over(src["a"]), "b": {"c": out["b"]["c"]}},
        {"a": out["a"], "b": {"c": over(src["b"]["c"])}},
    ):
        with pytest.raises(jr.ReshardError, match=r"holds a source array's own buffers"):
            plan(src, donate=donate)
        with pytest.raises(jr.ReshardError, match=r"holds a source array's own buffers"):
            plan.start(src, donate=donate)
        assert not any(x.is_deleted() for x in jax.tree.leaves(donate))
    assert np.asarray(src["a"]).tobytes() == want["a"].tobytes()
    assert np.asarray(src["b"]["c"]).tobytes() == want["c"].tobytes()
    out = plan(src, donate=out)  # the plan's own result: its own buffers
    assert np.asarray(out["a"]).tobytes() == want["a"].tobytes()


def test_the_buffer_check_reads_only_leaves_whose_shards_could_share_buffers(monkeypatch):
    """A donate= leaf can hold a source's buffers only where a source shard and a
    destination shard have one dtype and shape on one device: a call reads the buffer
    addresses of those leaves alone (reading all of 392 colocated LoRA adapters' took 60 ms
    a call), and still refuses a leaf made over another leaf's source buffers."""
    from jaxreshard import api

    read = []
    addresses = api._buffer_addresses
    monkeypatch.setattr(api, "_buffer_addresses", lambda xs: read.extend(xs) or addresses(xs))
    rows, cols = (tuple(range(4)), (4,), ("x",), "x"), (tuple(range(4)), (4,), ("x",), None, "x")
    src = {  # x: rows -> columns, y: columns -> rows; each one's result has the other's shards
        "x": jax.device_put(random_array((8, 8), "float32"), sharding(*rows)),
        "y": jax.device_put(random_array((8, 8), "float32", 1), sharding(*cols)),
    }
    for i in range(6):  # shards of shapes no other leaf's have
        src[f"z{i}"] = jax.device_put(random_array((16, 4), "float32", 2 + i), sharding(*rows))
    dst = {k: sharding(*cols) for k in src}
    dst["y"] = sharding(*rows)
    plan = jr.plan(src, dst)
    out = plan(src)
    read.clear()
    old, out = out, plan(src, donate=out)
    assert sorted(map(id, read)) == sorted(map(id, [src["x"], src["y"], old["x"], old["y"]]))
    over_x = jax.make_array_from_single_device_arrays(
        (8, 8), dst["y"], [s.data for s in src["x"].addressable_shards]
    )
    with pytest.raises(jr.ReshardError, match=r"\['y'\]: holds a source array's own buffers"):
        plan(src, donate={**out, "y": over_x})
    assert not over_x.is_deleted() and not out["y"].is_deleted()


def test_donating_a_leaf_over_a_fallback_leafs_source_buffers_is_refused():
    """(A fuzz.) A fallback leaf's source layout is not planned, so no shard shapes say which
    donated leaf could hold its buffers: a donate= leaf made over a fallback source key's
    data was donated and the source key destroyed. Every donated leaf is now checked against
    every source where the plan has fallback leaves."""
    from jax._src.sharding_impls import GSPMDSharding  # (a sharding not named: a fallback)

    line = lambda ids: Mesh(np.array([jax.devices()[i] for i in ids]), ("x",))  # noqa: E731
    key = jax.device_put(jax.random.key(0), GSPMDSharding.get_replicated([jax.devices()[0]]))
    words = jax.device_put(np.arange(2, dtype=np.uint32), NamedSharding(line([4, 5, 6, 7]), P()))
    src = {"k": key, "u": words}
    dst = {"k": NamedSharding(line([0]), P()), "u": NamedSharding(line([0, 1, 2, 3]), P())}
    plan = jr.plan(src, dst, fallback="device_put")
    assert plan.fallback and not plan._may_alias  # (no moved leaves' shards alike)
    out = plan(src)
    data = jax.random.key_data(key)  # over the key's own buffer
    per = {s.device.id: s.data for s in out["u"].addressable_shards}
    per[0] = data.addressable_shards[0].data
    over = jax.make_array_from_single_device_arrays(
        (2,), dst["u"], [per[d.id] for d in dst["u"].addressable_devices_indices_map((2,))]
    )
    with pytest.raises(jr.ReshardError, match=r"\['u'\]: holds a source array's own buffers"):
        plan(src, donate={"k": out["k"], "u": over})
    assert not key.is_deleted() and not over.is_deleted()
    out = plan(src, donate=out)  # its own results still go in
    assert np.asarray(out["u"]).tolist() == [0, 1]


def test_donating_a_key_array_over_a_source_keys_own_buffers_is_refused():
    """Regression: typed PRNG keys were left out of the buffer check, so in a plan of keys a
    key array made over a source key's data (``wrap_key_data(key_data(k))``) was donated and
    the process crashed (SIGSEGV)."""
    sh = sharding(*SRC)
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8).reshape(4, 2), sh)
    src = {"k": keys}
    plan = jr.plan(src, {"k": sh})
    out = plan(src)
    before = np.asarray(jax.random.key_data(keys)).copy()
    alias = jax.random.wrap_key_data(jax.random.key_data(keys))
    with pytest.raises(jr.ReshardError, match=r"\['k'\]: holds a source array's own buffers"):
        plan(src, donate={"k": alias})
    assert not alias.is_deleted() and not out["k"].is_deleted()
    assert np.asarray(jax.random.key_data(keys)).tobytes() == before.tobytes()
    out = plan(src, donate=out)  # its own result: its own buffers
    assert np.asarray(jax.random.key_data(out["k"])).tobytes() == before.tobytes()


def test_donating_a_key_over_a_plain_sources_buffers_or_its_data_is_refused():
    """(A fuzz.) A key leaf going one way and a uint32 leaf the other: a donate= leaf over the
    other kind's source buffers (the key's data at the uint32 leaf, a key wrapping the uint32
    source at the key leaf) was not looked for (the check compared a key's dtype and shape,
    not its buffers'), so the call destroyed the source or crashed the process."""
    a, b = sharding(tuple(range(4)), (4,), ("x",)), sharding(tuple(range(4, 8)), (4,), ("x",))
    src = {
        "k": jax.device_put(jax.random.split(jax.random.key(0), 4), a),
        "u": jax.device_put(np.arange(8, dtype=np.uint32).reshape(4, 2), b),
    }
    plan = jr.plan(src, {"k": b, "u": a})
    out = plan(src)
    for name, donate in (
        ("u", {"k": out["k"], "u": jax.random.key_data(src["k"])}),
        ("k", {"k": jax.random.wrap_key_data(src["u"]), "u": out["u"]}),
    ):
        with pytest.raises(jr.ReshardError, match=rf"\['{name}'\]: holds a source array's own"):
            plan(src, donate=donate)
        assert not any(x.is_deleted() for x in (*jax.tree.leaves(donate), *src.values()))


def test_a_bad_dtype(src):
    with pytest.raises(jr.ReshardError, match="dtype"):
        jr.plan(src, dst_tree(), dtype={"a": "not-a-dtype", "b": None})


def test_a_dtype_tree_of_other_keys_names_them_and_not_its_keep_entries(src):
    """Regression: a ``None`` ("keep") entry of a dtype tree of the wrong structure was named
    as an error, and a mistyped key holding None was not named at all."""
    for typo in (None, jnp.float16):
        with pytest.raises(jr.ReshardError) as e:
            jr.plan(src, dst_tree(), dtype={"a": None, "d": typo})
        assert "['b']['c']: missing here" in str(e.value) and "['d']: not in" in str(e.value)
        assert "['a']" not in str(e.value)


def test_a_dict_of_str_and_int_keys_is_refused_naming_the_argument_and_the_dict(src):
    """JAX cannot sort such a dict's keys, and its ValueError names neither."""
    mixed = {"a": src["a"], "b": [{"c": src["b"]["c"], 0: src["b"]["c"]}]}
    dst = sharding(*DST)
    cases = [
        ("the source tree", "['b'][0]", lambda: jr.plan(mixed, dst)),
        ("the source tree", "['b'][0]", lambda: jr.reshard(mixed, dst)),
        ("dst_shardings", "<root>", lambda: jr.plan(src, {"a": dst, 1: dst})),
        ("dtype=", "<root>", lambda: jr.plan(src, dst, dtype={"a": jnp.bfloat16, 3: None})),
        ("the source tree", "['b'][0]", lambda: jr.plan(src, dst)(mixed)),
        ("donate=", "['b'][0]", lambda: jr.plan(src, dst)(src, donate=mixed)),
    ]
    for name, where, call in cases:
        with pytest.raises(jr.ReshardError) as e:
            call()
        first, fix = str(e.value).splitlines()
        assert first.startswith(f"{name} cannot be flattened as a pytree: the dict at {where} ")
        assert fix == "How to fix: give each dict keys of one type (all str, or all int)"
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(src))


def test_tracers_are_refused_by_every_entry_point_naming_the_leaf_and_the_fix(src):
    """Inside jax.jit, jax.grad or jax.vmap a plan cannot run (it runs programs of its own on
    concrete arrays): each way in says so, naming the traced leaf, not a JAX error from deep
    inside (calling a plan inside jit failed in JAX's get_mesh, jr.reshard on ``.sharding``)."""
    plan = jr.plan(src, dst_tree())
    ways = {
        "jr.plan under jit": jax.jit(lambda x: jr.plan(x, dst_tree())),
        "a plan under jit": jax.jit(lambda x: plan(x)),
        "plan.start under jit": jax.jit(lambda x: plan.start(x)),
        "jr.reshard under jit": jax.jit(lambda x: jr.reshard(x, dst_tree())),
        "a plan under grad": jax.grad(lambda x: plan(x)["a"].sum()),
        "a plan under vmap": jax.vmap(lambda x: plan(x)),
    }
    named = r"(?s)\['b'\]\['c'\]: is a tracer.*outside"
    for way, call in ways.items():
        with pytest.raises(jr.ReshardTypeError, match=named) as e:
            call(src)
        assert "jax.jit" in str(e.value), way


def test_a_plan_called_while_tracing_on_closed_over_arrays_is_refused_with_the_fix(src):
    """(A fuzz.) No tracer among the arguments, but the call is made while JAX traces (the
    traced function closes over concrete arrays): JAX's raw ValueError from get_mesh became
    this refusal, for plain and fp8 plans, calls, starts and jr.reshard alike."""
    plan = jr.plan(src, dst_tree())
    fp8 = jr.plan(src, dst_tree(), dtype=jr.Fp8Blockwise(block=None))
    ways = {
        "a plan": lambda _: plan(src),
        "plan.start": lambda _: plan.start(src),
        "an fp8 plan": lambda _: fp8(src),
        "jr.reshard": lambda _: jr.reshard(src, dst_tree()),
    }
    for way, call in ways.items():
        with pytest.raises(jr.ReshardTypeError, match=r"being traced.*nothing was moved") as e:
            jax.jit(call)(jnp.zeros(()))
        assert "How to fix: call the plan" in str(e.value), way


def test_an_fp8_plan_names_a_traced_donate_and_out_tree():
    """(A fuzz.) An fp8 plan checked only its source for tracers: a traced donate= (or
    verify's out) failed in JAX. Each is named by its path."""
    x = jax.device_put(np.ones((8, 8), np.float32), sharding(*SRC))
    fp8 = jr.plan({"a": x}, {"a": sharding(*DST[:3])}, dtype=jr.Fp8Blockwise(block=(4, 4)))
    out = fp8({"a": x})
    for way, call in {
        "call": lambda o: fp8({"a": x}, donate=o),
        "start": lambda o: fp8.start({"a": x}, donate=o),
        "profile": lambda o: fp8.profile({"a": x}, donate=o),
        "verify": lambda o: fp8.verify({"a": x}, o),
    }.items():
        with pytest.raises(jr.ReshardTypeError, match=r"\['a'\].*is a tracer") as e:
            jax.jit(call)(out)
        assert "jax.jit" in str(e.value), way


def test_errors_leave_the_source_untouched(src):
    before = np.asarray(src["a"]).copy()
    with pytest.raises(jr.ReshardError, match=r"\['b'\]\['c'\].*rank 2"):
        jr.reshard(src, {"a": sharding(*DST), "b": {"c": sharding(*DST, None)}})
    assert not src["a"].is_deleted()
    np.testing.assert_array_equal(np.asarray(src["a"]), before)
    assert jnp.dtype(src["a"].dtype) == jnp.float32


def test_unknown_compiler_options_are_refused_before_any_data_moves(src):
    plan = jr.plan(src, dst_tree(), compiler_options={"no_such_xla_option": True})
    with pytest.raises(jr.ReshardError, match=r"compiler_options.*no_such_xla_option"):
        plan(src)
    # Regression: an unhashable value escaped as JAX's "Hashing global cache key" error.
    unhashable = jr.plan(src, dst_tree(), compiler_options={"xla_dump_to": ["a", "b"]})
    with pytest.raises(jr.ReshardError, match=r"compiler_options.*xla_dump_to"):
        unhashable(src)
    ok = jr.plan(src, dst_tree(), compiler_options={"xla_cpu_enable_fast_math": False})
    out = ok(src)
    assert_exact(out["a"], np.asarray(src["a"]), dst_tree()["a"])


def test_a_prefix_entry_beside_a_mistake_is_not_reported(src):
    """Regression: a valid subtree entry was reported as 'not in the source tree' and its
    leaves as 'missing' whenever another entry was wrong."""
    whole = sharding(*DST)
    for bad, line in [
        ({"a": whole, "b": whole, "z": whole}, r"\['z'\]: not in the source tree"),
        ({"a": None, "b": whole}, r"\['a'\]: None here, where the source tree has a leaf"),
    ]:
        with pytest.raises(jr.ReshardError, match=line) as e:
            jr.plan(src, bad)
        assert "(1 leaf)" in str(e.value) and "['b']" not in str(e.value)


@jax.tree_util.register_pytree_with_keys_class
class Tagged:
    """A pytree node with metadata (as an nnx.Param's sharding annotation)."""

    def __init__(self, value, tag):
        self.value, self.tag = value, tag

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("value"), self.value),), self.tag

    @classmethod
    def tree_unflatten(cls, tag, children):
        return cls(children[0], tag)


def test_destinations_at_the_same_paths_in_nodes_of_other_metadata_are_taken_leaf_by_leaf(src):
    """A sampler's state tree has the trainer's paths but its own node metadata."""
    trainer = {"a": Tagged(src["a"], "fsdp"), "b": src["b"]}
    sampler = {"a": Tagged(sharding(*DST), "tp"), "b": {"c": sharding(*DST)}}
    out = jr.plan(trainer, sampler)(trainer)
    assert out["a"].tag == "fsdp"  # the source's structure, as with any plan
    assert_exact(out["a"].value, np.asarray(src["a"]), sharding(*DST))
    assert_exact(out["b"]["c"], np.asarray(src["b"]["c"]), sharding(*DST))


def test_a_call_whose_nodes_differ_from_the_planned_ones_names_the_node(src):
    plan = jr.plan({"a": Tagged(src["a"], "fsdp"), "b": src["b"]}, dst_tree())
    with pytest.raises(
        jr.ReshardError,
        match=r"\['a'\]: a node .*Tagged\[tp\].* where the tree .* has .*Tagged\[fsdp\]",
    ):
        plan({"a": Tagged(src["a"], "tp"), "b": src["b"]})


def test_donating_two_leaves_over_the_same_buffers_is_refused(src):
    """Regression: only one array object at two leaves was refused; an array made over
    another donated leaf's shards went in, and XLA, handed one buffer twice, crashed the
    process (SIGSEGV). The plan's own results are taken without looking at addresses."""
    dst = {"a": sharding(*DST), "b": {"c": sharding(*DST)}}
    tree = {"a": src["a"], "b": {"c": src["a"]}}
    plan = jr.plan(tree, dst)
    out = plan(tree)
    alias = jax.make_array_from_single_device_arrays(
        out["a"].shape, out["a"].sharding, [s.data for s in out["a"].addressable_shards]
    )
    donate = {"a": out["a"], "b": {"c": alias}}
    with pytest.raises(jr.ReshardError, match=r"\['b'\]\['c'\]: shares its buffers with \['a'\]"):
        plan(tree, donate=donate)
    assert not any(x.is_deleted() for x in jax.tree.leaves(donate))
    out = plan(tree, donate=out)  # its own results: their own buffers
    assert_exact(out["b"]["c"], np.asarray(src["a"]), sharding(*DST))


def test_a_mesh_of_the_same_text_in_another_device_order_names_both_orders(src):
    """Two meshes that print alike but order their devices differently lay an array out
    differently: the refusal shows each one's device order (it showed the same text twice)."""
    plan = jr.plan(src, dst_tree())
    reordered = dict(src, a=jax.device_put(np.asarray(src["a"]), sharding((0, 2, 1, 3), *SRC[1:])))
    assert str(reordered["a"].sharding) == str(src["a"].sharding)
    with pytest.raises(
        jr.ReshardError, match=r"on devices \[0, 1, 2, 3\], got .* on devices \[0, 2, 1, 3\]"
    ):
        plan(reordered)


def test_a_leaf_where_the_plans_tree_has_a_subtree_is_named(src):
    plan = jr.plan(src, dst_tree())
    out = plan(src)
    with pytest.raises(jr.ReshardError, match=r"<root>: a leaf \(int\) here, .* 2 leaves below"):
        plan(src, donate=3)
    assert not out["a"].is_deleted()


def test_a_destination_dict_beside_an_ordered_dict_of_another_order_is_taken_by_path(src):
    """The same paths in another order (an OrderedDict source, a dict of shardings): each
    destination entry stands for the leaf at its own path."""
    ordered = collections.OrderedDict([("b", src["b"]), ("a", src["a"])])
    dst = {"a": sharding(*DST), "b": {"c": sharding(DST[0], DST[1], DST[2], "tp", None)}}
    out = jr.plan(ordered, dst)(ordered)
    assert_exact(out["a"], np.asarray(src["a"]), dst["a"])
    assert_exact(out["b"]["c"], np.asarray(src["b"]["c"]), dst["b"]["c"])


def test_a_plans_name_gives_the_first_moved_leafs_path_beside_its_layouts(src):
    """Under ``jax.distributed`` the order check and a refused call name a plan by its label:
    leaf count, first and last path, then the first moved leaf's layouts behind that leaf's
    path. A fallback leaf first in the tree (a host step counter sent by ``jax.device_put``)
    is not that leaf: the path beside the layouts is ``['b']['c']``, the float32[8, 4] leaf's.
    Mutation check: the first leaf's path (``['a']``, an int32 scalar) was printed beside the
    moved leaf's layouts."""
    tree = {"a": np.int32(3), "b": src["b"]}
    dst = {"a": sharding(*DST[:3]), "b": {"c": sharding(*DST)}}  # the scalar replicated
    label = jr.plan(tree, dst, fallback="device_put")._label
    assert label.startswith("the plan of 2 leaves ['a'] ... ['b']['c'] (['b']['c']: float32[8, 4] ")
    assert "['a']: " not in label


def test_a_boolean_bucket_bytes_is_refused():
    """``True`` is an int to Python, not a number of bytes."""
    src = jax.device_put(random_array((16, 8), "float32"), sharding(*SRC))
    for flag in (True, np.bool_(True)):
        with pytest.raises(jr.ReshardError, match="bucket_bytes") as e:
            jr.plan(src, sharding(*DST), bucket_bytes=flag)
        assert "How to fix" in str(e.value)


def test_buckets_too_small_for_their_bytes_are_warned_of_once_and_still_planned(caplog):
    """A ``bucket_bytes`` far below the leaves' bytes makes a plan of thousands of buckets,
    each a few host dispatches and a collective's latency: planned (it is valid) but logged as
    a warning naming the bucket count and the fix. The same bytes in a few buckets, and a
    small bucket that makes few buckets, are not warned of."""
    src = jax.device_put(random_array((1024, 256), "float32"), sharding(*SRC))
    with caplog.at_level(logging.WARNING, logger="jaxreshard"):
        plan = jr.plan(src, sharding(*DST), bucket_bytes=256)
    assert plan.stats.buckets >= 1024
    warned = [r.getMessage() for r in caplog.records if "bucket_bytes=256" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert f"makes {plan.stats.buckets} buckets" in warned[0] and "How to fix" in warned[0]
    caplog.clear()
    small = jax.device_put(random_array((16, 8), "float32"), sharding(*SRC))
    with caplog.at_level(logging.WARNING, logger="jaxreshard"):
        jr.plan(src, sharding(*DST), bucket_bytes=4 << 20)
        jr.plan(small, sharding(*DST), bucket_bytes=64)
    assert "bucket_bytes" not in caplog.text


def test_a_unit_buckets_that_is_not_a_positive_count_is_refused():
    """``unit_buckets`` counts buckets: a positive int, not a bool, a float or text; refused
    by `jr.plan`, `jr.reshard` and `jr.cached_plan` alike, naming the option and the fix."""
    src = jax.device_put(random_array((16, 8), "float32"), sharding(*SRC))
    for bad in (0, -1, True, 1.5, "32", 1 << 21):
        for call in (jr.plan, jr.reshard, jr.cached_plan):
            with pytest.raises(jr.ReshardError, match="unit_buckets") as e:
                call(src, sharding(*DST), unit_buckets=bad)
            assert "How to fix" in str(e.value)


def test_bad_leaves_found_by_different_checks_are_named_in_one_error():
    """Regression (an adversarial probe): where bad leaves fell to different checks, the
    error named only the first check's, and the caller met the others one fix at a time: an
    fp8 leaf and a plain one, a source and a donate= leaf, a source and a result leaf, an
    fp8 format a destination cuts and a destination that does not fit. Nothing moves, the
    donate= tree survives."""
    x = jax.device_put(random_array((8, 16), "float32"), sharding(*SRC))
    dst = {"a": sharding(*DST), "b": sharding(*DST)}

    def names_both(call):
        with pytest.raises(jr.ReshardError) as e:
            call()
        assert "['a']" in str(e.value) and "['b']" in str(e.value), str(e.value)

    plain = jr.plan({"a": x, "b": x}, dst)
    fp8 = jr.plan({"a": x, "b": x}, dst, dtype={"a": jr.Fp8Blockwise(block=(4, 4)), "b": None})
    wrong = {"a": x.astype(jnp.bfloat16), "b": x.astype(jnp.int32)}
    names_both(lambda: fp8(wrong))  # a: fp8 leaf, b: plain leaf
    out = plain({"a": x, "b": x})
    bad_donate = {"a": out["a"], "b": out["b"].astype(jnp.int32)}
    names_both(lambda: plain({"a": wrong["a"], "b": x}, donate=bad_donate))
    assert not any(v.is_deleted() for v in (*out.values(), *bad_donate.values()))
    names_both(lambda: plain.verify({"a": wrong["b"], "b": x}, bad_donate))
    three = sharding((4, 5, 6), (3,), ("t",), "t")  # splits 8 rows 3 ways
    cut = sharding((4, 5, 6, 7), (4,), ("t",), "t")  # cuts blocks of 8 rows
    names_both(
        lambda: jr.plan(
            {"a": x, "b": x}, {"a": three, "b": cut}, dtype={"a": None, "b": jr.Fp8Blockwise()}
        )
    )
