"""What the A/B probes share: a bench scenario's source and destinations, the check of
several plans' results against `jax.device_put`, and whole donated calls timed in
interleaved rounds."""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from typing import Any

import jax
import numpy as np

from jaxreshard.tools import bench


def case(name: str) -> tuple[Any, Any, Any]:
    """A bench scenario's source tree (on its devices), its destination shardings and its
    ``dtype=``."""
    devices = jax.devices()
    scenario = bench.SCENARIOS[name]
    assert scenario.tree is not None, f"{name} has no tree to move"
    tree = scenario.tree(bench.parse_args([]))
    src_sh, dst_sh = bench.shardings(tree, scenario.layouts(len(devices)), devices)
    return bench.make_source(tree, src_sh), dst_sh, scenario.dtype


def check_bits(src: Mapping[str, jax.Array], dst_sh: Any, outs: Mapping[Hashable, Any]) -> None:
    """Every plan's result equals `jax.device_put` of the source (cast as it was), bit for
    bit."""
    some = next(iter(outs.values()))
    for key, x in src.items():
        want = np.asarray(jax.device_put(x.astype(some[key].dtype), dst_sh[key]))
        for label, out in outs.items():
            got = np.asarray(out[key])
            assert want.view(np.uint8).tobytes() == got.view(np.uint8).tobytes(), (label, key)


def interleaved(
    plans: Mapping[bool, Any], outs: dict[bool, Any], src: Any, rounds: int
) -> tuple[float, float]:
    """Median ms of whole donated calls of ``plans[False]`` and ``plans[True]``, in
    ``rounds`` rounds that alternate which goes first (after two warm-up calls each)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for k in (False, True, False, True):  # warm-up
        outs[k] = plans[k](src, donate=outs[k])
    for i in range(rounds):
        for k in (False, True) if i % 2 else (True, False):
            jax.block_until_ready(outs[k])
            t0 = time.perf_counter()
            outs[k] = plans[k](src, donate=outs[k])
            jax.block_until_ready(outs[k])
            times[k].append(time.perf_counter() - t0)
    off, on = (1e3 * float(np.median(times[k])) for k in (False, True))
    return off, on
