"""jaxreshard on one GPU (writes $OUT/smoke.json): a local cast refit of a 4 GiB f32 tree to
bf16 (bit-exact against astype, under transfer_guard('disallow')); plan, first call and warm
call against a jitted astype."""

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr

rec = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}
dev = jax.devices()[0]
m = Mesh(np.array([dev]), ("x",))
s = NamedSharding(m, P())
L, D, F = int(os.environ.get("LAYERS", 16)), 2048, 8192
shapes = {
    "q": (D, D),
    "k": (D, D),
    "v": (D, D),
    "o": (D, D),
    "up": (D, F),
    "gate": (D, F),
    "down": (F, D),
    "norm": (D,),
}


def make(i):
    return {
        n: jax.jit(lambda k, sh=sh: jax.random.normal(k, sh, jnp.float32), out_shardings=s)(
            jax.random.key(i * 16 + j)
        )
        for j, (n, sh) in enumerate(shapes.items())
    }


src = {f"layer{i:02d}": make(i) for i in range(L)}
jax.block_until_ready(src)
nbytes = sum(x.nbytes for x in jax.tree.leaves(src))
rec["src_bytes"] = nbytes
dst = jax.tree.map(lambda _: s, src)
t = time.perf_counter()
plan = jr.plan(src, dst, dtype=jnp.bfloat16)
rec["plan_s"] = time.perf_counter() - t
t = time.perf_counter()
out = jax.block_until_ready(plan(src))
rec["first_call_s"] = time.perf_counter() - t
cast = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t))
ref = jax.block_until_ready(cast(src))


def med(fn, reps=20):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


box = [out]


def step():
    box[0] = plan(src, donate=box[0])
    return box[0]


def dispatch(fn, reps=20):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        r = fn()
        ts.append(time.perf_counter() - t)
        jax.block_until_ready(r)
    return statistics.median(ts)


with jax.transfer_guard("disallow"):
    rec["jr_warm_s"] = med(step)
    rec["astype_warm_s"] = med(lambda: cast(src))
    rec["jr_dispatch_s"] = dispatch(step)
    rec["astype_dispatch_s"] = dispatch(lambda: cast(src))
    rec["jr_warm_again_s"] = med(step)
    rec["astype_warm_again_s"] = med(lambda: cast(src))


def bits(x):
    return lax.bitcast_convert_type(x, jnp.uint16)


rec["bit_exact"] = all(
    bool(jnp.array_equal(bits(a), bits(b)))
    for a, b in zip(jax.tree.leaves(box[0]), jax.tree.leaves(ref), strict=False)
)
rec["jr_GBps"] = (nbytes * 1.5) / rec["jr_warm_s"] / 1e9
rec["astype_GBps"] = (nbytes * 1.5) / rec["astype_warm_s"] / 1e9
rec["describe"] = plan.describe()
print(json.dumps(rec, indent=1))
json.dump(rec, open(os.path.join(os.environ.get("OUT", "/tmp"), "smoke.json"), "w"), indent=1)
