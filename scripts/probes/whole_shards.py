"""Probe: what a path that sends whole shards, without pack or unpack, would win.

Where every destination shard is one whole source shard (the same spec on other devices, or
on the same devices in another order), a collective-permute could send each source shard as
it is and receive it straight into the destination's donated buffer: no staging, no pack, no
unpack. jaxreshard packs and unpacks every message (README, Limitations: "a pure permutation
of whole shards"). This probe times, on 8 simulated CPU devices, 8 float32 leaves of
4096 x 2048 (256 MiB) with ``P(None, "tp")`` on both sides:

- ``disjoint``: tp4 on devices 0-3 -> tp4 on devices 4-7;
- ``permuted``: tp8 on devices 0-7 -> tp8 on 1, 0, 3, 2, 5, 4, 7, 6;

each as a jaxreshard refit (donated), `jax.device_put`, and a hand-written ``shard_map`` of
one ``ppermute`` a leaf over the union of both device sets, its send operands the source
shards (devices that send nothing pass a spare buffer) and its receive buffers donated: the
destination's shards (devices that receive nothing pass a spare, which comes back zeroed).
Every result is checked bit for bit; medians of whole calls, the three interleaved.

    python scripts/probes/whole_shards.py [rounds]
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr

SHAPE = (4096, 2048)
LEAVES = 8
CASES = {
    "disjoint": ([0, 1, 2, 3], [4, 5, 6, 7]),
    "permuted": (list(range(8)), [1, 0, 3, 2, 5, 4, 7, 6]),
}


def _by_device(x: jax.Array) -> dict[int, jax.Array]:
    return {s.device.id: s.data for s in x.addressable_shards}


class WholeShards:
    """The hand-written path: per leaf, one collective-permute of whole shards over the
    union mesh into donated buffers; keeps each leaf's destination and spare buffers."""

    def __init__(self, src: dict[str, jax.Array], dst: dict[str, NamedSharding]) -> None:
        self.src, self.dst = src, dst
        first = next(iter(src.values()))
        self.senders = [d.id for d in first.sharding.mesh.devices.flat]
        self.receivers = [d.id for d in next(iter(dst.values())).mesh.devices.flat]
        self.union = sorted(set(self.senders) | set(self.receivers))
        devices = {d.id: d for d in jax.devices()}
        mesh = Mesh(np.array([devices[d] for d in self.union]), ("u",))
        self.sharding = NamedSharding(mesh, P("u"))
        at = {d: i for i, d in enumerate(self.union)}
        perm = [(at[s], at[r]) for s, r in zip(self.senders, self.receivers, strict=True)]
        self.shard = first.addressable_shards[0].data.shape
        self.union_shape = (len(self.union) * self.shard[0], *self.shard[1:])

        def permute(x: jax.Array, into: jax.Array) -> jax.Array:
            del into  # donated: XLA writes the result into it
            return jax.lax.ppermute(x, "u", perm)

        mapped = jax.shard_map(
            permute, mesh=mesh, in_specs=(P("u"), P("u")), out_specs=P("u"), check_vma=False
        )
        self.fn = jax.jit(mapped, donate_argnums=(1,), keep_unused=True)

        def spare(d: int) -> jax.Array:
            return jax.device_put(np.zeros(self.shard, first.dtype), devices[d])

        self.idle = {d: spare(d) for d in self.union if d not in self.senders}
        self.into = {k: {d: spare(d) for d in self.union} for k in src}

    def __call__(self) -> dict[str, jax.Array]:
        out = {}
        for k, x in self.src.items():
            held = _by_device(x)
            send = [held.get(d, self.idle.get(d)) for d in self.union]
            into = [self.into[k][d] for d in self.union]
            moved = self.fn(
                jax.make_array_from_single_device_arrays(self.union_shape, self.sharding, send),
                jax.make_array_from_single_device_arrays(self.union_shape, self.sharding, into),
            )
            self.into[k] = _by_device(moved)
            order = [d.id for d in self.dst[k].mesh.devices.flat]
            out[k] = jax.make_array_from_single_device_arrays(
                x.shape, self.dst[k], [self.into[k][d] for d in order]
            )
        return out


def _median_ms(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        jax.block_until_ready(fn())
    for i in range(rounds):
        for name in list(fns)[i % len(fns) :] + list(fns)[: i % len(fns)]:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * float(np.median(t)) for name, t in times.items()}


def probe(name: str, rounds: int) -> None:
    devices = jax.devices()
    senders, receivers = CASES[name]
    src_mesh = Mesh(np.array([devices[d] for d in senders]), ("tp",))
    dst_mesh = Mesh(np.array([devices[d] for d in receivers]), ("tp",))
    rng = np.random.default_rng(0)
    src = {
        f"w{i}": jax.device_put(
            rng.standard_normal(SHAPE, np.float32), NamedSharding(src_mesh, P(None, "tp"))
        )
        for i in range(LEAVES)
    }
    dst = {k: NamedSharding(dst_mesh, P(None, "tp")) for k in src}
    plan = jr.plan(src, dst)
    refit = {"out": plan(src)}

    def jaxreshard() -> Any:
        refit["out"] = plan(src, donate=refit["out"])
        return refit["out"]

    whole = WholeShards(src, dst)
    fns = {
        "jaxreshard": jaxreshard,
        "device_put": lambda: jax.device_put(src, dst),
        "whole shards": whole,
    }
    for label, fn in fns.items():
        got = fn()
        for k, x in src.items():
            assert got[k].sharding == dst[k], (label, k)
            assert np.asarray(got[k]).tobytes() == np.asarray(x).tobytes(), (label, k)
    ms = _median_ms(fns, rounds)
    print(
        f"{name:9s} "
        + ", ".join(f"{label} {t:6.1f} ms" for label, t in ms.items())
        + f" | jaxreshard {plan.stats.programs} programs, {plan.stats.buckets} buckets"
        + f"; whole shards / jaxreshard {ms['whole shards'] / ms['jaxreshard']:.2f}x"
    )


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    for case in CASES:
        probe(case, rounds)
