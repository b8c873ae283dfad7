"""A/B probe: a bench scenario planned with joined steps (`lower.JOIN_STEPS`) and without,
in one process, checked bit for bit against `jax.device_put`, then timed in interleaved
rounds (medians of whole calls into donated destinations).

    python scripts/probes/joined_steps.py many_leaves      # any bench scenario name
    python scripts/probes/joined_steps.py lora 20          # 20 rounds
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from _scenario import case, check_bits, interleaved

import jaxreshard as jr
from jaxreshard.planning import lower


def main(name: str, rounds: int) -> None:
    src, dst_sh, dtype = case(name)
    plans, outs = {}, {}
    for joined in (False, True):
        lower.JOIN_STEPS = joined
        plans[joined] = jr.plan(src, dst_sh, dtype=dtype)
        outs[joined] = plans[joined](src)
        s = plans[joined].stats
        print(
            f"{'joined' if joined else 'plain '}  steps {s.buckets}, rounds {s.rounds}, "
            f"host syncs {s.host_syncs}, dispatches {s.dispatches}, programs {s.programs}, "
            f"staging {s.staging_bytes / 2**20:.2f} MiB a device"
        )
    check_bits(src, dst_sh, outs)
    print("both bit for bit equal to jax.device_put")
    plain, joined = interleaved(plans, outs, src, rounds)
    print(f"{name}: plain {plain:.1f} ms, joined {joined:.1f} ms a call ({joined / plain:.2f}x)")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "many_leaves", int(args[1]) if len(args) > 1 else 12)
