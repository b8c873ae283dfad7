"""One process of a multi-process layout test (launched by tests/test_multiprocess_layouts.py).

    python tests/multiprocess_layouts_worker.py SCENARIO PROCESS_ID NUM_PROCESSES PORT DEVICES

Runs every case of the scenario in order (the same order on every process, as the calling
convention requires) and prints ``CASE <name> OK`` after each. Every process regenerates each
full global array from a seed with NumPy, and checks the destination shards it holds against
slices of it (``shard.index``), bit for bit; ``plan.stats.bytes_sent`` is checked against the
lower bound of tests/oracles.py (from ``devices_indices_map`` alone). Exits non-zero, with a
traceback, on the first failure.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Iterator

SCENARIO, PID, NPROC, PORT, NDEV = sys.argv[1], *map(int, sys.argv[2:6])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={NDEV}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: the oracles

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from oracles import jax_lower_bound_bytes  # noqa: E402

import jaxreshard as jr  # noqa: E402
from jaxreshard.planning import whole  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=NPROC, process_id=PID)

# Devices of each process, in id order (ids are not contiguous across processes), and all of
# them in process order: GLOBAL[k] is "global device k" of the test's description.
BY_PROCESS = [
    sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
    for p in range(NPROC)
]
GLOBAL = [d for ds in BY_PROCESS for d in ds]
assert len(GLOBAL) == NPROC * NDEV, (len(GLOBAL), NPROC, NDEV)


def mesh(devices: list, shape: tuple[int, ...], axes: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(devices, dtype=object).reshape(shape), axes)


def oracle(shape: tuple[int, ...], dtype, seed: int, normal: bool = False) -> np.ndarray:
    """The full global array, the same on every process: random bits of the dtype (NaN
    payloads included for floats), 0/1 for bool, or (``normal``, for leaves that are cast:
    a NaN's payload need not survive a cast) normal values."""
    dtype = np.dtype(jnp.dtype(dtype))
    rng = np.random.default_rng(seed)
    if normal:
        return (rng.standard_normal(shape) * 100).astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    n = int(np.prod(shape, dtype=np.int64))
    raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def source(full: np.ndarray, sharding: NamedSharding):
    """This process's part of a global source array (a placeholder where it holds none)."""
    if not sharding.addressable_devices:
        return jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=sharding)
    return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])


def cast(full: np.ndarray, dtype) -> np.ndarray:
    """What the destination must hold: NumPy's (ml_dtypes') cast, or the bits as they are."""
    return full if dtype is None else full.astype(jnp.dtype(dtype))


def check(out: dict, expected: dict[str, np.ndarray], dsts: dict) -> int:
    """This process's destination shards against NumPy slicing, bit for bit; the count."""
    checked = 0
    for name, want in expected.items():
        arr = out[name]
        assert arr.sharding == dsts[name], (name, arr.sharding, dsts[name])
        assert arr.shape == want.shape and jnp.dtype(arr.dtype) == want.dtype, (
            name,
            arr.shape,
            arr.dtype,
            want.shape,
            want.dtype,
        )
        mine = {d for d in dsts[name].device_set if d.process_index == PID}
        assert {s.device for s in arr.addressable_shards} == mine, name
        for shard in arr.addressable_shards:
            got = np.asarray(shard.data)
            ref = np.array(want[shard.index])
            assert got.shape == ref.shape, (name, shard.device, got.shape, ref.shape)
            assert got.tobytes() == ref.tobytes(), f"{name}: shard on {shard.device} differs"
            checked += 1
    return checked


def expected_bytes(full: dict, srcs: dict, dsts: dict, dtypes: dict) -> int:
    """Sum over leaves and destination devices of the bytes of its shard that the same device
    does not hold in the source layout (tests/oracles.py; wire itemsize of the destination
    dtype, at least one byte)."""
    total = 0
    for name, host in full.items():
        want = jnp.dtype(dtypes.get(name) or host.dtype)
        total += jax_lower_bound_bytes(srcs[name], dsts[name], host.shape, max(1, want.itemsize))
    return total


TIMES: dict[str, float] = {}


def move(full: dict, srcs: dict, dsts: dict, dtypes: dict, steps: int = 2, **options):
    """Plan, call ``steps`` times (new data each step, donating the previous result), check
    every step and the byte count; returns the number of shards checked and the plan."""
    dtype_tree = {k: dtypes.get(k) for k in full}
    tree = {k: source(full[k], srcs[k]) for k in full}
    t0 = time.monotonic()
    plan = jr.plan(tree, dsts, dtype=dtype_tree, **options)
    TIMES["plan"] = time.monotonic() - t0
    TIMES["programs"] = plan.stats.programs
    lower = expected_bytes(full, srcs, dsts, dtypes)
    assert plan.stats.bytes_sent == lower, (plan.stats.bytes_sent, lower)
    assert plan.stats.bytes_lower_bound == lower, (plan.stats.bytes_lower_bound, lower)
    out, checked = None, 0
    for step in range(steps):
        data = full if step == 0 else {k: np.roll(v, step) for k, v in full.items()}
        tree = {k: source(data[k], srcs[k]) for k in data}
        t0 = time.monotonic()
        out = plan(tree, donate=out)
        jax.block_until_ready(out)
        TIMES[f"call{step}"] = time.monotonic() - t0
        checked += check(out, {k: cast(v, dtypes.get(k)) for k, v in data.items()}, dsts)
        for k, v in tree.items():  # the sources are intact after the call
            if isinstance(v, jax.Array):
                assert not v.is_deleted(), k
    return checked, plan


def crossings(plan) -> tuple[int, int]:
    """Sent pieces (between processes, within one process)."""
    process_of = {d.id: d.process_index for d in GLOBAL}
    across = sum(1 for p in plan.assignment.pieces if process_of[p.src] != process_of[p.dst])
    return across, len(plan.assignment.pieces) - across


def ok(name: str, **info) -> None:
    extra = " ".join(f"{k}={v}" for k, v in info.items())
    print(f"CASE {name} OK {extra}".rstrip(), flush=True)


def model(seed: int) -> dict[str, np.ndarray]:
    """A small transformer-like tree (fp32 weights, a bias, an int step counter)."""
    return {
        "embed": oracle((64, 32), np.float32, seed, normal=True),
        "w_in": oracle((32, 64), np.float32, seed + 1, normal=True),
        "w_out": oracle((64, 32), np.float32, seed + 2, normal=True),
        "norm": oracle((32,), np.float32, seed + 3, normal=True),
        "step": oracle((8, 4), np.int32, seed + 4),
    }


BF16 = {"embed": jnp.bfloat16, "w_in": jnp.bfloat16, "w_out": jnp.bfloat16, "norm": jnp.bfloat16}


# --------------------------------------------------------------------------- 8 x 1 cases


def case_one_device_per_process_disjoint() -> None:
    """Trainer fsdp2 x tp2 on processes 0-3, sampler dp2 x tp2 on processes 4-7, bf16 cast, a
    donated second step. Every byte crosses processes."""
    trainer = mesh(GLOBAL[:4], (2, 2), ("fsdp", "tp"))
    sampler = mesh(GLOBAL[4:], (2, 2), ("dp", "tp"))
    full = model(100)
    srcs = {
        "embed": NamedSharding(trainer, P("fsdp", "tp")),
        "w_in": NamedSharding(trainer, P("fsdp", "tp")),
        "w_out": NamedSharding(trainer, P("tp", "fsdp")),
        "norm": NamedSharding(trainer, P("fsdp")),
        "step": NamedSharding(trainer, P()),
    }
    dsts = {
        "embed": NamedSharding(sampler, P(None, "tp")),
        "w_in": NamedSharding(sampler, P(None, "tp")),
        "w_out": NamedSharding(sampler, P("tp", None)),
        "norm": NamedSharding(sampler, P()),
        "step": NamedSharding(sampler, P("dp")),
    }
    n, plan = move(full, srcs, dsts, BF16)
    assert n == (0 if PID < 4 else 2 * 5), n
    assert crossings(plan)[1] == 0  # one device per process: every piece crosses
    ok("disjoint_8x1", checked=n)


def case_one_device_per_process_colocated() -> None:
    """Trainer fsdp4 x tp2 over all 8 processes, sampler dp2 x tp4 over the same devices in
    reversed order: part of every shard is local, the rest comes from other processes."""
    trainer = mesh(GLOBAL, (4, 2), ("fsdp", "tp"))
    sampler = mesh(GLOBAL[::-1], (2, 4), ("dp", "tp"))
    full = model(200)
    srcs = {
        "embed": NamedSharding(trainer, P("fsdp", "tp")),
        "w_in": NamedSharding(trainer, P("fsdp", "tp")),
        "w_out": NamedSharding(trainer, P("tp", "fsdp")),
        "norm": NamedSharding(trainer, P(("fsdp", "tp"))),
        "step": NamedSharding(trainer, P(None, "tp")),
    }
    dsts = {
        "embed": NamedSharding(sampler, P(None, "tp")),
        "w_in": NamedSharding(sampler, P("tp", "dp")),
        "w_out": NamedSharding(sampler, P("tp", None)),
        "norm": NamedSharding(sampler, P()),
        "step": NamedSharding(sampler, P("dp")),
    }
    n, _ = move(full, srcs, dsts, {"embed": jnp.bfloat16, "w_out": jnp.bfloat16})
    assert n == 2 * 5, n
    ok("colocated_8x1", checked=n)


# --------------------------------------------------------------------------- 2 x 4 cases


def interleaved() -> tuple[Mesh, Mesh]:
    """Trainer = global devices 0, 1 (process 0) and 4, 5 (process 1); sampler = 2, 3, 6, 7."""
    trainer = mesh([GLOBAL[i] for i in (0, 1, 4, 5)], (2, 2), ("fsdp", "tp"))
    sampler = mesh([GLOBAL[i] for i in (2, 3, 6, 7)], (2, 2), ("dp", "tp"))
    return trainer, sampler


def case_interleaved() -> None:
    """Trainer and sampler devices interleaved across both processes: each process both
    sends and receives, within itself and to the other one."""
    trainer, sampler = interleaved()
    full = model(300)
    srcs = {
        "embed": NamedSharding(trainer, P("fsdp", "tp")),
        "w_in": NamedSharding(trainer, P("tp", "fsdp")),
        "w_out": NamedSharding(trainer, P(None, ("fsdp", "tp"))),
        "norm": NamedSharding(trainer, P("tp")),
        "step": NamedSharding(trainer, P()),
    }
    dsts = {
        "embed": NamedSharding(sampler, P(None, "tp")),
        "w_in": NamedSharding(sampler, P(("dp", "tp"))),
        "w_out": NamedSharding(sampler, P("tp", None)),
        "norm": NamedSharding(sampler, P()),
        "step": NamedSharding(sampler, P("dp", "tp")),
    }
    n, plan = move(full, srcs, dsts, BF16, bucket_bytes=4096)
    assert n == 2 * 2 * 5, n  # two sampler devices per process, five leaves, two steps
    across, within = crossings(plan)
    assert across > 0 and within > 0, (across, within)
    assert plan.stats.buckets > 1, plan.stats
    ok("interleaved_2x4", checked=n, across=across, within=within)


def case_interleaved_reversed() -> None:
    """The reverse move (sampler layout back to the trainer's), in a sampler order that
    alternates processes: 7, 2, 6, 3."""
    trainer, _ = interleaved()
    sampler = mesh([GLOBAL[i] for i in (7, 2, 6, 3)], (4,), ("tp",))
    full = model(400)
    srcs = {k: NamedSharding(sampler, P("tp") if k != "norm" else P()) for k in full}
    dsts = {
        "embed": NamedSharding(trainer, P("fsdp", "tp")),
        "w_in": NamedSharding(trainer, P("tp", "fsdp")),
        "w_out": NamedSharding(trainer, P(None, "fsdp")),
        "norm": NamedSharding(trainer, P("tp")),
        "step": NamedSharding(trainer, P("fsdp")),
    }
    n, plan = move(full, srcs, dsts, {})
    assert n == 2 * 2 * 5, n
    assert min(crossings(plan)) > 0, crossings(plan)
    ok("interleaved_reversed_2x4", checked=n)


def case_colocated_adapters() -> None:
    """Small leaves colocated over both processes: rows over fsdp4 x tp2 -> columns over the
    same 8 devices in the same order. Devices 0, 2, 5 and 7 hold one of the parts they need
    and pass it through a slot of their own (`Step.kept`), so every device of a side runs one
    program a step; the programs span both processes."""
    trainer = mesh(GLOBAL, (4, 2), ("fsdp", "tp"))
    sampler = mesh(GLOBAL, (8,), ("tp",))
    full = {f"a{i}": oracle((8, 64), np.float32, 500 + i) for i in range(24)}
    srcs = {k: NamedSharding(trainer, P("fsdp", "tp")) for k in full}
    dsts = {k: NamedSharding(sampler, P(None, "tp")) for k in full}
    n, plan = move(full, srcs, dsts, {})
    assert all(step.kept for step in plan.lowered.steps)
    assert all(len(s.packs) == len(s.unpacks) == 1 for s in plan.lowered.steps)
    assert n == 2 * 24 * 4, n
    ok("colocated_adapters_2x4", checked=n)


@contextlib.contextmanager
def every_qualifying_leaf_whole() -> Iterator[None]:
    """Leaves that may move as whole shards do, however small (`whole.LATENCY_MARGIN` 0)."""
    margin, whole.LATENCY_MARGIN = whole.LATENCY_MARGIN, 0.0
    try:
        yield
    finally:
        whole.LATENCY_MARGIN = margin


def case_whole_shards() -> None:
    """Leaves that move as whole shards (`planning.whole`), across processes: the same spec
    from the trainer (0, 1 | 4, 5) to the sampler (2, 3 | 6, 7), each process sending and
    receiving; a leaf held on process 0 only and moved to process 1 only (process 1 holds no
    source array, process 0 no destination); one source shard to two replicas. Floating
    values of every bit pattern (NaN payloads kept)."""
    sampler = mesh([GLOBAL[i] for i in (2, 3, 6, 7)], (4,), ("tp",))
    first, second = mesh(GLOBAL[:4], (4,), ("tp",)), mesh(GLOBAL[4:], (4,), ("tp",))
    pair = mesh(GLOBAL[:2], (2,), ("tp",))
    replicas = mesh(GLOBAL[4:], (2, 2), ("dp", "tp"))
    flat = mesh([GLOBAL[i] for i in (0, 1, 4, 5)], (4,), ("tp",))
    full = {
        "same": oracle((16, 32), jnp.bfloat16, 600),
        "across": oracle((32, 8), np.float32, 601),
        "replicated": oracle((8, 16), np.int8, 602),
    }
    srcs = {
        "same": NamedSharding(flat, P(None, "tp")),
        "across": NamedSharding(first, P("tp")),
        "replicated": NamedSharding(pair, P("tp")),
    }
    dsts = {
        "same": NamedSharding(sampler, P(None, "tp")),
        "across": NamedSharding(second, P("tp")),
        "replicated": NamedSharding(replicas, P("tp")),
    }
    with every_qualifying_leaf_whole():  # (small leaves: whole all the same)
        n, plan = move(full, srcs, dsts, {})
    moved = {plan.leaves[i].path for step in plan.lowered.steps for i in step.whole}
    assert moved == {"['same']", "['across']", "['replicated']"}, moved
    assert not any(step.packs or step.unpacks for step in plan.lowered.steps)
    mine = sum(d.process_index == PID for k in dsts for d in dsts[k].device_set)
    assert n == 2 * mine, n  # every destination shard of this process, two steps
    ok("whole_shards_2x4", checked=n)


def case_whole_beside_staged() -> None:
    """Whole-shard steps on process 1's devices only, a staged step on process 0's only:
    each process runs only the transfers over its own devices (the staged transfer's
    devices are fewer than the union's). Two whole leaves go to the same devices in two
    orders (one step; their fresh destinations made in one program per order)."""
    staged_src = mesh(GLOBAL[:2], (2,), ("tp",))
    one = mesh(GLOBAL[2:3], (1,), ("tp",))
    second = mesh(GLOBAL[4:], (4,), ("tp",))
    orders = [mesh([GLOBAL[i] for i in ids], (4,), ("tp",)) for ids in ((5, 4, 7, 6), (7, 6, 5, 4))]
    full = {
        "staged": oracle((8, 8), np.int32, 610),
        "a": oracle((16, 8), np.float32, 611),
        "b": oracle((16, 8), jnp.bfloat16, 612),
    }
    srcs = {
        "staged": NamedSharding(staged_src, P("tp")),
        "a": NamedSharding(second, P("tp")),
        "b": NamedSharding(second, P("tp")),
    }
    dsts = {
        "staged": NamedSharding(one, P()),
        "a": NamedSharding(orders[0], P("tp")),
        "b": NamedSharding(orders[1], P("tp")),
    }
    with every_qualifying_leaf_whole():  # (small leaves: whole all the same)
        n, plan = move(full, srcs, dsts, {})
    moved = {plan.leaves[i].path for step in plan.lowered.steps for i in step.whole}
    assert moved == {"['a']", "['b']"}, moved
    ok("whole_beside_staged_2x4", checked=n)


def case_chained() -> None:
    """Four declared domains of two devices (0-1, 2-3 on process 0; 4-5, 6-7 on process 1):
    the trainer on 0, 1, the sampler replicated over the other six. The sources alone would
    send every byte three times, so the destination domains are chained: relays of stage 2
    forward bytes another domain forwarded, between the processes and inside them."""
    topology = jr.Topology.from_groups([GLOBAL[i : i + 2] for i in range(0, 8, 2)])
    trainer = mesh([GLOBAL[i] for i in (0, 1)], (2,), ("fsdp",))
    sampler = mesh([GLOBAL[i] for i in range(2, 8)], (6,), ("dp",))
    full = model(500)
    srcs = {k: NamedSharding(trainer, P("fsdp")) for k in full}
    dsts = {k: NamedSharding(sampler, P()) for k in full}
    n, plan = move(full, srcs, dsts, BF16, bucket_bytes=4096, topology=topology)
    stages = {p.stage for p in plan.assignment.pieces}
    assert stages == {0, 1, 2}, stages
    assert plan.stats.bytes_relayed_cross_domain > 0, plan.stats
    across, within = crossings(plan)
    assert across > 0 and within > 0, (across, within)
    ok("chained_2x4", checked=n, across=across, within=within)


DTYPES = [np.float32, jnp.bfloat16, np.int8, np.uint16, np.bool_, np.float16, np.int32]
SHAPES = [(16, 8), (8,), (4, 4, 4), (32,), (8, 12), (), (24, 4)]


def case_many_leaves() -> None:
    """300 small leaves, as a model holds them: 30 repeated layers of 10 leaves of mixed
    shapes, dtypes and layouts (drawn once from a seeded table), over the interleaved meshes;
    some kinds cast to bf16. Checks every shard and the byte bound."""
    trainer, sampler = interleaved()
    rng = np.random.default_rng(7)
    full, srcs, dsts, dtypes = {}, {}, {}, {}

    def specs(shape, axes):
        """Every spec over the mesh axes ``axes`` (both of size 2) that splits at most one
        dimension, with one axis or both."""
        out = [P()]
        for i, n in enumerate(shape):
            out += [P(*([None] * i), a) for a in axes if n % 2 == 0]
            out += [P(*([None] * i), axes) for _ in [0] if n % 4 == 0]
        return out

    kinds = []  # (shape, dtype, source spec, destination spec, cast to)
    for _ in range(10):
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        src_specs, dst_specs = specs(shape, ("fsdp", "tp")), specs(shape, ("dp", "tp"))
        cast_it = bool(jnp.issubdtype(dtype, jnp.floating) and rng.random() < 0.5)
        cast = (jnp.bfloat16 if dtype != jnp.bfloat16 else np.float32) if cast_it else None
        kinds.append(
            (
                shape,
                dtype,
                src_specs[int(rng.integers(len(src_specs)))],
                dst_specs[int(rng.integers(len(dst_specs)))],
                cast,
            )
        )
    for i in range(300):
        shape, dtype, src_spec, dst_spec, cast = kinds[i % 10]
        name = f"layer{i // 10:02d}_{i % 10}"
        srcs[name] = NamedSharding(trainer, src_spec)
        dsts[name] = NamedSharding(sampler, dst_spec)
        if cast is not None:
            dtypes[name] = cast
        full[name] = oracle(shape, dtype, 1000 + i, normal=cast is not None)
    start = time.monotonic()
    n, plan = move(full, srcs, dsts, dtypes, steps=2)
    assert len(plan.leaves) == 300 and min(crossings(plan)) > 0, crossings(plan)
    assert n == 2 * 2 * 300, n
    times = " ".join(f"{k}={v:.1f}" for k, v in TIMES.items())
    ok("many_leaves_2x4", checked=n, seconds=f"{time.monotonic() - start:.1f}", times=times)


SCENARIOS = {
    "8x1": [case_one_device_per_process_disjoint, case_one_device_per_process_colocated],
    "2x4": [
        case_interleaved,
        case_interleaved_reversed,
        case_chained,
        case_colocated_adapters,
        case_whole_shards,
        case_whole_beside_staged,
    ],
    "2x4_many": [case_many_leaves],
    "startup": [],
}

if __name__ == "__main__":
    start = time.monotonic()
    try:
        for case in SCENARIOS[SCENARIO]:
            case()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # do not wait in jax.distributed.shutdown for peers that may be stuck
    print(f"ALL OK in {time.monotonic() - start:.1f} s", flush=True)
    jax.distributed.shutdown()
