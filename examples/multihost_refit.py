"""Multi-host refit: trainer processes send new weights to sampler processes with jaxreshard.

The same script is one process of an N-process ``jax.distributed`` job:

    # on each host of a cluster (GPU: NCCL; no extra flags)
    python examples/multihost_refit.py --coordinator HOST0:1234 --num-processes 4 --process-id I
    # or let JAX find them: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a
    # cluster JAX detects by itself (SLURM, Open MPI, ...)
    python examples/multihost_refit.py

    # a local demo: launches 4 CPU processes with 2 devices each (gloo collectives)
    python examples/multihost_refit.py --local 4 --devices 2
    # one process (its devices split in two halves)
    python examples/multihost_refit.py --num-processes 1

The first half of the processes train (mesh fsdp x tp over their devices), the second half sample
(mesh dp x tp, the weights replicated over dp and split over tp). With a single process its
devices are split in two halves instead. Every step the trainer updates the weights and every
process calls the same plan: the trainer processes pass their arrays, the sampler processes
``jax.ShapeDtypeStruct`` placeholders for arrays they hold no shard of, and the sampler receives
bf16 weights into the buffers of the previous step's (``donate=``). Each sampler process checks
its own shards against the values the trainer must have produced.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import subprocess
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"))
    p.add_argument("--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"))
    p.add_argument("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"))
    p.add_argument("--local", type=int, metavar="N", help="launch N local CPU processes")
    p.add_argument("--devices", type=int, default=4, help="CPU devices per local process")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--width", type=int, default=1024, help="hidden size of the toy model")
    args = p.parse_args()
    for flag, value, least in (
        ("--local", args.local, 1),
        ("--num-processes", args.num_processes, 1),
        ("--process-id", args.process_id, 0),
        ("--devices", args.devices, 1),
        ("--steps", args.steps, 0),
        ("--width", args.width, 1),
    ):
        if value is not None and value < least:
            p.error(f"{flag} must be at least {least}, got {value}")
    if None not in (args.num_processes, args.process_id) and args.process_id >= args.num_processes:
        p.error(f"--process-id must be below --num-processes ({args.num_processes})")
    if args.local:
        if args.local == 1 and args.devices < 2:
            p.error("--devices must be at least 2 with --local 1 (half train, half sample)")
        _check_width(p, args.width, _mesh_sizes(args.local, args.devices))
        sys.exit(_launch_local(args))
    refit(args, p)


def _mesh_sizes(processes: int, devices: int) -> dict[str, int]:
    """The mesh axes the weights are split over, with their sizes, for ``processes`` processes
    of ``devices`` devices each (as `refit` builds the meshes)."""
    if processes == 1:  # its devices split in two halves
        return {"trainer tp": devices // 2, "sampler tp": devices - devices // 2}
    return {"trainer fsdp": processes // 2, "trainer tp": devices, "sampler tp": devices}


def _check_width(p: argparse.ArgumentParser, width: int, sizes: dict[str, int]) -> None:
    """A usage error unless ``width`` divides by every mesh axis it is split over."""
    lcm = math.lcm(*sizes.values())
    if width % lcm:
        axes = ", ".join(f"{name} {size}" for name, size in sizes.items())
        p.error(
            f"--width {width} must be a multiple of {lcm}, the mesh axes split it ({axes}): "
            f"use e.g. --width {max(1, width // lcm) * lcm}"
        )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _launch_local(args: argparse.Namespace) -> int:
    """Start ``args.local`` copies of this script as the processes of one local job."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    env["JAXRESHARD_EXAMPLE_CPU_COLLECTIVES"] = "gloo"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (repo, env.get("PYTHONPATH")) if x)
    common = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(args.local)]
    common += ["--steps", str(args.steps), "--width", str(args.width)]
    procs = [
        subprocess.Popen([sys.executable, __file__, *common, "--process-id", str(i)], env=env)
        for i in range(args.local)
    ]
    from jaxreshard.run.multihost import wait_local_processes  # after XLA_FLAGS is settled

    wait_local_processes(procs, timeout_s=600)
    return max(abs(proc.returncode) for proc in procs)


def refit(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if args.num_processes == 1 and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""
    ):  # one process on CPU: ask for --devices devices (accelerator backends ignore the flag)
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxreshard as jr

    if os.environ.get("JAXRESHARD_EXAMPLE_CPU_COLLECTIVES"):
        # CPU devices of several processes talk through gloo; GPUs use NCCL without a flag.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.num_processes != 1:  # one process needs no distributed runtime
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    me, n = jax.process_index(), jax.process_count()

    # Trainer: the first half of the processes; sampler: the rest (or halves of one process).
    by_process = [
        sorted((d for d in jax.devices() if d.process_index == q), key=lambda d: d.id)
        for q in range(n)
    ]
    if n == 1:
        local = by_process[0]
        if len(local) < 2:
            p.error(
                f"one process needs at least 2 devices (half train, half sample), has {len(local)}"
            )
        trainer_devices, sampler_devices = local[: len(local) // 2], local[len(local) // 2 :]
        trainer_procs, sampler_procs = 1, 1
    else:
        half = n // 2
        trainer_devices = [d for q in range(half) for d in by_process[q]]
        sampler_devices = [d for q in range(half, n) for d in by_process[q]]
        trainer_procs, sampler_procs = half, n - half
    trainer = Mesh(
        np.array(trainer_devices).reshape(trainer_procs, -1), ("fsdp", "tp")
    )  # fsdp across hosts, tp within
    sampler = Mesh(np.array(sampler_devices).reshape(sampler_procs, -1), ("dp", "tp"))
    split = {"trainer fsdp": trainer.shape["fsdp"], "trainer tp": trainer.shape["tp"]}
    _check_width(p, args.width, {**split, "sampler tp": sampler.shape["tp"]})
    is_trainer = any(d.process_index == me for d in trainer_devices)
    is_sampler = any(d.process_index == me for d in sampler_devices)

    w = args.width
    shapes = {
        "embed": (4 * w, w),
        "layers": {"w_in": (w, 4 * w), "w_out": (4 * w, w), "norm": (w,)},
    }
    train_specs = {
        "embed": P("fsdp", "tp"),
        "layers": {"w_in": P("fsdp", "tp"), "w_out": P("tp", "fsdp"), "norm": P()},
    }
    sample_specs = {  # tensor parallel over tp, replicated over dp
        "embed": P(None, "tp"),
        "layers": {"w_in": P(None, "tp"), "w_out": P("tp", None), "norm": P()},
    }
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    train_sh = jax.tree.map(lambda s: NamedSharding(trainer, s), train_specs)
    sample_sh = jax.tree.map(lambda s: NamedSharding(sampler, s), sample_specs)

    def initial(shape: tuple[int, ...], seed: int) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)

    seeds = {"embed": 0, "layers": {"w_in": 1, "w_out": 2, "norm": 3}}
    if is_trainer:
        params = jax.tree.map(
            lambda shape, seed, sh: jax.make_array_from_callback(
                shape, sh, lambda idx: initial(shape, seed)[idx], dtype=np.float32
            ),
            shapes,
            seeds,
            train_sh,
            is_leaf=is_shape,
        )
        update = jax.jit(lambda tree: jax.tree.map(lambda x: x + 0.5, tree), donate_argnums=0)
    else:  # this process holds no trainer shard: describe the trainer's arrays
        params = jax.tree.map(
            lambda shape, sh: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh),
            shapes,
            train_sh,
            is_leaf=is_shape,
        )

    # Every process makes the same plan: deterministic, agreed on at the first call.
    plan = jr.plan(params, sample_sh, dtype=jnp.bfloat16)
    if me == 0:
        print(plan.describe(), flush=True)

    weights = None
    for step in range(args.steps):
        if is_trainer:
            params = update(params)  # a training step, on the trainer's devices only
            jax.block_until_ready(params)
        start = time.perf_counter()
        weights = plan(params, donate=weights)  # every involved process, same order
        jax.block_until_ready(weights)
        took = time.perf_counter() - start
        checked = 0
        if is_sampler:  # each sampler process checks its own shards
            want = jax.tree.map(initial, shapes, seeds, is_leaf=is_shape)
            for _ in range(step + 1):  # the same float32 additions as the trainer's
                want = jax.tree.map(lambda x: x + np.float32(0.5), want)
            want = jax.tree.map(lambda x: x.astype(jnp.bfloat16), want)
            for got, ref in zip(jax.tree.leaves(weights), jax.tree.leaves(want), strict=True):
                for shard in got.addressable_shards:
                    np.testing.assert_array_equal(np.asarray(shard.data), ref[shard.index])
                    checked += 1
        role = "+".join(r for r, yes in (("trainer", is_trainer), ("sampler", is_sampler)) if yes)
        print(
            f"process {me} ({role or 'idle'}): step {step} refit {took * 1e3:.1f} ms, "
            f"{checked} destination shards checked",
            flush=True,
        )
    if jax.process_count() > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
