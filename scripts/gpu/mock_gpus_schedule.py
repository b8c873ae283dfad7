"""What XLA GPU makes of a two-lane plan's transfer programs, on one GPU (writes
$OUT/schedule.json). JAX's mock GPU client (``jax_mock_gpu_topology``, mock NCCL) makes one GPU
look like several, so programs over 8 GPUs compile there though none can run. A plan over two
domains of four (a `Topology` by hand) whose buckets hold rounds across the domains beside rounds
inside them: this reads the compiled schedule of its transfer programs (the order of the entry
computation) and counts how many collective-permutes are in flight at once, with no option and
with ``xla_gpu_experimental_parallel_collective_overlap_limit`` at 1 (XLA's default) and 4.
Also: the time to compile them.

Usage: ``MOCK=1x8x1 python scripts/gpu/mock_gpus_schedule.py`` (slices x hosts x GPUs per host);
``MOCK=`` (empty) runs on whatever devices there are (8 CPU devices with XLA_FLAGS set)."""

import json
import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mock_hlo import read_schedule, use_mock_topology

import jaxreshard as jr

MOCK = use_mock_topology("1x8x1")  # (before anything asks JAX for devices)

rec: dict = {"jax": jax.__version__, "mock": MOCK}


def in_flight(text: str) -> dict:
    """The most collective-permutes in flight at once, the async starts and the sync ones."""
    r = read_schedule(text)
    return {"most_in_flight": r["most"], "starts": r["async"], "sync_permutes": r["sync"]}


try:
    devs = jax.devices()
    rec["devices"] = [str(d) for d in devs]
    rec["process_count"] = jax.process_count()
    rec["local_devices"] = len(jax.local_devices())
    if len(devs) < 8:
        raise SystemExit(f"needs 8 devices, got {len(devs)}")
    devs = devs[:8]
    topo = jr.Topology.from_groups([devs[:4], devs[4:]])
    # Trainer: the first domain, fsdp over 4; sampler: both domains, tp2 x dp4 with the data
    # axis across the domains, so each byte goes to one GPU of each domain: the second domain's
    # first GPU imports it across and the fan-out forwards it inside.
    src = NamedSharding(Mesh(np.array(devs[:4]), ("fsdp",)), P("fsdp"))
    dst = NamedSharding(Mesh(np.array(devs).reshape(4, 2), ("dp", "tp")), P(None, "tp"))
    leaves = {
        f"w{i}": jax.ShapeDtypeStruct((2048, 2048), np.float32, sharding=src) for i in range(8)
    }
    shardings = dict.fromkeys(leaves, dst)
    for name, options in (("default", None), ("limit_1", 1), ("limit_4", 4)):
        opts = (
            None
            if options is None
            else {"xla_gpu_experimental_parallel_collective_overlap_limit": options}
        )
        try:
            plan = jr.plan(
                leaves, shardings, topology=topo, bucket_bytes=8 << 20, compiler_options=opts
            )
            t0 = time.perf_counter()
            texts = plan.compiled_transfers()
            seconds = time.perf_counter() - t0
            counts = [in_flight(t) for t in texts]
            rec[name] = {
                "options": plan.runtime.transfer_options,
                "stats": {
                    k: getattr(plan.stats, k)
                    for k in ("rounds", "buckets", "bytes_cross_domain", "bytes_relayed")
                },
                "programs": len(texts),
                "compile_s": seconds,
                "most_in_flight": max(c["most_in_flight"] for c in counts),
                "per_program": counts,
            }
            if name == "default":
                os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
                with open(
                    os.path.join(os.environ.get("OUT", "/tmp"), "transfer0.hlo.txt"), "w"
                ) as f:
                    f.write(texts[0])
        except Exception as e:  # report and go on
            rec[name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        print(name, json.dumps(rec[name], default=str)[:1500], flush=True)
except BaseException as e:
    rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    print(rec["error"], file=sys.stderr)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "schedule.json"), "w") as f:
    json.dump(rec, f, indent=1, default=str)
