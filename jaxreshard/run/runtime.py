"""Runs a `Lowered` plan on JAX devices: compile each distinct program once, run the steps.

A thin layer over JAX. The pure lowering (`jaxreshard.planning.lower`) says what every program
does; here each becomes a jitted ``shard_map``:

- *pack* (`PackProgram`): over a mesh of senders, each device slices its shards, casts, and
  writes the words into staging buffers it donates (the writes happen in place);
- *transfer* (`TransferProgram`): over the union mesh, one ``jax.lax.ppermute`` per round (XLA
  collective-permute; NCCL send/recv on GPU), receiving into donated buffers;
- *unpack* (`UnpackProgram`): over a mesh of receivers, each device writes the received words
  (and its local copies) into its destination shards, donated, in place.

Per-device buffers pass between these programs zero-copy: ``addressable_shards`` gives the
buffers of one program's output, `jax.make_array_from_single_device_arrays` wraps them into
the next program's input over another mesh.

**Staging.** Buffers come from a pool kept per device for the life of the plan (so a refit
loop allocates nothing after its first call; fresh buffers page-fault on first touch). Before
each step the pool frees and allocates by `plan_pool`, the policy the lowering simulates to
report ``stats.staging_bytes``, so a device never holds more staging than that. There is no
host sync between steps: the pool is finite, and a buffer handed to the next step's program
is donated, so that program waits for the last one reading it (JAX orders uses of a buffer).
Steps therefore overlap where their devices allow (the next step's pack on the senders while
the receivers unpack) without ever holding more than the pool.

**No host transfers.** Every buffer is made on device by a compiled program (zeros, and the
tables of box starts as constants), so a call runs under ``jax.transfer_guard("disallow")``.

Multi-controller JAX: each process runs only the programs over meshes that hold one of its
devices, and wraps only its own buffers.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # now: its first import registers an exit hook, refused at exit
import contextlib
import dataclasses
import functools
import math
import os
import threading
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, Sharding

from jaxreshard.errors import ReshardError
from jaxreshard.planning.layout import MeshSpec
from jaxreshard.planning.lower import (
    GROUP_AXIS,
    Lowered,
    Operand,
    PackCall,
    PackProgram,
    Roles,
    Slot,
    Step,
    TransferProgram,
    UnpackCall,
    UnpackProgram,
    plan_pool,
    step_roles,
    step_rounds_of,
)
from jaxreshard.planning.route import LeafSpec
from jaxreshard.run import views
from jaxreshard.run.codec import (
    ZERO,
    bits_dtype,
    bits_to_words,
    from_bits,
    read_bits,
    to_bits,
    whole_bits,
    wire_itemsize,
    words_of,
    words_to_bits,
    write_bits,
)

Buffers = dict[int, jax.Array]
"""Device id -> this process's single-device buffer on it."""

MAX_COMPILE_THREADS = 32
"""Most threads `Runtime._compile_ahead` compiles a first call's programs on (at most one per
core)."""

ONE_OFF_OPTIONS = {"xla_backend_optimization_level": 0}
"""XLA options of the programs a plan runs once (tables of box starts, staging buffers): their
code speed hardly matters, their compile time adds to the first call."""

CPU_COPY_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
"""XLA options of the pack and unpack programs on the CPU backend. XLA's CPU compiler builds
every fusion of a program as a module of its own, and a pack or unpack program is mostly
fusions (a copy per piece, an output per leaf): with the newer fusion emitters each costs
about 13 ms to compile here, with the older ones about 6 ms, for the same copies at the same
speed (measured: 160 copies of one element, 2.5 -> 1.0 s to compile; 4 copies of 4 MiB, 11.6
and 8.9 ms a run). Used where the backend knows the option (`copy_options`), by programs
that do not cast (`program_options`)."""


class Runtime:
    """The compiled programs and staging pool of one plan, for this process's devices.

    Construction compiles nothing and moves nothing. The first `run` compiles every distinct
    program (typed caches: programs are looked up by their value) and builds the on-device
    tables; later runs only dispatch.
    """

    def __init__(
        self,
        leaves: Sequence[LeafSpec],
        lowered: Lowered,
        src_shardings: Sequence[Sharding],
        dst_shardings: Sequence[NamedSharding],
        transfer_options: Mapping[str, Any] | None = None,
        never_donated: Iterable[int] = (),
    ) -> None:
        self.leaves = tuple(leaves)
        # Leaves a call with donate= still allocates (destinations in another memory kind,
        # `run.boundary`): the first call compiles their allocation too.
        self._never_donated = frozenset(never_donated)
        self.transfer_options = dict(transfer_options or {})
        self.lowered = lowered
        self.src_shardings = tuple(src_shardings)
        self.dst_shardings = tuple(dst_shardings)
        self.device = {d.id: d for d in jax.devices()}
        for s in (*src_shardings, *dst_shardings):
            self.device.update({d.id: d for d in s.device_set})
        here = jax.process_index()
        self.local = frozenset(i for i, d in self.device.items() if d.process_index == here)
        # The arrays' own meshes, so that outputs carry the caller's shardings exactly.
        self._mesh: dict[MeshSpec, Mesh] = {}
        for leaf, s in zip(self.leaves, self.src_shardings, strict=True):
            if leaf.src.mesh is not None and isinstance(s, NamedSharding):
                self._mesh.setdefault(leaf.src.mesh, s.mesh)
        for leaf, s in zip(self.leaves, self.dst_shardings, strict=True):
            self._mesh.setdefault(leaf.dst.mesh, s.mesh)
        self._packs: dict[Any, Callable[..., Any]] = {}
        self._unpacks: dict[Any, Callable[..., Any]] = {}
        self._bitcasts: dict[Any, Callable[..., Any]] = {}
        self._transfers: dict[TransferProgram, Callable[..., Any]] = {}
        self._allocs: dict[Any, Callable[..., Any]] = {}
        self._alloc_fns: dict[tuple[int, ...], Callable[[], tuple[jax.Array, ...]]] = {}
        # Per leaf, read on every call that makes fresh destinations: a shard here, no elements.
        self.holds_shard = [bool(s.addressable_devices) for s in self.dst_shardings]
        self._empty = [not math.prod(leaf.shape) for leaf in self.leaves]
        self._zeros: dict[tuple[Slot, tuple[int, ...]], Callable[..., Any]] = {}
        self._steps: list[_StepRun] | None = None
        self._tables: dict[tuple[MeshSpec, Any], jax.Array] = {}
        self._dst_views: dict[int, views.View] = {}
        self._pool: dict[int, dict[Slot, list[jax.Array]]] = defaultdict(lambda: defaultdict(list))
        self.host_syncs = waits_between_steps(self.device[d].platform for d in lowered.union)
        self._lock = threading.Lock()

    # --------------------------------------------------------------------------------- run

    def run(
        self,
        src: Sequence[jax.Array | jax.ShapeDtypeStruct],
        donate: Sequence[jax.Array | None] | None = None,
        profile: dict[str, float] | None = None,
        before_collectives: Callable[[], None] | None = None,
    ) -> list[jax.Array]:
        """Move ``src`` (one array per leaf) into the destination layout.

        With ``donate`` (a previous result), its buffers receive the data and are consumed.
        The source arrays are only read. With ``profile`` (a dict), every phase is awaited and
        its wall time added under its name: a profile, not the fast path.

        ``before_collectives`` runs once, after the first step's packs are dispatched and
        before the first program that involves another device's data (so a check through the
        host, such as the multi-process order check, overlaps the first packs). If it raises,
        nothing but staging buffers has been written and the call stops there.
        """
        with self._lock, _CPU_CALLS if self.host_syncs else contextlib.nullcontext():
            srcs = _Sources(self, src)
            if self._steps is None:
                self._tables = self._build_tables()
                transfers = dict.fromkeys(s.transfer for s in self.lowered.steps if s.transfer)
                _in_parallel([functools.partial(self._transfer_fn, t) for t in transfers])
                self._steps = [self._resolve(step) for step in self.lowered.steps]
                self._compile_ahead(srcs, fresh=donate is None)
            clock = _Clock(profile)
            dst = _Destinations(self, donate)
            previous = _LAST_STEP.arrays() if self.host_syncs else []
            hook = [before_collectives] if before_collectives is not None else []
            for step in self._steps:
                previous = self._run_step(step, srcs, dst, clock, previous, hook)
            if self.host_syncs:
                # The next call's first transfer, of this plan or any other, waits for this
                # call's last step too, as each step waits for the one before: calls made back
                # to back would otherwise put two calls' collectives in flight at once (200
                # refits of a one-step plan in a loop aborted in XLA's rendezvous).
                _LAST_STEP.remember(previous)
            if hook:
                hook.pop()()
            return dst.finish()

    def _run_step(
        self,
        step: _StepRun,
        src: _Sources,
        dst: _Destinations,
        clock: _Clock,
        previous: list[jax.Array],
        hook: list[Callable[[], None]],
    ) -> list[jax.Array]:
        """Dispatch one step; returns what it wrote (for the next step's host sync). Runs and
        drops the pending ``hook`` before the step's transfer and unpacks."""
        if step.fresh and not dst.donated_all:
            dst.allocate(step.fresh)
            clock.mark("alloc", dst.pending())
        staging = self._take(step)
        clock.mark("pool", [])
        sent: dict[tuple[int, int], jax.Array] = {}
        for call in step.packs:
            outs = call.fn(*call.table, *call.operands(src, dst), *call.staging(staging, sent))
            call.collect(outs, sent)
        clock.mark("pack", list(sent.values()))
        if self.host_syncs and previous and step.transfer is not None:
            # After the packs: they hold no collective, so they may run beside the previous
            # step's transfer and unpacks (see `waits_between_steps`).
            _await(previous)
        if hook:
            hook.pop()()
        received: dict[tuple[int, int], jax.Array] = {}
        if isinstance(step.transfer, _WholeRun):
            # (no packs, no unpacks: shards go as they are, into their destinations)
            received, written = step.transfer.run(src, dst, staging)
            clock.mark("transfer", written)
            clock.mark("unpack", [])  # (none: a profile still names every phase)
            self._back_to_pool(step, staging, received.items())
            return [*written, *received.values()]
        if step.transfer is not None:
            received = step.transfer.run(sent, staging)
            clock.mark("transfer", list(received.values()))
        # (what devices pass themselves, `Step.kept`: read from the buffers their packs filled)
        kept = {(d, t): sent[d, t] for d, t in step.kept if (d, t) in sent}
        readable = {**received, **kept} if kept else received
        written = []
        for call in step.unpacks:
            outs = call.run(readable, src, dst)
            call.store(outs, dst)
            written.extend(outs)
        clock.mark("unpack", dst.pending())
        self._back_to_pool(step, staging, [*sent.items(), *received.items()])
        if step.transfer is None:  # no collective: the next transfer also waits for the last
            return [*previous, *written]
        return [*written, *received.values()]

    def _back_to_pool(
        self,
        step: _StepRun,
        staging: _Staging,
        used: Iterable[tuple[tuple[int, int], jax.Array]],
    ) -> None:
        """Back to the pool: the buffers not donated, and ``used``, what the programs returned
        in place of the donated ones (``((device, step slot), buffer)``: a device's packed and
        received buffers of one slot are two). A later step donating one of them waits for
        its last reader."""
        for d, by_slot in staging.idle.items():
            for slot, buf in by_slot.items():
                self._pool[d][slot].append(buf)
        for (d, t), buf in used:
            self._pool[d][step.slots[t]].append(buf)

    # ------------------------------------------------------------------------- staging pool

    def _take(self, step: _StepRun) -> _Staging:
        """Buffers for ``step`` from the pool, by role (freeing and allocating by
        `plan_pool`, the policy `lower.staging` simulates)."""
        frees, missing = self._shortfall(
            step, lambda d: {slot: len(bufs) for slot, bufs in self._pool[d].items()}
        )
        for d, free in frees.items():
            for slot, n in free.items():
                del self._pool[d][slot][:n]
        for slot, devices in _groups(missing):
            for d, buf in self._allocate(slot, devices).items():
                self._pool[d][slot].append(buf)
        staging = _Staging()
        for d, roles in step.roles.items():
            pool = self._pool[d]
            for t, slot in roles.recv:
                staging.recv[d, t] = pool[slot].pop()
            for t, slot in roles.send:
                staging.send[d, t] = pool[slot].pop()
            for slot in roles.idle:
                staging.idle[d][slot] = pool[slot].pop()
        return staging

    def _shortfall(
        self, step: _StepRun, held: Callable[[int], Mapping[Slot, int]]
    ) -> tuple[dict[int, Counter[Slot]], dict[Slot, Counter[int]]]:
        """What `_take` frees on each device, and allocates of each slot, before ``step``
        when device ``d``'s pool holds ``held(d)`` buffers of each slot."""
        frees: dict[int, Counter[Slot]] = {}
        missing: dict[Slot, Counter[int]] = defaultdict(Counter)
        for d, need in step.needs.items():
            have = held(d)
            if all(have.get(slot, 0) >= n for slot, n in need.items()):
                continue  # the steady state: the pool already holds it all (and <= the cap)
            pool = Counter({slot: n for slot, n in have.items() if n})
            frees[d], allocate = plan_pool(pool, need, self.lowered.staging_cap)
            for slot, n in allocate.items():
                missing[slot][d] += n
        return frees, missing

    def _allocations(self) -> list[tuple[Slot, tuple[int, ...]]]:
        """Every ``(slot, devices)`` group `_take` allocates, over calls from an empty pool
        until the pool a call leaves repeats (the next call would allocate as one before).

        The first call compiles their zero-filling programs: a later call starts from the
        pool the last one left, so it may lack buffers on other groups of devices than the
        first (which started empty), and compiling then would break "later calls compile
        nothing". `release` empties the pool: the next call allocates as the first did."""
        pools: dict[int, Counter[Slot]] = defaultdict(Counter)
        groups: dict[tuple[Slot, tuple[int, ...]], None] = {}  # in order, once each
        ends: list[dict[int, Counter[Slot]]] = []
        while True:
            for step in self._steps or ():
                frees, missing = self._shortfall(step, lambda d: pools[d])
                for d, free in frees.items():
                    pools[d] -= free
                for slot, by_device in missing.items():
                    for d, n in by_device.items():
                        pools[d][slot] += n
                groups.update(dict.fromkeys(_groups(missing)))
            end = {d: +pool for d, pool in pools.items() if +pool}
            if end in ends:  # the states are finite (the cap bounds them): this ends
                return list(groups)
            ends.append(end)

    def _compile_ahead(self, src: _Sources, fresh: bool) -> None:
        """Compile the first call's programs all at once, on a pool of threads.

        (The transfer programs are compiled the same way before the steps are resolved.)
        Dispatched step by step, each pack and unpack program would compile when it first
        runs, one after another; XLA compiles outside the GIL, so a tree of many distinct
        leaves (hundreds of programs) compiles about as many times faster as the host has
        cores. What is compiled here is what the steps then call: the staging and (``fresh``:
        no donated destination) destination allocations, the allocations a call with donate=
        still makes (destinations that are never donated), and each jitted pack and unpack at
        the arguments of its first step, which JAX keeps under the key a call looks up, so
        the steps only dispatch. This warms caches and decides nothing: an argument that
        differs from the one compiled here (a weak type, say) compiles at its step as before,
        and an error raised here is raised again there.
        """
        jobs: list[Callable[[], Any]] = [
            functools.partial(self._zeros_program, slot, devices)
            for slot, devices in self._allocations()
        ]
        seen: set[int] = set()
        for step in self._steps or ():
            full = [i for i in step.fresh if self._allocates(i)]
            kept = [i for i in full if i in self._never_donated]  # what donate= allocates
            for leaves in dict.fromkeys(tuple(x) for x in ([full] if fresh else []) + [kept]):
                for group in self._alloc_groups(leaves):  # (the programs `_alloc` runs)
                    jobs.append(functools.partial(_compiled, self._alloc_fn(group), ()))
            for run in (*step.packs, *step.unpacks):
                if id(run.fn) not in seen:
                    seen.add(id(run.fn))
                    jobs.append(functools.partial(_compiled, run.fn, run.avals(self, src)))
            for run in step.unpacks:
                for fn, avals in run.bitcasts(self, src):
                    if id(fn) not in seen:
                        seen.add(id(fn))
                        jobs.append(functools.partial(_compiled, fn, avals))
        _in_parallel(jobs)

    def _allocates(self, leaf: int) -> bool:
        """Whether `alloc` makes leaf ``leaf``'s array with `_alloc` (it has a shard here and
        elements)."""
        return self.holds_shard[leaf] and not self._empty[leaf]

    def _allocate(self, slot: Slot, devices: tuple[int, ...]) -> Buffers:
        """One zeroed buffer of ``slot`` on each of ``devices`` (this process's), made on
        device by a compiled program."""
        return views.by_device(self._zeros_program(slot, devices)())

    def _zeros_program(self, slot: Slot, devices: tuple[int, ...]) -> Callable[[], jax.Array]:
        """The compiled program making `_allocate`'s buffers (compiled once per group)."""
        key = (slot, devices)
        fn = self._zeros.get(key)
        if fn is None:
            mesh = Mesh(np.array([self.device[d] for d in devices]), (GROUP_AXIS,))
            shape, dtype = slot.shape(len(devices)), np.dtype(slot.word)
            sharding = NamedSharding(mesh, PartitionSpec(GROUP_AXIS))
            fn = self._zeros[key] = (
                jax.jit(
                    lambda: jnp.zeros(shape, dtype),
                    out_shardings=sharding,
                    compiler_options=ONE_OFF_OPTIONS,
                )
                .lower()
                .compile()
            )
        return fn

    def release(self, wait: bool = True) -> None:
        """Free the staging pool (the next run allocates it again). With ``wait=False``, only
        if no run holds the plan now."""
        if not self._lock.acquire(blocking=wait):
            return
        try:
            self._pool.clear()
        finally:
            self._lock.release()

    def pool_bytes(self) -> dict[int, int]:
        """Staging bytes the pool holds now, per local device."""
        return {
            d: sum(s.nbytes * len(b) for s, b in pool.items()) for d, pool in self._pool.items()
        }

    # ---------------------------------------------------------------------- resolving steps

    def _resolve(self, step: Step) -> _StepRun:
        """Everything a step needs at run time, looked up once: compiled programs, tables,
        shardings, and which of them run on this process."""
        local_union = [d for d in self.lowered.union if d in self.local]
        roles = {d: r for d, r in step_roles(step, local_union).items()}
        packs = [self._pack(c) for c in step.packs if self._is_local(c.program.mesh)]
        unpacks = [self._unpack(c) for c in step.unpacks if self._is_local(c.program.mesh)]
        transfer: _TransferRun | _WholeRun | None = None
        # This process runs a transfer where its own devices take part (each transfer is over
        # its own devices: whole-shard steps may add some to the union the staged ones span).
        if step.transfer is not None and self.local.intersection(step.transfer.devices):
            transfer = _WholeRun(self, step) if step.whole else _TransferRun(self, step)
        return _StepRun(step.fresh, step.slots, roles, packs, transfer, unpacks, step.kept)

    def _is_local(self, mesh: MeshSpec) -> bool:
        return any(d in self.local for d in mesh.devices)

    def mesh(self, spec: MeshSpec) -> Mesh:
        """The JAX mesh of a `MeshSpec` (the arrays' own mesh where there is one)."""
        mesh = self._mesh.get(spec)
        if mesh is None:
            devices = np.array([self.device[d] for d in spec.devices]).reshape(spec.shape)
            kinds = tuple(AxisType[k] for k in spec.kinds) if spec.kinds else None
            mesh = self._mesh[spec] = Mesh(devices, spec.axes, axis_types=kinds)
        return mesh

    def _spec(self, operand: Operand, sharding: Sharding, mesh: MeshSpec) -> PartitionSpec:
        if operand.spec is None:
            return PartitionSpec(mesh.axes) if operand.shard else PartitionSpec()
        assert isinstance(sharding, NamedSharding)
        return sharding.spec

    def _pack(self, call: PackCall) -> _PackRun:
        program = call.program
        shardings = [self._sharding(a) for a in call.args]
        specs = tuple(
            self._spec(o, s, program.mesh) for o, s in zip(program.operands, shardings, strict=True)
        )
        key = (program, specs)
        fn = self._packs.get(key)
        if fn is None:
            fn = self._packs[key] = _build_pack(program, self.mesh(program.mesh), specs)
        return _PackRun(self, call, fn)

    def _unpack(self, call: UnpackCall) -> _UnpackRun:
        program = call.program
        mesh = program.mesh
        specs = tuple(
            self._spec(o, self.src_shardings[i], mesh)
            for o, i in zip(program.sources, call.sources, strict=True)
        ) + tuple(
            self._spec(o, self.dst_shardings[i], mesh)
            for o, i in zip(program.targets, call.targets, strict=True)
        )
        platform = self.device[mesh.devices[0]].platform
        held = tuple(held_as_bits(o.dtype, platform) for o in program.targets)
        key = (program, specs)
        fn = self._unpacks.get(key)
        if fn is None:
            fn = self._unpacks[key] = _build_unpack(program, self.mesh(mesh), specs, held)
        return _UnpackRun(self, call, fn, held)

    def bitcast_fn(
        self, dtypes: tuple[Any, ...], shardings: tuple[NamedSharding, ...]
    ) -> Callable[..., Any]:
        """The compiled-once program that reinterprets donated arrays of ``shardings`` (the
        targets of one unpack program: all over its mesh) as ``dtypes`` of the same width, in
        their own buffers (`held_as_bits`)."""
        key = (dtypes, shardings)
        fn = self._bitcasts.get(key)
        if fn is None:

            def bitcast(*xs: jax.Array) -> tuple[jax.Array, ...]:
                pairs = zip(xs, dtypes, strict=True)
                return tuple(lax.bitcast_convert_type(x, d) for x, d in pairs)

            # Shard by shard: a mesh whose axes are of mixed types (Auto and Explicit) types
            # its arrays by the Explicit ones alone, and a plain jit to ``shardings`` then
            # reshards the values between the two (XLA CPU quietened bfloat16 NaNs doing so).
            specs = tuple(s.spec for s in shardings)
            mapped = jax.shard_map(
                bitcast, mesh=shardings[0].mesh, in_specs=specs, out_specs=specs, check_vma=False
            )
            fn = self._bitcasts[key] = jax.jit(
                mapped,
                donate_argnums=tuple(range(len(dtypes))),
                out_shardings=shardings,
                compiler_options=copy_options("cpu"),
            )
        return fn

    def dst_view(self, leaf: int) -> views.View:
        """Makes leaf ``leaf``'s destination array from its per-device buffers."""
        view = self._dst_views.get(leaf)
        if view is None:
            spec = self.leaves[leaf]
            view = views.View(spec.shape, jnp.dtype(spec.dst_dtype), self.dst_shardings[leaf])
            self._dst_views[leaf] = view
        return view

    def _sharding(self, arg: tuple[int, str]) -> Sharding:
        leaf, side = arg
        return self.src_shardings[leaf] if side == "src" else self.dst_shardings[leaf]

    def _build_tables(self) -> dict[tuple[MeshSpec, Any], jax.Array]:
        """Every table of box starts this process's programs read, on device: one compiled
        program per mesh makes all of that mesh's tables (they are its constants)."""
        rows_of: dict[MeshSpec, dict[Any, None]] = defaultdict(dict)
        for step in self.lowered.steps:
            for call in (*step.packs, *step.unpacks):
                if call.program.columns and self._is_local(call.program.mesh):
                    rows_of[call.program.mesh][call.table] = None
        tables = {}
        for spec, rows in rows_of.items():
            mesh = self.mesh(spec)
            sharding = NamedSharding(mesh, _split_spec(mesh))
            constants = [np.asarray(r, dtype=np.int32) for r in rows]

            def make(constants: list[np.ndarray] = constants) -> tuple[jax.Array, ...]:
                return tuple(jnp.asarray(c) for c in constants)

            made = jax.jit(
                make, out_shardings=(sharding,) * len(constants), compiler_options=ONE_OFF_OPTIONS
            )()
            tables.update({(spec, r): x for r, x in zip(rows, made, strict=True)})
        return tables

    def table(self, mesh: MeshSpec, rows: Any) -> tuple[jax.Array, ...]:
        """The on-device table of box starts of a call; () for a program with no starts."""
        if not rows or not rows[0]:
            return ()
        return (self._tables[mesh, rows],)

    def alloc(self, leaves: Sequence[int]) -> list[jax.Array]:
        """Fresh (zero) destination arrays of ``leaves`` that have a shard on this process."""
        full = [i for i in leaves if self._allocates(i)]
        empty = [i for i in leaves if self._empty[i]]
        made = dict(zip(full, self._alloc(full), strict=True)) if full else {}
        made.update({i: self._alloc_empty(i) for i in empty})
        return [made[i] for i in leaves]

    def _alloc_empty(self, leaf: int) -> jax.Array:
        """A zero-size destination: XLA gives a zero-size array full-shape shards, so each
        device's (empty) shard is made as a replica of the shard shape, then wrapped."""
        spec, sharding = self.leaves[leaf], self.dst_shardings[leaf]
        devices = [d for d in sharding.addressable_devices]
        key = (spec.dst.shard_shape, spec.dst_dtype, tuple(d.id for d in devices))
        fn = self._allocs.get(key)
        if fn is None:
            line = NamedSharding(Mesh(np.array(devices), (GROUP_AXIS,)), PartitionSpec())
            shape, dtype = spec.dst.shard_shape, jnp.dtype(spec.dst_dtype)
            fn = self._allocs[key] = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=line)
        bufs = views.by_device(fn())
        return jax.make_array_from_single_device_arrays(
            spec.shape, sharding, [bufs[d.id] for d in devices]
        )

    def _alloc(self, leaves: Sequence[int]) -> list[jax.Array]:
        made: dict[int, jax.Array] = {}
        for ids in self._alloc_groups(leaves):
            made.update(zip(ids, self._alloc_fn(ids)(), strict=True))
        return [made[i] for i in leaves]

    def _alloc_groups(self, leaves: Sequence[int]) -> list[list[int]]:
        """``leaves`` by the order of their destinations' devices, one zeros program each: a
        jitted program's outputs must share one, and a step may make leaves whose meshes
        hold the same devices in other orders."""
        groups = views.by_device_order([self.dst_shardings[i] for i in leaves])
        return [[leaves[k] for k in group] for group in groups]

    def _alloc_fn(self, leaves: Sequence[int]) -> Callable[[], tuple[jax.Array, ...]]:
        """The jitted program making zero arrays of ``leaves`` (one per distinct list)."""
        fn = self._alloc_fns.get(tuple(leaves))
        if fn is not None:
            return fn
        shardings = tuple(self.dst_shardings[i] for i in leaves)
        avals = tuple((self.leaves[i].shape, self.leaves[i].dst_dtype) for i in leaves)
        key = (avals, shardings)
        fn = self._allocs.get(key)
        if fn is None:

            def zeros() -> tuple[jax.Array, ...]:
                return tuple(jnp.zeros(shape, jnp.dtype(dtype)) for shape, dtype in avals)

            fn = self._allocs[key] = jax.jit(zeros, out_shardings=shardings)
        self._alloc_fns[tuple(leaves)] = fn
        return fn

    # --------------------------------------------------------------------------- inspection

    def transfer_texts(self) -> list[str]:
        """Optimized HLO of each distinct transfer program (compiles them)."""
        out = []
        for program in dict.fromkeys(
            s.transfer for s in self.lowered.steps if s.transfer is not None
        ):
            out.append(self._transfer_fn(program).as_text())
        return out

    def _union_sharding(self, program: TransferProgram) -> NamedSharding:
        spec = MeshSpec.line(program.devices, GROUP_AXIS)
        return NamedSharding(self.mesh(spec), PartitionSpec(GROUP_AXIS))

    def _transfer_fn(self, program: TransferProgram) -> Callable[..., Any]:
        """The compiled transfer program (compiled ahead of its first run, while the steps are
        resolved: a bad ``compiler_options`` then fails before any data moves)."""
        fn = self._transfers.get(program)
        if fn is None:
            mesh = self.mesh(MeshSpec.line(program.devices, GROUP_AXIS))
            avals = _transfer_avals(program, self._union_sharding(program))

            options = self.transfer_options
            platform = self.device[program.devices[0]].platform
            if any(slot.shard for slot in program.slots) and copy_options(platform):
                # Shards moved as their bits: bitcasts that are free with these emitters.
                options = {**(copy_options(platform) or {}), **options}
            try:  # (building too: JAX hashes the options, which may not be hashable)
                jitted = _build_transfer(program, mesh, options)
                fn = jitted.lower(*avals).compile()
            except Exception as e:
                if not self.transfer_options:
                    raise
                raise ReshardError(
                    f"XLA refused the transfer programs' compiler_options "
                    f"{self.transfer_options}: {str(e).splitlines()[0]}\nHow to fix: pass "
                    "options this backend knows (as jax.jit's compiler_options), or none"
                ) from None
            self._transfers[program] = fn
        return fn


def _groups(missing: Mapping[Slot, Counter[int]]) -> list[tuple[Slot, tuple[int, ...]]]:
    """The allocations that give each device its missing buffers of each slot: one buffer
    on every device still missing one, until none is (one program call per group)."""
    out = []
    for slot, counts in missing.items():
        while counts:
            out.append((slot, tuple(sorted(counts))))
            counts = Counter({d: n - 1 for d, n in counts.items() if n > 1})
    return out


def _await(arrays: Sequence[jax.Array]) -> None:
    """Wait for ``arrays``' programs, leaving out what has been deleted or donated (another
    thread may do so at any moment: a result of a call on another thread, or the caller's
    own result of an earlier call, freed while a `Plan.start` runs)."""
    try:
        jax.block_until_ready([x for x in arrays if not x.is_deleted()])
    except Exception:
        # Deleted between the filter and the wait: one at a time, the deleted ones left out.
        for x in arrays:
            try:
                x.block_until_ready()
            except Exception:
                if not x.is_deleted():
                    raise


class _LastStep:
    """What the last call of any plan in this process wrote in its last step (on CPU): the
    next call's first transfer waits for it (`waits_between_steps`). One for the process, not
    one per plan: XLA's CPU devices share one thread pool whichever plan runs on them, so
    plan B called right after plan A must not put its collectives beside A's. Held weakly: a
    result the caller dropped is not kept alive for this, and a call made later finds the
    rest long done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refs: list[weakref.ref[jax.Array]] = []

    def arrays(self) -> list[jax.Array]:
        with self._lock:
            return [x for x in (ref() for ref in self._refs) if x is not None]

    def remember(self, arrays: Sequence[jax.Array]) -> None:
        refs = [weakref.ref(x) for x in arrays]
        with self._lock:
            self._refs = refs


_LAST_STEP = _LastStep()

_CPU_CALLS = threading.Lock()
"""Held by a call on CPU devices for its whole run, whichever plan and thread make it: the
steps of two calls made at once on two threads would otherwise interleave on the devices,
and XLA's CPU collectives need every device's thread (see `_LastStep`). Taken after the
plan's own lock, always in that order. Under ``jax.distributed`` too (without it, two threads
of each process calling two plans hung every process inside XLA's collectives, in 2 of 5
runs): a call waits for its peers (the order check) inside its run, so threads of one process
whose plans span different process groups can wait for each other across processes, which
ends in the order check's error (crossed calls, or the agreement timeout), not in a hang."""


def between_calls(platforms: Iterable[str], dispatch: Callable[[], Any]) -> Any:
    """Dispatch a program that runs beside the plans' calls and may hold collectives (the fp8
    quantizer's max over the devices that split a block), as a call's steps are dispatched
    where those wait for each other (CPU, `waits_between_steps`): under `_CPU_CALLS`, once
    the last call's last step is done, and the next call's first transfer waits for it.
    Dispatched from the caller's thread while a started refit ran on the worker (a probe of
    threads), its collectives could interleave with the refit's on the devices and leave
    both waiting until XLA aborts. Elsewhere it is only dispatched."""
    if not waits_between_steps(platforms):
        return dispatch()
    with _CPU_CALLS:
        _await(_LAST_STEP.arrays())
        out = dispatch()
        _LAST_STEP.remember([x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array)])
    return out


def waits_between_steps(platforms: Iterable[str]) -> bool:
    """Whether a call waits, before each step's transfer, for the previous step.

    XLA's CPU backend runs the devices' programs on one thread pool, and a collective-permute
    needs every device's thread to reach it at once: with several steps in flight, the
    programs queued behind a blocked collective can leave one device's part of it without a
    thread, and XLA aborts after 40 s (seen here with no waits). So on CPU each step's transfer
    starts once the previous step has finished, and a call's first transfer once the last
    call's last step has (a wait that costs nothing when the calls are not back to back, so
    `host_syncs_per_call` does not count it). A step's packs are dispatched before that wait:
    they hold no collective (a pack never blocks a thread waiting for another device), so
    they run beside the previous step's transfer and unpacks (1024 leaves in 32 steps: 154 ->
    141 ms a call, the two orders alternating in one process). Elsewhere nothing waits: the
    pool bounds the staging, and buffer dependencies order the steps.
    """
    return "cpu" in set(platforms)


# --------------------------------------------------------------------------- per-step runs


@dataclasses.dataclass
class _StepRun:
    fresh: tuple[int, ...]
    slots: tuple[Slot, ...]
    roles: dict[int, Roles]
    packs: list[_PackRun]
    transfer: _TransferRun | _WholeRun | None
    unpacks: list[_UnpackRun]
    kept: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        self.needs = {d: roles.need() for d, roles in self.roles.items()}


@dataclasses.dataclass
class _Staging:
    """A step's buffers by role: ``send[device, slot index]``, ``recv[device, slot index]``
    and ``idle[device][slot]`` (see `lower.Roles`)."""

    send: dict[tuple[int, int], jax.Array] = dataclasses.field(default_factory=dict)
    recv: dict[tuple[int, int], jax.Array] = dataclasses.field(default_factory=dict)
    idle: dict[int, dict[Slot, jax.Array]] = dataclasses.field(
        default_factory=lambda: defaultdict(dict)
    )


class _PackRun:
    """One pack call, resolved: its program, table, and the views that build its arguments."""

    def __init__(self, runtime: Runtime, call: PackCall, fn: Callable[..., Any]) -> None:
        program = call.program
        self.fn = fn
        self.table = runtime.table(program.mesh, call.table)
        mesh, self.slot_views = _slot_views(runtime, program)
        self.devices = self.slot_views[0].devices if self.slot_views else []
        self.slots = {d: s for d, s in zip(program.mesh.devices, call.slots, strict=True)}
        self.args = call.args
        self.operand_views = _operand_views(program.operands, mesh)

    def operands(self, src: _Sources, dst: _Destinations) -> list[jax.Array]:
        return [
            _operand(src if side == "src" else dst, leaf, view)
            for (leaf, side), view in zip(self.args, self.operand_views, strict=True)
        ]

    def staging(
        self, staging: _Staging, sent: Mapping[tuple[int, int], jax.Array]
    ) -> list[jax.Array]:
        """The staging buffers the pack writes into (donated), per program slot: what an
        earlier pack of the step wrote into the slot (its part of a shared slot,
        `PackProgram.based`), else the step's buffer."""

        def buffer(d: int, k: int) -> jax.Array:
            key = (d, self.slots[d][k])
            return sent[key] if key in sent else staging.send[key]

        return [
            view([buffer(d, k) for d in view.devices]) for k, view in enumerate(self.slot_views)
        ]

    def avals(self, runtime: Runtime, src: _Sources) -> list[Any]:
        """The arguments of this call's first run, as `jax.jit`'s ``lower`` takes them."""
        operands = [
            _operand_aval(runtime, src, leaf, side, view)
            for (leaf, side), view in zip(self.args, self.operand_views, strict=True)
        ]
        return [*self.table, *operands, *(view.aval for view in self.slot_views)]

    def collect(self, outs: Sequence[jax.Array], sent: dict[tuple[int, int], jax.Array]) -> None:
        """The filled buffers, by (device, step slot)."""
        for k, out in enumerate(outs):
            for d, buf in zip(self.devices, views.buffers(out), strict=True):
                sent[d, self.slots[d][k]] = buf


class _Permutes:
    """A step's compiled transfer program, and one view per round re-wrapping this process's
    buffers onto its union mesh (``devices``: this process's, in mesh order)."""

    def __init__(self, runtime: Runtime, step: Step) -> None:
        program = step.transfer
        assert program is not None
        self.fn = runtime._transfer_fn(program)
        sharding = runtime._union_sharding(program)
        n = len(program.devices)
        self.slots = program.slots
        self.views = [views.View(s.shape(n), s.word, sharding) for s in program.slots]
        self.devices = self.views[0].devices


class _TransferRun(_Permutes):
    """The transfer of one step: which buffer each local device passes in each round."""

    def __init__(self, runtime: Runtime, step: Step) -> None:
        super().__init__(runtime, step)
        program = step.transfer
        assert program is not None
        local, senders = self.devices, step.senders()
        # The buffer each local device sends in each round it sends in: the one its pack
        # filled for that round, or for another round of the step (`Step.shared`).
        self.sends = {
            (d, t): (d, t) for d in local for t in range(len(program.slots)) if (d, t) in senders
        }
        self.sends.update({(d, t): (d, packed) for d, t, packed in step.shared if d in local})

    def run(
        self, sent: Mapping[tuple[int, int], jax.Array], staging: _Staging
    ) -> dict[tuple[int, int], jax.Array]:
        sends, recvs = [], []
        for t, (slot, view) in enumerate(zip(self.slots, self.views, strict=True)):
            sends.append(
                view(
                    [
                        sent[self.sends[d, t]] if (d, t) in self.sends else staging.idle[d][slot]
                        for d in self.devices
                    ]
                )
            )
            recvs.append(view([staging.recv[d, t] for d in self.devices]))
        moved = self.fn(*sends, *recvs)
        out = {}
        for t, x in enumerate(moved):
            for d, buf in zip(self.devices, views.buffers(x), strict=True):
                out[d, t] = buf
        return out


class _WholeRun(_Permutes):
    """The transfer of a whole-shard step (`Step.whole`): in each round, the senders pass
    their source shards of the round's leaf as they are and the receivers their destination
    shards (donated: the collective-permute writes into them); the step's spares stand in for
    the others'."""

    def __init__(self, runtime: Runtime, step: Step) -> None:
        super().__init__(runtime, step)
        self.leaves = step.whole
        rounds = [pairs for _, pairs in step_rounds_of(step)]
        self.sends = [{a for a, _ in pairs} for pairs in rounds]
        self.recvs = [{b for _, b in pairs} for pairs in rounds]

    def run(
        self, src: _Sources, dst: _Destinations, staging: _Staging
    ) -> tuple[dict[tuple[int, int], jax.Array], list[jax.Array]]:
        """Dispatch the step; returns the spares it gave back (by device and round, for the
        pool) and the destination buffers it wrote."""
        sends, recvs, taken = [], [], []
        rounds = zip(self.leaves, self.slots, self.views, strict=True)
        idle = staging.idle
        for t, (leaf, slot, view) in enumerate(rounds):
            # (a process none of whose devices sends may hold no source array of the leaf)
            sending = any(d in self.sends[t] for d in self.devices)
            held = src.buffers(leaf) if sending else {}
            sends.append(
                view([held[d] if d in self.sends[t] else idle[d][slot] for d in self.devices])
            )
            mine = [d for d in self.devices if d in self.recvs[t]]
            into = dst.take_buffers(leaf, mine)
            taken.append(into)
            recvs.append(view([into[d] if d in into else staging.recv[d, t] for d in self.devices]))
        moved = self.fn(*sends, *recvs)
        spares: dict[tuple[int, int], jax.Array] = {}
        written = []
        for t, x in enumerate(moved):
            got = {}
            for d, buf in zip(self.devices, views.buffers(x), strict=True):
                if d in taken[t]:
                    got[d] = buf
                else:
                    spares[d, t] = buf
            dst.set_buffers(self.leaves[t], got)
            written.extend(got.values())
        return spares, written


class _UnpackRun:
    """One unpack call, resolved."""

    def __init__(
        self,
        runtime: Runtime,
        call: UnpackCall,
        fn: Callable[..., Any],
        held: Sequence[np.dtype | None],
    ) -> None:
        program = call.program
        self.fn = fn
        self.table = runtime.table(program.mesh, call.table)
        mesh, self.chunk_views = _slot_views(runtime, program)
        self.slots = {d: s for d, s in zip(program.mesh.devices, call.slots, strict=True)}
        self.sources = call.sources
        self.targets = call.targets
        self.source_views = _operand_views(program.sources, mesh)
        self.target_views = _operand_views(program.targets, mesh)
        # Targets the program writes as their bits (`held_as_bits`): reinterpreted before it
        # and back after it, in their own buffers, by two programs of bitcasts.
        self.as_bits = [t for t, bits in enumerate(held) if bits is not None]
        self._held = [held[t] for t in self.as_bits]
        self.to_bits = self.from_bits = None
        if self.as_bits:
            shardings = tuple(
                runtime.dst_shardings[self.targets[t]]
                if self.target_views[t] is None
                else self.target_views[t].sharding
                for t in self.as_bits
            )
            dtypes = tuple(jnp.dtype(program.targets[t].dtype) for t in self.as_bits)
            self.to_bits = runtime.bitcast_fn(tuple(self._held), shardings)
            self.from_bits = runtime.bitcast_fn(dtypes, shardings)

    def run(
        self,
        received: Mapping[tuple[int, int], jax.Array],
        src: _Sources,
        dst: _Destinations,
    ) -> Sequence[jax.Array]:
        """Dispatch the call (and the bitcasts around it); returns the targets' new arrays."""
        args = self.arguments(src, dst)
        if not self.as_bits:
            return self.fn(*self.table, *self.chunks(received), *args)
        first = len(self.sources)
        bits = self.to_bits(*(args[first + t] for t in self.as_bits))
        for t, x in zip(self.as_bits, bits, strict=True):
            args[first + t] = x
        outs = list(self.fn(*self.table, *self.chunks(received), *args))
        back = self.from_bits(*(outs[t] for t in self.as_bits))
        for t, x in zip(self.as_bits, back, strict=True):
            outs[t] = x
        return outs

    def bitcasts(self, runtime: Runtime, src: _Sources) -> list[tuple[Callable[..., Any], Any]]:
        """The bitcast programs around the call and their arguments (to compile ahead)."""
        if not self.as_bits:
            return []
        targets = self._target_avals(runtime, src)
        before = [targets[t] for t in self.as_bits]
        after = self._as_bits(targets)
        return [(self.to_bits, before), (self.from_bits, [after[t] for t in self.as_bits])]

    def _target_avals(self, runtime: Runtime, src: _Sources) -> list[Any]:
        """What `arguments` passes for the targets (in their own dtypes)."""
        return [
            _operand_aval(runtime, src, leaf, "dst", view)
            for leaf, view in zip(self.targets, self.target_views, strict=True)
        ]

    def _as_bits(self, targets: Sequence[Any]) -> list[Any]:
        """``targets``' avals with those written as bits in their bits' dtype."""
        out = list(targets)
        for t, held in zip(self.as_bits, self._held, strict=True):
            out[t] = jax.ShapeDtypeStruct(out[t].shape, held, sharding=out[t].sharding)
        return out

    def chunks(self, received: Mapping[tuple[int, int], jax.Array]) -> list[jax.Array]:
        return [
            view([received[d, self.slots[d][k]] for d in view.devices])
            for k, view in enumerate(self.chunk_views)
        ]

    def arguments(self, src: _Sources, dst: _Destinations) -> list[jax.Array]:
        out = [
            _operand(src, leaf, view)
            for leaf, view in zip(self.sources, self.source_views, strict=True)
        ]
        for leaf, view in zip(self.targets, self.target_views, strict=True):
            if view is None:
                out.append(dst.take_array(leaf))
            else:
                bufs = dst.take_buffers(leaf, view.devices)
                out.append(view([bufs[d] for d in view.devices]))
        return out

    def avals(self, runtime: Runtime, src: _Sources) -> list[Any]:
        """The arguments of this call's first run, as `jax.jit`'s ``lower`` takes them."""
        sources = [
            _operand_aval(runtime, src, leaf, "src", view)
            for leaf, view in zip(self.sources, self.source_views, strict=True)
        ]
        targets = self._as_bits(self._target_avals(runtime, src))
        return [*self.table, *(view.aval for view in self.chunk_views), *sources, *targets]

    def store(self, outs: Sequence[jax.Array], dst: _Destinations) -> None:
        for leaf, view, out in zip(self.targets, self.target_views, outs, strict=True):
            if view is None:
                dst.set_array(leaf, out)
            else:
                dst.set_buffers(leaf, dict(zip(view.devices, views.buffers(out), strict=True)))


def _slot_views(
    runtime: Runtime, program: PackProgram | UnpackProgram
) -> tuple[Mesh, list[views.View]]:
    """The program's mesh, and one view per staging slot: an array whose blocks (of rows, or
    of a 1-D slot's words) are the devices' buffers of that slot."""
    mesh = runtime.mesh(program.mesh)
    split = NamedSharding(mesh, _split_spec(mesh))
    g = len(program.mesh.devices)
    return mesh, [views.View(slot.shape(g), slot.word, split) for slot in program.slots]


def _operand(holder: _Sources | _Destinations, leaf: int, view: views.View | None) -> jax.Array:
    """A leaf as a program operand: its whole array (no view: the program runs over the
    array's own mesh), else its buffers on the program's devices under ``view``."""
    if view is None:
        return holder.array(leaf)
    bufs = holder.buffers(leaf)
    return view([bufs[d] for d in view.devices])


def _operand_aval(
    runtime: Runtime, src: _Sources, leaf: int, side: str, view: views.View | None
) -> Any:
    """What `_operand` (or a destination the caller did not donate) passes for a leaf."""
    if view is not None:
        return view.aval
    if side == "src":
        return src.array(leaf)
    spec = runtime.leaves[leaf]
    return jax.ShapeDtypeStruct(
        spec.shape, jnp.dtype(spec.dst_dtype), sharding=runtime.dst_shardings[leaf]
    )


def _in_parallel(jobs: Sequence[Callable[[], Any]]) -> None:
    """Run compile ``jobs`` on a pool of threads (`MAX_COMPILE_THREADS`, at most one per
    core), each through `_warm`."""
    workers = min(len(jobs), os.cpu_count() or 1, MAX_COMPILE_THREADS)
    if workers < 2:
        for job in jobs:
            _warm(job)
        return
    settings = _thread_settings()

    def warm(job: Callable[[], Any]) -> None:
        with settings():
            _warm(job)

    futures: list[concurrent.futures.Future] = []
    with concurrent.futures.ThreadPoolExecutor(workers, "jaxreshard-compile") as pool:
        try:
            for job in jobs:
                futures.append(pool.submit(warm, job))
        except RuntimeError as e:  # interpreter shutdown (a first call in an atexit hook):
            if not refused_at_shutdown(e):  # no new threads, so the rest one after another
                raise
    for future in futures:
        future.result()
    for job in jobs[len(futures) :]:
        _warm(job)


def refused_at_shutdown(error: RuntimeError) -> bool:
    """Whether ``concurrent.futures`` refused new work because the interpreter is shutting
    down ("cannot schedule new futures after (interpreter) shutdown"), not for another
    reason (no thread could start)."""
    return "shutdown" in str(error)


def _thread_settings() -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The calling thread's own JAX settings, to enter in another thread.

    JAX's context managers (``jax.transfer_guard``, ``jax.default_matmul_precision``,
    ``jax.set_mesh``, ...) set a value for the calling thread only, and JAX keys its compile
    cache on some of them: compiled in a thread without them, a program would be compiled
    again by the step that runs it. Read through JAX's config states (private API); where
    they are not there (another JAX version), nothing is entered and such a call compiles
    twice, as it would have without compiling ahead."""
    try:
        from jax._src import config as jax_config

        unset = jax_config.config_ext.unset
        local = [(state, state.get_local()) for state in jax_config.config_states.values()]
        local = [(state, value) for state, value in local if value is not unset]
    except Exception:  # pragma: no cover - another JAX layout
        return contextlib.nullcontext

    def enter() -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        for state, value in local:
            stack.enter_context(state(value))
        return stack

    return enter


def caller_settings_unset() -> contextlib.AbstractContextManager[Any]:
    """Set aside, for the calling thread, the JAX settings it has set for itself that JAX
    keys its compile cache on (private API).

    ``jax.set_mesh``, ``jax.default_device``, ``jax.default_matmul_precision``,
    ``jax.numpy_dtype_promotion``, a legacy ``with mesh:`` and the like set a value for the
    calling thread only, and a jitted program called under one is traced and compiled again.
    A plan's programs are its own code, with their own meshes and shardings, and none of
    these change what they compute; run with these values set aside (JAX's process-wide
    values in force), a plan made outside such a context and called inside one (or on
    another thread, as `Plan.start`'s worker) finds the programs its first call compiled.
    Other thread settings (the transfer guards, ``jax.log_compiles``) are kept. Where JAX's
    config states are not where this looks (another JAX version), nothing is set aside."""
    settings, unset = _keyed_settings()
    local = [(s, v) for s in settings if (v := s.get_local()) is not unset]
    if not local:
        return contextlib.nullcontext()
    done: list[tuple[Any, Any]] = []
    stack = contextlib.ExitStack()
    stack.callback(_put_back, done)
    try:
        for setting, value in local:
            setting.swap_local(unset)
            done.append((setting, value))
            hook = getattr(setting, "_update_thread_local_hook", None)
            if hook is not None:
                hook(None)
    except BaseException:
        stack.close()  # (the caller never enters it: put back what was set aside)
        raise
    return stack


def _put_back(local: Sequence[tuple[Any, Any]]) -> None:
    """Restore thread settings `caller_settings_unset` set aside (as JAX's own context
    managers leave them)."""
    for setting, value in reversed(local):
        setting.set_local(value)
        hook = getattr(setting, "_update_thread_local_hook", None)
        if hook is not None:
            hook(value)


_KEYED: dict[int, tuple[tuple[Any, ...], Any]] = {}


def _keyed_settings() -> tuple[tuple[Any, ...], Any]:
    """JAX's thread-settable config values that are part of its trace context and compile
    cache key (the config states it names as such, and the context managers' values:
    meshes, devices, ``compute_on``, of its config module), and JAX's marker of a value
    not set for the thread. Looked up again when JAX registers more states (a module
    imported later); none where JAX's config is not laid out so."""
    try:
        from jax._src import config as jax_config

        states = jax_config.config_states
        found = _KEYED.get(len(states))
        if found is None:
            config = jax_config.config_ext.Config
            names = set(jax_config.config_ext.trace_context_names())
            keyed = [s for name, s in states.items() if name in names]
            keyed += [
                v
                for v in vars(jax_config).values()
                if isinstance(v, config) and not isinstance(v, jax_config.State)
            ]
            found = (tuple(dict.fromkeys(keyed)), jax_config.config_ext.unset)
            _KEYED[len(states)] = found
        return found
    except Exception:  # pragma: no cover - another JAX layout
        return (), None


def _compiled(fn: Any, avals: Sequence[Any]) -> Any:
    return fn.lower(*avals).compile()


def _warm(job: Callable[[], Any]) -> None:
    """Run one compile job ahead; a failure is left for the step to raise (compiling
    again, on the calling thread)."""
    try:
        job()
    except Exception:  # the step compiles (and raises) again
        pass


# ------------------------------------------------------------------------------ leaf state


class _Sources:
    """The source arrays of a call; per-device buffers looked up once per leaf."""

    def __init__(self, runtime: Runtime, arrays: Sequence[Any]) -> None:
        self.arrays = arrays
        self._buffers: dict[int, Buffers] = {}

    def array(self, leaf: int) -> jax.Array:
        return self.arrays[leaf]

    def buffers(self, leaf: int) -> Buffers:
        if leaf not in self._buffers:
            self._buffers[leaf] = views.by_device(self.arrays[leaf])
        return self._buffers[leaf]


class _Destinations:
    """The destination of each leaf while a call runs: a whole array, or this process's
    per-device buffers (after unpacks over groups of devices that are not the array's mesh).
    """

    def __init__(self, runtime: Runtime, donate: Sequence[jax.Array] | None) -> None:
        self.runtime = runtime
        n = len(runtime.leaves)
        # A donated leaf receives in its old buffers; a None entry (a destination in another
        # memory kind, see `run.boundary`) is allocated like a call without donate=.
        self._arrays: list[jax.Array | None] = list(donate) if donate is not None else [None] * n
        self.donated_all = donate is not None and all(x is not None for x in donate)
        self._buffers: list[Buffers | None] = [None] * n
        self._pending: list[jax.Array] = []

    def allocate(self, leaves: Sequence[int]) -> None:
        mine = [
            i
            for i in leaves
            if self._arrays[i] is None and self._buffers[i] is None and self.runtime.holds_shard[i]
        ]
        if mine:
            for i, x in zip(mine, self.runtime.alloc(mine), strict=True):
                self._arrays[i] = x
                self._pending.append(x)

    def pending(self) -> list[jax.Array]:
        """Arrays written since the last call (what a profile waits for)."""
        out, self._pending = self._pending, []
        return out

    def array(self, leaf: int) -> jax.Array:
        if self._arrays[leaf] is None:
            view = self.runtime.dst_view(leaf)
            bufs = self._buffers[leaf] or {}
            self._arrays[leaf] = view([bufs[d] for d in view.devices])
            self._buffers[leaf] = None
        return self._arrays[leaf]

    def buffers(self, leaf: int) -> Buffers:
        if self._buffers[leaf] is None:
            self._buffers[leaf] = views.by_device(self.array(leaf))
            self._arrays[leaf] = None
        return self._buffers[leaf]

    def take_array(self, leaf: int) -> jax.Array:
        """The leaf's whole array, to donate (its state is set again by `set_array`)."""
        x = self.array(leaf)
        self._arrays[leaf] = None
        return x

    def take_buffers(self, leaf: int, devices: Sequence[int]) -> Buffers:
        """The leaf's buffers on ``devices``, to donate (set again by `set_buffers`)."""
        bufs = self.buffers(leaf)
        return {d: bufs.pop(d) for d in devices}

    def set_array(self, leaf: int, x: jax.Array) -> None:
        self._arrays[leaf], self._buffers[leaf] = x, None
        self._pending.append(x)

    def set_buffers(self, leaf: int, bufs: Buffers) -> None:
        current = self._buffers[leaf]
        if current is None:
            current = self._buffers[leaf] = {}
        current.update(bufs)
        self._pending.extend(bufs.values())

    def finish(self) -> list[jax.Array]:
        return [self.array(i) for i in range(len(self.runtime.leaves))]


# -------------------------------------------------------------------------------- programs


@functools.cache
def copy_options(platform: str) -> dict[str, Any] | None:
    """The XLA options pack and unpack programs compile with on ``platform``:
    `CPU_COPY_OPTIONS` on CPU where this XLA accepts them (checked once, on a program of one
    copy), else none."""
    if platform != "cpu":
        return None
    try:
        jax.jit(lambda x: x + 1, compiler_options=CPU_COPY_OPTIONS).lower(
            jax.ShapeDtypeStruct((1,), np.float32)
        ).compile()
    except Exception:  # an XLA without the option: compile as it would by default
        return None
    return dict(CPU_COPY_OPTIONS)


def program_options(platform: str, casts: bool) -> dict[str, Any] | None:
    """The XLA options of a pack or unpack program: `copy_options`, unless it casts. XLA's
    older CPU fusion emitters convert some dtypes differently from ``astype`` (which compiles
    with the newer ones): negative values that round to zero became 0x80, NaN, in the float8
    ``fnuz`` formats, NaN payloads came out other bits (bfloat16 -> float8_e5m2, float16 ->
    bfloat16), and a cast to float4_e2m1fn did not compile. A program that casts compiles as
    ``astype`` does, so a cast refit gives ``astype``'s bits (and `verify`'s)."""
    return None if casts else copy_options(platform)


def _pack_casts(program: PackProgram) -> bool:
    """Whether ``program`` converts any operand to another dtype on its way into the slots."""
    dtypes = [op.dtype for op in program.operands]
    return any(dtypes[r.operand] != r.wire for r in program.reads) or any(
        dtypes[i] != wire for i, wire in program.flat
    )


def _unpack_casts(program: UnpackProgram) -> bool:
    """Whether ``program``'s local copies convert any source to its target's dtype."""
    sources = [op.dtype for op in program.sources]
    targets = [op.dtype for op in program.targets]
    return any(sources[c.source] != targets[c.target] for c in program.copies) or any(
        sources[i] != dtype for i, dtype in program.flat_sources
    )


def _unpack_needs_newer_emitters(program: UnpackProgram) -> bool:
    """Whether an unpack compiles with XLA's newer CPU fusion emitters (`program_options`):
    where it casts, and where it reads slots held as rows. The older emitters read a slot of
    rows as flat words computing each word's place in its row, per element (a bfloat16 tree's
    unpack took 41 ms against 21 ms from flat slots); the newer ones copy as fast as from a
    flat slot (22 ms). They compile a copy in about twice the time (`CPU_COPY_OPTIONS`), but
    the first call of the bench's 8- and 32-layer trees did not grow measurably (its programs
    compile on threads, `Runtime._compile_ahead`)."""
    return _unpack_casts(program) or any(slot.width > 1 for slot in program.slots)


def _split_spec(mesh: Mesh) -> PartitionSpec:
    return PartitionSpec(tuple(mesh.axis_names))


def _build_pack(
    program: PackProgram, mesh: Mesh, specs: tuple[PartitionSpec, ...]
) -> Callable[..., Any]:
    n_ops, n_slots = len(program.operands), len(program.slots)
    has_table = program.columns > 0
    split = _split_spec(mesh)
    platform = mesh.devices.flat[0].platform

    def pack(*args: jax.Array) -> tuple[jax.Array, ...]:
        row = args[0][0] if has_table else None
        args = args[1:] if has_table else args
        ops, bufs = args[:n_ops], list(args[n_ops:])
        bases = _bases(row, program)
        for r in program.reads:
            slot = program.slots[r.slot]
            at = _at(row, r.column, len(r.shape))
            if r.rows:
                words = _read_rows(ops[r.operand], at, r.shape, r.wire, slot, platform)
            else:
                bits = read_bits(ops[r.operand], at, r.shape, r.wire, platform)
                words = bits_to_words(bits, slot.word)
            bufs[r.slot] = _put_words(bufs[r.slot], words, r.offset, slot.width, bases[r.slot])
        if program.gathers:
            word = program.slots[0].word
            flat = _flat(
                [
                    bits_to_words(whole_bits(ops[i], wire, platform), word)
                    for i, wire in program.flat
                ]
            )
            for g in program.gathers:
                words = _gather(flat, row, g.column, g.words)
                width = program.slots[g.slot].width
                bufs[g.slot] = _put_words(bufs[g.slot], words, 0, width, bases[g.slot])
        return tuple(bufs)

    in_specs = (split,) * has_table + specs + (split,) * n_slots
    mapped = jax.shard_map(
        pack, mesh=mesh, in_specs=in_specs, out_specs=(split,) * n_slots, check_vma=False
    )
    first = has_table + n_ops
    return jax.jit(
        mapped,
        donate_argnums=tuple(range(first, first + n_slots)),
        out_shardings=(NamedSharding(mesh, split),) * n_slots,
        compiler_options=program_options(platform, _pack_casts(program)),
    )


def _read_rows(
    shard: jax.Array,
    at: Sequence[jax.Array],
    shape: Sequence[int],
    wire: str,
    slot: Slot,
    platform: str,
) -> jax.Array:
    """The words of the box of ``shape`` from ``at`` in ``shard``, as rows of the slot's width.

    The shard is viewed with its last dimension cut into rows of the width's elements (a
    free reshape), so the box is whole rows of that view (`Read.rows` says so) and XLA copies
    it row by row into the slot's rows.
    """
    n = slot.width * np.dtype(slot.word).itemsize // wire_itemsize(wire)  # elements a row
    view = shard.reshape(*shard.shape[:-1], shard.shape[-1] // n, n)
    start = (*at[:-1], at[-1] // np.int32(n), ZERO)
    bits = read_bits(view, start, (*shape[:-1], shape[-1] // n, n), wire, platform)
    return bits_to_words(bits, slot.word).reshape(-1, slot.width)


def _put_words(
    buf: jax.Array, words: jax.Array, offset: int, width: int, base: jax.Array | None = None
) -> jax.Array:
    """``buf`` (a slot, flat or of rows ``width`` words wide) with ``words`` from word
    ``offset`` (after word ``base``, a multiple of ``width``, where the slot is shared).
    Words that are not whole rows of the slot are written as the part of a row they start
    in, the whole rows after it and the part of a row they end in: writes into a flat view of
    the slot would make XLA copy the whole slot first (the write is then not in place)."""
    if width == 1:
        start = np.int32(offset) if base is None else base + np.int32(offset)
        return lax.dynamic_update_slice(buf, words.reshape(-1), (start,))
    words = words.reshape(-1)
    n, row, col = words.size, offset // width, offset % width
    first = ZERO if base is None else base // np.int32(width)
    head = min(n, (width - col) % width)
    whole = (n - head) // width * width
    if head:
        part = words[:head].reshape(1, head)
        buf = lax.dynamic_update_slice(buf, part, (first + np.int32(row), np.int32(col)))
        row += 1
    if whole:
        part = words[head : head + whole].reshape(-1, width)
        buf = lax.dynamic_update_slice(buf, part, (first + np.int32(row), ZERO))
        row += whole // width
    if head + whole < n:
        part = words[head + whole :].reshape(1, -1)
        buf = lax.dynamic_update_slice(buf, part, (first + np.int32(row), ZERO))
    return buf


def _bases(row: jax.Array | None, program: PackProgram | UnpackProgram) -> list[Any]:
    """Each slot's base word in the table (`PackProgram.based`); None where there is none."""
    n = len(program.slots)
    if not program.based:
        return [None] * n
    assert row is not None
    return [row[program.columns - n + k] for k in range(n)]


def writes_in_place(dtype: Any, platform: str) -> bool:
    """Whether XLA writes boxes into a donated array of ``dtype`` in place and bit for bit.

    On the CPU backend XLA computes a ``dynamic-update-slice`` of bfloat16 or float8 values in
    float32: it rewrites the whole array (no longer in place) and quietens NaN payloads. Those
    dtypes (and complex and sub-byte types everywhere) are written as unsigned bits instead,
    which is exact but costs one pass over the destination shard per program. Every other
    dtype is written as it is, in place.
    """
    dtype = jnp.dtype(dtype)
    if jax.dtypes.itemsize_bits(dtype) < 8 or jnp.issubdtype(dtype, jnp.complexfloating):
        return False
    if platform == "cpu" and jnp.issubdtype(dtype, jnp.floating):
        return dtype in (jnp.dtype(jnp.float16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))
    return True


def held_as_bits(dtype: Any, platform: str) -> np.dtype | None:
    """The unsigned type an unpack program writes targets of ``dtype`` as, where they are
    passed to it as such: None for dtypes written as they are (`writes_in_place`).

    A target XLA cannot write in place (bfloat16 and float8 on CPU) would otherwise be
    rewritten whole by every program that writes part of it, through a temporary, because
    the bitcasts to and from its bits fuse with the writes: a leaf cut into K slabs paid
    K passes over its destination shard (a 64 MiB bfloat16 shard in 18 slabs: 4.2 s a call,
    5x ``jax.device_put``). Reinterpreted as its bits by a program of its own, in its own
    buffer (a free bitcast with the older CPU fusion emitters, `copy_options`), the target
    is written in place as an integer array is. Complex and sub-byte types change shape or
    width as bits, and keep the fused path."""
    dtype = jnp.dtype(dtype)
    if writes_in_place(dtype, platform) or copy_options(platform) is None:
        return None
    if jax.dtypes.itemsize_bits(dtype) < 8 or jnp.issubdtype(dtype, jnp.complexfloating):
        return None
    return bits_dtype(dtype)


def _build_unpack(
    program: UnpackProgram,
    mesh: Mesh,
    specs: tuple[PartitionSpec, ...],
    held: Sequence[np.dtype | None],
) -> Callable[..., Any]:
    """The unpack program; a target with ``held`` bits is passed and returned as them."""
    n_slots, n_src = len(program.slots), len(program.sources)
    n_tgt = len(program.targets)
    has_table = program.columns > 0
    split = _split_spec(mesh)
    platform = mesh.devices.flat[0].platform
    # Targets written as they are (in place; those held as bits included) or as bits.
    native = [
        writes_in_place(o.dtype, platform) or bits is not None
        for o, bits in zip(program.targets, held, strict=True)
    ]
    # The dtype a target's parts become before they are written, and the program returns.
    kept = [
        o.dtype if bits is None else bits for o, bits in zip(program.targets, held, strict=True)
    ]

    def unpack(*args: jax.Array) -> tuple[jax.Array, ...]:
        row = args[0][0] if has_table else None
        args = args[1:] if has_table else args
        # Slots held as rows are read as the flat words they are (a free reshape: not donated).
        chunks = [x.reshape(-1) for x in args[:n_slots]]
        sources = args[n_slots : n_slots + n_src]
        # Targets written as they are (in place) or as unsigned bits (`writes_in_place`).
        targets = args[n_slots + n_src :]
        out = [x if n else to_bits(x) for x, n in zip(targets, native, strict=True)]
        bases = _bases(row, program)

        def words(slot: int, offset: int, n: int) -> jax.Array:
            if bases[slot] is None:
                return lax.slice(chunks[slot], (offset,), (offset + n,))
            return lax.dynamic_slice(chunks[slot], (bases[slot] + np.int32(offset),), (n,))

        for w in program.writes:
            dtype = program.targets[w.target].dtype
            n = words_of(w.shape, dtype, program.slots[w.slot].word)
            raw = words(w.slot, w.offset, n)
            part = words_to_bits(raw, dtype, w.shape)
            if native[w.target]:
                part = from_bits(part, kept[w.target])
            out[w.target] = write_bits(out[w.target], part, _at(row, w.column, len(w.shape)))
        for c in program.copies:
            dtype = program.targets[c.target].dtype
            rank = len(c.shape)
            at = _at(row, c.source_column, rank)
            part = read_bits(sources[c.source], at, c.shape, dtype, platform)
            if native[c.target]:
                part = from_bits(part, kept[c.target])
            out[c.target] = write_bits(out[c.target], part, _at(row, c.target_column, rank))
        final = [
            x if n else from_bits(x, o.dtype)
            for x, n, o in zip(out, native, program.targets, strict=True)
        ]
        if program.rebuilds:
            word = program.word
            heads = [words(k, 0, n) for k, n in enumerate(program.prefix) if n]
            flat = _flat(
                [bits_to_words(x, word) for x in heads]
                + [
                    bits_to_words(whole_bits(sources[i], d, platform), word)
                    for i, d in program.flat_sources
                ]
                + [bits_to_words(to_bits(targets[t]), word) for t in program.flat_targets]
            )
            for r in program.rebuilds:
                target = program.targets[r.target]
                n = words_of(target.shard, target.dtype, word)
                words = _gather(flat, row, r.column, n)
                final[r.target] = from_bits(
                    words_to_bits(words, target.dtype, target.shard), kept[r.target]
                )
        return tuple(final)

    in_specs = (split,) * has_table + (split,) * n_slots + specs
    out_specs = specs[n_src:]
    mapped = jax.shard_map(
        unpack, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )
    first = has_table + n_slots + n_src
    # Explicit output shardings: for a mesh with axes of size 1, the sharding read back from
    # the compiled program could spell the spec differently from the caller's.
    out_shardings = tuple(NamedSharding(mesh, spec) for spec in out_specs)
    return jax.jit(
        mapped,
        donate_argnums=tuple(range(first, first + n_tgt)),
        out_shardings=out_shardings,
        # A rebuilt target whose old words go unread still hands its buffer to the result.
        keep_unused=True,
        compiler_options=program_options(platform, _unpack_needs_newer_emitters(program)),
    )


def _build_transfer(
    program: TransferProgram, mesh: Mesh, options: Mapping[str, Any] | None = None
) -> Callable[..., Any]:
    n = len(program.slots)
    spec = PartitionSpec(GROUP_AXIS)

    def transfer(*args: jax.Array) -> tuple[jax.Array, ...]:
        # The second half (receive buffers) is unused: donated only so that XLA writes each
        # round's result into it instead of into a fresh allocation.
        return tuple(
            _as_bits(functools.partial(lax.ppermute, axis_name=GROUP_AXIS, perm=list(perm)), x)
            for x, perm in zip(args[:n], program.perms, strict=True)
        )

    mapped = jax.shard_map(
        transfer, mesh=mesh, in_specs=(spec,) * (2 * n), out_specs=(spec,) * n, check_vma=False
    )
    return jax.jit(
        mapped,
        donate_argnums=tuple(range(n, 2 * n)),
        keep_unused=True,
        compiler_options=dict(options) if options else None,
    )


def _as_bits(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """``fn(x)`` on ``x``'s bits where ``x`` is floating (a whole shard, `Slot.shard`): XLA's
    CPU backend permutes bfloat16 and float8 values through float32, quietening NaN payloads;
    as unsigned words they move bit for bit (and the bitcasts cost nothing: `copy_options`)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return fn(x)
    return lax.bitcast_convert_type(fn(lax.bitcast_convert_type(x, bits_dtype(x.dtype))), x.dtype)


def _flat(parts: Sequence[jax.Array]) -> jax.Array:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _gather(flat: jax.Array, row: jax.Array | None, column: int, n: int) -> jax.Array:
    """Words ``flat[row[column : column + n]]`` (the lowering keeps every index in range)."""
    assert row is not None
    indices = lax.slice(row, (column,), (column + n,))
    return flat.at[indices].get(mode="promise_in_bounds")


def _transfer_avals(program: TransferProgram, sharding: NamedSharding) -> list[Any]:
    shapes = [
        jax.ShapeDtypeStruct(s.shape(len(program.devices)), np.dtype(s.word), sharding=sharding)
        for s in program.slots
    ]
    return shapes + shapes


def _at(row: jax.Array | None, column: int, rank: int) -> list[jax.Array]:
    assert row is not None or rank == 0
    return [row[column + i] for i in range(rank)]


# --------------------------------------------------------------------------------- helpers


def _operand_views(operands: Sequence[Operand], mesh: Mesh) -> list[views.View | None]:
    """A view per operand; None where the program runs over the operand's own mesh (an
    operand with a ``spec``), which then takes the whole array."""
    return [None if o.spec is not None else shard_view(o.shard, o.dtype, mesh) for o in operands]


def shard_view(shard: Sequence[int], dtype: Any, mesh: Mesh) -> views.View:
    """The view re-wrapping per-device buffers of shape ``shard`` (one per device of ``mesh``,
    in its order; any arrays of that shape and dtype) onto ``mesh``: split on dimension 0
    over all of its axes (rank 0: replicated, each device reading its own). A program over
    ``mesh`` then reads each device's buffer as its shard."""
    if not shard:
        return views.View((), dtype, NamedSharding(mesh, PartitionSpec()))
    g = int(np.prod(mesh.devices.shape))
    shape = (g * shard[0], *shard[1:])
    return views.View(shape, dtype, NamedSharding(mesh, _split_spec(mesh)))


class _Clock:
    """Adds each phase's wall time to ``profile`` (awaiting its outputs); inert without one."""

    def __init__(self, profile: dict[str, float] | None) -> None:
        self.profile = profile
        self.t = time.perf_counter()

    def mark(self, phase: str, outputs: Sequence[jax.Array]) -> None:
        if self.profile is None:
            return
        jax.block_until_ready(outputs)
        now = time.perf_counter()
        self.profile[phase] = self.profile.get(phase, 0.0) + now - self.t
        self.t = now


def bitcasts_per_call(lowered: Lowered, platforms: Iterable[str]) -> tuple[int, int]:
    """The programs (compiled once) and dispatches per call that the bitcasts around unpacks
    add (`held_as_bits`): two around each unpack call with such a target, and two programs
    per distinct unpack program with one (at most: unpack programs whose such targets have
    the same dtypes and shardings share their bitcast programs)."""
    kinds = set(platforms)
    if len(kinds) != 1:
        return 0, 0
    (platform,) = kinds
    calls = [
        call.program
        for step in lowered.steps
        for call in step.unpacks
        if any(held_as_bits(o.dtype, platform) is not None for o in call.program.targets)
    ]
    return 2 * len(set(calls)), 2 * len(calls)


def host_syncs_per_call(lowered: Lowered, platforms: Iterable[str]) -> int:
    """How many times one call waits for the devices (see `waits_between_steps`): before
    every step with a transfer but the first, on CPU; never elsewhere."""
    if not waits_between_steps(platforms):
        return 0
    return max(0, sum(step.transfer is not None for step in lowered.steps) - 1)
