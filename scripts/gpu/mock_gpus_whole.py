"""Whole-shard steps on GPUs (one GPU, mock NCCL; writes $OUT/whole.json). Plans leaves of
one layout on both sides (tp4 on mock GPUs 0-3 -> tp4 on 4-7, and one source shard to two
replicas) with the H100 profile's latency margin and with every qualifying leaf whole
(`whole.LATENCY_MARGIN` 0), compiles the whole-shard steps' transfer programs and reads
their entry computations: the opcodes (collective-permutes and bitcasts only, no copy or
fusion: the bitcasts of floating shards to their bits must be free on GPU too) and the
schedule (`mock_hlo.read_schedule`). Compiled, not run: a real run needs 8 GPUs."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mock_hlo import read_schedule, use_mock_topology

import jaxreshard as jr
from jaxreshard.planning import whole

MOCK = use_mock_topology("1x8x1")  # (before anything asks JAX for devices)

devs = jax.devices()[:8]
first = Mesh(np.array(devs[:4]), ("tp",))
second = Mesh(np.array(devs[4:]), ("tp",))
pair = Mesh(np.array(devs[:2]), ("tp",))
replicas = Mesh(np.array(devs[4:]).reshape(2, 2), ("dp", "tp"))
leaves, dsts = {}, {}
for name, shape, dtype in (
    ("big_f32", (8192, 4096), jnp.float32),  # 32 MiB shards
    ("mid_bf16", (4096, 4096), jnp.bfloat16),  # 8 MiB shards
    ("small_f32", (1024, 1024), jnp.float32),  # 1 MiB shards
):
    leaves[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(first, P(None, "tp")))
    dsts[name] = NamedSharding(second, P(None, "tp"))
leaves["replicated"] = jax.ShapeDtypeStruct(
    (8192, 4096), jnp.float8_e4m3fn, sharding=NamedSharding(pair, P("tp"))
)
dsts["replicated"] = NamedSharding(replicas, P("tp"))
rec: dict = {"jax": jax.__version__, "devices": len(jax.devices())}
for label, margin in (("h100_margin", whole.LATENCY_MARGIN), ("every_leaf", 0.0)):
    saved, whole.LATENCY_MARGIN = whole.LATENCY_MARGIN, margin
    try:
        plan = jr.plan(leaves, dsts)
    finally:
        whole.LATENCY_MARGIN = saved
    moved = sorted({plan.leaves[i].path for s in plan.lowered.steps for i in s.whole})
    r: dict = {
        "whole": moved,
        "stats": {
            k: getattr(plan.stats, k)
            for k in ("programs", "rounds", "buckets", "staging_bytes", "bytes_sent", "bytes_wire")
        },
    }
    programs = []
    try:
        texts = plan.compiled_transfers()
        steps = [s for s in plan.lowered.steps if s.transfer is not None]
        order = list(dict.fromkeys(s.transfer for s in steps))
        for program, text in zip(order, texts, strict=True):
            if not any(s.whole and s.transfer == program for s in steps):
                continue
            entry = text[text.index("\nENTRY") :]
            ops = sorted(set(re.findall(r"=\s*[^=]*?\s([a-z][a-z0-9-]*)\(", entry)))
            programs.append({"rounds": len(program.slots), "ops": ops, **read_schedule(text)})
    except Exception as e:
        programs.append(f"error: {str(e).splitlines()[0][:200]}")
    r["whole_programs"] = programs
    rec[label] = r
    print(label, json.dumps(r, default=sorted), flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "whole.json"), "w") as f:
    json.dump(rec, f, indent=1, default=sorted)
