"""A/B probe: small-leaf trees on colocated layouts, with held parts passed through slots of
their own (`lower.KEEP_HELD_PARTS`) and without, against `jax.device_put`.

Trees the bench does not hold (many small leaves, scanned and MoE-like stacks, optimizer
state) on 8 simulated CPU devices, source and destination over the same devices. Each case
is planned both ways in one process, checked bit for bit against `jax.device_put`, then
timed in interleaved rounds (medians of whole calls; device_put one leaf at a time, as the
bench does: a tree-wide call deadlocks XLA's CPU collectives).

    python scripts/probes/colocated_trees.py            # every case
    python scripts/probes/colocated_trees.py adapters   # one case
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from jaxreshard.planning import lower

Case = tuple[dict[str, jax.Array], dict[str, NamedSharding]]


def _meshes() -> dict[str, Mesh]:
    devices = np.array(jax.devices()[:8])
    return {
        "fsdp4_tp2": Mesh(devices.reshape(4, 2), ("fsdp", "tp")),
        "line": Mesh(devices, ("x",)),
        "line_reversed": Mesh(devices[::-1], ("x",)),
        "dp2_tp4": Mesh(devices.reshape(2, 4), ("dp", "tp")),
    }


def _array(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.Array:
    values = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape)
    return jax.device_put(values.astype(dtype), sharding)


def adapters(m: dict[str, Mesh]) -> Case:
    """448 LoRA-sized (8, 1024) float32 leaves: rows over fsdp4 x tp2 -> columns over 8."""
    src = NamedSharding(m["fsdp4_tp2"], P("fsdp", "tp"))
    leaves = {f"l{i}": _array((8, 1024), jnp.float32, src) for i in range(448)}
    return leaves, {k: NamedSharding(m["line"], P(None, "x")) for k in leaves}


def tiny(m: dict[str, Mesh]) -> Case:
    """40 tiny float32 leaves of four shapes -> dp2 x tp4 on the same devices."""
    src, dst = {}, {}
    for i in range(40):
        shape = [(8,), (16, 8), (32,), (8, 32)][i % 4]
        spec = P("fsdp") if len(shape) == 1 else P("fsdp", "tp")
        src[f"t{i}"] = _array(shape, jnp.float32, NamedSharding(m["fsdp4_tp2"], spec))
        out = P("tp") if len(shape) == 1 else P(None, "tp")
        dst[f"t{i}"] = NamedSharding(m["dp2_tp4"], out)
    return src, dst


def blocks(m: dict[str, Mesh]) -> Case:
    """12 bf16 blocks of width 256, fsdp over 8 -> tp4 x dp2 (column and row parallel)."""
    src, dst = {}, {}
    shapes = {"qkv": (256, 768), "o": (256, 256), "up": (256, 1024), "down": (1024, 256)}
    for i in range(12):
        for name, shape in {**shapes, "ln": (256,)}.items():
            key = f"b{i}.{name}"
            spec = P("x") if len(shape) == 1 else P("x", None)
            src[key] = _array(shape, jnp.bfloat16, NamedSharding(m["line"], spec))
            out = P(None) if len(shape) == 1 else P(None, "tp")
            if name in ("o", "down"):
                out = P("tp", None)
            dst[key] = NamedSharding(m["dp2_tp4"], out)
    return src, dst


def scanned(m: dict[str, Mesh]) -> Case:
    """A scanned bf16 stack of 8 layers, its biases and an embedding -> dp2 x tp4."""
    s = m["fsdp4_tp2"]
    src = {
        "w": _array((8, 256, 512), jnp.bfloat16, NamedSharding(s, P(None, "fsdp", "tp"))),
        "b": _array((8, 512), jnp.bfloat16, NamedSharding(s, P(None, "tp"))),
        "e": _array((4096, 256), jnp.bfloat16, NamedSharding(s, P("fsdp", "tp"))),
    }
    d = m["dp2_tp4"]
    dst = {
        "w": NamedSharding(d, P(None, None, "tp")),
        "b": NamedSharding(d, P(None, "tp")),
        "e": NamedSharding(d, P("tp", None)),
    }
    return src, dst


def optimizer(m: dict[str, Mesh]) -> Case:
    """Parameters and two moments (18 float32 leaves) -> rows over the devices reversed."""
    src, dst = {}, {}
    for part in ("p", "mu", "nu"):
        for i in range(6):
            key = f"{part}.{i}"
            sharding = NamedSharding(m["fsdp4_tp2"], P("fsdp", "tp"))
            src[key] = _array((128, 256), jnp.float32, sharding)
            dst[key] = NamedSharding(m["line_reversed"], P("x", None))
    return src, dst


def experts(m: dict[str, Mesh]) -> Case:
    """Four bf16 expert stacks, one expert a device -> their columns over tp4 x dp2."""
    sharding = NamedSharding(m["line"], P("x", None, None))
    src = {f"e{i}": _array((8, 128, 256), jnp.bfloat16, sharding) for i in range(4)}
    return src, {k: NamedSharding(m["dp2_tp4"], P(None, None, "tp")) for k in src}


CASES: dict[str, Callable[[dict[str, Mesh]], Case]] = {
    "adapters": adapters,
    "tiny": tiny,
    "blocks": blocks,
    "scanned": scanned,
    "optimizer": optimizer,
    "experts": experts,
}


def _times(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return out


def probe(name: str, meshes: dict[str, Mesh], rounds: int = 5) -> None:
    src, dst = CASES[name](meshes)

    def put() -> dict[str, jax.Array]:  # one leaf at a time
        return {k: jax.block_until_ready(jax.device_put(v, dst[k])) for k, v in src.items()}

    want = put()
    plans, first = {}, {}
    for keep in (False, True):
        lower.KEEP_HELD_PARTS = keep
        t0 = time.perf_counter()
        plans[keep] = jr.plan(src, dst)
        out = jax.block_until_ready(plans[keep](src))
        first[keep] = time.perf_counter() - t0
        for k in src:
            same = np.asarray(out[k]).tobytes() == np.asarray(want[k]).tobytes()
            assert same, (name, keep, k)
    lower.KEEP_HELD_PARTS = True
    times: dict[Any, list[float]] = {False: [], True: [], "device_put": []}
    for keep in (False, True):
        _times(lambda keep=keep: plans[keep](src), 2)
    _times(put, 2)
    for _ in range(rounds):
        for keep in (False, True):
            times[keep] += _times(lambda keep=keep: plans[keep](src), 3)
        times["device_put"] += _times(put, 3)
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    off, on = plans[False].stats, plans[True].stats
    print(
        f"{name:9s} device_put {ms['device_put']:6.1f} ms | held parts copied locally "
        f"{ms[False]:6.1f} ms ({ms[False] / ms['device_put']:.2f}x; {off.programs} programs, "
        f"{off.dispatches} dispatches, first call {first[False]:.2f} s) | passed through "
        f"slots {ms[True]:6.1f} ms ({ms[True] / ms['device_put']:.2f}x; {on.programs} "
        f"programs, {on.dispatches} dispatches, first call {first[True]:.2f} s, staging "
        f"{off.staging_bytes >> 10} -> {on.staging_bytes >> 10} KiB)",
        flush=True,
    )


def main(argv: list[str]) -> None:
    names = argv or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; the cases are {list(CASES)}")
    meshes = _meshes()
    for name in names:
        probe(name, meshes)


if __name__ == "__main__":
    main(sys.argv[1:])
