"""A/B probe: a bench scenario planned with joined steps (`lower.JOIN_STEPS`) and without,
in one process, checked bit for bit against `jax.device_put`, then timed in interleaved
rounds (medians of whole calls into donated destinations).

    python scripts/probes/joined_steps.py many_leaves      # any bench scenario name
    python scripts/probes/joined_steps.py lora 20          # 20 rounds
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np

import jaxreshard as jr
from jaxreshard.planning import lower
from jaxreshard.tools import bench


def main(name: str, rounds: int) -> None:
    devices = jax.devices()
    scenario = bench.SCENARIOS[name]
    assert scenario.tree is not None, f"{name} has no tree to move"
    tree = scenario.tree(bench.parse_args([]))
    src_sh, dst_sh = bench.shardings(tree, scenario.layouts(len(devices)), devices)
    src = bench.make_source(tree, src_sh)
    plans, outs = {}, {}
    for joined in (False, True):
        lower.JOIN_STEPS = joined
        plans[joined] = jr.plan(src, dst_sh, dtype=scenario.dtype)
        outs[joined] = plans[joined](src)
        s = plans[joined].stats
        print(
            f"{'joined' if joined else 'plain '}  steps {s.buckets}, rounds {s.rounds}, "
            f"host syncs {s.host_syncs}, dispatches {s.dispatches}, programs {s.programs}, "
            f"staging {s.staging_bytes / 2**20:.2f} MiB a device"
        )
    for key, x in src.items():
        want = np.asarray(jax.device_put(x.astype(outs[True][key].dtype), dst_sh[key]))
        for joined in (False, True):
            got = np.asarray(outs[joined][key])
            assert want.view(np.uint8).tobytes() == got.view(np.uint8).tobytes(), (joined, key)
    print("both bit for bit equal to jax.device_put")
    times: dict[bool, list[float]] = {False: [], True: []}
    for joined in (False, True, False, True):  # warm-up
        outs[joined] = plans[joined](src, donate=outs[joined])
    for i in range(rounds):
        for joined in (False, True) if i % 2 else (True, False):
            jax.block_until_ready(outs[joined])
            t0 = time.perf_counter()
            outs[joined] = plans[joined](src, donate=outs[joined])
            jax.block_until_ready(outs[joined])
            times[joined].append(time.perf_counter() - t0)
    plain, joined = (1e3 * np.median(times[k]) for k in (False, True))
    print(f"{name}: plain {plain:.1f} ms, joined {joined:.1f} ms a call ({joined / plain:.2f}x)")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "many_leaves", int(args[1]) if len(args) > 1 else 12)
