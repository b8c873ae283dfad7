"""Tunix's GRPO learner with every weight sync through jaxreshard (examples/tunix_grpo.py).

A few GRPO steps of a tiny Tunix Llama3 on 8 simulated CPU devices, with
``jaxreshard.integrations.tunix`` installed: no leaf falls back to Tunix's own path, the rollout
weights come out bit-identical to the trainer's, a warm sync compiles nothing, and the syncs run
under the transfer guards that Tunix's ``sync_weights`` sets on CPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("tunix")
pytest.importorskip("qwix")

from jax._src import config as jax_config
from jax._src import monitoring as jax_monitoring

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tunix_grpo.py"
STEPS = 2


@pytest.fixture(scope="module")
def example():
    """The example script imported as a module."""
    spec = importlib.util.spec_from_file_location("tunix_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@contextlib.contextmanager
def keeping_monitoring_listeners():
    """Tunix's ``RLCluster.close()`` (the end of ``learner.train``) clears every `jax.monitoring`
    listener, other test modules' compile counters too: put back the ones it removed."""
    kinds = {
        "_event_listeners": jax.monitoring.register_event_listener,
        "_event_duration_secs_listeners": jax.monitoring.register_event_duration_secs_listener,
        "_event_time_span_listeners": jax.monitoring.register_event_time_span_listener,
    }
    saved = {name: list(getattr(jax_monitoring, name)) for name in kinds}
    try:
        yield
    finally:
        for name, register in kinds.items():
            for listener in saved[name]:
                if listener not in getattr(jax_monitoring, name):
                    register(listener)


RUNS = [
    pytest.param((), id="disjoint"),
    pytest.param(("--lora",), id="lora"),
    pytest.param(("--colocated",), id="colocated", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=RUNS)
def trained(example, request):
    """(args, cluster, [(seconds, compilations)] of each reshard_pytree call, counters) after
    STEPS GRPO steps with the adapter installed (``fallback=None``: a leaf jaxreshard cannot
    take raises instead of going to ``jax.device_put``)."""
    args = example.parse_args(["--steps", str(STEPS), *request.param])
    example.jr_tunix.reset_counters()
    with keeping_monitoring_listeners():
        cluster, calls = example.train(args)
    return args, cluster, calls, example.jr_tunix.counters()


def test_every_sync_goes_through_jaxreshard(example, trained):
    """One call loads the rollout model, then one sync per step; none falls back."""
    _, cluster, calls, counters = trained
    assert len(calls) == 1 + STEPS
    assert counters["fallback_calls"] == 0 and counters["fallback_leaves"] == 0, counters
    assert counters["jaxreshard_calls"] == counters["calls"] == 1 + STEPS, counters
    # A real reshard: the rollout lives on other devices or in another layout.
    src, dst = (jax.tree.leaves(s) for s in example.synced_states(cluster))
    assert any(a.sharding != b.sharding for a, b in zip(src, dst, strict=True))


def test_rollout_weights_are_bit_identical_to_the_trained_ones(example, trained):
    args, cluster, _, _ = trained
    src, dst = example.synced_states(cluster)
    example.assert_bit_identical(src, dst)
    # ... and training moved them: the check is not between two copies of the initial weights.
    initial_model = example.make_actor(example.meshes(args.colocated)[0], args.lora, args.seed)
    initial = nnx.state(initial_model, example.sync_filter(initial_model))
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(example.host_leaves(initial), example.host_leaves(src), strict=True)
    ]
    assert any(changed)


def test_warm_sync_compiles_nothing_under_tunix_transfer_guards(example, trained):
    """``sync_weights`` sets ``transfer_guard_{host_to_device,device_to_host}
    ("disallow_explicit")`` on CPU; under them a warm sync compiles nothing and is exact."""
    _, cluster, _, _ = trained
    guards = []
    inner = example.jr_tunix.reshard_pytree

    def seeing_guards(source, target, **kw):
        guards.append(
            (
                jax_config.transfer_guard_host_to_device.value,
                jax_config.transfer_guard_device_to_host.value,
            )
        )
        return inner(source, target, **kw)

    with example.jr_tunix.installed(fallback=None), example.reshard_with(seeing_guards):
        cluster.sync_weights()  # warm (the training syncs are warm already)
        with example.counting_compiles() as compiles:
            cluster.sync_weights()
            jax.block_until_ready(jax.tree.leaves(example.synced_states(cluster)[1]))
    assert compiles[0] == 0
    assert guards == [("disallow_explicit", "disallow_explicit")] * 2
    example.assert_bit_identical(*example.synced_states(cluster))


def test_first_sync_reuses_the_plan_of_the_rollout_load(trained):
    """Full-weight sync moves the tree the rollout load moved: the trained params' specs
    (``P('fsdp', 'tp')``) and the initial ones (``P('fsdp', 'tp', None)``) are one layout, and
    the plan cache treats them as one. (With LoRA the syncs move only the LoRA leaves, another
    tree: the first sync plans it, the next ones reuse it.)"""
    args, _, calls, _ = trained
    compiles = [c for _, c in calls]
    if not args.lora:
        assert compiles[1] == 0, compiles
    assert compiles[2:] == [0] * (len(compiles) - 2), compiles
