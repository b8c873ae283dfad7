"""The Tunix adapter: one patched function, Tunix's signature, Tunix's results.

The oracle is Tunix's own ``reshard_pytree`` (``jax.device_put`` off Pathways), run on the same
inputs; the GRPO run through the adapter is in ``test_tunix.py``.
"""

from __future__ import annotations

import collections
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import random_array, sharding

tunix_reshard = pytest.importorskip("tunix.rl.reshard")
nnx = pytest.importorskip("flax.nnx")

from jaxreshard.integrations import tunix as jr_tunix  # noqa: E402

TRAINER = (tuple(range(4)), (2, 2), ("fsdp", "tp"))
ROLLOUT = (tuple(range(4, 8)), (4,), ("tp",))


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.down = nnx.Linear(64, 16, rngs=rngs)


def states() -> tuple[nnx.State, nnx.State]:
    """The same model's parameters on a trainer layout and on a rollout layout."""
    trainer = jax.device_put(nnx.state(Mlp(nnx.Rngs(0)), nnx.Param), sharding(*TRAINER, "fsdp"))
    rollout = nnx.state(Mlp(nnx.Rngs(1)), nnx.Param)  # last dimension split (kernels, biases)
    rollout = jax.tree.map(
        lambda x: jax.device_put(x, sharding(*ROLLOUT, *[None] * (x.ndim - 1), "tp")), rollout
    )
    return trainer, rollout


def bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.fixture(autouse=True)
def clean():
    jr_tunix.uninstall()
    jr_tunix.reset_counters()
    yield
    jr_tunix.uninstall()


def test_importing_jaxreshard_and_the_adapter_imports_no_tunix():
    code = (
        "import sys, jaxreshard, jaxreshard.integrations.tunix\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'tunix'], 'tunix imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_install_patches_the_one_function_and_uninstall_restores_it():
    original = tunix_reshard.reshard_pytree
    jr_tunix.install()
    assert tunix_reshard.reshard_pytree is jr_tunix.reshard_pytree and jr_tunix.is_installed()
    jr_tunix.install()  # twice: still restorable to Tunix's own
    jr_tunix.uninstall()
    assert tunix_reshard.reshard_pytree is original and not jr_tunix.is_installed()
    with jr_tunix.installed():
        assert tunix_reshard.reshard_pytree is jr_tunix.reshard_pytree
    assert tunix_reshard.reshard_pytree is original


@pytest.mark.parametrize("target_kind", ["arrays", "shardings"])
def test_results_are_tunix_own_results_bit_for_bit(target_kind):
    trainer, rollout = states()
    target = rollout if target_kind == "arrays" else jax.tree.map(lambda x: x.sharding, rollout)
    want = tunix_reshard.reshard_pytree(trainer, target)  # Tunix's own path
    with jr_tunix.installed():
        got = tunix_reshard.reshard_pytree(trainer, target)  # looked up as Tunix does
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert bits(got) == bits(want) == bits(trainer)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim) and x.dtype == y.dtype
    assert jr_tunix.counters() == {
        "calls": 1,
        "jaxreshard_calls": 1,
        "fallback_calls": 0,
        "fallback_leaves": 0,
    }


def test_under_tunix_cpu_transfer_guards_first_call_included():
    trainer, rollout = states()
    with (
        jr_tunix.installed(),
        jax.transfer_guard_host_to_device("disallow_explicit"),
        jax.transfer_guard_device_to_host("disallow_explicit"),
    ):
        for _ in range(2):
            out = tunix_reshard.reshard_pytree(trainer, rollout, cache_plan=False)
            out = tunix_reshard.reshard_pytree(trainer, rollout)
        jax.block_until_ready(out)
    assert bits(out) == bits(trainer)


def test_donate_input_consumes_the_source_as_device_put_does():
    trainer, rollout = states()
    want = bits(trainer)
    out = jr_tunix.reshard_pytree(trainer, rollout, donate_input=True)
    assert all(x.is_deleted() for x in jax.tree.leaves(trainer))
    assert bits(out) == want


def test_donate_target_reuses_the_rollout_buffers():
    trainer, rollout = states()
    jr_tunix.install(donate_target=True)
    out = tunix_reshard.reshard_pytree(trainer, rollout)
    assert all(x.is_deleted() for x in jax.tree.leaves(rollout))
    assert bits(out) == bits(trainer)
    # a target that cannot receive the result (another dtype) is left alone
    other = jax.tree.map(lambda x: x.astype(jnp.bfloat16), out)
    again = tunix_reshard.reshard_pytree(trainer, other)
    assert not any(x.is_deleted() for x in jax.tree.leaves(other))
    assert bits(again) == bits(trainer)


def test_donate_target_reuses_the_rollout_buffers_beside_none_target_leaves():
    """With ``donate_target``, a target holding None somewhere still gives its arrays'
    buffers to the leaves that move; the kept leaves are the source's own. Regression: a None
    target leaf turned the reuse off for the whole call."""
    trainer, rollout = states()
    jr_tunix.install(donate_target=True)
    source = {"up": trainer["up"], "down": trainer["down"]}
    out = tunix_reshard.reshard_pytree(source, {"up": rollout["up"], "down": None})
    assert all(x.is_deleted() for x in jax.tree.leaves(rollout["up"]))
    assert not any(x.is_deleted() for x in jax.tree.leaves(rollout["down"]))
    kept = zip(jax.tree.leaves(out["down"]), jax.tree.leaves(source["down"]), strict=True)
    assert all(o is s for o, s in kept)
    assert bits(out) == bits(source)


def test_leaves_jaxreshard_cannot_take_go_through_device_put_and_are_counted():
    trainer, rollout = states()
    source = {"params": trainer, "step": np.int32(3)}
    target = {"params": rollout, "step": sharding(*ROLLOUT)}
    with jr_tunix.installed():
        out = tunix_reshard.reshard_pytree(source, target)
    assert int(out["step"]) == 3 and bits(out["params"]) == bits(trainer)
    assert jr_tunix.counters()["fallback_leaves"] == 1
    with (
        jr_tunix.installed(fallback=None),
        pytest.raises(jr_tunix.ReshardTypeError, match=r"\['step'\]"),
    ):
        tunix_reshard.reshard_pytree(source, target)


def test_a_target_leaf_without_a_sharding_is_named():
    trainer, _ = states()
    target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), trainer)
    with pytest.raises(
        jr_tunix.ReshardTypeError,
        match=r"target leaves(.|\n)*\[.up.\]\[.kernel.\].*ndarray, with no sharding",
    ):
        jr_tunix.reshard_pytree(trainer, target)


def test_a_target_with_other_keys_is_refused_even_with_as_many_leaves():
    """Regression: the target's shardings were laid onto the source by position whenever the
    leaf counts agreed, so ``{a, b}`` onto ``{b, c}`` gave ``a`` the sharding of ``b``."""
    trainer, rollout = states()
    src = {"a": trainer["up"]["kernel"], "b": trainer["down"]["kernel"]}
    target = {"b": rollout["up"]["kernel"], "c": rollout["down"]["kernel"]}
    with pytest.raises(jr_tunix.ReshardError, match=r"keys are not the source's(.|\n)*\['a'\]"):
        jr_tunix.reshard_pytree(src, target)


@pytest.mark.parametrize(
    "shape",
    ["one leaf under one sharding", "a subtree under a sharding", "two one-leaf subtrees"],
)
def test_a_prefix_target_moves_as_tunix_moves_it_whatever_the_leaf_count(shape):
    """Regression: a target with as many leaves as the source was taken leaf for leaf, so a
    prefix of the source with as many shardings as it has leaves (``{a: x}`` onto one
    sharding) was refused for its keys, though ``jax.device_put`` (Tunix's path) takes it."""
    trainer, rollout = states()
    x, y = trainer["up"]["kernel"], trainer["down"]["kernel"]
    to = rollout["up"]["kernel"].sharding
    source, target = {
        "one leaf under one sharding": ({"a": x}, to),
        "a subtree under a sharding": ({"a": {"w": x}}, {"a": to}),
        "two one-leaf subtrees": ({"a": {"w": x}, "b": {"v": y}}, {"a": to, "b": to}),
    }[shape]
    want = tunix_reshard.reshard_pytree(source, target)
    got = jr_tunix.reshard_pytree(source, target)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert bits(got) == bits(want) == bits(source)
    assert all(leaf.sharding == to for leaf in jax.tree.leaves(got))


@pytest.mark.parametrize("kept", ["a leaf", "a subtree", "everything"])
def test_a_none_target_leaves_its_source_where_it_is_as_tunix_does(kept):
    """Tunix's path (``jax.device_put``) returns the source's own array wherever the target
    holds None (Tunix's MaxText LoRA set-up builds such targets, for leaves without a
    partition spec). Regression: the adapter refused them."""
    trainer, rollout = states()
    x, b, y = trainer["up"]["kernel"], trainer["up"]["bias"], trainer["down"]["kernel"]
    to = rollout["up"]["kernel"].sharding
    source = {"a": x, "b": {"w": b, "v": y}}
    target = {
        "a leaf": {"a": to, "b": {"w": None, "v": to}},
        "a subtree": {"a": to, "b": None},
        "everything": None,
    }[kept]
    want = tunix_reshard.reshard_pytree(source, target)
    got = jr_tunix.reshard_pytree(source, target)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    leaves = zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(source), strict=True)
    for g, w, s in leaves:
        assert (g is s) == (w is s)  # left in place exactly where Tunix leaves it
        assert g.sharding == w.sharding
    assert bits(got) == bits(source)


def test_host_leaves_under_a_none_target_become_arrays_as_tunix_makes_them():
    """Regression (a probe): under a None target a NumPy array or Python scalar came back as
    it was, where Tunix's path (``jax.device_put(x, None)``) makes a ``jax.Array`` of it, and
    ``install(fallback=None)`` let it through uncounted. They are fallback leaves, as where
    a target moves: arrays through ``jax.device_put``, counted, or refused by name."""
    trainer, rollout = states()
    source = {"w": trainer["up"]["kernel"], "step": np.int32(7), "scale": 0.5}
    target = {"w": rollout["up"]["kernel"].sharding, "step": None, "scale": None}
    want = tunix_reshard.reshard_pytree(source, target)
    with jr_tunix.installed():
        got = tunix_reshard.reshard_pytree(source, target)
    for name in ("step", "scale"):
        assert isinstance(got[name], jax.Array)
        assert got[name].dtype == want[name].dtype and got[name].sharding == want[name].sharding
        assert np.asarray(got[name]).tobytes() == np.asarray(want[name]).tobytes()
    assert jr_tunix.counters()["fallback_leaves"] == 2
    with (
        jr_tunix.installed(fallback=None),
        pytest.raises(jr_tunix.ReshardTypeError, match=r"\['scale'\]: is a float\n.*\['step'\]"),
    ):
        tunix_reshard.reshard_pytree(source, target)


def test_a_leaf_under_a_none_target_device_put_cannot_take_is_refused_before_anything_moves():
    """A string (or an object, an array of strings, a big-endian array) under a None target:
    Tunix's path fails on it with JAX's TypeError. Regression (a fuzz, 2026-12-06): the adapter
    moved the other leaves first, consuming the donated target, then let the TypeError
    escape; it is refused by name before anything moves, and the target survives."""
    trainer, rollout = states()
    with pytest.raises(TypeError):
        tunix_reshard.reshard_pytree({"name": "llama"}, {"name": None})
    source = {"w": trainer["up"]["kernel"], "name": "llama", "be": np.arange(4, dtype=">f4")}
    target = {"w": rollout["up"]["kernel"], "name": None, "be": None}
    with (
        jr_tunix.installed(donate_target=True),
        pytest.raises(jr_tunix.ReshardTypeError) as e,
    ):
        tunix_reshard.reshard_pytree(source, target)
    assert "['be']: dtype >f4 is not in this machine's byte order" in str(e.value)
    assert "['name']: a str is not an array or a number" in str(e.value)
    assert not target["w"].is_deleted() and not source["w"].is_deleted()
    assert jr_tunix.counters()["jaxreshard_calls"] == 0


def test_a_host_leaf_under_a_none_target_the_transfer_guard_refuses_is_named_before_the_move():
    """Under the transfer guard Tunix's ``sync_weights`` sets on CPU (explicit host-to-device
    transfers disallowed), a NumPy leaf under a None target cannot become an array. Regression
    (a review): the adapter made it after moving the other leaves, so JAX's error came after
    the donated target was consumed; it is refused by name before anything moves."""
    trainer, rollout = states()
    source = {"w": trainer["up"]["kernel"], "step": np.int32(7)}
    target = {"w": rollout["up"]["kernel"], "step": None}
    with (
        jr_tunix.installed(donate_target=True),
        jax.transfer_guard_host_to_device("disallow_explicit"),
        pytest.raises(jr_tunix.ReshardError, match=r"\['step'\]") as e,
    ):
        tunix_reshard.reshard_pytree(source, target, donate_input=True)
    assert "How to fix" in str(e.value)
    assert not target["w"].is_deleted() and not source["w"].is_deleted()
    assert jr_tunix.counters()["jaxreshard_calls"] == 0
    with jr_tunix.installed(donate_target=True):  # the guard lifted, the same sync moves
        got = tunix_reshard.reshard_pytree(source, target)
    assert int(got["step"]) == 7 and bits(got["w"]) == bits(source["w"])


def test_a_target_that_fits_the_source_neither_way_is_refused_by_jaxreshard():
    """A target neither a prefix of the source nor laid out leaf for leaf like it is refused
    with jaxreshard's error naming the structures. Regression: taking the None target leaves
    out first raised JAX's bare pytree ValueError instead."""
    trainer, rollout = states()
    to = rollout["up"]["kernel"].sharding
    source = {"a": trainer["up"]["kernel"], "b": {"p": trainer["up"]["bias"]}}
    target = {"a": to, "b": {"p": to, "r": to, "t": None}}
    with pytest.raises(jr_tunix.ReshardError, match="does not match the structure"):
        jr_tunix.reshard_pytree(source, target)


class Node:
    """A pytree node with metadata: two models' states of it are not prefixes of each other
    (their metadata differ), only leaf for leaf alike."""

    def __init__(self, children: dict, meta: str) -> None:
        self.children, self.meta = children, meta


jax.tree_util.register_pytree_with_keys(
    Node,
    lambda n: (
        [(jax.tree_util.DictKey(k), v) for k, v in sorted(n.children.items())],
        (tuple(sorted(n.children)), n.meta),
    ),
    lambda aux, children: Node(dict(zip(aux[0], children, strict=True)), aux[1]),
)


def test_a_none_in_both_models_states_stays_none_leaf_for_leaf():
    """Source and target from two models (node metadata differ: laid leaf for leaf), both
    holding None at the same place (a layer without a bias), and the target None where the
    source has an array (kept there): the Nones are kept and the rest moves. Regression:
    the target's None counted as a leaf and the source's did not, so the counts differed
    and the call failed with JAX's bare pytree error."""
    trainer, rollout = states()
    (x,) = jax.tree.leaves(trainer["up"]["kernel"])  # the array (a state holds Variables)
    (y,) = jax.tree.leaves(trainer["down"]["kernel"])
    to = rollout["up"]["kernel"].sharding
    got = jr_tunix.reshard_pytree(  # "k": a None target leaf, kept where it is
        Node({"w": x, "bias": None, "k": y}, "trainer"),
        Node({"w": to, "bias": None, "k": None}, "sampler"),
    )
    assert got.children["bias"] is None and got.children["k"] is y and got.meta == "trainer"
    assert got.children["w"].sharding == to
    assert bits(got.children["w"]) == bits(x)


def test_donate_input_keeps_what_a_none_target_leaves_in_place():
    """The leaves a None target keeps are the result's own: only the moved ones are
    consumed."""
    trainer, rollout = states()
    x, b = trainer["down"]["kernel"], trainer["down"]["bias"]
    want = bits({"a": x, "b": b})
    out = jr_tunix.reshard_pytree(
        {"a": x, "b": b}, {"a": rollout["down"]["kernel"].sharding, "b": None}, donate_input=True
    )
    assert x.is_deleted() and not b.is_deleted() and out["b"] is b
    assert bits(out) == want


def test_shape_dtype_struct_targets_give_their_shardings():
    """Tunix takes any target leaf with a sharding; a ShapeDtypeStruct without one is named."""
    trainer, rollout = states()
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), rollout
    )
    out = jr_tunix.reshard_pytree(trainer, target)
    assert bits(out) == bits(trainer)
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(rollout), strict=True):
        assert x.sharding == y.sharding
    bare = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rollout)
    with pytest.raises(jr_tunix.ReshardTypeError, match=r"ShapeDtypeStruct, with no sharding"):
        jr_tunix.reshard_pytree(trainer, bare)


def test_a_sync_refused_before_its_plan_is_placed_among_the_plans_calls(monkeypatch):
    """Under jax.distributed a sync refused before any plan is called (a target leaf with no
    sharding) must take a call's place in the order of calls, or the peers' same sync pairs
    with this process's next one (`jaxreshard.api.refuse_unplanned`, a no-op in one
    process: the multi-process tests run it); a sync refused inside the plan's call is
    placed by the call itself, not twice."""
    placed = []
    monkeypatch.setattr(
        jr_tunix.api,
        "refuse_unplanned",
        lambda source, target, error: placed.append(type(error)),
    )
    trainer, rollout = states()
    bare = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rollout)
    with pytest.raises(jr_tunix.ReshardTypeError):
        jr_tunix.reshard_pytree(trainer, bare)
    assert placed == [jr_tunix.ReshardTypeError]
    jr_tunix.reshard_pytree(trainer, rollout)  # planned
    gone = jax.tree.map(lambda x: x, trainer)
    jax.tree.leaves(gone)[0].delete()
    with pytest.raises(jr_tunix.ReshardError, match="deleted"):
        jr_tunix.reshard_pytree(gone, rollout)
    assert placed == [jr_tunix.ReshardTypeError]


def test_a_one_device_rollout_and_host_offload_targets():
    trainer, _ = states()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[7])
    out = jr_tunix.reshard_pytree(trainer, jax.tree.map(lambda _: one, trainer))
    assert all(x.sharding == one for x in jax.tree.leaves(out))
    offload = sharding(*TRAINER, "fsdp").with_memory_kind("pinned_host")  # Tunix's anchor copy
    host = jr_tunix.reshard_pytree(trainer, jax.tree.map(lambda _: offload, trainer))
    assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(host))
    assert bits(out) == bits(host) == bits(trainer)


def test_random_values_of_every_dtype_tunix_states_hold():
    src = {
        k: jax.device_put(random_array((8, 16), k, seed=i), sharding(*TRAINER, "fsdp", "tp"))
        for i, k in enumerate(["float32", "bfloat16", "int32", "bool"])
    }
    target = jax.tree.map(lambda _: sharding(*ROLLOUT, "tp"), src)
    want = tunix_reshard.reshard_pytree(src, target)
    assert bits(jr_tunix.reshard_pytree(src, target)) == bits(want)


def test_installed_puts_back_the_options_in_force_before_the_block():
    """Regression (a probe): inside an installed adapter, ``installed(donate_target=True)`` left
    its options behind, so every later sync deleted the caller's targets (and an
    ``install(fallback=None)`` became a silent fallback after a plain ``installed()``)."""
    jr_tunix.install(fallback=None)
    with jr_tunix.installed(donate_target=True):
        assert jr_tunix._DONATE_TARGET and jr_tunix._FALLBACK == "device_put"
    assert (jr_tunix._DONATE_TARGET, jr_tunix._FALLBACK) == (False, None)
    trainer, rollout = states()
    tunix_reshard.reshard_pytree(trainer, rollout)
    assert not any(x.is_deleted() for x in jax.tree.leaves(rollout))


def test_one_array_kept_and_moved_is_never_deleted_from_the_result():
    """Regression (a probe): one array at a kept path (None target) and at a moving one, with
    ``donate_input=True``: the result's kept leaf was deleted (Tunix's own path raises).
    And with ``install(donate_target=True)``, a target array that is a kept source array was
    donated, deleting the result's kept leaf. Both now leave it alive, values exact."""
    trainer, rollout = states()
    w = trainer["down"]["kernel"]
    want = np.asarray(w).tobytes()
    out = jr_tunix.reshard_pytree(
        {"a": w, "b": w}, {"a": None, "b": rollout["down"]["kernel"]}, donate_input=True
    )
    assert not out["a"].is_deleted() and out["a"] is w
    assert np.asarray(out["b"]).tobytes() == want
    (w1,) = jax.tree.leaves(trainer["up"]["kernel"])  # plain arrays of one shape, so that
    w2 = jax.device_put(np.asarray(w1) + 1, w1.sharding)  # w1 could receive w2's result
    jr_tunix.install(donate_target=True)
    out = tunix_reshard.reshard_pytree({"a": w1, "b": w2}, {"a": None, "b": w1})
    assert not out["a"].is_deleted() and out["a"] is w1
    assert np.asarray(out["b"]).tobytes() == np.asarray(w2).tobytes()


def test_a_target_of_the_same_keys_in_another_order_is_taken_by_key():
    """An OrderedDict source beside a dict target of the same keys (another order): each
    target entry stands for the source leaf of its key (it was refused as other keys)."""
    trainer, rollout = states()
    source = collections.OrderedDict([("b", trainer["down"]), ("a", trainer["up"])])
    target = {"a": rollout["up"], "b": rollout["down"]}
    out = jr_tunix.reshard_pytree(source, target)
    for k in ("a", "b"):
        for leaf in ("kernel", "bias"):
            assert out[k][leaf].sharding == target[k][leaf].sharding
            assert np.asarray(out[k][leaf]).tobytes() == np.asarray(source[k][leaf]).tobytes()


def test_counters_count_refused_calls_and_only_calls_jaxreshard_moved():
    """``calls`` counts every call (refused ones too); ``jaxreshard_calls`` only those where
    jaxreshard moved a leaf (not a call whose every leaf fell back)."""
    jr_tunix.install()
    tunix_reshard.reshard_pytree({"n": np.ones(4, np.float32)}, {"n": sharding(*ROLLOUT)})
    assert jr_tunix.counters()["calls"] == 1 and jr_tunix.counters()["jaxreshard_calls"] == 0
    jr_tunix.install(fallback=None)
    with pytest.raises(jr_tunix.ReshardError):
        tunix_reshard.reshard_pytree({"n": np.ones(4, np.float32)}, {"n": sharding(*ROLLOUT)})
    assert jr_tunix.counters()["calls"] == 2


def test_installed_over_no_adapter_puts_back_the_options_a_direct_call_takes():
    """Regression (a probe): ``installed(fallback=None)`` entered with no adapter installed
    left ``fallback=None`` behind it, so a later direct call of ``reshard_pytree`` refused
    the NumPy leaf it had sent through ``jax.device_put`` before the block."""
    jr_tunix.install()  # the default options, then no adapter
    jr_tunix.uninstall()
    with jr_tunix.installed(fallback=None, donate_target=True):
        assert jr_tunix.is_installed()
    assert not jr_tunix.is_installed()
    host = np.arange(8, dtype=np.float32)
    out = jr_tunix.reshard_pytree({"w": host}, {"w": sharding(*ROLLOUT)})
    np.testing.assert_array_equal(np.asarray(out["w"]), host)


@pytest.mark.parametrize(
    ("options", "says"),
    [({"fallback": "device-put"}, "fallback must be"), ({"donate_target": "yes"}, "True or False")],
)
def test_bad_options_are_refused_by_install_not_at_the_first_sync(options, says):
    for install in (jr_tunix.install, lambda **o: jr_tunix.installed(**o).__enter__()):
        with pytest.raises(jr_tunix.ReshardError, match=says) as e:
            install(**options)
        assert "How to fix" in str(e.value)
        assert not jr_tunix.is_installed()
