"""Would one `ragged_all_to_all` run a bucket's rounds at once on GPUs? (one GPU, mock NCCL;
writes $OUT/ragged.json).

A transfer program runs a bucket as rounds of `ppermute` (one message in and one out per
device a round), and XLA GPU runs a program's collective-permutes one after another (README,
"XLA GPU runs a transfer program's collective-permutes one after another"): a GPU's NVLink and
its NIC never carry its traffic at once, and every round pays its own latency. XLA's
``ragged-all-to-all`` (`jax.lax.ragged_all_to_all`) moves slices of any sizes from every device
to any others in one collective, into an output buffer it is given, leaving what nothing is
sent to untouched: a whole bucket, every pair at once, in one op. On GPU XLA lowers it to one
group of NCCL sends and receives (or its one-shot kernel on one host), so a device's messages
over both links could be in flight together.

It is not usable on CPU: XLA CPU refuses it ("HLO opcode `ragged-all-to-all` is not supported
by XLA:CPU ThunkEmitter", jax 0.10.2), so the executor cannot run it where the suite runs and
it is not built. This compiles, for 8 mock GPUs (two domains of four):

- ``rounds``: a bucket as today: 4 rounds of 16 MiB a device (two across the domains, two
  inside them), one `ppermute` each;
- ``ragged``: the same bytes as one `ragged_all_to_all` of a 64 MiB operand into a donated
  64 MiB output a device (its offsets and sizes are operands: in a transfer they would say
  which slice goes to which peer; only the op's schedule is read here);

and reads each schedule: collective-permutes (`mock_hlo.read_schedule`) and ragged-all-to-alls,
sync or async. One ``ragged`` op where ``rounds`` has four synchronous permutes is what a
timed run between real GPUs would then compare (the mock topology compiles, it does not run).
On CPU (``MOCK=`` empty, 8 host devices) ``rounds`` compiles and ``ragged`` records XLA CPU's
refusal: the script runs there too, as a check of itself.
"""

import json
import os
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mock_hlo import line_mesh, read_schedule, use_mock_topology

MOCK = use_mock_topology("1x8x1")  # (before anything asks JAX for devices)

WORDS = 4 << 20  # 16 MiB of uint32 a message
ROUNDS = [  # round k: device i sends to ROUNDS[k][i]
    [(i + 4) % 8 for i in range(8)],  # across the domains
    [4 * (1 - i // 4) + (i + 1) % 4 for i in range(8)],  # across, shifted
    [4 * (i // 4) + (i + 1) % 4 for i in range(8)],  # inside
    [4 * (i // 4) + (i + 2) % 4 for i in range(8)],  # inside, shifted
]


def rounds(*xs: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(
        lax.ppermute(x, "g", [(i, to[i]) for i in range(8)])
        for x, to in zip(xs, ROUNDS, strict=True)
    )


def ragged(x: jax.Array, out: jax.Array, *tab: jax.Array) -> jax.Array:
    return lax.ragged_all_to_all(x, out, *tab, axis_name="g")


def read_ragged(text: str) -> dict:
    return {
        "sync": len(re.findall(r" ragged-all-to-all\(", text)),
        "async": len(re.findall(r"ragged-all-to-all-start\(|async-start.*ragged-all-to-all", text)),
    }


def main() -> None:
    rec: dict = {"jax": jax.__version__, "devices": len(jax.devices()), "mock": MOCK}
    mesh, _ = line_mesh()
    spec = P("g")
    sharded = NamedSharding(mesh, spec)
    one = jax.ShapeDtypeStruct((8 * WORDS,), jnp.uint32, sharding=sharded)
    fn = jax.shard_map(rounds, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4)
    rec["rounds"] = read_schedule(jax.jit(fn).lower(*[one] * 4).compile().as_text())
    bucket = jax.ShapeDtypeStruct((8 * 4 * WORDS,), jnp.uint32, sharding=sharded)
    tab = jax.ShapeDtypeStruct((8 * 8,), jnp.int32, sharding=sharded)
    try:
        fn = jax.shard_map(ragged, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec, check_vma=False)
        text = jax.jit(fn, donate_argnums=1).lower(bucket, bucket, *[tab] * 4).compile().as_text()
        rec["ragged"] = {**read_ragged(text), "permutes": read_schedule(text)}
    except Exception as e:
        rec["ragged"] = f"error: {str(e).splitlines()[0][:200]}"
    print(json.dumps(rec), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "ragged.json"), "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
