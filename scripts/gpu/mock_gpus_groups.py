"""Can a scheduling annotation keep two collective-permutes in flight on XLA GPU? (one GPU,
mock NCCL; writes $OUT/groups.json). The two-ppermute program of `mock_gpus_options.py`, its
two ppermutes marked with one `_scheduling_group_id` (`jax.experimental.xla_metadata`) or
wrapped in one `jax.experimental.scheduling_groups.scheduling_group`, with and without the
overlap limit of 2; reads the schedule as there."""

import json
import os

import jax
from jax.experimental.scheduling_groups import scheduling_group
from jax.experimental.xla_metadata import set_xla_metadata
from jax.sharding import PartitionSpec as P
from mock_hlo import line_mesh, read_schedule, two_permutes, use_mock_topology

MOCK = use_mock_topology("1x8x1")  # (before anything asks JAX for devices)

LIMIT = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}


def plain(a, b):
    return two_permutes(a, b)


def metadata(a, b):
    with set_xla_metadata(_scheduling_group_id="1"):
        return two_permutes(a, b)


def grouped(a, b):
    return scheduling_group("lanes")(plain)(a, b)


mesh, aval = line_mesh()
rec: dict = {"jax": jax.__version__}
for name, body in (("plain", plain), ("metadata", metadata), ("scheduling_group", grouped)):
    for lim, opts in (("", {}), ("+limit2", LIMIT)):
        fn = jax.shard_map(body, mesh=mesh, in_specs=(P("g"), P("g")), out_specs=(P("g"), P("g")))
        try:
            text = jax.jit(fn, compiler_options=opts).lower(aval, aval).compile().as_text()
            r = read_schedule(text)
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
