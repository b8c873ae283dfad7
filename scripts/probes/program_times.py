"""Profile probe: every pack, transfer and unpack program of a bench scenario's donated call,
each awaited and timed (its dispatch, and until its outputs are ready), summed per call.

Awaiting each program serialises what a plain call overlaps, so the sums show what each
stage costs, not how long a call takes (printed first, untouched).

    python scripts/probes/program_times.py many_leaves
"""

from __future__ import annotations

import collections
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from _scenario import case

import jaxreshard as jr


def main(name: str, calls: int) -> None:
    src, dst_sh, dtype = case(name)
    plan = jr.plan(src, dst_sh, dtype=dtype)
    out = plan(src)
    for _ in range(3):
        out = plan(src, donate=out)
    jax.block_until_ready(out)
    plain = []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = jax.block_until_ready(plan(src, donate=out))
        plain.append(time.perf_counter() - t0)
    print(f"{name}: a plain donated call {1e3 * np.median(plain):.1f} ms (median of {calls})")
    times: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)

    def timed(fn, stage):
        def run(*args):
            t0 = time.perf_counter()
            result = fn(*args)
            t1 = time.perf_counter()
            jax.block_until_ready(result)
            times[stage].append((t1 - t0, time.perf_counter() - t0))
            return result

        return run

    for step in plan._runtime._steps:  # (private: a probe, not an API)
        for call in step.packs:
            call.fn = timed(call.fn, "pack")
        for call in step.unpacks:
            call.fn = timed(call.fn, "unpack")
        if step.transfer is not None:
            step.transfer.fn = timed(step.transfer.fn, "transfer")
    for _ in range(calls):
        out = jax.block_until_ready(plan(src, donate=out))
    for stage in ("pack", "transfer", "unpack"):
        t = 1e3 * np.array(times[stage]).reshape(-1, 2)
        dispatch, done = np.median(t, axis=0)
        print(
            f"  {stage:8s} {len(t) // calls:3d} programs a call: dispatch {dispatch:.3f} ms, "
            f"done {done:.3f} ms each (medians), {t[:, 1].sum() / calls:.1f} ms a call"
        )


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "many_leaves", int(args[1]) if len(args) > 1 else 5)
