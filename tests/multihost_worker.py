"""One process of a multi-process jaxreshard test (launched by tests/test_multihost.py).

    python tests/multihost_worker.py SCENARIO PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS

Runs every case of the scenario in order (the same order on every process, as the calling
convention requires) and prints ``CASE <name> OK`` after each; every process checks its own
destination shards against NumPy. Exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import sys
import threading
import time

SCENARIO, PID, NPROC, PORT, NDEV = sys.argv[1], *map(int, sys.argv[2:6])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={NDEV}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxreshard as jr  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
# The lost-peer cases shorten JAX's failure detection (heartbeat) and its wait for the lost
# peer at exit (shutdown), as the README advises for jobs that must not hang.
TIMEOUTS = {}
if os.environ.get("WORKER_FAST_FAILURE"):
    TIMEOUTS = {"heartbeat_timeout_seconds": 5, "shutdown_timeout_seconds": 5}
jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=NPROC, process_id=PID, **TIMEOUTS)

# Devices of each process, in id order (ids are not contiguous across processes).
BY_PROCESS = [
    sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
    for p in range(NPROC)
]
PROCESS_OF = {d.id: d.process_index for d in jax.devices()}


def mesh(devices: list, shape: tuple[int, ...], axes: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(devices, dtype=object).reshape(shape), axes)


def data(shape: tuple[int, ...], seed: int, dtype=np.float32) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(shape) * 100
    return values.astype(dtype)


def source(full: np.ndarray, sharding: NamedSharding, placeholder: bool = True):
    """This process's part of a global source array, as each process would hold it.

    A process holding no shard passes a ShapeDtypeStruct (or, with placeholder=False, an array
    with no addressable shards).
    """
    if not sharding.addressable_devices and placeholder:
        return jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=sharding)
    return jax.make_array_from_callback(
        full.shape, sharding, lambda index: full[index], dtype=full.dtype
    )


def check(out, expected: dict[str, np.ndarray], dsts: dict, dtypes: dict | None = None) -> int:
    """Compare this process's destination shards with NumPy; returns the number checked."""
    checked = 0
    for name, full in expected.items():
        arr = out[name]
        want_dtype = jnp.dtype((dtypes or {}).get(name) or full.dtype)
        assert arr.sharding == dsts[name], (name, arr.sharding, dsts[name])
        assert arr.dtype == want_dtype, (name, arr.dtype, want_dtype)
        assert arr.shape == full.shape, (name, arr.shape)
        want_devices = {d for d in dsts[name].device_set if d.process_index == PID}
        assert {s.device for s in arr.addressable_shards} == want_devices, name
        reference = full.astype(want_dtype)
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), reference[shard.index], name)
            checked += 1
    return checked


def ok(name: str, **info) -> None:
    extra = " ".join(f"{k}={v}" for k, v in info.items())
    print(f"CASE {name} OK {extra}".rstrip(), flush=True)


# ------------------------------------------------------------------------------ 2 x 4 cases


def case_split() -> None:
    """Trainer (fsdp2 x tp2) on process 0, sampler (tp4) on process 1; bf16 cast; a
    destination replicated on every sampler device; a second call donating the first result."""
    trainer = mesh(BY_PROCESS[0], (2, 2), ("fsdp", "tp"))
    sampler = mesh(BY_PROCESS[1], (4,), ("tp",))
    full = {
        "w_in": data((64, 48), 1),
        "w_out": data((48, 64), 2),
        "bias": data((64,), 3),
        "steps": np.arange(32 * 8, dtype=np.int32).reshape(32, 8),
    }
    srcs = {
        "w_in": NamedSharding(trainer, P("fsdp", "tp")),
        "w_out": NamedSharding(trainer, P("tp", "fsdp")),
        "bias": NamedSharding(trainer, P("fsdp")),
        "steps": NamedSharding(trainer, P(None, ("fsdp", "tp"))),
    }
    dsts = {
        "w_in": NamedSharding(sampler, P(None, "tp")),
        "w_out": NamedSharding(sampler, P("tp", None)),
        "bias": NamedSharding(sampler, P()),  # replicated on every sampler device
        "steps": NamedSharding(sampler, P("tp")),
    }
    dtypes = {"w_in": jnp.bfloat16, "w_out": jnp.bfloat16, "bias": jnp.bfloat16, "steps": None}
    tree = {k: source(full[k], srcs[k], placeholder=k != "steps") for k in full}
    plan = jr.plan(tree, dsts, dtype=dtypes)
    s = plan.stats
    assert s.bytes_local == 0 and s.bytes_sent == s.bytes_lower_bound == s.bytes_total, s
    out = plan(tree)
    n = check(out, full, dsts, dtypes)
    # Second step: new weights, donating the previous result (what a refit loop does).
    full2 = {k: v + 1 for k, v in full.items()}
    tree2 = {k: source(full2[k], srcs[k]) for k in full2}
    out2 = plan(tree2, donate=out)
    n += check(out2, full2, dsts, dtypes)
    assert n == (0 if PID == 0 else 32), n
    ok("split", checked=n, bytes_sent=s.bytes_sent, rounds=s.rounds)


def case_spanning() -> None:
    """Both meshes span both processes, with different shapes and device orders; replicas on
    both processes, so every piece must come from the receiver's own process."""
    p0, p1 = BY_PROCESS
    # Trainer: fsdp x tp = 2 x 4, row fsdp=k on process k: P("tp") replicates over processes.
    trainer = mesh(p0 + p1, (2, 4), ("fsdp", "tp"))
    # Sampler: dp x tp = 4 x 2 over an interleaved, reversed order of both processes' devices.
    order = [d for pair in zip(p1[::-1], p0, strict=True) for d in pair]
    sampler = mesh(order, (4, 2), ("dp", "tp"))
    full = {"a": data((32, 24), 4), "b": data((16, 40), 5), "c": data((8, 16, 4), 6)}
    srcs = {
        "a": NamedSharding(trainer, P("tp")),
        "b": NamedSharding(trainer, P(None, "tp")),
        "c": NamedSharding(trainer, P("fsdp", "tp")),
    }
    dsts = {
        "a": NamedSharding(sampler, P("tp", "dp")),
        "b": NamedSharding(sampler, P(("dp", "tp"))),
        "c": NamedSharding(sampler, P(None, "dp", "tp")),
    }
    tree = {k: source(full[k], srcs[k]) for k in full}
    plan = jr.plan(tree, dsts)
    # Leaves a and b have a source replica on each process: never cross processes for them.
    for piece in plan.assignment.pieces:
        if plan.leaves[piece.leaf].path in ("['a']", "['b']"):
            assert PROCESS_OF[piece.src] == PROCESS_OF[piece.dst], piece
    crossing = sum(1 for p in plan.assignment.pieces if PROCESS_OF[p.src] != PROCESS_OF[p.dst])
    assert crossing > 0  # leaf c has a single replica: some of it must cross
    out = plan(tree)
    n = check(out, full, dsts)
    assert n == 12, n
    ok("spanning", checked=n, crossing_pieces=crossing)


def case_fp8_spanning() -> None:
    """An fp8 leaf whose source spans both processes: blocks inside one source shard move
    (each process quantizes its own shards); blocks straddling shards, whose scales would
    need a collective across processes before the calls' order check (a probe hung), are
    refused by name on every process before anything runs."""
    p0, p1 = BY_PROCESS
    trainer = mesh(p0 + p1, (4, 2), ("fsdp", "tp"))
    dst = NamedSharding(mesh(p1 + p0, (8,), ("tp",)), P(None, "tp"))
    fp8 = jr.Fp8Blockwise(block=(128, 128))
    src = NamedSharding(trainer, P("fsdp", "tp"))
    full = data((512, 1024), 7)  # 128 rows per fsdp shard: every block in one shard
    out = jr.plan(source(full, src), dst, dtype=fp8)(source(full, src))
    err = np.abs(
        np.asarray(out.dequantize().addressable_shards[0].data)
        - full[out.values.addressable_shards[0].index]
    )
    assert float(err.max()) <= float(np.abs(full).max()) / 8, float(err.max())
    straddling = data((384, 1024), 8)  # 96 rows per shard: blocks cross shard and process
    try:
        jr.plan({"w": source(straddling, src)}, {"w": dst}, dtype=fp8)
    except jr.ReshardError as e:
        assert "['w']: its scales combine values of source shards held by different" in str(e)
    else:
        raise AssertionError("a quantizer with a collective across processes was planned")
    ok("fp8_spanning")


def case_reshard_cached() -> None:
    """jr.reshard every step: planned and agreed once, cached (placeholders included)."""
    trainer = mesh(BY_PROCESS[0], (4,), ("x",))
    sampler = mesh(BY_PROCESS[1], (2, 2), ("dp", "tp"))
    src_sharding = NamedSharding(trainer, P("x"))
    dst = NamedSharding(sampler, P("tp"))
    from jaxreshard.run import multihost

    before = len(jr.api._CACHE)
    agreements = sum(multihost._STATE.rounds.values())
    for step in range(3):
        full = data((16, 16), 10 + step)
        out = jr.reshard({"p": source(full, src_sharding)}, {"p": dst})
        check(out, {"p": full}, {"p": dst})
    assert len(jr.api._CACHE) == before + 1, (before, len(jr.api._CACHE))
    rounds = sum(multihost._STATE.rounds.values()) - agreements
    assert rounds == 1, f"{rounds} agreements for one plan called 3 times"
    ok("reshard_cached", agreements=rounds)


def case_key_kinds() -> None:
    """Process 0 plans rbg keys, process 1 unsafe_rbg keys: both move as four uint32 words
    per key, yet they are different plans, and both processes raise naming the leaf."""
    impl = "rbg" if PID == 0 else "unsafe_rbg"
    trainer = mesh(BY_PROCESS[0], (4,), ("fsdp",))
    sampler = mesh(BY_PROCESS[1], (4,), ("tp",))
    keys = jax.random.split(jax.random.key(0, impl=impl), 8)
    held = NamedSharding(trainer, P("fsdp"))
    if held.addressable_devices:
        tree = {"keys": jax.device_put(keys, held)}
    else:
        tree = {"keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=held)}
    plan = jr.plan(tree, {"keys": NamedSharding(sampler, P())})
    _refused("KEYS", lambda: plan(tree), lines=None)  # every line: the leaf, both dtypes
    ok("key_kinds")


def case_mismatch() -> None:
    """Process 1 passes a different destination spec for one leaf: both must raise, fast."""
    trainer = mesh(BY_PROCESS[0], (2, 2), ("fsdp", "tp"))
    sampler = mesh(BY_PROCESS[1], (4,), ("tp",))
    full = {"embed": data((32, 16), 7), "layers": {"w_in": data((16, 32), 8)}}
    srcs = {
        "embed": NamedSharding(trainer, P("fsdp", "tp")),
        "layers": {"w_in": NamedSharding(trainer, P("tp", "fsdp"))},
    }
    spec = P(None, "tp") if PID == 0 else P("tp", None)  # the mistake, on process 1 only
    dsts = {
        "embed": NamedSharding(sampler, P("tp")),
        "layers": {"w_in": NamedSharding(sampler, spec)},
    }
    tree = jax.tree.map(source, full, srcs)
    plan = jr.plan(tree, dsts)
    start = time.monotonic()
    try:
        plan(tree)
    except jr.ReshardError:
        print(f"MISMATCH raised after {time.monotonic() - start:.2f} s", flush=True)
        raise
    raise AssertionError("the mismatched plan ran")


# ------------------------------------------------------------------------------ 4 x 2 cases


def case_every_process() -> None:
    """Rows over 8 devices -> columns over the reversed order: every destination device needs a
    piece from every device, so from every process."""
    devices = [d for ds in BY_PROCESS for d in ds]
    src_mesh = mesh(devices, (8,), ("x",))
    dst_mesh = mesh(devices[::-1], (2, 4), ("dp", "tp"))
    full = {"w": data((64, 32), 11), "v": data((16, 64), 12, np.float16)}
    srcs = {"w": NamedSharding(src_mesh, P("x")), "v": NamedSharding(src_mesh, P(None, "x"))}
    dsts = {
        "w": NamedSharding(dst_mesh, P(None, ("dp", "tp"))),
        "v": NamedSharding(dst_mesh, P(("tp", "dp"))),
    }
    tree = {k: source(full[k], srcs[k]) for k in full}
    plan = jr.plan(tree, dsts, dtype={"w": jnp.bfloat16, "v": None})
    senders: dict[int, set[int]] = {}
    for piece in plan.assignment.pieces:
        senders.setdefault(piece.dst, set()).add(PROCESS_OF[piece.src])
    assert all(s == set(range(NPROC)) for s in senders.values()), senders
    out = plan(tree)
    n = check(out, full, dsts, {"w": jnp.bfloat16})
    assert n == 4, n
    ok("every_process", checked=n, bytes_sent=plan.stats.bytes_sent)


def case_subset() -> None:
    """A plan over processes 0 and 1 only: process 2 calls it (a no-op), process 3 does not."""
    src_mesh = mesh(BY_PROCESS[0], (2,), ("x",))
    dst_mesh = mesh(BY_PROCESS[1][::-1], (2,), ("x",))
    full = data((8, 6), 13)
    src, dst = NamedSharding(src_mesh, P("x")), NamedSharding(dst_mesh, P(None, "x"))
    if PID == 3:
        ok("subset", called=False)
        return
    plan = jr.plan({"w": source(full, src)}, {"w": dst})
    out = plan({"w": source(full, src)})
    n = check(out, {"w": full}, {"w": dst})
    assert n == (2 if PID == 1 else 0), n
    ok("subset", called=True, checked=n)


def case_topology() -> None:
    """Two replicas of the source, one on processes {0, 1}, one on {2, 3}: each destination
    device takes what its own process holds from itself, and the rest is spread over the two
    remote processes that hold it."""
    rows = [d for p in (0, 1) for d in BY_PROCESS[p]], [d for p in (2, 3) for d in BY_PROCESS[p]]
    src_mesh = mesh(rows[0] + rows[1], (2, 4), ("r", "s"))
    dst_mesh = mesh([d for ds in BY_PROCESS for d in ds], (8,), ("x",))
    full = data((64, 64), 14)
    src, dst = NamedSharding(src_mesh, P("s")), NamedSharding(dst_mesh, P(None, "x"))
    plan = jr.plan({"w": source(full, src)}, {"w": dst})
    leaf = plan.leaves[0]
    remote_bytes: dict[int, int] = {}
    for piece in plan.assignment.pieces:
        holders = {
            PROCESS_OF[d]
            for d, box in zip(leaf.src.devices, leaf.src.boxes, strict=True)
            if box[0][0] <= piece.box[0][0] < box[0][1]
        }
        if PROCESS_OF[piece.dst] in holders:
            assert PROCESS_OF[piece.src] == PROCESS_OF[piece.dst], piece
        else:
            n = (piece.box[0][1] - piece.box[0][0]) * (piece.box[1][1] - piece.box[1][0])
            remote_bytes[PROCESS_OF[piece.src]] = remote_bytes.get(PROCESS_OF[piece.src], 0) + n * 4
    assert len(remote_bytes) == NPROC and max(remote_bytes.values()) == min(
        remote_bytes.values()
    ), remote_bytes
    out = plan({"w": source(full, src)})
    n = check(out, {"w": full}, {"w": dst})
    ok("topology", checked=n, remote_bytes_per_process=sorted(remote_bytes.values()))


def case_crossed() -> None:
    """Processes 0 and 1 call two plans in opposite orders: A over processes {0, 1} and B over
    all four. Nobody may hang: 0 and 1 each see the other blocked in the other plan; 2 and 3,
    waiting in B, see process 0 fail."""
    devices = [d for ds in BY_PROCESS for d in ds]
    full = data((16, 8), 15)
    a_src = NamedSharding(mesh(BY_PROCESS[0], (2,), ("x",)), P("x"))
    a_dst = NamedSharding(mesh(BY_PROCESS[1], (2,), ("x",)), P(None, "x"))
    b_src = NamedSharding(mesh(devices, (8,), ("x",)), P("x"))
    b_dst = NamedSharding(mesh(devices[::-1], (8,), ("x",)), P("x"))
    calls = []
    for name, src, dst in (("A", a_src, a_dst), ("B", b_src, b_dst)):
        if name == "B" or PID in (0, 1):
            tree = {"w": source(full, src)}
            calls.append((name, jr.plan(tree, {"w": dst}), tree))
    if PID == 1:
        calls.reverse()
    start = time.monotonic()
    try:
        for _, plan, tree in calls:
            plan(tree)
    except jr.ReshardError:
        print(f"CROSSED raised after {time.monotonic() - start:.2f} s", flush=True)
        raise
    raise AssertionError("plans called in different orders ran")


# --------------------------------------------------------------------- every call's order


def _two_plans():
    """Plans A and B over both processes (trainer on 0, sampler on 1), and their sources."""
    trainer = mesh(BY_PROCESS[0], (2, 2), ("fsdp", "tp"))
    sampler = mesh(BY_PROCESS[1], (4,), ("tp",))
    full = {"a": data((16, 8), 21), "b": data((8, 32), 22)}
    out = {}
    for name, spec in (("a", P("tp")), ("b", P(None, "tp"))):
        tree = {name: source(full[name], NamedSharding(trainer, P("fsdp", "tp")))}
        dst = {name: NamedSharding(sampler, spec)}
        out[name] = (jr.plan(tree, dst), tree, dst, {name: full[name]})
    return out


def case_order_ok() -> None:
    """Many calls of two plans in the same order (calls and starts): every call is checked."""
    plans = _two_plans()
    for step in range(12):
        for name in ("a", "b") if step % 2 else ("b", "a"):
            plan, tree, dst, full = plans[name]
            out = plan.start(tree).result() if step % 3 == 0 else plan(tree)
            check(out, full, dst)
    ok("order_ok", calls=24)


def case_order_refused() -> None:
    """Process 0 refuses a call in its own checks (a source of another shape): process 1's
    same call raises naming that, and the next calls pair up again."""
    plans = _two_plans()
    plan, tree, dst, full = plans["a"]
    plan(tree)  # agreed
    bad = dict(tree)
    if PID == 0:
        bad["a"] = jax.device_put(np.zeros((8, 8), np.float32), tree["a"].sharding)
    _refused("REFUSED", lambda: plan(bad))
    check(plan(tree), full, dst)  # in step again
    ok("order_refused")


def case_order_refused_keeps_donations() -> None:
    """(A review, 2026-12-07.) Process 0 refuses a call in its own checks while process 1
    makes it with ``donate=`` its previous result, one leaf of it in host memory (freed, not
    written in place): process 1's call raises and both its donated leaves survive (the one
    bound for host memory had been deleted first); its next call takes them."""
    trainer = NamedSharding(mesh(BY_PROCESS[0], (4,), ("x",)), P("x"))
    sampler_mesh = mesh(BY_PROCESS[1], (4,), ("x",))
    dst = {
        "dev": NamedSharding(sampler_mesh, P("x")),
        "host": NamedSharding(sampler_mesh, P("x"), memory_kind="pinned_host"),
    }
    full = {"dev": data((16, 8), 91), "host": data((16, 8), 92)}
    tree = {k: source(v, trainer) for k, v in full.items()}
    plan = jr.plan(tree, dst)
    out = plan(tree)
    bad = dict(tree)
    if PID == 0:
        bad["dev"] = source(data((16, 8), 93, np.int32), trainer)
    _refused("DONATED", lambda: plan(bad, donate=out if PID == 1 else None))
    if PID == 1:
        assert not any(x.is_deleted() for x in out.values()), "a refused call took donations"
    new = plan(tree, donate=out if PID == 1 else None)
    if PID == 1:
        assert all(x.is_deleted() for x in out.values())
        check(new, full, dst)
    ok("order_refused_keeps_donations")


def case_order_refused_behind_a_refit() -> None:
    """(A review, 2026-12-07.) Process 1 starts a refit donating its previous result, then
    calls another plan on an array over that result's buffers (the same devices under other
    axis names). The call waits behind the refit, which process 0 joins late, and finds its
    source consumed: refused there, and process 0's same call raises naming it (it paired
    with process 1's next call, a step apart from then on); the next calls pair up."""
    trainer = mesh(BY_PROCESS[0], (2, 2), ("fsdp", "tp"))
    sampler = mesh(BY_PROCESS[1], (2, 2), ("a", "b"))
    renamed = mesh(BY_PROCESS[1], (2, 2), ("x", "y"))
    there = {"w": NamedSharding(sampler, P(None, "b"))}
    back_src, back = NamedSharding(renamed, P(None, "y")), {"w": NamedSharding(trainer, P())}
    full = data((16, 16), 61)
    tree = {"w": source(full, NamedSharding(trainer, P("fsdp", "tp")))}
    forth = jr.plan(tree, there)
    spare = forth(tree)
    returning = jr.plan({"w": source(full, back_src)}, back)
    check(returning({"w": source(full, back_src)}), {"w": full}, back)
    if PID == 1:
        alias = jax.device_put(spare["w"], back_src)  # (no copy: the same buffers)
        refit = forth.start(tree, donate=spare)
        _refused("BEHIND", lambda: returning({"w": alias}))
        check(refit.result(), {"w": full}, there)
    else:
        time.sleep(2)  # (the refit stays in flight on process 1 meanwhile)
        forth(tree)
        _refused("BEHIND", lambda: returning({"w": source(full, back_src)}))
    check(returning({"w": source(full + 1, back_src)}), {"w": full + 1}, back)
    ok("order_refused_behind_a_refit")


def case_order_fallback() -> None:
    """(A fuzz.) A plan with a NumPy step counter sent to every device by
    ``fallback="device_put"``, whose copy runs a collective (jax.device_put of a host value
    checks it equal on every process). Process 1 refuses call 2 (a placeholder of another
    shape): process 0's call 2 raises naming it, and calls 3 and 4 (a call and a start) pair
    up again, each with its own step's weights. The copy ran before the order check: process
    0 then failed in it, every later call failed, and the last hung."""
    trainer = mesh(BY_PROCESS[0], (4,), ("x",))
    sampler = mesh(BY_PROCESS[1], (4,), ("x",))
    every = mesh(BY_PROCESS[0] + BY_PROCESS[1], (8,), ("x",))
    dst = {"w": NamedSharding(sampler, P(None, "x")), "step": NamedSharding(every, P())}

    def tree(step: int, bad: bool = False) -> dict:
        full = data((8, 8), 30) + step
        w = source(full, NamedSharding(trainer, P("x")))
        if bad:
            w = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=w.sharding)
        return {"w": w, "step": np.int32(step)}

    def want(step: int) -> dict:
        return {"w": data((8, 8), 30) + step, "step": np.int32(step)}

    plan = jr.plan(tree(0), dst, fallback="device_put")
    check(plan(tree(1)), want(1), dst)
    _refused("FALLBACK", lambda: plan(tree(2, bad=PID == 1)))
    check(plan(tree(3)), want(3), dst)
    check(plan.start(tree(4)).result(), want(4), dst)
    ok("order_fallback")


def case_order_fallback_only() -> None:
    """(A fuzz.) A plan of one NumPy counter sent to every device by
    ``fallback="device_put"`` alone: no leaf the plan moves itself, yet its copy is a
    collective. Process 1 refuses call 2 (a string): process 0's call 2 raises naming it,
    and calls 3 and 4 pair up. Such a plan involved no process, so nothing was order-checked:
    process 0's copy paired with process 1's call 3, both then failed in JAX's equality
    check, and the last call hung."""
    every = mesh(BY_PROCESS[0] + BY_PROCESS[1], (8,), ("x",))
    dst = {"count": NamedSharding(every, P())}
    plan = jr.plan({"count": np.int32(0)}, dst, fallback="device_put")
    check(plan({"count": np.int32(1)}), {"count": np.int32(1)}, dst)
    _refused("ALONE", lambda: plan({"count": "two" if PID == 1 else np.int32(2)}))
    check(plan({"count": np.int32(3)}), {"count": np.int32(3)}, dst)
    check(plan.start({"count": np.int32(4)}).result(), {"count": np.int32(4)}, dst)
    ok("order_fallback_only")


def case_order_first_refused() -> None:
    """(A fuzz.) A plan's first call refused on process 0 (a source of another dtype): process
    1's first call raises naming it, and the next calls pair up, each with its own step's
    weights. The refusal took no place in the order (it came before the plan agreed):
    process 1's call paired with process 0's next one and returned that step's weights."""
    trainer = mesh(BY_PROCESS[0], (4,), ("x",))
    sampler = mesh(BY_PROCESS[1], (4,), ("x",))
    # (Its own leaf name: a plan of the same layout agreed earlier would make this one agreed.)
    dst = {"first": NamedSharding(sampler, P(None, "x"))}

    def tree(step: int, bad: bool = False) -> dict:
        full = data((8, 8), 50) + step
        return {
            "first": source(full.astype(np.int32) if bad else full, NamedSharding(trainer, P("x")))
        }

    plan = jr.plan(tree(0), dst)
    os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"] = "10"  # a lost refusal fails in seconds
    try:
        _refused("FIRST", lambda: plan(tree(1, bad=PID == 0)))
        for step in (2, 3):
            check(plan(tree(step)), {"first": data((8, 8), 50) + step}, dst)
    finally:
        del os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"]
    ok("order_first_refused")


def case_order_unplanned() -> None:
    """(A fuzz.) A `jr.reshard` refit loop whose step-1 call process 0 refuses before it finds
    a plan (a dst_shardings tree of another structure): process 1's same call raises naming
    it, and the next steps pair up, each with its own weights. Process 1 returned step 2's
    weights for step 1, silently, and stayed one step apart."""
    _reshard_refused_at_step_1("UNPLANNED", "unplanned", called_before=True)
    ok("order_unplanned")


def case_order_unplanned_first() -> None:
    """(A fuzz.) The same refusal at the layout's very first call: no plan, so no call to take
    the place of, but the agreement round of the processes the trees name is given up, so
    process 1's first call raises naming it, and the next calls pair up."""
    _reshard_refused_at_step_1("UNPLANNED_FIRST", "fresh", called_before=False)
    ok("order_unplanned_first")


def _reshard_refused_at_step_1(name: str, leaf: str, called_before: bool) -> None:
    """`jr.reshard` of one leaf named ``leaf`` (its own name: its own plan), at step 0 (where
    ``called_before``) and steps 1-3, process 0 passing a dst_shardings tree of another
    structure at step 1; each step's weights checked."""
    trainer = mesh(BY_PROCESS[0], (4,), ("x",))
    sampler = {leaf: NamedSharding(mesh(BY_PROCESS[1], (4,), ("x",)), P(None, "x"))}

    def tree(step: int) -> dict:
        return {leaf: source(data((8, 8), 51) + step, NamedSharding(trainer, P("x")))}

    if called_before:
        check(jr.reshard(tree(0), sampler), {leaf: data((8, 8), 51)}, sampler)
    bad = {"other": sampler[leaf]} if PID == 0 else sampler
    os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"] = "10"  # a lost refusal fails in seconds
    try:
        _refused(name, lambda: jr.reshard(tree(1), bad))
        for step in (2, 3):
            check(jr.reshard(tree(step), sampler), {leaf: data((8, 8), 51) + step}, sampler)
    finally:
        del os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"]


def _refused(name: str, call, lines: int | None = 2) -> None:
    """Run ``call``, which must raise `ReshardError`; print its first ``lines`` lines (None:
    all) as one line."""
    try:
        call()
    except jr.ReshardError as e:
        print(f"{name} {PID}: {' '.join(str(e).splitlines()[:lines])}", flush=True)
    else:
        raise AssertionError(f"{name}: the call ran")


def case_order_refusals() -> None:
    """Every kind of refusal after agreement takes its place in the order of calls, so the
    peer's same call raises and the next calls pair up (each step's weights differ, so a call
    paired with another step's would fail the check): a donate= tree still donated to a
    plan.start in flight (process 1), verify=True (both), an Fp8Blockwise plan's own source
    check (process 0); then a call process 0 gives up on (its order check times out) raises
    on process 1, which makes it late, instead of entering the transfer alone."""
    plans = _two_plans()
    plan, tree, dst, full = plans["a"]
    out = plan(tree)
    check(out, full, dst)
    # A donate= tree still in flight: refused on process 1, raised on process 0.
    refit = plan.start(tree, donate=out if PID == 1 else None)
    _refused("IN_FLIGHT", lambda: plan(tree, donate=out if PID == 1 else None))
    check(refit.result(), full, dst)
    _refused("VERIFY", lambda: plan(tree, verify=True))
    step = {k: v + 1 for k, v in full.items()}
    stepped = {k: source(v, tree[k].sharding) for k, v in step.items()}
    check(plan(stepped), step, dst)
    # An fp8 plan: process 1 holds no source shard and passes a placeholder.
    fp8 = jr.Fp8Blockwise(block=(4, 4))
    q = jr.plan(tree, dst, dtype=fp8)
    q(tree)  # agreed
    bad = dict(tree)
    if PID == 0:
        bad["a"] = jax.device_put(np.zeros((8, 8), np.float32), tree["a"].sharding)
    _refused("FP8", lambda: q(bad))
    q(tree)
    check(plan(stepped), step, dst)
    # A call given up by process 0 (a short timeout), made late by process 1.
    os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"] = "2"
    try:
        if PID == 1:
            time.sleep(4)
        _refused("GIVEN_UP", lambda: plan(tree))
    finally:
        del os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"]
    check(plan(stepped), step, dst)  # in step again
    ok("order_refusals")


def case_crossed_groups() -> None:
    """Plan A over processes {0, 1}, plan B over {0, 1, 2}, both agreed; then process 0 calls
    A then B, process 1 B then A: each group's call numbers agree, yet 0 waits in A for 1,
    which waits in B for 0. Both raise within a few polls (not at the timeout), naming the
    crossing; process 0's B then raises naming the given-up call, and so does process 2's (it
    was waiting for both in B). WORKER_LATE names a process that makes its crossed call half a
    poll after the others: the one that arrives later finds the crossing first."""
    a_src = mesh(BY_PROCESS[0], (2,), ("x",))
    a_dst = mesh(BY_PROCESS[1], (2,), ("x",))
    b_src = mesh(BY_PROCESS[0] + BY_PROCESS[1], (4,), ("x",))
    b_dst = mesh(BY_PROCESS[2] + BY_PROCESS[1], (4,), ("x",))
    full = data((8, 8), 41)
    tree_a = {"a": source(full, NamedSharding(a_src, P("x")))}
    tree_b = {"b": source(full, NamedSharding(b_src, P("x")))}
    plan_a = jr.plan(tree_a, {"a": NamedSharding(a_dst, P(None, "x"))})
    plan_b = jr.plan(tree_b, {"b": NamedSharding(b_dst, P(None, "x"))})
    if PID in (0, 1):
        plan_a(tree_a)
    plan_b(tree_b)  # both agreed
    if os.environ.get("WORKER_LATE") == str(PID):
        time.sleep(0.5)
    start = time.monotonic()
    if PID == 0:
        _refused("CROSSED_A", lambda: plan_a(tree_a))
        _refused("GAVE_UP_B", lambda: plan_b(tree_b))
    elif PID == 1:
        _refused("CROSSED_B", lambda: plan_b(tree_b))
    else:
        _refused("GAVE_UP_B", lambda: plan_b(tree_b))
    print(f"CROSSED_GROUPS raised after {time.monotonic() - start:.2f} s", flush=True)
    ok("crossed_groups")


def case_crossed_new() -> None:
    """(A fuzz.) Process 0 calls an agreed plan A while process 1 makes a new plan B's first
    call: each waited for the other the whole agreement timeout (300 s), then they were one
    call apart. Both raise within a few polls, each naming the other's call; both count the
    crossed call of A as made (B's first call stood in its place on process 1), and then
    calls of A and B pair up. WORKER_LATE names a process that arrives half a poll after the
    other."""
    plans = _two_plans()
    a, tree_a, dst_a, full_a = plans["a"]
    b, tree_b, dst_b, full_b = plans["b"]
    check(a(tree_a), full_a, dst_a)  # A agreed; B not yet
    if os.environ.get("WORKER_LATE") == str(PID):
        time.sleep(0.5)
    start = time.monotonic()
    if PID == 0:
        _refused("CROSSNEW_A", lambda: a(tree_a))
    else:
        _refused("CROSSNEW_B", lambda: b(tree_b))
    print(f"CROSSNEW {PID} raised after {time.monotonic() - start:.2f} s", flush=True)
    check(a(tree_a), full_a, dst_a)
    check(b(tree_b), full_b, dst_b)
    check(a(tree_a), full_a, dst_a)
    ok("crossed_new")


def case_crossed_substituted() -> None:
    """(A fuzz.) A refit loop of `jr.reshard`, one call a step, whose step-1 call process 1
    makes with an int32 source (a slip on one process: a plan of its own) while process 0
    calls the agreed float32 plan. Both raise at step 1, and steps 2 and 3 pair up step for
    step, each with its own weights. (Process 1 raised again at step 2, process 0 did not,
    and from step 3 on process 1 returned the step before's weights, silently.)"""
    trainer = NamedSharding(mesh(BY_PROCESS[0], (4,), ("x",)), P("x"))
    sampler = {"s": NamedSharding(mesh(BY_PROCESS[1], (4,), ("x",)), P(None, "x"))}

    def full(step: int) -> dict:
        return {"s": data((8, 16), 61) + 1000 * step}

    def tree(step: int, dtype=np.float32) -> dict:
        return {"s": source(full(step)["s"].astype(dtype), trainer)}

    check(jr.reshard(tree(0), sampler), full(0), sampler)
    if os.environ.get("WORKER_LATE") == str(PID):
        time.sleep(0.5)
    os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"] = "10"  # a lost call fails in seconds
    try:
        slip = np.int32 if PID == 1 else np.float32
        _refused("SUBSTITUTED", lambda: jr.reshard(tree(1, slip), sampler))
        for step in (2, 3):
            check(jr.reshard(tree(step), sampler), full(step), sampler)
    finally:
        del os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"]
    ok("crossed_substituted")


def case_refused_extra_leaf() -> None:
    """(A third fuzz.) A refit loop of `jr.reshard` in which process 0's tree at step 1 has
    one extra leaf whose destination sharding does not fit (refused before a plan, and a
    source layout with no plan cached) while process 1 calls the agreed plan: the refusal
    gave up an agreement round, process 1's call of step 1 paired with process 0's call of
    step 2, and each later step on process 1 returned the next step's weights, silently. It
    now takes the place of process 1's call (seen waiting), both raise at step 1 and steps 2
    and 3 pair up. Then (a fourth fuzz, each step with the late process 0.3 s behind): both
    processes pass that tree (the earlier one took the later one's next call, a step apart
    again, silently), process 1 alone passes it (it waited the whole timeout for a peer whose
    refusal of the step before it no longer read), each passes a bad tree of its own (both
    waited the whole timeout, then were a step apart): each raises within seconds and the
    next step pairs up."""
    trainer = NamedSharding(mesh(BY_PROCESS[0], (4,), ("x",)), P("x"))
    sampler_mesh = mesh(BY_PROCESS[1], (4,), ("x",))
    sampler = {"e": NamedSharding(sampler_mesh, P(None, "x"))}
    bad = {**sampler, "z": NamedSharding(sampler_mesh, P(None, "x"))}  # 6 columns over 4

    def full(step: int) -> dict:
        return {"e": data((8, 16), 81) + 1000 * step}

    def tree(step: int, extra: bool = False) -> dict:
        out = {"e": source(full(step)["e"], trainer)}
        if extra:
            out["z"] = source(data((8, 6), 82), trainer)
        return out

    check(jr.reshard(tree(0), sampler), full(0), sampler)
    if os.environ.get("WORKER_LATE") == str(PID):
        time.sleep(0.5)
    os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"] = "10"  # a lost call fails in seconds
    try:
        if PID == 0:
            _refused("EXTRA", lambda: jr.reshard(tree(1, extra=True), bad))
        else:
            _refused("EXTRA", lambda: jr.reshard(tree(1), sampler))
        for step in (2, 3):
            check(jr.reshard(tree(step), sampler), full(step), sampler)
        late = os.environ.get("WORKER_LATE") == str(PID)
        for name, step, slip in (
            ("EXTRA_BOTH", 4, (True, True)),  # the same bad tree on both
            ("EXTRA_ALONE", 6, (False, True)),  # then process 1 alone (a peer refused before)
            ("EXTRA_OTHER", 8, (True, "other")),  # each its own bad tree
        ):
            if late:
                time.sleep(0.3)
            start = time.monotonic()
            mine = slip[PID]
            if mine == "other":
                _refused(name, lambda s=step: jr.reshard(tree(s), {"other": sampler["e"]}))
            elif mine:
                _refused(name, lambda s=step: jr.reshard(tree(s, extra=True), bad))
            else:
                _refused(name, lambda s=step: jr.reshard(tree(s), sampler))
            print(f"{name} {PID} raised after {time.monotonic() - start:.2f} s", flush=True)
            check(jr.reshard(tree(step + 1), sampler), full(step + 1), sampler)
    finally:
        del os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"]
    ok("refused_extra_leaf")


def case_start_then_first_call() -> None:
    """(A fuzz.) Plans C and D made on both processes and called in the same order: step 1's
    call of C, then D's first call. Process 0 makes its call of C with `Plan.start` and reads
    the result after D's. D's agreement ran at once, before the worker had issued C's call:
    both processes raised on three calls. It now runs after the refits started before. (The
    worker issues C's call 2 s late here, so that process 1 is seen waiting in it: without
    that delay the worker usually won the race and the bug went unseen.)"""
    trainer = mesh(BY_PROCESS[0], (2, 2), ("fsdp", "tp"))
    sampler = mesh(BY_PROCESS[1], (4,), ("tp",))
    full = {"c": data((16, 24), 71), "d": data((24, 8), 72)}
    made = {}
    for name in full:
        tree = {name: source(full[name], NamedSharding(trainer, P("tp", "fsdp")))}
        dst = {name: NamedSharding(sampler, P("tp"))}
        made[name] = (jr.plan(tree, dst), tree, dst, {name: full[name]})
    c, tree_c, dst_c, full_c = made["c"]
    d, tree_d, dst_d, full_d = made["d"]
    check(c(tree_c), full_c, dst_c)
    os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"] = "10"  # a lost call fails in seconds
    try:
        if PID == 0:
            issue = jr.api.check_order

            def late(*args, **kwargs):
                if threading.current_thread().name.startswith("jaxreshard"):  # the worker
                    time.sleep(2.0)
                return issue(*args, **kwargs)

            jr.api.check_order = late
            try:
                refit = c.start(tree_c)
                check(d(tree_d), full_d, dst_d)
                check(refit.result(), full_c, dst_c)
            finally:
                jr.api.check_order = issue
        else:
            check(c(tree_c), full_c, dst_c)
            check(d(tree_d), full_d, dst_d)
        check(c(tree_c), full_c, dst_c)
        check(d(tree_d), full_d, dst_d)
    finally:
        del os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"]
    ok("start_then_first_call")


def case_order_remade() -> None:
    """A plan made again (identical, so agreed already) whose first call process 0 refuses:
    process 1's same call raises naming it at once, and the next calls pair up (it waited
    for the agreement timeout, or paired with process 0's next call: another step's data)."""
    plan, tree, dst, full = _two_plans()["a"]
    check(plan(tree), full, dst)
    again = jr.plan(tree, dst)  # the same plan, another object
    bad = dict(tree)
    if PID == 0:
        bad["a"] = jax.device_put(np.zeros((8, 8), np.float32), tree["a"].sharding)
    start = time.monotonic()
    os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"] = "10"  # a lost refusal fails in seconds
    try:
        _refused("REMADE", lambda: again(bad))
        print(f"REMADE {PID} raised after {time.monotonic() - start:.2f} s", flush=True)
        step = {k: v + 2 for k, v in full.items()}
        check(again({k: source(v, tree[k].sharding) for k, v in step.items()}), step, dst)
    finally:
        del os.environ["JAXRESHARD_AGREEMENT_TIMEOUT_S"]
    ok("order_remade")


def case_order_threads() -> None:
    """Two threads per process, one calling plan A, the other plan B, at once (a probe saw
    every process hang inside XLA's collectives, two calls' steps interleaved): the calls of
    one process run one at a time, so each thread's calls either all run (exact) or one is
    refused as crossed (ReshardError), never a hang."""
    import threading

    plans = _two_plans()
    for name in ("a", "b"):
        plan, tree, dst, full = plans[name]
        check(plan(tree), full, dst)  # agreed, one after the other
    results: dict[str, str] = {}

    def calls(name: str) -> None:
        plan, tree, dst, full = plans[name]
        try:
            for _ in range(20):
                check(plan(tree), full, dst)
            results[name] = "ran"
        except jr.ReshardError:
            results[name] = "refused"
        except BaseException as e:  # (reported below)
            results[name] = repr(e)

    threads = [threading.Thread(target=calls, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results.values()) <= {"ran", "refused"}, results
    print(f"THREADS {sorted(results.items())}", flush=True)
    ok("order_threads")


def case_order_swapped() -> None:
    """After agreeing on both plans, process 1 calls them in the other order: both raise."""
    plans = _two_plans()
    for name in ("a", "b"):
        plan, tree, _, _ = plans[name]
        plan(tree)
    names = ["a", "b"] if PID == 0 else ["b", "a"]
    start = time.monotonic()
    try:
        for name in names:
            plan, tree, _, _ = plans[name]
            plan(tree)
    except jr.ReshardError:
        print(f"ORDER raised after {time.monotonic() - start:.2f} s", flush=True)
        raise
    raise AssertionError("plans called in different orders ran")


def case_lost() -> None:
    """Process 1 dies between two refits; process 0's next call names it within the timeout
    (JAXRESHARD_AGREEMENT_TIMEOUT_S, set by the test) instead of waiting in a collective."""
    plans = _two_plans()
    plan, tree, dst, full = plans["a"]
    for _ in range(3):
        check(plan(tree), full, dst)
    if PID == 1:
        print("LOST: process 1 exits now", flush=True)
        os._exit(17)
    start = time.monotonic()
    try:
        plan(tree)
    except jr.ReshardError:
        print(f"LOST raised after {time.monotonic() - start:.2f} s", flush=True)
        raise
    raise AssertionError("a call with a lost peer ran")


def case_lost_in_transfer() -> None:
    """Process 1 dies while refits are in flight: process 0 must not hang (what stops it, and
    when, is printed for the test: an error from the collective or JAX's heartbeat)."""
    trainer = mesh(BY_PROCESS[0], (4,), ("x",))
    sampler = mesh(BY_PROCESS[1], (4,), ("x",))
    full = data((4096, 1024), 31)
    tree = {"w": source(full, NamedSharding(trainer, P("x")))}
    plan = jr.plan(tree, {"w": NamedSharding(sampler, P(None, "x"))}, bucket_bytes=1 << 18)
    out = plan(tree)
    jax.block_until_ready(out)
    if PID == 1:
        import threading

        threading.Timer(0.5, lambda: os._exit(17)).start()
    start = time.monotonic()
    try:
        for _ in range(10_000):
            out = plan(tree, donate=out)
            jax.block_until_ready(out)
    except Exception as e:
        print(
            f"IN_TRANSFER raised {type(e).__name__} after {time.monotonic() - start:.2f} s: "
            f"{str(e).splitlines()[0][:300]}",
            flush=True,
        )
        raise
    raise AssertionError("10000 refits ran with a lost peer")


SCENARIOS = {
    "2x4": [case_split, case_spanning, case_fp8_spanning, case_reshard_cached, case_mismatch],
    "keys": [case_key_kinds],  # alone: after a failed agreement, the next may fail too
    "4x2": [case_every_process, case_subset, case_topology, case_crossed],
    "order": [
        case_order_ok,
        case_order_refused,
        case_order_refused_keeps_donations,
        case_order_refused_behind_a_refit,
        case_order_fallback,
        case_order_fallback_only,
        case_order_refusals,
        case_order_first_refused,
        case_order_unplanned,
        case_order_unplanned_first,
        case_order_threads,
        case_order_swapped,
    ],
    "remade": [case_order_remade],
    "crossed_groups": [case_crossed_groups],
    "crossed_new": [
        case_crossed_new,
        case_crossed_substituted,
        case_start_then_first_call,
        case_refused_extra_leaf,
    ],
    "lost": [case_lost],
    "lost_in_transfer": [case_lost_in_transfer],
}

if __name__ == "__main__":
    start = time.monotonic()
    for case in SCENARIOS[SCENARIO]:
        case()
    print(f"ALL OK in {time.monotonic() - start:.1f} s", flush=True)
    jax.distributed.shutdown()
