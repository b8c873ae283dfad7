"""What units of many buckets cost a first call on GPUs (writes $OUT/units.json): the transfer
programs of one plan with units of up to 32 and up to 128 buckets (`GPU_UNIT_BUCKETS`), compiled
for 128 GPUs through JAX's mock GPU client (``jax_mock_gpu_topology``; nothing runs), their count
and compile time. The cluster model prices the rounds each saves (README, "Units of many
buckets") but not the compile time, which no GPU has measured.

The tree: three stacked expert-like leaves whose every destination shard takes a piece from
every source (layers and experts over half the GPUs -> a TP split over the other half), 512 MiB
a destination GPU a leaf in 4 MiB buckets, so that a unit's streams are short and its rounds
many, as on a large cluster (on 8 GPUs every bucket is one round and the programs are the same
either way).

Usage: ``MOCK=1x16x8 python scripts/gpu/mock_gpus_units.py`` (slices x hosts x GPUs per host,
128 GPUs); ``MOCK=`` (empty) runs on the devices there are (8 CPU devices with XLA_FLAGS set),
with the accelerators' planning options forced, a smoke test."""

import json
import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mock_hlo import use_mock_topology

import jaxreshard as jr
from jaxreshard import api
from jaxreshard.planning import schedule

MOCK = use_mock_topology("1x16x8")  # (before anything asks JAX for devices)

rec: dict = {"jax": jax.__version__, "mock": MOCK}
# The accelerators' options wherever this runs (on CPU devices too, for the smoke test).
api.platform_options = lambda _, *args: schedule.platform_options("gpu", *args)
try:
    devs = jax.devices()
    n = len(devs) // 8 * 8
    rec["devices"] = n
    if n < 8:
        raise SystemExit(f"needs 8 devices, got {len(devs)}")
    src_mesh = Mesh(np.array(devs[: n // 2]).reshape(2, n // 4), ("pp", "ep"))
    dst_mesh = Mesh(np.array(devs[n // 2 : n]), ("tp",))
    src = NamedSharding(src_mesh, P("pp", "ep"))  # (layers, experts, hidden, inter)
    dst = NamedSharding(dst_mesh, P(None, None, None, "tp"))
    leaves = {
        name: jax.ShapeDtypeStruct((16, 64, 128 * n, 512), np.float32, sharding=src)
        for name in ("gate", "up", "down")
    }
    shardings = dict.fromkeys(leaves, dst)
    for buckets in (32, 128):
        schedule.GPU_UNIT_BUCKETS = buckets
        try:
            plan = jr.plan(leaves, shardings, bucket_bytes=4 << 20)
            t0 = time.perf_counter()
            texts = plan.compiled_transfers()
            rec[f"units_of_{buckets}"] = {
                "compile_s": time.perf_counter() - t0,
                "programs": len(texts),
                "units": len(plan.schedule.units),
                "rounds": plan.stats.rounds,
                "buckets": plan.stats.buckets,
            }
        except Exception as e:  # report and go on
            rec[f"units_of_{buckets}"] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        print(buckets, json.dumps(rec[f"units_of_{buckets}"], default=str), flush=True)
except BaseException as e:
    rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    print(rec["error"], file=sys.stderr)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "units.json"), "w") as f:
    json.dump(rec, f, indent=1, default=str)
