"""Which XLA GPU options keep two collective-permutes in flight (one GPU, mock NCCL; writes
$OUT/options.json). Compiles, for each option set, (a) a plain shard_map program with two
independent ppermutes over 8 mock GPUs (one across two domains of four, one inside them) and
(b) the transfer programs of a jaxreshard plan with two lanes (`mock_gpus_schedule.py`'s), and
reads the schedule: collective-permutes left synchronous, async ones, the most in flight."""

import json
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mock_hlo import line_mesh, read_schedule, two_permutes, use_mock_topology

import jaxreshard as jr

MOCK = use_mock_topology("1x8x1")  # (before anything asks JAX for devices)

LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"
SETS = {
    "none": {},
    "limit2": {LIMIT: 2},
    "limit2_lhs": {LIMIT: 2, "xla_gpu_enable_latency_hiding_scheduler": True},
    "limit2_lhs_analytical": {
        LIMIT: 2,
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_enable_analytical_latency_estimator": True,
    },
    "limit2_pipelined_p2p": {LIMIT: 2, "xla_gpu_enable_pipelined_p2p": True},
    "limit2_decompose": {LIMIT: 2, "xla_gpu_collective_permute_decomposer_threshold": 0},
    "limit2_highest_priority": {LIMIT: 2, "xla_gpu_enable_highest_priority_async_stream": True},
    "limit2_memcpy_p2p": {LIMIT: 2, "xla_gpu_use_memcpy_local_p2p": True},
}


devs = jax.devices()[:8]
mesh, aval = line_mesh()
plain = jax.shard_map(
    two_permutes, mesh=mesh, in_specs=(P("g"), P("g")), out_specs=(P("g"), P("g"))
)
topo = jr.Topology.from_groups([devs[:4], devs[4:]])
src = NamedSharding(Mesh(np.array(devs[:4]), ("fsdp",)), P("fsdp"))
dst = NamedSharding(Mesh(np.array(devs).reshape(4, 2), ("dp", "tp")), P(None, "tp"))
leaves = {f"w{i}": jax.ShapeDtypeStruct((2048, 2048), np.float32, sharding=src) for i in range(8)}
rec: dict = {"jax": jax.__version__, "devices": len(jax.devices())}
for name, opts in SETS.items():
    r: dict = {}
    try:
        text = jax.jit(plain, compiler_options=opts).lower(aval, aval).compile().as_text()
        r["plain"] = read_schedule(text)
    except Exception as e:
        r["plain"] = f"error: {str(e).splitlines()[0][:200]}"
    try:
        plan = jr.plan(
            leaves,
            dict.fromkeys(leaves, dst),
            topology=topo,
            bucket_bytes=8 << 20,
            compiler_options=opts or None,
        )
        per = [read_schedule(t) for t in plan.compiled_transfers()]
        r["plan"] = {k: sum(p[k] for p in per) for k in ("sync", "async", "send_recv")} | {
            "most": max(p["most"] for p in per),
            "queues": sorted({q for p in per for q in p["queues"]}),
        }
    except Exception as e:
        r["plan"] = f"error: {str(e).splitlines()[0][:200]}"
    rec[name] = r
    print(name, json.dumps(r), flush=True)
    if name == "limit2_decompose" and isinstance(r["plain"], dict):
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "decomposed.hlo.txt"), "w") as f:
            f.write(text)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "options.json"), "w") as f:
    json.dump(rec, f, indent=1)
