"""Calibrate the cost model on this machine's CPU devices, then check it against the executor.

    python -m jaxreshard.simulate --calibrate            # 8 simulated CPU devices

Two steps, both on JAX's CPU backend:

1. **Measure a CPU profile** with microbenchmarks that know nothing of the planner: a jitted copy
   into a donated buffer (one device alone, and all devices at once: the host's copy speed;
   with rows of 256 bytes instead of 16 KiB: a row's cost; whole rows, one contiguous run:
   the speed of such boxes), compiled with the executor's own
   options for its copy programs (`runtime.copy_options`), collective-permute rounds over
   the union mesh (a round's latency: what 16 rounds of 4 KiB in one program take over one;
   the host's aggregate message bandwidth with 4 pairs of 16 MiB, one pair alone for a single
   link), and a refit of a one-bucket, 4 KiB plan (the fixed cost of one bucket, dispatches
   included, less its modeled rounds).
2. **Predict and measure** the bench scenarios: each is planned by `jaxreshard.plan`, priced by
   `costmodel.modeled_time` from its schedule with the measured profile, and timed (donated
   refits). The model must land within +-30% of the measurement on each.

Every time is the lowest of several medians (`_median`): of `PROFILE_PASSES` for the
microbenchmarks, of two for the scenarios.

Nothing here is used by the library; it is the check that the cluster model's structure (rounds,
pack, unpack, per-bucket costs) describes a real executor run.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from jaxreshard.planning.lower import MIN_CAST_SLOT_WIDTH
from jaxreshard.planning.topology import GB, PROFILES, Profile, Topology
from jaxreshard.planning.whole import step_rounds, without_leaves
from jaxreshard.run import codec, runtime
from jaxreshard.run.codec import ZERO
from jaxreshard.tools import bench, costmodel

TOLERANCE = 0.30
"""The model must predict each scenario's measured time within this fraction."""

SCENARIOS = (
    "disjoint",
    "disjoint_gpt32k",
    "disjoint_gpt32k_blocks",
    "disjoint_gpt32k_embed",
    "same_layout",
    "colocated",
    "many_leaves",
    "replicated_src",
    "replicated_dst",
    "cast",
    "big_leaf",
)
"""The bench's timing scenarios (`jaxreshard.tools.bench.SCENARIOS`)."""

SHORT_RUN_BYTES = 256
"""Row length of the box copy whose extra time over 16 KiB rows gives a row's cost
(`Profile.run_overhead`): rows this short are where it matters (a 256 x 256 float32 leaf split
over its columns), and a row's cost per byte falls as rows grow."""

PROFILE_PASSES = 4
"""Passes of each microbenchmark of the profile (the fastest pass is its figure). Eight CPU
devices copying on 2 cores vary by up to 1.4x between passes of the same program (all-device
copies: 7.1-9.8 GB/s over eight passes here), and a profile measured in a slow pass
over-prices every scenario; the microbenchmarks are short, so more passes cost little."""

LATENCY_ROUNDS = 16
"""Rounds of the program whose extra time over a one-round program gives a round's latency."""


@dataclasses.dataclass(frozen=True)
class Check:
    """One scenario: the model's prediction against the measured refit."""

    scenario: str
    modeled: costmodel.ModeledTime
    measured_s: float
    buckets: int

    @property
    def ratio(self) -> float:
        return self.modeled.seconds / self.measured_s

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1) <= TOLERANCE


# ----------------------------------------------------------------------------- the profile


def _median(fn: Any, reps: int, passes: int = 2) -> float:
    """The lower of ``passes`` medians (`bench._median_time`: ``reps`` awaited calls after an
    untimed one): load from elsewhere on the machine only ever adds time, so the quieter pass
    is the figure."""
    return min(bench._median_time(fn, reps) for _ in range(passes))


def _copy_program(
    fn: Any, devices: Sequence[jax.Device], *, casts: bool = False, **kwargs: Any
) -> Any:
    """``jax.jit(fn, **kwargs)`` compiled as the executor compiles its pack and unpack
    programs (`runtime.program_options`; ``casts``: whether ``fn`` converts dtypes): on CPU,
    XLA's older fusion emitters copy wide elements about 1.3x faster and narrow ones slower
    than the default, so a copy timed otherwise prices another program than the one the
    executor runs."""
    options = runtime.program_options(devices[0].platform, casts)
    return jax.jit(fn, compiler_options=options, **kwargs)


class _InPlace:
    """A microbenchmark whose program ``fn(x, y)`` writes into ``y``, donated: each call passes
    the last result back in, as the executor passes its staging buffers."""

    x: jax.Array
    y: jax.Array
    fn: Any

    def __call__(self) -> jax.Array:
        self.y = self.fn(self.x, self.y)
        return self.y


class _Permute:
    """``rounds`` collective-permute rounds in one program over a union mesh, each into a
    donated receive buffer, as the runtime's transfer program runs a bucket's rounds
    (`jaxreshard.run.runtime`): one dispatch, then one collective-permute per round."""

    def __init__(
        self,
        devices: Sequence[jax.Device],
        pairs: Sequence[tuple[int, int]],
        nbytes: int,
        rounds: int = 1,
    ):
        n = len(devices)
        words = max(1, nbytes // 4)
        mesh = Mesh(np.array(list(devices)), ("g",))
        s = NamedSharding(mesh, P("g"))
        make = jax.jit(lambda: jnp.ones((n * words,), jnp.uint32), out_shardings=s)
        self.xs = [make() for _ in range(rounds)]
        self.ys = [make() for _ in range(rounds)]

        def body(*args: jax.Array) -> tuple[jax.Array, ...]:
            return tuple(lax.ppermute(x, "g", list(pairs)) for x in args[:rounds])

        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=(P("g"),) * (2 * rounds), out_specs=(P("g"),) * rounds
        )
        self.fn = jax.jit(mapped, donate_argnums=tuple(range(rounds, 2 * rounds)), keep_unused=True)

    def __call__(self) -> Any:
        self.ys = list(self.fn(*self.xs, *self.ys))
        return self.ys


class _ManyCopies:
    """``boxes`` copies of ``box_bytes`` each on every device (a pack-like program: slices of a
    source at offsets read from a table, written into a donated buffer), or one copy of them
    all. The offsets are data, as in the executor's programs, so XLA cannot merge the copies."""

    def __init__(self, devices: Sequence[jax.Device], boxes: int, box_bytes: int, *, one: bool):
        n, words = len(devices), box_bytes // 4
        mesh = Mesh(np.array(list(devices)), ("g",))
        s = NamedSharding(mesh, P("g"))
        make = jax.jit(lambda: jnp.ones((n * boxes * words,), jnp.uint32), out_shardings=s)
        self.x, self.y = make(), make()
        order = np.random.default_rng(0).permutation(boxes).astype(np.int32) * words
        self.starts = jax.device_put(np.tile(order, n), s)

        def body(x: jax.Array, y: jax.Array, starts: jax.Array) -> jax.Array:
            if one:
                return lax.dynamic_update_slice(y, x, (np.int32(0),))
            for i in range(boxes):
                piece = lax.dynamic_slice(x, (starts[i],), (words,))
                y = lax.dynamic_update_slice(y, piece, (np.int32(i * words),))
            return y

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("g"), P("g"), P("g")), out_specs=P("g"))
        self.fn = _copy_program(mapped, devices, donate_argnums=1)

    def __call__(self) -> jax.Array:
        self.y = self.fn(self.x, self.y, self.starts)
        return self.y


class _BoxCopy(_InPlace):
    """Half the columns of a float32 matrix written into a donated flat buffer (a pack), on
    every device of ``devices`` at once: the executor copies boxes, not whole buffers. Each
    row of the box is a contiguous run of ``run_bytes``; ``nbytes`` per device."""

    def __init__(self, devices: Sequence[jax.Device], nbytes: int, run_bytes: int = 16 << 10):
        n = len(devices)
        half = max(1, run_bytes // 4)
        rows, cols = max(1, nbytes // (half * 4)), 2 * half
        mesh = Mesh(np.array(list(devices)), ("g",))
        s2, s1 = NamedSharding(mesh, P("g", None)), NamedSharding(mesh, P("g"))
        self.x = jax.jit(lambda: jnp.ones((n * rows, cols), jnp.float32), out_shardings=s2)()
        self.y = jax.jit(lambda: jnp.zeros((n * rows * half,), jnp.float32), out_shardings=s1)()

        def body(x: jax.Array, y: jax.Array) -> jax.Array:
            return lax.dynamic_update_slice(y, x[:, half:].reshape(-1), (np.int32(0),))

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("g", None), P("g")), out_specs=P("g"))
        self.fn = _copy_program(mapped, devices, donate_argnums=1)
        self.nbytes = n * rows * half * 4
        self.runs = n * rows


class _RowsCopy(_InPlace):
    """Whole rows of a float32 matrix written into a donated flat buffer, on every device of
    ``devices`` at once: a box that is one contiguous run of its shard (a pack of whole rows,
    an unpack into a shard split over its rows only); ``nbytes`` per device."""

    def __init__(self, devices: Sequence[jax.Device], nbytes: int):
        n = len(devices)
        rows, cols = 1024, max(1, nbytes // 4 // 1024)
        mesh = Mesh(np.array(list(devices)), ("g",))
        s2, s1 = NamedSharding(mesh, P("g", None)), NamedSharding(mesh, P("g"))
        self.x = jax.jit(lambda: jnp.ones((n * rows, cols), jnp.float32), out_shardings=s2)()
        self.y = jax.jit(lambda: jnp.zeros((n * rows * cols,), jnp.float32), out_shardings=s1)()

        def body(x: jax.Array, y: jax.Array) -> jax.Array:
            return lax.dynamic_update_slice(y, x.reshape(-1), (np.int32(0),))

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("g", None), P("g")), out_specs=P("g"))
        self.fn = _copy_program(mapped, devices, donate_argnums=1)
        self.nbytes = n * rows * cols * 4


class _NarrowCopy(_InPlace):
    """Narrow elements on every device at once, the two ways a bf16 refit copies them:
    ``cast``: half the columns of a float32 matrix, cast to bfloat16 and written as 16-bit
    words into a donated slot of rows of `lower.MIN_CAST_SLOT_WIDTH` words, read from the
    matrix viewed with rows of that many elements (a casting pack, as `runtime._read_rows`
    reads one; a flat slot, as measured until 2026-12-05, copies about 1.6x slower, and the
    model then priced the bench's `cast` refit at 1.5-1.65x its time); else: 16-bit words
    written as bfloat16 into half the columns of a donated bf16 matrix (an unpack into a
    bf16 shard). A bucket of bf16 leaves stages 16-bit words (`lower._word_bytes`: the widest
    word every element is made of), so these are the executor's own copies."""

    def __init__(self, devices: Sequence[jax.Device], nbytes: int, *, cast: bool):
        n = len(devices)
        width = MIN_CAST_SLOT_WIDTH
        rows, cols = 1024, max(2 * width, nbytes // 2 // 1024)  # ``nbytes`` of bf16, half cols
        cols -= cols % (2 * width)
        mesh = Mesh(np.array(list(devices)), ("g",))
        s2, s1 = NamedSharding(mesh, P("g", None)), NamedSharding(mesh, P("g"))
        half = cols // 2
        if cast:
            self.x = jax.jit(lambda: jnp.ones((n * rows, cols), jnp.float32), out_shardings=s2)()
            self.y = jax.jit(
                lambda: jnp.zeros((n * rows * half // width, width), jnp.uint16), out_shardings=s2
            )()

            def body(x: jax.Array, y: jax.Array) -> jax.Array:
                view = x.reshape(rows, cols // width, width)
                start = (ZERO, np.int32(half // width), ZERO)
                bits = codec.read_bits(view, start, (rows, half // width, width), jnp.bfloat16)
                return lax.dynamic_update_slice(y, bits.reshape(-1, width), (ZERO, ZERO))

            specs = (P("g", None), P("g", None))
        else:
            self.x = jax.jit(lambda: jnp.ones((n * rows * half,), jnp.uint16), out_shardings=s1)()
            self.y = jax.jit(lambda: jnp.zeros((n * rows, cols), jnp.bfloat16), out_shardings=s2)()

            def body(x: jax.Array, y: jax.Array) -> jax.Array:
                # As the executor writes a shard: on its bits (XLA's CPU backend would compute
                # a bf16 update in float32), through its own codec.
                bits = codec.write_bits(codec.to_bits(y), x.reshape(rows, half), (0, half))
                return codec.from_bits(bits, jnp.bfloat16)

            specs = (P("g"), P("g", None))
        out = specs[1]
        mapped = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out)
        self.fn = _copy_program(mapped, devices, casts=cast, donate_argnums=1)
        self.nbytes = n * rows * half * 2


class _ManyArguments:
    """One in-place program over ``k`` donated arrays, each sharded over every device: what a
    pack or unpack pays per leaf it takes, beyond its bytes."""

    def __init__(self, devices: Sequence[jax.Device], k: int):
        mesh = Mesh(np.array(list(devices)), ("g",))
        s = NamedSharding(mesh, P("g"))
        n = len(devices)
        make = jax.jit(lambda: jnp.zeros((n * 256,), jnp.uint32), out_shardings=s)
        self.xs = [make() for _ in range(k)]
        self.fn = _copy_program(
            lambda *xs: tuple(x.at[0].set(1) for x in xs), devices, donate_argnums=tuple(range(k))
        )

    def __call__(self) -> Any:
        self.xs = list(self.fn(*self.xs))
        return self.xs


def measure_profile(devices: Sequence[jax.Device], *, reps: int = 25) -> Profile:
    """A CPU `Profile` measured on ``devices`` (see the module docstring)."""
    n = len(devices)
    big = 16 << 20

    def timed(fn: Any) -> float:
        return _median(fn, reps, PROFILE_PASSES)

    alone, together = _BoxCopy(devices[:1], big), _BoxCopy(devices, big)
    copy_one = alone.nbytes / timed(alone)
    t_together = timed(together)
    copy_all = together.nbytes / t_together
    # Rows: the same bytes as boxes of 256-byte rows (a leaf of a few hundred columns split
    # in two) take longer than boxes of 16 KiB rows; the difference, per extra row.
    rows = _BoxCopy(devices, big, run_bytes=SHORT_RUN_BYTES)
    per_run = max(0.0, (timed(rows) - t_together) / (rows.runs - together.runs))
    whole = _RowsCopy(devices, big)
    contiguous = whole.nbytes / timed(whole)
    half = n // 2
    pairs = [(i, half + i) for i in range(half)]
    # A round's latency is what one more round adds to a program (4 KiB: the bytes are
    # nothing); a program of one round also pays its dispatch, which the bucket's fixed cost
    # holds (`_bucket_overhead`), so the bandwidths subtract that whole program.
    one_round = timed(_Permute(devices, pairs, 4 << 10))
    many = timed(_Permute(devices, pairs, 4 << 10, rounds=LATENCY_ROUNDS))
    latency = max(0.0, (many - one_round) / (LATENCY_ROUNDS - 1))
    t_large = timed(_Permute(devices, pairs, big))
    host_link = len(pairs) * big / max(t_large - one_round, 1e-9)
    t_pair = timed(_Permute(devices, [(0, half)], big))
    link = big / max(t_pair - one_round, 1e-9)
    packs, unpacks = _NarrowCopy(devices, big, cast=True), _NarrowCopy(devices, big, cast=False)
    narrow = 2 * packs.nbytes / (timed(packs) + timed(unpacks))
    args = 128
    per_argument = max(
        0.0,
        (timed(_ManyArguments(devices, args)) - timed(_ManyArguments(devices, 1))) / (args - 1),
    )
    boxes, box = 128, 16 << 10
    t_many = timed(_ManyCopies(devices, boxes, box, one=False))
    t_one = timed(_ManyCopies(devices, boxes, box, one=True))
    per_copy = max(0.0, (t_many - t_one) / (boxes * n))
    measured = dataclasses.replace(
        PROFILES["cpu"],
        name="cpu (measured)",
        domain_size=n,
        host_size=n,
        intra_bandwidth=link,
        inter_bandwidth=link,
        round_latency=latency,
        copy_bandwidth=copy_one,
        host_copy_bandwidth=copy_all,
        host_link_bandwidth=host_link,
        narrow_copy_bandwidth=narrow,
        contiguous_copy_bandwidth=max(contiguous, copy_all),
        copy_overhead=per_copy,
        run_overhead=per_run,
        argument_overhead=per_argument,
        bucket_overhead=0.0,
        sources=(
            ("intra_bandwidth", "measured: one collective-permute pair of 16 MiB"),
            (
                "round_latency",
                f"measured: {LATENCY_ROUNDS} collective-permute rounds of 4 pairs of 4 KiB in "
                "one program against one, per round",
            ),
            (
                "copy_bandwidth",
                "measured: 16 MiB of half the columns of a matrix copied into "
                "a donated buffer, one device",
            ),
            ("host_copy_bandwidth", f"measured: the same on all {n} devices at once"),
            (
                "host_link_bandwidth",
                "measured: 4 pairs of 16 MiB, less a program of 4 KiB",
            ),
            (
                "narrow_copy_bandwidth",
                "measured: a f32 -> bf16 cast and a bf16 copy of 16 MiB "
                "per device, all devices at once",
            ),
            (
                "contiguous_copy_bandwidth",
                f"measured: 16 MiB of whole rows of a matrix into a donated buffer on all {n} "
                "devices at once (never below the box copy)",
            ),
            (
                "copy_overhead",
                f"measured: {boxes} copies of 16 KiB against one, per copy summed over the host",
            ),
            (
                "run_overhead",
                f"measured: 16 MiB per device of {SHORT_RUN_BYTES}-byte rows against 16 KiB "
                "rows, all devices at once, per row summed over the host",
            ),
            ("bucket_overhead", "measured: a one-bucket 4 KiB refit less its modeled rounds"),
        ),
    )
    return dataclasses.replace(measured, bucket_overhead=_bucket_overhead(devices, measured, reps))


def _bucket_overhead(devices: Sequence[jax.Device], profile: Profile, reps: int) -> float:
    half = len(devices) // 2
    src = NamedSharding(Mesh(np.array(devices[:half]), ("a",)), P("a"))
    dst = NamedSharding(Mesh(np.array(devices[half:]), ("b",)), P(None))
    x = jax.jit(lambda: jnp.ones((1024,), jnp.float32), out_shardings=src)()
    plan = jr.plan(x, dst)
    out = [plan(x)]

    def step() -> jax.Array:
        out[0] = plan(x, donate=out[0])
        return out[0]

    measured = _median(step, reps * 4)
    bare = modeled(plan, profile).seconds
    return max(0.0, (measured - bare) / max(1, plan.stats.buckets))


def modeled(plan: jr.Plan, profile: Profile) -> costmodel.ModeledTime:
    """``plan``'s schedule priced with ``profile`` on its own devices, as a call runs it:
    buckets joined into one step priced as one (`lower.Step.buckets`)."""
    topology: Topology = dataclasses.replace(
        plan.topology,
        intra_bandwidth=profile.intra_bandwidth,
        inter_bandwidth=profile.inter_bandwidth,
        round_latency=profile.round_latency,
    )
    steps = [step.buckets for step in plan.lowered.steps]
    whole = [step_rounds(step) for step in plan.lowered.steps if step.whole]
    moved_whole = {i for step in plan.lowered.steps for i in step.whole}
    return costmodel.modeled_time(
        plan.schedule,
        topology,
        profile,
        leaves=plan.leaves,
        # (a whole-shard leaf's local copies are pairs of its collective-permute)
        local=without_leaves(plan.assignment, moved_whole).local,
        steps=steps,
        whole=whole,
    )


# -------------------------------------------------------------------------------- the check


def check(
    names: Sequence[str], profile: Profile, devices: Sequence[jax.Device], args: Any, reps: int
) -> list[Check]:
    """Model and measure each bench scenario of ``names``."""
    out = []
    for name in names:
        sc = bench.SCENARIOS[name]
        assert sc.tree is not None
        tree = sc.tree(args)
        src_sh, dst_sh = bench.shardings(tree, sc.layouts(len(devices)), devices)
        src = bench.make_source(tree, src_sh)
        plan = jr.plan(src, dst_sh, dtype=sc.dtype)
        out_tree = [plan(src)]

        def step(plan: jr.Plan = plan, src: Any = src, out_tree: list[Any] = out_tree) -> Any:
            out_tree[0] = plan(src, donate=out_tree[0])
            return out_tree[0]

        measured = _median(step, reps)
        out.append(Check(name, modeled(plan, profile), measured, plan.stats.buckets))
        jax.block_until_ready(out_tree[0])
        for leaf in (*jax.tree.leaves(out_tree[0]), *jax.tree.leaves(src)):
            leaf.delete()
        plan.free_staging()
    return out


def format_profile(p: Profile) -> str:
    rows = [
        ("one link (a pair alone)", f"{p.intra_bandwidth / GB:.2f} GB/s"),
        ("round latency", f"{p.round_latency * 1e3:.3f} ms"),
        ("messages on the host, together", f"{(p.host_link_bandwidth or math.inf) / GB:.2f} GB/s"),
        ("copy, one device", f"{p.copy_bandwidth / GB:.2f} GB/s"),
        ("copy, every device together", f"{(p.host_copy_bandwidth or math.inf) / GB:.2f} GB/s"),
        (
            "whole rows, every device together",
            f"{(p.contiguous_copy_bandwidth or math.inf) / GB:.2f} GB/s",
        ),
        ("bf16 / cast copy, together", f"{(p.narrow_copy_bandwidth or math.inf) / GB:.2f} GB/s"),
        ("per box copied", f"{p.copy_overhead * 1e6:.2f} us"),
        ("per row copied", f"{p.run_overhead * 1e9:.1f} ns"),
        ("per array a program takes", f"{p.argument_overhead * 1e6:.2f} us"),
        ("per bucket", f"{p.bucket_overhead * 1e3:.3f} ms"),
    ]
    return "\n".join(f"  {k:<32} {v}" for k, v in rows)


def format_checks(checks: Sequence[Check]) -> str:
    head = (
        f"  {'scenario':<24} {'buckets':>7} {'modeled':>9} {'measured':>9} {'ratio':>6}  "
        "parts (rounds / pack / unpack / local / buckets, ms)"
    )
    lines = [head]
    for c in checks:
        m = c.modeled
        parts = " / ".join(f"{x * 1e3:.1f}" for x in m.parts().values())
        lines.append(
            f"  {c.scenario:<24} {c.buckets:>7} {m.seconds * 1e3:>7.1f}ms "
            f"{c.measured_s * 1e3:>7.1f}ms "
            f"{c.ratio:>6.2f}  {parts}  {'within' if c.within else 'OUTSIDE'} +-{TOLERANCE:.0%}"
        )
    return "\n".join(lines)


def run(
    *, names: Sequence[str] = SCENARIOS, reps: int = 7, size_mib: float | None = None
) -> dict[str, Any]:
    """Measure the profile, check every scenario, print both; returns them as a JSON record."""
    devices = jax.devices()
    if len(devices) < 2:
        raise SystemExit(
            "the calibration needs several devices: run with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8"
        )
    argv = ["--no-progress"] + ([] if size_mib is None else ["--size-mib", str(size_mib)])
    args = bench.parse_args(argv)
    profile = measure_profile(devices)
    print(f"CPU profile measured on {len(devices)} {devices[0].platform} devices:")
    print(format_profile(profile), flush=True)
    checks = check(names, profile, devices, args, reps)
    print("\nmodel (with that profile) against the measured executor, median of donated refits:")
    print(format_checks(checks))
    return {
        "profile": {
            f.name: getattr(profile, f.name)
            for f in dataclasses.fields(profile)
            if f.name not in ("sources", "source")
        },
        "checks": [
            {
                "scenario": c.scenario,
                "modeled_s": c.modeled.seconds,
                "measured_s": c.measured_s,
                "ratio": c.ratio,
                "within": c.within,
                "buckets": c.buckets,
                "parts_s": c.modeled.parts(),
            }
            for c in checks
        ],
    }


# ------------------------------------------------------------------------ one device's copies


DEVICE_BYTES = 1 << 30
"""Bytes each copy of `measure_device` moves by default: far above a GPU's L2 cache (60 MB
on an H200), so the copies run at HBM speed, not the cache's."""

DEVICE_BOXES = (64, 512)
"""Box counts of the pack-like programs whose difference gives a box's cost and a box's
compile time (16 KiB boxes at offsets read from a table, as the executor's packs)."""


@dataclasses.dataclass(frozen=True)
class DeviceCopies:
    """What one device's pack and unpack programs cost: the copy and launch fields of a
    `Profile`, measured (`measure_device`). The GPU profiles' copy and host figures come from
    two such runs on an H200 (`topology.COPY_EFFICIENCY`); rounds and links need several
    devices.

    Attributes:
      device: the device's kind, as JAX names it.
      nbytes: bytes each copy moved.
      flat_copy: bytes/s of one flat copy into a donated buffer (`bench.Memcpy`, the CPU
        benchmarks' reference; on an H200 slower than a box copy).
      box_copy: bytes/s of half the columns of a float32 matrix (rows of 16 KiB) copied into a
        donated flat buffer: `Profile.copy_bandwidth`.
      narrow_copy: bytes/s of a casting bf16 pack and a bf16 unpack, averaged:
        `Profile.narrow_copy_bandwidth`.
      cast_copy, bf16_copy: the two apart (bf16 bytes counted): a pack that casts float32 to
        bfloat16 reads two bytes for each it writes, where a bf16 copy without a cast (the
        cluster scenarios' packs and unpacks) reads one.
      per_row: seconds per row of 256 bytes beyond its bytes: `Profile.run_overhead`.
      per_box: seconds per 16 KiB box of a pack-like program beyond its bytes:
        `Profile.copy_overhead`.
      per_argument: seconds per array a program takes: `Profile.argument_overhead`.
      per_program: seconds per program of a chain dispatched without waiting (the longer of
        the host's dispatch and the device's launch): `Profile.launch_overhead` where the
        device is the slower.
      compile_per_box: seconds of compiling per box of a pack-like program.
    """

    device: str
    nbytes: int
    flat_copy: float
    box_copy: float
    narrow_copy: float
    cast_copy: float
    bf16_copy: float
    per_row: float
    per_box: float
    per_argument: float
    per_program: float
    compile_per_box: float

    def rows(self) -> list[tuple[str, str]]:
        """The figures as ``(what, value)`` lines."""
        return [
            ("flat copy into a donated buffer", f"{self.flat_copy / GB:.1f} GB/s"),
            ("box copy (16 KiB rows)", f"{self.box_copy / GB:.1f} GB/s"),
            ("bf16 / cast copy", f"{self.narrow_copy / GB:.1f} GB/s"),
            ("  of which the cast (float32 -> bf16)", f"{self.cast_copy / GB:.1f} GB/s"),
            ("  of which the bf16 copy, no cast", f"{self.bf16_copy / GB:.1f} GB/s"),
            ("per row of 256 bytes", f"{self.per_row * 1e9:.2f} ns"),
            ("per box of 16 KiB", f"{self.per_box * 1e6:.2f} us"),
            ("per array a program takes", f"{self.per_argument * 1e6:.2f} us"),
            ("per program of a chain", f"{self.per_program * 1e6:.2f} us"),
            ("compile, per box", f"{self.compile_per_box * 1e3:.2f} ms"),
        ]


class _Chain:
    """``k`` one-element in-place programs dispatched one after another with no wait between
    them, as the executor dispatches a bucket's pack, transfer and unpack."""

    def __init__(self, device: jax.Device, k: int):
        self.k = k
        self.x = jax.device_put(np.zeros((256,), np.uint32), device)
        self.fn = jax.jit(lambda x: x.at[0].add(1), donate_argnums=0)

    def __call__(self) -> jax.Array:
        for _ in range(self.k):
            self.x = self.fn(self.x)
        return self.x


def _compile_seconds(devices: Sequence[jax.Device], boxes: int) -> float:
    """Seconds to lower and compile a pack-like program of ``boxes`` boxes (`_ManyCopies`)."""
    program = _ManyCopies(devices, boxes, 16 << 10, one=False)
    t0 = time.perf_counter()
    program.fn.lower(program.x, program.y, program.starts).compile()
    seconds = time.perf_counter() - t0
    for a in (program.x, program.y, program.starts):
        a.delete()
    return seconds


def measure_device(
    device: jax.Device,
    *,
    nbytes: int = DEVICE_BYTES,
    reps: int = 10,
    boxes: tuple[int, int] = DEVICE_BOXES,
) -> DeviceCopies:
    """Measure `DeviceCopies` on ``device`` alone (see the class); each figure is the fastest
    of `PROFILE_PASSES` medians of ``reps`` calls, ``boxes`` the two box counts of the
    pack-like programs. The programs are freed as they finish, so about 5x ``nbytes`` of
    device memory is enough."""
    devices = [device]

    def timed(make: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
        program = make(devices, *args, **kwargs)
        seconds = _median(program, reps, PROFILE_PASSES)
        jax.block_until_ready(program())
        return seconds, program

    def free(program: Any) -> None:
        for name in ("x", "y", "starts"):
            if isinstance(getattr(program, name, None), jax.Array):
                getattr(program, name).delete()
        for x in getattr(program, "xs", []):
            x.delete()

    flat = bench.Memcpy(devices, nbytes)
    flat_copy = flat.nbytes / bench._median_time(flat._step, reps)
    flat.a.delete()
    flat.b.delete()
    t_box, box = timed(_BoxCopy, nbytes)
    free(box)
    t_rows, rows = timed(_BoxCopy, nbytes, run_bytes=SHORT_RUN_BYTES)
    free(rows)
    t_cast, packs = timed(_NarrowCopy, nbytes, cast=True)
    free(packs)
    t_bf16, unpacks = timed(_NarrowCopy, nbytes, cast=False)
    free(unpacks)
    few, many = boxes
    t_few, p = timed(_ManyCopies, few, 16 << 10, one=False)
    free(p)
    t_many, p = timed(_ManyCopies, many, 16 << 10, one=False)
    free(p)
    t_args1, p = timed(_ManyArguments, 1)
    free(p)
    t_args, p = timed(_ManyArguments, 128)
    free(p)
    chains = 64
    t_chain = _median(_Chain(device, chains), reps, PROFILE_PASSES)
    t_single = _median(_Chain(device, 1), reps, PROFILE_PASSES)
    # One compile of each: a GPU compile of hundreds of boxes takes seconds.
    compile_few, compile_many = (_compile_seconds(devices, k) for k in boxes)
    return DeviceCopies(
        device=str(device.device_kind),
        nbytes=box.nbytes,
        flat_copy=flat_copy,
        box_copy=box.nbytes / t_box,
        narrow_copy=2 * packs.nbytes / (t_cast + t_bf16),
        cast_copy=packs.nbytes / t_cast,
        bf16_copy=unpacks.nbytes / t_bf16,
        per_row=max(0.0, (t_rows - t_box) / (rows.runs - box.runs)),
        per_box=max(0.0, (t_many - t_few) / (many - few)),
        per_argument=max(0.0, (t_args - t_args1) / 127),
        per_program=max(0.0, (t_chain - t_single) / (chains - 1)),
        compile_per_box=max(0.0, (compile_many - compile_few) / (many - few)),
    )


HBM_PEAKS: dict[str, float] = {
    "NVIDIA H200": 4800 * GB,
    "NVIDIA H100 80GB HBM3": 3350 * GB,
    "NVIDIA B200": 8000 * GB,
    "NVIDIA GB200": 8000 * GB,
}
"""Datasheet HBM bandwidth (read and write together) of the GPUs `run_device` knows, by the
device kind JAX reports: NVIDIA's H200 SXM, H100 SXM5, B200 and GB200 NVL72 datasheets."""


def device_profiles_against(copies: DeviceCopies) -> list[tuple[str, str, str]]:
    """``(field, what a GPU profile assumes, what was measured)`` for the copy and launch
    fields of `PROFILES`' GPU profiles. Copy speeds are compared as fractions of HBM peak
    over two (a copy reads and writes each byte), the profiles' own basis, where the device's
    peak is known (`HBM_PEAKS`); else in bytes/s."""
    h100 = PROFILES["h100"]
    basis = 3350 * GB / 2  # the h100 profile's: HBM3 3.35 TB/s, read and write
    peak = HBM_PEAKS.get(copies.device)

    def measured(rate: float) -> str:
        if peak is None:
            return f"{rate / GB:.0f} GB/s (this device's HBM peak is not known here)"
        return f"{rate / (peak / 2):.0%} of HBM peak / 2"

    return [
        (
            "copy_bandwidth",
            f"{h100.copy_bandwidth / basis:.0%} of HBM peak / 2",
            measured(copies.box_copy),
        ),
        (
            "narrow_copy_bandwidth",
            f"{(h100.narrow_copy_bandwidth or h100.copy_bandwidth) / basis:.0%} of HBM peak / 2",
            measured(copies.narrow_copy),
        ),
        ("run_overhead", f"{h100.run_overhead * 1e9:.1f} ns", f"{copies.per_row * 1e9:.2f} ns"),
        ("copy_overhead", f"{h100.copy_overhead * 1e6:.1f} us", f"{copies.per_box * 1e6:.2f} us"),
        (
            "argument_overhead",
            f"{h100.argument_overhead * 1e6:.1f} us",
            f"{copies.per_argument * 1e6:.2f} us",
        ),
        (
            "launch_overhead",
            f"{h100.launch_overhead * 1e6:.1f} us",
            f"{copies.per_program * 1e6:.2f} us (dispatch-bound where larger)",
        ),
    ]


def run_device(*, nbytes: int = DEVICE_BYTES, reps: int = 10) -> dict[str, Any]:
    """Measure `DeviceCopies` on the first device, print them (on a GPU, beside what the GPU
    profiles assume); returns them as a JSON record."""
    device = jax.devices()[0]
    copies = measure_device(device, nbytes=nbytes, reps=reps)
    print(f"one {device.platform} device ({copies.device}), copies of {copies.nbytes / GB:.2f} GB:")
    print("\n".join(f"  {k:<32} {v}" for k, v in copies.rows()))
    print("\nthe GPU profiles' assumptions (h100, gb200-nvl72) against this device:")
    for field, assumed, measured in device_profiles_against(copies):
        print(f"  {field:<24} assumed {assumed:<28} measured {measured}")
    return {"platform": device.platform, **dataclasses.asdict(copies)}
