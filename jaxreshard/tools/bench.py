"""Side-by-side benchmark: jaxreshard against what JAX users do today.

Run it as a module (8 simulated CPU devices unless the default backend already has 8 devices)::

    python -m jaxreshard.bench                      # every scenario, ~256 MiB trees
    python -m jaxreshard.bench --scenario disjoint --pairs 20 --json out.json
    python -m jaxreshard.bench --size-mib 4 --big-leaf-mib 4 --pairs 2   # a quick smoke run

Scenarios (`SCENARIOS`) are named layout pairs over a GPT-like parameter tree; strategies are the
ways to move it: ``jaxreshard`` (plan once, then call with ``donate=`` the previous result, as a
refit loop does), ``device_put`` (`jax.device_put` onto the destination shardings),
``gather_slice`` (all-gather to a full replica on the source devices, then slice each
destination shard out of a replica and copy it onto its device) and ``xla_reshard``
(``jax.jit(identity, out_shardings=dst)``: XLA's SPMD partitioner, only for one device set).

Method:

* warm-up: every strategy runs once on the same source (its first call, which compiles, is
  timed; compile time is summed from `jax.monitoring` events) and its result is checked
  equal to jaxreshard's, element for element;
* timing: the strategies are interleaved ``A B C, C B A, A B C, ...`` for ``--pairs`` rounds, so
  drift of a shared machine hits all alike. Before every call, untimed, the source tree is
  replaced by a new one (``x + 1`` with donation, as an optimizer step would): JAX caches the
  host copy of an array that `jax.device_put` pulled through host memory, which would flatter
  it on a repeated source. Reported: min / median / max wall time and the median of the
  per-round ratios against jaxreshard;
* memory: one more call per strategy, alone, with free heap memory returned to the system
  first (``malloc_trim``); peak resident memory during the call beyond the resident memory just
  before it (the kernel's ``VmHWM`` after resetting it, or, where that cannot be reset, a thread
  sampling ``/proc/self/statm``). ``transient`` is that peak less the strategy's freshly
  allocated result (jaxreshard writes into the donated previous result, so none).
* bytes: jaxreshard's `PlanStats` (``bytes_sent`` against ``bytes_lower_bound``, rounds,
  staging); bytes through host memory are *measured* by watching the host arrays JAX hands
  back to devices during the warm-up call (its slow path pulls the whole array to NumPy and
  puts the destination shards back); gather-then-slice's device-to-device bytes are computed
  from the layouts (all-gather fills every source device, then the copies of each destination
  shard that is not on a replica holder).

On CPU every "device" is a slice of host memory and every transfer is a memcpy by some thread;
see the README's Performance section for what this does and does not tell about GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

MiB = 1 << 20
N_DEVICES = 8
_HOST_FLAG = "--xla_force_host_platform_device_count"


def _ask_for_host_devices(n: int = N_DEVICES) -> None:
    """Ask XLA for ``n`` CPU devices. Works until the first backend starts (jax.devices())."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _HOST_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_HOST_FLAG}={n}".strip()


_ask_for_host_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding  # noqa: E402

import jaxreshard as jr  # noqa: E402

P = PartitionSpec

# ------------------------------------------------------------------------------- scenarios

# Roles of GPT parameters and how each layout splits them. "col" weights are column-parallel
# (qkv, mlp up), "row" weights row-parallel (attention out, mlp down), "embed" the (vocab, d)
# embedding, "bias" a column-parallel bias, "vec" a layer-norm scale or bias of size d.
TRAINER = {  # fsdp x tp
    "col": P("fsdp", "tp"),
    "row": P("tp", "fsdp"),
    "embed": P("tp", "fsdp"),
    "bias": P("tp"),
    "vec": P("fsdp"),
}
SAMPLER_TP = {  # tensor parallel only
    "col": P(None, "tp"),
    "row": P("tp", None),
    "embed": P("tp", None),
    "bias": P("tp"),
    "vec": P(),
}
FSDP_ONLY = {  # dp x fsdp: everything split on its first dimension, replicated over dp
    "col": P("fsdp", None),
    "row": P("fsdp", None),
    "embed": P("fsdp", None),
    "bias": P("fsdp"),
    "vec": P("fsdp"),
}


@dataclasses.dataclass(frozen=True)
class Tree:
    """Leaf shapes and roles, by name (a flat dict is a pytree)."""

    leaves: dict[str, tuple[tuple[int, ...], str]]

    @property
    def nbytes_f32(self) -> int:
        return sum(4 * math.prod(shape) for shape, _ in self.leaves.values())


def gpt_tree(size_mib: float, layers: int = 8) -> Tree:
    """A GPT-like parameter tree of about ``size_mib`` MiB in fp32.

    ``layers`` blocks of (ln1 scale/bias, qkv weight/bias, attention out, ln2 scale/bias, mlp
    up weight/bias, mlp down), a (16 d, d) embedding and a final layer norm: 9 leaves per
    block. ``d`` is the largest multiple of 16 that keeps the tree within the size (at least 16).
    """

    def build(d: int) -> Tree:
        leaves: dict[str, tuple[tuple[int, ...], str]] = {"embed": ((16 * d, d), "embed")}
        for i in range(layers):
            p = f"layer{i:02d}."
            leaves |= {
                p + "ln1.scale": ((d,), "vec"),
                p + "ln1.bias": ((d,), "vec"),
                p + "attn.qkv": ((d, 3 * d), "col"),
                p + "attn.qkv_bias": ((3 * d,), "bias"),
                p + "attn.out": ((d, d), "row"),
                p + "ln2.scale": ((d,), "vec"),
                p + "ln2.bias": ((d,), "vec"),
                p + "mlp.up": ((d, 4 * d), "col"),
                p + "mlp.up_bias": ((4 * d,), "bias"),
                p + "mlp.down": ((4 * d, d), "row"),
            }
        leaves |= {"final_ln.scale": ((d,), "vec"), "final_ln.bias": ((d,), "vec")}
        return Tree(leaves)

    d = 16
    while build(d + 16).nbytes_f32 <= size_mib * MiB:
        d += 16
    return build(d)


def matrices_tree(size_mib: float, n: int, like: int | None = None) -> Tree:
    """``n`` equal (rows, cols) fp32 matrices, alternately column- and row-parallel.

    Sized as ``like`` matrices (default ``n``) of about ``size_mib / like`` MiB each, with rows
    and columns multiples of 16 (at least 16 x 16), so `matrices_tree(s, 8, like=1024)` holds
    exactly the bytes of `matrices_tree(s, 1024)`: the same columns, 128 x the rows.
    """
    like = like or n
    if like % n:
        raise ValueError(f"{n} matrices cannot hold the bytes of {like} equal ones")
    per = size_mib * MiB / 4 / like  # elements per matrix at `like` matrices
    cols = max(16, int(math.sqrt(per)) // 16 * 16)
    rows = max(16, int(per / cols) // 16 * 16) * (like // n)
    return Tree({f"w{i:04d}": ((rows, cols), "col" if i % 2 == 0 else "row") for i in range(n)})


def one_leaf_tree(size_mib: float) -> Tree:
    """One square fp32 matrix of about ``size_mib`` MiB (16384 x 16384 for 1024 MiB)."""
    n = max(16, int(math.sqrt(size_mib * MiB / 4)) // 16 * 16)
    return Tree({"w": ((n, n), "col")})


@dataclasses.dataclass(frozen=True)
class Layouts:
    """A source and a destination layout: meshes (device positions, shape, axes) and specs."""

    src_devices: tuple[int, ...]
    src_mesh: tuple[tuple[int, ...], tuple[str, ...]]
    src_specs: dict[str, PartitionSpec]
    dst_devices: tuple[int, ...]
    dst_mesh: tuple[tuple[int, ...], tuple[str, ...]]
    dst_specs: dict[str, PartitionSpec]


DISJOINT = Layouts(
    (0, 1, 2, 3), ((2, 2), ("fsdp", "tp")), TRAINER, (4, 5, 6, 7), ((4,), ("tp",)), SAMPLER_TP
)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A named benchmark case: what moves, from where to where, and the strategies that apply."""

    name: str
    description: str
    layouts: Layouts
    tree: Callable[[argparse.Namespace], Tree]
    dtype: Any = None
    strategies: tuple[str, ...] = ("jaxreshard", "device_put", "gather_slice")


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "disjoint",
            "trainer fsdp2 x tp2 on devices 0-3 -> sampler tp4 on devices 4-7 (GPT tree)",
            DISJOINT,
            lambda a: gpt_tree(a.size_mib, a.layers),
        ),
        Scenario(
            "colocated",
            "the same 8 devices: fsdp4 x tp2 on 0..7 -> dp2 x tp4 on 0,2,4,6,1,3,5,7 (GPT tree)",
            Layouts(
                tuple(range(8)),
                ((4, 2), ("fsdp", "tp")),
                TRAINER,
                (0, 2, 4, 6, 1, 3, 5, 7),
                ((2, 4), ("dp", "tp")),
                SAMPLER_TP,
            ),
            lambda a: gpt_tree(a.size_mib, a.layers),
            strategies=("jaxreshard", "device_put", "gather_slice", "xla_reshard"),
        ),
        Scenario(
            "many_leaves",
            "--many-leaves (1024) equal matrices, layouts as `disjoint`; jaxreshard_8_leaves "
            "moves the same bytes as 8 matrices (per-leaf overhead)",
            DISJOINT,
            lambda a: matrices_tree(a.size_mib, a.many_leaves),
            strategies=("jaxreshard", "jaxreshard_8_leaves", "device_put", "gather_slice"),
        ),
        Scenario(
            "replicated_src",
            "dp2 x fsdp2 on 0-3 (every shard held twice) -> tp4 on 4-7 (GPT tree)",
            dataclasses.replace(DISJOINT, src_mesh=((2, 2), ("dp", "fsdp")), src_specs=FSDP_ONLY),
            lambda a: gpt_tree(a.size_mib, a.layers),
        ),
        Scenario(
            "replicated_dst",
            "fsdp2 x tp2 on 0-3 -> dp2 x tp2 on 4-7 (every destination shard held twice)",
            dataclasses.replace(DISJOINT, dst_mesh=((2, 2), ("dp", "tp"))),
            lambda a: gpt_tree(a.size_mib, a.layers),
        ),
        Scenario(
            "cast",
            "as `disjoint`, casting fp32 -> bf16 on the way (the senders cast: half the bytes)",
            DISJOINT,
            lambda a: gpt_tree(a.size_mib, a.layers),
            dtype=jnp.bfloat16,
        ),
        Scenario(
            "big_leaf",
            "one fp32 matrix of --big-leaf-mib (1 GiB), fsdp2 x tp2 on 0-3 -> tp4 on 4-7",
            DISJOINT,
            lambda a: one_leaf_tree(a.big_leaf_mib),
        ),
    ]
}

STRATEGIES = ("jaxreshard", "jaxreshard_8_leaves", "device_put", "gather_slice", "xla_reshard")


def _mesh(devices: Sequence[jax.Device], positions: Sequence[int], shape_axes: Any) -> Mesh:
    shape, axes = shape_axes
    return Mesh(np.array([devices[i] for i in positions]).reshape(shape), axes)


def shardings(tree: Tree, layouts: Layouts, devices: Sequence[jax.Device]) -> tuple[Any, Any]:
    """Source and destination `NamedSharding` trees of ``tree`` under ``layouts``."""
    src = _mesh(devices, layouts.src_devices, layouts.src_mesh)
    dst = _mesh(devices, layouts.dst_devices, layouts.dst_mesh)
    return (
        {k: NamedSharding(src, layouts.src_specs[role]) for k, (_, role) in tree.leaves.items()},
        {k: NamedSharding(dst, layouts.dst_specs[role]) for k, (_, role) in tree.leaves.items()},
    )


def make_source(tree: Tree, src_shardings: dict[str, NamedSharding]) -> dict[str, jax.Array]:
    """Build the source arrays on their devices (no host copy): distinct values per leaf."""
    makers: dict[Any, Any] = {}
    out = {}
    for k, ((shape, _), leaf) in enumerate(zip(tree.leaves.values(), tree.leaves, strict=True)):
        sharding = src_shardings[leaf]
        key = (shape, sharding)
        if key not in makers:

            def make(seed: jax.Array, shape: tuple[int, ...] = shape) -> jax.Array:
                i = jax.lax.iota(jnp.int32, math.prod(shape)).reshape(shape)
                return ((i * 7 + seed) % 4093).astype(jnp.float32)

            makers[key] = jax.jit(make, out_shardings=sharding)
        out[leaf] = makers[key](jnp.int32(k))
    return out


# ------------------------------------------------------------------------------ strategies


class Strategy:
    """One way of moving the source tree into the destination layout.

    ``__call__`` returns the destination tree; ``done`` disposes of it (frees it, or keeps it
    for the next call's donation). Byte counts are per call; None where not known.
    """

    name = ""
    source = "main"  # which source tree it reads
    donates = False  # writes into its previous result: no fresh result allocated
    bytes_sent: int | None = None
    notes = ""

    def prepare(self) -> None:
        """Untimed set-up (planning, building programs that are not compiled yet)."""

    def describe(self, src: Any) -> None:
        """Untimed, after the warm-up: fill in ``notes`` (may compile for inspection)."""

    def __call__(self, src: Any) -> Any:
        raise NotImplementedError

    def done(self, out: Any) -> None:
        for x in jax.tree_util.tree_leaves(out):
            x.delete()


class JaxReshard(Strategy):
    """jaxreshard: one plan, then every call donates the previous result (a refit loop)."""

    donates = True

    def __init__(self, src: Any, dst: Any, dtype: Any, bucket_bytes: int | None, name: str):
        self.name, self.src, self.dst = name, src, dst
        self.dtype, self.bucket_bytes = dtype, bucket_bytes
        self.source = "main" if name == "jaxreshard" else name
        self.prev: Any = None

    def prepare(self) -> None:
        t0 = time.perf_counter()
        self.plan = jr.plan(self.src, self.dst, bucket_bytes=self.bucket_bytes, dtype=self.dtype)
        self.plan_s = time.perf_counter() - t0
        self.bytes_sent = self.plan.stats.bytes_sent

    def __call__(self, src: Any) -> Any:
        out = self.plan(src, donate=self.prev)
        self.prev = out
        return out

    def done(self, out: Any) -> None:
        pass  # kept as self.prev, donated to the next call


class DevicePut(Strategy):
    """`jax.device_put` onto the destination shardings (cast first on the source, if any).

    Between two orders of one device set JAX runs one XLA reshard program per leaf. Dispatched
    back to back, several such collective programs are in flight at once, and on the CPU
    backend they deadlock now and then (XLA aborts the process after 40 s). There the leaves
    are put one at a time, each awaited: a little slower than one tree-wide call.
    """

    name = "device_put"

    def __init__(self, src_shardings: Any, dst: Any, dtype: Any):
        self.dst = dst
        self.cast = (
            None
            if dtype is None
            else jax.jit(lambda t: _cast(t, dtype), out_shardings=src_shardings)
        )
        self.one_at_a_time = any(
            s.device_set == dst[k].device_set and jax.devices()[0].platform == "cpu"
            for k, s in src_shardings.items()
        )
        if self.one_at_a_time:
            self.notes = "one leaf at a time: a tree-wide call deadlocks XLA's CPU collectives"

    def __call__(self, src: Any) -> Any:
        if self.cast is not None:
            src = self.cast(src)
        if not self.one_at_a_time:
            return jax.device_put(src, self.dst)
        return {k: _ready(jax.device_put(x, self.dst[k])) for k, x in src.items()}


class XlaReshard(Strategy):
    """XLA's own reshard: ``jax.jit(identity, out_shardings=dst)``, for one device set.

    `jax.jit` refuses a destination whose mesh lists the same devices in another order, so the
    source is first re-wrapped, zero-copy, over the destination's device order (what
    `jax.device_put` does internally; jax private API, `xla_client.reorder_shards`).
    """

    name = "xla_reshard"

    def __init__(self, src_shardings: Any, dst: Any, dtype: Any):
        self.dst = dst
        self.fn = jax.jit(lambda t: _cast(t, dtype), out_shardings=dst)
        self.rewrap: dict[str, Any] = {}
        for k, s in src_shardings.items():
            d = dst[k]
            if s._internal_device_list != d._internal_device_list:
                self.rewrap[k] = _reordered_sharding(s, d)

    def _rewrapped(self, src: Any) -> Any:
        if not self.rewrap:
            return src
        from jax._src.lib import xla_client as xc

        return {
            k: xc.reorder_shards(x, self.rewrap[k], xc.ArrayCopySemantics.REUSE_INPUT)
            if k in self.rewrap
            else x
            for k, x in src.items()
        }

    def __call__(self, src: Any) -> Any:
        return self.fn(self._rewrapped(src))

    def describe(self, src: Any) -> None:
        counts = _collective_counts(self.fn.lower(self._rewrapped(src)).compile().as_text())
        self.notes = "HLO: " + (
            ", ".join(f"{k} x{v}" for k, v in counts.items()) or "no collectives"
        )


def _reordered_sharding(src: NamedSharding, dst: NamedSharding) -> NamedSharding:
    """``src``'s placement expressed over ``dst``'s device order (as jax.device_put does)."""
    from jax._src import dispatch

    mesh = Mesh(dst.mesh.devices.reshape(src.mesh.axis_sizes), src.mesh.axis_names)
    ids = dispatch._cached_logical_device_ids(
        src._internal_device_list,
        dst._internal_device_list,
    )
    return NamedSharding(mesh, src.spec, _logical_device_ids=ids)


def _collective_counts(hlo: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter"):
        n = len(re.findall(rf"= [^=]*? {op}(?:-start)?\(", hlo))
        if n:
            counts[op] = n
    return counts


class GatherSlice(Strategy):
    """All-gather to a full replica on every source device, then slice onto the destination.

    What many RL frameworks do: ``jit(identity, out_shardings=replicated on the source
    mesh)``, then per source device one jitted program cuts the destination shards it serves out
    of its replica (a destination device that holds a replica serves itself; the others are
    served round robin), `jax.device_put` copies each to its device, and
    `jax.make_array_from_single_device_arrays` assembles the result.
    """

    name = "gather_slice"

    def __init__(self, src_shardings: Any, dst: Any, dtype: Any, tree: Tree):
        self.dst, self.tree = dst, tree
        self.keys = list(tree.leaves)
        replicated = {k: NamedSharding(s.mesh, P()) for k, s in src_shardings.items()}
        self.gather = jax.jit(lambda t: _cast(t, dtype), out_shardings=replicated)
        itemsize = jnp.dtype(dtype if dtype is not None else jnp.float32).itemsize
        # Who serves which destination shard: (leaf, dst device) -> source device.
        self.serve: list[tuple[str, jax.Device, jax.Device, tuple[slice, ...]]] = []
        gathered_bytes = sliced = 0
        for k in self.keys:
            shape = tree.leaves[k][0]
            holders = list(src_shardings[k].mesh.devices.flat)
            nbytes = math.prod(shape) * itemsize
            for idx in src_shardings[k].devices_indices_map(shape).values():
                gathered_bytes += nbytes - _index_size(idx, shape) * itemsize
            for j, (d, idx) in enumerate(dst[k].devices_indices_map(shape).items()):
                holder = d if d in holders else holders[j % len(holders)]
                self.serve.append((k, d, holder, idx))
                if holder != d:
                    sliced += _index_size(idx, shape) * itemsize
        self.bytes_sent = gathered_bytes + sliced
        self.notes = f"all-gather {_mib(gathered_bytes)} + copies {_mib(sliced)}"
        self.slicers: dict[jax.Device, Any] = {}
        for holder in {h for _, _, h, _ in self.serve}:
            jobs = [(k, idx) for k, _, h, idx in self.serve if h == holder]
            self.slicers[holder] = (
                sorted({k for k, _ in jobs}),
                jax.jit(
                    _slicer(jobs, sorted({k for k, _ in jobs})),
                    out_shardings=SingleDeviceSharding(holder),
                ),
            )

    def __call__(self, src: Any) -> Any:
        full = self.gather(src)
        replica = {k: {s.device: s.data for s in full[k].addressable_shards} for k in self.keys}
        del full
        pieces: dict[tuple[str, jax.Device], jax.Array] = {}
        for holder, (keys, fn) in self.slicers.items():
            outs = fn(*[replica[k][holder] for k in keys])
            jobs = [(k, d) for k, d, h, _ in self.serve if h == holder]
            for (k, d), x in zip(jobs, outs, strict=True):
                pieces[k, d] = x
        del replica
        order = list(pieces)
        moved = jax.device_put([pieces[kd] for kd in order], [kd[1] for kd in order])
        del pieces
        placed = dict(zip(order, moved, strict=True))
        out = {}
        for k in self.keys:
            s = self.dst[k]
            out[k] = jax.make_array_from_single_device_arrays(
                self.tree.leaves[k][0], s, [placed[k, d] for d in s.addressable_devices]
            )
        return out


def _slicer(jobs: list[tuple[str, tuple[slice, ...]]], keys: list[str]) -> Callable[..., Any]:
    def cut(*replicas: jax.Array) -> tuple[jax.Array, ...]:
        by_key = dict(zip(keys, replicas, strict=True))
        return tuple(by_key[k][idx] for k, idx in jobs)

    return cut


def _cast(tree: Any, dtype: Any) -> Any:
    return tree if dtype is None else jax.tree_util.tree_map(lambda x: x.astype(dtype), tree)


def _index_size(idx: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    return math.prod(len(range(*s.indices(n))) for s, n in zip(idx, shape, strict=True))


# ------------------------------------------------------------------------------ measuring


class _CompileClock:
    """Sums JAX's tracing, lowering and backend-compile durations while ``on``."""

    EVENTS = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )

    def __init__(self) -> None:
        self.on, self.total = False, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **_: Any) -> None:
        if self.on and event in self.EVENTS:
            self.total += duration

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False


class _HostWatch:
    """Counts bytes that JAX moves through host NumPy arrays during a call.

    `jax.device_put` between different device sets falls back to pulling the array into one
    host NumPy array (``x._value``) and handing it to ``pxla.shard_args``, which copies each
    destination shard back to its device. Watching ``shard_args`` sees exactly those arrays.
    """

    @contextlib.contextmanager
    def measure(self) -> Iterator[list[int]]:
        from jax._src.interpreters import pxla

        counted = [0]
        original = pxla.shard_args

        def watched(shardings: Any, layouts: Any, copy: Any, args: Any, *a: Any, **k: Any) -> Any:
            for s, x in zip(shardings, args, strict=True):
                if isinstance(x, np.ndarray):
                    shard = math.prod(s.shard_shape(x.shape)) * x.itemsize
                    counted[0] += x.nbytes + shard * len(s.device_set)  # down, then back up
            return original(shardings, layouts, copy, args, *a, **k)

        pxla.shard_args = watched
        try:
            yield counted
        finally:
            pxla.shard_args = original


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"VmHWM:\s+(\d+) kB", f.read())
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class _RssSampler(threading.Thread):
    """Samples resident memory every ~0.2 ms until stopped; keeps the peak."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _rss()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.0002)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, _rss())
        return self.peak


def peak_rss_during(fn: Callable[[], Any]) -> tuple[Any, int, str]:
    """Run ``fn``; return its result, peak RSS beyond the RSS just before, and the method."""
    gc.collect()
    _malloc_trim()
    have_hwm = os.path.exists("/proc/self/status") and _reset_hwm()
    base = _rss()
    sampler = _RssSampler()
    sampler.start()
    try:
        out = fn()
    finally:
        sampled = sampler.stop()
    if have_hwm:
        hwm = _hwm()
        if hwm is not None:
            return out, max(hwm, sampled) - base, "VmHWM"
    return out, sampled - base, "sampled statm"


def _ready(x: Any) -> Any:
    return jax.block_until_ready(x)


@jax.jit
def _equal(a: Any, b: Any) -> jax.Array:
    leaves = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x, y: jnp.all(x == y), a, b))
    return jnp.all(jnp.stack(leaves))


# ---------------------------------------------------------------------------------- running


@dataclasses.dataclass
class Result:
    """Figures of one strategy in one scenario (the JSON record)."""

    strategy: str
    times_s: list[float] = dataclasses.field(default_factory=list)
    min_s: float = math.nan
    median_s: float = math.nan
    max_s: float = math.nan
    ratio_vs_jaxreshard: float | None = None
    first_call_s: float = math.nan
    compile_s: float = math.nan
    plan_s: float | None = None
    bytes_sent: int | None = None
    bytes_lower_bound: int | None = None
    host_bytes: int = 0
    rounds: int | None = None
    buckets: int | None = None
    staging_bytes: int | None = None
    peak_rss_bytes: int | None = None
    new_result_bytes: int = 0
    transient_bytes: int | None = None
    rss_method: str = ""
    verified: bool | None = None
    notes: str = ""


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = max(total, 1), 0, enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(frac * 30)
        elapsed = time.perf_counter() - self.t0
        line = f"[{bar:<30}] {self.done:>4}/{self.total} {elapsed:6.0f}s  {label[:40]:<40}"
        sys.stderr.write(f"\r{line}" if self.tty else f"{line}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()


def _steps(scenario: Scenario, args: argparse.Namespace) -> int:
    return len(_chosen(scenario, args)) * (args.pairs + 2)  # warm-up, pairs, memory


def _chosen(scenario: Scenario, args: argparse.Namespace) -> list[str]:
    return [s for s in scenario.strategies if args.strategies is None or s in args.strategies]


def _stepper(shardings_tree: Any) -> Any:
    """An untimed "optimizer step": a new source tree in place of the old (donated) one."""
    return jax.jit(
        lambda t: jax.tree_util.tree_map(lambda x: x + 1, t),
        out_shardings=shardings_tree,
        donate_argnums=0,
    )


def run_scenario(
    scenario: Scenario,
    args: argparse.Namespace,
    devices: Sequence[jax.Device],
    clock: _CompileClock,
    progress: Progress,
) -> dict[str, Any]:
    """Run one scenario: warm-up and check, interleaved timing, memory pass. JSON-ready dict."""
    tree = scenario.tree(args)
    src_s, dst_s = shardings(tree, scenario.layouts, devices)
    sources: dict[str, Any] = {"main": make_source(tree, src_s)}
    steppers = {"main": _stepper(src_s)}
    names = _chosen(scenario, args)
    strategies: list[Strategy] = []
    extra: dict[str, Any] = {}
    for name in names:
        if name == "jaxreshard":
            s: Strategy = JaxReshard(
                sources["main"], dst_s, scenario.dtype, args.bucket_bytes, name
            )
        elif name == "jaxreshard_8_leaves":
            few = matrices_tree(args.size_mib, 8, like=args.many_leaves)
            f_src, f_dst = shardings(few, scenario.layouts, devices)
            sources[name] = make_source(few, f_src)
            steppers[name] = _stepper(f_src)
            s = JaxReshard(sources[name], f_dst, scenario.dtype, args.bucket_bytes, name)
        elif name == "device_put":
            s = DevicePut(src_s, dst_s, scenario.dtype)
        elif name == "gather_slice":
            s = GatherSlice(src_s, dst_s, scenario.dtype, tree)
        elif name == "xla_reshard":
            s = XlaReshard(src_s, dst_s, scenario.dtype)
        else:
            raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
        strategies.append(s)
    results = {s.name: Result(s.name) for s in strategies}
    dst_itemsize = jnp.dtype(scenario.dtype or jnp.float32).itemsize
    dst_total = sum(
        _index_size(idx, shape) * dst_itemsize
        for k, (shape, _) in tree.leaves.items()
        for idx in dst_s[k].devices_indices_map(shape).values()
    )

    # Warm-up: first calls (compile), all on the same source, each checked against jaxreshard.
    reference = None
    for s in strategies:
        r = results[s.name]
        s.prepare()
        if isinstance(s, JaxReshard):
            r.plan_s = s.plan_s
            st = s.plan.stats
            r.bytes_lower_bound, r.rounds, r.buckets, r.staging_bytes = (
                st.bytes_lower_bound,
                st.rounds,
                st.buckets,
                st.staging_bytes,
            )
        compile_before = clock.total
        with clock.measure():
            t0 = time.perf_counter()
            out = _ready(s(sources[s.source]))
            r.first_call_s = time.perf_counter() - t0
            if isinstance(s, JaxReshard):  # the donating call compiles its own init program
                out = _ready(s(sources[s.source]))
        r.compile_s = clock.total - compile_before
        with _HostWatch().measure() as host:  # a steady-state call, as the timed ones
            out = _ready(s(sources[s.source]))
        r.host_bytes = host[0]
        r.bytes_sent = s.bytes_sent if r.host_bytes == 0 else 0
        r.new_result_bytes = 0 if s.donates else dst_total
        if s.name == "device_put" and r.host_bytes == 0 and r.bytes_sent is None:
            s.notes = "one device set: JAX re-orders the shards, XLA reshards; " + s.notes
        if s.name == "jaxreshard":
            reference = out
            r.verified = True if len(strategies) == 1 else None
        elif s.source == "main" and reference is not None:
            r.verified = bool(_equal(reference, out))
            if "device_put" == s.name:
                results["jaxreshard"].verified = r.verified  # device_put is JAX's ground truth
        s.done(out)
        del out
        s.describe(sources[s.source])
        progress.step(f"{scenario.name}: warm-up {s.name}")
    reference = None

    # Timing: A B C, C B A, ... with a fresh source before every call.
    for i in range(args.pairs):
        order = strategies if i % 2 == 0 else strategies[::-1]
        for s in order:
            sources[s.source] = _ready(steppers[s.source](sources[s.source]))
            src = sources[s.source]
            t0 = time.perf_counter()
            out = _ready(s(src))
            results[s.name].times_s.append(time.perf_counter() - t0)
            s.done(out)
            del out
            progress.step(f"{scenario.name}: pair {i + 1} {s.name}")

    # Memory: one call per strategy, alone.
    for s in strategies:
        sources[s.source] = _ready(steppers[s.source](sources[s.source]))
        src = sources[s.source]
        out, peak, method = peak_rss_during(lambda s=s, src=src: _ready(s(src)))
        r = results[s.name]
        r.peak_rss_bytes, r.rss_method = peak, method
        r.transient_bytes = peak - r.new_result_bytes
        s.done(out)
        del out
        progress.step(f"{scenario.name}: memory {s.name}")

    base = results.get("jaxreshard")
    for s in strategies:
        r = results[s.name]
        r.notes = r.notes or s.notes
        r.min_s, r.median_s, r.max_s = (
            min(r.times_s, default=math.nan),
            statistics.median(r.times_s) if r.times_s else math.nan,
            max(r.times_s, default=math.nan),
        )
        if base is not None and r.times_s and base.times_s:
            r.ratio_vs_jaxreshard = statistics.median(
                a / b for a, b in zip(r.times_s, base.times_s, strict=True)
            )
    if scenario.dtype is not None and "jaxreshard" in results:
        plain = jr.plan(sources["main"], dst_s, bucket_bytes=args.bucket_bytes)
        cast_sent = results["jaxreshard"].bytes_sent
        extra["bytes_sent_without_cast"] = plain.stats.bytes_sent
        extra["cast_halves_bytes_sent"] = 2 * cast_sent == plain.stats.bytes_sent
    for s in strategies:
        if isinstance(s, JaxReshard):
            s.prev = None
    return {
        "scenario": scenario.name,
        "description": scenario.description,
        "leaves": len(tree.leaves),
        "bytes": tree.nbytes_f32,
        "dst_bytes_total": dst_total,
        "dst_dtype": jnp.dtype(scenario.dtype or jnp.float32).name,
        "results": [dataclasses.asdict(results[s.name]) for s in strategies],
        **extra,
    }


# ---------------------------------------------------------------------------------- output


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def _ms(t: float) -> str:
    return "-" if t is None or math.isnan(t) else f"{t * 1e3:.1f}"


def format_scenario(rec: dict[str, Any]) -> str:
    """A terminal table for one scenario."""
    lines = [
        f"== {rec['scenario']}: {rec['description']}",
        f"   {rec['leaves']} leaves, {_mib(rec['bytes'])} MiB fp32 source, destination "
        f"{_mib(rec['dst_bytes_total'])} MiB {rec['dst_dtype']} over all its devices",
    ]
    jrr = next((r for r in rec["results"] if r["strategy"] == "jaxreshard"), None)
    if jrr is not None:
        bound = jrr["bytes_lower_bound"]
        sent = jrr["bytes_sent"]
        lines.append(
            f"   jaxreshard: sent {_mib(sent)} MiB, lower bound {_mib(bound)} MiB"
            f" ({'= bound' if sent == bound else 'ABOVE BOUND'}), {jrr['rounds']} rounds in "
            f"{jrr['buckets']} bucket(s), staging {_mib(jrr['staging_bytes'])} MiB/device, "
            f"plan {jrr['plan_s']:.2f} s"
        )
    if "bytes_sent_without_cast" in rec:
        lines.append(
            f"   cast: sent {_mib(jrr['bytes_sent'] if jrr else None)} MiB vs "
            f"{_mib(rec['bytes_sent_without_cast'])} MiB without the cast (exactly half: "
            f"{rec['cast_halves_bytes_sent']})"
        )
    head = (
        f"   {'strategy':<20} {'min ms':>8} {'med ms':>8} {'max ms':>8} {'x jr':>6} "
        f"{'sent MiB':>9} {'host MiB':>9} {'peak MiB':>9} {'trans MiB':>9} "
        f"{'1st call s':>10} {'compile s':>9} {'ok':>3}"
    )
    lines += [head, "   " + "-" * (len(head) - 3)]
    for r in rec["results"]:
        ratio = "-" if r["ratio_vs_jaxreshard"] is None else f"{r['ratio_vs_jaxreshard']:.2f}"
        ok = {True: "yes", False: "NO", None: "-"}[r["verified"]]
        lines.append(
            f"   {r['strategy']:<20} {_ms(r['min_s']):>8} {_ms(r['median_s']):>8} "
            f"{_ms(r['max_s']):>8} {ratio:>6} {_mib(r['bytes_sent']):>9} "
            f"{_mib(r['host_bytes']):>9} {_mib(r['peak_rss_bytes']):>9} "
            f"{_mib(r['transient_bytes']):>9} {r['first_call_s']:>10.2f} "
            f"{r['compile_s']:>9.2f} {ok:>3}"
        )
        if r["notes"]:
            lines.append(f"   {'':<20} {r['notes']}")
    return "\n".join(lines)


def targets(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals, checked against this run (goals, not tests)."""
    by = {
        rec["scenario"]: {r["strategy"]: r for r in rec["results"]} | {"_": rec} for rec in records
    }
    out = []

    def ratio(scn: str, other: str) -> float | None:
        r = by.get(scn, {}).get(other)
        if r is None or r["ratio_vs_jaxreshard"] in (None, 0):
            return None
        return 1.0 / r["ratio_vs_jaxreshard"]  # jaxreshard time / other's time

    def add(goal: str, value: float | None, limit: float) -> None:
        met = None if value is None else value <= limit
        out.append({"goal": goal, "value": value, "limit": limit, "met": met})

    add("colocated: jaxreshard / xla_reshard <= 0.5", ratio("colocated", "xla_reshard"), 0.5)
    add("many_leaves: jaxreshard / device_put <= 0.5", ratio("many_leaves", "device_put"), 0.5)
    many = by.get("many_leaves", {}).get("_", {}).get("leaves", "many")
    add(
        f"many_leaves: jaxreshard ({many} leaves) / jaxreshard (8 leaves) <= 1.5",
        ratio("many_leaves", "jaxreshard_8_leaves"),
        1.5,
    )
    add("disjoint: jaxreshard / device_put <= 2", ratio("disjoint", "device_put"), 2.0)
    if "cast" in by and "jaxreshard" in by["cast"]:
        ok = by["cast"]["_"].get("cast_halves_bytes_sent")
        out.append({"goal": "cast: bytes_sent exactly half of fp32", "met": ok})
    for name, rs in by.items():
        r = rs.get("jaxreshard")
        if r is not None:
            out.append(
                {
                    "goal": f"{name}: bytes_sent == bytes_lower_bound",
                    "met": r["bytes_sent"] == r["bytes_lower_bound"],
                }
            )
    if "big_leaf" in by and "jaxreshard" in by["big_leaf"]:
        r = by["big_leaf"]["jaxreshard"]
        replica = by["big_leaf"]["_"]["bytes"]
        add(
            "big_leaf: jaxreshard transient / full replica <= 0.25",
            None if r["transient_bytes"] is None else r["transient_bytes"] / replica,
            0.25,
        )
    return out


def format_targets(ts: Sequence[dict[str, Any]]) -> str:
    lines = ["== goals (issue 5; goals, not tests)"]
    for t in ts:
        met = {True: "met", False: "NOT MET", None: "n/a"}[t["met"]]
        value = f" ({t['value']:.2f})" if t.get("value") is not None else ""
        lines.append(f"   {met:<8} {t['goal']}{value}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxreshard.bench",
        description="Benchmark jaxreshard against jax.device_put, gather-then-slice and XLA's "
        "own reshard on 8 (simulated CPU) devices.",
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=sorted(SCENARIOS),
        help="run only this scenario (repeatable); default: all",
    )
    p.add_argument(
        "--strategies",
        type=lambda s: s.split(","),
        default=None,
        help=f"comma-separated subset of {','.join(STRATEGIES)} (default: all that apply)",
    )
    p.add_argument("--pairs", type=int, default=10, help="interleaved timing rounds (>= 10)")
    p.add_argument(
        "--bucket-bytes",
        type=int,
        default=None,
        help="jaxreshard's staging limit per device (default: jr.default_bucket_bytes)",
    )
    p.add_argument("--size-mib", type=float, default=256.0, help="size of the GPT-like tree")
    p.add_argument(
        "--layers", type=int, default=8, help="blocks of the GPT-like tree (9 leaves each)"
    )
    p.add_argument(
        "--many-leaves", type=int, default=1024, help="leaves of many_leaves (a multiple of 8)"
    )
    p.add_argument(
        "--big-leaf-mib", type=float, default=1024.0, help="size of big_leaf's one matrix"
    )
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run every scenario in this process (default: one child process per scenario)",
    )
    p.add_argument(
        "--attempts",
        type=int,
        default=3,
        help="runs of a scenario whose child process aborts before it is reported as failed",
    )
    p.add_argument("--quiet-header", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    if args.many_leaves < 8 or args.many_leaves % 8:
        p.error("--many-leaves must be a positive multiple of 8")
    if args.strategies is not None:
        bad = [s for s in args.strategies if s not in STRATEGIES]
        if bad:
            p.error(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the tables; return (and optionally write) the JSON record.

    With several scenarios, each runs in its own child process (``--in-process`` turns this
    off): XLA's own reshard program (`jax.device_put` or ``jit`` between two orders of the
    same CPU devices) deadlocks now and then in XLA's in-process CPU collectives, and XLA
    then aborts the whole process after 40 s. A scenario that aborts is run again, up to
    ``--attempts`` times, then reported as failed; the others still run.
    """
    args = parse_args(argv)
    names = args.scenario or list(SCENARIOS)
    if len(names) > 1 and not args.in_process:
        return _run_children(args, names)
    devices = jax.devices()
    if len(devices) < N_DEVICES:
        raise SystemExit(
            f"jaxreshard.bench needs {N_DEVICES} devices, JAX has {len(devices)} "
            f"({devices[0].platform}). On CPU: set XLA_FLAGS={_HOST_FLAG}={N_DEVICES} before "
            "JAX starts, or JAX_PLATFORMS=cpu on a machine with fewer accelerators."
        )
    if args.pairs < 10 and not args.quiet_header:
        print(f"note: --pairs {args.pairs} < 10: figures are indicative only", file=sys.stderr)
    clock = _CompileClock()
    progress = Progress(
        sum(_steps(SCENARIOS[n], args) for n in names),
        enabled=not args.no_progress,
    )
    header = _header(args, devices)
    if not args.quiet_header:
        _print_header(header)
    records: list[dict[str, Any]] = []
    try:
        for name in names:
            rec = run_scenario(SCENARIOS[name], args, devices[:N_DEVICES], clock, progress)
            records.append(rec)
            progress.close()
            print(format_scenario(rec), flush=True)
            # Written after every scenario: an abort in XLA keeps what was measured.
            _write(args.json, {"config": header, "scenarios": records, "complete": False})
    finally:
        progress.close()
    return _finish(args, header, records, [])


def _header(args: argparse.Namespace, devices: Sequence[jax.Device]) -> dict[str, Any]:
    return {
        "jax": jax.__version__,
        "jaxreshard": jr.__version__,
        "platform": devices[0].platform,
        "devices": len(devices),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "pairs": args.pairs,
        "size_mib": args.size_mib,
        "big_leaf_mib": args.big_leaf_mib,
        "layers": args.layers,
        "many_leaves": args.many_leaves,
        "bucket_bytes": args.bucket_bytes
        if args.bucket_bytes is not None
        else jr.default_bucket_bytes(devices[0].platform),
    }


def _print_header(header: dict[str, Any]) -> None:
    print(
        f"jaxreshard.bench: {header['devices']} {header['platform']} devices, jax "
        f"{header['jax']}, {header['cpus']} CPUs, {header['pairs']} interleaved rounds, bucket "
        f"{_mib(header['bucket_bytes'])} MiB",
        flush=True,
    )


def _finish(
    args: argparse.Namespace,
    header: dict[str, Any],
    records: list[dict[str, Any]],
    failed: list[dict[str, Any]],
) -> dict[str, Any]:
    ts = targets(records)
    if not args.child:
        print(format_targets(ts), flush=True)
        for f in failed:
            print(f"   FAILED   {f['scenario']}: {f['error']}", flush=True)
    report = {
        "config": header,
        "scenarios": records,
        "goals": ts,
        "failed": failed,
        "complete": not failed,
    }
    _write(args.json, report)
    return report


def _run_children(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """Run every scenario in a child process (``--in-process``) and merge their records."""
    import tempfile

    if args.pairs < 10:
        print(f"note: --pairs {args.pairs} < 10: figures are indicative only", file=sys.stderr)
    common = [
        *("--pairs", str(args.pairs), "--size-mib", str(args.size_mib)),
        *("--layers", str(args.layers), "--many-leaves", str(args.many_leaves)),
        *("--big-leaf-mib", str(args.big_leaf_mib)),
        *(["--bucket-bytes", str(args.bucket_bytes)] if args.bucket_bytes else []),
        *(["--strategies", ",".join(args.strategies)] if args.strategies else []),
        *(["--no-progress"] if args.no_progress else []),
    ]
    header: dict[str, Any] | None = None
    records: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="jaxreshard-bench-") as tmp:
        for name in names:
            path = os.path.join(tmp, f"{name}.json")
            for attempt in range(1, args.attempts + 1):
                cmd = [sys.executable, "-m", "jaxreshard.bench", "--in-process", "--child"]
                cmd += ["--scenario", name, "--json", path, "--quiet-header", *common]
                if header is None:
                    cmd.remove("--quiet-header")  # the first child prints the header
                returncode, err = _run_teeing_stderr(cmd)
                if returncode == 0:
                    with open(path) as f:
                        child = json.load(f)
                    header = header or child["config"]
                    records.extend(child["scenarios"])
                    break
                lines = [ln for ln in err.splitlines() if ln.strip()]
                error = next((ln for ln in lines if "] Termination timeout" in ln), None)
                error = (error or (lines[-1] if lines else f"exit {returncode}"))[:300]
                print(
                    f"   {name}: child exited with {returncode} (attempt {attempt}): {error}",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                failed.append({"scenario": name, "error": error})
    args.child = False
    return _finish(args, header or {}, records, failed)


def _run_teeing_stderr(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd``; its stdout goes to ours, its stderr to ours and into the returned text."""
    import subprocess

    sys.stdout.flush()
    proc = subprocess.Popen(cmd, stdout=sys.stdout, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    kept = bytearray()
    while chunk := os.read(proc.stderr.fileno(), 4096):
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
        kept += chunk
        del kept[: max(0, len(kept) - 200_000)]
    return proc.wait(), kept.decode(errors="replace")


def _write(path: str | None, report: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(_no_nan(report), f, indent=1, default=str)


def _no_nan(x: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_no_nan(v) for v in x]
    return x


if __name__ == "__main__":
    main()
