"""The public entry points: `plan`, `Plan` and `reshard`."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import math
import sys
import threading
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding
from jax.tree_util import keystr

from jaxreshard.errors import (
    ReshardError,
    ReshardTypeError,
    deleted_sources_error,
    leaf_error,
    merged_error,
)
from jaxreshard.planning.layout import Layout, LayoutError, normalize_spec
from jaxreshard.planning.lower import Lowered, lower, whole_wire_bytes, with_lowered
from jaxreshard.planning.route import Assignment, LeafSpec, planner_options, route
from jaxreshard.planning.schedule import (
    PlanStats,
    Schedule,
    build_plan_schedule,
    plan_stats,
    platform_options,
)
from jaxreshard.planning.topology import PROFILES, Topology
from jaxreshard.planning.whole import whole_leaves, whole_steps, without_leaves
from jaxreshard.quant import Fp8Blockwise, QuantizedArray, Quantizer
from jaxreshard.run import boundary, views
from jaxreshard.run.boundary import Boundary, Crossing
from jaxreshard.run.codec import wire_itemsize
from jaxreshard.run.multihost import (
    PlanIdentity,
    agree,
    check_order,
    fingerprint,
    give_up_agreement,
    options_text,
    order_check_enabled,
    place_refusal,
    refuse_call,
)
from jaxreshard.run.runtime import (
    Runtime,
    bitcasts_per_call,
    caller_settings_unset,
    host_syncs_per_call,
    refused_at_shutdown,
)
from jaxreshard.run.verify import Verifier, differing_shards

MiB = 1 << 20
log = logging.getLogger("jaxreshard")

DEFAULT_BUCKET_BYTES = {"cpu": 16 * MiB}
"""Per-device staging buffer size by backend, when ``bucket_bytes`` is not given.

On the CPU backend a collective-permute of fresh multi-10-MiB buffers is slowed by first-touch
page faults (about 1 GB/s at 64 MiB against 3.5 GB/s at 16 MiB), so buckets stay small there.
On GPUs NCCL send/recv reaches link bandwidth only with large messages and every bucket costs a
few kernel launches, so larger buckets (`GPU_BUCKET_BYTES`) pay off.
"""
GPU_BUCKET_BYTES = 128 * MiB

SMALL_BUCKET_BYTES = 1 * MiB
"""Below this ``bucket_bytes``, a plan of `MANY_BUCKETS` buckets or more is logged as a
warning: each bucket costs host dispatches and a collective's latency (hundreds of
microseconds on CPU, about as long as moving a MiB), so such a plan's calls are bound by its
bucket count, not by its bytes (a fuzz case of 64-byte buckets made 25,001 buckets and a
first call of 199 s)."""
MANY_BUCKETS = 1024


def default_bucket_bytes(platform: str) -> int:
    """The default ``bucket_bytes`` for a backend name (``"cpu"``, ``"gpu"``, ``"tpu"``)."""
    return DEFAULT_BUCKET_BYTES.get(platform, GPU_BUCKET_BYTES)


_F = TypeVar("_F", bound=Callable[..., Any])


def _own_meshes(method: _F) -> _F:
    """Run ``method`` with no mesh in context: a plan's programs run over meshes of their own
    (`jaxreshard.run.runtime`), which ``jax.set_mesh(trainer_mesh)`` around the call (the
    usual way to run explicit sharding) would otherwise contradict (shard_map and jit refuse a
    context mesh other than their own)."""

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _refuse_tracers(args[1:], kwargs)  # (args[0]: the plan itself)
        with _compiled_programs(args[0].x64):
            return method(*args, **kwargs)

    return wrapped  # type: ignore[return-value]


def _compiled_programs(x64: bool) -> contextlib.AbstractContextManager[Any]:
    """Run a plan's programs as compiled programs, whatever JAX's debugging settings, with
    ``jax_enable_x64`` as it was when the plan was made (``x64``): its dtypes were
    canonicalized then, and its programs, traced under the other setting, would mix 32- and
    64-bit words.

    A plan moves bits: a leaf holding NaN or inf is data, and under ``jax.debug_nans`` /
    ``jax.debug_infs`` JAX would re-run a program whose result holds one, op by op, on
    buffers the program had already consumed (donated), losing the caller's ``donate=`` tree
    mid-call. Under ``jax.disable_jit`` the compiled transfer programs cannot run at all. A
    plan's programs are its own code, traced once: ``jax.numpy_rank_promotion("raise")`` (or
    ``"warn"``), a check meant for the caller's code, would refuse (or warn about) their
    broadcasts. So these settings are at their defaults while a plan runs (on the calling
    thread: the caller's own code keeps them), which also keeps the programs' cache keys
    the same whatever the caller's settings."""
    stack = contextlib.ExitStack()
    try:
        # First the caller's own thread settings set aside (JAX keys its compile cache on
        # them), so that a call under `jax.set_mesh` or `jax.default_matmul_precision` finds
        # the programs compiled outside it; then the settings a plan's programs need.
        stack.enter_context(caller_settings_unset())
        if _mesh_in_context():
            stack.enter_context(jax.set_mesh(None))  # a process-wide mesh (`_own_meshes`)
        changed = [
            (setting, neutral)
            for setting, value, neutral in (
                (jax.debug_nans, jax.config.jax_debug_nans, False),
                (jax.debug_infs, jax.config.jax_debug_infs, False),
                (jax.disable_jit, jax.config.jax_disable_jit, False),
                (jax.numpy_rank_promotion, jax.config.jax_numpy_rank_promotion, "allow"),
                (jax.enable_x64, bool(jax.config.jax_enable_x64), x64),
            )
            if value != neutral
        ]
        for setting, neutral in changed:
            stack.enter_context(setting(neutral))
    except BaseException:
        stack.close()  # (the caller never enters it: the caller's settings as they were)
        raise
    return stack


def _mesh_in_context() -> bool:
    """Whether a mesh is set around the call; refuses a call made while JAX traces (a plan
    called inside `jax.jit` on arrays the traced function closes over: no tracer among its
    arguments, but JAX's mesh context cannot be read inside a trace)."""
    try:
        return not (jax.sharding.get_mesh().empty and jax.sharding.get_abstract_mesh().empty)
    except ValueError:  # "get_mesh can only be used outside of jax.jit"
        raise ReshardTypeError(
            f"{_TRACED}: this call is being traced (its arrays are concrete, closed over by the "
            f"traced function); nothing was moved\nHow to fix: {_TRACED_FIX}"
        ) from None


_TRACED = "jaxreshard cannot run inside jax.jit, jax.grad or jax.vmap"
_TRACED_FIX = (
    "call the plan (or jr.reshard) outside traced functions, on the arrays a jitted step "
    "returns: e.g. params = train_step(params, batch); sampler_params = plan(params)"
)


_WIDE_DTYPES = frozenset({"int64", "uint64", "float64", "complex128"})
"""Dtypes whose arrays only ``jax_enable_x64`` makes (a plan of them runs with it on)."""

_DONATES_A_SOURCE = "is also passed as a source array; donating it would destroy the source"
"""Why a ``donate=`` leaf that is a source array is refused (moved and fallback leaves alike)."""

_DONATED_IN_FLIGHT = (
    "is donated to a call in flight (or a Plan.start), which overwrites it: read that call's "
    "result (refit.result()) instead"
)
"""Why a source (of a plain or an fp8 plan) that a call in flight consumes is refused."""


def _refuse_tracers(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Refuse traced leaves (a plan called inside `jax.jit`, `jax.grad` or `jax.vmap`) before
    anything looks at them: a plan runs programs of its own on concrete arrays, so it cannot
    be traced into another program. Paths are the source tree's (the first argument), or
    start with the argument's name."""
    try:
        leaves = jax.tree_util.tree_leaves((args, kwargs))
    except (ValueError, TypeError):
        _check_flattenable(
            {"the source tree" if i == 0 else f"argument {i}": tree for i, tree in enumerate(args)}
            | {f"{name}=": tree for name, tree in kwargs.items()}
        )
        raise
    if not any(isinstance(x, jax.core.Tracer) for x in leaves):
        return  # (the common case: paths only for the error)
    named = {"" if i == 0 else f"<argument {i}>": tree for i, tree in enumerate(args)}
    named.update(kwargs)
    problems = [
        (name + keystr(path), f"is a tracer ({type(x).__name__}): jaxreshard moves concrete arrays")
        for name, tree in named.items()
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if isinstance(x, jax.core.Tracer)
    ]
    if problems:
        raise leaf_error(_TRACED, problems, _TRACED_FIX, cls=ReshardTypeError)


def _check_flattenable(trees: Mapping[str, Any]) -> None:
    """Refuse, by argument name, a tree JAX cannot flatten (a dict whose keys cannot be
    sorted: str and int keys together), where JAX's own ValueError names neither the argument
    nor the dict."""
    for name, tree in trees.items():
        try:
            jax.tree_util.tree_structure(tree)
        except (ValueError, TypeError) as e:
            where = _unsortable_dict(tree, "")
            if where is None:
                raise ReshardError(
                    f"{name} cannot be flattened as a pytree ({e})\nHow to fix: pass a tree "
                    "jax.tree_util.tree_flatten takes"
                ) from e
            raise ReshardError(
                f"{name} cannot be flattened as a pytree: the dict at {where or '<root>'} has "
                f"keys that cannot be sorted ({e})\nHow to fix: give each dict keys of one type "
                "(all str, or all int)"
            ) from e


def _unsortable_dict(tree: Any, path: str) -> str | None:
    """The path of the first dict in ``tree`` (through dicts, lists and tuples) whose keys
    cannot be sorted, or None."""
    if isinstance(tree, dict):
        try:
            sorted(tree)
        except TypeError:
            return path
        items: Iterable[tuple[Any, Any]] = tree.items()
    elif isinstance(tree, list | tuple):
        items = enumerate(tree)
    else:
        return None
    for key, child in items:
        found = _unsortable_dict(child, f"{path}[{key!r}]")
        if found is not None:
            return found
    return None


class Plan:
    """A compiled reshard from one set of layouts to another.

    Made by `jaxreshard.plan`. Call it with a source tree laid out as planned; it returns the
    tree in the destination layout. Planning is done when the plan is made; the transfer
    programs are compiled on the first call and reused by every later call.

    Attributes:
      stats: byte, round and program counts (`PlanStats`).
      lowered: every program of every step (pure data, `jaxreshard.planning.lower`).
      schedule: the units, rounds and buckets (pure data).
      assignment: the local copies and sent pieces (pure data).
      leaves: one `LeafSpec` per leaf, in tree-flattening order.

    The plan keeps its staging buffers between calls (at most ``stats.staging_bytes`` per
    device), so that a refit loop allocates nothing after its first call; `free_staging`
    returns them.
    """

    def __init__(
        self,
        treedef: Any,
        paths: Sequence[str],
        src_avals: Sequence[tuple[tuple[int, ...], Any, Sharding]],
        dst_shardings: Sequence[NamedSharding],
        leaves: Sequence[LeafSpec],
        assignment: Assignment,
        schedule: Schedule,
        lowered: Lowered,
        bucket_bytes: int,
        topology: Topology,
        compiler_options: Mapping[str, Any] | None = None,
        *,
        boundaries: Sequence[Boundary],
        moved: Sequence[int],
        fallback: Sequence[tuple[int, Sharding]] = (),
        fallback_avals: Mapping[int, _FallbackAval] | None = None,
    ) -> None:
        self.treedef = treedef
        self.paths = tuple(paths)
        self.src_avals = tuple(src_avals)
        self.dst_shardings = tuple(dst_shardings)
        self.leaves = tuple(leaves)
        # Which leaves of the caller's tree the planner moves (``leaves`` and the lists above
        # follow them), and which go through ``jax.device_put`` (``fallback="device_put"``).
        self.moved = tuple(moved)
        self.fallback = tuple(fallback)
        self._fallback_avals = dict(fallback_avals or {})  # leaf -> shape, dtype, cast
        self.boundaries = tuple(boundaries)
        # A `QuantizedPlan`'s inner plan: the caller's dtype each fp8 leaf's values were
        # quantized from, by moved leaf (set by `_plan_quantized`). The moved values do not
        # say it, so the multi-process agreement compares it beside them.
        self.quantized_from: dict[int, str] = {}
        # The setting its dtypes were canonicalized under, in force while it runs; on where
        # a leaf is 64-bit (made under jax.enable_x64, planned outside it): its programs
        # need 64-bit words.
        self.x64 = bool(jax.config.jax_enable_x64) or any(
            dtype in _WIDE_DTYPES
            for leaf in self.leaves
            for dtype in (leaf.src_dtype, leaf.dst_dtype)
        )
        self._crossing = Crossing(self.boundaries)
        self.assignment = assignment
        self.schedule = schedule
        self.lowered = lowered
        self.bucket_bytes = bucket_bytes
        self.compiler_options = dict(compiler_options or {})
        self.topology = topology
        platforms = [d.platform for s in dst_shardings for d in s.device_set]
        self.stats: PlanStats = with_lowered(
            plan_stats(self.leaves, assignment, schedule, crosses=topology.crosses),
            lowered,
            host_syncs_per_call(lowered, platforms),
            bitcasts_per_call(lowered, platforms),
        )
        self._runtime: Runtime | None = None
        # False while `jr.reshard`'s cache holds this plan outside the most recently used
        # (`_STAGING_PLANS`): each call then frees its staging when it is done.
        self._keep_staging = True
        self._lock = threading.Lock()
        self._agreed = False

    @property
    def runtime(self) -> Runtime:
        """The compiled programs and staging pool of this plan (made on first use)."""
        with self._lock:
            if self._runtime is None:
                self._runtime = Runtime(
                    self.leaves,
                    self.lowered,
                    [b.src for b in self.boundaries],
                    [b.dst for b in self.boundaries],
                    transfer_options=self.compiler_options,
                    never_donated=[i for i, b in enumerate(self.boundaries) if b.stages_out],
                )
            return self._runtime

    @_own_meshes
    def __call__(self, src_tree: Any, *, donate: Any = None, verify: bool = False) -> Any:
        """Reshard ``src_tree`` into the destination layout.

        Args:
          src_tree: arrays with the planned shapes, dtypes and shardings. Only read. Under
            ``jax.distributed`` a leaf whose source devices are all on other processes may be a
            ``jax.ShapeDtypeStruct`` with the planned sharding (see `plan`).
          donate: optional result of an earlier call of this plan; its buffers are reused for
            the new result (as ``jax.jit`` donation does) and it is deleted.
          verify: also check the result against the source (`verify`), raising
            `ReshardError` naming any shard that differs.

        Returns:
          A tree of ``jax.Array`` with the destination shardings and dtypes. Under
          ``jax.distributed`` each process's arrays hold its own destination shards.

        Raises:
          ReshardError: before any data moves, if an argument does not match the plan, or (first
            call, several processes) if the processes do not hold the same plan.
        """
        out = self._call(src_tree, donate, None, verify=verify)
        if verify:
            self.verify(src_tree, out)
        return out

    @_own_meshes
    def verify(self, src_tree: Any, out_tree: Any) -> None:
        """Check ``out_tree`` (this plan's result for ``src_tree``) shard by shard against
        ``src_tree``, with checksums computed on device on both sides.

        Each destination shard's position-hashed checksum is compared with the sum of the
        same box's parts on the source devices (cast as the plan casts), so only a few bytes per
        shard reach the host (`jaxreshard.run.verify`). Costs about one read of the source and
        one of the result; its first use compiles the checksum programs (one per box shape and
        side, shared by that side's devices). Single-controller JAX only for now.

        Raises:
          ReshardError: naming every leaf and device whose shard differs from its source.
        """
        errors = []
        try:
            flat = self._check_src(src_tree)
        except ReshardError as e:
            errors.append(e)
        try:
            out = self._check_arrays(
                out_tree,
                "the result tree",
                self._dst_avals,
                "these result leaves do not match the plan",
                "pass verify the tree this plan returned for src_tree (its destination shapes, "
                "dtypes and shardings), not deleted",
                fallbacks=False,
            )
        except ReshardError as e:
            errors.append(e)
        if errors:  # (the bad leaves of both trees in one error)
            raise merged_error(errors)
        src = self._crossing.sources([flat[i] for i in self.moved])
        results = self._crossing.inner([out[i] for i in self.moved])
        self._verifier.refuse_distributed()  # (before the fallback leaves' copies are made)
        self._verifier.check(src, results, also=self._fallback_problems(flat, out))

    @functools.cached_property
    def _verifier(self) -> Verifier:
        return Verifier(self.leaves, [self.paths[i] for i in self.moved])

    @_own_meshes
    def profile(self, src_tree: Any, *, donate: Any = None) -> tuple[Any, dict[str, float]]:
        """Like calling the plan, but every phase is awaited before the next starts and timed.

        Returns the result and seconds per phase: ``alloc`` (fresh destinations, without
        ``donate``), ``pool`` (staging buffers made), ``pack``, ``transfer``, ``unpack``. The
        phases do not overlap here as they do in a plain call, so the sum is longer than a
        call: use it to see where time goes, not to time the call.
        """
        phases: dict[str, float] = {}
        out = self._call(src_tree, donate, phases)
        return out, phases

    def free_staging(self) -> None:
        """Return the staging buffers the plan keeps between calls (the next call makes them
        again, which costs page faults on CPU and allocator time on accelerators)."""
        if self._runtime is not None:
            self._runtime.release()

    def _free_staging_unless_kept(self) -> None:
        """Free the staging now if the plan cache no longer keeps it (`_STAGING_PLANS`), and
        no call of this plan is running (one that is frees it when it is done)."""
        if not self._keep_staging and self._runtime is not None:
            self._runtime.release(wait=False)

    @_own_meshes
    def start(self, src_tree: Any, *, donate: Any = None) -> Refit:
        """Start resharding ``src_tree`` and return at once; the move runs without the caller.

        A worker thread issues the plan's programs (on top of JAX's asynchronous dispatch), so
        the caller keeps working, for example generating with the sampler's current weights,
        while the next weights stream in. The returned `Refit` says when it is ``done()``, and
        ``result()`` returns exactly what ``plan(src_tree, donate=donate)`` would have.

        Double buffering: keep two sampler trees and alternate them through ``donate=``::

            spare = plan(params)                     # weights k, in the sampler layout
            current = plan(params)
            for step in range(n):
                refit = plan.start(new_params(), donate=spare)   # k+1 streams into spare
                generate(current)                    # meanwhile: sample with weights k
                spare, current = current, refit.result()

        That holds two sampler copies of the weights (plus the plan's staging).

        Rules:
          - Arguments are checked here: a bad call raises `ReshardError` from ``start``,
            before anything moves, as a plain call does.
          - The sources must stay alive until ``result()`` returns: do not delete them or
            donate them (to ``jax.jit`` or elsewhere) while the refit is in flight. The refit
            keeps references to them; this library refuses to donate them, and a source
            deleted before the worker reaches it makes ``result()`` raise `ReshardError`
            naming it. One deleted while the refit's programs are dispatched on it can crash
            the process (JAX segfaults so with plain ``jax.jit`` calls too).
          - ``donate=`` is consumed: do not use that tree after ``start``. Until the refit is
            done, a call that donates it again or reads it as a source raises `ReshardError`
            (as does one that reads or donates an array over its buffers once the refit consumed
            them).
          - Leaves sent by ``jax.device_put`` (``fallback=``) are copied before ``start``
            returns, under the caller's ``jax.transfer_guard``: a NumPy source may change
            afterwards. (Under ``jax.distributed`` their NumPy values are copied on the host
            then, and put on the devices by the worker after the call's order check: a
            ``jax.device_put`` there may be a collective.)
          - Refits are issued in the order they are started, one at a time, on one worker
            thread per process; a plain call made while refits are in flight is issued after
            them (on that thread, the caller waiting). Under ``jax.distributed`` every
            involved process starts them in the same order (as with calls). The first start
            of a plan agrees with the other processes before it returns.
          - The programs queue on the devices behind work already enqueued there: a sampler
            that dispatches its next generation step after reading the previous one's tokens
            leaves room between steps; one that enqueues many steps ahead delays the refit
            until they have run. On CPU, one that enqueues collectives, or piles up
            multi-device programs, on the same devices without waiting can deadlock with the
            refit (XLA aborts after 40 s; see the README).
        """
        flat, old = self._prepare(src_tree, donate)
        try:
            flat, copies = self._early_fallback_copies(flat)
        except BaseException as e:  # a Ctrl-C here too: nothing will take the claim back
            _DONATED.release(old)
            if isinstance(e, ReshardError):
                self.refuse(e)
            raise
        sources = [x for x in flat if isinstance(x, jax.Array)]

        def deleted(donated_too: bool) -> ReshardError | None:
            gone = [(self.paths[i], "source") for i, x in enumerate(flat) if _deleted(x)]
            if donated_too:  # (before the move only: the move itself consumes them)
                gone += [(self.paths[i], "donate=") for i, x in enumerate(old or ()) if _deleted(x)]
            if not gone:
                return None
            return leaf_error(
                "these arrays were deleted while the refit was in flight",
                [(p, f"{kind} deleted (or donated) before result() returned") for p, kind in gone],
                "keep the source arrays alive until refit.result() returns, and do not use "
                "the donate= tree after start()",
            )

        def run() -> Any:
            try:
                early = deleted(donated_too=True)
                if early is not None:  # nothing issued yet: the peers' same call raises too
                    self.refuse(early, on_worker=True)
                    raise early
                try:
                    out = self._move(flat, old, None, copies)
                    jax.block_until_ready(out)
                    return out
                except Exception as e:
                    late = deleted(donated_too=False)
                    if late is None:
                        raise
                    raise late from e
            finally:
                _IN_FLIGHT.remove(sources)
                _DONATED.release(old)

        _IN_FLIGHT.add(sources)
        try:
            return Refit(_submit(run), sources)
        except BaseException:
            _IN_FLIGHT.remove(sources)
            _DONATED.release(old)
            raise

    def _call(
        self, src_tree: Any, donate: Any, profile: dict[str, float] | None, verify: bool = False
    ) -> Any:
        flat, old = self._prepare(src_tree, donate, verify)
        if _IN_FLIGHT.busy():  # keep the order of issue: after the refits started before
            return self._call_behind(flat, old, profile)
        try:
            return self._move(flat, old, profile)
        finally:
            _DONATED.release(old)

    def _call_behind(self, flat: list[Any], old: list[Any] | None, profile: Any) -> Any:
        """A call made while refits are in flight: its move runs on the worker after them,
        the caller waiting. The move itself gives up the claim on ``donate=`` when it is
        done: a wait interrupted (Ctrl-C) leaves a move that still runs and consumes the
        tree, which a retry must not be handed (a fuzz crashed so in XLA, 2026-12-06); one
        interrupted before the worker took it up is cancelled, and moves nothing."""
        try:
            flat, copies = self._early_fallback_copies(flat)

            def move() -> Any:
                try:
                    return self._move(flat, old, profile, copies)
                finally:
                    _DONATED.release(old)

            future = _submit(move)
        except BaseException:
            _DONATED.release(old)
            raise
        try:
            return future.result()
        except BaseException:
            if future.cancel():
                _DONATED.release(old)
            raise

    def _prepare(
        self, src_tree: Any, donate: Any, verify: bool = False
    ) -> tuple[list[Any], list[Any] | None]:
        """Check a call's arguments (and, once per plan, agree with the other processes)."""
        try:
            if not isinstance(verify, (bool, np.bool_)):  # "no" or "yes" would read as true
                raise ReshardTypeError(
                    f"verify must be True or False, got {verify!r}; nothing was moved\nHow to "
                    "fix: pass verify=True to check the result, or leave verify out"
                )
            if verify and jax.process_count() > 1:  # refused before anything moves
                raise ReshardError(
                    "verify=True is not supported under jax.distributed yet (the per-shard "
                    "sums would need combining across processes); nothing was moved\nHow to "
                    "fix: call the plan without verify=, or verify in a single-controller run"
                )
            flat, old = self._check_call(src_tree, donate)
        except ReshardError as e:
            self.refuse(e)
            raise
        self._agree()  # fail here, not in a collective
        taken = _DONATED.claim(old)  # last: a refused call must not keep its claim
        if taken:
            e = leaf_error(
                "these donate= leaves are being donated to another call in flight",
                [
                    (self.paths[i], "is donated to a call (or a Plan.start) not yet finished")
                    for i in taken
                ],
                "donate each result once: wait for the call or refit.result() that took it, "
                "then donate what that returned",
            )
            self.refuse(e)
            raise e
        # Checked again now that the claim is held: a call in flight that held these leaves
        # until its claim ended (another thread donating the same tree) has consumed them
        # since `_check_donate` found them alive, and XLA handed a consumed buffer crashes.
        gone = [self.paths[i] for i, x in enumerate(old or ()) if _deleted(x)]
        if gone:
            _DONATED.release(old)
            e = leaf_error(
                "these donate= leaves were donated to another call meanwhile",
                [
                    (path, "deleted by a call that finished after this one checked it")
                    for path in gone
                ],
                "donate each result once: a tree donated from two threads must be handed from "
                "one call to the next (donate what the call that took it returned)",
            )
            self.refuse(e)
            raise e
        return flat, old

    def refuse(self, error: ReshardError, *, on_worker: bool = False) -> None:
        """Under ``jax.distributed``: record a call this process refuses before anything moves
        in the order of calls (`multihost.refuse_call`), so that the other processes' same
        call raises naming it instead of pairing with this process's next call (which would
        hand them another step's weights). A plan's first call refused agrees on the plan
        first, as the call would have (the peers' same call waits there for this process):
        the refusal then takes that call's place. Where the agreement fails, it raises on
        the peers too, and nothing is recorded. A no-op in one process.

        Calls take their number in the order of calls when they are issued, and refits in
        flight are issued by the worker thread: while there are some, the refusal is
        recorded there too, after them (``on_worker``: the caller is that thread)."""
        if self._order_check() is None:
            return
        if not self._agreed:  # this object's first call; the same plan made again has agreed
            try:
                self._agree(on_worker)
            except ReshardError:  # (published: the peers raise in their agreement too)
                return
        record = functools.partial(
            refuse_call, self.identity, self._label, " ".join(str(error).splitlines()[:2])
        )
        if _IN_FLIGHT.busy() and not on_worker:
            _submit(record).result()
        else:
            record()

    def _agree(self, on_worker: bool = False) -> None:
        """Under ``jax.distributed``, once per plan object: agree on the whole plan, leaf by
        leaf, with the other processes (`multihost.agree`). While refits started before are
        still to be issued, on the worker thread after them (``on_worker``: the caller is
        that thread): their calls take their numbers first, as they were made first, where
        a first call agreed at once would cross them (a fuzz saw both processes raise on
        three calls, 2026-12-05)."""
        if jax.process_count() == 1 or self._agreed:
            return
        if _IN_FLIGHT.busy() and not on_worker:
            _submit(functools.partial(agree, self.identity)).result()
        else:
            agree(self.identity)
        self._agreed = True

    def _order_check(self) -> Callable[[], None] | None:
        """Every call under ``jax.distributed``: the same call on every involved process
        (`multihost.check_order`; run by the runtime while the first packs compute)."""
        if jax.process_count() == 1 or not order_check_enabled():
            return None
        return functools.partial(check_order, self.identity, self._label)

    def _move(self, *args: Any) -> Any:
        """`_move_now` under the plan's compile settings (also here: refits run on a worker
        thread)."""
        with _compiled_programs(self.x64):
            return self._move_now(*args)

    def _move_now(
        self,
        flat: list[Any],
        old: list[Any] | None,
        profile: dict | None,
        copies: dict[int, jax.Array] | None = None,
    ) -> Any:
        # Sources and donate= leaves checked again: a call behind refits in flight (run on
        # the worker, after them) may get an array over the buffers of a tree one of them
        # consumed (a donated one crashed the process in XLA). Refused in the order of calls,
        # as a refusal before the move is (a review: the peers' same call paired with this
        # process's next one, a step apart from then on).
        gone = [self.paths[i] for i in self.moved if _deleted(flat[i])]
        lost = [] if old is None else [self.paths[i] for i in self.moved if _deleted(old[i])]
        if gone or lost:
            errors = [deleted_sources_error("the call", gone)] if gone else []
            if lost:
                errors.append(
                    leaf_error(
                        "these donate= leaves were deleted before the call wrote them",
                        [(path, "deleted (or donated to a refit in flight)") for path in lost],
                        "donate a tree no call or refit in flight was given (nor arrays over "
                        "its buffers), or leave donate= out",
                    )
                )
            error = merged_error(errors)
            self.refuse(error, on_worker=True)
            raise error
        out: list[Any] = [None] * len(flat)
        check = self._order_check()
        if copies is None:  # (else made already, on the caller's thread)
            if check is not None and self.fallback:
                # Under jax.distributed a fallback copy may run a collective (jax.device_put of
                # a host value checks it equal on every process): after the call's order check,
                # or a call refused on a peer would pair it with the peer's next call.
                check()
                check = None
            copies = self._fallback_copies(flat)
        for i, x in copies.items():  # fallback leaves first: nothing is donated yet
            out[i] = x
        src = self._crossing.sources([flat[i] for i in self.moved])
        inner_old = None
        if old is not None:
            inner_old = self._crossing.donations([old[i] for i in self.moved])
        weak = [bool(getattr(flat[i], "weak_type", False)) for i in self.moved]
        moved = self._crossing.results(self.runtime.run(src, inner_old, profile, check), weak)
        if old is not None:
            self._crossing.free_unused([old[i] for i in self.moved])
        self._free_staging_unless_kept()
        for i, x in zip(self.moved, moved, strict=True):
            out[i] = x
        _PRODUCED.add(moved)
        for i, _ in self.fallback:
            if old is not None and isinstance(old[i], jax.Array) and not old[i].is_deleted():
                old[i].delete()
        return jax.tree_util.tree_unflatten(self.treedef, out)

    def _early_fallback_copies(
        self, flat: list[Any]
    ) -> tuple[list[Any], dict[int, jax.Array] | None]:
        """For a move the worker thread issues later (`start`, or a call behind refits in
        flight): ``(flat, copies)``, the fallback leaves' results made now, on the caller's
        thread (`_fallback_copies`). Under ``jax.distributed`` they may run collectives, which
        must follow the call's order check on the worker (`_move_now`): there the copies are
        None, and ``flat`` holds copies of the fallback leaves' NumPy values, taken now (the
        caller may change its arrays once ``start`` returns)."""
        if self._order_check() is None or not self.fallback:
            return flat, self._fallback_copies(flat)
        flat = list(flat)
        for i, _ in self.fallback:
            if isinstance(flat[i], np.ndarray):
                flat[i] = np.array(flat[i], copy=True)
        return flat, None

    def _fallback_copies(self, flat: Sequence[Any]) -> dict[int, jax.Array]:
        """The fallback leaves' results (named in a log line when the plan was made). Checked
        like the others, they should not fail, but if one does nothing has been donated yet.
        A call whose move runs on the worker thread (`start`, or a call behind refits in
        flight) makes them on the caller's thread first: they read host values (a NumPy
        array the caller may change after `start` returns) under the caller's
        ``jax.transfer_guard``, as a plain call does."""
        out = {}
        for i, dst in self.fallback:
            try:
                out[i] = self._fallback_copy(i, flat[i], dst)
            except Exception as e:  # (nothing is donated yet: fallback leaves go first)
                raise leaf_error(
                    "jax.device_put refused these fallback leaves",
                    [(self.paths[i], str(e).splitlines()[0])],
                    "give the leaf a destination jax.device_put takes, or make it a jax.Array "
                    "on a NamedSharding so that the plan moves it",
                ) from e
        return out

    def _fallback_copy(self, i: int, value: Any, dst: Sharding) -> jax.Array:
        """Leaf ``i``'s result through ``jax.device_put`` (``fallback="device_put"``), cast as
        planned: a copy even where the sharding is already the destination's (device_put
        would return the source itself, and donating that result would delete the
        source). A NumPy value is copied on the host first: jax 0.10.2's ``device_put`` of a
        NumPy array onto CPU devices other than the first returned arrays that went on reading
        its buffer (a later change of the NumPy array showed in them, after
        ``block_until_ready`` too, ``may_alias=False`` or not)."""
        if isinstance(value, np.ndarray):
            value = np.array(value, copy=True)
        out = jax.device_put(value, dst, may_alias=False)
        cast = self._fallback_avals[i][2] if i in self._fallback_avals else None
        return out if cast is None else out.astype(cast)

    def _fallback_problems(self, flat: Sequence[Any], out: Sequence[Any]) -> list[tuple[str, str]]:
        """`verify` of the fallback leaves: each result against a fresh `_fallback_copy` of
        its source, shard by shard, bit for bit (on device; a flag per shard reaches the
        host)."""
        problems = []
        wants = self._fallback_copies(flat)  # (refused as a call refuses them, naming them)
        for i, _ in self.fallback:
            want, got = wants[i], out[i]
            if (
                not isinstance(got, jax.Array)
                or got.is_deleted()
                or (got.shape, got.dtype) != (want.shape, want.dtype)
                or not got.sharding.is_equivalent_to(want.sharding, got.ndim)
            ):
                problems.append((self.paths[i], f"is not an array like {want.aval.str_short()}"))
                continue
            problems += [
                (self.paths[i], f"device {d}: the shard differs from the source (fallback)")
                for d in differing_shards(got, want)
            ]
        return problems

    @functools.cached_property
    def identity(self) -> PlanIdentity:
        """The plan as the multi-process agreement compares it (a hash of the pure plan data,
        and one description per leaf for mismatch messages)."""
        # A typed key moves as its uint32 data, the same for key<rbg> and key<urbg>: its
        # dtype is hashed too, so processes holding different key types disagree.
        kinds = tuple(
            str(dtype) if boundary.is_key(dtype) else self.quantized_from.get(i, "")
            for i, (_, dtype, _) in enumerate(self.src_avals)
        )
        options = options_text(self.compiler_options)
        # Leaves sent by jax.device_put are compared too, and their destinations' processes
        # take part: a device_put of a host value onto several processes' devices is a
        # collective (a fuzz, 2026-12-06: a process involved only through one was not
        # order-checked, and a plan of such leaves alone had no order check at all).
        fallbacks, fallback_devices = [], set()
        for i, sharding in self.fallback:
            shape, dtype, cast = self._fallback_avals[i]
            ids = _device_ids(sharding)
            into = f" as {jnp.dtype(cast)}" if cast is not None else ""
            fallbacks.append(
                (
                    self.paths[i],
                    f"{jnp.dtype(dtype)}{list(shape)}{into} by jax.device_put -> "
                    f"{_describe_devices(sharding, ids)}",
                )
            )
            fallback_devices.update(ids)
        return PlanIdentity(
            fingerprint(
                self.leaves,
                self.assignment,
                self.schedule,
                self.bucket_bytes,
                kinds,
                options,
                fallbacks,
            ),
            self.leaves,
            tuple(self._describe_leaf(i) for i in range(len(self.leaves))),
            self.bucket_bytes,
            kinds,
            options,
            tuple(fallbacks),
            tuple(sorted(fallback_devices)),
        )

    @functools.cached_property
    def _label(self) -> str:
        """A short name of the plan for messages: leaf count, first and last path, and the
        first moved leaf's layouts (two plans of one tree to two layouts differ there)."""
        if not self.paths:
            return "a plan of no leaves"
        n = len(self.paths)
        ends = self.paths[0] + (f" ... {self.paths[-1]}" if n > 1 else "")
        first = ""
        if self.leaves:  # (the first moved leaf: a fallback leaf may come before it)
            path = "" if self.moved[0] == 0 else f"{self.paths[self.moved[0]]}: "
            first = f" ({path}{self._describe_leaf(0)}{', ...' if n > 1 else ''})"
        return f"the plan of {n} {'leaf' if n == 1 else 'leaves'} {ends}{first}"

    def _describe_leaf(self, i: int) -> str:
        leaf = self.leaves[i]
        shape, dtype, src = self.src_avals[i]
        what, into = f"{leaf.src_dtype}{list(leaf.shape)}", leaf.dst_dtype
        if boundary.is_key(dtype):  # moved as its data; named as the caller holds it
            what, into = f"{dtype}{list(shape)}", str(dtype)
        if i in self.quantized_from:
            what = f"{self.quantized_from[i]}{list(shape)} quantized to {what}"
        return (
            f"{what} {_describe_devices(src, leaf.src.devices)} -> "
            f"{into} {_describe_devices(self.dst_shardings[i], leaf.dst.devices)}"
        )

    # --------------------------------------------------------------------------- checking

    def _check_call(self, src_tree: Any, donate: Any) -> tuple[list[Any], list[Any] | None]:
        """`_check_src` and `_check_donate` (with ``donate``), raising one error naming the bad
        leaves of both trees."""
        errors, flat, old = [], None, None
        try:
            flat = self._check_src(src_tree)
        except ReshardError as e:
            errors.append(e)
        if donate is not None:
            try:  # (a source array donated is found by identity, whatever the tree's shape)
                src = jax.tree_util.tree_leaves(src_tree) if flat is None else flat
                old = self._check_donate(donate, src)
            except ReshardError as e:
                errors.append(e)
        if errors:
            raise merged_error(errors)
        return flat, old

    def _check_src(self, src_tree: Any) -> list[Any]:
        return self._check_arrays(
            src_tree,
            "the source tree",
            self.src_avals,
            "these source leaves do not match the plan",
            "call the plan with arrays of the planned shape, dtype and sharding, or make a "
            "new plan with jr.plan(...) (jr.reshard does this for you and caches plans)",
            allow_placeholders=True,
        )

    @functools.cached_property
    def _dst_avals(self) -> list[tuple[tuple[int, ...], Any, Sharding]]:
        """Each moved leaf's result: the caller's shape, dtype and sharding."""
        return [
            (leaf.shape if b.key_impl is None else b.shape, dtype, b.user_dst)
            for leaf, b, dtype in zip(self.leaves, self.boundaries, self._dst_dtypes, strict=True)
        ]

    def _check_donate(self, donate: Any, src: Sequence[Any]) -> list[Any]:
        return self._check_arrays(
            donate,
            "the donate= tree",
            self._dst_avals,
            "these donate= leaves cannot receive the result",
            "pass donate= the previous result of this same plan (same destination shapes, "
            "dtypes and shardings), not yet deleted, or leave donate= out",
            sources=src,
        )

    @functools.cached_property
    def _dst_dtypes(self) -> tuple[Any, ...]:
        """The caller's dtype of each moved leaf's result (a typed key's key dtype)."""
        return tuple(
            dtype if b.key_impl is not None else jnp.dtype(leaf.dst_dtype)
            for leaf, b, (_, dtype, _) in zip(
                self.leaves, self.boundaries, self.src_avals, strict=True
            )
        )

    def _check_arrays(
        self,
        tree: Any,
        name: str,
        expected: Sequence[tuple[tuple[int, ...], Any, Sharding]],
        summary: str,
        fix: str,
        sources: Sequence[Any] | None = None,
        allow_placeholders: bool = False,
        fallbacks: bool = True,
    ) -> list[Any]:
        """The leaves of ``tree``, if each moved leaf is a live array of the expected shape,
        dtype and sharding (and, for donation, none is a source array); else an error naming
        them all. Fallback leaves (``fallback="device_put"``) are passed on as they are.

        With ``allow_placeholders``, a leaf whose sharding has no device on this process may be
        a ``jax.ShapeDtypeStruct`` (multi-controller JAX: this process holds none of it).
        ``fallbacks``: a source tree's fallback leaves are checked against the planned ones
        (not a result tree's: they are what `jax.device_put` gave)."""
        # Plain leaves: a tree of the plan's structure has the plan's paths (`self.paths`),
        # which only a problem needs; flattening with paths costs ~1 us a leaf on every call.
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef and not (sources is not None and self._same_paths(tree)):
            # (A donate= tree is taken leaf by leaf, by path: a sampler's own nnx.State,
            # whose Variables carry the sampler's annotations, differs from the source's only
            # in that metadata.)
            raise _structure_error(
                name, tree, self.paths, planned=True, reference=_shaped(self.treedef)
            )
        source_ids = {id(x) for x in sources or () if isinstance(x, jax.Array)}
        source_buffers: set[tuple[int, int]] | None = None  # read where a plan may alias
        first_at: dict[int, int] = {}  # donation: one array at two leaves would be donated twice
        problems = []
        # The per-leaf checks below name every problem; a tree that passes them all (every
        # call of a refit loop) is first recognised in one quick pass. A rule added below
        # needs its quick form in `_fit_quickly` too (one loop doing both, registries read once
        # per tree, took about a quarter more host time per warm call of 128 leaves).
        # A donated fallback leaf is deleted once its copy is made, so it is checked as a
        # moved leaf is (against the fallback's result), with the moved leaves (no leaf twice).
        fallen_donated = self._fallback_results if sources is not None else []
        quick = not fallen_donated and self._fit_quickly(leaves, expected, sources, source_ids)
        checked = [] if quick else [*zip(self.moved, expected, strict=True), *fallen_donated]
        fallen = {i for i, _ in fallen_donated}
        for i, (shape, dtype, sharding) in checked:
            path, x = self.paths[i], leaves[i]
            placeholder_ok = allow_placeholders and not sharding.addressable_devices
            problem = _array_problem(x, shape, dtype, sharding, placeholder_ok)
            if problem is None and id(x) in source_ids:
                problem = _DONATES_A_SOURCE
            if problem is None and sources is not None and isinstance(x, jax.Array):
                seen = first_at.setdefault(id(x), i)
                if seen != i:
                    problem = (
                        f"is the same array as {self.paths[seen]}; each leaf needs its own buffers"
                    )
            if problem is None and sources is None and _DONATED.holds(x):
                problem = _DONATED_IN_FLIGHT
            # (a plan with fallback leaves: their sources' layouts are not planned, so any
            # donated leaf could be over one of their buffers)
            if problem is None and sources is not None and (self._may_alias or fallen):
                if source_buffers is None:
                    source_buffers = _buffer_addresses(sources)
                if isinstance(x, jax.Array) and not source_buffers.isdisjoint(
                    _buffer_addresses([x])
                ):
                    problem = (
                        "holds a source array's own buffers (an array made over the source's "
                        "shards); donating it would destroy the source"
                    )
            if problem is None and sources is not None and _IN_FLIGHT.holds(x):
                problem = (
                    "is the source of a refit in flight (Plan.start); donating it would destroy "
                    "it: wait for that refit's result() first"
                )
            if problem:
                problems.append((path, problem))
        if sources is not None and not problems:  # donation: leaves sharing buffers
            donated = (*self.moved, *sorted(fallen))
            problems = self._shared_buffers([(self.paths[i], leaves[i]) for i in donated])
        if sources is None and fallbacks:  # a source tree: its fallback leaves as planned too
            for i, (shape, dtype, _) in self._fallback_avals.items():
                path, x = self.paths[i], leaves[i]
                if isinstance(x, jax.Array) and x.is_deleted():
                    problems.append((path, "is deleted"))
                    continue
                why = device_put_problem(x)  # (the check the plan made of its own leaf)
                if why:
                    problems.append((path, f"jax.device_put cannot take it ({why})"))
                    continue
                got = (tuple(np.shape(x)), _host_dtype(x))
                if got != (shape, dtype):
                    problems.append(
                        (path, f"expected {dtype}{list(shape)}, got {got[1]}{list(got[0])}")
                    )
        if problems:
            raise leaf_error(summary, problems, fix)
        return leaves

    def _same_paths(self, tree: Any) -> bool:
        """Whether ``tree``'s leaves have the plan's paths, in order."""
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return len(flat) == len(self.paths) and all(
            keystr(p) == q for (p, _), q in zip(flat, self.paths, strict=True)
        )

    def _fit_quickly(
        self,
        leaves: Sequence[Any],
        expected: Sequence[tuple[tuple[int, ...], Any, Sharding]],
        sources: Sequence[Any] | None,
        source_ids: set[int],
    ) -> bool:
        """Whether every moved leaf of ``leaves`` is a live array of exactly its expected
        shape, dtype and sharding that none of `_check_arrays`'s rules refuses: a quick pass
        (about half the cost of the per-leaf checks) that only ever says yes when they would
        find nothing. ``sources``, ``source_ids``: a donate= tree's sources (else None) and
        their arrays' ids."""
        moved = [leaves[i] for i in self.moved]
        ids = [id(x) for x in moved]
        if sources is None:  # a source or result tree: none donated to a call in flight
            if not _DONATED.isdisjoint(ids):
                return False
        else:  # donation: no source, no leaf twice, no source of a refit in flight
            if len(set(ids)) != len(ids) or not source_ids.isdisjoint(ids):
                return False
            if not _IN_FLIGHT.isdisjoint(ids):
                return False
            if self._may_alias:
                held, into = self._aliasing
                if len(sources) != len(self.paths):
                    return False  # (a source tree that did not pass its own checks)
                if not _buffer_addresses([sources[j] for j in held]).isdisjoint(
                    _buffer_addresses([moved[k] for k in into])
                ):
                    return False
        for x, (shape, dtype, sharding) in zip(moved, expected, strict=True):
            if not isinstance(x, jax.Array) or x.is_deleted():
                return False
            if x.shape != shape or x.dtype != dtype:
                return False
            if x.sharding is not sharding and x.sharding != sharding:
                return False
        return True

    def _shared_buffers(self, moved: Sequence[tuple[str, Any]]) -> list[tuple[str, str]]:
        """Donated leaves over one another's buffers, each named with the first holding
        them; none to look for where every leaf is a result the runtime made."""
        arrays = [x for _, x in moved]
        if _PRODUCED.made_all(arrays):
            return []
        owner: dict[tuple[int, int], str] = {}
        problems = []
        for name, x in moved:
            if not isinstance(x, jax.Array):
                continue
            for address in _buffer_addresses([x]):
                first = owner.setdefault(address, name)
                if first != name:
                    problems.append(
                        (name, f"shares its buffers with {first}; each leaf needs its own")
                    )
                    break
        return problems

    @functools.cached_property
    def _fallback_results(self) -> list[tuple[int, tuple[tuple[int, ...], Any, Sharding]]]:
        """Each fallback leaf's result (``fallback="device_put"``): its index, and the shape,
        dtype (cast as planned) and sharding `_fallback_copy` gives it."""
        results = []
        for i, dst in self.fallback:
            shape, dtype, cast = self._fallback_avals[i]
            results.append((i, (shape, dtype if cast is None else jnp.dtype(cast), dst)))
        return results

    @functools.cached_property
    def _may_alias(self) -> bool:
        """Whether a donate= leaf could be a source array's own buffers under another array
        object (`jax.make_array_from_single_device_arrays` over the source's shards, or a
        typed key wrapping them, `jax.random.wrap_key_data`, and its key data): some
        destination and source whose shards hold buffers of one dtype and shape share a
        device. Only such plans pay for reading buffer addresses on each call, and only of
        those leaves (`_aliasing`)."""
        return bool(self._aliasing[1])

    @functools.cached_property
    def _aliasing(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(source leaves, moved leaves)`` that could share buffers: the sources (by path
        index) with a shard of the dtype and shape of a destination's shard on one device,
        and the moved leaves (by index among them) whose destination has such a shard. (A
        plan with fallback leaves, whose sources' layouts it does not know, checks every
        donated leaf against every source: `_check_arrays`.)"""

        src = [_shard_buffers(*aval) for aval in self.src_avals]
        dst = [_shard_buffers(*aval) for aval in self._dst_avals]
        every_src, every_dst = set().union(*src), set().union(*dst)
        return (
            tuple(self.moved[k] for k, b in enumerate(src) if not b.isdisjoint(every_dst)),
            tuple(k for k, b in enumerate(dst) if not b.isdisjoint(every_src)),
        )

    # ---------------------------------------------------------------------------- reports

    @_own_meshes
    def compiled_transfers(self) -> list[str]:
        """The optimized HLO text of each distinct transfer program (compiles them; buckets
        of one shape share one).

        For inspection: each holds one ``collective-permute`` per round and no all-gather,
        all-reduce or all-to-all.
        """
        return self.runtime.transfer_texts()

    def describe(self) -> str:
        """A human-readable summary: bytes against the lower bound, rounds, buckets, per device.

        Pure: compiles nothing and moves no data.
        """
        s = self.stats
        send: dict[int, int] = collections.defaultdict(int)
        recv: dict[int, int] = collections.defaultdict(int)
        local: dict[int, int] = collections.defaultdict(int)
        for p in (*self.assignment.sent, *self.assignment.fans):  # (not every fan's pieces)
            n = math.prod(e - b for b, e in p.box) * self.leaves[p.leaf].itemsize
            send[p.src] += n * len(p.dsts)
            for d in p.dsts:
                recv[d] += n
        for c in self.assignment.local:
            local[c.device] += math.prod(e - b for b, e in c.box) * self.leaves[c.leaf].itemsize
        devices = sorted(set(send) | set(recv) | set(local))
        pad = s.bytes_wire - s.bytes_sent
        largest = max((n for b in self.schedule.buckets for n in b.slot_bytes), default=0)
        whole = [step for step in self.lowered.steps if step.whole]
        largest = max([largest, *(slot.nbytes for slot, _ in self.lowered.whole_rounds())])
        whole_sent = whole_wire_bytes(self.lowered)
        lines = [
            f"jaxreshard plan: {len(self.leaves)} leaves, {len(devices)} devices "
            f"({len(send)} send, {len(recv)} receive)",
            f"  bytes   total {_b(s.bytes_total)} | local {_b(s.bytes_local)} | lower bound "
            f"{_b(s.bytes_lower_bound)} | sent {_b(s.bytes_sent)}"
            + (
                f" ({s.bytes_sent / s.bytes_lower_bound:.0%} of bound)"
                if s.bytes_lower_bound
                else ""
            ),
            f"  wire    {_b(s.bytes_wire)} (padding {_b(pad)}"
            + (f", {pad / s.bytes_sent:.2%}" if s.bytes_sent else "")
            + f") | relayed {_b(s.bytes_relayed)}"
            + (
                f" ({_b(s.bytes_relayed_cross_domain)} between domains)"
                if s.bytes_relayed_cross_domain
                else ""
            ),
            f"  packed  {_b(self.lowered.packed_bytes)} (sent twice or more from one buffer: "
            f"{_b(s.bytes_sent - self.lowered.packed_bytes - whole_sent)})"
            + (
                f" | held parts passed through slots {_b(self.lowered.kept_bytes)}"
                if self.lowered.kept_bytes
                else ""
            )
            + (
                f" | sent as whole shards {_b(whole_sent)} in {len(whole)} step(s), not packed"
                if whole
                else ""
            ),
            f"  rounds  {s.rounds} in {s.buckets} bucket(s) of {len(self.schedule.units)} "
            f"unit(s), largest round {_b(largest)}, bucket limit {_b(self.bucket_bytes)}",
            f"  staging {_b(s.staging_bytes)} per device, "
            + (
                "kept between calls"
                if self._keep_staging
                else "freed after each call (a cached plan out of the most recently used)"
            ),
            f"  calls   {s.programs} programs (compiled on the first call), {s.dispatches} "
            f"dispatches and {s.host_syncs} host sync(s) per call",
            f"  busiest sender {_b(s.max_device_send_bytes)}, busiest receiver "
            f"{_b(s.max_device_recv_bytes)}",
        ]
        if self.compiler_options:
            lines.append(f"  xla     transfer programs ask for {self.compiler_options}")
        lines.append(f"  {'device':>8} {'sends':>12} {'receives':>12} {'local':>12}")
        for d in devices:
            lines.append(f"  {d:>8} {_b(send[d]):>12} {_b(recv[d]):>12} {_b(local[d]):>12}")
        crossing = [
            (self.paths[i], what)
            for i, b in zip(self.moved, self.boundaries, strict=True)
            for what in (
                "typed PRNG key, moved as its key data" if b.key_impl is not None else None,
                "source in host memory, copied to device memory first" if b.stages_in else None,
                "destination in host memory, copied there last" if b.stages_out else None,
            )
            if what
        ]
        crossing += [(self.paths[i], "through jax.device_put (fallback)") for i, _ in self.fallback]
        if crossing:
            lines.append(f"  {len(crossing)} leaf note(s):")
            lines += [f"    {path or '<root>'}: {what}" for path, what in crossing[:20]]
            if len(crossing) > 20:
                lines.append(f"    ... and {len(crossing) - 20} more")
        return "\n".join(lines)

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"Plan(leaves={len(self.leaves)}, bytes_sent={s.bytes_sent}, "
            f"rounds={s.rounds}, buckets={s.buckets})"
        )


class Refit:
    """A refit started by `Plan.start`, running while the caller goes on."""

    def __init__(self, future: concurrent.futures.Future, sources: Sequence[jax.Array]) -> None:
        self._future = future
        self._sources = sources  # kept alive until the refit is done

    def done(self) -> bool:
        """Whether the refit has finished (its result is on the devices, or it failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the refit and return the destination tree (what the plan's call returns).

        Raises what the move raised (`ReshardError` naming a source deleted while in flight),
        or ``TimeoutError`` if ``timeout`` seconds pass first (the refit goes on).
        """
        out = self._future.result(timeout)
        self._sources = ()
        return out

    def __repr__(self) -> str:
        return f"Refit(done={self.done()})"


class _InFlight:
    """Source arrays of refits in flight (by identity; the refits keep them alive)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: collections.Counter[int] = collections.Counter()
        self._refits = 0

    def add(self, arrays: Sequence[jax.Array]) -> None:
        with self._lock:
            self._count.update(id(x) for x in arrays)
            self._refits += 1

    def remove(self, arrays: Sequence[jax.Array]) -> None:
        with self._lock:
            self._count.subtract(id(x) for x in arrays)
            self._count += collections.Counter()  # drop the zeros
            self._refits -= 1

    def busy(self) -> bool:
        """Whether any refit is in flight."""
        return self._refits > 0

    def holds(self, x: Any) -> bool:
        with self._lock:
            return self._count[id(x)] > 0

    def isdisjoint(self, ids: Collection[int]) -> bool:
        """Whether no array of these ids (`id`) is a source of a refit in flight."""
        with self._lock:
            return not self._count or self._count.keys().isdisjoint(ids)


_IN_FLIGHT = _InFlight()


class _Donations:
    """Arrays donated to calls in flight (by identity; the calls hold them). A second call
    donating one of them is refused: the first call's programs consume its buffers, and XLA
    would be handed buffers already donated (a crash, not an error)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[int] = set()

    def claim(self, old: Sequence[Any] | None) -> list[int]:
        """Claim the arrays of ``old`` (a donate= tree's leaves) for one call; or, where some
        are claimed already, claim none and return those leaves' indexes."""
        arrays = [(i, x) for i, x in enumerate(old or ()) if isinstance(x, jax.Array)]
        with self._lock:
            taken = [i for i, x in arrays if id(x) in self._ids]
            if not taken:
                self._ids.update(id(x) for _, x in arrays)
            return taken

    def holds(self, x: Any) -> bool:
        with self._lock:
            return id(x) in self._ids

    def isdisjoint(self, ids: Collection[int]) -> bool:
        """Whether no array of these ids (`id`) is donated to a call in flight."""
        with self._lock:
            return self._ids.isdisjoint(ids)

    def release(self, old: Sequence[Any] | None) -> None:
        with self._lock:
            self._ids.difference_update(id(x) for x in old or () if isinstance(x, jax.Array))


_DONATED = _Donations()


class _Produced:
    """The results jaxreshard's runtime made (weakly, by identity): each holds buffers of its
    own, so a donate= tree of them needs no look at buffer addresses. Any other array in a
    donate= tree could share buffers with another leaf (an array made over a result's shards),
    and XLA handed one buffer twice crashes (a segfault, not an error): such trees are
    checked (`Plan._check_arrays`), at a few microseconds per leaf."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refs: dict[int, weakref.ref] = {}
        self._live = 0  # entries after the last pruning

    def add(self, arrays: Sequence[Any]) -> None:
        with self._lock:
            for x in arrays:
                if isinstance(x, jax.Array):
                    self._refs[id(x)] = weakref.ref(x)
            if len(self._refs) > 2 * self._live + 1024:  # drop the dead now and then
                self._refs = {k: r for k, r in self._refs.items() if r() is not None}
                self._live = len(self._refs)

    def made_all(self, arrays: Sequence[Any]) -> bool:
        with self._lock:
            for x in arrays:
                ref = self._refs.get(id(x))
                if ref is None or ref() is not x:
                    return False
            return True


_PRODUCED = _Produced()
_WORKER: concurrent.futures.ThreadPoolExecutor | None = None
_WORKER_LOCK = threading.Lock()
_AT_SHUTDOWN = threading.Lock()


def _worker() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that issues started refits, in the order they were started."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxreshard")
        return _WORKER


def _submit(fn: Callable[[], Any]) -> concurrent.futures.Future:
    """Run ``fn`` on the worker, after what was submitted before. At interpreter shutdown
    (``concurrent.futures`` takes no new work then: a probe's training thread still calling
    ``start`` after the main module ended, or a final sync in an ``atexit`` hook, got its
    raw RuntimeError) ``fn`` runs on the caller's thread once the worker has finished what it
    holds, one such caller at a time, and the future returned is already resolved."""
    try:
        return _worker().submit(fn)
    except RuntimeError as e:  # "cannot schedule new futures after (interpreter) shutdown"
        if not refused_at_shutdown(e):
            raise
    with _AT_SHUTDOWN:
        _worker().shutdown(wait=True)
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn())
        except Exception as e:
            future.set_exception(e)
        return future


def _deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and x.is_deleted()


class _Checked(NamedTuple):
    """`_checked_leaves`: each moved leaf's aval, boundary and spec, the moved and the fallback
    leaves' indices (a fallback with its destination and aval), and the error naming every
    leaf that can be neither (None if there is none)."""

    avals: list[Any]
    leaves: list[LeafSpec]
    boundaries: list[Any]
    moved: list[int]
    fallen: list[tuple[int, Sharding, Any]]
    error: ReshardError | None


def _checked_leaves(
    flat: Sequence[tuple[Any, Any]],
    dsts: Sequence[Any],
    dtypes: Sequence[Any],
    named: Sequence[bool],
    fallback: str | None,
) -> _Checked:
    """`plan`'s per-leaf checks over ``flat`` (``(path, leaf)`` pairs, with their destination,
    dtype entry and whether that entry is the leaf's own)."""
    problems, avals, leaves, boundaries, moved, fallen = [], [], [], [], [], []
    for i, ((path, x), dst, want, own) in enumerate(zip(flat, dsts, dtypes, named, strict=True)):
        try:
            aval, edge, leaf = _leaf_spec(keystr(path), x, dst, want, own)
        except _LeafProblem as e:
            if fallback == "device_put" and e.device_put_ok and isinstance(dst, Sharding):
                try:
                    fallen.append((i, dst, _fallback_aval(x, dst, want, own)))
                except _LeafProblem as f:
                    problems.append((keystr(path), str(f), f.kind))
            else:
                # A sharding no fallback moves either gets a fix that does not offer one.
                offers = e.kind != "sharding" or e.device_put_ok
                problems.append((keystr(path), str(e), e.kind if offers else "sharding-only"))
            continue
        avals.append(aval)
        boundaries.append(edge)
        leaves.append(leaf)
        moved.append(i)
    error = None
    if problems:
        kinds = {k for _, _, k in problems}
        if "sharding" in kinds:
            kinds.discard("sharding-only")
        cls = ReshardTypeError if kinds == {"type"} else ReshardError
        error = leaf_error(
            "cannot plan a reshard for these leaves",
            [(p, m) for p, m, _ in problems],
            _FIXES[sorted(kinds)[0]]
            if len(kinds) == 1
            else " / ".join(_FIXES[k] for k in sorted(kinds)),
            cls=cls,
        )
    return _Checked(avals, leaves, boundaries, moved, fallen, error)


def plan(
    src_tree: Any,
    dst_shardings: Any,
    *,
    bucket_bytes: int | None = None,
    unit_buckets: int | None = None,
    dtype: Any = None,
    topology: Topology | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    fallback: str | None = None,
) -> Plan | QuantizedPlan:
    """Plan moving ``src_tree`` into the layouts ``dst_shardings``.

    Args:
      src_tree: a pytree of ``jax.Array`` (or ``jax.ShapeDtypeStruct`` with a ``sharding``, to
        plan before the data exists).
      dst_shardings: a pytree of shardings (``NamedSharding``, or any ``Sharding`` with a
        device set, as ``SingleDeviceSharding``) with the same structure, or a prefix of it
        (one sharding for everything, one per subtree), as ``jax.jit``'s ``out_shardings``.
      bucket_bytes: largest per-device staging buffer, per direction (at least 16 bytes,
        the widest element). Defaults to `default_bucket_bytes` of the destination's backend.
      unit_buckets: the most buckets a *unit* spans (a run of leaves, or a slab of a large
        leaf, moved apart from the others; README, How it works). Each bucket of a unit is a
        program of its own, and every (sender, receiver) pair costs a unit a round: larger
        units make fewer rounds on every call and more programs to compile on the first.
        Defaults to 1 on CPU and `schedule.GPU_UNIT_BUCKETS` (128) on accelerators.
      dtype: destination dtype: one dtype, or a tree (prefix) of dtypes with None meaning
        "keep". The cast runs on the senders, so narrowing halves the bytes sent. An entry
        standing for a subtree casts its floating leaves only. An `Fp8Blockwise` entry
        quantizes its floating leaves on the senders into a `QuantizedArray` (fp8 values and
        per-block float32 scales; `jaxreshard.quant`): the plan is then a `QuantizedPlan`.
        Standing for a subtree, it quantizes the floating leaves of at least the block's
        rank, and the others (counters, keys, 1-D norms under a 2-D block) keep their dtype.
      topology: optional `Topology` (fast domains, bandwidths) of the devices. With it,
        senders in the receiver's domain are preferred, cross-domain sends are balanced, bytes
        needed by several devices of a domain cross into it once and are relayed inside it
        (hierarchical fan-out), slow and fast links get rounds of their own, and
        ``stats.bytes_cross_domain`` counts what crosses domains. See `jr.Topology`
        (`jaxreshard.planning.topology`).
      compiler_options: XLA options for the transfer programs only, as ``jax.jit``'s
        ``compiler_options`` (for example, on GPUs of one host,
        ``{"xla_gpu_use_memcpy_local_p2p": True}``; see the README's GPU section). None are
        set by default: jaxreshard never changes ``XLA_FLAGS``.
      fallback: ``"device_put"``: leaves jaxreshard cannot take (NumPy arrays, Python
        scalars, a typed key on a sharding that is not named) go through ``jax.device_put``
        (a copy), named in a warning of the ``"jaxreshard"`` logger when the plan is made.
        None (default): they are refused, named.

    Returns:
      A `Plan`. Planning is pure: no program is compiled and no data moves.

    Raises:
      ReshardError: naming every bad leaf, if the trees or layouts cannot be resharded.

    Multi-controller JAX (``jax.distributed``): the transfer is a collective over the devices
    of several processes, so:

    1. Every *involved* process, one that owns a device of any leaf's source or destination
       sharding, calls ``jr.plan`` (or ``jr.reshard``) with the same global description: the
       same tree, shapes and dtypes, shardings on the same meshes (same device order) and the
       same options. Plans are deterministic: every process derives the identical schedule.
    2. Each involved process then calls the plan with its source tree: ``jax.Array`` leaves
       holding its own (addressable) shards; a leaf whose source devices are all on other
       processes may be a ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``. The result
       holds this process's destination shards (none on a process without destination
       devices). ``donate=`` is per process: the previous result of the same plan.
    3. Involved processes call their plans in the same order. The first call of a plan blocks
       until every involved process reaches it and confirms (through the ``jax.distributed``
       key-value store) that they hold the same plan; on a mismatch every process raises
       `ReshardError` naming the first differing leaf, before any data moves.
    4. Processes that own none of the plan's devices need not call it (calling it does nothing
       and returns arrays with no addressable shards).

    Without a ``topology``, `Topology.from_devices` describes the devices (one domain per
    process): a part with replicas is sent from one on the receiver's own process when there is
    one; other parts are balanced over all replicas.
    """
    _check_options(bucket_bytes, topology, compiler_options, fallback, unit_buckets)
    _check_flattenable(
        {"the source tree": src_tree, "dst_shardings": dst_shardings, "dtype=": dtype}
    )
    _refuse_tracers((src_tree,), {})
    flat, treedef = jax.tree_util.tree_flatten_with_path(src_tree)
    hint = None if flat else _nnx_hint(src_tree)
    if hint is not None:  # (an empty plan would move nothing, silently)
        raise ReshardError(f"the source tree holds no arrays\nHow to fix: {hint}")
    paths = [keystr(p) for p, _ in flat]
    dsts = _broadcast(dst_shardings, src_tree, "dst_shardings", lambda x: isinstance(x, Sharding))
    dtypes, named = _dtype_entries(dtype, src_tree)
    if any(isinstance(d, Fp8Blockwise) for d in dtypes):
        return _plan_quantized(
            flat,
            treedef,
            dsts,
            dtypes,
            named,
            bucket_bytes=bucket_bytes,
            unit_buckets=unit_buckets,
            topology=topology,
            compiler_options=compiler_options,
            fallback=fallback,
        )
    checked = _checked_leaves(flat, dsts, dtypes, named, fallback)
    if checked.error is not None:
        raise checked.error
    avals, leaves, boundaries = checked.avals, checked.leaves, checked.boundaries
    moved, fallen = checked.moved, checked.fallen
    if fallen:
        log.warning(
            "jaxreshard: %d leaves go through jax.device_put (fallback='device_put'): %s",
            len(fallen),
            ", ".join(paths[i] or "<root>" for i, _, _ in fallen[:20])
            + (" ..." if len(fallen) > 20 else ""),
        )
    dsts = [b.dst for b in boundaries]
    platform = next(iter(dsts[0].device_set)).platform if dsts else "cpu"
    if bucket_bytes is None:
        bucket_bytes = default_bucket_bytes(platform)
    fan_out = topology is not None  # relays only where the caller described the domains
    if topology is None:
        topology = Topology.from_devices(_plan_devices(dsts, avals))
    options = platform_options(platform, int(bucket_bytes), unit_buckets)
    assignment = route(leaves, topology, fan_out=fan_out, **planner_options(int(bucket_bytes)))
    # Leaves whose every destination shard is a whole source shard go as they are, without
    # staging (`planning.whole`); the schedule stages the rest.
    profile = PROFILES["cpu" if platform == "cpu" else "h100"]  # (as Topology.from_devices)
    whole = whole_leaves(leaves, assignment, int(bucket_bytes), profile)
    schedule = build_plan_schedule(
        leaves,
        without_leaves(assignment, whole),
        bucket_bytes=int(bucket_bytes),
        link_class=topology.link_class,
        class_latency_bytes=topology.class_latency_bytes(),
        **options,
    )
    lowered = lower(
        leaves,
        schedule,
        bucket_bytes=int(bucket_bytes),
        whole=whole_steps(leaves, whole, int(bucket_bytes)),
    )
    made = Plan(
        treedef,
        paths,
        avals,
        [b.user_dst for b in boundaries],
        leaves,
        assignment,
        schedule,
        lowered,
        int(bucket_bytes),
        topology,
        compiler_options,
        boundaries=boundaries,
        moved=moved,
        fallback=[(i, dst) for i, dst, _ in fallen],
        fallback_avals={i: aval for i, _, aval in fallen},
    )
    _warn_if_many_small_buckets(made, platform)
    return made


def _warn_if_many_small_buckets(made: Plan, platform: str) -> None:
    """Logs a warning for a plan of `MANY_BUCKETS` buckets or more under `SMALL_BUCKET_BYTES`
    (a call then costs about a bucket's host and collective overhead per bucket)."""
    stats = made.stats
    if made.bucket_bytes >= SMALL_BUCKET_BYTES or stats.buckets < MANY_BUCKETS:
        return
    log.warning(
        "jaxreshard: bucket_bytes=%d makes %d buckets (%d dispatches a call): each bucket "
        "costs host dispatches and a collective's latency, so every call of this plan is "
        "bound by its bucket count rather than its bytes. How to fix: pass bucket_bytes of a "
        "few MiB or more (the default on %s: %d), or None",
        made.bucket_bytes,
        stats.buckets,
        stats.dispatches,
        platform,
        default_bucket_bytes(platform),
    )


# ------------------------------------------------------------------------------ FP8 plans


class QuantizedPlan:
    """A plan with `Fp8Blockwise` leaves (made by `plan`): quantize on the senders, then one
    inner `Plan` moves every leaf, fp8 values and float32 scales included.

    Calling it returns the destination tree with a `QuantizedArray` at each fp8 leaf; donate=
    takes such a result. ``stats`` (values and scales both counted), ``describe()``,
    ``lowered`` and the rest are the inner plan's (`inner`).
    """

    def __init__(
        self,
        inner: Plan,
        treedef: Any,
        paths: Sequence[str],
        quantized: Sequence[int],
        formats: Sequence[Fp8Blockwise],
        avals: Sequence[tuple[tuple[int, ...], Any, Sharding]],
        quantizer: Quantizer,
    ) -> None:
        self.inner = inner
        self.x64 = inner.x64
        self.treedef = treedef
        self.paths = tuple(paths)
        self.quantized = tuple(quantized)
        self.formats = tuple(formats)
        self._avals = tuple(avals)
        self._quantizer = quantizer

    @_own_meshes  # (tracers refused in every argument: donate= and out too)
    def __call__(self, src_tree: Any, *, donate: Any = None, verify: bool = False) -> Any:
        """Quantize the fp8 leaves on their devices and move the tree (see `Plan.__call__`)."""
        inner = self._quantize(src_tree, call=True, donate=donate)
        return self.inner(inner, donate=donate, verify=verify)

    @_own_meshes
    def start(self, src_tree: Any, *, donate: Any = None) -> Refit:
        """`Plan.start` with the fp8 leaves quantized first (dispatched, not awaited)."""
        return self.inner.start(self._quantize(src_tree, call=True, donate=donate), donate=donate)

    @_own_meshes
    def verify(self, src_tree: Any, out_tree: Any) -> None:
        """`Plan.verify` of the values and scales against the senders' quantization (the
        quantize program runs again: it is deterministic)."""
        self.inner.verify(self._quantize(src_tree), out_tree)

    @_own_meshes
    def profile(self, src_tree: Any, *, donate: Any = None) -> tuple[Any, dict[str, float]]:
        """`Plan.profile` of the move (the quantize program is not in the phases)."""
        inner = self._quantize(src_tree, call=True, donate=donate)
        return self.inner.profile(inner, donate=donate)

    @_own_meshes
    def _quantize(self, src_tree: Any, call: bool = False, donate: Any = None) -> Any:
        """The inner plan's source: the tree with each fp8 leaf as its quantized pair. A
        ``call`` this refuses takes its place in the order of calls (`Plan.refuse`), as the
        inner plan's own refusals do. A ``donate=`` leaf over one of the fp8 source arrays
        is refused first: the inner plan sees their quantized copies, not them."""
        flat, treedef = jax.tree_util.tree_flatten(src_tree)
        try:
            if treedef != self.treedef:
                raise _structure_error(
                    "the source tree",
                    src_tree,
                    self.paths,
                    planned=True,
                    reference=_shaped(self.treedef),
                )
            problems = []
            for i, (shape, dtype, sharding) in zip(self.quantized, self._avals, strict=True):
                # (a leaf this process holds none of may be a placeholder, as with `Plan`)
                mine = bool(sharding.addressable_devices)
                problem = _array_problem(flat[i], shape, dtype, sharding, not mine)
                if problem is None and _DONATED.holds(flat[i]):
                    # (a review: quantized once the call in flight had consumed it, the
                    # process crashed)
                    problem = _DONATED_IN_FLIGHT
                if problem:
                    problems.append((self.paths[i], problem))
            donated = [] if problems else self._donated_sources(flat, donate)
            if donated:
                raise leaf_error(
                    "these donate= leaves cannot receive the result",
                    donated,
                    "pass donate= the previous result of this same plan, not the source's "
                    "own arrays, or leave donate= out",
                )
            if problems:  # (with the other leaves' problems, which the inner plan names next)
                problems += self._other_problems(flat)
                raise leaf_error(
                    "these source leaves do not match the plan",
                    problems,
                    "call the plan with arrays of the planned shape, dtype and sharding",
                )
        except ReshardError as e:
            if call:
                self.inner.refuse(e)
            raise
        try:
            pairs = self._quantizer(
                [flat[i] for i in self.quantized], [self.paths[i] for i in self.quantized]
            )
        except ReshardError as e:
            if call:
                self.inner.refuse(e)
            raise
        inner = list(flat)
        for i, fmt, (values, scales) in zip(self.quantized, self.formats, pairs, strict=True):
            inner[i] = QuantizedArray(values, scales, fmt)
        return jax.tree_util.tree_unflatten(self.treedef, inner)

    def _donated_sources(self, flat: Sequence[Any], donate: Any) -> list[tuple[str, str]]:
        """The ``donate=`` leaves that are one of the quantized source arrays, or over its
        buffers, by path. The inner plan checks donated leaves against its own sources only,
        the quantized copies, so it cannot see these (a fuzz found an fp8 source donated as
        the values deleted by the call, 2026-12-06; a review, a float32 source donated at a
        plain leaf of its shape and sharding, and an fp8 source in a donate= tree of another
        pytree type that the inner plan takes by path, 2026-12-07)."""
        sources = [flat[i] for i in self.quantized if isinstance(flat[i], jax.Array)]
        if donate is None or not sources:
            return []
        inner = self.inner
        leaves, treedef = jax.tree_util.tree_flatten(donate)
        if treedef == inner.treedef:
            by_path = dict(zip(inner.paths, leaves, strict=True))
        else:  # (taken leaf by leaf, by path, as the inner plan takes it)
            flat_donate = jax.tree_util.tree_flatten_with_path(donate)[0]
            by_path = {keystr(p): x for p, x in flat_donate}
        ids = {id(x) for x in sources}
        found = {path for path, x in by_path.items() if id(x) in ids}
        # Another array over a source's buffers: only where a destination's shards could be
        # such buffers (`_source_aliasing`), so a refit loop reads few buffer addresses.
        others = [
            (path, x)
            for path in (inner.paths[j] for j in self._source_aliasing)
            if path not in found and isinstance(x := by_path.get(path), jax.Array)
        ]
        if others:
            buffers = _buffer_addresses(sources)
            found.update(p for p, x in others if not buffers.isdisjoint(_buffer_addresses([x])))
        return [(path, _DONATES_A_SOURCE) for path in by_path if path in found]

    @functools.cached_property
    def _source_aliasing(self) -> tuple[int, ...]:
        """The inner plan's leaves (by path index) whose destination shards hold buffers of
        the dtype and shape of a quantized source's shards on one device: where a donated
        array could be a source's own buffers under another array object."""
        held = set().union(*(_shard_buffers(*aval) for aval in self._avals))
        inner = self.inner
        return tuple(
            inner.moved[k]
            for k, aval in enumerate(inner._dst_avals)
            if not _shard_buffers(*aval).isdisjoint(held)
        )

    def _other_problems(self, flat: Sequence[Any]) -> list[tuple[str, str]]:
        """The problems of the source leaves that are not fp8, against the inner plan's avals
        (the inner tree has two leaves, values and scales, at each fp8 leaf)."""
        expected = dict(zip(self.inner.moved, self.inner.src_avals, strict=True))
        quantized, j, problems = set(self.quantized), 0, []
        for i, x in enumerate(flat):
            if i in quantized:
                j += 2
                continue
            if j in expected:
                shape, dtype, sharding = expected[j]
                mine = bool(sharding.addressable_devices)
                problem = _array_problem(x, shape, dtype, sharding, not mine)
                if problem:
                    problems.append((self.paths[i], problem))
            j += 1
        return problems

    def describe(self) -> str:
        """The inner plan's summary, and the fp8 leaves' values and scales."""
        lines = [self.inner.describe(), f"  {len(self.quantized)} fp8 leaf (leaves):"]
        for i, fmt, (shape, _, _) in zip(
            self.quantized[:20], self.formats, self._avals, strict=False
        ):
            lines.append(
                f"    {self.paths[i] or '<root>'}: {fmt.fmt.name}{list(shape)} values + float32"
                f"{list(fmt.scale_shape(shape))} scales (block {fmt.block})"
            )
        if len(self.quantized) > 20:
            lines.append(f"    ... and {len(self.quantized) - 20} more")
        return "\n".join(lines)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"QuantizedPlan({len(self.quantized)} fp8 leaves, inner={self.inner!r})"


def _plan_quantized(
    flat: Sequence[tuple[Any, Any]],
    treedef: Any,
    dsts: Sequence[Any],
    dtypes: Sequence[Any],
    named: Sequence[bool],
    **options: Any,
) -> QuantizedPlan:
    """`plan` for a tree with `Fp8Blockwise` entries (``flat``: the source's leaves with their
    paths): checks the fp8 leaves, builds the senders' quantize program and the inner plan over
    values, scales and the other leaves."""
    from jaxreshard import quant

    paths = [keystr(p) for p, _ in flat]
    problems, quantized, formats, avals = [], [], [], []
    inner_src, inner_dst, inner_dtype = [], [], []
    src_values, src_scales = [], []
    plain: list[tuple[tuple[Any, Any], Any, Any]] = []  # the other leaves, as the inner plan
    unfit: list[tuple[tuple[Any, Any], Any]] = []  # fp8 leaves failing any leaf's checks
    for i, ((_, x), dst, want, own) in enumerate(zip(flat, dsts, dtypes, named, strict=True)):
        if isinstance(want, Fp8Blockwise) and not own and not _blockable(x, want):
            want = None  # an entry for a subtree quantizes what it can; the rest keep theirs
        if not isinstance(want, Fp8Blockwise):
            inner_src.append(x)
            inner_dst.append(dst)
            # The inner plan gets a full dtype tree (every entry at its leaf): apply the
            # subtree rule here.
            takes = want is not None and (own or _floating(x))
            inner_dtype.append(want if takes else None)
            plain.append((flat[i], dst, inner_dtype[-1]))
            continue
        if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or not jnp.issubdtype(
            x.dtype, jnp.floating
        ):
            problems.append((paths[i], "is not a floating jax.Array (only those quantize)"))
            continue
        try:  # the leaf as any leaf first: a problem of its own is named with its own fix
            _leaf_spec(paths[i], x, dst, None, False)
        except _LeafProblem:
            unfit.append((flat[i], dst))
            continue
        if not isinstance(dst, NamedSharding) or not isinstance(x.sharding, NamedSharding):
            problems.append(
                (
                    paths[i],
                    "an fp8 leaf needs NamedSharding source and destination (one device: a "
                    "NamedSharding over a one-device Mesh)",
                )
            )
            continue
        shape = tuple(x.shape)
        why = quant.check_leaf(shape, want, dst)
        if (
            why is None
            and jax.process_count() > 1
            and quant.crosses_processes(shape, want, x.sharding)
        ):
            why = (
                "its scales combine values of source shards held by different processes (a "
                "per-tensor scale, or blocks straddling source shards): not supported under "
                "jax.distributed yet, the quantizer's collective would run outside the calls' "
                "order; give it a block size whose blocks each lie in one source shard"
            )
        if why:
            problems.append((paths[i], why))
            continue
        grid = want.scale_shape(shape)
        # The quantizer computes over the source's mesh: Manual and Explicit axes as Auto
        # ones (reviews: a block straddling shards over Manual axes failed inside JAX, and
        # every call of a leaf over Explicit axes, whose reshapes need an output sharding).
        on_mesh = boundary.as_auto(boundary.as_named(x.sharding, shape))
        s_src = quant.scale_sharding(on_mesh, shape, want)
        s_dst = quant.scale_sharding(dst, shape, want)
        values = jax.ShapeDtypeStruct(shape, want.fmt, sharding=on_mesh)
        scales = jax.ShapeDtypeStruct(grid, jnp.float32, sharding=s_src)
        inner_src.append(QuantizedArray(values, scales, want))
        inner_dst.append(QuantizedArray(dst, s_dst, want))
        inner_dtype.append(QuantizedArray(None, None, want))
        quantized.append(i)
        formats.append(want)
        avals.append((shape, x.dtype, x.sharding))
        src_values.append(on_mesh)
        src_scales.append(s_src)
    if problems or unfit:  # (with the other leaves' problems, which the inner plan would
        # name next)
        others = _checked_leaves(
            [f for f, _, _ in plain],
            [d for _, d, _ in plain],
            [w for _, _, w in plain],
            [True] * len(plain),
            options.get("fallback"),
        )
        own = _checked_leaves(  # (refused whatever the fallback: an fp8 entry names them)
            [f for f, _ in unfit],
            [d for _, d in unfit],
            [None] * len(unfit),
            [True] * len(unfit),
            None,
        )
        raise merged_error(
            [
                *([quant.refuse(problems)] if problems else []),
                *filter(None, [own.error, others.error]),
            ]
        )
    inner = plan(
        jax.tree_util.tree_unflatten(treedef, inner_src),
        jax.tree_util.tree_unflatten(treedef, inner_dst),
        dtype=jax.tree_util.tree_unflatten(treedef, inner_dtype),
        **options,
    )
    # Each fp8 leaf's values (at inner leaf i + the fp8 leaves before it: each adds its
    # scales) are compared across processes with the dtype they are quantized from.
    position = {leaf: k for k, leaf in enumerate(inner.moved)}
    for n, (i, (_, dtype, _)) in enumerate(zip(quantized, avals, strict=True)):
        if i + n in position:
            inner.quantized_from[position[i + n]] = str(jnp.dtype(dtype))
    quantizer = Quantizer(formats, src_values, src_scales)
    return QuantizedPlan(inner, treedef, paths, quantized, formats, avals, quantizer)


def _floating(x: Any) -> bool:
    """Whether leaf ``x`` is floating, as ``jax.device_put`` would make it (a NumPy array or a
    Python float under a fallback too): a dtype entry standing for a subtree casts it."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return _takes_cast(x.dtype, False)
    try:
        return _takes_cast(_host_dtype(x), False)
    except TypeError:  # (not a leaf jax.device_put takes: the checks name it)
        return False


def _blockable(x: Any, fmt: Fp8Blockwise) -> bool:
    """Whether an `Fp8Blockwise` entry standing for a subtree quantizes leaf ``x``: a
    floating array with at least the block's rank. Other leaves of the subtree (step counters,
    keys, norm scales and biases under a 2-D block) keep their dtype, as under an ordinary
    dtype's subtree entry; the entry at a leaf's own position refuses them instead."""
    return (
        isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
        and jnp.issubdtype(x.dtype, jnp.floating)
        and (fmt.block is None or len(x.shape) >= len(fmt.block))
    )


# ---------------------------------------------------------------------------- plan cache

_CACHE: collections.OrderedDict[Any, Plan] = collections.OrderedDict()
_CACHE_SIZE = 256
"""Plans `reshard` keeps (their compiled programs), the most recently used. Large enough for
a sync cut into many chunks, each a plan of its own (Tunix's ``reshard_chunk_size``): with
fewer plans than chunks, every sync would plan and compile every chunk again."""
_STAGING_PLANS = 8
"""Of those, the most recently used that keep their staging buffers between calls (up to
``stats.staging_bytes`` per device each); older ones free theirs, and allocate them again when
called. A sync cut into chunks to bound device memory would otherwise hold every chunk's."""
_CACHE_LOCK = threading.Lock()


def reshard(
    src_tree: Any,
    dst_shardings: Any,
    *,
    bucket_bytes: int | None = None,
    unit_buckets: int | None = None,
    dtype: Any = None,
    donate: Any = None,
    topology: Topology | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    fallback: str | None = None,
) -> Any:
    """Reshard ``src_tree`` into ``dst_shardings``; `plan` then call, with plans cached.

    Plans are cached by layout signature (tree structure, shapes, dtypes, shardings and
    options), so calling this every step plans and compiles only on the first call. See `plan`
    and `Plan.__call__` for the arguments.
    """
    try:
        found = cached_plan(
            src_tree,
            dst_shardings,
            bucket_bytes=bucket_bytes,
            unit_buckets=unit_buckets,
            dtype=dtype,
            topology=topology,
            compiler_options=compiler_options,
            fallback=fallback,
        )
    except ReshardError as e:
        refuse_unplanned(src_tree, dst_shardings, e)
        raise
    return found(src_tree, donate=donate)


def refuse_unplanned(src_tree: Any, dst_shardings: Any, error: ReshardError) -> None:
    """Under ``jax.distributed``, a `reshard` this process refused before it found a plan (a
    ``dst_shardings`` tree that does not fit the source, ...): the refusal takes the place of
    the event its peers make at this step, so that theirs raises naming the refusal, where it
    would pair with this process's next call and return another step's weights.

    Where a peer is seen waiting for this process, in a call or in a new plan's agreement,
    the refusal takes that place (`multihost.place_refusal`, which waits for one up to the
    agreement timeout; where every peer refused the step too, all place the lowest process's
    guess). Where none comes, it places its own guess: a call of the plan this process last
    used for a source laid out as ``src_tree`` (tree, shapes, dtypes, shardings), where the
    cache holds one, as if that plan had refused it (`Plan.refuse`), else the agreement round
    of the processes owning a device the two trees name, given up
    (`multihost.give_up_agreement`). Placed after the refits started before
    (their calls take their numbers first). A no-op in one process."""
    if jax.process_count() == 1:
        return
    source = _source_key(src_tree, "device_put")
    found = None
    if source is not None:
        with _CACHE_LOCK:
            found = next((p for k, p in reversed(_CACHE.items()) if k[:2] == source), None)
    named = [
        x if isinstance(x, Sharding) else getattr(x, "sharding", None)
        for tree in (src_tree, dst_shardings)
        for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Sharding))
    ]
    processes = {d.process_index for s in named if isinstance(s, Sharding) for d in s.device_set}
    reason = " ".join(str(error).splitlines()[:2])
    moving = None if found is None else _moving(found)

    def place(on_worker: bool) -> None:
        # Where a peer is seen waiting for this process, there; else the guess.
        identity = None if moving is None else moving.identity
        if place_refusal(processes, reason, identity):
            return
        if moving is not None:
            moving.refuse(error, on_worker=on_worker)  # (only where calls are checked in order)
        else:
            give_up_agreement(processes, reason)

    # After the refits started before, as their calls take their numbers first.
    if _IN_FLIGHT.busy():
        _submit(functools.partial(place, True)).result()
    else:
        place(False)


def cached_plan(
    src_tree: Any,
    dst_shardings: Any,
    *,
    bucket_bytes: int | None = None,
    unit_buckets: int | None = None,
    dtype: Any = None,
    topology: Topology | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    fallback: str | None = None,
) -> Plan:
    """The plan `reshard` uses for these arguments: from the cache, or made and cached.

    Same arguments as `plan`. Useful to read a cached plan's ``stats`` or ``describe()``.
    """
    _check_options(bucket_bytes, topology, compiler_options, fallback, unit_buckets)
    options = tuple(sorted((compiler_options or {}).items()))
    try:
        key = _cache_key(
            src_tree,
            dst_shardings,
            bucket_bytes,
            dtype,
            (topology, options, unit_buckets),
            fallback,
        )
    except (ValueError, TypeError):  # (checked only then: every jr.reshard call comes here)
        _check_flattenable(
            {"the source tree": src_tree, "dst_shardings": dst_shardings, "dtype=": dtype}
        )
        raise
    found, older = None, None
    if key is not None:
        with _CACHE_LOCK:
            found = _CACHE.get(key)
            if found is not None:
                _CACHE.move_to_end(key)
                _moving(found)._keep_staging = True
                older = _pushed_out_of_staging()
        if older is not None:
            older._free_staging_unless_kept()  # (not under the lock: it never waits for a call)
    if found is None:
        found = plan(
            src_tree,
            dst_shardings,
            bucket_bytes=bucket_bytes,
            unit_buckets=unit_buckets,
            dtype=dtype,
            topology=topology,
            compiler_options=compiler_options,
            fallback=fallback,
        )
        if key is not None:
            with _CACHE_LOCK:
                _CACHE[key] = found
                while len(_CACHE) > _CACHE_SIZE:
                    _CACHE.popitem(last=False)
                older = _pushed_out_of_staging()
            if older is not None:
                older._free_staging_unless_kept()
    return found


def _pushed_out_of_staging() -> Plan | None:
    """The plan that the last use pushed out of the `_STAGING_PLANS` most recently used (one
    use moves one plan out), marked so that its calls free their staging when done; called
    under `_CACHE_LOCK`, the staging freed by the caller after it (a call of that plan may
    be running: it frees its own when done, and the cache never waits for it)."""
    if len(_CACHE) <= _STAGING_PLANS:
        return None
    older = _moving(next(itertools.islice(reversed(_CACHE.values()), _STAGING_PLANS, None)))
    older._keep_staging = False
    return older


def _moving(found: Plan | QuantizedPlan) -> Plan:
    """The plan that moves the data (and holds the staging) of a cached plan."""
    return found.inner if isinstance(found, QuantizedPlan) else found


def clear_cache() -> None:
    """Forget every plan cached by `reshard` (and with them their compiled programs)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def _source_key(src_tree: Any, fallback: Any) -> tuple[Any, Any] | None:
    """The source's part of a `_cache_key`: ``(treedef, signature)``, or None where the
    source cannot key a plan (left for `plan` to report)."""
    leaves, treedef = jax.tree_util.tree_flatten(src_tree)
    arrays = (jax.Array, jax.ShapeDtypeStruct)
    if fallback is None and not all(isinstance(x, arrays) for x in leaves):
        return None  # let plan() report it
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None  # let plan() report it (a tracer has no .sharding to key by)
    try:  # fallback leaves (not arrays): their kind and shape are part of the signature
        signature = tuple(
            (x.shape, x.dtype, _placement_key(x.sharding, len(x.shape)))
            if isinstance(x, arrays)
            else (type(x), np.shape(x), np.result_type(x))
            for x in leaves
        )
        hash(signature)
    except (TypeError, ValueError):
        return None
    return treedef, signature


def _cache_key(
    src_tree: Any, dst: Any, bucket_bytes: Any, dtype: Any, options: Any, fallback: Any
) -> Any:
    source = _source_key(src_tree, fallback)
    if source is None:
        return None
    treedef, signature = source
    dst_leaves, dst_def = jax.tree_util.tree_flatten(dst, is_leaf=lambda x: isinstance(x, Sharding))
    dt_leaves, dt_def = jax.tree_util.tree_flatten(
        dtype, is_leaf=lambda x: x is None or _is_dtype_like(x)
    )
    try:
        key = (
            treedef,
            signature,
            dst_def,
            # Destinations as given, not `_placement_key`: the result carries the plan's
            # destination shardings, and JAX tells P("tp") and P("tp", None) apart.
            tuple(dst_leaves),
            dt_def,
            tuple(
                d if d is None or isinstance(d, Fp8Blockwise) else jnp.dtype(d) for d in dt_leaves
            ),
            bucket_bytes,
            options,
            fallback,
            # A plan's dtypes (a cast's, a fallback leaf's) are canonicalized when it is made.
            bool(jax.config.jax_enable_x64),
        )
        hash(key)
    except TypeError:
        return None
    return key


MAX_BUCKET_BYTES = 1 << 48
"""The largest ``bucket_bytes`` taken (256 TiB, beyond any device's memory): the planner sizes
chunks in 64-bit integer arrays."""


MAX_UNIT_BUCKETS = 1 << 20
"""The largest ``unit_buckets`` taken (far beyond what any plan spans)."""


def _not_a_count(value: Any, most: int) -> bool:
    """Whether ``value`` is given and is not an int from 1 to ``most`` (a bool is no count)."""
    return value is not None and (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or not 1 <= value <= most
    )


def _check_options(
    bucket_bytes: Any,
    topology: Any,
    compiler_options: Any,
    fallback: Any,
    unit_buckets: Any = None,
) -> None:
    """Refuse bad plan options before anything else looks at them."""
    if _not_a_count(unit_buckets, MAX_UNIT_BUCKETS):
        raise ReshardError(
            f"unit_buckets must be a positive int (a count of buckets) of at most 2**20, got "
            f"{unit_buckets!r}\nHow to fix: pass a count such as 32, or None for the backend's "
            "default"
        )
    if _not_a_count(bucket_bytes, MAX_BUCKET_BYTES):
        raise ReshardError(
            f"bucket_bytes must be a positive int (bytes) of at most 2**48, got "
            f"{bucket_bytes!r}\nHow to fix: pass a number of bytes such as 16 << 20, or None "
            "for the backend's default"
        )
    if topology is not None and not isinstance(topology, Topology):
        raise ReshardTypeError(
            f"topology must be a jaxreshard.Topology, got {type(topology).__name__} "
            f"{topology!r}\nHow to fix: build one with jr.Topology.from_devices(...) or "
            "jr.Topology(...), or leave topology out"
        )
    if compiler_options is not None and not isinstance(compiler_options, Mapping):
        raise ReshardTypeError(
            f"compiler_options must be a mapping of XLA option names to values, got "
            f"{type(compiler_options).__name__}\nHow to fix: pass a dict, as for jax.jit's "
            "compiler_options"
        )
    keys = [k for k in compiler_options or () if not isinstance(k, str)]
    if keys:
        raise ReshardTypeError(
            f"compiler_options must name XLA options by str, got the keys {keys!r}\nHow to "
            "fix: pass option names as strings, as for jax.jit's compiler_options"
        )
    if fallback not in (None, "device_put"):
        raise ReshardError(
            f'fallback must be None or "device_put", got {fallback!r}\nHow to fix: leave it '
            'out (a leaf jaxreshard cannot move is refused, naming it), or pass "device_put" '
            "to move such leaves with jax.device_put"
        )


def _placement_key(s: Any, ndim: int) -> Any:
    """A cache key for a source sharding, equal for shardings that place an array of rank
    ``ndim`` alike on the same devices in the same order: the test a plan's call applies
    (`Sharding.is_equivalent_to`), so a hit is always a plan that takes the source.
    ``P("fsdp", "tp", None)`` and ``P("fsdp", "tp")`` (optimizer steps turn one into the
    other), and one mesh under other axis names, are one key; JAX's own equality tells them
    apart."""
    try:
        return (s._to_xla_hlo_sharding(ndim), s._internal_device_list, s.memory_kind)
    except Exception:  # (not a sharding JAX can lay out at this rank: plan() reports it)
        return s


# ------------------------------------------------------------------------------- helpers


MAX_LEAF_BYTES = 1 << 62
"""The most bytes a leaf may hold: the plan counts byte offsets and sizes in int64 arrays."""


class _LeafProblem(Exception):
    def __init__(self, message: str, kind: str, device_put_ok: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        # A leaf jaxreshard cannot take but jax.device_put can (fallback="device_put").
        self.device_put_ok = device_put_ok


_FIXES = {
    "type": "pass jax.Array leaves (jax.device_put a NumPy array onto its mesh first, or plan "
    'with fallback="device_put") or jax.ShapeDtypeStruct(shape, dtype, '
    "sharding=NamedSharding(...)), and jax.sharding.Sharding destinations (NamedSharding, "
    "SingleDeviceSharding, ...)",
    "size": "plan such a leaf in parts (a ShapeDtypeStruct per slice), each under 2**62 bytes",
    "layout": "make every destination PartitionSpec fit the array: at most one entry per "
    "dimension, mesh axes of that mesh, and axis sizes whose product divides the dimension "
    "(or leave that dimension unsharded with None)",
    "source-layout": "give every source a sharding that fits its shape (JAX refuses arrays laid "
    "out otherwise; a jax.ShapeDtypeStruct takes any sharding unchecked): at most one entry per "
    "dimension, mesh axes of its mesh, and axis sizes whose product divides the dimension",
    "sharding": "give such leaves layouts jaxreshard moves (NamedSharding or "
    "SingleDeviceSharding, nothing reduced, unreduced or UNCONSTRAINED: see each reason), or, "
    'where the reason allows it, plan with fallback="device_put" to send them through '
    "jax.device_put",
    "sharding-only": "give such leaves layouts jaxreshard moves (NamedSharding or "
    "SingleDeviceSharding, nothing unreduced or UNCONSTRAINED: see each reason); "
    "jax.device_put does not move them either",
    "deleted": "pass arrays that are still alive: an array donated to jax.jit or to "
    "donate= is deleted; keep the source alive until the reshard returns",
    "dtype": "pass a NumPy/JAX dtype such as jnp.bfloat16, or None to keep the source dtype "
    "(typed PRNG keys and their subtrees take None)",
}


def _leaf_spec(path: str, x: Any, dst: Any, want: Any, own: bool) -> tuple[Any, Boundary, LeafSpec]:
    """Check one leaf and describe it: the caller's aval, how it crosses into the runtime,
    and what the planner moves (a typed key's data, in device memory, on a named mesh)."""
    if isinstance(x, jax.core.Tracer):
        raise _LeafProblem(
            "is a tracer: jaxreshard moves concrete arrays, call it outside jit", "type"
        )
    if isinstance(x, jax.Array):
        if x.is_deleted():
            raise _LeafProblem("the source array has been deleted", "deleted")
        sharding = x.sharding
    elif isinstance(x, jax.ShapeDtypeStruct):
        sharding = x.sharding
        if not isinstance(sharding, Sharding):
            raise _LeafProblem(
                "a ShapeDtypeStruct source needs sharding=NamedSharding(...)", "type"
            )
    else:
        raise _LeafProblem(
            f"the source is of type {type(x).__name__}, not a jax.Array", "type", device_put_ok=True
        )
    if isinstance(dst, PartitionSpec):
        raise _LeafProblem(
            f"the destination is a PartitionSpec {dst}, not a jax.sharding.Sharding: give it "
            "its mesh, NamedSharding(mesh, spec) (a spec of logical axis names, as "
            "nnx.get_partition_spec gives, needs its rules first: nnx.get_named_sharding(state, "
            "mesh) under nnx.logical_axis_rules(...))",
            "type",
        )
    if isinstance(dst, (jax.Array, jax.ShapeDtypeStruct)):
        raise _LeafProblem(
            f"the destination is of type {type(dst).__name__}, not a jax.sharding.Sharding: "
            "give its sharding (x.sharding)",
            "type",
        )
    if not isinstance(dst, Sharding):
        raise _LeafProblem(
            f"the destination is of type {type(dst).__name__}, not a jax.sharding.Sharding",
            "type",
        )
    for side, s in (("source", sharding), ("destination", dst)):
        if isinstance(s, NamedSharding) and isinstance(s.mesh, jax.sharding.AbstractMesh):
            raise _LeafProblem(
                f"the {side} sharding's mesh is an AbstractMesh, which has no devices: give "
                "it a jax.sharding.Mesh of devices",
                "type",
            )
        problem = _spec_problem(s) if isinstance(s, NamedSharding) else None
        if problem:
            reason, device_put_ok = problem
            raise _LeafProblem(
                f"the {side} sharding {reason}", "sharding", device_put_ok=device_put_ok
            )
    user_shape = tuple(x.shape)
    if math.prod(user_shape) * getattr(x.dtype, "itemsize", 1) >= MAX_LEAF_BYTES:
        raise _LeafProblem(
            f"has shape {user_shape}: at least 2**62 bytes, beyond the byte offsets a plan "
            "counts in (int64)",
            "size",
        )
    key_impl = None
    try:
        dst_named = boundary.as_named(dst, user_shape)
        if boundary.is_key(x.dtype):
            if want is not None and own:
                raise _LeafProblem(
                    f"is a typed PRNG key ({x.dtype}); it cannot be cast to {want!r}", "dtype"
                )
            try:  # against the key array's own shape, before the key data's extra dimension
                _layout(dst_named, user_shape)
            except LayoutError as e:
                raise _LeafProblem(
                    f"destination {_describe_sharding(dst_named)} does not fit shape "
                    f"{user_shape}: {e}",
                    "layout",
                ) from None
            # Keys move as their key data and are wrapped again (`run.boundary`).
            key_impl = jax.random.key_impl(x) if isinstance(x, jax.Array) else x.dtype._impl
            shape, src_dtype = boundary.key_data_shape(x)
            src_sharding = boundary.key_data_sharding(sharding)
            # The caller's own destination, not its named equivalent: the result is wrapped
            # into it, and a GSPMD tiling of the key's rank splits no key-data dimension.
            boundary.key_data_sharding(dst)
            dst_dtype, typed = src_dtype, False
        else:
            shape, src_dtype, src_sharding = user_shape, jnp.dtype(x.dtype), sharding
            dst_dtype = _cast(src_dtype, want, own)
            # A leaf that takes a dtype entry, even its own dtype, is strongly typed after, as
            # ``astype`` makes it.
            typed = _takes_entry(src_dtype, want, own)
    except LayoutError as e:
        raise _LeafProblem(
            f"cannot move this leaf's sharding: {e}", "sharding", device_put_ok=True
        ) from None
    try:
        src_layout = _layout(src_sharding, shape)
    except LayoutError as e:
        raise _LeafProblem(f"source layout: {e}", "source-layout") from None
    try:
        dst_layout = _layout(dst_named, shape)
    except LayoutError as e:
        raise _LeafProblem(
            f"destination {_describe_sharding(dst_named)} does not fit shape {shape}: {e}",
            "layout",
        ) from None
    leaf = LeafSpec(
        path, src_layout, dst_layout, src_dtype.name, dst_dtype.name, wire_itemsize(dst_dtype)
    )
    if isinstance(src_sharding, NamedSharding):
        # A source over Manual mesh axes is read as the same over Auto ones (a probe: the
        # pack program, traced over Manual axes, took each shard for the whole array).
        src_sharding = boundary.as_named(src_sharding, shape)
    edge = Boundary(
        key_impl,
        boundary.on_device_memory(src_sharding),
        boundary.on_device_memory(dst_named),
        sharding,
        dst,
        user_shape,
        weak_type=bool(getattr(x, "weak_type", False)) and not typed,
        casts=typed,
    )
    return (user_shape, x.dtype, sharding), edge, leaf


_FallbackAval = tuple[tuple[int, ...], Any, Any]
"""A fallback leaf's planned shape and dtype (as ``jax.device_put`` makes it) and the dtype
it is cast to, or None."""


def _shard_buffers(shape: tuple[int, ...], dtype: Any, s: Sharding) -> set[tuple[Any, ...]]:
    """What the buffers of an array of ``shape``, ``dtype`` and sharding ``s`` are, device by
    device: ``(dtype, shard shape, device id)`` (a typed key's: its key data's). Arrays whose
    sets are disjoint cannot share a buffer (`Plan._aliasing`)."""
    shard = s.shard_shape(shape)
    if boundary.is_key(dtype):  # its buffers hold its key data
        data, bits = boundary.key_data_shape(jax.ShapeDtypeStruct(shard, dtype))
        kind: tuple[Any, ...] = (bits, data)
    else:
        kind = (jnp.dtype(dtype), tuple(shard))
    return {(*kind, d.id) for d in s.device_set}


def _buffer_addresses(arrays: Sequence[Any]) -> set[tuple[int, int]]:
    """``(device id, address)`` of this process's buffers of the live arrays in ``arrays``."""
    return {
        (d, buf.unsafe_buffer_pointer())
        for x in arrays
        if isinstance(x, jax.Array) and not x.is_deleted()
        for d, buf in views.by_device(x).items()
    }


def _host_dtype(x: Any) -> Any:
    """The dtype ``jax.device_put(x)`` gives ``x`` (read from ``x.dtype`` where it has one:
    never from its data, which may be on a device)."""
    if isinstance(x, jax.Array):
        return x.dtype
    if isinstance(x, (str, bytes, type, np.dtype)):
        # (NumPy reads "f4", jnp.float32 or a dtype as the dtype they name: not values)
        raise TypeError(f"a {type(x).__name__} is not an array or a number")
    dtype = x.dtype if isinstance(x, (np.ndarray, np.generic)) else np.result_type(x)
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def device_put_problem(x: Any) -> str | None:
    """Why ``jax.device_put`` cannot take leaf ``x`` (None: it can), found without calling it:
    it would refuse a string, an object or an array of strings only when called."""
    if isinstance(x, np.ma.MaskedArray):  # (an ndarray, whose copy would drop the mask)
        return "a NumPy masked array: its mask would be lost; pass x.filled(value) instead"
    try:
        dtype = _host_dtype(x)
    except TypeError as e:
        return str(e)
    if not isinstance(x, jax.Array) and not _on_device(dtype):
        return f"arrays of dtype {dtype} cannot be on a device"
    if isinstance(x, (np.ndarray, np.generic)) and not x.dtype.isnative:
        return (
            f"dtype {x.dtype.str} is not in this machine's byte order: "
            "x.astype(x.dtype.newbyteorder('=')) first"
        )
    return None


def _fallback_aval(x: Any, dst: Sharding, want: Any, own: bool) -> _FallbackAval:
    """A fallback leaf's `_FallbackAval`, once its destination is known to fit it: checked
    when planning, so that a call never fails half way (its donated buffers gone)."""
    why = device_put_problem(x)
    if why:
        raise _LeafProblem(f"jax.device_put cannot take it either ({why})", "type")
    shape, dtype = tuple(np.shape(x)), _host_dtype(x)
    try:
        spec = dst.spec if isinstance(dst, NamedSharding) else None
        reduced = spec is not None and (spec.reduced or spec.unreduced)
        if spec is not None and not reduced:
            # (a spec longer than the rank: JAX's own check is a bare IndexError from inside
            # its sharding code; a spec with reduced axes JAX refuses to read that way)
            normalize_spec(spec, len(shape), tuple(dst.mesh.axis_names))
        dst.shard_shape(shape)
    except (LayoutError, ValueError) as e:
        raise _LeafProblem(f"through jax.device_put: {e}", "layout") from None
    # Cast wherever the leaf takes its entry, its own dtype included: ``astype`` makes a
    # weakly typed leaf strong, as a moved leaf's cast does.
    takes = _takes_entry(dtype, want, own)
    return shape, dtype, (_cast(dtype, want, own) if takes else None)


def _cast(src: np.dtype, want: Any, own: bool) -> np.dtype:
    """The destination dtype: ``want`` if the dtype entry stands at the leaf itself; if it
    stands for a whole subtree (one ``dtype=`` for the tree), only floating leaves take it, so
    integer, boolean and complex leaves such as step counters keep theirs."""
    if want is None:
        return src
    try:
        dtype = jax.dtypes.canonicalize_dtype(jnp.dtype(want))
    except TypeError as e:
        raise _LeafProblem(f"cannot use {want!r} as a destination dtype ({e})", "dtype") from None
    if not _on_device(dtype):
        raise _LeafProblem(
            f"cannot use {want!r} as a destination dtype: arrays of it cannot be on a device",
            "dtype",
        )
    return np.dtype(dtype) if _takes_cast(src, own) else src


def _takes_entry(src: Any, want: Any, own: bool) -> bool:
    """Whether a leaf of dtype ``src`` takes the ``dtype=`` entry ``want`` (`_cast`): its
    result is then ``astype``'s, strongly typed even where the dtype is its own."""
    return want is not None and _takes_cast(src, own)


def _on_device(dtype: Any) -> bool:
    """Whether arrays of ``dtype`` can be on a device (numbers and booleans; not NumPy's
    time deltas, which it counts as integers and JAX refuses)."""
    if getattr(dtype, "kind", None) in ("m", "M"):
        return False
    return bool(jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_))


def _takes_cast(src: Any, own: bool) -> bool:
    """Whether a leaf of dtype ``src`` takes its ``dtype=`` entry: always at its own position,
    only when floating for an entry standing for a subtree."""
    return own or bool(jnp.issubdtype(src, jnp.floating))


def _dtype_entries(dtype: Any, src_tree: Any) -> tuple[list[Any], list[bool]]:
    """Each leaf's ``dtype=`` entry, and whether the entry stands at the leaf itself (rather
    than for a subtree holding it)."""
    if dtype is None:
        n = len(jax.tree_util.tree_leaves(src_tree))
        return [None] * n, [False] * n
    pairs = _prefix_entries(dtype, src_tree, "dtype", lambda x: x is None or _is_dtype_like(x))
    return [value for value, _ in pairs], [own for _, own in pairs]


def _spec_problem(sharding: NamedSharding) -> tuple[str, bool] | None:
    """What makes a NamedSharding's spec name no layout jaxreshard moves, and whether
    ``jax.device_put`` moves it (``fallback="device_put"``); None when nothing does."""
    spec = sharding.spec
    if getattr(spec, "unreduced", None):
        return (
            f"has unreduced axes ({spec!r}): its shards are partial values of a sum still to "
            "be taken, not parts of the array; reduce first",
            False,  # jax.device_put copies unreduced only to unreduced, on the same devices
        )
    if getattr(spec, "reduced", None):
        return (
            f"has reduced axes ({spec!r}), which jaxreshard does not plan: the same spec "
            "without reduced= lays out the same values (or pass fallback='device_put')",
            True,
        )
    if any(entry is PartitionSpec.UNCONSTRAINED for entry in spec):
        return (
            f"has an UNCONSTRAINED entry ({spec!r}), which names no layout: say how that "
            "dimension is split (None: not split)",
            False,
        )
    return None


def _layout(sharding: Sharding, shape: tuple[int, ...]) -> Layout:
    # A NamedSharding whose devices JAX permutes (its private ``_logical_device_ids``) places
    # data other than its mesh and spec say: its layout comes from ``devices_indices_map``.
    if isinstance(sharding, NamedSharding) and boundary.logical_ids(sharding) is None:
        mesh = sharding.mesh
        if isinstance(mesh, jax.sharding.AbstractMesh):
            raise LayoutError(
                "the sharding's mesh is an AbstractMesh (it has no devices): use a "
                "jax.sharding.Mesh of devices"
            )
        spec = tuple(sharding.spec)
        return Layout.from_mesh(
            shape,
            mesh.devices.shape,
            mesh.axis_names,
            [d.id for d in mesh.devices.flat],
            spec,
            tuple(t.name for t in mesh.axis_types),
        )
    try:
        return Layout.from_sharding(sharding, shape)
    except (ValueError, TypeError) as e:
        raise LayoutError(str(e)) from None


def _describe_sharding(s: NamedSharding) -> str:
    mesh = dict(zip(s.mesh.axis_names, s.mesh.axis_sizes, strict=True))
    return f"NamedSharding(mesh={mesh}, spec={s.spec})"


def _array_problem(
    x: Any, shape: tuple[int, ...], dtype: Any, sharding: Sharding, placeholder_ok: bool = False
) -> str | None:
    # A process holding no shard of a source contributes nothing to it: a ShapeDtypeStruct
    # describing it will do (multi-controller JAX cannot build such arrays on every process).
    if placeholder_ok and isinstance(x, jax.ShapeDtypeStruct):
        if x.sharding is None:
            return "a ShapeDtypeStruct standing for a source needs its planned sharding="
    elif not isinstance(x, jax.Array):
        return f"expected a jax.Array, got {type(x).__name__}"
    elif x.is_deleted():
        return "the array has been deleted"
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
        want, got = _dtype_name(dtype), _dtype_name(x.dtype)
        return f"expected {want}{list(shape)}, got {got}{list(x.shape)}"
    if x.sharding != sharding and not x.sharding.is_equivalent_to(sharding, len(shape)):
        want, got = str(sharding), str(x.sharding)
        if want == got:  # the same text: the meshes differ in their devices' order
            want += f" on devices {_device_ids(sharding)}"
            got += f" on devices {_device_ids(x.sharding)}"
        return f"expected sharding {want}, got {got}"
    return None


def _device_ids(sharding: Sharding) -> list[int]:
    """A sharding's devices in its mesh's order (where it has one), as ids."""
    mesh = getattr(sharding, "mesh", None)
    devices = getattr(mesh, "devices", None)
    if devices is not None:
        return [int(d.id) for d in np.asarray(devices).flat]
    return sorted(d.id for d in sharding.device_set)


def _dtype_name(dtype: Any) -> str:
    return str(dtype) if boundary.is_key(dtype) else jnp.dtype(dtype).name


def _is_dtype_like(x: Any) -> bool:
    """A dtype leaf of a ``dtype=`` tree: a dtype, a scalar type such as jnp.bfloat16, a name,
    or an `Fp8Blockwise` format."""
    return isinstance(x, (str, np.dtype, type, Fp8Blockwise))


def _broadcast(prefix: Any, full: Any, name: str, is_leaf: Callable[[Any], bool]) -> list[Any]:
    """Broadcast a tree prefix onto ``full``'s leaves, as jax.jit does for ``out_shardings``."""
    return [value for value, _ in _prefix_entries(prefix, full, name, is_leaf)]


def _prefix_entries(
    prefix: Any, full: Any, name: str, is_leaf: Callable[[Any], bool]
) -> list[tuple[Any, bool]]:
    """For each leaf of ``full``: the entry of the tree prefix that stands for it, and whether
    that entry stands at the leaf itself (rather than for a subtree holding it)."""
    prefix_leaves, prefix_def = jax.tree_util.tree_flatten(prefix, is_leaf=is_leaf)
    try:
        subtrees = prefix_def.flatten_up_to(full)
    except (ValueError, TypeError):
        expected = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(full)[0]]
        got = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(prefix, is_leaf)[0]]
        if sorted(got) == sorted(expected) and len(set(got)) == len(got):
            # The same leaves at the same paths, in nodes of other metadata (a sampler's
            # nnx.State beside the trainer's, whose Params carry other sharding annotations;
            # a dict beside an OrderedDict of another key order): each entry stands for the
            # leaf at its path.
            at = dict(zip(got, prefix_leaves, strict=True))
            return [(at[path], True) for path in expected]
        raise _structure_error(
            name, prefix, expected, is_leaf, reference=full, none_ok=is_leaf(None)
        ) from None
    out = []
    for value, sub in zip(prefix_leaves, subtrees, strict=True):
        leaves, structure = jax.tree_util.tree_flatten(sub)
        at_leaf = jax.tree_util.treedef_is_leaf(structure)
        out.extend([(value, at_leaf)] * len(leaves))
    return out


def _structure_error(
    name: str,
    tree: Any,
    expected_paths: Sequence[str],
    is_leaf: Callable[[Any], bool] | None = None,
    *,
    planned: bool = False,
    reference: Any = None,
    none_ok: bool = False,
) -> ReshardError:
    """``tree`` against the source tree's leaves (``planned``: a call's tree against the tree
    the plan was made for). With ``is_leaf`` a leaf of ``tree`` may stand for a whole subtree
    (a prefix tree), so it is wrong only where it covers no leaf of the source. ``reference``
    (a tree of the reference structure) locates a difference in the nodes themselves.
    ``none_ok``: a None entry is a value (a ``dtype=`` tree's "keep"), right or wrong where
    any other entry would be."""
    what = "the tree the plan was made for" if planned else "the source tree"
    flat = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is None or (is_leaf is not None and is_leaf(x))
    )[0]
    got = [keystr(p) for p, x in flat if x is not None or none_ok]
    nones = [keystr(p) for p, x in flat if x is None and not none_ok]
    # Each path that covers some expected leaf (the leaf's own, or an ancestor's), with how
    # many it covers: an entry of ``tree`` is right exactly where it covers one.
    covering = collections.Counter(a for p in expected_paths for a in _ancestors(p))
    problems = []
    for path in nones:
        if covering[path]:
            leaves = "a leaf" if covering[path] == 1 else f"{covering[path]} leaves"
            problems.append((path, f"None here, where {what} has {leaves}"))
    entries = {*got, *nones}
    missing = [p for p in expected_paths if entries.isdisjoint(_ancestors(p))]
    extra = [g for g in got if g not in covering]
    wrapped = bool(missing) and sorted(extra) == sorted(p + ".value" for p in missing)
    # The other way round: plain entries at the paths of the source's nnx Variables (an
    # nnx.State source, shardings as its pure dict); they cover its leaves, so none is missing.
    unwrapped = (
        not missing
        and not extra
        and bool(expected_paths)
        and all(p.endswith(".value") for p in expected_paths)
        and sorted(got) == sorted(p.removesuffix(".value") for p in expected_paths)
    )
    said_once = unwrapped and not problems
    if said_once:
        n = len(got)
        problems = [(
            got[0] + (f" and {n - 1} more" if n > 1 else ""),
            f"{name} holds plain leaves where {what} holds nnx Variables (at "
            f"{got[0]}.value: the only difference)",
        )]  # fmt: skip
    if wrapped and not problems:
        # Only an nnx Variable level between them (an nnx.State against its pure dict): said
        # once, with the fix, rather than every leaf twice.
        n = len(missing)
        problems = [(
            missing[0] + (f" and {n - 1} more" if n > 1 else ""),
            f"at {missing[0]}.value here: {name} holds nnx Variables where {what} holds "
            "plain leaves (the only difference)",
        )]  # fmt: skip
    else:
        problems += [(p, "missing here") for p in missing]
        problems += [(p, f"not in {what}") for p in extra]
    if is_leaf is None and not said_once:  # not a prefix tree: a leaf standing where a
        # subtree should be (each plain leaf in place of its Variable is said once above)
        wanted = set(expected_paths)
        for path, x in ((keystr(p), x) for p, x in flat if x is not None):
            if path not in wanted and covering[path]:
                n = covering[path]
                problems.append((
                    path or "<root>",
                    f"a leaf ({type(x).__name__}) here, where {what} has "
                    + ("a leaf below" if n == 1 else f"{n} leaves below"),
                ))  # fmt: skip
    if not problems:
        where = None if reference is None else _first_difference(tree, reference, is_leaf)
        if where is None:
            structure = jax.tree_util.tree_structure(tree, is_leaf=is_leaf)
            problems = [("<root>", f"same leaves, other structure: {structure}")]
        else:
            path, here, there = where
            problems = [(path or "<root>", f"a node {here} where {what} has {there}")]
    fix = (
        f"give {name} the structure of {what}, or make a new plan for this tree "
        "(jr.reshard makes and caches plans)"
        if planned
        else f"give {name} the same structure as the source tree (a NamedSharding or dtype may "
        "also stand for a whole subtree, as with jax.jit's out_shardings)"
    )
    if wrapped:
        fix = (
            f"pass {name} as a pure dict (state.to_pure_dict()), as the plan was made for, or "
            "make a plan for the nnx.State"
            if planned
            else f"make both plain or both nnx.State: pass {name} as a pure dict "
            "(state.to_pure_dict() of an nnx.State), or the source as the nnx.State itself"
        )
    if unwrapped:
        fix = (
            f"pass {name} as the nnx.State the plan was made for, not its pure dict, or make "
            "a plan for the pure dict (jr.plan(state.to_pure_dict(), ...))"
            if planned
            else f"make both plain or both nnx.State: pass {name} as an nnx.State (as "
            "nnx.get_named_sharding(state, mesh) gives it), or the source as a pure dict "
            "(state.to_pure_dict())"
        )
    hint = _nnx_hint(tree, reference)
    if hint:
        fix = f"{hint}; or {fix}"
    return leaf_error(f"{name} does not match the structure of {what}", problems, fix)


def _nnx_hint(*trees: Any) -> str | None:
    """What to pass instead where one of ``trees`` is a Flax NNX module, or what
    ``nnx.split`` returns, rather than a state: the usual mistake behind a structure
    mismatch of NNX trees (checked only where Flax is already imported)."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return None
    parts = [x for tree in trees for x in (tree if isinstance(tree, tuple) else (tree,))]
    if any(isinstance(x, nnx.Module) for x in parts):
        return (
            "an nnx Module stands where its state should: pass nnx.state(model) (and "
            "nnx.update(model, result) after), with shardings of the same structure "
            "(nnx.get_named_sharding(nnx.state(model), mesh))"
        )
    if any(isinstance(x, nnx.GraphDef) for x in parts):
        return "an nnx GraphDef (what nnx.split returns) stands in a tree: pass the State alone"
    return None


def _ancestors(path: str) -> set[str]:
    """The key path ``path`` (as `keystr` writes it) and each of its ancestors' (the root's,
    "", included): every entry of a prefix tree that would stand for it."""
    return {path[:i] for i, c in enumerate(path) if c in "[."} | {path}


def _shaped(treedef: Any) -> Any:
    """A tree of ``treedef``'s structure (zeros for leaves), to compare a call's tree with."""
    return jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)


def _first_difference(
    tree: Any, reference: Any, is_leaf: Callable[[Any], bool] | None = None, path: str = ""
) -> tuple[str, str, str] | None:
    """The first node (by key path) where ``tree`` and ``reference`` differ in type or
    metadata: its path, and each side's node (children elided), or None. A leaf of ``tree``
    (``is_leaf``: an entry of a prefix tree) stands for whatever ``reference`` has there."""
    if (is_leaf is not None and is_leaf(tree)) or jax.tree_util.treedef_is_leaf(
        jax.tree_util.tree_structure(tree)
    ):
        return None

    def level(x: Any) -> tuple[Any, list[tuple[Any, Any]]]:
        """``x``'s own node, with its children as leaves, and its children by key."""

        def below(y: Any) -> bool:
            return y is not x

        children = jax.tree_util.tree_flatten_with_path(x, is_leaf=below)[0]
        return jax.tree_util.tree_structure(x, is_leaf=below), children

    mine, children = level(tree)
    theirs, ref_children = level(reference)
    if mine != theirs:
        return path, _short(mine), _short(theirs)
    for (key, child), (_, ref_child) in zip(children, ref_children, strict=True):
        found = _first_difference(child, ref_child, is_leaf, path + keystr(key))
        if found is not None:
            return found
    return None


def _short(treedef: Any, limit: int = 160) -> str:
    text = str(treedef)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plan_devices(dsts: Sequence[NamedSharding], avals: Sequence[Any]) -> list[Any]:
    """Every device of the plan's source and destination shardings, by id."""
    devices = {d.id: d for s in dsts for d in s.device_set}
    for _, _, sharding in avals:
        devices.update({d.id: d for d in sharding.device_set})
    return [devices[i] for i in sorted(devices)]


def _describe_devices(sharding: Any, devices: Sequence[int]) -> str:
    ids = list(devices)
    shown = ", ".join(map(str, ids[:16])) + (f", ... ({len(ids)} devices)" if len(ids) > 16 else "")
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and hasattr(mesh, "axis_names"):
        axes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
        return f"NamedSharding(mesh={axes}, devices=[{shown}], spec={sharding.spec})"
    return f"{type(sharding).__name__}(devices=[{shown}])"


def _b(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
