"""A/B probe: pack (and unpack) programs compiled with XLA CPU's older fusion emitters, as
the executor compiles them (`runtime.CPU_COPY_OPTIONS`), against the newer ones, in one
process: each plan checked bit for bit against `jax.device_put`, then timed in interleaved
rounds (medians of whole donated calls), with each plan's first call (compiles included).

    python scripts/probes/emitters.py many_leaves            # packs on the newer emitters
    python scripts/probes/emitters.py lora,disjoint 20 all   # packs and unpacks, 20 rounds
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
from _scenario import case, check_bits, interleaved

import jaxreshard as jr
from jaxreshard.run import runtime

BUILT = runtime.program_options, runtime._pack_casts


def newer(on: bool, which: str) -> None:
    """Programs built from now on compile with the newer emitters (``which``: "packs" or
    "all"), or as the executor builds them."""
    options, pack_casts = BUILT
    runtime.program_options = (lambda platform, casts: None) if on and which == "all" else options
    runtime._pack_casts = (lambda program: True) if on else pack_casts


def main(name: str, rounds: int, which: str) -> None:
    src, dst_sh, dtype = case(name)
    plans, outs, first = {}, {}, {}
    for on in (False, True):
        newer(on, which)  # programs are built (and their options read) at the first call
        start = time.perf_counter()
        plans[on] = jr.plan(src, dst_sh, dtype=dtype)
        outs[on] = jax.block_until_ready(plans[on](src))
        first[on] = time.perf_counter() - start
    newer(False, which)
    check_bits(src, dst_sh, outs)
    built, new = interleaved(plans, outs, src, rounds)
    print(
        f"{name}: as built {built:.1f} ms, {which} on the newer emitters {new:.1f} ms a call "
        f"({new / built:.2f}x); first call {first[False]:.2f} s against {first[True]:.2f} s",
        flush=True,
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    for name in (args[0] if args else "many_leaves").split(","):
        main(name, int(args[1]) if len(args) > 1 else 12, args[2] if len(args) > 2 else "packs")
