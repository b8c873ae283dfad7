"""Where a GPU's conversions differ (one GPU; writes $OUT/casts.json). An e5m2 fp8 refit's
values against the NumPy reference (which differ, and what the GPU's own astype gives there);
then cast refits f32 -> bf16 / f16 / e4m3fn / e5m2 of special values, jaxreshard on the GPU
against astype on the GPU, astype on the CPU and ml_dtypes."""

import json
import os
import sys

sys.path.insert(0, "tests")
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_fp8 import reference

import jaxreshard as jr

gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
sh = {k: NamedSharding(Mesh(np.array([d]), ("x",)), P()) for k, d in (("gpu", gpu), ("cpu", cpu))}
rec = {}
rng = np.random.default_rng(0)
x = (rng.standard_normal((512, 1024)) * np.exp(rng.uniform(-20, 8, (512, 1)))).astype(np.float32)
x[3, 5] = np.nan
x[200:328, 256:384] = 0
x[400, 7] = np.float32(1e-40)
fmt = jnp.float8_e5m2
src = {"w": jax.device_put(x, sh["gpu"])}
q = jr.plan(src, {"w": sh["gpu"]}, dtype=jr.Fp8Blockwise(block=(128, 128), fmt=fmt))(src)["w"]
gv = np.asarray(q.values).view(np.uint8)
rv, rs = reference(x, (128, 128), fmt)
rv = np.asarray(rv).view(np.uint8)
sc = np.repeat(np.repeat(np.asarray(rs, np.float32), 128, 0), 128, 1)
y = np.clip(x * (np.float32(1) / sc).astype(np.float32), -57344, 57344).astype(np.float32)
ya = jax.device_put(y, sh["gpu"])
g_ast = np.asarray(jax.jit(lambda a: a.astype(fmt))(ya)).view(np.uint8)
diffs = []
for i, j in np.argwhere(gv != rv)[:10]:
    diffs.append(
        {
            "at": [int(i), int(j)],
            "x_bits": hex(x.view(np.uint32)[i, j]),
            "y": repr(y[i, j]),
            "y_bits": hex(y.view(np.uint32)[i, j]),
            "jr_gpu": hex(gv[i, j]),
            "numpy": hex(rv[i, j]),
            "astype_gpu": hex(g_ast[i, j]),
        }
    )
rec["e5m2_diffs"] = diffs
rec["astype_gpu_vs_numpy_all"] = int(
    (g_ast != y.astype(ml_dtypes.float8_e5m2).view(np.uint8)).sum()
)

# special values
f = np.float32
sp = np.array(
    [
        0.0,
        -0.0,
        1.0,
        -1.0,
        np.inf,
        -np.inf,
        65504,
        65520,
        57344,
        57345,
        61440,
        448,
        464,
        480,
        1e-40,
        -1e-40,
        1.2e-38,
        5.96e-8,
        2.98e-8,
        1.5e-5,
        7.6e-6,
        1e-9,
        3.4e38,
    ],
    np.float32,
)
nans = np.array(
    [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FC12345, 0x7FA00000, 0xFFFFFFFF], np.uint32
).view(np.float32)
ties = (rng.integers(0, 2**23, 4096, dtype=np.uint32) | 0x3F800000).view(np.float32)  # [1,2)
wide = rng.standard_normal(65536).astype(np.float32) * f(1000)
vals = np.concatenate([sp, -sp, nans, ties, wide, wide * f(1e-6)]).astype(np.float32)
vals = np.resize(vals, (len(vals) // 64 + 1) * 64).reshape(-1, 64)
out = {}
for dt in (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2):
    name = np.dtype(dt).name
    width = np.dtype(dt).itemsize
    u = {1: np.uint8, 2: np.uint16}[width]
    a = {"v": jax.device_put(vals, sh["gpu"])}
    r = {}
    r["jr_gpu"] = np.asarray(jr.plan(a, {"v": sh["gpu"]}, dtype=dt)(a)["v"]).view(u)
    r["astype_gpu"] = np.asarray(jax.jit(lambda t, dt=dt: t.astype(dt))(a["v"])).view(u)
    c = jax.device_put(vals, sh["cpu"])
    r["astype_cpu"] = np.asarray(jax.jit(lambda t, dt=dt: t.astype(dt))(c)).view(u)
    r["numpy"] = vals.astype(dt).view(u)
    pairs = {}
    for p, q2 in (
        ("jr_gpu", "astype_gpu"),
        ("astype_gpu", "astype_cpu"),
        ("astype_gpu", "numpy"),
        ("astype_cpu", "numpy"),
    ):
        bad = np.argwhere(r[p] != r[q2])
        pairs[f"{p}!={q2}"] = {
            "n": len(bad),
            "examples": [
                {
                    "in": hex(vals.view(np.uint32)[tuple(b)]),
                    p: hex(r[p][tuple(b)]),
                    q2: hex(r[q2][tuple(b)]),
                }
                for b in bad[:4]
            ],
        }
    out[name] = pairs
rec["casts"] = out
print(json.dumps(rec, indent=1))
json.dump(rec, open(os.path.join(os.environ.get("OUT", "/tmp"), "casts.json"), "w"), indent=1)
