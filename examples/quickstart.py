"""Quickstart: reshard a small parameter tree between two submeshes of 8 CPU devices.

    python examples/quickstart.py

The trainer holds the weights FSDP x TP (fsdp2 x tp2) on devices 0-3; the sampler wants them
TP-sharded (tp4) in bfloat16 on devices 4-7. jaxreshard plans the move once, then every refit
is one call that writes into the previous sampler weights' buffers.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Simulate 8 devices on the CPU unless the caller configured XLA already.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr


def main() -> None:
    devices = jax.devices()
    if len(devices) < 8:
        raise SystemExit(f"this example needs 8 devices, found {len(devices)}")
    trainer = Mesh(np.array(devices[:4]).reshape(2, 2), ("fsdp", "tp"))
    sampler = Mesh(np.array(devices[4:8]), ("tp",))

    def on(mesh, *spec):
        return NamedSharding(mesh, P(*spec))

    key = jax.random.key(0)
    d_model, d_ff, vocab = 256, 1024, 1024
    shapes = {
        "embed": ((vocab, d_model), on(trainer, "tp", "fsdp"), on(sampler, "tp", None)),
        "attn_qkv": ((d_model, 3 * d_model), on(trainer, "fsdp", "tp"), on(sampler, None, "tp")),
        "attn_out": ((d_model, d_model), on(trainer, "tp", "fsdp"), on(sampler, "tp", None)),
        "mlp_in": ((d_model, d_ff), on(trainer, "fsdp", "tp"), on(sampler, None, "tp")),
        "mlp_out": ((d_ff, d_model), on(trainer, "tp", "fsdp"), on(sampler, "tp", None)),
        "norm": ((d_model,), on(trainer), on(sampler)),
    }
    params, sampler_layout = {}, {}
    for i, (name, (shape, train_sharding, sample_sharding)) in enumerate(shapes.items()):
        value = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
        params[name] = jax.device_put(value, train_sharding)
        sampler_layout[name] = sample_sharding

    plan = jr.plan(params, sampler_layout, dtype=jnp.bfloat16)
    print(plan.describe())

    sampler_params = plan(params)  # first call compiles
    for _ in range(3):  # a refit loop: new weights, written into the old sampler buffers
        params = jax.tree.map(lambda p: p * 0.5, params)
        sampler_params = plan(params, donate=sampler_params)
    jax.block_until_ready(sampler_params)

    for name, value in sampler_params.items():
        expected = np.asarray(params[name]).astype(jnp.bfloat16)
        assert value.sharding == sampler_layout[name]
        np.testing.assert_array_equal(np.asarray(value), expected)
    print(
        f"\nrefit checked against NumPy: {len(sampler_params)} leaves on {sampler.devices.size} "
        "sampler devices, bfloat16, bit-exact"
    )


if __name__ == "__main__":
    main()
