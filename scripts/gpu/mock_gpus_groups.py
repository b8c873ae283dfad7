"""Can a scheduling annotation keep two collective-permutes in flight on XLA GPU? (one GPU,
mock NCCL; writes $OUT/groups.json). The two-ppermute program of `mock_gpus_options.py`, its
two ppermutes marked with one `_scheduling_group_id` (`jax.experimental.xla_metadata`) or
wrapped in one `jax.experimental.scheduling_groups.scheduling_group`, with and without the
overlap limit of 2; reads the schedule as there."""

import json
import os
import re

os.environ.setdefault("MOCK", "1x8x1")
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.scheduling_groups import scheduling_group
from jax.experimental.xla_metadata import set_xla_metadata
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

if os.environ["MOCK"]:
    jax.config.update("jax_mock_gpu_topology", os.environ["MOCK"])

LIMIT = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}


def schedule(text: str) -> dict:
    out: dict = {"sync": 0, "async": 0, "most": 0, "queues": set(), "order": []}
    for comp in re.split(r"\n(?=\S)", text):
        live = 0
        for line in comp.splitlines():
            q = re.search(r'"operation_queue_id":"(\d+)"', line)
            if q and "collective-permute" in line:
                out["queues"].add(q.group(1))
            if re.search(r"collective-permute-start\(", line):
                live += 1
                out["async"] += 1
                out["most"] = max(out["most"], live)
                out["order"].append("start")
            elif re.search(r"collective-permute-done\(", line):
                live -= 1
                out["order"].append("done")
            elif re.search(r" collective-permute\(", line):
                out["sync"] += 1
                out["order"].append("sync")
    out["queues"] = sorted(out["queues"])
    return out


devs = jax.devices()[:8]
mesh = Mesh(np.array(devs), ("g",))
across = [(i, (i + 4) % 8) for i in range(8)]
inside = [(i, 4 * (i // 4) + (i + 1) % 4) for i in range(8)]


def plain(a, b):
    return lax.ppermute(a, "g", across), lax.ppermute(b, "g", inside)


def metadata(a, b):
    with set_xla_metadata(_scheduling_group_id="1"):
        return lax.ppermute(a, "g", across), lax.ppermute(b, "g", inside)


def grouped(a, b):
    return scheduling_group("lanes")(plain)(a, b)


aval = jax.ShapeDtypeStruct((8 << 22,), jnp.uint32, sharding=NamedSharding(mesh, P("g")))
rec: dict = {"jax": jax.__version__}
for name, body in (("plain", plain), ("metadata", metadata), ("scheduling_group", grouped)):
    for lim, opts in (("", {}), ("+limit2", LIMIT)):
        fn = jax.shard_map(body, mesh=mesh, in_specs=(P("g"), P("g")), out_specs=(P("g"), P("g")))
        try:
            text = jax.jit(fn, compiler_options=opts).lower(aval, aval).compile().as_text()
            r = schedule(text)
            if name == "metadata" and lim:
                with open(
                    os.path.join(os.environ.get("OUT", "/tmp"), "metadata.hlo.txt"), "w"
                ) as f:
                    f.write(text)
        except Exception as e:
            r = {"error": str(e).splitlines()[0][:300]}
        rec[name + lim] = r
        print(name + lim, json.dumps(r, default=str), flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "groups.json"), "w") as f:
    json.dump(rec, f, indent=1, default=str)
