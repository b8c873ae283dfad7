"""Multi-controller JAX: plan fingerprints and plan agreement.

Under ``jax.distributed`` every process runs its own copy of the program. jaxreshard's transfers
are collectives over the devices of several processes, so every process whose devices take part
must derive the same schedule and issue the same programs in the same order; a process that
planned something else would wait forever in a collective that never completes.

This module makes that failure loud instead of silent:

- `fingerprint` hashes the pure data of a plan (leaves with their layouts and dtypes, the
  assignment, the schedule, the bucket size). It uses integer device ids and a canonical text
  form of frozen dataclasses and tuples, so it does not depend on dict order, hash seeds, object
  identities or the order in which a process enumerates its devices.
- `agree` runs before the first transfer of a plan: each involved process publishes its
  fingerprint in the ``jax.distributed`` key-value store and reads the others'. Equal
  fingerprints: the transfer proceeds. A different fingerprint, or a peer blocked in the agreement
  of another plan that involves this process (plans made in different orders, or over different
  devices), raises `ReshardError` on every process within a poll interval, naming the first leaf
  (by path) whose description differs. A peer that never arrives raises after
  `agreement_timeout_s` seconds.

Only the key-value store of the distributed runtime is used (no collective, no device memory),
so the same code serves the CPU backend (gloo) and GPUs (NCCL).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from jaxreshard.errors import ReshardError
from jaxreshard.planning.route import LeafSpec

FORMAT = "jaxreshard-plan-v2"
"""Version tag hashed into every fingerprint: plans of different library versions never agree."""

DEFAULT_AGREEMENT_TIMEOUT_S = 300.0
"""How long a process waits for peers that have not yet reached a plan's first call.

Peers normally arrive within a step; a mismatch is detected as soon as the peer arrives (or is
seen waiting elsewhere), so this bounds only the case of a peer that never calls the plan.
Override with the ``JAXRESHARD_AGREEMENT_TIMEOUT_S`` environment variable.
"""

_PREFIX = "jaxreshard/agree"
REFUSAL_GRACE_S = 5.0
"""How long a call refused before its plan (`place_refusal`) still waits for a peer's event
once a peer of its group is seen refusing now at another step (trees that name other
processes): instead of the whole agreement timeout."""
_POLL_S = (0.001, 0.25)  # first and largest sleep between polls of the key-value store


# ------------------------------------------------------------------------------ fingerprints


def _canonical(x: Any, out: list[str]) -> None:
    """Append a canonical text form of plan data (dataclasses, tuples, ints, strs, bools)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        out.append(type(x).__name__)
        out.append("(")
        for field in dataclasses.fields(x):
            _canonical(getattr(x, field.name), out)
            out.append(",")
        out.append(")")
    elif isinstance(x, (tuple, list)):
        if any(dataclasses.is_dataclass(v) or isinstance(v, Mapping) for v in x):
            out.append("(")
            for v in x:
                _canonical(v, out)
                out.append(",")
            out.append(")")
        else:  # tuples of ints/strs/tuples (boxes, device ids): repr is canonical and fast
            out.append(repr(tuple(x)))
    elif isinstance(x, Mapping):  # sorted, so insertion order does not matter
        out.append("{")
        for k in sorted(x, key=repr):
            out.append(repr(k))
            out.append(":")
            _canonical(x[k], out)
            out.append(",")
        out.append("}")
    elif x is None or isinstance(x, (bool, int, str)):
        out.append(repr(x))
    else:
        raise TypeError(f"cannot fingerprint a {type(x).__name__}: plans hold only pure data")


def digest(*parts: Any) -> str:
    """A short, process-independent hash of pure plan data."""
    text: list[str] = []
    for part in parts:
        _canonical(part, text)
        text.append("|")
    return hashlib.blake2b("".join(text).encode(), digest_size=16).hexdigest()


def leaf_digest(leaf: LeafSpec, kind: str = "") -> str:
    """The hash of one leaf: path, shape, source and destination layouts, dtypes, and
    ``kind``: what the caller's dtype is beyond the moved one (a typed PRNG key's dtype, such
    as ``key<rbg>``, moved as its uint32 data like ``key<urbg>``)."""
    return digest(FORMAT, leaf, kind) if kind else digest(FORMAT, leaf)


def fingerprint(
    leaves: Sequence[LeafSpec],
    assignment: Any,
    schedule: Any,
    bucket_bytes: int,
    kinds: Sequence[str] = (),
    compiler_options: str = "",
    fallbacks: Sequence[tuple[str, str]] = (),
) -> str:
    """The hash of a whole plan; equal on two processes exactly when they planned the same.

    Covers the leaves (with their ``kinds``, `leaf_digest`) and what was derived from them
    (assignment and schedule), so a difference in options (``bucket_bytes``, a
    process-dependent ``tier``) is caught as well, and the transfer programs' XLA options
    (``compiler_options``, as `options_text` writes them): processes whose transfer
    programs were compiled differently could disagree inside a collective.
    """
    kinds = tuple(kinds) or ("",) * len(leaves)
    digests = [leaf_digest(leaf, kind) for leaf, kind in zip(leaves, kinds, strict=True)]
    parts: list[object] = [digests, assignment, schedule, int(bucket_bytes), compiler_options]
    if fallbacks:  # (plans without fallback leaves keep the fingerprints they had)
        parts.append([list(f) for f in fallbacks])
    return digest(FORMAT, *parts)


def options_text(options: Mapping[str, Any] | None) -> str:
    """XLA options (a plan's ``compiler_options``) as one canonical line: sorted, repr'd."""
    return ", ".join(f"{k}={v!r}" for k, v in sorted((options or {}).items()))


@dataclasses.dataclass(frozen=True)
class PlanIdentity:
    """What the agreement compares, and what a mismatch message shows (pure data).

    Attributes:
      fingerprint: `fingerprint` of the whole plan.
      leaves: the plan's leaves (paths, layouts, dtypes).
      descriptions: one human-readable line per leaf (shapes, shardings), for messages.
      bucket_bytes: the plan's bucket size (named when only the schedules differ).
      kinds: per leaf, the caller's dtype where the moved one does not say it all
        (`leaf_digest`), else "" (empty: "" for every leaf).
      compiler_options: the transfer programs' XLA options (`options_text`), named when
        only they differ.
      fallbacks: ``(path, description)`` of each leaf the plan sends by ``jax.device_put``
        (``fallback="device_put"``), compared with the leaves (in the fingerprint too).
      fallback_devices: the devices those leaves go to: their processes take part as the
        moved leaves' do (a ``jax.device_put`` of a host value onto devices of several
        processes is a collective, which must follow the calls' order).
    """

    fingerprint: str
    leaves: tuple[LeafSpec, ...]
    descriptions: tuple[str, ...]
    bucket_bytes: int
    kinds: tuple[str, ...] = ()
    compiler_options: str = ""
    fallbacks: tuple[tuple[str, str], ...] = ()
    fallback_devices: tuple[int, ...] = ()


# ------------------------------------------------------------------------------- processes


def involved_processes(
    leaves: Iterable[LeafSpec], process_of: Mapping[int, int], more: Iterable[int] = ()
) -> tuple[int, ...]:
    """The processes owning a device of any leaf's source or destination layout, or one of
    the devices ``more`` (sorted)."""
    devices = {d for leaf in leaves for d in (*leaf.src.devices, *leaf.dst.devices)}
    return tuple(sorted({process_of[d] for d in (*devices, *more)}))


def plan_processes(plan: PlanIdentity, process_of: Mapping[int, int]) -> tuple[int, ...]:
    """The processes involved in ``plan``: its moved leaves' and its fallback leaves'."""
    return involved_processes(plan.leaves, process_of, plan.fallback_devices)


# --------------------------------------------------------------------------------- agreement


def _involvement(plan: PlanIdentity, client: Any) -> tuple[Any, int, tuple[int, ...]] | None:
    """``(client, this process, the involved processes)`` when this process must talk to
    others about ``plan``; None in a single process, without the distributed runtime, or when
    this process is alone in (or not part of) the plan."""
    import jax

    if jax.process_count() == 1:
        return None
    process_of = {d.id: d.process_index for d in jax.devices()}
    return _talking(plan_processes(plan, process_of), client)


def _talking(group: tuple[int, ...], client: Any) -> tuple[Any, int, tuple[int, ...]] | None:
    """``(client, this process, group)`` where this process must talk to the others of
    ``group`` (sorted process indices); None otherwise (see `_involvement`)."""
    import jax
    from jax._src import distributed

    if jax.process_count() == 1:
        return None
    client = client if client is not None else distributed.global_state.client
    if client is None:
        return None  # multi-process without the distributed runtime: nothing to talk through
    me = jax.process_index()
    if me not in group or len(group) == 1:
        return None
    return client, me, group


def agreement_timeout_s() -> float:
    """The current wait limit for absent peers (see `DEFAULT_AGREEMENT_TIMEOUT_S`)."""
    value = os.environ.get("JAXRESHARD_AGREEMENT_TIMEOUT_S")
    return float(value) if value else DEFAULT_AGREEMENT_TIMEOUT_S


@dataclasses.dataclass
class _State:
    agreed: set[str] = dataclasses.field(default_factory=set)
    rounds: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    # Calls ``(group key, n)`` this process gave up before making them, for a crossing it
    # found (`_Waiting.check`), with the reason: making such a call raises at once.
    given_up: dict[tuple[str, int], str] = dataclasses.field(default_factory=dict)
    # This process's last refusals before a plan (`place_refusal`): step and guess.
    refusals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Per group, the first block of call records this process has not deleted (`check_order`).
    kept_from: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    # Re-entrant: an agreement runs under it (one at a time per process), and what it finds
    # while it waits (a peer in a call it stands for: `_take_call`) updates the counts.
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)


_STATE = _State()


def has_agreed(plan: PlanIdentity) -> bool:
    """Whether this process has agreed on ``plan``'s fingerprint (with any plan object)."""
    with _STATE.lock:
        return plan.fingerprint in _STATE.agreed


def agree(plan: PlanIdentity, *, timeout_s: float | None = None, client: Any = None) -> None:
    """Confirm that every process involved in ``plan`` holds the same plan; blocks until then.

    Called by `Plan.__call__` before its first transfer. A no-op in a single process, on a
    process that owns none of the plan's devices, and for a fingerprint this process has already
    agreed on (plans remade with the same inputs, e.g. after ``jr.clear_cache()``). Uses the
    ``jax.distributed`` key-value store only; moves no array data.

    Raises:
      ReshardError: on a peer with a different plan (naming the first differing leaf), a peer
        blocked in the agreement of another plan involving this process, or a peer that has not
        arrived within ``timeout_s`` (default `agreement_timeout_s`).
    """
    found = _involvement(plan, client)
    if found is None:
        return
    client, me, group = found
    fp = plan.fingerprint
    with _STATE.lock:
        if fp in _STATE.agreed:
            return
        group_key = digest(group)[:16]
        n = _STATE.rounds[group_key]
        _STATE.rounds[group_key] = n + 1
        _Agreement(client, me, group, group_key, n, fp, plan).run(
            agreement_timeout_s() if timeout_s is None else timeout_s
        )
        _STATE.agreed.add(fp)


def give_up_agreement(processes: Iterable[int], reason: str, *, client: Any = None) -> None:
    """A plan's first call this process refused before it could make the plan (a
    ``dst_shardings`` tree that does not fit the source, ...), under ``jax.distributed``: its
    next agreement round over ``processes`` (those owning a device the call's trees name)
    is given up, so the peers' agreement of their plan in that round raises at once, naming
    ``reason``, instead of passing with this process's next plan (and pairing its next call
    with their first); both then take the next round for their next plans. A no-op where
    this process is alone, not among ``processes``, or in a single process."""
    found = _talking(tuple(sorted(set(processes))), client)
    if found is None:
        return
    client, me, group = found
    key = digest(group)[:16]
    with _STATE.lock:
        n = _STATE.rounds[key]
        _STATE.rounds[key] = n + 1
    _fail_round(client, key, n, me, reason)


def place_refusal(
    processes: Iterable[int],
    reason: str,
    plan: PlanIdentity | None = None,
    *,
    timeout_s: float | None = None,
    client: Any = None,
) -> bool:
    """A call this process refused before it could make its plan (`give_up_agreement`), under
    ``jax.distributed``: take the place of the event its peers make at this step; whether it
    was placed (False: the caller places its guess).

    The refusing process cannot tell from its own state what its peers make at this step: a
    call of a plan they agreed on, or a new plan's agreement. Its guess (the call of
    ``plan``, the plan it last used for a source laid out alike, where there is one; else the
    agreement round of ``processes``, those owning a device its trees name) was wrong where
    the peers made the other (a fuzz, 2026-12-05: one extra leaf on one process at one step
    of a refit loop): the peers' call then paired with this process's next one and returned
    that step's weights, silently. The peers say where they are: a call's record is published
    when it starts (`check_order`), an agreement's wait when it starts (`_Agreement`), and
    every process's next event over a group is the one that pairs with this process's next
    event there. So this polls, up to ``timeout_s`` (default `agreement_timeout_s`), for a
    peer's record of this process's next call over a group it has agreed plans in, or a peer
    waiting in this process's next agreement round over a group that holds it, and refuses
    that call (`check_order` raises there, naming ``reason``) or gives that round up (the
    agreement raises).

    Peers that refuse the same step say so: each refusal publishes the step it stands at
    (its group and this process's call and round numbers over it, equal on every process at
    the same step) with its guess, and keeps the last `_REFUSALS_KEPT`. Their events are
    later steps', so they are not taken; where every other process of the group refused
    this step, all place the guess of the lowest of them (one placement everywhere, whatever
    each guessed: a fuzz saw two processes that refused the same tree end a step apart when
    the earlier one took the later one's next call). A peer refusing now at another step
    (trees that name other processes) cuts the wait to `REFUSAL_GRACE_S`. Needs calls
    checked in order (`order_check_enabled`: calls publish nothing otherwise): without, it
    returns False at once. A no-op (False) in one process or where this process is alone
    among ``processes``."""
    group = tuple(sorted(set(processes) | set(_plan_processes(plan))))
    found = _talking(group, client)
    if found is None or not order_check_enabled():
        return False
    client, me, group = found
    key = digest(group)[:16]
    guess = _guess(plan, group)
    with _STATE.lock:
        step = [key, _STATE.calls[key], _STATE.rounds[key]]
        _STATE.refusals = [*_STATE.refusals, {"step": step, "guess": guess}][-_REFUSALS_KEPT:]
        refusals = list(_STATE.refusals)
    marker = f"{_PREFIX}/refusing/{me}"
    client.key_value_set(
        marker, json.dumps({"active": True, "refused": refusals}), allow_overwrite=True
    )
    deadline = time.monotonic() + (agreement_timeout_s() if timeout_s is None else timeout_s)
    sleep = _POLL_S[0]
    try:
        while True:
            alike, elsewhere = _refusing(client, me, group, step)
            if _take_peers_event(client, me, reason, exclude=alike):
                return True
            if len(alike) == len(group) - 1:  # every peer refused this step
                lowest = min({**alike, me: guess}.items())[1]
                return _place_guess(client, me, reason, lowest)
            if elsewhere:
                deadline = min(deadline, time.monotonic() + REFUSAL_GRACE_S)
            if time.monotonic() > deadline:
                return False
            time.sleep(sleep)
            sleep = min(_POLL_S[1], sleep * 2)
    finally:
        done = json.dumps({"active": False, "refused": refusals})
        client.key_value_set(marker, done, allow_overwrite=True)


_REFUSALS_KEPT = 16
"""Refusals before a plan a process keeps published (`place_refusal`): a peer still waiting
in the step of an older one reads it there."""


def _plan_processes(plan: PlanIdentity | None) -> tuple[int, ...]:
    """The processes involved in ``plan`` (none for no plan)."""
    if plan is None:
        return ()
    import jax

    process_of = {d.id: d.process_index for d in jax.devices()}
    return plan_processes(plan, process_of)


def _guess(plan: PlanIdentity | None, group: tuple[int, ...]) -> list[Any]:
    """Where `place_refusal`'s caller places the refusal when no peer is seen: ``["call",
    key, n]`` (``plan``'s next call, where it has agreed) or ``["round", key, n]`` (its
    agreement, or that of ``group``), with this process's numbers now."""
    with _STATE.lock:
        if plan is not None:
            key = digest(_plan_processes(plan))[:16]
            if plan.fingerprint in _STATE.agreed:
                return ["call", key, _STATE.calls[key]]
            return ["round", key, _STATE.rounds[key]]
        key = digest(group)[:16]
        return ["round", key, _STATE.rounds[key]]


def _refusing(
    client: Any, me: int, group: Sequence[int], step: list[Any]
) -> tuple[dict[int, list[Any]], bool]:
    """The other processes of ``group`` that refused at ``step`` (`place_refusal`), with
    their guesses, and whether another of them is refusing now at another step."""
    alike: dict[int, list[Any]] = {}
    elsewhere = False
    for k, v in client.key_value_dir_get(f"{_PREFIX}/refusing/"):
        q = int(k.rsplit("/", 1)[1])
        if q == me or q not in group:
            continue
        marker = json.loads(v)
        guesses = [r["guess"] for r in marker["refused"] if r["step"] == step]
        if guesses:
            alike[q] = guesses[-1]
        elif marker["active"]:
            elsewhere = True
    return alike, elsewhere


def _take_peers_event(client: Any, me: int, reason: str, exclude: Collection[int] = ()) -> bool:
    """Refuse the call, or give up the agreement round, that a peer (not in ``exclude``:
    peers that refused this step themselves) waits in for this process as its next one (see
    `place_refusal`); whether one was found."""
    for k, v in client.key_value_dir_get(f"{_PREFIX}/waiting/"):
        q = int(k.rsplit("/", 1)[1])
        if q == me or q in exclude or v == "idle":
            continue
        other = json.loads(v)
        if "failed" in other or me not in other["group"]:
            continue
        if _take_round(other["key"], other["n"]):
            _fail_round(client, other["key"], other["n"], me, reason)
            return True
    with _STATE.lock:
        nexts = {key: _STATE.calls[key] for key in (*_STATE.calls, *_STATE.rounds)}
    for key, n in nexts.items():
        records = {
            int(k.rsplit("/", 1)[1]): json.loads(v)
            for k, v in client.key_value_dir_get(f"{_call_key(key, n, me).rsplit('/', 1)[0]}/")
        }
        theirs = next((r for q, r in records.items() if q != me and q not in exclude), None)
        if theirs is not None and _refuse_call_as(client, me, (key, n), theirs["plan"], reason):
            return True
    return False


def _place_guess(client: Any, me: int, reason: str, guess: list[Any]) -> bool:
    """Place a refusal at ``guess`` (`_guess`: a call or an agreement round, by the numbers
    of the process that guessed it) where it is this process's next one; whether it was."""
    kind, key, n = guess
    if kind == "round":
        if not _take_round(key, n):
            return False
        _fail_round(client, key, n, me, reason)
        return True
    return _refuse_call_as(client, me, (key, n), "", reason)


def _refuse_call_as(client: Any, me: int, call: tuple[str, int], label: str, reason: str) -> bool:
    """Take ``call`` (``(group key, n)``) as refused here, if it is this process's next call
    over that group and not one it gave up in a crossing (its own call of that one raises);
    the peers' `check_order` raises there, naming ``reason``. Whether it was."""
    with _STATE.lock:  # one hold: no call of that number is given up or taken in between
        if call in _STATE.given_up or not _take_call(*call):
            return False
    record = {"fp": "", "plan": label, "refused": reason[:500]}
    client.key_value_set(_call_key(*call, me), json.dumps(record))
    return True


def _take_round(key: str, n: int) -> bool:
    """Count agreement round ``n`` over the group ``key`` as passed here, if it is this
    process's next one (a round given up in a crossing); whether it was."""
    with _STATE.lock:
        if _STATE.rounds[key] != n:
            return False
        _STATE.rounds[key] = n + 1
        return True


def _take_call(key: str, n: int) -> bool:
    """Count call ``n`` over the group ``key`` as made here, if it is this process's next one
    (a call of an agreed plan crossed with this process's first call of a new plan: this
    process made the new plan's call in its place); whether it was."""
    with _STATE.lock:
        if _STATE.calls[key] != n:
            return False
        _STATE.calls[key] = n + 1
        return True


def _fail_round(
    client: Any, key: str, n: int, me: int, reason: str, call: tuple[str, int] | None = None
) -> None:
    """Mark agreement round ``n`` over the group ``key`` given up by this process: a peer
    agreeing in it raises at once, naming ``reason`` (`_Agreement._wait`), and counts
    ``call`` (``(group key, number)``: the call this process gave up for it) as made."""
    failed: dict[str, Any] = {"fp": "", "failed": reason[:500]}
    if call is not None:
        failed["call"] = list(call)
    client.key_value_set(f"{_PREFIX}/{key}/{n}/fp/{me}", json.dumps(failed), allow_overwrite=True)


class _Agreement:
    """One round of the agreement protocol for one process (see `agree`).

    Keys: ``{_PREFIX}/{group}/{n}/fp/{process}`` holds a process's fingerprint and options;
    ``{_PREFIX}/{group}/{n}/leaves/{process}`` its per-leaf digests and descriptions (read only
    on a mismatch); ``{_PREFIX}/waiting/{process}`` the round it is blocked in, or "idle".
    """

    def __init__(
        self,
        client: Any,
        me: int,
        group: tuple[int, ...],
        key: str,
        n: int,
        fp: str,
        plan: PlanIdentity,
    ) -> None:
        self.client, self.me, self.group, self.n, self.fp, self.plan = (
            client,
            me,
            group,
            n,
            fp,
            plan,
        )
        self.base = f"{_PREFIX}/{key}/{n}"
        self.waiting = {"group": list(group), "key": key, "n": n}
        self.mismatched = False  # (the round failed on a peer's different fingerprint)

    def run(self, timeout_s: float) -> None:
        c, me = self.client, self.me
        c.key_value_set_bytes(f"{self.base}/leaves/{me}", _leaves_blob(self.plan))
        c.key_value_set(
            f"{self.base}/fp/{me}",
            json.dumps(
                {
                    "fp": self.fp,
                    "bucket_bytes": self.plan.bucket_bytes,
                    "compiler_options": self.plan.compiler_options,
                }
            ),
        )
        c.key_value_set(f"{_PREFIX}/waiting/{me}", json.dumps(self.waiting), allow_overwrite=True)
        try:
            self._wait(timeout_s)
        except ReshardError as e:
            # Peers waiting for this process in any plan see this and fail too, rather than
            # wait for a process that is about to exit. And a peer that reaches this round
            # later must not take this process's fingerprint for its agreement: it would pass,
            # and enter a transfer this process never makes (its next plan's, meanwhile).
            # (A mismatch keeps its fingerprint: the peer reads it to name the differing leaf.)
            reason = str(e).splitlines()[0][:500]
            failed = {**self.waiting, "failed": reason}
            if not self.mismatched:
                c.key_value_set(
                    f"{self.base}/fp/{me}", json.dumps({"fp": self.fp, "failed": reason}),
                    allow_overwrite=True,
                )  # fmt: skip
            c.key_value_set(f"{_PREFIX}/waiting/{me}", json.dumps(failed), allow_overwrite=True)
            raise
        c.key_value_set(f"{_PREFIX}/waiting/{me}", "idle", allow_overwrite=True)
        if self.n > 0:  # every peer has passed the previous round: its keys are no longer read
            previous = self.base.rsplit("/", 1)[0] + f"/{self.n - 1}"
            for kind in ("fp", "leaves"):
                c.key_value_delete(f"{previous}/{kind}/{me}")

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        sleep = _POLL_S[0]
        peers = set(self.group) - {self.me}
        while True:
            seen = {
                int(k.rsplit("/", 1)[1]): json.loads(v)
                for k, v in self.client.key_value_dir_get(f"{self.base}/fp/")
            }
            for q in sorted(peers & set(seen)):
                if "failed" in seen[q]:
                    if "call" in seen[q]:  # crossed with q's call: it stood for that one here
                        _take_call(*seen[q]["call"])
                    raise ReshardError(
                        f"jaxreshard: process {q} gave up the agreement of this plan (its plan "
                        f"#{self.n + 1} over processes {list(self.group)}): "
                        f"{seen[q]['failed']}\nHow to fix: see the error on process "
                        f"{q}; every involved process must reach each plan's first call within "
                        "JAXRESHARD_AGREEMENT_TIMEOUT_S of the others. No data was moved"
                    )
                if seen[q]["fp"] != self.fp:
                    self.mismatched = True
                    raise self._mismatch(q, seen[q])
            missing = sorted(peers - set(seen))
            if not missing:
                return
            self._check_blocked(missing)
            if time.monotonic() > deadline:
                raise ReshardError(
                    f"jaxreshard: process {self.me} waited {timeout_s:.0f} s for processes "
                    f"{missing} to reach the first call of the same plan (every process owning a "
                    f"device of the plan: {list(self.group)}).\nHow to fix: call the plan (or "
                    "jr.reshard) on every process that owns one of its source or destination "
                    "devices, in the same order; raise JAXRESHARD_AGREEMENT_TIMEOUT_S if they "
                    "are only slow to get there"
                )
            time.sleep(sleep)
            sleep = min(_POLL_S[1], sleep * 2)

    def _check_blocked(self, missing: Sequence[int]) -> None:
        """Raise if a missing peer is blocked in another round that waits for this process,
        or in a call of an agreed plan that this process has not made (`_check_calling`)."""
        for k, v in self.client.key_value_dir_get(f"{_ORDER_PREFIX}/waiting/"):
            q = int(k.rsplit("/", 1)[1])
            if q in missing and v != "idle":
                self._check_calling(q, json.loads(v))
        for k, v in self.client.key_value_dir_get(f"{_PREFIX}/waiting/"):
            q = int(k.rsplit("/", 1)[1])
            if q not in missing or v == "idle":
                continue
            other = json.loads(v)
            if "failed" in other:
                if other["key"] == self.waiting["key"] and other["n"] < self.n:
                    # An earlier round of this group, which the peer gave up (a crossing):
                    # its next agreement over this group is this round.
                    continue
                raise ReshardError(
                    f"jaxreshard: process {q}, which this plan needs (processes "
                    f"{list(self.group)}), failed the agreement of its plan "
                    f"#{other['n'] + 1} over processes {other['group']} and will not get "
                    f"here: {other['failed']}\nHow to fix: see the error on process {q}"
                )
            if self.me not in other["group"] or (other["key"], other["n"]) == (
                self.waiting["key"],
                self.waiting["n"],
            ):
                continue
            mine = f"{_PREFIX}/{other['key']}/{other['n']}/fp/{self.me}"
            if _try_get(self.client, mine) is not None:
                continue  # this process already passed that round; the peer will follow
            raise ReshardError(
                f"jaxreshard: processes {self.me} and {q} are waiting for each other in "
                f"different plans: this process is at its plan #{self.n + 1} over processes "
                f"{list(self.group)}, process {q} at its plan #{other['n'] + 1} over processes "
                f"{other['group']}.\nHow to fix: every process must make and call the same "
                "plans (same trees, shardings with the same meshes and device order, same "
                "options) in the same order"
            )

    def _check_calling(self, q: int, other: Mapping[str, Any]) -> None:
        """Raise if peer ``q`` waits in a call of an agreed plan (its order check: ``other``,
        what `_Waiting` says it waits for) that needs this process and that this process has
        not made: it waits here, in the first call of another plan, for ``q``. That call is
        given up for ``q`` (which raises at once, naming this plan) and counted as made here:
        this first call stood in its place (in a refit loop, one process's call of that step
        made a plan of its own, a dtype or a sharding that differs), so the next calls of
        both pair up step for step. (Until a fuzz found it, 2026-12-05, this process's next
        call took that number and raised, leaving the loops one step apart, silently.)"""
        if self.me not in other["group"]:
            return
        with _STATE.lock:
            if (other["key"], other["n"]) in _STATE.given_up or not _take_call(
                other["key"], other["n"]
            ):
                return  # this process made that call (or gave it up), or is further behind
        error = ReshardError(
            f"jaxreshard: processes {self.me} and {q} are waiting for each other: this "
            f"process in the first call of a plan it has not agreed on yet (its plan "
            f"#{self.n + 1} over processes {list(self.group)}), process {q} in call "
            f"#{other['n'] + 1} over processes {other['group']} ({other['plan']}), which "
            "this process has not made. No data was moved.\nHow to fix: every process "
            "must call its plans in the same order, new plans included"
        )
        # The round this agreement fails goes with the record: the peer's next agreement over
        # this group then takes the next round, as this process's does.
        record = {
            "fp": "",
            "plan": other["plan"],
            "abandoned": str(error).splitlines()[0],
            "round": [self.waiting["key"], self.n],
        }
        self.client.key_value_set(_call_key(other["key"], other["n"], self.me), json.dumps(record))
        raise error

    def _mismatch(self, q: int, theirs: Mapping[str, Any]) -> ReshardError:
        mine = _leaves_entries(self.plan)
        raw = self.client.blocking_key_value_get_bytes(f"{self.base}/leaves/{q}", 10_000)
        other = json.loads(zlib.decompress(raw))
        lines = [
            f"jaxreshard: processes {self.me} (this one) and {q} hold different plans for the "
            f"same transfer (fingerprints {self.fp[:12]} and {theirs['fp'][:12]}); no data "
            "was moved."
        ]
        for i in range(max(len(mine), len(other))):
            a = mine[i] if i < len(mine) else None
            b = other[i] if i < len(other) else None
            if a is not None and b is not None and a[0] == b[0]:
                continue
            here = f"{a[1]}: {a[2]}" if a else "(no such leaf)"
            there = f"{b[1]}: {b[2]}" if b else "(no such leaf)"
            lines += [
                f"First differing leaf: {(a or b)[1]} "
                + (f"(leaf {i + 1} of {len(mine)} here)" if a else f"({len(mine)} leaves here)"),
                f"  process {self.me}: {here}",
                f"  process {q}: {there}",
            ]
            break
        else:
            mine_options = self.plan.compiler_options
            their_options = theirs.get("compiler_options", "")
            if mine_options != their_options:
                lines.append(
                    f"Every leaf agrees, but the transfer programs' compiler_options differ: "
                    f"{{{mine_options}}} here, {{{their_options}}} on process {q}."
                )
            else:
                lines.append(
                    f"Every leaf agrees, but the schedules differ: bucket_bytes "
                    f"{self.plan.bucket_bytes} here, {theirs['bucket_bytes']} on process {q}, "
                    "or unit_buckets= or a topology= that depends on the process."
                )
        lines.append(
            "How to fix: every process must call jr.plan / jr.reshard with the same global "
            "description: the same tree, shapes and dtypes, shardings on the same meshes (same "
            "device order) with the same PartitionSpecs, and the same dtype=, bucket_bytes=, "
            "unit_buckets=, topology= and compiler_options=; and make their plans' first calls "
            f"in the same order (this was the first call of plan #{self.n + 1} over processes "
            f"{list(self.group)} on both: two plans whose first calls came in another order "
            "on each differ here, though each process holds both)"
        )
        return ReshardError("\n".join(lines))


# ------------------------------------------------------------------------------ call order

_ORDER_PREFIX = "jaxreshard/order"
_ORDER_POLL_S = 1.0  # the wait for a peer's call is cut into polls of this length
_ORDER_BLOCK = 64  # calls per directory of keys (deleted together)


def order_check_enabled() -> bool:
    """Whether every call checks the call order (``JAXRESHARD_ORDER_CHECK=0`` turns it off)."""
    return os.environ.get("JAXRESHARD_ORDER_CHECK", "1") != "0"


def check_order(
    plan: PlanIdentity, label: str, *, timeout_s: float | None = None, client: Any = None
) -> None:
    """Before every call of a plan: confirm that every involved process is making the same
    call, the n-th call over the same group of processes being of the same plan everywhere.

    Each involved process publishes ``(fingerprint, label)`` of its n-th call under the key
    ``{_ORDER_PREFIX}/{group}/{n}/{process}`` of the ``jax.distributed`` key-value store and
    reads its peers' (one write and one blocking read per peer: a few hundred microseconds on a
    local coordinator). Plans called in different orders raise `ReshardError` on every
    involved process as soon as both have published, naming both plans; a peer that does not
    publish within ``timeout_s`` (default `agreement_timeout_s`) raises, naming the process.
    No array data moves and no collective runs, so a refused call leaves everything intact.
    """
    mine = {"fp": plan.fingerprint[:16], "plan": label}
    slot = _publish_call(plan, client, mine)
    if slot is None:
        return
    client, me, group, group_key, n, base, crossed = slot
    if crossed is not None:
        raise ReshardError(
            f"jaxreshard: this process (process {me}) gave up call #{n + 1} over processes "
            f"{list(group)} ({label}) before making it: {crossed}. No data was moved.\nHow to "
            "fix: every process must call its plans in the same order, plans over different "
            "groups of processes included"
        )
    timeout_s = agreement_timeout_s() if timeout_s is None else timeout_s
    start = time.monotonic()
    deadline = start + timeout_s
    records: dict[int, str] = {}
    waiting = _Waiting(client, me, group, group_key, n, label)
    try:
        for q in group:
            if q == me:
                continue
            theirs = _wait_for(client, f"{base}/{n}/{q}", deadline, lambda q=q: waiting.check(q))
            if theirs is None:
                raise ReshardError(
                    f"jaxreshard: process {me} waited {timeout_s:.0f} s for process {q} to make "
                    f"call #{n + 1} over processes {list(group)} ({label}); process {q} is "
                    "lost, stuck, or calling fewer plans than this one. No data was moved.\n"
                    "How to fix: call the same plans in the same order on every involved "
                    "process; if processes are only slow to arrive, raise "
                    "JAXRESHARD_AGREEMENT_TIMEOUT_S. A process that died is also detected by "
                    "jax.distributed's heartbeat (see the README's 'A lost process')"
                )
            records[q] = theirs
    except ReshardError as e:
        # Give the call up for good: a peer that makes it later reads this and raises,
        # instead of passing on the record published above and entering the transfer alone.
        given_up = {**mine, "abandoned": str(e).splitlines()[0][:500]}
        client.key_value_set(f"{base}/{n}/{me}", json.dumps(given_up), allow_overwrite=True)
        raise
    finally:
        waiting.done()
    if len(records) > 1:
        # A peer read before another arrived may have given the call up since (above): the
        # crossing that the later peer was held in ends with exactly that. Read every record
        # again, in one request, so that this process does not enter a transfer it would be
        # alone in. (A peer giving up after this read is still waiting for a record that is
        # already published, which only its timeout does.)
        again = {int(k.rsplit("/", 1)[1]): v for k, v in client.key_value_dir_get(f"{base}/{n}/")}
        records = {q: again.get(q, v) for q, v in records.items()}
    for q, theirs in records.items():
        theirs = json.loads(theirs)
        if "abandoned" in theirs:
            if "round" in theirs:  # given up in a new plan's agreement that waited for this
                _take_round(*theirs["round"])  # process: that round is over for it too
            raise ReshardError(
                f"jaxreshard: process {q} gave up call #{n + 1} over processes {list(group)} "
                f"({theirs['plan']}) before this process made it: {theirs['abandoned']}. No "
                f"data was moved.\nHow to fix: see the error on process {q}; every involved "
                "process must make the same calls in the same order, each within "
                "JAXRESHARD_AGREEMENT_TIMEOUT_S of the others"
            )
        if "refused" in theirs:
            raise ReshardError(
                f"jaxreshard: process {q} refused call #{n + 1} over processes {list(group)} "
                f"({theirs['plan']}) in its own argument checks: {theirs['refused']}\nNo data "
                f"was moved, here or there.\nHow to fix: see the error on process {q}; every "
                "involved process must call the plan with arguments it accepts"
            )
        if theirs["fp"] != mine["fp"]:
            raise ReshardError(
                f"jaxreshard: call #{n + 1} over processes {list(group)} is not the same call "
                f"everywhere: process {me} (this one) calls {label} [{mine['fp'][:8]}], "
                f"process {q} calls {theirs['plan']} [{theirs['fp'][:8]}]. No data was "
                "moved.\nHow to fix: every involved process must call its plans in the same "
                "order (the order of jr.reshard / plan calls and plan.start)"
            )
    # Every peer has published call n - 1, so it has read every key up to n - 2: the blocks
    # before the previous one are no longer read by anyone. Every such block is deleted, not
    # only the one a block's first call passes: that call may be refused, given up or
    # crossed, and its block's keys then stayed for the rest of the job (a review).
    last = n // _ORDER_BLOCK - 2  # (the last block no peer reads any more)
    with _STATE.lock:
        first = _STATE.kept_from[group_key]
        _STATE.kept_from[group_key] = max(first, last + 1)
    for block in range(first, last + 1):
        _ignore_missing(client.key_value_delete, f"{_ORDER_PREFIX}/{group_key}/{block}")


def refuse_call(plan: PlanIdentity, label: str, reason: str, *, client: Any = None) -> None:
    """A call of ``plan`` this process refused in its own argument checks, before anything
    moved: it takes its place in the order of calls (`check_order`) with the refusal, so the
    peers' same call raises naming it instead of pairing with this process's next call."""
    _publish_call(
        plan, client, {"fp": plan.fingerprint[:16], "plan": label, "refused": reason[:500]}
    )


def _publish_call(
    plan: PlanIdentity, client: Any, record: Mapping[str, str]
) -> tuple[Any, int, tuple[int, ...], str, int, str, str | None] | None:
    """Take this process's next call number over ``plan``'s processes and publish ``record``
    under it; returns ``(client, me, group, group_key, n, base, crossed)``, or None where this
    process is not involved (or there is one process). ``crossed``: why this process gave
    that call up before making it (`_Waiting.check`), its record then already published."""
    found = _involvement(plan, client)
    if found is None:
        return None
    client, me, group = found
    group_key = digest(group)[:16]
    with _STATE.lock:
        n = _STATE.calls[group_key]
        _STATE.calls[group_key] = n + 1
        crossed = _STATE.given_up.pop((group_key, n), None)
    # Keys in blocks of _ORDER_BLOCK calls, so that old ones go with one delete per block.
    base = f"{_ORDER_PREFIX}/{group_key}/{n // _ORDER_BLOCK}"
    if crossed is None:  # (a given-up call's record, written then, stays: the peers read it)
        client.key_value_set(f"{base}/{n}/{me}", json.dumps(dict(record)))
    return client, me, group, group_key, n, base, crossed


def _call_key(group_key: str, n: int, process: int) -> str:
    """The key of ``process``'s record of call ``n`` over the group ``group_key`` (as
    `_publish_call` lays them out: ``{base}/{n}/{process}``)."""
    return f"{_ORDER_PREFIX}/{group_key}/{n // _ORDER_BLOCK}/{n}/{process}"


def _ignore_missing(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as e:  # a peer deleted it first
        if "NOT_FOUND" not in str(e).upper():
            raise


def _wait_for(
    client: Any, key: str, deadline: float, on_poll: Callable[[], None] | None = None
) -> str | None:
    """The value of ``key`` once a peer has set it; None when ``deadline`` passes first.
    ``on_poll`` runs after each poll that found nothing (and may raise)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            return client.blocking_key_value_get(key, int(1000 * min(left, _ORDER_POLL_S)))
        except Exception as e:  # DEADLINE_EXCEEDED: poll again until the deadline
            if "DEADLINE" not in str(e).upper() and "TIMEOUT" not in str(e).upper():
                raise
        if on_poll is not None:
            on_poll()


class _Waiting:
    """A call's order check that has waited a poll for a peer: it says so in the key-value
    store (``{_ORDER_PREFIX}/waiting/{process}``) and reads what the peer waits for, to
    find calls crossed between plans over different groups of processes (A over {0, 1} then
    B over {0, 1, 2} on one process, the other order on another), which each group's own
    call numbers cannot show. Nothing is written for calls that wait less than a poll."""

    def __init__(
        self, client: Any, me: int, group: Sequence[int], key: str, n: int, label: str
    ) -> None:
        self.client, self.me, self.group, self.key, self.n, self.label = (
            client,
            me,
            list(group),
            key,
            n,
            label,
        )
        self.said = False

    def check(self, q: int) -> None:
        """Raise if peer ``q`` waits in a call of another group that needs this process,
        and that this process has not made (it never will: it waits here for ``q``)."""
        if not self.said:
            record = {"group": self.group, "key": self.key, "n": self.n, "plan": self.label}
            self._set(json.dumps(record))
            self.said = True
        value = _try_get(self.client, f"{_ORDER_PREFIX}/waiting/{q}")
        if value is None or value == "idle":
            self._check_agreeing(q)
            return
        other = json.loads(value)
        if other["key"] == self.key or self.me not in other["group"]:
            return
        crossing = (other["key"], other["n"])
        error = ReshardError(
            f"jaxreshard: processes {self.me} and {q} are waiting for each other in crossed "
            f"calls: this process in call #{self.n + 1} over processes {self.group} "
            f"({self.label}), process {q} in call #{other['n'] + 1} over processes "
            f"{other['group']} ({other['plan']}), which this process has not made. No data "
            "was moved.\nHow to fix: every process must call its plans in the same order, "
            "plans over different groups of processes included"
        )
        reason = str(error).splitlines()[0]
        with _STATE.lock:  # one hold: no call of that number is taken in between
            made = _STATE.calls[other["key"]]
            if made > other["n"] or crossing in _STATE.given_up:
                return  # this process made that call, or gave it up: the peer will pass it
            if made == other["n"]:
                # The peer waits there for this process, which gives that call up now: the
                # peer reads the record below and raises at once. This process's own call of
                # that number, when its program makes it (it was about to: the orders are
                # crossed), raises at once too (`check_order`), so both count that call
                # alike. (Taking the number silently instead left that call waiting for
                # peers that had given it up.)
                _STATE.given_up[crossing] = reason
        # Give this call up before the peer's: a peer that reads the give-up below moves on
        # to this call (the orders are crossed), and must find it given up here, not pass it
        # on this process's earlier record and enter the transfer without this process.
        own = {"fp": "", "plan": self.label, "abandoned": reason}
        key = _call_key(self.key, self.n, self.me)
        self.client.key_value_set(key, json.dumps(own), allow_overwrite=True)
        if made == other["n"]:
            n = other["n"]
            record = {"fp": "", "plan": other["plan"], "abandoned": reason}
            key = _call_key(other["key"], n, self.me)
            self.client.key_value_set(key, json.dumps(record))
        raise error

    def _check_agreeing(self, q: int) -> None:
        """Raise if peer ``q`` waits in the agreement of a new plan that needs this process,
        a round this process has not reached (it waits here for ``q``): this call is given
        up, and so is that round, for this process (``q`` raises at once, naming this call,
        and counts this call as made, its first call having stood in its place; this
        process's next agreement over that group takes the next round, as ``q``'s does
        after its round failed). See `_Agreement._check_calling` for the other side."""
        value = _try_get(self.client, f"{_PREFIX}/waiting/{q}")
        if value is None or value == "idle":
            return
        other = json.loads(value)
        if "failed" in other or self.me not in other["group"]:
            return
        if not _take_round(other["key"], other["n"]):
            return  # this process passed that round, or is further behind
        error = ReshardError(
            f"jaxreshard: processes {self.me} and {q} are waiting for each other: this process "
            f"in call #{self.n + 1} over processes {self.group} ({self.label}), process {q} in "
            f"the first call of a plan this process has not reached (plan #{other['n'] + 1} "
            f"over processes {other['group']}, agreeing on it). No data was moved.\nHow to "
            "fix: every process must call its plans in the same order, new plans included"
        )
        reason = str(error).splitlines()[0]
        # This call first (as in `check`), then the peer's round.
        own = {"fp": "", "plan": self.label, "abandoned": reason}
        self.client.key_value_set(
            _call_key(self.key, self.n, self.me), json.dumps(own), allow_overwrite=True
        )
        _fail_round(self.client, other["key"], other["n"], self.me, reason, (self.key, self.n))
        raise error

    def done(self) -> None:
        if self.said:
            self._set("idle")

    def _set(self, value: str) -> None:
        self.client.key_value_set(f"{_ORDER_PREFIX}/waiting/{self.me}", value, allow_overwrite=True)


def wait_local_processes(procs: Sequence[Any], timeout_s: float) -> None:
    """Wait for locally launched processes (``subprocess.Popen``) of one job.

    Once one fails, or ``timeout_s`` passes, the others are killed: they would otherwise wait
    forever for it in a collective or the plan agreement. Used by the local demo and benchmark.
    """
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _try_get(client: Any, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception:  # NOT_FOUND is reported as an exception by the runtime client
        return None


def _leaves_entries(plan: PlanIdentity) -> list[list[str]]:
    kinds = plan.kinds or ("",) * len(plan.leaves)
    return [
        *(
            [leaf_digest(leaf, kind), leaf.path, text]
            for leaf, text, kind in zip(plan.leaves, plan.descriptions, kinds, strict=True)
        ),
        *([digest(FORMAT, path, text), path, text] for path, text in plan.fallbacks),
    ]


def _leaves_blob(plan: PlanIdentity) -> bytes:
    return zlib.compress(json.dumps(_leaves_entries(plan)).encode())
