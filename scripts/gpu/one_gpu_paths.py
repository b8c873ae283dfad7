"""jaxreshard's one-device paths on one GPU (writes $OUT/paths.json).

1. XLA GPU and the lane option: does this XLA know
   xla_gpu_experimental_parallel_collective_overlap_limit (a bogus option must be refused, so
   acceptance means something), and are collective-permutes async in the compiled program?
2. Host memory kinds on a GPU (pinned_host / unpinned_host source -> device, device -> host
   destination), bit for bit, and under transfer_guard('disallow').
3. Fp8Blockwise on the GPU against the NumPy reference (tests/test_fp8.reference) and the
   same plan on the CPU device, bit for bit.
4. Typed PRNG keys on the GPU, and donating a key array over the source key's own buffers
   (refused, not a crash).
"""

import json
import os
import sys
import time
import traceback

sys.path.insert(0, "tests")
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr

rec = {
    "jax": jax.__version__,
    "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
}
dev = jax.devices()[0]
rec["device"] = str(dev.device_kind)
mesh = Mesh(np.array([dev]), ("x",))
dsh = NamedSharding(mesh, P())


def section(name):
    def deco(fn):
        t = time.perf_counter()
        try:
            rec[name] = fn()
        except Exception as e:
            rec[name] = {
                "error": f"{type(e).__name__}: {e}"[:2000],
                "trace": traceback.format_exc()[-2000:],
            }
        rec[name + "_s"] = time.perf_counter() - t
        print(name, json.dumps(rec[name], default=str)[:3000], flush=True)

    return deco


@section("lane_option")
def _():
    out = {}
    x = jax.ShapeDtypeStruct((1 << 20,), jnp.float32, sharding=dsh)
    f = jax.shard_map(
        lambda a: lax.ppermute(a, "x", [(0, 0)]) + 1, mesh=mesh, in_specs=P("x"), out_specs=P("x")
    )
    for name, opts in [
        ("lane", {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}),
        ("none", {}),
        ("bogus", {"xla_gpu_no_such_option_jaxreshard": 2}),
        ("limit_as_str", {"xla_gpu_experimental_parallel_collective_overlap_limit": "2"}),
    ]:
        try:
            c = jax.jit(f, compiler_options=opts).lower(x).compile()
            txt = c.as_text()
            out[name] = {
                "compiled": True,
                "cp_start": txt.count("collective-permute-start"),
                "cp": txt.count("collective-permute"),
            }
        except Exception as e:
            out[name] = {"compiled": False, "error": str(e).splitlines()[0][:300]}
    return out


@section("memory_kinds")
def _():
    out = {}
    host = np.arange(3 * 1024 * 1024, dtype=np.float32).reshape(1024, 3072)
    host[0, 0] = np.float32(np.nan)
    for kind in ("pinned_host", "unpinned_host"):
        try:
            hs = NamedSharding(mesh, P(), memory_kind=kind)
            src = {"w": jax.device_put(host, hs), "b": jax.device_put(host[:, :7].copy(), hs)}
            plan = jr.plan(src, {"w": dsh, "b": dsh})
            with jax.transfer_guard("disallow"):
                r = plan(src)
                jax.block_until_ready(r)
                r = plan(src, donate=r)
                jax.block_until_ready(r)
            to_dev = all(
                np.array_equal(np.asarray(r[k]).view(np.uint32), np.asarray(src[k]).view(np.uint32))
                for k in r
            )
            back = jr.plan(r, {"w": hs, "b": hs})
            with jax.transfer_guard("disallow"):
                h = back(r)
                jax.block_until_ready(h)
            to_host = all(
                np.array_equal(np.asarray(h[k]).view(np.uint32), np.asarray(src[k]).view(np.uint32))
                for k in h
            )
            out[kind] = {
                "to_device_exact": to_dev,
                "to_host_exact": to_host,
                "result_kind": r["w"].sharding.memory_kind,
                "back_kind": h["w"].sharding.memory_kind,
            }
        except Exception as e:
            out[kind] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    return out


@section("fp8")
def _():
    from test_fp8 import reference

    out = {}
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((512, 1024)) * np.exp(rng.uniform(-20, 8, (512, 1)))).astype(
        np.float32
    )
    x[3, 5] = np.nan
    x[200:328, 256:384] = 0
    x[400, 7] = np.float32(1e-40)
    for fmt in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        res = {}
        for where, d in (("gpu", dev), ("cpu", jax.devices("cpu")[0])):
            m = Mesh(np.array([d]), ("x",))
            s = NamedSharding(m, P())
            src = {"w": jax.device_put(x, s)}
            q = jr.plan(src, {"w": s}, dtype=jr.Fp8Blockwise(block=(128, 128), fmt=fmt))(src)["w"]
            res[where] = (np.asarray(q.values).view(np.uint8), np.asarray(q.scales).view(np.uint32))
        rv, rs = reference(x, (128, 128), fmt)
        rv = np.asarray(rv).view(np.uint8)
        rs = np.asarray(rs, np.float32).view(np.uint32)
        out[str(np.dtype(fmt))] = {
            "gpu_vs_cpu_values": bool(np.array_equal(res["gpu"][0], res["cpu"][0])),
            "gpu_vs_cpu_scales": bool(np.array_equal(res["gpu"][1], res["cpu"][1])),
            "gpu_vs_numpy_values": bool(np.array_equal(res["gpu"][0], rv)),
            "gpu_vs_numpy_scales": bool(np.array_equal(res["gpu"][1], rs)),
            "values_differing": int((res["gpu"][0] != rv).sum()),
        }
    return out


@section("keys")
def _():
    k = jax.device_put(jax.random.split(jax.random.key(0), 64), dsh)
    src = {"k": k, "w": jax.device_put(np.ones((64, 64), np.float32), dsh)}
    plan = jr.plan(src, {"k": dsh, "w": dsh})
    with jax.transfer_guard("disallow"):
        r = plan(src)
    same = bool(
        np.array_equal(np.asarray(jax.random.key_data(r["k"])), np.asarray(jax.random.key_data(k)))
    )
    try:
        plan(
            src, donate={"k": jax.random.wrap_key_data(jax.random.key_data(src["k"])), "w": r["w"]}
        )
        donated = "accepted"
    except jr.ReshardError as e:
        donated = "refused: " + str(e).splitlines()[0][:200]
    return {"keys_exact": same, "donate_alias": donated, "source_alive": not src["k"].is_deleted()}


json.dump(
    rec, open(os.path.join(os.environ.get("OUT", "/tmp"), "paths.json"), "w"), indent=1, default=str
)
