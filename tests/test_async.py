"""`Plan.start`: a refit that runs while the caller keeps working.

Specification: ``plan.start(src, donate=spare).result()`` is bit for bit ``plan(src)``; start
returns before the move has finished; the current sampler weights stay usable throughout;
errors surface from ``start`` (bad arguments, before anything moves) or ``result`` (a source
deleted in flight); staging stays what the plan reports; a sampler program with collectives
running meanwhile does not deadlock.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import assert_exact, random_array, sharding
from compiles import COMPILES
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from jaxreshard import api

SRC = (tuple(range(4)), (2, 2), ("fsdp", "tp"))
DST = (tuple(range(4, 8)), (2, 2), ("dp", "tp"))


def trees(version: int, rows: int = 256):
    host = {f"w{i}": random_array((rows, 64), "float32", seed=10 * version + i) for i in range(6)}
    src = {k: jax.device_put(v, sharding(*SRC, "fsdp", "tp")) for k, v in host.items()}
    return host, src


DST_SHARDING = sharding(*DST, None, "tp")


def check(out, host, dtype=jnp.bfloat16):
    for k, v in host.items():
        assert_exact(out[k], v.astype(dtype), DST_SHARDING)


def test_a_started_refit_is_the_call_bit_for_bit_and_the_current_weights_stay_usable():
    host0, src0 = trees(0)
    host1, src1 = trees(1)
    plan = jr.plan(src0, DST_SHARDING, dtype=jnp.bfloat16, bucket_bytes=32 << 10)
    spare, current = plan(src0), plan(src0)
    refit = plan.start(src1, donate=spare)

    def checksum(t):
        return sum(jnp.sum(jax.lax.bitcast_convert_type(x, jnp.uint16)) for x in t.values())

    busy = [int(jax.jit(checksum)(current)) for _ in range(3)]  # sampling on weights k
    new = refit.result()
    assert refit.done() and len(set(busy)) == 1
    check(new, host1)
    check(current, host0)  # untouched
    assert all(x.is_deleted() for x in spare.values())  # the spare was consumed
    # and the next one alternates the buffers
    spare, current = current, new
    again = plan.start(src0, donate=spare).result()
    check(again, host0)
    check(current, host1)


def test_start_returns_before_the_move_has_finished():
    _, src = trees(0, rows=2048)
    plan = jr.plan(src, DST_SHARDING, dtype=jnp.bfloat16)
    out = plan(src)
    jax.block_until_ready(out)
    seen_pending = False
    for _ in range(5):
        refit = plan.start(src, donate=out)
        seen_pending |= not refit.done()
        out = refit.result()
    assert seen_pending


def test_bad_arguments_are_refused_by_start_before_anything_moves():
    _, src = trees(0)
    plan = jr.plan(src, DST_SHARDING)
    out = plan(src)
    wrong = dict(src, w0=jax.device_put(jnp.zeros((8, 8)), sharding(*SRC)))
    with pytest.raises(jr.ReshardError, match=r"\['w0'\]"):
        plan.start(wrong, donate=out)
    assert not any(x.is_deleted() for x in out.values())


def test_a_source_of_a_refit_in_flight_cannot_be_donated_and_a_deleted_one_is_named():
    _, src = trees(0, rows=2048)
    _, other = trees(5, rows=2048)
    plan = jr.plan(src, DST_SHARDING)
    back = jr.plan(plan(src), sharding(*SRC, "fsdp", "tp"))
    moved = plan(src)
    blocker = jr.plan(other, DST_SHARDING, bucket_bytes=4 << 10)  # keeps the worker busy
    hold = blocker.start(other)
    refit = plan.start(src)
    try:
        with pytest.raises(jr.ReshardError, match="source of a refit in flight"):
            back(moved, donate=src)  # would destroy the in-flight source
    finally:
        hold.result()
        refit.result()

    def deleted_while_queued(donate, victim_leaf, match):
        """Start a refit behind ``blocker``'s, delete ``victim_leaf`` while it waits its
        turn (behind the library's back), and expect ``result()`` to name it."""
        hold = blocker.start(other)
        victim = plan.start(src, donate=donate)
        victim_leaf.delete()
        hold.result()
        if victim.done() and victim._future.exception() is None:
            pytest.skip("the refit finished before the array could be deleted")
        with pytest.raises(jr.ReshardError, match=match):
            victim.result()

    deleted_while_queued(None, src["w3"], r"deleted while the refit was in flight(.|\n)*w3")
    # the same for a donate= tree (regression: XLA's own "Array has been deleted")
    src = trees(0, rows=2048)[1]
    spare = plan(src)
    deleted_while_queued(spare, spare["w2"], r"\['w2'\]: donate= deleted")
    assert_exact(plan(src)["w2"], np.asarray(src["w2"]), DST_SHARDING)


def test_a_result_donated_to_a_refit_in_flight_is_neither_donated_again_nor_read():
    """Donating one tree to two calls at once is refused (XLA would be handed buffers the
    first call already consumed: a crash), and so is reading it as a source while the refit
    overwrites it; once the refit is done its result may be donated."""
    _, src = trees(0, rows=2048)
    _, other = trees(5, rows=2048)
    plan = jr.plan(src, DST_SHARDING)
    spare = plan(src)
    back = jr.plan(spare, sharding(*SRC, "fsdp", "tp"))
    blocker = jr.plan(other, DST_SHARDING, bucket_bytes=4 << 10)  # keeps the worker busy
    hold = blocker.start(other)
    refit = plan.start(src, donate=spare)
    try:
        with pytest.raises(jr.ReshardError, match=r"donated to another call in flight(.|\n)*w0"):
            plan(src, donate=spare)
        with pytest.raises(jr.ReshardError, match="donated to another call in flight"):
            plan.start(src, donate=spare)
        # (refused by the call's checks, before it queues behind the refit: not found
        # deleted once the refit has consumed it)
        with pytest.raises(jr.ReshardError, match=r"w0'\]: is donated to a call in flight"):
            back(spare)  # read while the refit overwrites it
    finally:
        hold.result()
        new = refit.result()
    again = plan(src, donate=new)  # the claim ends with the refit
    assert all(x.is_deleted() for x in new.values())
    assert not any(x.is_deleted() for x in again.values())


def _run_script(path: Path, text: str) -> subprocess.CompletedProcess:
    """Run ``text`` as a script of its own (a process a crash may kill without taking pytest
    with it), from the repository root; it must exit cleanly."""
    path.write_text(text)
    done = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


TWO_THREADS_SCRIPT = """
import os, threading
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxreshard as jr
from jaxreshard import api

devices = np.array(jax.devices())
src_s = NamedSharding(Mesh(devices[:4].reshape(2, 2), ("fsdp", "tp")), P("fsdp", "tp"))
dst_s = NamedSharding(Mesh(devices[4:], ("tp",)), P(None, "tp"))
host = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
src = {"w0": jax.device_put(host, src_s)}
plan = jr.plan(src, {"w0": dst_s})
spare = plan(src)
checked, consumed = threading.Event(), threading.Event()
claim = api._DONATED.claim

def late_claim(old):
    if threading.current_thread().name == "T":
        checked.set()
        consumed.wait(timeout=60)
    return claim(old)

api._DONATED.claim = late_claim
errors = []

def other():
    try:
        plan(src, donate=spare)
    except jr.ReshardError as e:
        errors.append(str(e))

t = threading.Thread(target=other, name="T")
t.start()
assert checked.wait(timeout=60)
out = plan(src, donate=spare)  # consumes the spare while T waits to claim it
consumed.set()
t.join(timeout=120)
assert spare["w0"].is_deleted() and np.array_equal(np.asarray(out["w0"]), host)
print(errors[0] if errors else "T was not refused")
"""


def test_a_tree_donated_by_two_threads_is_refused_once_the_other_call_consumed_it(tmp_path):
    """Regression (two threads running ``cur = plan(src, donate=cur)`` crashed the process
    with a segfault): a call that checked its donate= tree while another call still held it,
    and claimed it once that call had consumed it, handed XLA deleted buffers. Made
    deterministic (in a process of its own: the bug kills the process): thread T passes its
    checks, the main thread's call consumes the tree, then T claims it. T is refused, naming
    the leaf; the main thread's result is intact."""
    done = _run_script(tmp_path / "two_threads.py", TWO_THREADS_SCRIPT)
    assert "donated to another call meanwhile" in done.stdout, done.stdout
    assert "['w0']" in done.stdout


def test_errors_inside_the_move_resurface_from_result(monkeypatch):
    _, src = trees(0)
    plan = jr.plan(src, DST_SHARDING)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(plan.runtime, "run", broken)
    refit = plan.start(src)
    with pytest.raises(RuntimeError, match="device lost"):
        refit.result()
    assert refit.done()


def test_staging_stays_bounded_and_nothing_recompiles():
    _, src = trees(0)
    plan = jr.plan(src, DST_SHARDING, dtype=jnp.bfloat16, bucket_bytes=16 << 10)
    out = plan(src)
    spare = plan(src)
    jax.block_until_ready((out, spare))
    with COMPILES as later:
        for _ in range(4):
            out, spare = plan.start(src, donate=spare).result(), out
            assert max(plan.runtime.pool_bytes().values()) <= plan.stats.staging_bytes
    assert later.count == 0


def test_a_sampler_program_with_collectives_running_meanwhile_does_not_deadlock():
    host, src = trees(0)
    plan = jr.plan(src, DST_SHARDING, dtype=jnp.bfloat16, bucket_bytes=32 << 10)
    spare = plan(src)
    mesh = DST_SHARDING.mesh
    x = jax.device_put(jnp.ones((4, 256)), jax.sharding.NamedSharding(mesh, P(("dp", "tp"))))
    step = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(jnp.tanh(v), ("dp", "tp")),
            mesh=mesh,
            in_specs=P(("dp", "tp")),
            out_specs=P(),
        )
    )
    stop = threading.Event()
    ran = []

    def sampler():
        while not stop.is_set():
            ran.append(float(step(x).sum()))  # a decode step: dispatch, read, repeat

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        for _ in range(10):
            spare = plan.start(src, donate=spare).result(
                timeout=max(1, deadline - time.monotonic())
            )
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive() and ran
    check(spare, host)


def test_a_plain_call_made_while_refits_are_in_flight_runs_after_them():
    host0, src0 = trees(0)
    host1, src1 = trees(1)
    plan = jr.plan(src0, DST_SHARDING, dtype=jnp.bfloat16)
    spare = plan(src0)
    refit = plan.start(src1, donate=spare)
    now = plan(src0)  # issued after the started refit, on the same worker
    check(refit.result(), host1)
    check(now, host0)


class Interrupt(BaseException):
    """What Ctrl-C raises (a `KeyboardInterrupt`, not an `Exception`), without pytest's
    reaction to a real one."""


def interrupted_waits(monkeypatch, cancellable: bool) -> None:
    """From now on a wait for the worker thread is interrupted at once; the move it waited
    for is cancelled if it has not started (``cancellable``), else it stays queued."""
    submit = api._submit

    class Waited:
        def __init__(self, future):
            self.future = future

        def result(self, timeout=None):
            raise Interrupt

        def cancel(self):
            return cancellable and self.future.cancel()

    monkeypatch.setattr(api, "_submit", lambda fn: Waited(submit(fn)))


@pytest.mark.parametrize("cancellable", [True, False], ids=["not-started", "started"])
def test_a_call_interrupted_while_it_waits_behind_refits_keeps_its_donation_until_it_is_done(
    monkeypatch, cancellable
):
    host0, src0 = trees(0)
    host1, src1 = trees(1)
    plan = jr.plan(src0, DST_SHARDING, dtype=jnp.bfloat16)
    spare, current = plan(src0), plan(src0)
    gate = threading.Event()
    api._submit(gate.wait)  # the worker is busy until the gate opens
    try:
        refit = plan.start(src1, donate=spare)  # in flight: the next call queues behind it
        interrupted_waits(monkeypatch, cancellable)
        with pytest.raises(Interrupt):
            plan(src0, donate=current)
        monkeypatch.undo()
        if cancellable:  # cancelled: nothing moved, nothing claimed
            assert not any(x.is_deleted() for x in current.values())
            retry = plan.start(src0, donate=current)
        else:  # still queued: it will consume `current`, so a retry may not have it (XLA crashed)
            with pytest.raises(jr.ReshardError, match="being donated to another call in flight"):
                plan.start(src0, donate=current)  # (a start: a call would wait for the gate)
    finally:
        gate.set()
    check(refit.result(), host1)
    if cancellable:
        check(retry.result(), host0)
    else:
        api._submit(lambda: None).result()  # the interrupted move has run
        assert all(x.is_deleted() for x in current.values())
        with pytest.raises(jr.ReshardError, match="deleted"):
            plan(src0, donate=current)


def test_a_start_interrupted_before_it_submits_keeps_no_claim(monkeypatch):
    host, src = trees(0)
    plan = jr.plan(src, DST_SHARDING, dtype=jnp.bfloat16)
    spare = plan(src)

    def interrupted(flat):
        raise Interrupt

    monkeypatch.setattr(plan, "_early_fallback_copies", interrupted)
    with pytest.raises(Interrupt):
        plan.start(src, donate=spare)
    monkeypatch.undo()
    check(plan(src, donate=spare), host)  # not "being donated to another call in flight"


def test_host_leaves_are_read_as_start_returns_under_the_callers_transfer_guard(monkeypatch):
    """Regression (a probe): a NumPy leaf sent by ``jax.device_put`` (``fallback=``) was read
    by the worker thread when it reached the refit, so a caller that reused its host buffer
    after ``start`` returned got the new values, not what ``plan(src)`` returns; and that
    copy ran outside the caller's ``jax.transfer_guard``."""
    _, src0 = trees(0)
    first = jr.plan(src0, DST_SHARDING)
    gate, move = threading.Event(), first._move
    monkeypatch.setattr(first, "_move", lambda *a: (gate.wait(30), move(*a))[1])
    host = np.arange(8, dtype=np.float32)
    src = {"w": src0["w0"], "host": host}
    plan = jr.plan(src, {"w": DST_SHARDING, "host": sharding(*DST)}, fallback="device_put")
    busy = first.start(src0)  # the worker waits at the gate meanwhile
    refit = plan.start(src)
    host[:] = -1
    gate.set()
    busy.result()
    np.testing.assert_array_equal(np.asarray(refit.result()["host"]), np.arange(8))
    with jax.transfer_guard("disallow_explicit"):
        for call in (plan, plan.start):
            with pytest.raises(jr.ReshardError, match=r"jax\.device_put refused"):
                call(src)


def test_a_call_behind_a_refit_donating_an_array_over_its_consumed_tree_is_refused(
    monkeypatch,
):
    """Regression (a review, 2026-12-07): a call waiting behind a refit in flight, whose
    donate= leaf is an array over the buffers of the tree that refit consumes (the same
    devices under other axis names: no copy), reached XLA with a deleted buffer and crashed
    the process. Refused when its turn comes; the refit's result is exact."""
    host, src = trees(0)
    there = sharding(*DST, None, "tp")
    renamed = sharding(DST[0], DST[1], ("x", "y"), None, "y")  # (the same layout)
    forth, other = jr.plan(src, there), jr.plan(src, renamed)
    spare = forth(src)
    alias = {k: jax.device_put(v, renamed) for k, v in spare.items()}
    assert alias["w0"].addressable_shards[0].data.unsafe_buffer_pointer() == (
        spare["w0"].addressable_shards[0].data.unsafe_buffer_pointer()
    )
    gate, move = threading.Event(), forth._move
    monkeypatch.setattr(forth, "_move", lambda *a: (gate.wait(30), move(*a))[1])
    refit = forth.start(src, donate=spare)  # in flight until the gate opens
    threading.Timer(0.5, gate.set).start()  # (the call below waits behind it meanwhile)
    with pytest.raises(jr.ReshardError, match="donate= leaves were deleted") as e:
        other(src, donate=alias)
    assert "['w0']" in str(e.value) and "How to fix" in str(e.value)
    for k, v in refit.result().items():
        np.testing.assert_array_equal(np.asarray(v), host[k])
    for k, v in other(src).items():  # the plan goes on
        np.testing.assert_array_equal(np.asarray(v), host[k])


@pytest.mark.parametrize("fp8", [False, True])
def test_an_array_over_the_buffers_of_a_tree_donated_in_flight_is_refused_when_read(
    fp8, monkeypatch
):
    """Regression (a probe): an array over the buffers of a tree donated to a refit in flight
    (``jax.device_put`` onto the same devices under other axis names makes no copy) passed
    the checks, which know donated trees by identity. Read once the refit had consumed the
    buffers, a plain plan raised JAX's RuntimeError, and an fp8 plan's quantizer crashed the
    process. Both refuse it, naming the leaf; the refit is unharmed."""
    host, src = trees(0)
    plan = jr.plan(src, DST_SHARDING)
    spare = plan(src)
    devices = np.array(jax.devices()[4:]).reshape(2, 2)
    renamed = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("x", "y")), P(None, "y"))
    alias = jax.device_put(spare["w0"], renamed)
    assert {s.data.unsafe_buffer_pointer() for s in alias.addressable_shards} == {
        s.data.unsafe_buffer_pointer() for s in spare["w0"].addressable_shards
    }
    dtype = jr.Fp8Blockwise(block=None) if fp8 else None
    back = jr.plan(alias, sharding(*SRC, "fsdp", "tp"), dtype=dtype)
    refit = plan.start(src, donate=spare)
    if fp8:  # the quantizer reads its sources once the refit in flight has run
        between = jr.quant.runtime.between_calls
        monkeypatch.setattr(
            jr.quant.runtime, "between_calls", lambda *a: (refit.result(), between(*a))[1]
        )
    with pytest.raises(jr.ReshardError, match=r"(?s)were deleted before .*<root>: deleted"):
        back(alias)
    check(refit.result(), host, jnp.float32)


def test_repr():
    _, src = trees(0)
    refit = jr.plan(src, DST_SHARDING).start(src)
    refit.result()
    assert repr(refit) == "Refit(done=True)"


def test_a_result_freed_by_another_thread_while_a_call_waits_for_it_is_left_out(monkeypatch):
    """Regression (an adversarial probe): on CPU a call's first transfer waits for the last
    call's last step, leaving out what was deleted; an array deleted by another thread
    between that check and the wait (the caller freeing its previous result while a
    `Plan.start` runs) made the refit fail with JAX's "called on deleted or donated buffer".
    The wait now leaves it out whenever it goes."""
    from jaxreshard.run import runtime

    a, b = (jax.device_put(np.ones(4, np.float32), jax.devices()[i]) for i in (0, 1))
    real = jax.block_until_ready

    def deleting_first(xs):
        b.delete()  # after the filter, before the wait
        return real(xs)

    monkeypatch.setattr(jax, "block_until_ready", deleting_first)
    runtime._await([a, b])  # no error: b is left out
    monkeypatch.setattr(jax, "block_until_ready", real)
    with pytest.raises(Exception, match="deleted"):
        real([a, b])  # (what the wait raised before)


def test_calls_of_two_plans_made_at_once_on_two_threads_run_one_after_the_other(monkeypatch):
    """On CPU a call's steps wait for each other and XLA's collectives need every device's
    thread: two calls of different plans made at once on two threads run one after the
    other (an adversarial probe saw their steps interleave), and each is exact."""
    from jaxreshard.run import runtime

    steps = []
    real = runtime.Runtime._run_step

    def recording(self, *args, **kwargs):
        steps.append(id(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(runtime.Runtime, "_run_step", recording)
    host, src = trees(2)
    plans = [jr.plan(src, DST_SHARDING, bucket_bytes=b) for b in (32 << 10, 48 << 10)]
    outs, errors = {}, []

    def calls(i):
        try:
            for _ in range(12):
                outs[i] = plans[i](src)
        except Exception as e:  # (reported below)
            errors.append(e)

    threads = [threading.Thread(target=calls, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    per_call = {id(p.runtime): len(p.lowered.steps) for p in plans}
    assert min(per_call.values()) > 1
    runs = []  # consecutive steps of one runtime
    for r in steps:
        if runs and runs[-1][0] == r:
            runs[-1][1] += 1
        else:
            runs.append([r, 1])
    assert all(n % per_call[r] == 0 for r, n in runs), runs
    for out in outs.values():
        check(out, host, jnp.float32)


SHUTDOWN_SCRIPT = """
import atexit, os, sys, threading
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxreshard as jr

devices = np.array(jax.devices())
src_sharding = NamedSharding(Mesh(devices[:4].reshape(2, 2), ("fsdp", "tp")), P("fsdp", "tp"))
dst = NamedSharding(Mesh(devices[4:], ("tp",)), P(None, "tp"))
host = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
src = jax.device_put(host, src_sharding)
plan = jr.plan(src, dst)
plan.start(src).result()

fresh = jr.plan(src, NamedSharding(dst.mesh, P("tp")))  # first called at exit: compiles then

def final_sync(where):
    out = plan.start(src).result()
    same = np.array_equal(np.asarray(out), host) and out.sharding == dst
    print(where, "ok" if same else "wrong", flush=True)

def first_call():
    out = fresh(src)
    print("first", "ok" if np.array_equal(np.asarray(out), host) else "wrong", flush=True)

atexit.register(first_call)
atexit.register(final_sync, "atexit")
later = threading.Timer(0.5, final_sync, ("thread",))  # still running when the main module ends
later.start()
"""


def test_a_refit_started_at_interpreter_shutdown_runs(tmp_path):
    """A refit started after the main module ended (a training thread still running, or a
    final sync in an ``atexit`` hook), when ``concurrent.futures`` takes no new work, runs on
    the caller's thread (a probe: it raised the executor's raw RuntimeError), and a plan's
    first call there compiles its programs one after another (a review: it raised too)."""
    done = _run_script(tmp_path / "shutdown.py", SHUTDOWN_SCRIPT)
    assert sorted(done.stdout.split()) == ["atexit", "first", "ok", "ok", "ok", "thread"], (
        done.stdout
    )
