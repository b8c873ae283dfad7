"""Multi-controller jaxreshard: fingerprints, agreement, process topology, real multi-process runs.

The `multiprocess` tests launch local ``jax.distributed`` processes (127.0.0.1, CPU devices, gloo
collectives) running tests/multihost_worker.py; each process checks its own destination shards
against NumPy. One launch serves several cases, and each launch is bounded by a timeout.
The other tests are pure (fingerprints, sender preference) or drive the agreement protocol with
threads over an in-memory key-value store.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from launch import run_local

import jaxreshard as jr
from jaxreshard.planning.layout import Layout
from jaxreshard.planning.route import LeafSpec, route
from jaxreshard.planning.topology import Topology
from jaxreshard.run import multihost

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multihost_worker.py"
LAUNCH_TIMEOUT_S = 300  # generous: the machine running the tests may be loaded
FAIL_GRACE_S = 30  # how long the others may take to exit once one process has failed


# ------------------------------------------------------------------------------ fingerprints


def _leaves(order: tuple[int, ...] = (0, 1, 2, 3), dst_spec=("x",)) -> list[LeafSpec]:
    src = Layout.from_mesh((16, 8), (2, 2), ("a", "b"), [10, 11, 12, 13], ("a", "b"))
    dst = Layout.from_mesh((16, 8), (4,), ("x",), [20 + i for i in order], dst_spec)
    return [LeafSpec("['w']", src, dst, "float32", "bfloat16", 2)]


def _fingerprint(leaves: list[LeafSpec], bucket_bytes: int = 1 << 20) -> str:
    from jaxreshard.planning.schedule import build_schedule

    assignment = route(leaves, Topology.from_groups([range(10, 14), range(20, 24)]))
    schedule = build_schedule(leaves, assignment.pieces, bucket_bytes=bucket_bytes)
    return multihost.fingerprint(leaves, assignment, schedule, bucket_bytes)


def test_fingerprint_is_the_same_for_the_same_plan_and_differs_for_any_change():
    base = _fingerprint(_leaves())
    assert base == _fingerprint(_leaves())
    assert base != _fingerprint(_leaves(order=(3, 2, 1, 0)))  # another device order
    assert base != _fingerprint(_leaves(dst_spec=(None, "x")))  # another spec
    assert base != _fingerprint(_leaves(), bucket_bytes=1 << 10)  # another option
    other_dtype = [dataclasses.replace(_leaves()[0], dst_dtype="float32", itemsize=4)]
    assert base != _fingerprint(other_dtype)


def test_fingerprint_covers_the_routing_and_the_schedule():
    """Plans of the same leaves and options that differ only in who sends what (another
    topology, or one piece from another replica), or only in the schedule, get different
    fingerprints: processes that would issue different transfers must not agree."""
    from jaxreshard.planning.schedule import build_schedule

    # Replicated on 10 and 20: one domain balances over both, two domains read from 20 only.
    src = Layout.from_mesh((16, 8), (2,), ("dp",), [10, 20], ())
    dst = Layout.from_mesh((16, 8), (2,), ("x",), [21, 22], ("x",))
    leaves = [LeafSpec("['w']", src, dst, "float32", "float32", 4)]
    flat = route(leaves, Topology.from_groups([[10, 20, 21, 22]]), fan_out=False)
    split = route(leaves, Topology.from_groups([[10], [20, 21, 22]]), fan_out=False)
    assert {p.src for p in flat.pieces} == {10, 20} and {p.src for p in split.pieces} == {20}
    schedule = build_schedule(leaves, flat.pieces, bucket_bytes=1 << 20)
    base = multihost.fingerprint(leaves, flat, schedule, 1 << 20)
    assert base == multihost.fingerprint(leaves, flat, schedule, 1 << 20)
    assert base != multihost.fingerprint(leaves, split, schedule, 1 << 20)
    first, *rest = flat.pieces
    other = 20 if first.src == 10 else 10  # the same bytes from the other replica
    moved = dataclasses.replace(flat, sent=(dataclasses.replace(first, src=other), *rest))
    assert base != multihost.fingerprint(leaves, moved, schedule, 1 << 20)
    small = build_schedule(leaves, flat.pieces, bucket_bytes=64)
    assert small != schedule
    assert base != multihost.fingerprint(leaves, flat, small, 1 << 20)


def test_fingerprint_does_not_depend_on_hash_seed_or_process():
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        sys.path.insert(0, sys.argv[1] + "/tests")  # the helpers the test module imports
        from tests.test_multihost import _fingerprint, _leaves
        print(_fingerprint(_leaves()))
        """
    )
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu"}
        run = subprocess.run(
            [sys.executable, "-c", script, str(ROOT)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        outs.add(run.stdout.strip())
    assert outs == {_fingerprint(_leaves())}


def test_digests_of_mappings_do_not_depend_on_insertion_order():
    """Plan data reaches the fingerprint as dataclasses, tuples and (from the planner's
    bookkeeping) mappings; two processes may build a mapping in different orders. (A tree of
    dicts is no test of this: jax.tree_util sorts dict keys before the planner sees them.)"""
    one = {(1, 2): ("a", 3), (0, 5): ("b", 4)}
    two = dict(reversed(list(one.items())))
    assert list(one) != list(two)
    assert multihost.digest(one) == multihost.digest(two)
    assert multihost.digest(one) != multihost.digest({**one, (0, 5): ("b", 5)})


# ---------------------------------------------------------------------------------- topology


def test_a_replica_on_the_receivers_process_is_preferred():
    # Source replicated over two "processes" (devices 0-3 and 4-7), destination sharded over
    # all eight: every receiver has a replica on its own process and must use it.
    process_of = {d: d // 4 for d in range(8)}
    src = Layout.from_mesh((64, 8), (2, 4), ("r", "s"), list(range(8)), ("s",))
    dst = Layout.from_mesh((64, 8), (8,), ("x",), [7, 0, 6, 1, 5, 2, 4, 3], (None, "x"))
    leaves = [LeafSpec("w", src, dst, "float32", "float32", 4)]
    hosts = Topology.from_groups([[d for d in process_of if process_of[d] == p] for p in (0, 1, 2)])
    pieces = route(leaves, hosts, fan_out=False).pieces
    assert pieces
    assert all(process_of[p.src] == process_of[p.dst] for p in pieces)


def test_what_no_local_replica_holds_is_spread_over_the_remote_ones():
    # Source on processes 0 and 1 (two replicas), destination on process 2: nothing is local,
    # so the sending is balanced over both remote replicas.
    process_of = {d: d // 4 for d in range(12)}
    src = Layout.from_mesh((64, 8), (2, 4), ("r", "s"), list(range(8)), ("s",))
    dst = Layout.from_mesh((64, 8), (4,), ("x",), [8, 9, 10, 11], (None, "x"))
    leaves = [LeafSpec("w", src, dst, "float32", "float32", 4)]
    hosts = Topology.from_groups([[d for d in process_of if process_of[d] == p] for p in (0, 1, 2)])
    pieces = route(leaves, hosts, fan_out=False).pieces
    sent = {0: 0, 1: 0}
    for p in pieces:
        sent[process_of[p.src]] += (p.box[0][1] - p.box[0][0]) * (p.box[1][1] - p.box[1][0]) * 4
    assert sent[0] == sent[1] == 64 * 8 * 4 // 2


def test_involved_processes_are_the_owners_of_source_and_destination_devices():
    process_of = {d: d // 2 for d in range(8)}
    leaves = [
        LeafSpec(
            "w",
            Layout.from_mesh((4,), (2,), ("x",), [0, 1], ("x",)),
            Layout.from_mesh((4,), (2,), ("x",), [4, 6], ("x",)),
            "float32",
            "float32",
            4,
        )
    ]
    assert multihost.involved_processes(leaves, process_of) == (0, 2, 3)


def test_a_plans_processes_include_its_fallback_leaves_destinations(devices):
    """A fallback leaf's jax.device_put of a host value onto several processes' devices is a
    collective: those processes take part in the agreement and the order checks (a fuzz: a
    process involved through such a leaf alone was not order-checked)."""
    src = NamedSharding(Mesh(np.array(devices[:2]), ("a",)), P("a"))
    every = NamedSharding(Mesh(np.array(devices), ("x",)), P())
    tree = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=src), "n": np.int32(0)}
    identity = jr.plan(tree, {"w": src, "n": every}, fallback="device_put").identity
    process_of = {d.id: d.id // 2 for d in devices}  # (as if 4 processes of 2 devices)
    assert multihost.involved_processes(identity.leaves, process_of) == (0,)
    assert multihost.plan_processes(identity, process_of) == (0, 1, 2, 3)
    alone = jr.plan({"n": np.int32(0)}, every, fallback="device_put").identity
    assert not alone.leaves and multihost.plan_processes(alone, process_of) == (0, 1, 2, 3)


# ------------------------------------------------------------- agreement over a fake KV store


class FakeClient:
    """The key-value calls of ``jax.distributed``'s client, in memory, thread-safe."""

    def __init__(self) -> None:
        self.store: dict[str, str | bytes] = {}
        self.lock = threading.Lock()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.lock:
            assert allow_overwrite or key not in self.store, key
            self.store[key] = value

    key_value_set_bytes = key_value_set

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        with self.lock:
            return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]

    def key_value_try_get(self, key: str) -> str:
        with self.lock:
            if key not in self.store:
                raise KeyError(key)  # the runtime raises NOT_FOUND
            return self.store[key]

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        deadline = time.monotonic() + timeout_in_ms / 1000
        while time.monotonic() < deadline:
            with self.lock:
                if key in self.store:
                    return self.store[key]
            time.sleep(0.001)
        raise TimeoutError(key)

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        return self.blocking_key_value_get_bytes(key, timeout_in_ms)

    def key_value_delete(self, key: str) -> None:
        """The key and, as the runtime's store does, every key in the directory it names."""
        with self.lock:
            self.store.pop(key, None)
            for k in [k for k in self.store if k.startswith(key + "/")]:
                del self.store[k]


def _plans(devices, dst_spec_1=None):
    """The same two-leaf plan as processes 0 and 1 would make it (1 may differ in one spec)."""
    src_mesh = Mesh(np.array(devices[:4]).reshape(2, 2), ("a", "b"))
    dst_mesh = Mesh(np.array(devices[4:]), ("x",))
    tree = {
        "emb": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(src_mesh, P("a"))),
        "w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(src_mesh, P("b"))),
    }
    plans = []
    for spec in (P(None, "x"), dst_spec_1 or P(None, "x")):
        dst = {"emb": NamedSharding(dst_mesh, P("x")), "w": NamedSharding(dst_mesh, spec)}
        plans.append(jr.plan(tree, dst))
    return plans


def _agree_all(client, calls, timeout_s=30.0):
    """Run ``_Agreement(...).run`` for every (process, group, key, n, plan) in threads."""
    results: dict[int, BaseException | None] = {}

    def one(me, group, key, n, plan):
        identity = plan.identity
        try:
            multihost._Agreement(client, me, group, key, n, identity.fingerprint, identity).run(
                timeout_s
            )
            results[me] = None
        except BaseException as e:
            results[me] = e

    threads = [threading.Thread(target=one, args=call) for call in calls]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s + 10)
    assert not any(t.is_alive() for t in threads), "an agreement hung"
    return results, time.monotonic() - start


def test_agreement_passes_when_every_process_holds_the_same_plan(devices):
    plan = _plans(devices)[0]
    client = FakeClient()
    results, _ = _agree_all(client, [(p, (0, 1, 2), "g", 0, plan) for p in range(3)])
    assert results == {0: None, 1: None, 2: None}
    assert all(v == "idle" for k, v in client.store.items() if "/waiting/" in k)


def test_agreement_mismatch_names_the_first_differing_leaf_on_every_process(devices):
    plans = _plans(devices, dst_spec_1=P("x"))
    results, took = _agree_all(FakeClient(), [(p, (0, 1), "g", 0, plans[p]) for p in (0, 1)])
    assert took < 5
    for me, other in ((0, 1), (1, 0)):
        err = results[me]
        assert isinstance(err, jr.ReshardError), err
        message = str(err)
        assert "First differing leaf: ['w']" in message, message
        assert f"process {other}:" in message and "spec=P('x',)" in message, message
        assert "How to fix" in message


def test_agreement_refuses_plans_whose_transfer_programs_take_other_compiler_options(devices):
    """Regression (a probe): processes planning with different ``compiler_options`` agreed,
    and their transfer programs, compiled differently, met inside one collective. Now the
    options are in the fingerprint, and the error names them."""
    src_mesh = Mesh(np.array(devices[:4]), ("a",))
    dst_mesh = Mesh(np.array(devices[4:]), ("x",))
    tree = {
        "w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(src_mesh, P("a")))
    }
    dst = {"w": NamedSharding(dst_mesh, P(None, "x"))}
    plans = [
        jr.plan(tree, dst),
        jr.plan(tree, dst, compiler_options={"xla_cpu_enable_fast_math": False}),
    ]
    results, _ = _agree_all(FakeClient(), [(p, (0, 1), "g", 0, plans[p]) for p in (0, 1)])
    for me in (0, 1):
        message = str(results[me])
        assert isinstance(results[me], jr.ReshardError), message
        assert "compiler_options differ" in message and "xla_cpu_enable_fast_math" in message


def test_agreement_compares_the_fallback_leaves_and_names_the_one_that_differs(devices):
    """(A fuzz.) Processes sending a fallback leaf to different shardings agreed, and each
    then held its own view of the "same" array (replicated on one, split on the other)."""
    src = NamedSharding(Mesh(np.array(devices[:4]), ("a",)), P("a"))
    mesh = Mesh(np.array(devices[4:]), ("e",))
    tree = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=src), "n": np.zeros(8)}
    plans = [
        jr.plan(tree, {"w": src, "n": NamedSharding(mesh, spec)}, fallback="device_put")
        for spec in (P(), P("e"))
    ]
    assert plans[0].identity.fingerprint != plans[1].identity.fingerprint
    results, _ = _agree_all(FakeClient(), [(p, (0, 1), "g", 0, plans[p]) for p in (0, 1)])
    for me in (0, 1):
        message = str(results[me])
        assert isinstance(results[me], jr.ReshardError), message
        assert "First differing leaf: ['n']" in message and "by jax.device_put" in message
        assert "spec=P('e',)" in message, message


def test_agreement_times_out_when_a_peer_never_arrives(devices):
    plan = _plans(devices)[0]
    results, took = _agree_all(FakeClient(), [(0, (0, 1), "g", 0, plan)], timeout_s=0.3)
    assert isinstance(results[0], jr.ReshardError)
    assert "waited" in str(results[0]) and "[1]" in str(results[0])
    assert took < 5


def test_a_peer_arriving_after_an_agreement_was_given_up_raises_instead_of_passing(devices):
    """Regression (a probe): process 0 timed out waiting for process 1 in a plan's agreement
    and went on; process 1, arriving late, found process 0's fingerprint of that round, agreed
    with it, and entered a transfer process 0 never made (with the order check off, process
    0's next plan's transfer paired with it: wrong data, then a hang). The round is marked
    given up: the late process raises at once, naming it."""
    plan = _plans(devices)[0]
    client = FakeClient()
    early, _ = _agree_all(client, [(0, (0, 1), "g", 0, plan)], timeout_s=0.3)
    assert isinstance(early[0], jr.ReshardError)
    late, took = _agree_all(client, [(1, (0, 1), "g", 0, plan)], timeout_s=30.0)
    assert took < 5
    assert isinstance(late[1], jr.ReshardError), late
    assert "process 0 gave up the agreement of this plan" in str(late[1])
    assert "No data was moved" in str(late[1])


def test_a_call_waiting_for_a_peer_that_agrees_on_a_new_plan_gives_both_up(monkeypatch):
    """The order check's side of a crossing between a call of an agreed plan (here, call #3
    over processes {0, 1}) and a peer's first call of a new plan over them (its agreement
    round 5, which this process has not reached): this call raises, giving itself up, and
    gives that round up for this process, whose next agreement over the group takes round
    6, as the peer's does once its round failed. The failed round names this call: the
    peer, whose first call stood in its place, counts it as made (its next call is #4, as
    this process's), and only where it is the peer's next call."""
    monkeypatch.setattr(multihost, "_STATE", multihost._State())
    client = FakeClient()
    multihost._STATE.rounds["g"] = 5
    waiting = {"group": [0, 1], "key": "g", "n": 5}
    client.key_value_set(f"{multihost._PREFIX}/waiting/1", json.dumps(waiting))
    call = multihost._Waiting(client, 0, (0, 1), "g", 2, "plan A")
    with pytest.raises(jr.ReshardError, match="in the first call of a plan this process"):
        call.check(1)
    assert "abandoned" in json.loads(client.store[multihost._call_key("g", 2, 0)])
    failed = json.loads(client.store[f"{multihost._PREFIX}/g/5/fp/0"])
    assert "failed" in failed and failed["call"] == ["g", 2]
    assert multihost._STATE.rounds["g"] == 6
    # The peer, agreeing in round 5, reads that and counts call #3 as made.
    monkeypatch.setattr(multihost, "_STATE", multihost._State())
    multihost._STATE.calls["g"] = 2
    plan = _plans(jax.devices())[0].identity
    peer = multihost._Agreement(client, 1, (0, 1), "g", 5, plan.fingerprint, plan)
    with pytest.raises(jr.ReshardError, match="process 0 gave up the agreement"):
        peer._wait(5.0)
    assert multihost._STATE.calls["g"] == 3
    multihost._STATE.calls["g"] = 7  # (a peer at another call does not move)
    with pytest.raises(jr.ReshardError, match="process 0 gave up the agreement"):
        peer._wait(5.0)
    assert multihost._STATE.calls["g"] == 7
    # A round this process passed (or is not at yet) is no crossing.
    monkeypatch.setattr(multihost, "_STATE", multihost._State())
    multihost._STATE.rounds["g"] = 6
    multihost._Waiting(FakeClient(), 0, (0, 1), "g", 2, "plan A").check(1)


def test_a_new_plans_agreement_waiting_for_a_peer_in_a_call_gives_both_up(devices, monkeypatch):
    """The agreement's side of the same crossing: the peer waits in call #3 over {0, 1},
    which this process has not made. The agreement raises, gives that call up for the peer
    (which raises at once, and whose next agreement over the group skips this round) and
    counts it as made here (this first call stood in its place: the next call of each is
    #4, so a refit loop's next steps pair up). A peer that failed an earlier round of this
    group (a crossing) is no reason to fail this one: its next round is this one."""
    monkeypatch.setattr(multihost, "_STATE", multihost._State())
    plan = _plans(devices)[0].identity
    client = FakeClient()
    multihost._STATE.calls["g"] = 2
    waiting = {"group": [0, 1], "key": "g", "n": 2, "plan": "plan A"}
    client.key_value_set(f"{multihost._ORDER_PREFIX}/waiting/0", json.dumps(waiting))
    agreement = multihost._Agreement(client, 1, (0, 1), "g", 5, plan.fingerprint, plan)
    with pytest.raises(jr.ReshardError, match="in call #3 over processes"):
        agreement._check_blocked([0])
    given_up = json.loads(client.store[multihost._call_key("g", 2, 1)])
    assert "abandoned" in given_up and given_up["round"] == ["g", 5]
    assert multihost._STATE.calls["g"] == 3 and not multihost._STATE.given_up
    client = FakeClient()
    failed = {"group": [0, 1], "key": "g", "n": 4, "failed": "crossed"}
    client.key_value_set(f"{multihost._PREFIX}/waiting/0", json.dumps(failed))
    multihost._Agreement(client, 1, (0, 1), "g", 5, plan.fingerprint, plan)._check_blocked([0])


def test_old_call_records_are_deleted_whichever_calls_are_refused(devices, monkeypatch):
    """The order check's records are kept in blocks of `_ORDER_BLOCK` calls, and a block no
    peer reads any more is deleted. Regression (a review): only a block's first call deleted
    the block two before, so where that call was refused (or given up) the block stayed for
    the rest of the job: 400 calls with the peer refusing calls 128, 192 and 256 left 544
    keys where 160 stay without refusals. Process 0 over a fake key-value store, its peer's
    records written ahead of each call."""
    monkeypatch.setattr(multihost, "_STATE", multihost._State())
    client = FakeClient()
    monkeypatch.setattr(multihost, "_involvement", lambda plan, c: (client, 0, (0, 1)))
    plan = _plans(devices)[0].identity
    group = multihost.digest((0, 1))[:16]
    block = multihost._ORDER_BLOCK
    refused = {2 * block, 3 * block, 4 * block}
    for n in range(400):
        peer = {"fp": plan.fingerprint[:16], "plan": "plan A"}
        if n in refused:
            peer["refused"] = "a source leaf of another shape"
        client.key_value_set(multihost._call_key(group, n, 1), json.dumps(peer))
        if n in refused:
            with pytest.raises(jr.ReshardError, match="process 1 refused call"):
                multihost.check_order(plan, "plan A", client=client, timeout_s=5)
        else:
            multihost.check_order(plan, "plan A", client=client, timeout_s=5)
    blocks = {k.split("/")[-3] for k in client.store if k.startswith(multihost._ORDER_PREFIX)}
    assert blocks == {str(399 // block - 1), str(399 // block)}, sorted(blocks)


def test_a_refusal_before_a_plan_takes_the_place_of_the_event_a_peer_waits_in(monkeypatch):
    """(A third fuzz.) A call refused before its plan cannot tell from its own state whether
    the peers make a call or a new plan's agreement at this step; its guess, where wrong,
    left the refit loops a step apart, silently. It takes the place of whatever a peer is
    seen waiting in for this process: its next agreement round over a group (given up:
    the peer raises, naming the refusal) or its next call over a group (refused: the
    peer's order check raises), never an event this process has passed or given up."""
    client = FakeClient()

    def fresh(calls=None, rounds=None):
        monkeypatch.setattr(multihost, "_STATE", multihost._State())
        multihost._STATE.calls.update(calls or {})
        multihost._STATE.rounds.update(rounds or {})

    monkeypatch.setattr(multihost, "_talking", lambda group, c: (client, 0, group))
    marker = f"{multihost._PREFIX}/refusing/0"
    # A peer in this process's next agreement round over "k": given up there.
    fresh(rounds={"k": 5})
    waiting = {"group": [0, 1], "key": "k", "n": 5}
    client.key_value_set(f"{multihost._PREFIX}/waiting/1", json.dumps(waiting))
    assert multihost.place_refusal([0, 1], "bad tree", timeout_s=5.0)
    assert json.loads(client.store[f"{multihost._PREFIX}/k/5/fp/0"])["failed"] == "bad tree"
    assert multihost._STATE.rounds["k"] == 6 and not json.loads(client.store[marker])["active"]
    # A round this process passed is no place: then a peer's record of its next call is.
    fresh(calls={"k": 3}, rounds={"k": 6})
    peer = {"fp": "ab", "plan": "the plan of 1 leaf ['e']"}
    client.key_value_set(multihost._call_key("k", 3, 1), json.dumps(peer))
    assert multihost.place_refusal([0, 1], "bad tree", timeout_s=5.0)
    mine = json.loads(client.store[multihost._call_key("k", 3, 0)])
    assert mine["refused"] == "bad tree" and mine["plan"] == peer["plan"]
    assert multihost._STATE.calls["k"] == 4 and multihost._STATE.rounds["k"] == 6
    # Not a call this process gave up (its own call of it raises), nor one it made: nothing
    # is seen, and the refusal returns at the timeout for the caller to place its guess.
    fresh(calls={"k": 3}, rounds={"k": 6})
    multihost._STATE.given_up["k", 3] = "crossed"
    start = time.monotonic()
    assert not multihost.place_refusal([0, 1], "bad tree", timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 5
    assert multihost._STATE.calls["k"] == 3
    key = multihost.digest((0, 1))[:16]
    guess = json.loads(client.store[marker])["refused"][-1]["guess"]
    assert guess == ["round", key, 0]
    # A peer that refused this step too (its record names the step: the group and the call
    # and round numbers over it) is at a later step: its call there is not taken. Every
    # peer having refused, all place the lowest process's guess, at once.
    fresh(calls={"k": 3, key: 7}, rounds={"k": 6, key: 2})
    theirs = {"active": False, "refused": [{"step": [key, 7, 2], "guess": ["call", "k", 3]}]}
    client.key_value_set(f"{multihost._PREFIX}/refusing/1", json.dumps(theirs), True)
    start = time.monotonic()
    assert multihost.place_refusal([0, 1], "bad tree", timeout_s=30.0)
    assert time.monotonic() - start < 5
    assert multihost._STATE.calls["k"] == 3  # (peer 1's record of call #4 over "k": later)
    assert multihost._STATE.rounds[key] == 3  # this process's guess: the lowest
    assert json.loads(client.store[f"{multihost._PREFIX}/{key}/2/fp/0"])["failed"] == "bad tree"
    mine = json.loads(client.store[marker])
    assert not mine["active"] and mine["refused"][-1]["step"] == [key, 7, 2]
    # Seen from process 1 (the same step), process 0's guess is placed, not its own (a call
    # of a plan it has cached for its source layout, say).
    fresh(calls={"k": 3, key: 7}, rounds={"k": 6, key: 2})
    monkeypatch.setattr(multihost, "_talking", lambda group, c: (client, 1, group))
    monkeypatch.setattr(multihost, "_guess", lambda plan, group: ["call", "k", 3])
    client.store.pop(multihost._call_key("k", 3, 1))
    assert multihost.place_refusal([0, 1], "bad tree too", timeout_s=30.0)
    assert multihost._STATE.rounds[key] == 3 and multihost._STATE.calls["k"] == 3
    monkeypatch.undo()
    monkeypatch.setattr(multihost, "_talking", lambda group, c: (client, 0, group))
    # A peer refusing now at another step (its trees name other processes): a short grace,
    # not the whole timeout.
    fresh(calls={"k": 4}, rounds={"k": 6})
    monkeypatch.setattr(multihost, "REFUSAL_GRACE_S", 0.5)
    other = {"active": True, "refused": [{"step": ["elsewhere", 0, 0], "guess": guess}]}
    client.key_value_set(f"{multihost._PREFIX}/refusing/1", json.dumps(other), True)
    start = time.monotonic()
    assert not multihost.place_refusal([0, 1], "bad tree", timeout_s=30.0)
    assert 0.5 <= time.monotonic() - start < 5
    # Without the order check calls publish nothing to be seen: the guess, at once.
    monkeypatch.setenv("JAXRESHARD_ORDER_CHECK", "0")
    assert not multihost.place_refusal([0, 1], "bad tree", timeout_s=30.0)


def test_a_refusal_guessing_a_new_plan_gives_up_the_named_processes_next_round(
    devices, monkeypatch
):
    """Where a refusal before any plan places its guess and nothing is cached for its source
    layout (`place_refusal` saw no peer, or every peer refuses alike), it gives up the next
    agreement round of the processes its trees name: a peer agreeing in that round raises,
    naming the refusal, and both take the next round for their next plans."""
    monkeypatch.setattr(multihost, "_STATE", multihost._State())
    client = FakeClient()
    monkeypatch.setattr(multihost, "_talking", lambda group, c: (client, 0, group))
    key = multihost.digest((0, 1))[:16]
    multihost._STATE.rounds[key] = 2
    multihost.give_up_agreement([1, 0, 1], "bad tree")
    assert multihost._STATE.rounds[key] == 3
    assert json.loads(client.store[f"{multihost._PREFIX}/{key}/2/fp/0"])["failed"] == "bad tree"
    plan = _plans(devices)[0].identity
    peer = multihost._Agreement(client, 1, (0, 1), key, 2, plan.fingerprint, plan)
    with pytest.raises(jr.ReshardError, match="process 0 gave up the agreement of this plan"):
        peer._wait(5.0)


def test_agreement_detects_processes_waiting_in_different_plans(devices):
    # Process 0 waits in a plan over {0, 1}; process 1 in a plan over {0, 1, 2}; process 2
    # waits with 1 for process 0. Nobody hangs: 0 and 1 see the crossing, 2 sees 0 fail.
    plans = _plans(devices)
    calls = [
        (0, (0, 1), "a", 0, plans[0]),
        (1, (0, 1, 2), "b", 0, plans[1]),
        (2, (0, 1, 2), "b", 0, plans[1]),
    ]
    results, took = _agree_all(FakeClient(), calls)
    assert took < 5
    assert all(isinstance(e, jr.ReshardError) for e in results.values()), results
    assert "waiting for each other in different plans" in str(results[0])
    assert "process 0" in str(results[2])


# ------------------------------------------------------------------- multi-process launches


@dataclasses.dataclass
class Launch:
    returncodes: list[int]
    outputs: list[str]

    def case_ok(self, name: str) -> None:
        for pid, out in enumerate(self.outputs):
            assert f"CASE {name} OK" in out, f"process {pid}:\n{out[-4000:]}"


def launch(
    scenario: str, processes: int, devices: int, env: dict[str, str] | None = None
) -> Launch:
    """Run tests/multihost_worker.py as ``processes`` local jax.distributed processes (with
    ``env`` added to their environment)."""
    run = run_local(
        WORKER,
        scenario,
        processes,
        devices,
        timeout_s=LAUNCH_TIMEOUT_S,
        grace_s=FAIL_GRACE_S,
        env=env,
    )
    if run.killed:
        pytest.fail(
            f"{scenario}: processes still running (hung?) after {LAUNCH_TIMEOUT_S} s, or "
            f"{FAIL_GRACE_S} s after another one failed\n"
            + "\n".join(f"--- process {i}\n{o[-3000:]}" for i, o in enumerate(run.outputs))
        )
    return Launch(run.returncodes, run.outputs)


@pytest.fixture(scope="module")
def run_2x4() -> Launch:
    return launch("2x4", 2, 4)


@pytest.fixture(scope="module")
def run_4x2() -> Launch:
    return launch("4x2", 4, 2)


@pytest.mark.multiprocess
def test_trainer_on_process_0_sampler_on_process_1_with_bf16_cast_and_replicas(run_2x4):
    run_2x4.case_ok("split")


@pytest.mark.multiprocess
def test_meshes_spanning_both_processes_in_different_orders(run_2x4):
    run_2x4.case_ok("spanning")


@pytest.mark.multiprocess
def test_fp8_scales_needing_a_collective_across_processes_are_refused_by_name(run_2x4):
    run_2x4.case_ok("fp8_spanning")


@pytest.mark.multiprocess
def test_reshard_with_placeholders_plans_and_agrees_once(run_2x4):
    """Three jr.reshard calls: one plan in the cache, one agreement (the worker asserts both:
    the cache grew by one and the agreement rounds of the process group by one)."""
    run_2x4.case_ok("reshard_cached")


@pytest.mark.multiprocess
def test_processes_holding_different_key_types_raise_naming_the_leaf():
    """Regression: key<rbg> and key<urbg> both move as four uint32 words per key, and the
    plans' fingerprints saw only those: process 1 got process 0's rbg key data as urbg keys."""
    run = launch("keys", 2, 4)
    run.case_ok("key_kinds")
    for pid, out in enumerate(run.outputs):
        line = re.search(rf"KEYS {pid}: (.*)", out).group(1)
        assert "hold different plans" in line and "First differing leaf: ['keys']" in line, line
        assert "key<rbg>[8]" in line and "key<urbg>[8]" in line, line


@pytest.mark.multiprocess
def test_mismatched_plans_raise_on_every_process_naming_the_leaf(run_2x4):
    for pid, (rc, out) in enumerate(zip(run_2x4.returncodes, run_2x4.outputs, strict=True)):
        assert rc != 0, f"process {pid} did not fail:\n{out[-3000:]}"
        assert "jaxreshard.errors.ReshardError" in out, out[-3000:]
        assert "First differing leaf: ['layers']['w_in']" in out, out[-3000:]
        assert "spec=P(None, 'tp')" in out and "spec=P('tp', None)" in out, out[-3000:]
        seconds = float(re.search(r"MISMATCH raised after ([\d.]+) s", out).group(1))
        assert seconds < 10, seconds


@pytest.mark.multiprocess
def test_layout_needing_pieces_from_every_process(run_4x2):
    run_4x2.case_ok("every_process")


@pytest.mark.multiprocess
def test_processes_outside_a_plan_are_not_involved(run_4x2):
    run_4x2.case_ok("subset")


@pytest.mark.multiprocess
def test_senders_on_the_receivers_process_first_then_spread(run_4x2):
    run_4x2.case_ok("topology")


@pytest.mark.multiprocess
def test_plans_called_in_different_orders_raise_instead_of_hanging(run_4x2):
    for pid, (rc, out) in enumerate(zip(run_4x2.returncodes, run_4x2.outputs, strict=True)):
        assert rc != 0, f"process {pid} did not fail:\n{out[-3000:]}"
        assert "jaxreshard.errors.ReshardError" in out, out[-3000:]
        seconds = float(re.search(r"CROSSED raised after ([\d.]+) s", out).group(1))
        assert seconds < 10, seconds
    assert "waiting for each other in different plans" in run_4x2.outputs[0]


@pytest.fixture(scope="module")
def run_order() -> Launch:
    return launch("order", 2, 4)


@pytest.mark.multiprocess
def test_every_call_is_checked_and_calls_in_order_pass(run_order):
    run_order.case_ok("order_ok")


@pytest.mark.multiprocess
def test_two_threads_calling_two_plans_at_once_never_hang(run_order):
    run_order.case_ok("order_threads")


@pytest.mark.multiprocess
def test_a_call_refused_on_one_process_raises_on_the_others_and_the_next_calls_pair(run_order):
    """Regression: a call refused in one process's own checks was not published, so the other
    process's same call paired with that process's next call (a different step's data)."""
    run_order.case_ok("order_refused")
    assert "REFUSED 0: these source leaves do not match the plan" in run_order.outputs[0]
    assert "REFUSED 1: jaxreshard: process 0 refused call #" in run_order.outputs[1]
    assert "['a']: expected float32[16, 8]" in run_order.outputs[1]


@pytest.mark.multiprocess
def test_a_call_refused_on_a_peer_keeps_the_donated_leaves_bound_for_host_memory(run_order):
    """Regression (a review, 2026-12-07): the leaves of a refused call's ``donate=`` tree whose
    destination is in host memory were deleted before the peer's refusal was read."""
    run_order.case_ok("order_refused_keeps_donations")
    assert "DONATED 1: jaxreshard: process 0 refused call #" in run_order.outputs[1]


@pytest.mark.multiprocess
def test_a_call_refused_behind_a_refit_in_flight_raises_on_the_peer_and_calls_pair(run_order):
    """Regression (a review, 2026-12-07): a call queued behind a refit in flight that found
    its source consumed by it raised on its own process only; the peer's same call paired
    with the next one."""
    run_order.case_ok("order_refused_behind_a_refit")
    assert "BEHIND 0: jaxreshard: process 1 refused call #" in run_order.outputs[0]


@pytest.mark.multiprocess
def test_a_refused_call_of_a_plan_with_fallback_leaves_raises_on_the_peer_and_calls_pair(
    run_order,
):
    """(A fuzz.) A fallback leaf's jax.device_put, a collective under jax.distributed, ran
    before the order check: a call refused on one process put the processes out of step
    for good (and the last call hung)."""
    run_order.case_ok("order_fallback")
    assert "FALLBACK 0: jaxreshard: process 1 refused call #" in run_order.outputs[0]
    assert "FALLBACK 1: these source leaves do not match the plan" in run_order.outputs[1]


@pytest.mark.multiprocess
def test_a_refused_call_of_a_plan_of_fallback_leaves_alone_raises_on_the_peer_and_calls_pair(
    run_order,
):
    """(A fuzz.) Such a plan moves no leaf itself, yet its copies are collectives: its
    processes are the fallback leaves' destinations', and every call is order-checked."""
    run_order.case_ok("order_fallback_only")
    assert "ALONE 0: jaxreshard: process 1 refused call #" in run_order.outputs[0]
    assert "ALONE 1: these source leaves do not match the plan" in run_order.outputs[1]


@pytest.mark.multiprocess
def test_every_refusal_and_a_given_up_call_raise_on_the_peer_and_the_next_calls_pair(run_order):
    """Regression: a donate= tree still in flight and an Fp8Blockwise plan's own checks were
    refused without a place in the order of calls, so the peer's call paired with the next
    one and returned another step's weights; verify=True moved the data before refusing; a
    call one process gave up on (timed out) let a late peer enter the transfer alone (hung);
    an fp8 leaf's placeholder was refused on the process holding no shard of it."""
    run_order.case_ok("order_refusals")
    p0, p1 = run_order.outputs
    assert "IN_FLIGHT 1: these donate= leaves are being donated" in p1
    assert "IN_FLIGHT 0: jaxreshard: process 1 refused call #" in p0
    assert "VERIFY 0: verify=True is not supported under jax.distributed" in p0
    assert "FP8 0: these source leaves do not match the plan" in p0
    assert "FP8 1: jaxreshard: process 0 refused call #" in p1
    assert "GIVEN_UP 0: jaxreshard: process 0 waited 2 s for process 1" in p0
    assert "GIVEN_UP 1: jaxreshard: process 0 gave up call #" in p1


@pytest.mark.multiprocess
def test_a_first_call_refused_on_one_process_raises_on_the_others_and_the_next_calls_pair(
    run_order,
):
    """(A fuzz.) A refusal before the plan agreed took no place in the order of calls: the
    peer's first call paired with the refusing process's next one (another step's weights,
    no error), and every later call was one step apart. The refusal now agrees first."""
    run_order.case_ok("order_first_refused")
    assert "FIRST 0: these source leaves do not match the plan" in run_order.outputs[0]
    assert "FIRST 1: jaxreshard: process 0 refused call #" in run_order.outputs[1]


@pytest.mark.multiprocess
def test_a_reshard_refused_before_its_plan_raises_on_the_others_and_the_next_calls_pair(
    run_order,
):
    """(A fuzz.) A `jr.reshard` refused before it found a plan (a dst_shardings tree that
    does not fit) published nothing: the peer's call paired with the next step's. It now
    takes the place of a call of the plan last used for that source layout."""
    run_order.case_ok("order_unplanned")
    assert "UNPLANNED 0: dst_shardings does not match the structure" in run_order.outputs[0]
    assert "UNPLANNED 1: jaxreshard: process 0 refused call #" in run_order.outputs[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("late", [None, "0", "1"])
def test_an_agreed_plan_crossed_with_a_new_plans_first_call_raises_on_both_within_seconds(late):
    """(A fuzz.) The order check and the agreement did not see each other's waits: a process
    calling an agreed plan and a peer making a new plan's first call waited for each other
    the whole agreement timeout (300 s), then were one call apart. Whichever finds the
    crossing first, both raise within a few polls, naming it, and the calls then pair up."""
    run = launch("crossed_new", 2, 4, env={"WORKER_LATE": late} if late else None)
    run.case_ok("crossed_new")
    p0, p1 = run.outputs
    assert "CROSSNEW_A 0: jaxreshard: process" in p0
    assert "CROSSNEW_B 1: jaxreshard: process" in p1
    # (A fuzz.) A refit loop in which one process's call of one step made a plan of its own
    # (an int32 source): both raise at that step, and the next steps pair up step for step.
    run.case_ok("crossed_substituted")
    assert "SUBSTITUTED 0: jaxreshard: process" in p0 and "SUBSTITUTED 1: jaxreshard:" in p1
    # (A fuzz.) A plan's first call made while a Plan.start is in flight agrees after it.
    run.case_ok("start_then_first_call")
    # (A third fuzz.) A reshard refused before its plan, on one process, at one step of a
    # refit loop whose peer calls the agreed plan: it takes the place of the peer's call
    # (seen waiting), where it gave up an agreement round and left the loops a step apart.
    # Refused on both, it is placed alike on both at once.
    run.case_ok("refused_extra_leaf")
    assert "EXTRA 0: cannot plan a reshard for these leaves" in p0, p0[-3000:]
    assert "EXTRA 1: jaxreshard: process 0 refused call #" in p1, p1[-3000:]
    for pid, out in enumerate(run.outputs):
        seconds = float(re.search(rf"CROSSNEW {pid} raised after ([\d.]+) s", out)[1])
        assert seconds < 10, (pid, seconds)
        for name in ("EXTRA_BOTH", "EXTRA_ALONE", "EXTRA_OTHER"):
            seconds = float(re.search(rf"{name} {pid} raised after ([\d.]+) s", out)[1])
            assert seconds < 5, (name, pid, seconds)


@pytest.mark.multiprocess
def test_a_reshard_refused_at_its_layouts_first_call_raises_on_the_others_and_the_next_calls_pair(
    run_order,
):
    """(A fuzz.) With no plan cached for the source layout there is no call to take the
    place of: the refusal gives up the agreement round of the processes the trees name."""
    run_order.case_ok("order_unplanned_first")
    out0, out1 = run_order.outputs
    assert "UNPLANNED_FIRST 0: dst_shardings does not match the structure" in out0
    assert "UNPLANNED_FIRST 1: jaxreshard: process 0 gave up the agreement of this plan" in out1


@pytest.mark.multiprocess
def test_a_plan_made_again_refused_at_its_first_call_raises_on_the_peer_at_once():
    """Regression: the refusal was not published (this plan object had not agreed, though
    its fingerprint had), so the peer waited for the agreement timeout or paired with the
    next call, returning a mix of two steps' weights."""
    run = launch("remade", 2, 4)
    run.case_ok("order_remade")
    assert "REMADE 0: these source leaves do not match the plan" in run.outputs[0]
    assert "REMADE 1: jaxreshard: process 0 refused call #" in run.outputs[1]
    seconds = float(re.search(r"REMADE 1 raised after ([\d.]+) s", run.outputs[1])[1])
    assert seconds < 10, seconds


@pytest.mark.multiprocess
def test_agreed_plans_called_in_different_orders_raise_on_both_naming_both(run_order):
    for pid, (rc, out) in enumerate(zip(run_order.returncodes, run_order.outputs, strict=True)):
        assert rc != 0, f"process {pid} did not fail:\n{out[-3000:]}"
        assert "is not the same call everywhere" in out, out[-3000:]
        assert "the plan of 1 leaf ['a'] (" in out and "the plan of 1 leaf ['b'] (" in out, out
        seconds = float(re.search(r"ORDER raised after ([\d.]+) s", out).group(1))
        assert seconds < 10, seconds


@pytest.mark.multiprocess
@pytest.mark.parametrize("late", [0, 1])
def test_calls_crossed_between_plans_over_different_groups_raise_within_seconds(late):
    """Regression: each group of processes numbers its own calls, so plans over different
    groups called in crossed orders were found only at the order check's timeout (300 s).

    Process 0 calls A (over 0, 1) then B (over 0, 1, 2); process 1 calls B then A. The process
    that arrives later (``late``) finds the crossing first and gives the other's call up for
    it; every crossed call then raises within seconds, whichever process found it.
    (Regression: where process 0 found it, its B waited out the timeout for peers that had
    given B up.)"""
    # A call that waits out the order check's timeout fails here in 40 s, not 300.
    env = {"WORKER_LATE": str(late), "JAXRESHARD_AGREEMENT_TIMEOUT_S": "40"}
    run = launch("crossed_groups", 3, 2, env=env)
    run.case_ok("crossed_groups")
    p0, p1, p2 = run.outputs
    crossed = re.compile(r"processes [01] and [01] are waiting for each other in crossed calls")
    assert crossed.search(re.search(r"CROSSED_A 0: .*", p0).group(0)), p0
    assert crossed.search(re.search(r"CROSSED_B 1: .*", p1).group(0)), p1
    # B's call was given up by the process that found the crossing; process 0 says which.
    if late == 0:
        assert "GAVE_UP_B 0: jaxreshard: this process (process 0) gave up call #" in p0, p0
    else:
        assert "GAVE_UP_B 0: jaxreshard: process 1 gave up call #" in p0, p0
    assert f"GAVE_UP_B 2: jaxreshard: process {late} gave up call #" in p2, p2
    for out in run.outputs:
        seconds = float(re.search(r"CROSSED_GROUPS raised after ([\d.]+) s", out).group(1))
        assert seconds < 20, seconds


class _Recording(FakeClient):
    """A `FakeClient` that logs every key it sets, in order; ``on_get`` runs before each
    blocking read of the key it names (a peer acting while this process waits)."""

    def __init__(self, on_get: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.sets: list[str] = []
        self.on_get = on_get or {}

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        super().key_value_set(key, value, allow_overwrite=True)
        self.sets.append(key)

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        if key in self.on_get:
            self.on_get.pop(key)()
        return self.blocking_key_value_get_bytes(key, timeout_in_ms)


def _as_process(monkeypatch, client, me, group):
    """Make `multihost` see this process as ``me`` of ``group``, with fresh call counters."""
    monkeypatch.setattr(multihost, "_STATE", multihost._State())
    monkeypatch.setattr(multihost, "_involvement", lambda plan, c: (client, me, group))


def test_a_crossing_gives_this_call_up_before_the_peers(devices, monkeypatch):
    """Regression (seen under load, jax 0.11.2 on 16 cores): process 1, in call B over
    {0, 1, 2}, finds process 0 waiting in call A over {0, 1}. It gave A up, then B; process 0,
    released by A's give-up, made B and read process 1's B record before it said "given up",
    and entered B's transfer without process 1. B must be given up first."""
    client = _Recording()
    _as_process(monkeypatch, client, 1, (0, 1, 2))
    waiting = multihost._Waiting(client, 1, (0, 1, 2), "B", 0, "the plan of B")
    client.key_value_set(
        f"{multihost._ORDER_PREFIX}/waiting/0",
        '{"group": [0, 1], "key": "A", "n": 0, "plan": "the plan of A"}',
    )
    with pytest.raises(jr.ReshardError, match="waiting for each other in crossed calls"):
        waiting.check(0)
    order = [k for k in client.sets if "/waiting/" not in k]
    prefix = multihost._ORDER_PREFIX
    assert order == [f"{prefix}/B/0/0/1", f"{prefix}/A/0/0/1"], order
    assert "abandoned" in client.store[f"{prefix}/B/0/0/1"]


def test_a_call_whose_earlier_peer_gave_it_up_while_a_later_one_arrived_raises(
    devices, monkeypatch
):
    """Regression: process 2 read process 0's record of call #1, then waited for process 1's;
    meanwhile process 0 gave the call up (a crossing it found). A call that took under a
    second did not read the records again and entered the transfer alone."""
    prefix = multihost._ORDER_PREFIX
    plan = _plans(devices)[0]
    identity = plan.identity
    fp = identity.fingerprint[:16]
    key = multihost.digest((0, 1, 2))[:16]
    record = f'{{"fp": "{fp}", "plan": "the plan"}}'

    def process_0_gives_up_then_process_1_arrives():
        gave_up = '{"fp": "", "plan": "the plan", "abandoned": "a crossing"}'
        client.key_value_set(f"{prefix}/{key}/0/0/0", gave_up, allow_overwrite=True)
        client.key_value_set(f"{prefix}/{key}/0/0/1", record)

    client = _Recording(on_get={f"{prefix}/{key}/0/0/1": process_0_gives_up_then_process_1_arrives})
    client.key_value_set(f"{prefix}/{key}/0/0/0", record)
    _as_process(monkeypatch, client, 2, (0, 1, 2))
    with pytest.raises(jr.ReshardError, match="process 0 gave up call #1"):
        multihost.check_order(identity, "the plan", timeout_s=5)


@pytest.mark.multiprocess
def test_a_peer_lost_between_refits_is_named_within_the_timeout():
    lost = launch(
        "lost", 2, 4, env={"JAXRESHARD_AGREEMENT_TIMEOUT_S": "4", "WORKER_FAST_FAILURE": "1"}
    )
    assert lost.returncodes[1] == 17, lost.outputs[1][-2000:]
    out = lost.outputs[0]
    assert lost.returncodes[0] != 0 and "jaxreshard.errors.ReshardError" in out, out[-3000:]
    assert "for process 1 to make call" in out and "is lost" in out, out[-3000:]
    seconds = float(re.search(r"LOST raised after ([\d.]+) s", out).group(1))
    assert 3.5 < seconds < 15, seconds


@pytest.mark.multiprocess
def test_a_peer_lost_inside_a_transfer_stops_the_survivor_at_the_heartbeat_timeout():
    """A peer that dies while refits are in flight leaves the survivor inside a collective;
    jax.distributed's heartbeat (here heartbeat_timeout_seconds=5) aborts it: it never hangs."""
    start = time.monotonic()
    lost = launch("lost_in_transfer", 2, 4, env={"WORKER_FAST_FAILURE": "1"})
    took = time.monotonic() - start
    assert lost.returncodes[1] == 17, lost.outputs[1][-2000:]
    assert lost.returncodes[0] != 0, lost.outputs[0][-3000:]
    assert "heartbeat" in lost.outputs[0].lower(), lost.outputs[0][-3000:]
    assert took < 60, took


EXAMPLE_ARGS = ["--local", "2", "--devices", "2", "--steps", "2", "--width", "64"]


@pytest.mark.multiprocess
def test_multihost_example_runs_as_local_processes():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "multihost_refit.py"), *EXAMPLE_ARGS],
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "process 1 (sampler): step 1 refit" in run.stdout, run.stdout[-3000:]
