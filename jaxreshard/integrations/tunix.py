"""Drop-in weight sync for Tunix (``google-tunix``).

Tunix routes every weight sync through one function, ``tunix.rl.reshard.reshard_pytree``:
``RLCluster.sync_weights`` -> ``rollout.update_params``, the vLLM and sglang-jax samplers'
``transfer_state_with_mappings``, model loading. Each call site looks it up as a module
attribute when it runs, so replacing that attribute is the whole integration::

    from jaxreshard.integrations import tunix as jr_tunix

    jr_tunix.install()          # every Tunix weight sync now goes through jaxreshard
    ...
    jr_tunix.uninstall()        # back to Tunix's own path

    with jr_tunix.installed():  # or for a block
        rl_cluster.sync_weights()

Plans are cached by layout (`jaxreshard.reshard`), so a refit loop plans and compiles on its
first sync only (a sync Tunix cuts into chunks, ``reshard_chunk_size``, makes a plan per
chunk: the cache keeps 256). Leaves jaxreshard cannot take (NumPy arrays, Python scalars) go through
``jax.device_put``, named in a log line; ``install(fallback=None)`` refuses them instead.

Importing this module does not import Tunix; `install` does.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import Sharding

from jaxreshard import api
from jaxreshard.errors import ReshardError, ReshardTypeError, leaf_error

__all__ = [
    "ReshardError",
    "ReshardTypeError",
    "counters",
    "install",
    "installed",
    "is_installed",
    "reset_counters",
    "reshard_pytree",
    "uninstall",
]

_LOCK = threading.Lock()
_ORIGINAL: Any = None  # Tunix's own reshard_pytree while installed
_FALLBACK: str | None = "device_put"
_DONATE_TARGET = False
_COUNTERS: collections.Counter[str] = collections.Counter()


def reshard_pytree(
    source: Any,
    target: Any,
    cache_plan: bool = True,
    donate_input: bool = False,
    use_experimental_pre_reshard: bool = True,
) -> Any:
    """Tunix's ``reshard_pytree``, through jaxreshard.

    Args:
      source: the pytree to move (an ``nnx.State``, nested dicts, ...).
      target: the same structure (or a prefix of it, as ``jax.device_put`` takes), with a
        ``jax.Array`` (its sharding, memory kind included, is the destination), a
        ``jax.ShapeDtypeStruct`` with a sharding, or a ``jax.sharding.Sharding`` at each leaf.
      cache_plan: reuse the plan (and its compiled programs) of an earlier call with the same
        layouts; False plans and compiles on every call.
      donate_input: the source is not used again: its arrays are deleted once moved (as
        ``jax.device_put(..., donate=True)`` consumes them on Tunix's path).
      use_experimental_pre_reshard: accepted and ignored (a Pathways option).

    Returns:
      ``source`` in the target layout. Floating leaves keep their dtype (Tunix casts on the
      rollout side where it needs to).

    Raises:
      ReshardError: before anything moves, naming each leaf jaxreshard cannot move.
    """
    del use_experimental_pre_reshard
    with _LOCK:
        _COUNTERS["calls"] += 1
    try:
        plan, dst, kept, moving, host, old = _planned(source, target, cache_plan)
        # Kept leaves are made first (their host values through jax.device_put): one that
        # fails fails before anything moves or is donated (a review: under Tunix's transfer
        # guard it failed after the move, the donated target lost).
        staying = _kept_values(dst, source) if kept else None
    except ReshardError as e:
        # Refused before a plan was called (a target leaf with no sharding, ...): under
        # jax.distributed the peers' same sync must raise too, not pair with this process's
        # next one (`jaxreshard.api.refuse_unplanned`). A plan's call places its own.
        api.refuse_unplanned(source, target, e)
        raise
    out = _run(plan, moving, old)
    if kept:
        out = _with_kept(dst, out, staying)
    with _LOCK:
        if plan.moved:
            _COUNTERS["jaxreshard_calls"] += 1
        if plan.fallback or host:
            _COUNTERS["fallback_calls"] += 1
            _COUNTERS["fallback_leaves"] += len(plan.fallback) + len(host)
    if donate_input:
        # The leaves left where they are are the result's own, so is an array that is both
        # kept and moved (one array at two paths): those stay.
        own = _addresses(out)
        for x in jax.tree_util.tree_leaves(moving):
            if isinstance(x, jax.Array) and not x.is_deleted() and own.isdisjoint(_addresses(x)):
                x.delete()
    return out


def _planned(
    source: Any, target: Any, cache_plan: bool
) -> tuple[api.Plan, Any, bool, Any, list[tuple[str, Any]], Any]:
    """What a sync moves, and its plan: ``(plan, destinations, kept, the moving part of the
    source, host leaves under a None target, the target's arrays to donate or None)``."""
    flat = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_target_leaf)[0]
    dst, kept = _destinations(source, target, flat)
    # A None target leaf leaves its source subtree where it is, as ``jax.device_put`` (Tunix's
    # path) does: it is taken out of what moves (None in both trees) and put back after. A
    # target that does not fit the source goes to `jr.plan` as it is, which names the misfit.
    moving = _without_kept(dst, source) if kept else source
    host = _kept_host_leaves(dst, source) if kept else []
    if host and _FALLBACK is None:
        raise leaf_error(
            "these leaves under a None target are not jax.Arrays (Tunix's path makes arrays "
            "of them with jax.device_put)",
            [(path, f"is a {type(x).__name__}") for path, x in host],
            "make them jax.Arrays, or install(fallback='device_put') to send them through "
            "jax.device_put",
            cls=ReshardTypeError,
        )
    unfit = [(path, why) for path, x in host if (why := api.device_put_problem(x))]
    if unfit:  # (Tunix's path fails on them too, but after moving the rest)
        raise leaf_error(
            "jax.device_put cannot take these leaves under a None target",
            unfit,
            "make them arrays or numbers, or leave them out of the synced tree",
            cls=ReshardTypeError,
        )
    old = _old_buffers(moving, flat) if _DONATE_TARGET else None
    if old is not None and not _addresses(old).isdisjoint(_addresses(source)):
        # A target array over a source array's buffers (a kept one, which `jr.plan` does not
        # see, included): the result would lose it. Not donated (the call moves as usual).
        old = None
    return _plan(moving, dst, cache_plan), dst, kept, moving, host, old


def install(*, fallback: str | None = "device_put", donate_target: bool = False) -> None:
    """Route Tunix's weight sync through jaxreshard (patches ``tunix.rl.reshard``).

    Args:
      fallback: ``"device_put"`` (default): leaves jaxreshard cannot take (NumPy arrays,
        Python scalars) go through ``jax.device_put``, named in a log line. None: refuse them
        (a `ReshardError` naming them).
      donate_target: reuse the target arrays' buffers for the result (they are deleted). Only
        for callers that replace the target with the result, as Tunix's vanilla rollout does
        in ``update_params``; it then holds one sampler copy instead of two during a sync.
        Targets that cannot receive the result (another dtype, shardings instead of arrays)
        are left alone.

    Calling it again changes the options; the original is kept once. Bad options are
    refused here (`ReshardError`), not at the first sync.
    """
    _check_install_options(fallback, donate_target)
    from tunix.rl import reshard as tunix_reshard  # imported only here

    global _ORIGINAL, _FALLBACK, _DONATE_TARGET
    with _LOCK:
        _FALLBACK, _DONATE_TARGET = fallback, donate_target
        if _ORIGINAL is None:
            _ORIGINAL = tunix_reshard.reshard_pytree
        tunix_reshard.reshard_pytree = reshard_pytree


def uninstall() -> None:
    """Restore Tunix's own ``reshard_pytree`` (a no-op when not installed)."""
    global _ORIGINAL
    with _LOCK:
        if _ORIGINAL is None:
            return
        from tunix.rl import reshard as tunix_reshard

        tunix_reshard.reshard_pytree = _ORIGINAL
        _ORIGINAL = None


def is_installed() -> bool:
    """Whether Tunix's weight sync currently goes through jaxreshard."""
    return _ORIGINAL is not None


@contextlib.contextmanager
def installed(
    *, fallback: str | None = "device_put", donate_target: bool = False
) -> Iterator[None]:
    """`install` for a block, then restore what was in force before it: Tunix's own
    function, or jaxreshard with the options it had. The options are the process's (every
    thread's calls take them while the block runs)."""
    global _FALLBACK, _DONATE_TARGET
    with _LOCK:
        was, options = is_installed(), (_FALLBACK, _DONATE_TARGET)
    install(fallback=fallback, donate_target=donate_target)
    try:
        yield
    finally:
        with _LOCK:  # the options in force before the block, back (they are also what a
            _FALLBACK, _DONATE_TARGET = options  # direct call of reshard_pytree takes)
        if not was:
            uninstall()


def _check_install_options(fallback: Any, donate_target: Any) -> None:
    api._check_options(None, None, None, fallback)
    if not isinstance(donate_target, bool):
        raise ReshardError(
            f"donate_target must be True or False, got {donate_target!r}\nHow to fix: pass "
            "donate_target=True to reuse the target arrays' buffers for the result, or leave "
            "it out"
        )


def counters() -> dict[str, int]:
    """Calls so far: ``calls`` (all, refused ones included), ``jaxreshard_calls`` (with a leaf
    moved by jaxreshard), ``fallback_calls`` (with a leaf sent by ``jax.device_put``) and
    ``fallback_leaves``."""
    with _LOCK:
        return {
            k: _COUNTERS[k]
            for k in ("calls", "jaxreshard_calls", "fallback_calls", "fallback_leaves")
        }


def reset_counters() -> None:
    """Set every counter of `counters` to zero."""
    with _LOCK:
        _COUNTERS.clear()


# ------------------------------------------------------------------------------- helpers


def _is_target_leaf(x: Any) -> bool:
    """A target leaf: a destination, or None (the source subtree there stays where it is)."""
    return x is None or isinstance(x, (Sharding, jax.Array, jax.ShapeDtypeStruct))


def _is_kept(x: Any) -> bool:
    return x is None


def _is_prefix(prefix: Any, tree: Any) -> bool:
    """Whether ``prefix`` (shardings, or None, at its leaves) is a prefix of ``tree``'s
    structure, node types included (as ``jax.device_put`` broadcasts a sharding over a
    subtree)."""
    try:
        jax.tree_util.tree_map(lambda _p, _t: None, prefix, tree, is_leaf=_is_kept)
    except (ValueError, TypeError):
        return False
    return True


def _without_kept(dst: Any, source: Any) -> Any:
    """``source`` with each subtree whose destination is None replaced by None."""
    return jax.tree_util.tree_map(
        lambda d, s: None if d is None else s, dst, source, is_leaf=_is_kept
    )


def _kept_values(dst: Any, source: Any) -> Any:
    """``dst`` with each None destination replaced by the source subtree the result keeps
    there: its arrays as they are, other leaves (`_kept_host_leaves`) through
    ``jax.device_put`` as Tunix's path (``jax.device_put(x, None)``) gives them. Raises
    `ReshardError` naming the leaves ``jax.device_put`` refuses (under the caller's transfer
    guard, say)."""
    problems: list[tuple[str, str]] = []

    def put(path: Any, x: Any) -> Any:
        if isinstance(x, jax.Array):
            return x
        try:
            return jax.device_put(x)
        except Exception as e:  # (named below, before anything moves)
            problems.append((jax.tree_util.keystr(path), str(e).splitlines()[0]))
            return None

    def kept(path: Any, subtree: Any) -> Any:
        if all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(subtree)):
            return subtree  # (the very object: an nnx.Variable stays the one passed)
        return jax.tree_util.tree_map_with_path(lambda p, x: put((*path, *p), x), subtree)

    values = jax.tree_util.tree_map_with_path(
        lambda path, d, s: kept(path, s) if d is None else None, dst, source, is_leaf=_is_kept
    )
    if problems:
        raise leaf_error(
            "jax.device_put refused these leaves under a None target",
            problems,
            "make them jax.Arrays where they should stay, or call under a transfer guard "
            "that lets jax.device_put place them (Tunix's path puts them with it too)",
        )
    return values


def _with_kept(dst: Any, out: Any, staying: Any) -> Any:
    """``out`` with each subtree whose destination is None taken from ``staying``
    (`_kept_values`)."""
    return jax.tree_util.tree_map(
        lambda d, o, k: k if d is None else o, dst, out, staying, is_leaf=_is_kept
    )


def _kept_host_leaves(dst: Any, source: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of the source's leaves under a None destination that are not
    ``jax.Array``s (NumPy arrays, Python scalars): fallback leaves, as where a target moves."""
    kept = jax.tree_util.tree_map(
        lambda d, s: s if d is None else None, dst, source, is_leaf=_is_kept
    )
    return [
        (jax.tree_util.keystr(path), x)
        for path, x in jax.tree_util.tree_flatten_with_path(kept)[0]
        if not isinstance(x, jax.Array)
    ]


def _on_source_structure(source: Any, flat: list[tuple[Any, Any]]) -> Any:
    """The target's ``(path, leaf)`` pairs laid onto the source's tree structure, or None
    when their counts differ.

    Raises:
      ReshardError: when the counts agree but the keys do not (the leaves would land on the
        wrong source leaves).
    """
    # A None in the source counts as a leaf, as it does in the target (`_is_target_leaf`):
    # both models' states hold None where a layer has no bias, say.
    source_flat, structure = jax.tree_util.tree_flatten_with_path(source, is_leaf=_is_kept)
    if len(source_flat) != len(flat):
        return None
    names = [_names(p) for p, _ in source_flat]
    by_name = {_names(p): x for p, x in flat}
    if names != [_names(p) for p, _ in flat] and len(by_name) == len(flat) == len(set(names)):
        if by_name.keys() == set(names):  # the same keys in another order (an OrderedDict)
            return jax.tree_util.tree_unflatten(structure, [by_name[n] for n in names])
    differ = [
        (jax.tree_util.keystr(sp), f"the target has {jax.tree_util.keystr(tp)} here")
        for (sp, _), (tp, _) in zip(source_flat, flat, strict=True)
        if _names(sp) != _names(tp)
    ]
    if differ:
        raise leaf_error(
            "reshard_pytree: the target's keys are not the source's",
            differ,
            "give the target the source's keys (the same model's state, as Tunix's "
            "reshard_pytree requires)",
        )
    return jax.tree_util.tree_unflatten(structure, [x for _, x in flat])


def _names(path: Any) -> tuple[Any, ...]:
    """A key path's names, whatever kind of node holds each (dict, attribute, sequence):
    two models' states may be different node types with the same keys."""
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def _destinations(source: Any, target: Any, flat: list[tuple[Any, Any]]) -> tuple[Any, bool]:
    """The target's shardings, in the source's tree structure, and whether they fit it (a
    target that fits neither way is returned as it is, for `jr.plan` to refuse).

    A target whose structure is a prefix of the source's is used as one, as ``jax.device_put``
    does. Else, Tunix builds source and target from two models (``nnx.state`` of each), whose
    tree nodes may carry different metadata; leaf for leaf they correspond, so the target's
    leaves are laid onto the source's structure when their counts agree.
    """
    problems, shardings = [], []
    for path, x in flat:
        if x is None or isinstance(x, Sharding):
            shardings.append(x)
        elif isinstance(getattr(x, "sharding", None), Sharding):
            # An array (a deleted one still has its sharding), or a ShapeDtypeStruct with one.
            shardings.append(x.sharding)
        else:
            problems.append(
                (jax.tree_util.keystr(path), f"is a {type(x).__name__}, with no sharding")
            )
    if problems:
        raise leaf_error(
            "reshard_pytree: these target leaves give no destination",
            problems,
            "give each target leaf a jax.Array, a jax.sharding.Sharding or a "
            "jax.ShapeDtypeStruct with a sharding",
            cls=ReshardTypeError,
        )
    prefix = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(target, is_leaf=_is_target_leaf), shardings
    )
    if _is_prefix(prefix, source):
        return prefix, True
    laid = _on_source_structure(source, [(p, x) for (p, _), x in zip(flat, shardings, strict=True)])
    return (prefix, False) if laid is None else (laid, True)


def _old_buffers(source: Any, flat: list[tuple[Any, Any]]) -> Any:
    """The target's arrays (``flat``: path, leaf) in the source's structure, to donate (None
    where the target keeps the source's leaf: ``source`` holds None there too); None if any
    other is not a live array."""
    arrays = [x for _, x in flat if x is not None]
    if not arrays or not all(isinstance(x, jax.Array) and not x.is_deleted() for x in arrays):
        return None
    try:
        return _on_source_structure(source, flat)
    except ReshardError:  # a prefix (`_destinations` took it): no array per source leaf
        return None


def _addresses(tree: Any) -> set[tuple[int, int]]:
    """``(device id, address)`` of this process's buffers of the live arrays in ``tree``."""
    return api._buffer_addresses(jax.tree_util.tree_leaves(tree))


def _plan(source: Any, dst: Any, cache_plan: bool) -> api.Plan:
    if cache_plan:
        return api.cached_plan(source, dst, fallback=_FALLBACK)
    return api.plan(source, dst, fallback=_FALLBACK)


def _run(plan: api.Plan, source: Any, old: Any) -> Any:
    if old is not None:
        try:
            return plan(source, donate=old)
        except ReshardError:  # the target cannot receive the result: refused before any move
            pass
    return plan(source)
