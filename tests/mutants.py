"""Mutation check: plant known bugs one at a time and check that the named tests catch each.

A test suite that passes proves little until it is seen failing on a bug. Each `Mutant` is a
small textual patch (exact old -> new strings) on one file of the package. The script copies
the repository to a temporary directory (without .git, .venv or caches), checks that the
unmutated copy passes every named test, then for each mutant patches the copy, checks that
Python imports the patched file from the copy (not the installed package), runs
``python -m pytest -q <its tests>`` there and restores the file.

A mutant is *caught* when every one of its named tests fails; one that fails only some of
them is reported as "partly caught", and an import or collection error (pytest status 2-5)
means the mutant or its test names are broken. The script exits non-zero unless every mutant
is caught, and first if the unmutated code fails any named test.

Usage (from the repository root, in the project's environment; not collected by pytest)::

    python tests/mutants.py                 # every mutant
    python tests/mutants.py --only layout   # mutants whose name contains "layout"
    python tests/mutants.py --list

See tests/mutants.md for the table and how to add mutants.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900  # one pytest run; generous for a loaded machine


@dataclasses.dataclass(frozen=True)
class Mutant:
    """A planted bug: ``patches`` (old, new) applied to ``file``; ``tests`` must catch it.

    Every ``old`` must occur exactly once in the file, so a mutant never silently applies to
    the wrong place (or to nothing, after the code it targets was rewritten).
    """

    name: str
    file: str  # relative to the repository root
    patches: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root
    bug: str  # what the patch does, in words


ROUTE = "jaxreshard/planning/route.py"
T_ROUTE = "tests/test_route.py"
T_TOPO = "tests/test_topology.py"

PLANNER_MUTANTS = [
    Mutant(
        "route-sends-held-replica",
        ROUTE,
        (
            (
                "                        if d in replicas:\n"
                "                            local.append(LocalCopy(index, d, common))\n"
                "                    wanting = _by_domain([d for d in holders if d not in "
                "replicas], domain)",
                "                        if d in replicas and len(replicas) == 1:\n"
                "                            local.append(LocalCopy(index, d, common))\n"
                "                    wanting = _by_domain([d for d in holders if not (d in "
                "replicas and len(replicas) == 1)], domain)",
            ),
            (
                "                        senders = closeness(replicas, d)\n",
                "                        senders = closeness(\n"
                "                            tuple(s for s in replicas if s != d), d\n"
                "                        )\n",
            ),
        ),
        (
            f"{T_ROUTE}::test_degenerate_cases[replicated-colocated]",
            "tests/test_properties.py::test_named_cases[replicated-colocated]",
        ),
        "a part the receiver holds, but other replicas hold too, is sent from another replica "
        "(a refit that needs 0 bytes sends some)",
    ),
    Mutant(
        "route-split-swapped-senders",
        ROUTE,
        (
            (
                "    return list(zip(senders, boxes, strict=True))",
                "    return list(zip(senders[::-1], boxes, strict=True))",
            ),
        ),
        (f"{T_ROUTE}::test_balance_hits_the_row_optimum[uneven-split]",),
        "_split hands each sender the rows meant for another",
    ),
    Mutant(
        "route-no-pair-preference",
        ROUTE,
        (
            ("near = paired_with[demand.dst]", "near: set[int] = set()"),
            ("        near = paired_with[d.dst]", "        near: set[int] = set()"),
        ),
        (f"{T_ROUTE}::test_a_replicated_leaf_rides_on_the_pairs_of_a_split_leaf",),
        "_hand_out and _rotate never prefer a sender already paired with the receiver (more "
        "messages, possibly more rounds)",
    ),
    Mutant(
        "route-remainder-to-last-sender",
        ROUTE,
        (
            (
                "        sender = max(left, key=lambda s: (left[s] - take.get(s, 0) * row_bytes, "
                "-s))",
                "        sender = min(left, key=lambda s: (left[s] - take.get(s, 0) * row_bytes, "
                "-s))",
            ),
            ("        if untaken is not None and (", "        if False and ("),
        ),
        (f"{T_ROUTE}::test_balance_hits_the_row_optimum[rounding-remainder]",),
        "_split gives the rows lost to rounding to the sender with the least quota left",
    ),
    Mutant(
        "route-min-share-ignored",
        ROUTE,
        (
            (
                "            m = len(ds) if not min_share_bytes else max(1, min(len(ds), total // "
                "min_share_bytes))",
                "            m = len(ds)",
            ),
        ),
        (
            f"{T_TOPO}::test_a_leaf_smaller_than_a_share_per_device_is_imported_by_fewer_devices"
            "_in_turn",
        ),
        "every device of a domain imports a share of every leaf, however small (a norm over a "
        "rack of 72 makes 5,112 relays)",
    ),
    Mutant(
        "route-no-pooling",
        ROUTE,
        (
            (
                "        return _pooled(runs, pool_bytes) if by_leaf and pool_bytes else runs",
                "        return runs",
            ),
        ),
        (f"{T_TOPO}::test_small_leaves_are_pooled_into_one_share_per_device",),
        "small consecutive leaves are shared out leaf by leaf (one piece per importer per leaf)",
    ),
    Mutant(
        "route-relays-unmerged",
        ROUTE,
        (
            (
                "                for leaf, box in _merged([(r.leaf, r.box) for r in part]):",
                "                for leaf, box in [(r.leaf, r.box) for r in part]:",
            ),
        ),
        (f"{T_TOPO}::test_a_share_spanning_adjacent_regions_is_relayed_as_one_box",),
        "an importer relays each region of its share as a box of its own",
    ),
    Mutant(
        "route-shares-cut-mid-row",
        ROUTE,
        (
            (
                "        bounds = _snapped(bounds, regions, itemsizes, total // (k * "
                "SHARE_ROUNDING))",
                "        pass",
            ),
        ),
        (f"{T_TOPO}::test_shares_end_on_whole_rows_when_a_row_is_small",),
        "fan-out shares end in the middle of a row (more, smaller boxes)",
    ),
    Mutant(
        "route-chain-ignored",
        ROUTE,
        (("    if not sources:\n        return False", "    if True:\n        return False"),),
        (f"{T_TOPO}::test_destination_domains_that_outnumber_the_sources_forward_to_each_other",),
        "destination domains are never chained: the sources send every byte once per domain "
        "even where they, not the destinations, are the bottleneck",
    ),
    Mutant(
        "route-chain-always",
        ROUTE,
        (
            (
                "    return sent > (1 + CHAIN_SLACK) * imported",
                "    return True",
            ),
        ),
        (f"{T_TOPO}::test_domains_are_not_chained_where_the_sources_keep_up",),
        "destination domains are chained even where the sources keep up (a stage and its "
        "pieces for nothing)",
    ),
    Mutant(
        "route-chain-skips-devices-alone",
        ROUTE,
        (
            (
                "                        if chain and fan_out and g not in held:  # (d is alone "
                "in ds)",
                "                        if False:  # (d is alone in ds)",
            ),
        ),
        (f"{T_TOPO}::test_devices_alone_in_their_domain_are_chained_as_groups_of_one",),
        "devices alone in their domain to lack some bytes (a TP group over several domains) "
        "are never chained: their sources send every byte once per replica",
    ),
    Mutant(
        "route-chained-devices-alone-also-sent-directly",
        ROUTE,
        (
            (
                "        far = [x for x in far if x.dst not in alone]",
                "        pass",
            ),
        ),
        (f"{T_TOPO}::test_devices_alone_in_their_domain_are_chained_as_groups_of_one",),
        "a chained device alone in its domain also keeps its direct demands: it gets its "
        "bytes twice",
    ),
    Mutant(
        "route-chain-forwards-to-another-position",
        ROUTE,
        (
            (
                "        across = tuple(at[q] for q in range(k) if q != home)",
                "        across = tuple(groups[q][-1] for q in range(k) if q != home)",
            ),
        ),
        (
            f"{T_TOPO}::test_destination_domains_that_outnumber_the_sources_forward_to_each_other",
            "tests/test_lower.py::test_random_layouts_with_chained_domains_lower_exactly"
            "[False-by copies-as chosen]",
        ),
        "a share is forwarded to the last device of each other domain, not the one at its "
        "position, which relays it in stage 2 (that device relays bytes it never got)",
    ),
    Mutant(
        "route-skips-local-copies",
        ROUTE,
        (
            (
                "                        local.append(LocalCopy(index, d, common))",
                "                        pass  # the held part is neither copied nor sent",
            ),
        ),
        (
            f"{T_ROUTE}::test_degenerate_cases[identical-layouts]",
            "tests/test_properties.py::test_named_cases[identical-layouts]",
        ),
        "a part the receiver holds is dropped: neither copied locally nor sent",
    ),
    Mutant(
        "layout-off-by-one",
        "jaxreshard/planning/layout.py",
        (
            (
                "                box.append((index * step, (index + 1) * step))",
                "                box.append((index * step, min(n, (index + 1) * step + 1)))",
            ),
        ),
        (f"{T_ROUTE}::test_oracle_boxes_and_from_mesh_agree_with_jax",),
        "Layout.from_mesh boxes reach one row into the next shard",
    ),
    Mutant(
        "units-local-copies-uncounted",
        "jaxreshard/planning/schedule.py",
        (("    return out, into, sends, recvs + copies", "    return out, into, sends, recvs"),),
        (
            "tests/test_compiled.py::"
            "test_a_plan_of_local_copies_only_keeps_its_programs_small_and_flat_in_the_layers",
        ),
        "a unit's local copies do not count towards its copies: a plan of local copies is "
        "one program of every leaf, whose compile grows faster than its leaves",
    ),
    Mutant(
        "topology-profile-domains-of-absolute-slots",
        "jaxreshard/planning/topology.py",
        (("tuple(i // size for i in rel),", "tuple(i // size for i in slots),"),),
        ("tests/test_topology.py::test_profile_domains_and_hosts_count_from_the_first_device",),
        "Topology.profile(..., first_device=f) groups domains from id 0, not from f (16 h100 "
        "devices from id 4: three domains of 4, 8 and 4)",
    ),
    Mutant(
        "topology-profile-host-unclamped",
        "jaxreshard/planning/topology.py",
        (("host = min(p.host_size, size)", "host = p.host_size"),),
        (
            "tests/test_topology.py::"
            "test_profile_domains_smaller_than_its_hosts_are_hosts_of_their_own",
        ),
        "Topology.profile with domains smaller than the profile's hosts keeps the hosts' size, "
        "so a host spans two domains",
    ),
    Mutant(
        "topology-cross-latency-at-nvlink-speed",
        "jaxreshard/planning/topology.py",
        (
            (
                "1: int(self.round_latency * self.inter_bandwidth)",
                "1: int(self.round_latency * self.intra_bandwidth)",
            ),
        ),
        (
            "tests/test_simulate.py::"
            "test_a_rounds_latency_in_bytes_is_what_each_link_class_moves_meanwhile",
        ),
        "class_latency_bytes prices a round's latency across domains at NVLink speed, so the "
        "schedule weighs a slow round as ten times the bytes it costs",
    ),
    Mutant(
        "costmodel-round-robin-receivers-keyed-as-senders",
        "jaxreshard/tools/costmodel.py",
        (
            (
                "load[-1 - d, cross] += nbytes  # receivers keyed apart from senders",
                "load[d, cross] += nbytes  # receivers keyed apart from senders",
            ),
        ),
        (
            "tests/test_simulate.py::"
            "test_round_robin_prices_a_device_that_sends_and_receives_as_full_duplex",
        ),
        "the direct round-robin baseline adds a device's received bytes to its sent ones, as if "
        "links were half duplex (a swap of halves priced at twice its time)",
    ),
    Mutant(
        "costmodel-sole-holder-sends-over-nvlink-only",
        "jaxreshard/tools/costmodel.py",
        (('(n / (bi + bx), f"device {s} sends', '(n / bi, f"device {s} sends'),),
        (
            "tests/test_simulate.py::"
            "test_physical_bound_lets_a_sole_holder_send_over_nvlink_and_nic_at_once",
        ),
        "the physical bound prices a sole holder's sends over NVLink alone, not NVLink and NIC "
        "at once (the bound too high: 11 s where 10 s)",
    ),
]

MULTIHOST_MUTANTS = [
    Mutant(
        "fingerprint-without-routing",
        "jaxreshard/run/multihost.py",
        (
            (
                "[digests, assignment, schedule, int(bucket_bytes), compiler_options]",
                "[digests, int(bucket_bytes), compiler_options]",
            ),
        ),
        ("tests/test_multihost.py::test_fingerprint_covers_the_routing_and_the_schedule",),
        "the plan fingerprint hashes the leaves and options only: processes that routed "
        "differently (another topology or tier) would agree",
    ),
    Mutant(
        "fingerprint-without-key-dtypes",
        "jaxreshard/run/multihost.py",
        (
            (
                "    digests = [leaf_digest(leaf, kind) for leaf, kind in zip(leaves, kinds, "
                "strict=True)]",
                "    digests = [leaf_digest(leaf) for leaf in leaves]",
            ),
        ),
        (
            "tests/test_multihost.py::"
            "test_processes_holding_different_key_types_raise_naming_the_leaf",
        ),
        "key<rbg> and key<urbg> leaves (the same uint32 words) fingerprint alike: processes "
        "holding different key types run, handing one's key data out as the other's keys",
    ),
    Mutant(
        "order-crossed-call-taken-silently",
        "jaxreshard/run/multihost.py",
        (
            (
                "    client, me, group, group_key, n, base, crossed = slot\n"
                "    if crossed is not None:",
                "    client, me, group, group_key, n, base, crossed = slot\n    if False:",
            ),
        ),
        (
            "tests/test_multihost.py::"
            "test_calls_crossed_between_plans_over_different_groups_raise_within_seconds[0]",
        ),
        "a process that found a crossing and gave the peer's call up makes that call as if "
        "nothing happened: it waits out the timeout for peers that gave it up",
    ),
    Mutant(
        "order-crossing-gives-the-peers-call-up-first",
        "jaxreshard/run/multihost.py",
        (
            (
                "        self.client.key_value_set(key, json.dumps(own), allow_overwrite=True)\n",
                "",
            ),
        ),
        ("tests/test_multihost.py::test_a_crossing_gives_this_call_up_before_the_peers",),
        "the finder of a crossing gives the peer's call up before its own: the released peer "
        "can read the finder's record of its call before it says given up, and enter alone",
    ),
    Mutant(
        "order-records-not-read-again",
        "jaxreshard/run/multihost.py",
        (("    if len(records) > 1:\n", "    if False:\n"),),
        (
            "tests/test_multihost.py::"
            "test_a_call_whose_earlier_peer_gave_it_up_while_a_later_one_arrived_raises",
        ),
        "a call enters its transfer on peers' records read before another peer arrived, "
        "though one of them gave the call up meanwhile",
    ),
]

LOWER = "jaxreshard/planning/lower.py"
SCHEDULE = "jaxreshard/planning/schedule.py"
RUNTIME = "jaxreshard/run/runtime.py"
T_LOWER = "tests/test_lower.py"
T_PLANNER = "tests/test_planner.py"

EXECUTOR_MUTANTS: list[Mutant] = [
    Mutant(
        "tunix-none-target-drops-the-leaf",
        "jaxreshard/integrations/tunix.py",
        (
            (
                "        lambda d, o, k: k if d is None else o, dst, out, staying, "
                "is_leaf=_is_kept",
                "        lambda d, o, k: o, dst, out, staying, is_leaf=_is_kept",
            ),
        ),
        (
            "tests/test_tunix_adapter.py::"
            "test_a_none_target_leaves_its_source_where_it_is_as_tunix_does[a subtree]",
        ),
        "where the target holds None the result holds None, not the source's arrays that "
        "Tunix's path leaves in place",
    ),
    Mutant(
        "tunix-none-target-disables-donation",
        "jaxreshard/integrations/tunix.py",
        (
            (
                "    arrays = [x for _, x in flat if x is not None]\n",
                "    arrays = [x for _, x in flat]\n",
            ),
        ),
        (
            "tests/test_tunix_adapter.py::"
            "test_donate_target_reuses_the_rollout_buffers_beside_none_target_leaves",
        ),
        "with install(donate_target=True), a None anywhere in the target turns the reuse of "
        "its arrays off for the whole call",
    ),
    Mutant(
        "tunix-misfit-target-taken-apart",
        "jaxreshard/integrations/tunix.py",
        (("    return (prefix, False) if laid", "    return (prefix, True) if laid"),),
        (
            "tests/test_tunix_adapter.py::"
            "test_a_target_that_fits_the_source_neither_way_is_refused_by_jaxreshard",
        ),
        "a target that fits the source neither way has its None leaves taken out first, "
        "which raises JAX's bare pytree error instead of jaxreshard's",
    ),
    Mutant(
        "tunix-source-none-no-leaf",
        "jaxreshard/integrations/tunix.py",
        (
            (
                "tree_flatten_with_path(source, is_leaf=_is_kept)",
                "tree_flatten_with_path(source)",
            ),
        ),
        (
            "tests/test_tunix_adapter.py::"
            "test_a_none_in_both_models_states_stays_none_leaf_for_leaf",
        ),
        "a None in the source is no leaf while the target's None is one: two models' states "
        "with a None at the same place no longer match leaf for leaf",
    ),
    Mutant(
        "lone-stretch-kept-apart",
        SCHEDULE,
        (
            (
                "            stretch = None  # one ordinary unit holds it all: nothing repeats "
                "(see above)",
                "            pass",
            ),
        ),
        (f"{T_LOWER}::test_on_cpu_a_small_model_whose_layers_fit_one_unit_moves_in_one_step",),
        "repeated layers that fit one ordinary unit are still cut apart from the other "
        "leaves on CPU: a small model takes two steps (and a host sync) a call",
    ),
    Mutant(
        "runtime-calls-back-to-back-unwaited",
        RUNTIME,
        (
            (
                "                _LAST_STEP.remember(previous)",
                "                pass",
            ),
        ),
        (
            "tests/test_compiled.py::"
            "test_on_cpu_a_call_waits_for_the_last_calls_step_before_its_first_transfer",
        ),
        "on CPU a call's first transfer does not wait for the last call's last step: a "
        "one-step plan called back to back puts two calls' collectives in flight (XLA aborts)",
    ),
    Mutant(
        "runtime-last-step-per-plan",
        RUNTIME,
        (
            (  # each plan its own last step: plan B does not wait for plan A's
                "            previous = _LAST_STEP.arrays() if self.host_syncs else []\n",
                "            previous = [x for x in _LAST_STEP.arrays() if id(x) in self._mine]\n",
            ),
            (
                "                _LAST_STEP.remember(previous)",
                "                _LAST_STEP.remember(previous)\n"
                "                self._mine = {id(x) for x in previous}",
            ),
            (
                "        self._lock = threading.Lock()\n\n    # ---",
                "        self._lock = threading.Lock()\n        self._mine = set()\n\n    # ---",
            ),
        ),
        (
            "tests/test_compiled.py::"
            "test_on_cpu_a_plans_first_transfer_waits_for_another_plans_last_step",
        ),
        "on CPU a plan's call waits for the last call of the same plan only: plan B called "
        "right after plan A puts its collectives beside A's on the shared thread pool",
    ),
    Mutant(
        "chunk-choice-ignores-the-pool",
        SCHEDULE,
        (
            (  # the rule before: any change of round sizes between units is fresh staging
                "total += int(self.fault_cost * _faulted_bytes(needs, self.pool_bytes))",
                "shapes = [frozenset(+n) for n in needs]\n"
                "            total += int(self.fault_cost * sum(\n"
                "                sum(k * c for k, c in n.items())\n"
                "                for i, n in enumerate(needs) if shapes[i] != shapes[i - 1]\n"
                "            ))",
            ),
        ),
        (
            f"{T_PLANNER}::"
            "test_the_chunk_choice_prices_fresh_staging_only_where_the_pool_cannot_keep_it",
        ),
        "the chunk choice prices every change of round size as fresh staging, though the "
        "pool keeps every size: small trees get rounds cut to their smallest unit's streams",
    ),
    Mutant(
        "chunk-choice-pruned-by-the-best-bare-time",
        SCHEDULE,
        (
            (  # stops at the best's fault-free time, not its priced one: can miss the best
                "if (bare[c], -c) >= best_key:",
                "if (bare[c], -c) >= (bare[best], -best):",
            ),
        ),
        (f"{T_PLANNER}::test_the_chunk_choice_is_the_best_candidate_faults_included",),
        "the chunk choice stops pricing candidates once one's fault-free time reaches the "
        "best's fault-free time, though the best's faults may make a later one better",
    ),
    Mutant(
        "faulted-bytes-counts-each-need-once",
        SCHEDULE,
        (
            (  # every repeat of a need dropped, not only the ones right after an equal need
                "needs = [n for k, n in enumerate(needs) if k == 0 or n != needs[k - 1]]",
                "needs = [n for k, n in enumerate(needs) if n not in needs[:k]]",
            ),
        ),
        (
            f"{T_PLANNER}::"
            "test_runs_of_equal_needs_allocate_what_the_pool_policy_replayed_step_by_step_does",
        ),
        "the pool's replay drops every need seen before, not only the ones right after an "
        "equal need: a pool that frees and reallocates between alternating sizes looks free",
    ),
    Mutant(
        "lower-read-offset-off-by-one",
        LOWER,
        (
            (
                "                    offset = g.offset // w\n",
                "                    offset = g.offset // w + 1\n",
            ),
        ),
        (
            f"{T_LOWER}::test_lowered_programs_rebuild_every_destination_shard"
            "[disjoint gpt-by copies]",
        ),
        "pack lays each box one word past where the unpack reads it",
    ),
    Mutant(
        "lower-drops-local-copies",
        LOWER,
        (
            (
                "    unpacks = _unpacks(leaves, small, got, local, w, slots)",
                "    unpacks = _unpacks(leaves, small, got, (), w, slots)",
            ),
        ),
        (
            f"{T_LOWER}::test_lowered_programs_rebuild_every_destination_shard"
            "[colocated with local copies-by copies]",
            # (a layout whose held parts stay local copies: the colocated pair's pass
            # through slots of their own since 2026-12-06, `lower.Step.kept`)
            "tests/test_reshard.py::test_layout_pair[by copies-same devices, transposed split]",
        ),
        "the local copies of a step with a transfer are never done",
    ),
    Mutant(
        "lower-tables-in-reverse-device-order",
        LOWER,
        (
            (
                "        calls.append(PackCall(program, args, per_device, table))",
                "        calls.append(PackCall(program, args, per_device, table[::-1]))",
            ),
        ),
        (
            f"{T_LOWER}::test_lowered_programs_rebuild_every_destination_shard"
            "[disjoint gpt-by copies]",
            "tests/test_reshard.py::test_layout_pair[by copies-disjoint fsdp2xtp2 -> tp4]",
        ),
        "each device of a pack reads its boxes at another device's starts",
    ),
    Mutant(
        "schedule-drops-last-chunk",
        SCHEDULE,
        (("    return [tuple(c) for c in chunks]", "    return [tuple(c) for c in chunks[:-1]]"),),
        (
            f"{T_LOWER}::test_lowered_programs_rebuild_every_destination_shard"
            "[disjoint gpt, small buckets-by copies]",
        ),
        "the last chunk of every stream is never sent",
    ),
    Mutant(
        "schedule-buckets-past-the-limit",
        SCHEDULE,
        (
            (
                "            if group and sum(s for _, (s, _) in group) + size > cap:",
                "            if group and sum(s for _, (s, _) in group) + size > 4 * cap:",
            ),
        ),
        (
            f"{T_LOWER}::test_lowered_programs_rebuild_every_destination_shard"
            "[disjoint gpt, small buckets-by copies]",
        ),
        "rounds are grouped into buckets of up to four times bucket_bytes (staging above two "
        "buckets)",
    ),
    Mutant(
        "schedule-relays-beside-their-own-bytes",
        SCHEDULE,
        (
            (
                "            into = arriving[i + stage]",
                "            into = arriving[i]",
            ),
            (
                "                    later = arriving[i + stage]",
                "                    later = arriving[i]",
            ),
        ),
        (
            f"{T_LOWER}::test_relays_run_beside_the_next_units_cross_domain_sends",
            f"{T_LOWER}::test_a_large_leaf_relays_slab_by_slab",
        ),
        "pipelining keeps each unit's relays in its own buckets, beside the stage they forward "
        "from (a relay reads bytes that have not arrived)",
    ),
    Mutant(
        "schedule-stage-2-one-unit-late",
        SCHEDULE,
        (
            (
                "            into = arriving[i + stage]",
                "            into = arriving[i + min(stage, 1)]",
            ),
            (
                "                    later = arriving[i + stage]",
                "                    later = arriving[i + min(stage, 1)]",
            ),
        ),
        (
            f"{T_LOWER}::test_random_layouts_with_chained_domains_lower_exactly"
            "[True-by copies-as chosen]",
        ),
        "pipelining moves stage-2 relays one unit later, like stage 1: they run beside the "
        "forwards that bring their bytes (a relay reads bytes that have not arrived)",
    ),
    Mutant(
        "schedule-chained-stages-coloured-apart",
        SCHEDULE,
        (
            (
                "    if interleave and len(np.unique(stage[link == slowest])) > 1:",
                "    if False:",
            ),
        ),
        (f"{T_LOWER}::test_chained_units_colour_imports_and_forwards_together",),
        "a pipelined unit colours the sources' sends and the forwards between destination "
        "domains apart (a device that imports and forwards idles through the other's rounds)",
    ),
    Mutant(
        "schedule-tails-apart-from-full-chunks",
        SCHEDULE,
        (("    if ladder:\n        half = _align(chunk // 2)", "    if False:\n        half = 0"),),
        (
            "tests/test_planner.py::test_tails_rounded_up_to_a_chunk_are_coloured_with_the_full"
            "_chunks[tails over half a chunk]",
        ),
        "tails that travel in chunk-sized rounds anyway get rounds of their own (the busiest "
        "device's full chunks plus another device's tails)",
    ),
    Mutant(
        "schedule-alike-parts-lose-chunk-order",
        SCHEDULE,
        (
            (
                "merged[r].extend([((senders[s], receivers[d]), k) for (s, d), k in entries])",
                "merged[r].extend([((senders[s], receivers[d]), 0) for (s, d), k in entries])",
            ),
        ),
        (
            "tests/test_planner.py::test_colour_rounds_meets_the_konig_bound"
            "[racks-alike-full chunks]",
        ),
        "parts coloured once and mapped onto alike parts lose which chunk of a stream each "
        "round moves (chunks sent twice, others never)",
    ),
    Mutant(
        "schedule-slabs-along-the-first-dimension",
        SCHEDULE,
        (("    dim = _slab_dimension(pieces, k)", "    dim = 0"),),
        (f"{T_LOWER}::test_slabs_cut_the_dimension_every_sender_spans",),
        "a large leaf is cut into slabs along its first dimension, even where the sources split "
        "it (each slab then takes bytes from a few senders only)",
    ),
    Mutant(
        "lower-staging-forgets-idle-buffers",
        LOWER,
        (
            (
                "        idle = tuple(\n"
                "            dict.fromkeys(s for t, s in recv if (d, t) not in senders and (d, t) "
                "not in shared)\n"
                "        )\n",
                "        idle = ()\n",
            ),
        ),
        ("tests/test_compiled.py::test_staging_held_by_the_runtime_is_what_the_plan_reports",),
        "the staging the plan reports leaves out the buffers passed for rounds a device sends "
        "nothing in (the runtime holds more than reported)",
    ),
    Mutant(
        "runtime-bfloat16-written-in-place-on-cpu",
        RUNTIME,
        (
            (
                "        return dtype in (jnp.dtype(jnp.float16), jnp.dtype(jnp.float32), "
                "jnp.dtype(jnp.float64))",
                "        return True",
            ),
        ),
        ("tests/test_reshard.py::test_every_dtype_is_moved_bit_for_bit[by copies-bfloat16]",),
        "bfloat16 destinations written with XLA's CPU dynamic-update-slice (via float32: NaN "
        "payloads quietened)",
    ),
    Mutant(
        "lower-gather-reads-a-box-backwards",
        LOWER,
        (
            (
                "            picks.append(base[_arg(g)] + at)",
                "            picks.append(base[_arg(g)] + at[::-1])",
            ),
        ),
        (
            f"{T_LOWER}::test_lowered_programs_rebuild_every_destination_shard"
            "[disjoint gpt-by gathers]",
        ),
        "a pack's gather reads each small box's words in reverse order",
    ),
    Mutant(
        "lower-rebuild-forgets-the-old-words",
        LOWER,
        (
            (
                "        self.keep = [i for i in self.targets if i in short or i in self.keep]",
                "        self.keep = []",
            ),
        ),
        (
            f"{T_LOWER}::test_a_small_leaf_moved_over_several_steps_keeps_what_the_others_wrote",
            "tests/test_reshard.py::test_every_dtype_is_moved_bit_for_bit[by gathers-float32]",
        ),
        "a small leaf cut over several steps is rebuilt from this step's words only: what the "
        "other steps wrote is lost",
    ),
    Mutant(
        "schedule-gathered-leaf-counted-per-piece",
        SCHEDULE,
        (
            (
                "_load(leaf, self.columns[i], n, gathered(leaf, gather_bytes), self.local_of",
                "_load(leaf, self.columns[i], n, False, self.local_of",
            ),
        ),
        (f"{T_LOWER}::test_small_leaves_move_by_one_gather_per_program_not_a_copy_per_piece",),
        "a leaf that moves by gathers still counts a copy per piece against the unit cap (many "
        "more units, steps and rounds for trees of small leaves)",
    ),
    Mutant(
        "schedule-tail-ignores-a-busy-receiver",
        SCHEDULE,
        (
            (
                "            free = masks[large - 1] & ~(busy_src[pair[0]] | busy_dst[pair[1]]) "
                "if large else 0",
                "            free = masks[large - 1] & ~busy_src[pair[0]] if large else 0",
            ),
        ),
        (f"{T_PLANNER}::test_a_tail_takes_a_free_slot_of_a_larger_round_on_a_cluster",),
        "a tail takes a slot of a larger round where its sender is free but its receiver may "
        "not be: a device receives twice in one round",
    ),
    Mutant(
        "schedule-stream-key-ignores-bytes",
        SCHEDULE,
        (
            (
                "return tuple((self._cut_id(cut), totals.tobytes()) for cut, totals in slabs)",
                'return tuple((self._cut_id(cut), b"") for cut, totals in slabs)',
            ),
        ),
        (f"{T_LOWER}::test_units_share_a_stream_key_only_where_their_streams_are_equal",),
        "units are keyed by their slabs' cuts alone, not the bytes each slab puts on its streams "
        "(slabs of one leaf that differ in size reuse one unit's rounds: bytes never sent)",
    ),
    Mutant(
        "schedule-chunk-model-rows-by-sizes-only",
        SCHEDULE,
        (
            (
                "key = (stages[m], sizes[a * ws : b * ws], counts[a * wc : b * wc])",
                'key = (stages[m], sizes[a * ws : b * ws], b"")',
            ),
        ),
        (f"{T_PLANNER}::test_the_chunk_model_prices_the_busiest_device_of_each_stage",),
        "the chunk model counts devices whose streams have the same sizes as one, however many "
        "streams each has (the busiest device's rounds undercounted)",
    ),
    Mutant(
        "schedule-colour-memo-hands-out-its-own-lists",
        SCHEDULE,
        (
            (
                "        return [list(entries) for entries in self.known[key]]",
                "        return self.known[key]",
            ),
        ),
        (f"{T_PLANNER}::test_remembered_colourings_are_the_colourings_and_stay_unchanged",),
        "a remembered colouring is handed out as the memo's own lists, so a caller adding "
        "entries to a round changes the next unit's rounds",
    ),
    Mutant(
        "schedule-parts-without-the-stage-full-rounds",
        SCHEDULE,
        (
            (
                "dict.fromkeys(kind, cls), ladder, coloured, most)",
                "dict.fromkeys(kind, cls), ladder, coloured)",
            ),
        ),
        (f"{T_PLANNER}::test_racks_relaying_inside_themselves_are_planned_once_each_kind[0]",),
        "a stage planned part by part gives each part only its own full-chunk rounds, so a "
        "small rack's tails take rounds of their own instead of the slots the stage's other "
        "racks leave free",
    ),
    Mutant(
        "schedule-parts-ranked-senders-apart-from-receivers",
        SCHEDULE,
        (
            (
                "        rank_s, rank_d = np.searchsorted(devices, s), np.searchsorted(devices, d)",
                "        rank_s, rank_d = np.unique(s, return_inverse=True)[1], np.searchsorted("
                "devices, d)",
            ),
        ),
        (f"{T_PLANNER}::test_a_stage_planned_part_by_part_is_the_stage_planned_whole",),
        "a part's senders are numbered apart from its receivers, so the kinds of parts alike "
        "are told apart wrongly and a sender of one rack stands for another's receiver",
    ),
    Mutant(
        "schedule-ranked-parts-not-looked-into",
        SCHEDULE,
        (
            (
                "            alike[key] = colour_rounds(ranked, ranked_order)",
                "            alike[key] = _colour_connected(ranked, ranked_order)",
            ),
        ),
        (f"{T_PLANNER}::test_a_part_ranked_on_its_own_may_fall_apart_and_is_coloured_so",),
        "a part of a stage, ranked on its own, is coloured whole even where its sends and "
        "receives fall apart: a tail finds no free slot and takes a round of its own",
    ),
    Mutant(
        "schedule-parts-never-give-way",
        SCHEDULE,
        (
            (
                "        sum(asked[kind][call] for kind, _ in members) == 1 for call in",
                "        False and sum(asked[kind][call] for kind, _ in members) == 1 for call in",
            ),
        ),
        (f"{T_PLANNER}::test_parts_give_way_to_the_whole_stage_where_one_part_has_full_chunks",),
        "a stage is planned part by part even where one part alone has full chunks, which the "
        "whole stage colours as a graph of its own: other rounds than the whole stage's",
    ),
    Mutant(
        "schedule-chained-chunks-leave-no-room",
        SCHEDULE,
        (("        beside_slowest=2 if chained else 0,", "        beside_slowest=0,"),),
        (
            "tests/test_simulate.py::"
            "test_chained_plans_leave_room_for_two_faster_rounds_beside_a_slow_one",
        ),
        "a chained plan's faster chunks leave no room for two beside one of the slowest links' "
        "(a lane's extra round takes a bucket where the other lane idles)",
    ),
    Mutant(
        "schedule-lanes-never-share-buckets",
        SCHEDULE,
        (("        if together < apart:", "        if False:"),),
        ("tests/test_simulate.py::test_where_lanes_overlap_a_bucket_holds_a_round_of_each",),
        "the faster links' chunks never shrink to fit beside the slowest's, so where the two "
        "do not fit one bucket each lane takes buckets of its own and the lanes never overlap",
    ),
    Mutant(
        "schedule-lanes-share-buckets-at-any-price",
        SCHEDULE,
        (("        if together < apart:", "        if True:"),),
        ("tests/test_simulate.py::test_a_sliver_beside_the_slowest_chunks_is_not_taken",),
        "the faster links' chunks shrink into whatever sliver the slowest's leave in a bucket, "
        "rounds that cost more latency than the lanes' overlap wins back",
    ),
    Mutant(
        "costmodel-timeline-ties-to-the-last",
        "jaxreshard/tools/costmodel.py",
        (
            (
                "parts[:, int(np.argmax(_totals(parts)))]",
                "parts[:, -1 - int(np.argmax(_totals(parts)[::-1]))]",
            ),
        ),
        ("tests/test_simulate.py::test_the_gpu_timeline_equals_a_clock_per_device_to_the_bit",),
        "the GPU timeline's barrier takes the last of the clocks tied for the latest, not the "
        "first (the parts reported on the critical path change)",
    ),
    Mutant(
        "costmodel-contiguous-at-box-speed",
        "jaxreshard/tools/costmodel.py",
        (
            (
                "        flat_bw = profile.contiguous_copy_bandwidth or wide_bw",
                "        flat_bw = wide_bw",
            ),
        ),
        ("tests/test_simulate.py::test_boxes_of_one_contiguous_run_copy_at_the_contiguous_speed",),
        "boxes of one contiguous run copy at the box copy's speed: the CPU calibration "
        "over-prices whole-row packs and unpacks by about 2x",
    ),
    Mutant(
        "costmodel-floor-without-copies",
        "jaxreshard/tools/costmodel.py",
        (
            (
                "        return wire + copies / copy_rate, copies",
                "        return wire, copies",
            ),
        ),
        ("tests/test_simulate.py::test_executor_floor_by_hand",),
        "the executor floor forgets that a domain's devices copy beside their rounds: it is the "
        "bound at the links' efficiency again",
    ),
    Mutant(
        "costmodel-floor-copies-on-one-device",
        "jaxreshard/tools/costmodel.py",
        (
            (
                "copy = max(copy, profile.narrow_copy_bandwidth or 0.0, profile.contiguous_copy_",
                "copy = copy / 64 if 1 else (copy, profile.contiguous_copy_",
            ),
        ),
        (
            "tests/test_topology.py::test_random_layouts_and_domains_on_virtual_devices",
            "tests/test_simulate.py::test_executor_floor_charges_a_sole_holders_packs",
        ),
        "the executor floor prices copies 64x slower than the model does: a floor above what "
        "plans are priced at",
    ),
    Mutant(
        "costmodel-floor-nics-bring-only-the-imports",
        "jaxreshard/tools/costmodel.py",
        (
            (
                "return min(priced(m) for m in (imports, exports, needs) if m >= imports)",
                "return priced(imports)",
            ),
        ),
        (
            "tests/test_simulate.py::test_executor_floor_lets_the_nics_carry_more_where_copies_are_slower",
        ),
        "the executor floor assumes a domain's NICs bring in only what it must import, where "
        "copies slower than the NICs make bringing more the cheaper plan: no floor then",
    ),
    Mutant(
        "costmodel-m2n-pays-the-executors-dispatch",
        "jaxreshard/tools/costmodel.py",
        (
            (
                "        seconds += 2 * busiest / profile.copy_bandwidth  # pack on the sender, "
                "unpack on arrival\n",
                "        seconds += 2 * busiest / profile.copy_bandwidth\n"
                "        seconds += math.ceil(busiest / staging_bytes) * profile.bucket_overhead\n",
            ),
        ),
        (
            "tests/test_simulate.py::"
            "test_baselines_charge_no_host_cost_and_round_robin_carries_its_turn",
        ),
        "the M2N-like baseline is charged the executor's JAX dispatch per 256 MiB, one after "
        "the other, where the plan's host work runs beside its GPUs' (it favours the plan)",
    ),
    Mutant(
        "costmodel-round-robin-restarts-every-part",
        "jaxreshard/tools/costmodel.py",
        (
            (
                "                    s = replicas[(first + k) % len(replicas)]",
                "                    s = replicas[k % len(replicas)]",
            ),
        ),
        (
            "tests/test_simulate.py::"
            "test_baselines_charge_no_host_cost_and_round_robin_carries_its_turn",
        ),
        "direct round-robin restarts at the first replica for every part: the first replicas "
        "send every part's first share (a pessimistic baseline)",
    ),
    Mutant(
        "simulate-tp-replicates-query-heads",
        "jaxreshard/tools/simulate.py",
        (("    if replicate and ways % units == 0:", "    if ways % units == 0:"),),
        (
            "tests/test_simulate.py::test_cli_refuses_a_bad_setup_with_its_reason_not_a_traceback"
            "[argv14-attn.q: 32 units of 128 cannot be split]",
        ),
        "a TP beyond the query heads replicates them (a layout vLLM refuses) instead of being "
        "refused",
    ),
    Mutant(
        "simulate-scenario-takes-a-placement",
        "jaxreshard/tools/simulate.py",
        (('        "--placement": args.placement,\n', ""),),
        ("tests/test_simulate.py::test_cli_refuses_setup_arguments_a_scenario_would_ignore",),
        "--placement beside --scenario or --all is taken, and the scenario prints its published "
        "comparison beside another placement",
    ),
    Mutant(
        "simulate-summary-two-lanes-is-the-ratio",
        "jaxreshard/tools/simulate.py",
        (
            (
                "two = two_lanes / bound if two_lanes is not None and bound else "
                'r["modeled_over_bound"]',
                'two = r["modeled_over_bound"]',
            ),
        ),
        ("tests/test_simulate.py::test_the_summary_reads_each_scenarios_record",),
        "the summary's two-lane column repeats the modeled ratio (read from the record)",
    ),
    Mutant(
        "verify-checksum-rank-promotion",
        "jaxreshard/run/verify.py",
        (
            (
                "    col_hash = col_hash.reshape((1,) * len(lead) + col_hash.shape)",
                "    col_hash = col_hash",
            ),
        ),
        ("tests/test_verify.py::test_verify_and_a_verified_refit_run_under_rank_promotion_raise",),
        "the checksum broadcasts a row of column hashes by rank promotion, which "
        "jax.numpy_rank_promotion('raise') refuses",
    ),
    Mutant(
        "verify-wide-words-folded",
        "jaxreshard/run/verify.py",
        (
            (
                "    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 64 bits: (..., 2)",
                "    pair = jax.lax.bitcast_convert_type(x, jnp.uint32)\n"
                "    return pair[..., :1] ^ (pair[..., 1:] * np.uint32(0x85EBCA6B))",
            ),
        ),
        (
            "tests/test_verify.py::"
            "test_an_element_of_several_words_changed_in_all_of_them_is_found[float64]",
        ),
        "verify folds a 64-bit element into one word before hashing: a change of both halves "
        "that keeps the fold passes",
    ),
    Mutant(
        "api-rank-promotion-left-as-the-caller-set-it",
        "jaxreshard/api.py",
        (
            (
                "            (jax.numpy_rank_promotion, jax.config.jax_numpy_rank_promotion, "
                '"allow"),\n',
                "",
            ),
        ),
        (
            "tests/test_leaves.py::test_debugging_settings_neither_stop_a_refit_nor_cost_the_"
            "donated_tree[numpy_rank_promotion-raise-process]",
        ),
        "a plan's programs are traced under the process's rank promotion setting, part of their "
        "cache key: a call under 'raise' compiles them again",
    ),
    Mutant(
        "verify-skips-fallback-leaves",
        "jaxreshard/api.py",
        (
            (
                "self._verifier.check(src, results, also=self._fallback_problems(flat, out))",
                "self._verifier.check(src, results)",
            ),
        ),
        ("tests/test_verify.py::test_fallback_leaves_are_verified_too",),
        "verify leaves fallback='device_put' leaves unchecked: a wrong one passes",
    ),
    Mutant(
        "await-raises-on-a-freed-result",
        "jaxreshard/run/runtime.py",
        (
            (
                "            except Exception:\n                if not x.is_deleted():\n"
                "                    raise",
                "            except Exception:\n                raise",
            ),
        ),
        (
            "tests/test_async.py::"
            "test_a_result_freed_by_another_thread_while_a_call_waits_for_it_is_left_out",
        ),
        "a result deleted by another thread while a call waits for it fails the call",
    ),
    Mutant(
        "cpu-calls-interleave",
        "jaxreshard/run/runtime.py",
        (
            (
                "        with self._lock, _CPU_CALLS if self.host_syncs else "
                "contextlib.nullcontext():",
                "        with self._lock, contextlib.nullcontext():",
            ),
        ),
        (
            "tests/test_async.py::"
            "test_calls_of_two_plans_made_at_once_on_two_threads_run_one_after_the_other",
        ),
        "on CPU two plans' calls made at once on two threads interleave their steps",
    ),
    Mutant(
        "tunix-installed-leaves-its-options",
        "jaxreshard/integrations/tunix.py",
        (
            (
                "            _FALLBACK, _DONATE_TARGET = options  # direct call",
                "            pass  # direct call",
            ),
        ),
        (
            "tests/test_tunix_adapter.py::"
            "test_installed_puts_back_the_options_in_force_before_the_block",
        ),
        "an installed() block inside an installed adapter leaves its options behind (later "
        "syncs donate the caller's targets)",
    ),
    Mutant(
        "tunix-donate-input-deletes-a-kept-array",
        "jaxreshard/integrations/tunix.py",
        (("and own.isdisjoint(_addresses(x)):", ":"),),
        (
            "tests/test_tunix_adapter.py::"
            "test_one_array_kept_and_moved_is_never_deleted_from_the_result",
        ),
        "donate_input=True deletes an array the result keeps at another path",
    ),
    Mutant(
        "tunix-donates-a-kept-source",
        "jaxreshard/integrations/tunix.py",
        (
            (
                "    if old is not None and not _addresses(old).isdisjoint(_addresses(source)):",
                "    if False:",
            ),
        ),
        (
            "tests/test_tunix_adapter.py::"
            "test_one_array_kept_and_moved_is_never_deleted_from_the_result",
        ),
        "install(donate_target=True) donates a target array that is a kept source leaf",
    ),
    Mutant(
        "codec-xla-rounds-integers-to-bf16",
        "jaxreshard/run/codec.py",
        (('        platform == "cpu"\n', '        platform == "never"\n'),),
        (
            "tests/test_reshard.py::"
            "test_an_integer_cast_to_bfloat16_leaves_other_16_bit_leaves_bit_for_bit",
        ),
        "XLA CPU converts an integer to bfloat16 in a pack that gathers it beside other 16-bit "
        "words, whose subnormals and NaN payloads it then changes",
    ),
    Mutant(
        "logical-device-ids-ignored-in-layouts",
        "jaxreshard/api.py",
        (
            (
                "    if isinstance(sharding, NamedSharding) and boundary.logical_ids(sharding) "
                "is None:",
                "    if isinstance(sharding, NamedSharding):",
            ),
        ),
        (
            "tests/test_leaves.py::"
            "test_a_named_sharding_with_permuted_logical_devices_places_data_as_jax_does",
        ),
        "a source NamedSharding with permuted logical devices is laid out by mesh and spec "
        "alone: local copies of the wrong rows beside destinations on its devices",
    ),
    Mutant(
        "destinations-by-path-in-order-only",
        "jaxreshard/api.py",
        (
            (
                "        if sorted(got) == sorted(expected) and len(set(got)) == len(got):",
                "        if got == expected:",
            ),
        ),
        (
            "tests/test_errors.py::"
            "test_a_destination_dict_beside_an_ordered_dict_of_another_order_is_taken_by_path",
        ),
        "a destination tree with the source's paths in another order is refused",
    ),
    Mutant(
        "costmodel-permutes-always-overlap",
        "jaxreshard/tools/costmodel.py",
        (
            (
                "    return profile.overlap_links and profile.permutes_overlap",
                "    return profile.overlap_links",
            ),
        ),
        (
            "tests/test_simulate.py::"
            "test_a_buckets_rounds_overlap_only_where_links_and_the_backend_both_allow",
            "tests/test_simulate.py::test_executor_floor_by_hand",
        ),
        "a bucket's NIC and NVLink rounds are priced at once though XLA GPU compiles them one "
        "after another (the modeled time and the floor of the two-lane world)",
    ),
    Mutant(
        "costmodel-floor-serial-lanes-free",
        "jaxreshard/tools/costmodel.py",
        (
            (
                "        wire = max(moved, exports) / nic_rate + (inside / nvl_rate if nvl_rate "
                "else 0.0)",
                "        wire = max(moved, exports) / nic_rate",
            ),
        ),
        ("tests/test_simulate.py::test_executor_floor_by_hand",),
        "the executor floor lets a domain's messages inside it hide under its NICs' share "
        "though a device takes one message at a time",
    ),
]
API = "jaxreshard/api.py"

SURFACE_MUTANTS: list[Mutant] = [
    Mutant(
        "api-donated-tree-read-as-source",
        API,
        (
            (
                "            if problem is None and sources is None and _DONATED.holds(x):",
                "            if False:",
            ),
        ),
        (
            "tests/test_async.py::"
            "test_a_result_donated_to_a_refit_in_flight_is_neither_donated_again_nor_read",
        ),
        "a tree donated to a refit in flight may be read as a source while the refit "
        "overwrites it (JAX fails mid-call; donating it twice, the other half of the check, "
        "crashes XLA outright, which this harness cannot tell from a broken test)",
    ),
    Mutant(
        "verify-sub-byte-as-bytes",
        "jaxreshard/run/verify.py",
        (
            (
                "    bits = jax.dtypes.itemsize_bits(dtype)  # not itemsize: 4-bit and 2-bit "
                "types take 1 byte",
                "    bits = dtype.itemsize * 8",
            ),
        ),
        (
            "tests/test_verify.py::"
            "test_sub_byte_and_complex_leaves_verify_and_a_moved_element_is_found[8-int4]",
        ),
        "verify bit-casts a 4-bit leaf to bytes (two elements to a word)",
    ),
    Mutant(
        "verify-words-summed-unmixed",
        "jaxreshard/run/verify.py",
        (
            (
                "    per_row = jnp.sum(_mix(words ^ col_hash), axis=-1, dtype=jnp.uint32)",
                "    per_row = jnp.sum(words ^ col_hash, axis=-1, dtype=jnp.uint32)",
            ),
        ),
        ("tests/test_verify.py::test_the_same_bit_flipped_in_two_words_is_found[31]",),
        "verify sums each word xor its column hash unmixed, so two sign flips cancel mod 2**32",
    ),
    Mutant(
        "runtime-casting-copies-with-the-older-emitters",
        "jaxreshard/run/runtime.py",
        (
            (
                "    return None if casts else copy_options(platform)",
                "    return copy_options(platform)",
            ),
        ),
        (
            "tests/test_reshard.py::"
            "test_a_cast_gives_the_bits_of_astype_sent_and_copied_locally[float8_e4m3fnuz]",
        ),
        "pack and unpack programs that cast compile with XLA's older CPU fusion emitters",
    ),
    Mutant(
        "runtime-compiles-ahead-without-the-callers-settings",
        "jaxreshard/run/runtime.py",
        (("    settings = _thread_settings()", "    settings = contextlib.nullcontext"),),
        (
            "tests/test_compiled.py::"
            "test_the_first_call_compiles_its_programs_together_before_any_step_runs",
        ),
        "the compile threads run without the settings the call holds for its thread (the "
        "plan's own x64), so each step compiles its program a second time",
    ),
    Mutant(
        "schedule-units-cut-in-tree-order-across-meshes",
        SCHEDULE,
        (
            (
                "        for index in itertools.chain.from_iterable(groups.values()):",
                "        for index in indices:",
            ),
        ),
        (f"{T_LOWER}::test_leaves_of_the_same_meshes_share_units_wherever_they_sit_in_the_tree",),
        "leaves alternating between mesh pairs make a unit (a step) each",
    ),
    Mutant(
        "verify-rows-weigh-alike",
        "jaxreshard/run/verify.py",
        (
            (
                "    row_weight = _mix(row) * np.uint32(2) + np.uint32(1)",
                "    row_weight = jnp.ones_like(row)",
            ),
        ),
        ("tests/test_verify.py::test_data_in_the_wrong_place_is_found",),
        "every row weighs the same, so rows moved within a shard (reversed) pass",
    ),
    Mutant(
        "api-fallback-result-is-the-source",
        "jaxreshard/api.py",
        (
            (
                "        out = jax.device_put(value, dst, may_alias=False)",
                "        out = jax.device_put(value, dst)",
            ),
        ),
        (
            "tests/test_leaves.py::"
            "test_a_fallback_leaf_already_in_place_is_copied_so_donating_it_spares_the_source",
        ),
        "a fallback leaf already in its destination sharding comes back as the source array, "
        "so donating the result deletes the source",
    ),
    Mutant(
        "api-donated-fallback-leaf-unchecked",
        "jaxreshard/api.py",
        (
            (
                "        fallen_donated = self._fallback_results if sources is not None else []",
                "        fallen_donated = []",
            ),
        ),
        (
            "tests/test_leaves.py::"
            "test_a_donated_fallback_leaf_is_checked_like_a_moved_one_before_anything_is_deleted",
        ),
        "a donate= leaf at a fallback leaf is not checked and is deleted after the call: an "
        "array over a source's buffers (the source with it) or of another shape",
    ),
    Mutant(
        "tunix-host-leaves-under-none-target-uncounted",
        "jaxreshard/integrations/tunix.py",
        (("    host = _kept_host_leaves(dst, source) if kept else []", "    host = []"),),
        (
            "tests/test_tunix_adapter.py::"
            "test_host_leaves_under_a_none_target_become_arrays_as_tunix_makes_them",
        ),
        "NumPy arrays and Python scalars under a None target are not fallback leaves: "
        "install(fallback=None) lets them through, and they go uncounted",
    ),
    Mutant(
        "fp8-quantizer-takes-the-callers-sharding",
        "jaxreshard/quant.py",
        (("    if x.sharding is sharding or x.sharding == sharding:\n", "    if True:\n"),),
        ("tests/test_fp8.py::test_transfers_hold_collective_permutes_only_and_calls_compile_once",),
        "the fp8 quantizer runs on the caller's sharding object: the same layout spelled "
        "otherwise (another mesh's axis names) compiles it again",
    ),
    Mutant(
        "api-plan-runs-under-the-callers-x64",
        "jaxreshard/api.py",
        (("            (jax.enable_x64, bool(jax.config.jax_enable_x64), x64),\n", ""),),
        ("tests/test_reshard.py::test_a_plan_runs_under_the_x64_setting_it_was_made_under",),
        "a plan's programs are traced under the caller's jax_enable_x64, not the plan's: a "
        "float64 cast planned with it on fails when called with it off",
    ),
    Mutant(
        "api-own-dtype-entry-keeps-weak-type",
        "jaxreshard/api.py",
        (
            (
                "            typed = _takes_entry(src_dtype, want, own)",
                "            typed = dst_dtype != src_dtype",
            ),
        ),
        (
            "tests/test_leaves.py::"
            "test_weakly_typed_leaves_arrive_weakly_typed_as_device_put_keeps_them",
        ),
        "a weakly typed leaf given a dtype= entry of its own dtype stays weak, where astype "
        "makes it strong",
    ),
    Mutant(
        "multihost-given-up-agreement-left-as-agreed",
        "jaxreshard/run/multihost.py",
        (("            if not self.mismatched:\n", "            if False:\n"),),
        (
            "tests/test_multihost.py::"
            "test_a_peer_arriving_after_an_agreement_was_given_up_raises_instead_of_passing",
        ),
        "a round of agreement given up for a timeout keeps its fingerprint: a late peer agrees "
        "with it and enters a transfer the other process never makes",
    ),
    Mutant(
        "api-wide-leaves-planned-without-x64-run-without-it",
        "jaxreshard/api.py",
        (
            (
                "        self.x64 = bool(jax.config.jax_enable_x64) or any(",
                "        self.x64 = bool(jax.config.jax_enable_x64) and any(",
            ),
        ),
        ("tests/test_reshard.py::test_a_plan_runs_under_the_x64_setting_it_was_made_under",),
        "a plan of 64-bit arrays made outside jax.enable_x64 runs with it off, and fails in XLA",
    ),
    Mutant(
        "api-fallback-own-dtype-keeps-weak-type",
        "jaxreshard/api.py",
        (
            (
                "    return shape, dtype, (_cast(dtype, want, own) if takes else None)",
                "    cast = _cast(dtype, want, own)\n"
                "    return shape, dtype, (None if cast == dtype else cast)",
            ),
        ),
        ("tests/test_leaves.py::test_a_fallback_leaf_taking_its_own_dtype_is_strongly_typed_too",),
        "a weakly typed fallback leaf given a dtype= entry of its own dtype stays weak",
    ),
    Mutant(
        "api-donate-tree-of-other-metadata-refused",
        "jaxreshard/api.py",
        (
            (
                "        if treedef != self.treedef and not (sources is not None and "
                "self._same_paths(tree)):",
                "        if treedef != self.treedef:",
            ),
        ),
        (
            "tests/test_leaves.py::"
            "test_a_samplers_own_nnx_state_of_other_annotations_is_taken_as_donate",
        ),
        "a donate= tree that differs from the source's only in container metadata (a sampler's "
        "nnx.State of its own annotations) is refused",
    ),
    Mutant(
        "api-nnx-level-difference-listed-leaf-by-leaf",
        "jaxreshard/api.py",
        (
            (
                '    wrapped = bool(missing) and sorted(extra) == sorted(p + ".value" for p in '
                "missing)",
                "    wrapped = False",
            ),
        ),
        (
            "tests/test_errors.py::"
            "test_shardings_as_an_nnx_state_over_a_pure_dict_source_say_so_once",
        ),
        "shardings given as an nnx.State over a pure-dict source list every leaf twice, "
        "without saying that the Variable level is the one difference",
    ),
    Mutant(
        "api-manual-source-read-over-manual-axes",
        "jaxreshard/api.py",
        (("src_sharding = boundary.as_named(src_sharding, shape)", "pass"),),
        ("tests/test_leaves.py::test_a_source_over_manual_mesh_axes_moves_as_over_auto_ones",),
        "a source whose mesh axes are Manual is read over them: the pack program takes each "
        "shard for the whole array and fails in XLA",
    ),
    Mutant(
        "fp8-quantizer-beside-a-call-in-flight",
        "jaxreshard/quant.py",
        (
            (
                "in runtime.between_calls(self._platforms, dispatch):",
                "in dispatch():",
            ),
        ),
        (
            "tests/test_fp8.py::"
            "test_the_quantizers_collectives_wait_for_the_call_on_the_cpu_devices",
        ),
        "the fp8 quantizer's collectives are dispatched on CPU while a call (a started refit "
        "on the worker) has its own in flight on the same devices",
    ),
    Mutant(
        "fp8-source-donated-in-flight-quantized",
        "jaxreshard/api.py",
        (("if problem is None and _DONATED.holds(flat[i]):", "if False:"),),
        (
            "tests/test_fp8.py::"
            "test_a_source_donated_to_a_refit_in_flight_is_refused_before_quantizing",
        ),
        "an fp8 plan's source donated to a refit in flight is quantized (after that refit has "
        "consumed it: the process crashes) where a plain plan refuses it",
    ),
    Mutant(
        "fp8-quantizer-over-manual-axes",
        "jaxreshard/api.py",
        (
            (
                "on_mesh = boundary.as_auto(boundary.as_named(x.sharding, shape))",
                "on_mesh = x.sharding",
            ),
        ),
        ("tests/test_fp8.py::test_a_source_over_manual_mesh_axes_quantizes_as_over_auto_ones",),
        "an fp8 plan's quantizer computes over the source's Manual mesh axes: a block "
        "straddling shards fails inside JAX",
    ),
    Mutant(
        "fp8-cross-process-quantizer-planned",
        "jaxreshard/api.py",
        (("            and jax.process_count() > 1\n", "            and False\n"),),
        (
            "tests/test_multihost.py::"
            "test_fp8_scales_needing_a_collective_across_processes_are_refused_by_name",
        ),
        "an fp8 leaf whose scales need a collective across processes is planned: its "
        "quantizer runs before the calls' order check, and a start beside a call hangs",
    ),
    Mutant(
        "runtime-first-call-at-shutdown-compiles-on-threads",
        "jaxreshard/run/runtime.py",
        (
            (
                "        except RuntimeError as e:  # interpreter shutdown",
                "        except ZeroDivisionError as e:  # interpreter shutdown",
            ),
        ),
        ("tests/test_async.py::test_a_refit_started_at_interpreter_shutdown_runs",),
        "a plan's first call at interpreter shutdown raises concurrent.futures' raw error "
        "from the compile threads it cannot start",
    ),
    Mutant(
        "api-start-at-shutdown-raises-the-executors-error",
        "jaxreshard/api.py",
        (
            (
                '    except RuntimeError as e:  # "cannot schedule new futures after '
                '(interpreter) shutdown"',
                "    except ZeroDivisionError as e:",
            ),
        ),
        ("tests/test_async.py::test_a_refit_started_at_interpreter_shutdown_runs",),
        "a refit started at interpreter shutdown (a training thread still running, an atexit "
        "hook's final sync) raises concurrent.futures' raw RuntimeError",
    ),
    Mutant(
        "api-cache-keys-sources-by-mesh",
        "jaxreshard/api.py",
        (
            (
                "        return (s._to_xla_hlo_sharding(ndim), s._internal_device_list, "
                "s.memory_kind)",
                "        return (s._to_xla_hlo_sharding(ndim), s._internal_device_list, "
                "s.memory_kind, s.mesh)",
            ),
        ),
        (
            "tests/test_compiled.py::"
            "test_one_layout_on_a_mesh_of_other_axis_names_shares_one_cached_plan",
        ),
        "the plan cache keys a source by its mesh: a source on the same devices under other "
        "axis names plans and compiles again",
    ),
    Mutant(
        "api-programs-run-under-the-callers-thread-settings",
        "jaxreshard/api.py",
        (("    stack.enter_context(caller_settings_unset())", "    pass"),),
        (
            "tests/test_compiled.py::"
            "test_a_refit_compiles_nothing_again_under_settings_the_caller_holds_alone",
        ),
        "a plan's programs run under the settings the caller's thread holds (a mesh, a matmul "
        "precision), part of JAX's cache key: a call under another compiles them again",
    ),
    Mutant(
        "runtime-context-meshes-kept",
        "jaxreshard/run/runtime.py",
        (
            (
                "                if isinstance(v, config) and not isinstance(v, jax_config.State)",
                "                if False",
            ),
        ),
        (
            "tests/test_compiled.py::"
            "test_a_refit_compiles_nothing_again_under_settings_the_caller_holds_alone",
        ),
        "the caller's jax.set_mesh (JAX's context values outside its config states) is not set "
        "aside: a refit called inside it compiles its programs again",
    ),
    Mutant(
        "runtime-bf16-targets-written-through-fused-bitcasts",
        "jaxreshard/run/runtime.py",
        (("    return bits_dtype(dtype)\n", "    return None\n"),),
        (
            "tests/test_compiled.py::"
            "test_on_cpu_a_leaf_cut_into_slabs_is_written_in_place_whatever_its_dtype",
        ),
        "an unpack writes a bfloat16 target through bitcasts fused with its writes: every "
        "unpack rewrites the whole destination shard (a leaf in K slabs: K passes)",
    ),
    Mutant(
        "runtime-bitcasts-compiled-as-copies",
        "jaxreshard/run/runtime.py",
        (
            (
                '                compiler_options=copy_options("cpu"),',
                "                compiler_options=None,",
            ),
        ),
        (
            "tests/test_compiled.py::"
            "test_on_cpu_a_leaf_cut_into_slabs_is_written_in_place_whatever_its_dtype",
        ),
        "the bitcasts around an unpack compile with XLA's newer CPU emitters, which copy the "
        "whole destination shard twice",
    ),
    Mutant(
        "api-stats-miss-the-bitcasts",
        "jaxreshard/api.py",
        (("            bitcasts_per_call(lowered, platforms),\n", ""),),
        (
            "tests/test_compiled.py::"
            "test_on_cpu_a_leaf_cut_into_slabs_is_written_in_place_whatever_its_dtype",
        ),
        "plan.stats counts no program or dispatch for the bitcasts around unpacks",
    ),
    Mutant(
        "api-cache-ignores-memory-kind",
        "jaxreshard/api.py",
        (
            (
                "return (s._to_xla_hlo_sharding(ndim), s._internal_device_list, s.memory_kind)",
                "return (s._to_xla_hlo_sharding(ndim), s._internal_device_list)",
            ),
        ),
        (
            "tests/test_cache.py::"
            "test_a_source_in_host_memory_gets_a_plan_of_its_own_beside_one_in_device_memory",
        ),
        "the plan cache keys a source without its memory kind, so a pinned_host source of the "
        "same mesh and spec is handed the device-memory plan (which refuses it)",
    ),
    Mutant(
        "api-cache-ignores-bucket-bytes",
        "jaxreshard/api.py",
        (
            (
                "            bucket_bytes,\n            options,\n            fallback,\n",
                "            options,\n            fallback,\n",
            ),
        ),
        (
            "tests/test_cache.py::"
            "test_a_plan_asked_for_with_smaller_buckets_is_not_the_default_buckets_plan",
        ),
        "the plan cache ignores bucket_bytes, so a plan asked for with small buckets is the "
        "cached default-bucket plan, staging far more than asked",
    ),
    Mutant(
        "api-cache-ignores-shape",
        "jaxreshard/api.py",
        (
            (
                "(x.shape, x.dtype, _placement_key(x.sharding, len(x.shape)))",
                "(x.dtype, _placement_key(x.sharding, len(x.shape)))",
            ),
        ),
        ("tests/test_cache.py::test_sources_of_two_shapes_on_one_sharding_each_get_their_plan",),
        "the plan cache keys a source without its shape, so a source of another shape on the "
        "same sharding is handed the first shape's plan (which refuses it)",
    ),
    Mutant(
        "api-label-names-the-first-leaf",
        "jaxreshard/api.py",
        (
            (
                'path = "" if self.moved[0] == 0 else f"{self.paths[self.moved[0]]}: "',
                'path = "" if self.moved[0] == 0 else f"{self.paths[0]}: "',
            ),
        ),
        (
            "tests/test_errors.py::"
            "test_a_plans_name_gives_the_first_moved_leafs_path_beside_its_layouts",
        ),
        "a plan's label (the order check's and a refused call's name for it) prints the first "
        "leaf's path beside the first moved leaf's layouts, where a fallback leaf comes first",
    ),
    Mutant(
        "api-mixed-problems-raise-type-error",
        "jaxreshard/api.py",
        (
            (
                'cls = ReshardTypeError if kinds == {"type"} else ReshardError',
                'cls = ReshardTypeError if "type" in kinds else ReshardError',
            ),
        ),
        (
            "tests/test_errors.py::"
            "test_a_tree_refused_for_a_type_and_for_a_layout_raises_the_plain_error_naming_both",
        ),
        "a refusal listing a type problem beside a layout problem is a ReshardTypeError, so an "
        "`except TypeError` takes the layout problem too",
    ),
    Mutant(
        "api-subtree-cast-takes-complex",
        "jaxreshard/api.py",
        (
            (
                "return own or bool(jnp.issubdtype(src, jnp.floating))",
                "return own or bool(jnp.issubdtype(src, jnp.inexact))",
            ),
        ),
        ("tests/test_leaves.py::test_a_dtype_for_a_subtree_leaves_its_complex_leaves_complex",),
        "a dtype= entry standing for a subtree casts its complex leaves too (to bfloat16: their "
        "imaginary parts dropped), not only its floating ones",
    ),
    Mutant(
        "lower-staging-first-call-only",
        "jaxreshard/planning/lower.py",
        (("    for _ in range(2):", "    for _ in range(1):"),),
        (
            "tests/test_compiled.py::"
            "test_staging_held_inside_every_step_of_every_call_is_within_what_the_plan_reports",
        ),
        "the lowering simulates the staging pool over the first call only, so the plan "
        "reports less staging than a second call, starting from the pool the first left, holds",
    ),
    Mutant(
        "codec-bf16-ties-round-up",
        "jaxreshard/run/codec.py",
        (
            (
                "u + np.uint32(0x7FFF) + lsb",
                "u + np.uint32(0x8000)",
            ),
        ),
        (
            "tests/test_reshard.py::test_integers_rounded_to_bfloat16_bit_for_bit_as_xla_co"
            "nverts_them",
        ),
        "codec.py `_cast_bits`: an integer rounded to bfloat16 on CPU rounds ties up, not "
        "to even (257 -> 258 where XLA gives 256)",
    ),
    Mutant(
        "codec-complex-bits-of-the-whole-element",
        "jaxreshard/run/codec.py",
        (
            (
                'return np.dtype(f"uint{dtype.itemsize * 4}")',
                'return np.dtype(f"uint{dtype.itemsize * 8}")',
            ),
        ),
        ("tests/test_reshard.py::test_every_dtype_is_moved_bit_for_bit[by gathers-complex64]",),
        "codec.py `bits_dtype`: a complex element's bits carried per part in a word as "
        "wide as the whole element",
    ),
    Mutant(
        "verify-columns-of-elements-not-words",
        "jaxreshard/run/verify.py",
        (
            (
                "origin = (*origin[:-1], _u32(origin[-1]) * np.uint32(k))",
                "origin = (*origin[:-1], _u32(origin[-1]))",
            ),
        ),
        (
            "tests/test_verify.py::test_verify_passes_an_exact_result_whose_layouts_cut_wid"
            "e_elements_columns_differently",
        ),
        "verify.py `box_checksum`: a box's first column counted in elements, not words, so "
        "a 64-bit or complex leaf cut along its last dimension fails an exact result",
    ),
    Mutant(
        "verify-row-stride-of-the-shard",
        "jaxreshard/run/verify.py",
        (
            (
                "stride *= int(global_shape[d])",
                "stride *= int(lead[d])",
            ),
        ),
        (
            "tests/test_verify.py::test_verify_passes_an_exact_result_whose_layouts_cut_a_m"
            "iddle_dimension_differently",
        ),
        "verify.py `box_checksum`: rows numbered by the box's own extents, not the global "
        "array's, so a rank-3 leaf cut along a middle dimension fails an exact result",
    ),
    Mutant(
        "layout-intersect-keeps-empty",
        "jaxreshard/planning/layout.py",
        (
            (
                "        if lo >= hi:\n            return None",
                "        if lo > hi:\n            return None",
            ),
        ),
        (
            "tests/test_layout.py::test_overlapping_on_a_layout_that_is_not_a_grid_skips_bo"
            "xes_that_only_touch",
        ),
        "layout.py `intersect`: boxes that only touch meet in an empty box, so "
        "`overlapping` on a layout that is not a grid yields them",
    ),
    Mutant(
        "layout-axis-used-twice-taken",
        "jaxreshard/planning/layout.py",
        (
            (
                "    if len(used) != len(set(used)):",
                "    if len(used) < len(set(used)):",
            ),
        ),
        ("tests/test_layout.py::test_from_mesh_refuses_a_spec_naming_an_axis_twice_as_jax_does",),
        "layout.py `normalize_spec`: a spec naming one mesh axis twice (JAX refuses it) is taken",
    ),
    Mutant(
        "layout-empty-mesh-axis-taken",
        "jaxreshard/planning/layout.py",
        (
            (
                "any(n < 1 for n in mesh_shape)",
                "any(n < 0 for n in mesh_shape)",
            ),
        ),
        ("tests/test_layout.py::test_from_mesh_refuses_a_mesh_axis_of_size_zero",),
        "layout.py `Layout.from_mesh`: a mesh axis of size 0 is taken",
    ),
    Mutant(
        "boundary-view-cache-ignores-weak-type",
        "jaxreshard/run/boundary.py",
        (
            (
                "key = (x.shape, x.dtype, sharding, weak_type)",
                "key = (x.shape, x.dtype, sharding)",
            ),
        ),
        ("tests/test_leaves.py::test_each_call_gets_its_own_sources_weak_type",),
        "boundary.py `Crossing._view`: views cached without their weak type, so a weak "
        "result takes the strong source view's",
    ),
    Mutant(
        "boundary-memory-copy-key-ignores-kind",
        "jaxreshard/run/boundary.py",
        (
            (
                "key = (d, kinds, tuple(",
                "key = (d, tuple(",
            ),
        ),
        (
            "tests/test_leaves.py::test_host_memory_to_host_memory_on_the_same_devices_land"
            "s_in_host_memory",
        ),
        "boundary.py `_MemoryCopies`: copy programs cached without the memory kind, so "
        "host -> host on the same devices lands in device memory",
    ),
    Mutant(
        "boundary-manual-destination-not-rewrapped",
        "jaxreshard/run/boundary.py",
        (
            (
                "named = isinstance(self.user_dst, NamedSharding) and not _manual(self.user_dst)",
                "named = isinstance(self.user_dst, NamedSharding)",
            ),
        ),
        (
            "tests/test_leaves.py::test_a_destination_over_manual_mesh_axes_gets_the_shardi"
            "ng_it_asked_for",
        ),
        "boundary.py `Boundary.rewraps`: a destination over Manual axes is not re-wrapped "
        "(the result carries the Auto sharding)",
    ),
    Mutant(
        "quant-zero-block-scale-tiny",
        "jaxreshard/quant.py",
        (
            (
                "scale = jnp.where(amax > 0,",
                "scale = jnp.where(amax >= 0,",
            ),
        ),
        ("tests/test_fp8.py::test_a_zero_size_leaf_scaled_per_tensor_moves_with_scale_one",),
        "quant.py `quantize`: an all-zero block gets the least scale, not 1",
    ),
    Mutant(
        "quant-zero-block-size-taken",
        "jaxreshard/quant.py",
        (
            (
                "and b >= 1\n",
                "and b >= 0\n",
            ),
        ),
        ("tests/test_errors.py::test_a_bad_fp8_format_is_refused_with_its_fix[block]",),
        "quant.py `_sizes`: a block size of 0 is taken",
    ),
    Mutant(
        "quant-replicated-scales-in-device-memory",
        "jaxreshard/quant.py",
        (
            (
                "        return NamedSharding(sharding.mesh, PartitionSpec(), "
                "memory_kind=sharding.memory_kind)",
                "        return NamedSharding(sharding.mesh, PartitionSpec())",
            ),
        ),
        (
            "tests/test_fp8.py::test_replicated_fp8_scales_of_a_host_memory_destination_lan"
            "d_beside_their_values",
        ),
        "quant.py `scale_sharding`: replicated scales of a host-memory destination land in "
        "device memory",
    ),
    Mutant(
        "api-cache-ignores-fallback",
        "jaxreshard/api.py",
        (
            (
                "            options,\n            fallback,\n",
                "            options,\n",
            ),
        ),
        (
            "tests/test_cache.py::test_a_plan_cached_with_the_device_put_fallback_is_not_gi"
            "ven_to_a_call_without_it",
        ),
        "api.py `_cache_key`: the cache ignores `fallback`, so a call without it gets a "
        "device_put-fallback plan",
    ),
    Mutant(
        "api-cache-ignores-compiler-options",
        "jaxreshard/api.py",
        (
            (
                "            (topology, options, unit_buckets),\n",
                "            (topology, unit_buckets),\n",
            ),
        ),
        (
            "tests/test_cache.py::test_a_plan_cached_without_compiler_options_is_not_given_"
            "to_a_call_with_them",
        ),
        "api.py `cached_plan`: the cache ignores `compiler_options`",
    ),
    Mutant(
        "api-bucket-bytes-zero-taken",
        "jaxreshard/api.py",
        (
            (
                "or not 1 <= value <= most",
                "or not 0 <= value <= most",
            ),
        ),
        ("tests/test_errors.py::test_a_bad_option_is_refused_with_its_fix[bucket_bytes]",),
        "api.py `_check_options`: bucket_bytes=0 (and unit_buckets=0) taken",
    ),
    Mutant(
        "api-bucket-bytes-bool-taken",
        "jaxreshard/api.py",
        (
            (
                "        isinstance(value, bool)\n        or not isinstance",
                "        not isinstance",
            ),
        ),
        ("tests/test_errors.py::test_a_boolean_bucket_bytes_is_refused",),
        "api.py `_check_options`: bucket_bytes=True taken as 1 byte (and unit_buckets=True as 1)",
    ),
    Mutant(
        "api-cache-evicts-one-early",
        "jaxreshard/api.py",
        (
            (
                "while len(_CACHE) > _CACHE_SIZE:",
                "while len(_CACHE) >= _CACHE_SIZE:",
            ),
        ),
        ("tests/test_cache.py::test_the_reshard_cache_keeps_its_256_most_recently_used_plans",),
        "api.py `cached_plan`: the cache keeps 255 plans, not 256",
    ),
    Mutant(
        "api-call-ignores-source-dtype",
        "jaxreshard/api.py",
        (
            (
                "if tuple(x.shape) != tuple(shape) or x.dtype != dtype:",
                "if tuple(x.shape) != tuple(shape):",
            ),
        ),
        ("tests/test_errors.py::test_a_plan_applied_to_arrays_of_another_shape_dtype_or_sharding",),
        "api.py `_array_problem`: a call's source of another dtype is not refused",
    ),
    Mutant(
        "api-host-bool-leaves-refused",
        "jaxreshard/api.py",
        (
            (
                "return bool(jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, "
                "jnp.bool_))",
                "return bool(jnp.issubdtype(dtype, jnp.number))",
            ),
        ),
        (
            "tests/test_leaves.py::test_numpy_boolean_leaves_go_through_device_put_as_it_pl"
            "aces_them",
        ),
        "api.py `_on_device`: boolean host leaves (and a bool dtype= entry) refused",
    ),
    Mutant(
        "runtime-empty-alloc-key-ignores-dtype",
        "jaxreshard/run/runtime.py",
        (
            (
                "key = (spec.dst.shard_shape, spec.dst_dtype, tuple(d.id for d in devices))",
                "key = (spec.dst.shard_shape, tuple(d.id for d in devices))",
            ),
        ),
        ("tests/test_leaves.py::test_zero_size_leaves_of_two_dtypes_arrive_with_their_own_dtypes",),
        "runtime.py `_alloc_empty`: empty destinations cached without their dtype",
    ),
    Mutant(
        "runtime-partly-donated-taken-as-all",
        "jaxreshard/run/runtime.py",
        (
            (
                "self.donated_all = donate is not None and all(x is not None for x in donate)",
                "self.donated_all = donate is not None",
            ),
        ),
        (
            "tests/test_leaves.py::test_destinations_in_host_memory_land_there_under_the_tr"
            "ansfer_guard",
        ),
        "runtime.py `_Destinations`: a donate= tree with None entries (host-memory "
        "destinations) counts as all donated, so those are never allocated",
    ),
    Mutant(
        "views-weak-type-dropped",
        "jaxreshard/run/views.py",
        (
            (
                "base = _core.ShapedArray(self.shape, self.dtype, weak_type=weak_type)",
                "base = _core.ShapedArray(self.shape, self.dtype)",
            ),
        ),
        (
            "tests/test_leaves.py::test_weakly_typed_leaves_arrive_weakly_typed_as_device_p"
            "ut_keeps_them",
        ),
        "views.py `View`: views made strongly typed whatever their weak_type",
    ),
    Mutant(
        "route-pool-overfills",
        "jaxreshard/planning/route.py",
        (
            (
                "        if out and total + nbytes <= pool_bytes:",
                "        if out and total <= pool_bytes:",
            ),
        ),
        ("tests/test_topology.py::test_leaves_are_pooled_only_up_to_the_pool_bytes",),
        "route.py `_pooled`: a run joins the pool while the pool so far is within "
        "pool_bytes, however large the run",
    ),
    Mutant(
        "stats-fan-receiver-counted-per-fan-member",
        "jaxreshard/planning/schedule.py",
        (
            (
                "        for d in dsts:\n            recv_by[d] += n\n",
                "        for d in dsts:\n            recv_by[d] += n * len(dsts)\n",
            ),
        ),
        (
            "tests/test_topology.py::test_a_leaf_smaller_than_a_share_per_device_is_importe"
            "d_by_fewer_devices_in_turn",
        ),
        "schedule.py `plan_stats`: a fan's receiver counted once per member of the fan",
    ),
    Mutant(
        "stats-relayed-cross-misses-fans",
        "jaxreshard/planning/schedule.py",
        (
            (
                "            cross += crossing\n            relayed_cross += crossing\n",
                "            cross += crossing\n",
            ),
        ),
        ("tests/test_topology.py::test_devices_alone_in_their_domain_chained_run_bit_exact",),
        "schedule.py `plan_stats`: fans crossing domains left out of bytes_relayed_cross_domain",
    ),
    Mutant(
        "stats-wire-ignores-messages",
        "jaxreshard/planning/schedule.py",
        (
            (
                "wire += sum(size * messages for size, messages in rounds)",
                "wire += sum(size for size, messages in rounds)",
            ),
        ),
        ("tests/test_planner.py::test_small_replicated_leaves_ride_on_pairs_already_in_use",),
        "schedule.py `plan_stats`: bytes_wire counts each round size once, not once per message",
    ),
    Mutant(
        "verify-pieces-keep-the-boxs-origin",
        "jaxreshard/run/verify.py",
        (
            (
                "return _moved(start, d, offset), _with(shape, d, n), _moved(origin, d, offset)",
                "return _moved(start, d, offset), _with(shape, d, n), origin",
            ),
        ),
        (
            "tests/test_verify.py::test_a_checksum_taken_in_pieces_is_the_formula[new-emitters-"
            "16-shape0-box0-float32]",
        ),
        "verify.py `box_checksum_of`: every piece of a box cut into pieces is hashed at "
        "the box's origin, not its own, so rows and columns are numbered wrong",
    ),
    Mutant(
        "verify-last-piece-dropped",
        "jaxreshard/run/verify.py",
        (
            (
                "return acc + piece(*part(whole * k, tail)) if tail else acc",
                "return acc",
            ),
        ),
        (
            "tests/test_verify.py::test_a_checksum_taken_in_pieces_is_the_formula[new-emitters-"
            "16-shape1-box1-bfloat16]",
        ),
        "verify.py `box_checksum_of`: a box whose pieces do not divide it evenly loses its "
        "shorter last piece",
    ),
    Mutant(
        "verify-bf16-sliced-as-values",
        "jaxreshard/run/verify.py",
        (
            (
                "as_bits = not _sliced_exactly(jnp.dtype(x.dtype))",
                "as_bits = False",
            ),
        ),
        (
            "tests/test_verify.py::test_a_checksum_taken_in_pieces_is_the_formula[old-emitters-"
            "262144-shape1-box1-bfloat16]",
        ),
        "verify.py `box_checksum_of`: bfloat16 pieces sliced as values, which XLA's older "
        "CPU emitters (and the newer ones, in a loop) compute through float32, quietening "
        "NaN payloads",
    ),
    Mutant(
        "api-never-donated-leaves-not-compiled-ahead",
        "jaxreshard/api.py",
        (
            (
                "never_donated=[i for i, b in enumerate(self.boundaries) if b.stages_out],",
                "never_donated=(),",
            ),
        ),
        (
            "tests/test_leaves.py::"
            "test_a_refit_loop_with_host_memory_destinations_compiles_nothing_after_its_first_call",
        ),
        "the runtime is not told which destinations a donated call still allocates (host "
        "memory), so the second call of a refit loop compiles their zero-filling program",
    ),
    Mutant(
        "api-start-reads-host-leaves-on-the-worker",
        "jaxreshard/api.py",
        (
            (
                "        try:\n            flat, copies = self._early_fallback_copies(flat)\n"
                "        except BaseException as e:",
                "        try:\n            copies = None\n        except BaseException as e:",
            ),
        ),
        (
            "tests/test_async.py::"
            "test_host_leaves_are_read_as_start_returns_under_the_callers_transfer_guard",
        ),
        "`Plan.start` leaves the fallback leaves' device_put to the worker thread, which reads a "
        "NumPy source when it reaches the refit (after the caller changed it) and outside the "
        "caller's transfer guard",
    ),
    Mutant(
        "api-sources-not-checked-again-on-the-worker",
        "jaxreshard/api.py",
        (
            (
                "gone = [self.paths[i] for i in self.moved if _deleted(flat[i])]",
                "gone = []",
            ),
        ),
        (
            "tests/test_async.py::"
            "test_an_array_over_the_buffers_of_a_tree_donated_in_flight_is_refused_when_read"
            "[False]",
        ),
        "a call run behind refits in flight reads its sources unchecked, so an array over the "
        "buffers a refit consumed raises JAX's RuntimeError, not a ReshardError naming it",
    ),
    Mutant(
        "tunix-installed-keeps-its-options-after-the-block",
        "jaxreshard/integrations/tunix.py",
        (
            (
                "        with _LOCK:  # the options in force before the block, back (they are "
                "also what a\n            _FALLBACK, _DONATE_TARGET = options  # direct call of "
                "reshard_pytree takes)\n        if not was:\n            uninstall()",
                "        if was:\n            with _LOCK:\n                _FALLBACK, "
                "_DONATE_TARGET = options\n        else:\n            uninstall()",
            ),
        ),
        (
            "tests/test_tunix_adapter.py::"
            "test_installed_over_no_adapter_puts_back_the_options_a_direct_call_takes",
        ),
        "`installed` entered with no adapter installed uninstalls it after the block but keeps "
        "the block's options, which a direct call of reshard_pytree then takes",
    ),
    Mutant(
        "tunix-install-takes-any-options",
        "jaxreshard/integrations/tunix.py",
        (("    _check_install_options(fallback, donate_target)\n", ""),),
        (
            "tests/test_tunix_adapter.py::"
            "test_bad_options_are_refused_by_install_not_at_the_first_sync",
        ),
        "`install` takes any fallback= or donate_target=; a typo surfaces at every later sync",
    ),
    Mutant(
        "api-fallback-numpy-leaf-not-copied-first",
        "jaxreshard/api.py",
        (("            value = np.array(value, copy=True)\n", "            pass\n"),),
        (
            "tests/test_leaves.py::"
            "test_a_numpy_leafs_result_keeps_its_values_when_the_numpy_array_changes_afterwards",
        ),
        "a NumPy fallback leaf goes to jax.device_put as it is, whose CPU results (jax 0.10.2) "
        "go on reading its buffer: the result changes with the caller's array",
    ),
    Mutant(
        "runtime-rows-start-not-divided",
        "jaxreshard/run/runtime.py",
        (
            (
                "    start = (*at[:-1], at[-1] // np.int32(n), ZERO)\n",
                "    start = (*at[:-1], at[-1], ZERO)\n",
            ),
        ),
        ("tests/test_reshard.py::test_boxes_packed_as_rows_of_their_shards_arrive_bit_for_bit",),
        "a box read as rows starts at its start in elements, not in rows of its shard's view: "
        "a box off the shard's first column packs other columns",
    ),
    Mutant(
        "runtime-rows-elements-a-row-in-words",
        "jaxreshard/run/runtime.py",
        (
            (
                "    n = slot.width * np.dtype(slot.word).itemsize // wire_itemsize(wire)",
                "    n = slot.width",
            ),
        ),
        ("tests/test_reshard.py::test_rows_carry_casts_and_words_narrower_than_an_element",),
        "a row of the shard's view holds a slot row's width in elements, not in words: an "
        "element of several words (float32 in a 16-bit slot, complex) makes rows too long",
    ),
    Mutant(
        "lower-rows-strided-box-not-checked",
        "jaxreshard/planning/lower.py",
        (("rows = slots[t].width > 1 and all(", "rows = slots[t].width > 1 or all("),),
        ("tests/test_lower.py::test_lowered_programs_rebuild_every_destination_shard",),
        "every box of a slot held as rows is read from its shard cut into rows of that width, "
        "though one that is not whole rows of its shard (or of the slot) must be read as its "
        "own shape",
    ),
    Mutant(
        "lower-rows-box-offset-not-checked",
        "jaxreshard/planning/lower.py",
        (
            (
                "        seg.offset // w,\n        per * math.prod(shape),\n",
                "        0,\n        0,\n",
            ),
        ),
        ("tests/test_lower.py::test_a_leaf_of_narrow_rows_leaves_the_other_boxes_their_rows",),
        "a strided box is copied row by row wherever it falls in the slot, though rows of the "
        "slot start only every width words",
    ),
    Mutant(
        "lower-rows-widest-not-fastest",
        "jaxreshard/planning/lower.py",
        (
            (
                "best = max(fast, key=lambda width: (fast[width], width), default=1)",
                "best = max(fast, key=lambda width: (width, fast[width]), default=1)",
            ),
        ),
        ("tests/test_lower.py::test_rows_of_64_words_only_where_every_message_of_the_slot_casts",),
        "slots take the widest rows any box allows, though fewer of their boxes then copy row "
        "by row than under a narrower width",
    ),
    Mutant(
        "runtime-words-mid-row-at-row-start",
        "jaxreshard/run/runtime.py",
        (
            (
                "buf = lax.dynamic_update_slice(buf, part, (first + np.int32(row), np.int32(col)))",
                "buf = lax.dynamic_update_slice(buf, part, (first + np.int32(row), ZERO))",
            ),
        ),
        ("tests/test_reshard.py::test_boxes_of_narrow_rows_beside_wide_ones_arrive_bit_for_bit",),
        "words that start mid-row of a slot held as rows are written from the start of that row",
    ),
    Mutant(
        "lower-rows-of-64-words-everywhere",
        "jaxreshard/planning/lower.py",
        (
            (
                "            floor = MIN_CAST_SLOT_WIDTH if casts.get(key) else MIN_SLOT_WIDTH\n",
                "            floor = MIN_CAST_SLOT_WIDTH\n",
            ),
        ),
        ("tests/test_lower.py::test_rows_of_64_words_only_where_every_message_of_the_slot_casts",),
        "slots take rows of 64 words whether or not their messages cast, where the older "
        "emitters of a plain pack copy such rows no faster than a flat slot",
    ),
    Mutant(
        "verify-one-program-sums-every-box",
        "jaxreshard/run/verify.py",
        (
            (
                "    return max(1, min(GROUP_JOBS, GROUP_WORDS // words))",
                "    return 1 << 30",
            ),
        ),
        (
            "tests/test_verify.py::"
            "test_verify_of_many_leaves_of_one_shape_compiles_a_few_programs_not_one_term_a_leaf",
        ),
        "a checksum program sums every box of its shape on its device at once: the terms "
        "compiled grow with the leaves (1024 leaves compiled for minutes)",
    ),
    Mutant(
        "api-donation-claimed-after-another-call-consumed-it",
        "jaxreshard/api.py",
        (
            (
                "        gone = [self.paths[i] for i, x in enumerate(old or ()) if _deleted(x)]\n",
                "        gone = []\n",
            ),
        ),
        (
            "tests/test_async.py::"
            "test_a_tree_donated_by_two_threads_is_refused_once_the_other_call_consumed_it",
        ),
        "a call claims a donate= tree another thread's call consumed after this one checked it, "
        "and hands XLA deleted buffers (two threads donating one tree crashed the process)",
    ),
    Mutant(
        "api-fp8-call-names-only-its-fp8-leaves",
        "jaxreshard/api.py",
        (("                problems += self._other_problems(flat)\n", ""),),
        ("tests/test_errors.py::test_bad_leaves_found_by_different_checks_are_named_in_one_error",),
        "a call of an fp8 plan with bad fp8 and bad plain source leaves names only the fp8 ones",
    ),
    Mutant(
        "api-call-names-only-its-bad-sources",
        "jaxreshard/api.py",
        (
            (
                "            raise merged_error(errors)\n        return flat, old",
                "            raise errors[0]\n        return flat, old",
            ),
        ),
        ("tests/test_errors.py::test_bad_leaves_found_by_different_checks_are_named_in_one_error",),
        "a call with bad source and bad donate= leaves names only the sources",
    ),
    Mutant(
        "multihost-fingerprint-ignores-compiler-options",
        "jaxreshard/run/multihost.py",
        (
            (
                "int(bucket_bytes), compiler_options]",
                "int(bucket_bytes)]",
            ),
        ),
        (
            "tests/test_multihost.py::test_agreement_refuses_plans_whose_transfer_programs_take_other_compiler_options",
        ),
        "processes whose transfer programs take different compiler_options agree on the plan",
    ),
    Mutant(
        "api-nnx-state-beside-pure-dict-shardings-unexplained",
        "jaxreshard/api.py",
        (("    said_once = unwrapped and not problems\n", "    said_once = False\n"),),
        ("tests/test_errors.py::test_nnx_mistakes_are_named_with_their_fix",),
        "an nnx.State source beside shardings as its pure dict is reported as differing "
        "nodes, without the one difference or the fix",
    ),
    Mutant(
        "runtime-packs-wait-for-previous-step",
        RUNTIME,
        (
            (
                'before the step\'s transfer and unpacks."""\n',
                'before the step\'s transfer and unpacks."""\n'
                "        if self.host_syncs and previous and step.transfer is not None:\n"
                "            _await(previous)\n",
            ),
        ),
        (
            "tests/test_compiled.py::"
            "test_on_cpu_a_steps_packs_run_before_the_wait_for_the_previous_step",
        ),
        "on CPU a step's packs wait for the previous step too, so they never run beside its "
        "transfer and unpacks (a tree of many leaves in many steps pays each step's packs "
        "in turn)",
    ),
    Mutant(
        "api-mesh-axis-types-dropped",
        "jaxreshard/api.py",
        (
            (
                "            tuple(t.name for t in mesh.axis_types),\n",
                "            (),\n",
            ),
        ),
        (
            "tests/test_reshard.py::test_meshes_of_the_same_devices_and_names_whose_axis_types_"
            "differ_are_different_meshes",
        ),
        "two meshes of the same devices and names whose axis types differ are one mesh to the "
        "plan: the result carries the source's axis types, and an Explicit source to an Auto "
        "destination fails in shard_map",
    ),
    Mutant(
        "runtime-bitcasts-as-a-plain-jit",
        RUNTIME,
        (
            (
                "            mapped = jax.shard_map(\n",
                "            mapped = bitcast or jax.shard_map(\n",
            ),
        ),
        (
            "tests/test_reshard.py::test_bits_written_over_a_mesh_of_mixed_axis_types_keep_their_"
            "nan_payloads",
        ),
        "the bitcasts around a bf16 unpack run as a plain jit to the destination sharding: over "
        "a mesh of Auto and Explicit axes it reshards the values and quietens NaN payloads",
    ),
    Mutant(
        "verify-cast-nans-by-payload",
        "jaxreshard/run/verify.py",
        (
            (
                "            canonical_nan(leaf.dst_dtype) if leaf.src_dtype != leaf.dst_dtype "
                "else None\n",
                "            None\n",
            ),
        ),
        ("tests/test_verify.py::test_an_exact_cast_of_nan_payloads_passes_when_taken_in_pieces",),
        "verify compares a cast leaf's NaNs by payload: XLA CPU converts payloads differently "
        "with what the convert is fused with, and an exact result is called corrupt",
    ),
    Mutant(
        "lower-packs-every-message",
        LOWER,
        (
            (
                "    packed_slots = bucket.packed_slots()\n",
                "    packed_slots = [m.slot for m in bucket.messages]\n",
            ),
        ),
        (
            "tests/test_lower.py::test_a_sender_packs_once_what_it_sends_to_several_replicas",
            "tests/test_compiled.py::test_a_sender_sends_what_it_packed_once_to_every_replica",
        ),
        "a sender packs again every message it sends alike to several receivers of a step, "
        "where one buffer could be sent to all of them",
    ),
    Mutant(
        "runtime-shared-rounds-send-idle-buffers",
        RUNTIME,
        (
            (
                "        self.sends.update({(d, t): (d, packed) for d, t, packed in step.shared "
                "if d in local})\n",
                "",
            ),
        ),
        ("tests/test_compiled.py::test_a_sender_sends_what_it_packed_once_to_every_replica",),
        "the rounds that send another round's packed buffer send an idle one: the second "
        "replica of every shard gets garbage",
    ),
    Mutant(
        "route-replicas-take-senders-in-turn",
        ROUTE,
        (
            (
                "    choose = functools.partial(_choose_senders, alike=not fan_out)\n",
                "    choose = functools.partial(_choose_senders, alike=False)\n",
            ),
        ),
        (
            "tests/test_route.py::test_replicas_of_a_destination_shard_get_their_bytes_from_one_"
            "sender",
        ),
        "replicas of a destination shard take their bytes from senders in turn, so no sender "
        "sends two replicas the same bytes and nothing is packed once",
    ),
    Mutant(
        "costmodel-packs-shared-messages-twice",
        "jaxreshard/tools/costmodel.py",
        (("                    if not again:\n", "                    if True:\n"),),
        (
            "tests/test_simulate.py::test_modeled_time_packs_once_what_a_sender_sends_alike_to_"
            "several_receivers",
        ),
        "the cost model packs a message its sender sends alike to several receivers once per "
        "receiver, where the executor packs it once",
    ),
    Mutant(
        "api-key-buffers-compared-as-keys",
        API,
        (
            (
                "    if boundary.is_key(dtype):  # its buffers hold its key data\n",
                "    if False:\n",
            ),
        ),
        (
            "tests/test_errors.py::test_donating_a_key_over_a_plain_sources_buffers_or_its_data_"
            "is_refused",
            "tests/test_fp8.py::test_an_fp8_plan_beside_a_typed_key_leaf_takes_its_result_donated",
        ),
        "a typed key's buffers are compared as the key's own dtype and shape, not its data's: a "
        "donate= leaf over a source key's data (or a key over a uint32 source) destroys the "
        "source or crashes the process (and an fp8 plan holding a key leaf refuses every "
        "donate= with a bare TypeError)",
    ),
    Mutant(
        "api-dtype-names-taken-as-fallback-values",
        API,
        (("    if isinstance(x, (str, bytes, type, np.dtype)):\n", "    if False:\n"),),
        (
            "tests/test_leaves.py::test_fallback_leaves_device_put_cannot_take_are_refused_when_"
            "planning",
        ),
        "a fallback leaf that names a dtype ('f4', jnp.float32) is planned as that dtype's "
        "value, and every call fails in jax.device_put",
    ),
    Mutant(
        "api-fallback-call-raw-type-error",
        API,
        (
            (
                "                why = device_put_problem(x)  # (the check the plan made of "
                "its own leaf)\n",
                "                why = None\n",
            ),
        ),
        (
            "tests/test_leaves.py::test_a_call_with_a_fallback_leaf_device_put_cannot_take_is_"
            "refused_naming_it",
        ),
        "a call whose fallback leaf is a string or an object raises NumPy's raw TypeError from "
        "the call's checks, naming no leaf",
    ),
    Mutant(
        "api-traced-call-raw-jax-error",
        API,
        (
            (
                '    except ValueError:  # "get_mesh can only be used',
                '    except KeyError:  # "get_mesh',
            ),
        ),
        (
            "tests/test_errors.py::test_a_plan_called_while_tracing_on_closed_over_arrays_is_"
            "refused_with_the_fix",
        ),
        "a plan called while JAX traces, on closed-over arrays, fails with JAX's raw ValueError "
        "from get_mesh instead of naming the mistake and its fix",
    ),
    Mutant(
        "route-alike-rotation-replaces-the-plain-one",
        ROUTE,
        (
            (
                "    rotated.append(_rotate(numbered, number))\n",
                "    rotated = rotated or [_rotate(numbered, number)]\n",
            ),
        ),
        (
            "tests/test_route.py::test_replicas_taking_one_holder_never_cost_the_balance_the_"
            "plain_rotation_reaches",
        ),
        "with replicas taking one holder, that rotation replaces the plain one among the "
        "sender choices: where it is unbalanced the plain rotation, alone optimal, is lost",
    ),
    Mutant(
        "lower-shares-where-it-splits-packs",
        LOWER,
        (("        if len(alone) < len(packs):\n", "        if False:\n"),),
        (
            "tests/test_compiled.py::test_a_step_shares_no_packed_buffer_where_that_would_split_"
            "its_pack_program",
        ),
        "a step shares packed buffers where that gives its senders unlike packs: two pack "
        "programs a step, for a few small messages' copies",
    ),
    Mutant(
        "schedule-relays-ignore-the-sources-excess",
        SCHEDULE,
        (
            (
                "    return int((weight * np.maximum(most[0] - most[1], 0)).sum())\n",
                "    return 0\n",
            ),
        ),
        ("tests/test_planner.py::test_relays_share_their_links_chunk_where_the_sources_bind",),
        "relays take a chunk of their own where the sources bind: the sources' sends then "
        "wait for the forwards' rounds",
    ),
    Mutant(
        "schedule-cut-ignores-the-relay-chunk",
        SCHEDULE,
        (
            (
                "        return chunk_of.get(cls + RELAY_CLASS, chunk_of[cls]) if relayed else "
                "chunk_of[cls]\n",
                "        return chunk_of[cls]\n",
            ),
        ),
        (
            "tests/test_lower.py::test_random_layouts_with_chained_domains_lower_exactly"
            "[True-by copies-apart]",
        ),
        "the lowering cuts a relay's stream with its link's chunk where the rounds were "
        "coloured with the relays' own",
    ),
    Mutant(
        "schedule-cut-takes-merged-pairs-by-stage",
        SCHEDULE,
        (
            (
                "        relayed = pair not in starts if stage == ALL_STAGES else stage > 0\n",
                "        relayed = stage > 0\n",
            ),
        ),
        (
            "tests/test_lower.py::test_random_layouts_with_chained_domains_lower_exactly"
            "[True-by copies-apart]",
        ),
        "where a unit's stages are coloured as one, the lowering takes no pair for a relay: "
        "the relays' streams cut with their link's chunk",
    ),
    Mutant(
        "api-first-call-refusal-not-placed",
        API,
        (
            (
                "            try:\n                self._agree(on_worker)\n",
                "            try:\n                raise ReshardError('not agreed')\n",
            ),
        ),
        (
            "tests/test_multihost.py::test_a_first_call_refused_on_one_process_raises_on_the_"
            "others_and_the_next_calls_pair",
            "tests/test_multihost.py::"
            "test_a_plan_made_again_refused_at_its_first_call_raises_on_the_peer_at_once",
        ),
        "a plan's first call refused before this plan object agreed (a new plan, or one made "
        "again, identical to one that agreed) takes no place in the order of calls: the peer's "
        "first call pairs with this process's next one (another step's data)",
    ),
    Mutant(
        "api-reshard-refusal-before-plan-not-placed",
        API,
        (("        refuse_unplanned(src_tree, dst_shardings, e)\n", "        pass\n"),),
        (
            "tests/test_multihost.py::test_a_reshard_refused_before_its_plan_raises_on_the_"
            "others_and_the_next_calls_pair",
        ),
        "a jr.reshard refused before it found a plan publishes nothing: the peer's call pairs "
        "with this process's next one",
    ),
    Mutant(
        "tunix-refusal-before-plan-not-placed",
        "jaxreshard/integrations/tunix.py",
        (("        api.refuse_unplanned(source, target, e)\n", "        pass\n"),),
        (
            "tests/test_tunix_adapter.py::test_a_sync_refused_before_its_plan_is_placed_among_"
            "the_plans_calls",
        ),
        "a Tunix sync refused before its plan is called publishes nothing under jax.distributed",
    ),
    Mutant(
        "order-wait-blind-to-an-agreement",
        "jaxreshard/run/multihost.py",
        (("            self._check_agreeing(q)\n", ""),),
        (
            "tests/test_multihost.py::test_a_call_waiting_for_a_peer_that_agrees_on_a_new_plan_gives_"
            "both_up",
        ),
        "a call of an agreed plan waiting for a peer that agrees on a new plan over the same "
        "processes does not see it: both wait the whole agreement timeout",
    ),
    Mutant(
        "order-crossed-agreement-round-kept",
        "jaxreshard/run/multihost.py",
        (
            (
                "        _STATE.rounds[key] = n + 1\n        return True\n",
                "        return True\n",
            ),
        ),
        (
            "tests/test_multihost.py::test_a_call_waiting_for_a_peer_that_agrees_on_a_new_plan_gives_"
            "both_up",
        ),
        "a call that gives a crossed agreement round up for this process keeps that round: "
        "its next agreement over the group reads the failed round and raises",
    ),
    Mutant(
        "agree-blind-to-a-peers-call",
        "jaxreshard/run/multihost.py",
        (("                self._check_calling(q, json.loads(v))\n", "                pass\n"),),
        (
            "tests/test_multihost.py::test_a_new_plans_agreement_waiting_for_a_peer_in_a_call_gives_"
            "both_up",
        ),
        "a new plan's agreement waiting for a peer that waits in a call of an agreed plan "
        "does not see it: both wait the whole agreement timeout",
    ),
    Mutant(
        "agree-earlier-failed-round-taken-for-lost",
        "jaxreshard/run/multihost.py",
        (
            (
                '                if other["key"] == self.waiting["key"] and other["n"] < self.n:\n',
                "                if False:\n",
            ),
        ),
        (
            "tests/test_multihost.py::test_a_new_plans_agreement_waiting_for_a_peer_in_a_call_gives_"
            "both_up",
        ),
        "an agreement fails at once where the peer gave an earlier round of the same group "
        "up (a crossing), though the peer's next round is this one",
    ),
    Mutant(
        "agree-unplanned-refusal-not-given-up",
        "jaxreshard/run/multihost.py",
        (
            (
                "    _fail_round(client, key, n, me, reason)\n\n\ndef place_refusal(",
                "    pass\n\n\ndef place_refusal(",
            ),
        ),
        (
            "tests/test_multihost.py::test_a_refusal_guessing_a_new_plan_gives_up_the_named_"
            "processes_next_round",
        ),
        "a jr.reshard refused at its layout's first call, before any plan, that places its "
        "guess gives no agreement round up: the peer's first call pairs with this process's "
        "next one",
    ),
    Mutant(
        "cost-casts-at-contiguous-speed",
        "jaxreshard/tools/costmodel.py",
        (
            (
                "        if narrow and runs == 1 and not casts:\n",
                "        if narrow and runs == 1:\n",
            ),
        ),
        (
            "tests/test_simulate.py::test_narrow_copies_of_whole_rows_take_the_contiguous_speed_"
            "unless_they_cast",
        ),
        "a pack that casts whole rows is priced at the contiguous copy speed, as a bf16 copy",
    ),
    Mutant(
        "cost-round-plan-slots-wide",
        "jaxreshard/tools/costmodel.py",
        (
            (
                "            + nbytes * self.narrow / narrow_bw\n",
                "            + nbytes * self.narrow / bandwidth\n",
            ),
        ),
        (
            "tests/test_simulate.py::test_a_round_plans_slots_copy_at_the_narrow_speed_in_the_"
            "share_of_narrow_leaves",
        ),
        "a round plan's slots copy at the wide speed whatever their leaves (the cluster model "
        "then priced bf16 packs and unpacks at the float32 box copy's speed)",
    ),
    Mutant(
        "agree-crossed-call-not-taken",
        "jaxreshard/run/multihost.py",
        (
            (
                'not _take_call(\n                other["key"], other["n"]\n            ):\n',
                '_STATE.calls[\n                other["key"]\n            ] != other["n"]:\n',
            ),
        ),
        (
            "tests/test_multihost.py::test_a_new_plans_agreement_waiting_for_a_peer_in_a_call_"
            "gives_both_up",
        ),
        "a new plan's agreement that finds a peer in a call it has not made does not count "
        "that call as made here: a refit loop is then one step apart",
    ),
    Mutant(
        "agree-failed-round-call-not-taken",
        "jaxreshard/run/multihost.py",
        (
            (
                '                        _take_call(*seen[q]["call"])\n',
                "                        pass\n",
            ),
        ),
        (
            "tests/test_multihost.py::test_a_call_waiting_for_a_peer_that_agrees_on_a_new_plan_"
            "gives_both_up",
        ),
        "an agreement failed by a peer's crossed call does not count that call as made here: "
        "the next steps of a refit loop pair one apart, silently",
    ),
    Mutant(
        "api-first-call-agrees-before-refits-in-flight",
        API,
        (
            (
                "        if _IN_FLIGHT.busy() and not on_worker:\n            _submit(functools",
                "        if False:\n            _submit(functools",
            ),
        ),
        (
            "tests/test_multihost.py::test_an_agreed_plan_crossed_with_a_new_plans_first_call_"
            "raises_on_both_within_seconds[None]",
        ),
        "a plan's first call agrees at once while refits started before are not issued yet: "
        "both processes raise on three calls made in the same order",
    ),
    Mutant(
        "refusal-peers-event-not-seen",
        "jaxreshard/run/multihost.py",
        (
            (
                "            if _take_peers_event(client, me, reason, exclude=alike):\n",
                "            if False:\n",
            ),
        ),
        (
            "tests/test_multihost.py::test_a_refusal_before_a_plan_takes_the_place_of_the_event_"
            "a_peer_waits_in",
            "tests/test_multihost.py::test_an_agreed_plan_crossed_with_a_new_plans_first_call_"
            "raises_on_both_within_seconds[None]",
        ),
        "a reshard refused before its plan always places its guess: one extra leaf that does "
        "not fit, on one process at one step, leaves the refit loops a step apart, silently",
    ),
    Mutant(
        "refusal-alike-not-seen",
        "jaxreshard/run/multihost.py",
        (
            (
                "            if len(alike) == len(group) - 1:  # every peer refused this step\n",
                "            if False:  # every peer refused this step\n",
            ),
        ),
        (
            "tests/test_multihost.py::test_a_refusal_before_a_plan_takes_the_place_of_the_event_"
            "a_peer_waits_in",
        ),
        "processes that all refuse the same bad tree before a plan wait for each other the "
        "whole agreement timeout",
    ),
    Mutant(
        "refusal-takes-a-refusing-peers-next-call",
        "jaxreshard/run/multihost.py",
        (
            (
                "if q != me and q not in exclude), None)",
                "if q != me), None)",
            ),
        ),
        (
            "tests/test_multihost.py::test_a_refusal_before_a_plan_takes_the_place_of_the_event_"
            "a_peer_waits_in",
        ),
        "a refusal before a plan takes the next call of a peer that refused the same step "
        "(the same bad tree on both, one a little late): the loops a step apart, silently",
    ),
    Mutant(
        "refusal-all-refused-own-guess",
        "jaxreshard/run/multihost.py",
        (
            (
                "                lowest = min({**alike, me: guess}.items())[1]\n",
                "                lowest = guess\n",
            ),
        ),
        (
            "tests/test_multihost.py::test_a_refusal_before_a_plan_takes_the_place_of_the_event_"
            "a_peer_waits_in",
            "tests/test_multihost.py::test_an_agreed_plan_crossed_with_a_new_plans_first_call_"
            "raises_on_both_within_seconds[None]",
        ),
        "processes that all refuse one step, each with a bad tree of its own, place their own "
        "guesses (a call on one, an agreement round on the other): a step apart, silently",
    ),
    Mutant(
        "refusal-grace-ignored",
        "jaxreshard/run/multihost.py",
        (
            (
                "                deadline = min(deadline, time.monotonic() + REFUSAL_GRACE_S)\n",
                "                pass\n",
            ),
        ),
        (
            "tests/test_multihost.py::test_a_refusal_before_a_plan_takes_the_place_of_the_event_"
            "a_peer_waits_in",
        ),
        "a call refused before its plan, beside a peer refusing with another guess, waits the "
        "whole agreement timeout (300 s by default) before it raises",
    ),
    Mutant(
        "refusal-takes-a-given-up-call",
        "jaxreshard/run/multihost.py",
        (
            (
                "        if call in _STATE.given_up or not _take_call(*call):",
                "        if not _take_call(*call):",
            ),
        ),
        (
            "tests/test_multihost.py::test_a_refusal_before_a_plan_takes_the_place_of_the_event_"
            "a_peer_waits_in",
        ),
        "a refusal before a plan takes the place of a call this process gave up in a crossing "
        "(its own call of it raises too: the next calls pair one apart)",
    ),
    Mutant(
        "fp8-skips-the-leafs-own-checks",
        "jaxreshard/api.py",
        (
            (
                "            _leaf_spec(paths[i], x, dst, None, False)\n",
                "            pass\n",
            ),
        ),
        (
            "tests/test_fp8.py::test_an_fp8_leaf_whose_destination_does_not_fit_its_shape_is_"
            "named_with_that_fix",
        ),
        "an fp8 leaf whose destination does not fit its shape escapes as JAX's own exception "
        "(IndexError, IndivisibleError), naming no leaf and no fix",
    ),
    Mutant(
        "tunix-host-leaves-unchecked",
        "jaxreshard/integrations/tunix.py",
        (
            (
                "    if unfit:  # (Tunix's path fails on them too",
                "    if False:  # (Tunix's path fails on them too",
            ),
        ),
        (
            "tests/test_tunix_adapter.py::test_a_leaf_under_a_none_target_device_put_cannot_take_"
            "is_refused_before_anything_moves",
        ),
        "a string under a None target escapes as JAX's TypeError after the other leaves moved, "
        "the donated target consumed",
    ),
    Mutant(
        "verify-fallback-copies-unchecked",
        "jaxreshard/api.py",
        (
            (
                "        wants = self._fallback_copies(flat)",
                "        wants = {i: self._fallback_copy(i, flat[i], d) for i, d in self.fallback}",
            ),
        ),
        ("tests/test_errors.py::test_verify_of_a_fallback_leaf_device_put_refuses_names_it",),
        "verify of a fallback leaf that jax.device_put refuses lets JAX's own error escape",
    ),
    Mutant(
        "nnx-plain-leaves-listed-again",
        "jaxreshard/api.py",
        (("    if is_leaf is None and not said_once:", "    if is_leaf is None:"),),
        (
            "tests/test_errors.py::test_a_call_with_the_pure_dict_of_the_nnx_state_planned_says_so_once",
        ),
        "a call with the pure dict of the nnx.State planned lists every leaf again below the "
        "one difference",
    ),
    Mutant(
        "interrupted-call-releases-its-claim",
        "jaxreshard/api.py",
        (
            (
                "                try:\n"
                "                    return self._move(flat, old, profile, copies)\n"
                "                finally:\n                    _DONATED.release(old)",
                "                return self._move(flat, old, profile, copies)",
            ),
            (
                "        try:\n            return future.result()\n        except BaseException:\n"
                "            if future.cancel():\n                _DONATED.release(old)\n"
                "            raise",
                "        try:\n            return future.result()\n        finally:\n"
                "            _DONATED.release(old)",
            ),
        ),
        (
            "tests/test_async.py::test_a_call_interrupted_while_it_waits_behind_refits_keeps_its_"
            "donation_until_it_is_done",
        ),
        "a call interrupted while it waits behind refits gives up its donate= claim while its "
        "move is still queued: a retry is handed the tree the move consumes (XLA crashed)",
    ),
    Mutant(
        "interrupted-start-keeps-its-claim",
        "jaxreshard/api.py",
        (
            (
                "        except BaseException as e:  # a Ctrl-C here too: nothing will take the "
                "claim back",
                "        except ReshardError as e:",
            ),
        ),
        ("tests/test_async.py::test_a_start_interrupted_before_it_submits_keeps_no_claim",),
        "a start interrupted before it submits its move keeps its donate= claim for good",
    ),
    Mutant(
        "fp8-donated-source-unchecked",
        "jaxreshard/api.py",
        (
            (
                "        if donate is None or not sources:\n            return []",
                "        return []",
            ),
        ),
        ("tests/test_fp8.py::test_an_fp8_source_donated_as_the_values_is_refused_and_kept",),
        "an fp8 source donated as a result's values is consumed by the call",
    ),
    Mutant(
        "fp8-agreement-without-source-dtype",
        "jaxreshard/api.py",
        (
            (
                "            inner.quantized_from[position[i + n]] = str(jnp.dtype(dtype))",
                "            pass",
            ),
        ),
        (
            "tests/test_fp8.py::test_the_plan_agreement_compares_the_dtype_fp8_leaves_are_"
            "quantized_from",
        ),
        "processes quantizing fp8 leaves from different dtypes agree on one plan",
    ),
    Mutant(
        "mixed-dict-keys-escape-as-jax-errors",
        "jaxreshard/api.py",
        (
            (
                '    _check_flattenable(\n        {"the source tree": src_tree, "dst_shardings": '
                'dst_shardings, "dtype=": dtype}\n    )\n    _refuse_tracers((src_tree,), {})',
                "    _refuse_tracers((src_tree,), {})",
            ),
        ),
        (
            "tests/test_errors.py::test_a_dict_of_str_and_int_keys_is_refused_naming_the_"
            "argument_and_the_dict",
        ),
        "a dst_shardings or dtype= dict of str and int keys escapes as JAX's ValueError, "
        "naming neither the argument nor the dict",
    ),
    Mutant(
        "route-cover-dropped",
        "jaxreshard/planning/route.py",
        (("    covered = _cover(numbered)\n", "    covered = None\n"),),
        (
            "tests/test_lower.py::test_many_small_leaves_of_regular_layouts_still_run_as_one_"
            "program_a_stage",
        ),
        "LoRA adapters take senders by the other candidates: two receivers with two senders, "
        "two with three, and two programs a side in every step",
    ),
    Mutant(
        "route-cover-without-turns",
        "jaxreshard/planning/route.py",
        (
            (
                "s = holders[(turn[holders] + taken[holders]) % len(holders)]",
                "s = holders[taken[holders] % len(holders)]",
            ),
        ),
        (
            "tests/test_lower.py::test_many_small_leaves_of_regular_layouts_still_run_as_one_"
            "program_a_stage",
        ),
        "receivers sharing senders split their parts between them the same way, not rotated: "
        "the senders send different leaves and run two programs a step",
    ),
    Mutant(
        "fallback-destinations-not-involved",
        "jaxreshard/run/multihost.py",
        (
            (
                "    return involved_processes(plan.leaves, process_of, plan.fallback_devices)",
                "    return involved_processes(plan.leaves, process_of)",
            ),
        ),
        (
            "tests/test_multihost.py::test_a_plans_processes_include_its_fallback_leaves_"
            "destinations",
        ),
        "a process involved only through a fallback leaf's destination is not order-checked, "
        "and a plan of fallback leaves alone checks no call",
    ),
    Mutant(
        "fallback-leaves-not-fingerprinted",
        "jaxreshard/run/multihost.py",
        (("        parts.append([list(f) for f in fallbacks])", "        pass"),),
        (
            "tests/test_multihost.py::test_agreement_compares_the_fallback_leaves_and_names_"
            "the_one_that_differs",
        ),
        "processes sending a fallback leaf to different shardings agree on one plan",
    ),
    Mutant(
        "lower-held-parts-never-kept",
        "jaxreshard/planning/lower.py",
        (("KEEP_HELD_PARTS = True\n", "KEEP_HELD_PARTS = False\n"),),
        (
            "tests/test_compiled.py::test_colocated_small_leaves_pass_held_parts_through_slots_"
            "of_their_own_exactly",
        ),
        "devices holding part of their shards copy it locally where their peers receive theirs: "
        "two programs a side a step, every leaf re-wrapped for each",
    ),
    Mutant(
        "lower-kept-slot-beyond-the-cap",
        "jaxreshard/planning/lower.py",
        (
            (
                "        if rounds_bytes + sum(slot.nbytes for slot, _ in messages) > cap:",
                "        if False:",
            ),
        ),
        ("tests/test_lower.py::test_rounds_per_unit_meet_the_konig_bound_of_each_round_size",),
        "a held part's slot takes a step's staging past two buckets",
    ),
    Mutant(
        "lower-kept-slot-gets-a-receive-buffer",
        "jaxreshard/planning/lower.py",
        (
            (
                "        recv = tuple(enumerate(step.slots[:rounds]))",
                "        recv = tuple(enumerate(step.slots))",
            ),
        ),
        (
            "tests/test_lower.py::test_devices_holding_part_of_their_shards_pass_it_to_"
            "themselves_to_run_one_program",
        ),
        "every device holds a receive buffer for the held parts' slot too (staging grows)",
    ),
    Mutant(
        "runtime-kept-parts-not-handed-to-the-unpack",
        "jaxreshard/run/runtime.py",
        (
            (
                "        kept = {(d, t): sent[d, t] for d, t in step.kept if (d, t) in sent}",
                "        kept = {(d, t): received.get((d, 0)) for d, t in step.kept}",
            ),
        ),
        (
            "tests/test_compiled.py::test_colocated_small_leaves_pass_held_parts_through_slots_"
            "of_their_own_exactly",
        ),
        "the unpack reads a held part from another round's buffer",
    ),
    Mutant(
        "api-alias-check-reads-the-wrong-sources",
        "jaxreshard/api.py",
        (
            (
                "tuple(self.moved[k] for k, b in enumerate(src) if not b.isdisjoint(every_dst)),",
                "tuple(self.moved[k] for k, b in enumerate(src) if b.isdisjoint(every_dst)),",
            ),
        ),
        (
            "tests/test_errors.py::test_the_buffer_check_reads_only_leaves_whose_shards_could_"
            "share_buffers",
        ),
        "a donate= leaf over another leaf's source buffers goes in (the source destroyed)",
    ),
    Mutant(
        "lower-held-parts-passed-in-one-message",
        "jaxreshard/planning/lower.py",
        (
            (
                "            return [[c for c in copies if c.leaf in p] for p in parts]",
                "            return [list(copies)]",
            ),
        ),
        ("tests/test_lower.py::test_held_parts_are_cut_as_a_peer_that_holds_none_receives_them",),
        "a holder passes itself all its parts in one message where its peers get them in two: "
        "its unpack still differs from theirs",
    ),
    Mutant(
        "lower-held-parts-kept-whatever-their-bytes",
        "jaxreshard/planning/lower.py",
        (("REWRAP_BYTES + most <", "REWRAP_BYTES <"),),
        (
            "tests/test_lower.py::test_a_held_part_stays_a_local_copy_where_passing_it_costs_"
            "more_than_it_saves",
        ),
        "a held part of megabytes is copied twice to save a program",
    ),
    Mutant(
        "api-fallback-sources-unchecked-for-aliases",
        "jaxreshard/api.py",
        (
            (
                "sources is not None and (self._may_alias or fallen):",
                "sources is not None and (self._may_alias or i in fallen):",
            ),
        ),
        (
            "tests/test_errors.py::test_donating_a_leaf_over_a_fallback_leafs_source_buffers_"
            "is_refused",
        ),
        "a donate= leaf over a fallback leaf's source buffers goes in (the source destroyed)",
    ),
    Mutant(
        "lower-join-ignores-relays",
        "jaxreshard/planning/lower.py",
        (
            (
                "return not any(i in written for call in step.packs for i, side in call.args "
                'if side == "dst")',
                "return True",
            ),
        ),
        ("tests/test_lower.py::test_a_relay_never_joins_the_step_that_delivers_what_it_forwards",),
        "a relay's step joins the step that delivers what it forwards: its pack reads them first",
    ),
    Mutant(
        "lower-join-at-base-zero",
        "jaxreshard/planning/lower.py",
        (("bases = [tuple(j * first.slots[t].words", "bases = [tuple(0 * first.slots[t].words"),),
        ("tests/test_lower.py::test_steps_of_the_same_rounds_run_as_one_step_of_half_a_bucket",),
        "every joined step's messages at the slot's start: each overwrites the last",
    ),
    Mutant(
        "lower-join-whole-bucket",
        "jaxreshard/planning/lower.py",
        (
            (
                "steps = _joined(steps, int(bucket_bytes) // 2)",
                "steps = _joined(steps, int(bucket_bytes) * 2)",
            ),
        ),
        ("tests/test_lower.py::test_steps_of_the_same_rounds_run_as_one_step_of_half_a_bucket",),
        "joined steps fill two buckets of slots a device (staging beyond the cap)",
    ),
    Mutant(
        "lower-join-groups-of-any-size",
        "jaxreshard/planning/lower.py",
        (("        if n % k == 0:\n", "        if False:\n"),),
        ("tests/test_lower.py::test_a_run_is_cut_into_groups_of_one_size_where_a_divisor_allows",),
        "runs joined in groups of the most and a shorter last one: programs compiled per size",
    ),
    Mutant(
        "lower-join-ignores-kept",
        "jaxreshard/planning/lower.py",
        (
            (
                "return (step.slots, step.shared, step.kept, transfer.devices, transfer.perms)",
                "return (step.slots, step.shared, transfer.devices, transfer.perms)",
            ),
        ),
        ("tests/test_lower.py::test_joined_steps_keep_held_parts_and_gathers_exact",),
        "steps whose held parts differ join: one program slot a round's on one device and a "
        "kept one on another",
    ),
    Mutant(
        "lower-join-kinds-only-side-by-side",
        "jaxreshard/planning/lower.py",
        (("        elif not relays:\n", "        elif False:\n"),),
        ("tests/test_lower.py::test_steps_of_one_kind_join_wherever_they_sit_without_relays",),
        "without relays too, only consecutive steps join: layers of alternating rounds run a "
        "step each",
    ),
    Mutant(
        "runtime-pack-ignores-base",
        "jaxreshard/run/runtime.py",
        (
            (
                "_put_words(bufs[r.slot], words, r.offset, slot.width, bases[r.slot])",
                "_put_words(bufs[r.slot], words, r.offset, slot.width)",
            ),
        ),
        (
            "tests/test_compiled.py::test_many_small_leaves_move_in_joined_steps_exactly_and_through_no_host",
        ),
        "a joined step's packs write their messages at the slot's start",
    ),
    Mutant(
        "runtime-unpack-ignores-base",
        "jaxreshard/run/runtime.py",
        (("            if bases[slot] is None:\n", "            if True:\n"),),
        (
            "tests/test_compiled.py::test_many_small_leaves_move_in_joined_steps_exactly_and_through_no_host",
        ),
        "a joined step's unpacks read every step's messages from the slot's start",
    ),
    Mutant(
        "lower-stats-count-buckets-not-steps",
        "jaxreshard/planning/lower.py",
        (("        buckets=len(moving),\n", ""),),
        (
            "tests/test_compiled.py::test_many_small_leaves_move_in_joined_steps_exactly_and_through_no_host",
        ),
        "a joined plan reports the schedule's buckets, not the steps a call runs",
    ),
    Mutant(
        "lower-joined-step-keeps-first-bucket",
        "jaxreshard/planning/lower.py",
        (("        tuple(b for x in run for b in x.buckets),\n", "        first.buckets,\n"),),
        ("tests/test_lower.py::test_steps_of_the_same_rounds_run_as_one_step_of_half_a_bucket",),
        "a joined step names only its first step's schedule bucket",
    ),
    Mutant(
        "costmodel-joined-steps-priced-apart",
        "jaxreshard/tools/costmodel.py",
        (
            (
                "    if steps is not None:\n        every = list(counts)",
                "    if False:\n        every = list(counts)",
            ),
        ),
        (
            "tests/test_simulate.py::test_buckets_a_call_runs_as_one_joined_step_are_priced_as_one_step",
        ),
        "the cost model prices each bucket of a joined step apart",
    ),
    Mutant(
        "api-verify-takes-any-truthy-value",
        "jaxreshard/api.py",
        (
            (
                "            if not isinstance(verify, (bool, np.bool_)):",
                "            if False:",
            ),
        ),
        ("tests/test_errors.py::test_verify_takes_true_or_false_only",),
        "a call takes verify='no' as true instead of refusing it",
    ),
    Mutant(
        "whole-spares-not-counted",
        "jaxreshard/planning/lower.py",
        (
            (
                "        out[d] = Roles(recv, (), idle)",
                "        out[d] = Roles((), (), ())",
            ),
        ),
        (
            "tests/test_whole_shards.py::test_spares_count_as_staging_and_a_leaf_whose_spares_pass_half_a_bucket_is_staged",
        ),
        "a whole-shard step's spare buffers are not counted as staging (nor taken from the pool)",
    ),
    Mutant(
        "whole-floats-permuted-as-values",
        "jaxreshard/run/runtime.py",
        (
            (
                "    if not jnp.issubdtype(x.dtype, jnp.floating):\n        return fn(x)",
                "    if True:\n        return fn(x)",
            ),
        ),
        (
            "tests/test_whole_shards.py::test_a_whole_shard_layout_moves_exactly_without_staging_copies",
        ),
        "whole bfloat16 and float8 shards are permuted as values (XLA CPU quietens NaN payloads)",
    ),
    Mutant(
        "whole-partial-boxes-accepted",
        "jaxreshard/planning/whole.py",
        (
            (
                "        if box != dst_box.get(d) or box != src_box.get(s) or d in covered:",
                "        if d in covered:",
            ),
        ),
        (
            "tests/test_whole_shards.py::"
            "test_only_pieces_that_are_whole_shards_of_their_holder_make_a_leaf_whole",
        ),
        "a leaf sent as parts of shards is taken for whole shards",
    ),
    Mutant(
        "whole-steps-join-other-devices",
        "jaxreshard/planning/whole.py",
        (
            (
                "            _sides(leaves[i]) != _sides(leaves[group[0].leaf])\n"
                "            or not",
                "            not",
            ),
        ),
        ("tests/test_whole_shards.py::test_leaves_of_other_devices_move_in_steps_of_their_own",),
        "leaves of other device sets join one whole-shard step (one allocation over both)",
    ),
    Mutant(
        "whole-wire-counts-local-copies",
        "jaxreshard/planning/lower.py",
        (
            (
                "        slot.nbytes * sum(1 for a, b in pairs if a != b) for slot",
                "        slot.nbytes * len(pairs) for slot",
            ),
        ),
        (
            "tests/test_whole_shards.py::test_a_whole_shard_layout_moves_exactly_without_staging_copies",
        ),
        "bytes_wire counts a whole-shard step's local copies as bytes between devices",
    ),
    Mutant(
        "roles-on-devices-outside-the-transfer",
        "jaxreshard/planning/lower.py",
        (("    for d in (d for d in union if d in mine):", "    for d in union:"),),
        ("tests/test_whole_shards.py::test_whole_steps_on_devices_no_staged_transfer_touches",),
        "a staged step's staging is counted on devices its transfer does not touch",
    ),
    Mutant(
        "alloc-one-program-for-every-device-order",
        "jaxreshard/run/runtime.py",
        (
            (
                "views.by_device_order([self.dst_shardings[i] for i in leaves])",
                "[list(range(len(leaves)))]",
            ),
        ),
        (
            "tests/test_whole_shards.py::"
            "test_leaves_joined_in_one_step_may_order_the_same_devices_differently",
        ),
        "fresh destinations of meshes in different device orders are made by one program",
    ),
    Mutant(
        "quantizer-one-program-for-every-device-order",
        "jaxreshard/quant.py",
        (
            (
                "for ks in views.by_device_order(self.src_shardings)",
                "for ks in [list(range(len(self.src_shardings)))]",
            ),
        ),
        (
            "tests/test_fp8.py::"
            "test_fp8_leaves_whose_sources_order_devices_differently_quantize_apart",
        ),
        "fp8 sources in different device orders are quantized by one program",
    ),
    Mutant(
        "colour-swap-keeps-the-last-senders-old-colour",
        "jaxreshard/planning/schedule.py",
        (("            del at_src[node][last]\n", ""),),
        ("tests/test_planner.py::test_colour_rounds_meets_the_konig_bound",),
        "a Kempe swap ending at a sender leaves that sender's edge under its old colour too",
    ),
    Mutant(
        "colour-every-chunk-numbered-first",
        "jaxreshard/planning/schedule.py",
        (("            k = chunks.get(d, 0)\n", "            k = 0\n"),),
        ("tests/test_planner.py::test_colour_rounds_meets_the_konig_bound",),
        "a pair's chunks in several rounds are all numbered chunk 0",
    ),
    Mutant(
        "parted-rounds-unsorted",
        "jaxreshard/planning/schedule.py",
        (("order = np.lexsort((dst, src))", "order = np.arange(len(src))"),),
        ("tests/test_planner.py",),
        "a stage planned by parts lists each round's entries part by part, not in pair order",
    ),
    Mutant(
        "units-runs-within-one-bucket-on-accelerators",
        "jaxreshard/planning/schedule.py",
        (
            (
                "load = _RunLoad(loads, bucket_bytes, max_copies, unit_bytes)  # (the run's)",
                "load = _RunLoad(loads, bucket_bytes, max_copies)  # (the run's)",
            ),
        ),
        ("tests/test_lower.py::test_on_accelerators_runs_of_leaves_fill_units_of_many_buckets",),
        "on accelerators a run of leaves stops at one bucket, not at the unit's many buckets",
    ),
    Mutant(
        "units-copy-cap-per-unit-not-per-bucket",
        "jaxreshard/planning/schedule.py",
        (
            (
                "1, -(-nbytes // self.bucket_bytes)",
                "1, -(-self.limit // self.bucket_bytes)",
            ),
        ),
        ("tests/test_lower.py::test_on_accelerators_runs_of_leaves_fill_units_of_many_buckets",),
        "a unit of many buckets may give a device the copies of all of them in one bucket",
    ),
    Mutant(
        "units-run-past-the-copy-cap-takes-others",
        "jaxreshard/planning/schedule.py",
        (("        return touched == len(self.over)\n", "        return True\n"),),
        ("tests/test_lower.py",),
        "a run past a unit's copy cap on some device takes a leaf that leaves that device past it",
    ),
    Mutant(
        "api-unit-buckets-ignored",
        "jaxreshard/api.py",
        (
            (
                "platform_options(platform, int(bucket_bytes), unit_buckets)",
                "platform_options(platform, int(bucket_bytes))",
            ),
        ),
        ("tests/test_reshard.py::test_units_of_several_buckets_are_exact_and_cached_apart",),
        "jr.plan takes unit_buckets= and plans with the backend's default unit anyway",
    ),
    Mutant(
        "api-cache-ignores-unit-buckets",
        "jaxreshard/api.py",
        (
            (
                "            (topology, options, unit_buckets),\n",
                "            (topology, options),\n",
            ),
        ),
        ("tests/test_reshard.py::test_units_of_several_buckets_are_exact_and_cached_apart",),
        "jr.reshard's cache hands a plan made with one unit_buckets= to a call asking another",
    ),
    Mutant(
        "boundary-frees-host-donations-before-the-move",
        "jaxreshard/run/boundary.py",
        (
            (
                "            if b.stages_out:\n                out.append(None)\n",
                "            if b.stages_out:\n"
                "                x.delete()\n"
                "                out.append(None)\n",
            ),
        ),
        (
            "tests/test_leaves.py::"
            "test_a_refused_call_keeps_donated_leaves_in_host_memory_and_a_done_one_takes_them",
        ),
        "a call the runtime refuses has already deleted the donated leaves bound for host memory",
    ),
    Mutant(
        "api-masked-fallback-leaf-taken",
        "jaxreshard/api.py",
        (
            (
                "    if isinstance(x, np.ma.MaskedArray):  # (an ndarray, whose copy would drop "
                "the mask)\n",
                "    if False:  # (an ndarray, whose copy would drop the mask)\n",
            ),
        ),
        (
            "tests/test_errors.py::"
            "test_masked_arrays_and_time_deltas_are_refused_when_planning_and_in_a_call",
        ),
        "a NumPy masked array as a fallback leaf loses its mask through the copy "
        "jax.device_put takes",
    ),
    Mutant(
        "join-makes-only-its-own-units-destinations",
        "jaxreshard/planning/lower.py",
        (
            (
                "        units += [maker[i] for x in group for call in x.unpacks for i in "
                "call.targets if i in maker]\n",
                "",
            ),
        ),
        (
            "tests/test_lower.py::"
            "test_a_group_holding_a_later_slab_makes_the_leaf_its_first_slab_makes",
        ),
        "a group of joined steps holding a later slab of a leaf writes it before the unit that "
        "makes its destination has run",
    ),
    Mutant(
        "api-many-small-buckets-unwarned",
        "jaxreshard/api.py",
        (
            (
                "    if made.bucket_bytes >= SMALL_BUCKET_BYTES or stats.buckets < MANY_BUCKETS:\n",
                "    if made.bucket_bytes >= SMALL_BUCKET_BYTES or stats.buckets < 1 << 30:\n",
            ),
        ),
        (
            "tests/test_errors.py::"
            "test_buckets_too_small_for_their_bytes_are_warned_of_once_and_still_planned",
        ),
        "a plan of thousands of tiny buckets is made without a word, every call of it bound by "
        "its bucket count",
    ),
    Mutant(
        "api-quantized-donation-checks-fp8-sources-only",
        "jaxreshard/api.py",
        (
            (
                "        sources = [flat[i] for i in self.quantized if isinstance(flat[i], "
                "jax.Array)]\n",
                "        sources = [flat[i] for i, f in zip(self.quantized, self.formats) if "
                "isinstance(flat[i], jax.Array) and flat[i].dtype == f.fmt]\n",
            ),
        ),
        ("tests/test_fp8.py::test_a_quantized_source_donated_anywhere_is_refused_and_kept",),
        "a float32 source of an fp8 leaf donated at a plain leaf of its layout is deleted by "
        "the call",
    ),
    Mutant(
        "api-quantizer-over-explicit-axes",
        "jaxreshard/api.py",
        (
            (
                "        on_mesh = boundary.as_auto(boundary.as_named(x.sharding, shape))\n",
                "        on_mesh = boundary.as_named(x.sharding, shape)\n",
            ),
        ),
        (
            "tests/test_fp8.py::"
            "test_fp8_leaves_over_explicit_mesh_axes_quantize_move_and_dequantize",
        ),
        "an fp8 leaf whose source mesh has Explicit axes plans, then fails on every call",
    ),
    Mutant(
        "quant-dequantize-over-explicit-axes",
        "jaxreshard/quant.py",
        (("    if _explicit(values):\n", "    if False:\n"),),
        (
            "tests/test_fp8.py::"
            "test_fp8_leaves_over_explicit_mesh_axes_quantize_move_and_dequantize",
        ),
        "QuantizedArray.dequantize fails on a result over Explicit mesh axes",
    ),
    Mutant(
        "runtime-ahead-allocs-one-program-over-orders",
        "jaxreshard/run/runtime.py",
        (
            (
                "                for group in self._alloc_groups(leaves):  # (the programs "
                "`_alloc` runs)\n",
                "                for group in [list(leaves)] if leaves else []:\n",
            ),
        ),
        (
            "tests/test_leaves.py::"
            "test_whole_shards_into_host_memory_on_devices_in_two_orders_compile_once",
        ),
        "the first call compiles one allocation program for destinations over two orders of "
        "devices (which cannot compile), so a later call compiles the ones that run",
    ),
    Mutant(
        "tunix-kept-host-leaves-put-after-the-move",
        "jaxreshard/integrations/tunix.py",
        (
            (
                "        staying = _kept_values(dst, source) if kept else None\n",
                "        staying = None\n",
            ),
            (
                "        out = _with_kept(dst, out, staying)\n",
                "        out = _with_kept(dst, out, _kept_values(dst, source))\n",
            ),
        ),
        (
            "tests/test_tunix_adapter.py::"
            "test_a_host_leaf_under_a_none_target_the_transfer_guard_refuses_is_named_before_the_move",
        ),
        "a host leaf under a None target is put on a device after the move: under Tunix's "
        "transfer guard the sync fails with the donated target consumed",
    ),
    Mutant(
        "api-behind-refusal-not-placed",
        "jaxreshard/api.py",
        (("            self.refuse(error, on_worker=True)\n", ""),),
        (
            "tests/test_multihost.py::"
            "test_a_call_refused_behind_a_refit_in_flight_raises_on_the_peer_and_calls_pair",
        ),
        "a call behind a refit in flight that finds its source consumed raises on its own "
        "process only: the peer's same call pairs with the next one (the launch hangs to its "
        "timeout)",
    ),
    Mutant(
        "api-behind-donations-unchecked",
        "jaxreshard/api.py",
        (
            (
                "        lost = [] if old is None else [self.paths[i] for i in self.moved if "
                "_deleted(old[i])]\n",
                "        lost = []\n",
            ),
        ),
        (
            "tests/test_async.py::"
            "test_a_call_behind_a_refit_donating_an_array_over_its_consumed_tree_is_refused",
        ),
        "a call behind a refit in flight donating an array over the tree that refit consumes "
        "hands XLA a deleted buffer (the process crashed)",
    ),
    Mutant(
        "order-deletes-only-at-a-blocks-first-call",
        "jaxreshard/run/multihost.py",
        (
            (
                "    for block in range(first, last + 1):\n",
                "    for block in range(last, last + 1) if n % _ORDER_BLOCK == 0 else ():\n",
            ),
        ),
        ("tests/test_multihost.py::test_old_call_records_are_deleted_whichever_calls_are_refused",),
        "a block of call records whose first call is refused is never deleted: the "
        "coordinator's store grows for the rest of the job",
    ),
    Mutant(
        "api-cache-keeps-few-plans",
        "jaxreshard/api.py",
        (("_CACHE_SIZE = 256\n", "_CACHE_SIZE = 8\n"),),
        (
            "tests/test_reshard.py::"
            "test_a_sync_cut_into_more_chunks_than_plans_kept_with_staging_plans_once",
        ),
        "the plan cache keeps fewer plans than a chunked sync has chunks: every sync plans and "
        "compiles every chunk again",
    ),
    Mutant(
        "api-cache-keeps-every-plans-staging",
        "jaxreshard/api.py",
        (("    older._keep_staging = False\n", ""),),
        (
            "tests/test_reshard.py::"
            "test_a_sync_cut_into_more_chunks_than_plans_kept_with_staging_plans_once",
        ),
        "every cached plan keeps its staging: a sync cut into chunks to bound device memory "
        "holds every chunk's",
    ),
    Mutant(
        "api-pushed-out-plan-keeps-the-staging-it-makes",
        "jaxreshard/api.py",
        (
            (
                "            self._crossing.free_unused([old[i] for i in self.moved])\n"
                "        self._free_staging_unless_kept()\n",
                "            self._crossing.free_unused([old[i] for i in self.moved])\n",
            ),
        ),
        (
            "tests/test_reshard.py::"
            "test_a_sync_cut_into_more_chunks_than_plans_kept_with_staging_plans_once",
        ),
        "a plan pushed out of the cache's staging window while its started refit waited keeps "
        "the staging that refit makes",
    ),
    Mutant(
        "api-cache-ignores-x64",
        "jaxreshard/api.py",
        (("            bool(jax.config.jax_enable_x64),\n", ""),),
        ("tests/test_reshard.py::test_a_cached_plan_is_not_reused_across_jax_enable_x64",),
        "jr.reshard's plan cache ignores jax_enable_x64: a float64 cast planned with it off "
        "(float32) is reused with it on",
    ),
    Mutant(
        "api-debug-settings-left-on",
        "jaxreshard/api.py",
        (
            (
                "        stack.enter_context(setting(neutral))",
                "        pass",
            ),
        ),
        (
            "tests/test_leaves.py::"
            "test_debugging_settings_neither_stop_a_refit_nor_cost_the_donated_tree[debug_nans-True-process]",
        ),
        "a plan runs under the caller's jax.debug_nans: JAX re-runs an unpack holding a NaN "
        "on buffers it consumed",
    ),
    Mutant(
        "tunix-prefix-taken-leaf-for-leaf",
        "jaxreshard/integrations/tunix.py",
        (("    if _is_prefix(prefix, source):", "    if _is_prefix(prefix, source) and False:"),),
        (
            "tests/test_tunix_adapter.py::test_a_prefix_target_moves_as_tunix_moves_it_whatever"
            "_the_leaf_count[one leaf under one sharding]",
        ),
        "a prefix target with as many entries as the source has leaves is refused for its keys",
    ),
    Mutant(
        "cache-destinations-up-to-trailing-nones",
        "jaxreshard/api.py",
        (
            (
                "            tuple(dst_leaves),",
                "            tuple(_placement_key(d, 2) for d in dst_leaves),",
            ),
        ),
        ("tests/test_compiled.py::test_a_destination_spelled_two_ways_comes_back_as_asked",),
        "the plan cache keys destinations up to trailing Nones, so a result carries another "
        "spelling of its sharding",
    ),
    Mutant(
        "boundary-weak-type-dropped",
        "jaxreshard/run/boundary.py",
        (("            weak_type = b.weak_type != (i in flips)", "            weak_type = False"),),
        (
            "tests/test_leaves.py::"
            "test_weakly_typed_leaves_arrive_weakly_typed_as_device_put_keeps_them",
        ),
        "a weakly typed source arrives strongly typed",
    ),
    Mutant(
        "boundary-weak-type-of-the-plan",
        "jaxreshard/api.py",
        (
            (
                "        moved = self._crossing.results(self.runtime.run(src, inner_old, profile, "
                "check), weak)",
                "        moved = self._crossing.results(self.runtime.run(src, inner_old, profile, "
                "check))",
            ),
        ),
        ("tests/test_leaves.py::test_each_call_gets_its_own_sources_weak_type",),
        "a call's result takes the weak type of the source the plan was made from",
    ),
    Mutant(
        "quant-nan-left-to-the-cross-device-max",
        "jaxreshard/quant.py",
        (("    amax = jnp.where(nan, np.float32(np.nan), amax)", "    amax = amax"),),
        (
            "tests/test_fp8.py::"
            "test_a_nan_block_and_a_tiny_block_straddling_source_shards_quantize_as_the_reference",
        ),
        "a NaN in a block split by source shards is left to XLA's cross-device max, which drops it",
    ),
    Mutant(
        "quick-check-ignores-refits-in-flight",
        "jaxreshard/api.py",
        (
            (
                "            if not _IN_FLIGHT.isdisjoint(ids):\n                return False\n",
                "",
            ),
        ),
        (
            "tests/test_async.py::"
            "test_a_source_of_a_refit_in_flight_cannot_be_donated_and_a_deleted_one_is_named",
        ),
        "the quick pass over a donate= tree lets a source of a refit in flight through",
    ),
    Mutant(
        "quick-check-reads-no-deletion",
        "jaxreshard/api.py",
        (
            (
                "            if not isinstance(x, jax.Array) or x.is_deleted():",
                "            if not isinstance(x, jax.Array):",
            ),
        ),
        ("tests/test_errors.py::test_a_call_with_a_deleted_source_or_donate_leaf_names_it",),
        "the quick pass over a tree takes a deleted array for a live one",
    ),
]

MUTANTS: list[Mutant] = PLANNER_MUTANTS + MULTIHOST_MUTANTS + EXECUTOR_MUTANTS + SURFACE_MUTANTS


# ------------------------------------------------------------------------------ machinery

IGNORED = (".git", ".venv", ".hypothesis", "__pycache__", ".pytest_cache", ".ruff_cache")


def copy_tree(dest: Path) -> Path:
    """The repository's working tree (what the tests would run on), without .git and caches."""
    shutil.copytree(
        ROOT, dest, ignore=shutil.ignore_patterns(*IGNORED, "*.egg-info", "build", "dist")
    )
    return dest


def environment(tree: Path) -> dict[str, str]:
    """Imports resolve to the copy first: its root on PYTHONPATH (ahead of the editable
    install's finder), no bytecode written, so a restored file is never shadowed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports_copy(tree: Path, file: str, needle: str | None) -> None:
    """Import the module of ``file`` as the tests will, and check it is the copy's file (with
    the mutation in it, if ``needle`` is given)."""
    module = file.removesuffix(".py").replace("/", ".")
    probe = (
        "import importlib, inspect, sys\n"
        f"m = importlib.import_module({module!r})\n"
        "print(m.__file__)\n"
        "sys.exit(0 if sys.argv[1] == '' or sys.argv[1] in inspect.getsource(m) else 3)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe, needle or ""],
        cwd=tree,
        env=environment(tree),
        capture_output=True,
        text=True,
        timeout=300,
    )
    where = run.stdout.strip().splitlines()[-1:] or ["?"]
    if run.returncode != 0 or Path(where[0]).resolve() != (tree / file).resolve():
        raise SystemExit(
            f"{module} was not imported from the patched copy ({where[0]}; status "
            f"{run.returncode}):\n{run.stderr[-2000:]}"
        )


def run_tests(tree: Path, tests: Sequence[str]) -> tuple[int, set[str], str]:
    """``python -m pytest -q tests`` in the copy: (exit status, the named tests that failed,
    the first lines that say why)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests]
    try:
        run = subprocess.run(
            cmd, cwd=tree, env=environment(tree), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:  # a test hung on the bug: it would fail CI by timeout
        return 1, set(tests), f"the tests ran past {TIMEOUT_S} s (hung on the bug)"
    lines = run.stdout.splitlines()
    failed = {t for t in tests for ln in lines if ln.startswith(f"FAILED {t}")}
    why = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    why += [ln for ln in lines if ln.startswith("E   ")][:2]
    why = [ln if len(ln) < 160 else ln[:157] + "..." for ln in why or lines[-3:]]
    return run.returncode, failed, "\n      ".join(why)


def apply(tree: Path, mutant: Mutant) -> str:
    """Patch the copy; returns the original text (to restore)."""
    path = tree / mutant.file
    original = text = path.read_text()
    for old, new in mutant.patches:
        count = text.count(old)
        if count != 1:
            raise SystemExit(
                f"mutant {mutant.name}: the text to replace occurs {count} times in "
                f"{mutant.file} (expected once); update the mutant:\n{old}"
            )
        text = text.replace(old, new)
    path.write_text(text)
    return original


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="name substring")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or any(s in m.name for s in args.only)]
    if args.list or not chosen:
        for m in MUTANTS:
            print(f"{m.name:34} {m.file:32} {' '.join(m.tests)}")
        return 0 if args.list else 2
    with tempfile.TemporaryDirectory(prefix="jaxreshard-mutants-") as tmp:
        tree = copy_tree(Path(tmp) / "repo")
        check_imports_copy(tree, chosen[0].file, None)
        named = sorted({t for m in chosen for t in m.tests})
        start = time.monotonic()
        status, _, why = run_tests(tree, named)
        took = time.monotonic() - start
        print(f"unmutated: {len(named)} named tests, pytest status {status} ({took:.0f} s)")
        if status != 0:
            print(f"  the unmutated code fails its named tests:\n      {why}")
            return 1
        results = []
        for m in chosen:
            original = apply(tree, m)
            try:
                check_imports_copy(tree, m.file, m.patches[0][1])
                start = time.monotonic()
                status, failed, why = run_tests(tree, m.tests)
            finally:
                (tree / m.file).write_text(original)
            if status == 1:
                verdict = "caught" if len(failed) == len(m.tests) else "PARTLY caught"
            else:
                verdict = "SURVIVED" if status == 0 else f"BROKEN (pytest status {status})"
            results.append((m, verdict))
            print(f"{m.name:34} {verdict:10} ({time.monotonic() - start:.0f} s)  {m.bug}")
            print(f"      {why}")
    bad = [m.name for m, verdict in results if verdict != "caught"]
    print(
        f"{len(results) - len(bad)} of {len(results)} mutants caught"
        + (f"; not: {bad}" if bad else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
