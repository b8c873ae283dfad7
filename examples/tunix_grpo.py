"""Tunix GRPO with every trainer -> rollout weight sync going through jaxreshard.

    pip install -e ".[examples,tunix]"
    python examples/tunix_grpo.py [--colocated] [--lora]

What it shows: Tunix (google-tunix) sends all its weight syncs through one function,
``tunix.rl.reshard.reshard_pytree``; ``jaxreshard.integrations.tunix.install()`` replaces it with
jaxreshard. This script trains a tiny Tunix Llama3 (``tunix.models.llama3``, 2 layers, d_model 32)
with Tunix's own GRPO learner (``GRPOLearner`` on an ``RLCluster`` with the vanilla rollout) on a
toy task with a verifiable reward: the prompt starts counting (``count 3 4 5``) and the answer
must go on counting (``6 7 8 ...``, modulo 10).

- default: trainer (actor) on devices 0-3 as fsdp2 x tp2, rollout on devices 4-7 as tp4
  (disjoint meshes: every sync moves every byte to other devices);
- ``--colocated``: trainer fsdp2 x tp4 and rollout fsdp4 x tp2, both on devices 0-7;
- ``--lora``: a qwix LoRA (rank 4) on the attention and MLP projections: Tunix then syncs only
  the ``nnx.LoRAParam`` leaves;
- ``--donate-target``: ``install(donate_target=True)``, the sync reuses the rollout's buffers.

It prints each GRPO step's reward, loss and gradient norm (with one iteration per batch and
no KL term the GRPO loss is 0 by construction: the probability ratio is 1 and the advantages
of a group sum to 0; the gradient is not), each ``reshard_pytree`` call's time and number of
XLA compilations, then times the refit on the trained state: Tunix's
``rl_cluster.sync_weights()`` and the bare ``reshard_pytree`` call, each with jaxreshard and
with Tunix's default path (``jax.device_put``), interleaved in the same run (the first timed
call and the median of ``--reps``), and checks that the rollout weights are bit-identical to
the trainer's. On CPU ``jax.device_put`` between two layouts goes through the host, which the
transfer guards that ``sync_weights`` sets there forbid: Tunix's own path fails inside
``sync_weights`` (the script shows the error) and is timed with the guards lifted.

With no accelerator it runs on 8 simulated CPU devices (it sets
``--xla_force_host_platform_device_count=8`` unless ``XLA_FLAGS`` already asks for a count); on
CPU every "device" shares the same cores and memory, so the timings show the mechanics, not a
cluster.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import optax
import qwix
from flax import nnx
from jax.sharding import Mesh
from tunix.models.llama3 import model as llama3
from tunix.rl import reshard as tunix_reshard
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout
from tunix.sft import utils as sft_utils

import jaxreshard as jr
from jaxreshard.integrations import tunix as jr_tunix

# ------------------------------------------------------------------------------- tokenizer

SPECIALS = ("<pad>", "<s>", "</s>")
WORDS = ("count", *map(str, range(10)), "a", "b")  # 16 tokens in all
PAD, BOS, EOS = 0, 1, 2


class WordTokenizer:
    """A whitespace tokenizer over a fixed word list: the interface Tunix's sampler needs
    (``encode``, ``decode``, ``bos_id``, ``eos_id``, ``pad_id``)."""

    def __init__(self) -> None:
        self.vocab = (*SPECIALS, *WORDS)
        self.ids = {w: i for i, w in enumerate(self.vocab)}

    def encode(self, text: str, **_: Any) -> list[int]:
        return [self.ids[w] for w in text.split() if w in self.ids]

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return " ".join(self.vocab[i] for i in ids if i >= len(SPECIALS))

    def bos_id(self) -> int:
        return BOS

    def eos_id(self) -> int:
        return EOS

    def pad_id(self) -> int:
        return PAD


# ------------------------------------------------------------------------------------ task


def prompts(n: int, seed: int) -> list[str]:
    """``n`` prompts ``count a a+1 a+2`` (mod 10) with random starts."""
    rng = np.random.default_rng(seed)
    return [
        "count " + " ".join(str((a + i) % 10) for i in range(3)) for a in rng.integers(10, size=n)
    ]


def counting_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """The fraction of the first 4 answer words that go on counting from the prompt's end."""
    rewards = []
    for prompt, completion in zip(prompts, completions, strict=True):
        last = int(prompt.split()[-1])
        words = completion.split()[:4]
        good = sum(w == str((last + 1 + i) % 10) for i, w in enumerate(words))
        rewards.append(good / 4)
    return rewards


def dataset(steps: int, batch: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
    """Batches as Tunix's learner takes them: NumPy arrays (a list would be a pytree of
    strings that the learner's ``jax.tree.map``s would repeat string by string)."""
    for step in range(steps):
        yield {"prompts": np.array(prompts(batch, seed + step))}


# ----------------------------------------------------------------------------------- model

MODEL = llama3.ModelConfig(
    num_layers=2,
    vocab_size=len(SPECIALS) + len(WORDS),
    embed_dim=32,
    hidden_dim=64,
    num_heads=4,
    head_dim=8,
    num_kv_heads=4,
    rope_theta=10_000,
    norm_eps=1e-5,
)
Role = rl_cluster_lib.Role
LORA_MODULES = ".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def meshes(colocated: bool) -> tuple[Mesh, Mesh]:
    """(trainer mesh, rollout mesh), both with the axes Llama3's sharding names: fsdp, tp."""
    devices = np.array(jax.devices()[:8])
    if colocated:
        return Mesh(devices.reshape(2, 4), ("fsdp", "tp")), Mesh(
            devices.reshape(4, 2), ("fsdp", "tp")
        )
    return Mesh(devices[:4].reshape(2, 2), ("fsdp", "tp")), Mesh(
        devices[4:].reshape(1, 4), ("fsdp", "tp")
    )


def make_actor(mesh: Mesh, lora: bool, seed: int) -> nnx.Module:
    """A Llama3 with random weights, sharded on ``mesh`` by its own annotations; with ``lora``
    wrapped with a qwix LoRA (Tunix then syncs only the LoRA parameters)."""
    model = llama3.Llama3(MODEL, rngs=nnx.Rngs(seed))
    # Tunix's Llama3 starts its MLP at zero (it expects a checkpoint): draw every weight.
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(state))))
    nnx.update(
        model, jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), state)
    )
    if lora:
        provider = qwix.LoraProvider(module_path=LORA_MODULES, rank=4, alpha=8.0)
        model = qwix.apply_lora_to_model(
            model, provider, rngs=nnx.Rngs(seed + 1), **model.get_model_input()
        )
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    return model


def make_cluster(args: argparse.Namespace) -> rl_cluster_lib.RLCluster:
    trainer_mesh, rollout_mesh = meshes(args.colocated)
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={
            Role.ACTOR: trainer_mesh,
            Role.REFERENCE: trainer_mesh,
            Role.ROLLOUT: rollout_mesh,
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adamw(args.lr),
            eval_every_n_steps=1_000,
            max_steps=args.steps,
            data_sharding_axis=("fsdp",),
            pbar_description=None,
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=6,
            max_prompt_length=8,
            kv_cache_size=32,
            temperature=1.0,
            top_p=1.0,
        ),
    )
    actor = make_actor(trainer_mesh, args.lora, args.seed)
    return rl_cluster_lib.RLCluster(actor=actor, tokenizer=WordTokenizer(), cluster_config=config)


def make_learner(cluster: rl_cluster_lib.RLCluster, args: argparse.Namespace):
    algo = grpo_learner.GRPOConfig(num_generations=args.generations, num_iterations=1, beta=0.0)
    return grpo_learner.GRPOLearner(
        rl_cluster=cluster, algo_config=algo, reward_fns=counting_reward
    )


# ------------------------------------------------------------------- the jaxreshard adapter

TUNIX_RESHARD = tunix_reshard.reshard_pytree  # Tunix's own: pathways-utils, else jax.device_put


@contextlib.contextmanager
def reshard_with(fn: Callable):
    """Route Tunix's ``reshard_pytree`` through ``fn`` inside the block."""
    saved = tunix_reshard.reshard_pytree
    tunix_reshard.reshard_pytree = fn
    try:
        yield
    finally:
        tunix_reshard.reshard_pytree = saved


@contextlib.contextmanager
def counting_compiles():
    """Counts XLA compilations (``backend_compile`` events of `jax.monitoring`) in the block:
    yields a one-item list. (A fresh listener each time: Tunix's ``RLCluster.close()`` clears
    every `jax.monitoring` listener.)"""
    count = [0]

    def listen(event: str, duration: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield count
    finally:
        with contextlib.suppress(Exception):  # gone if Tunix cleared the listeners
            jax.monitoring.unregister_event_duration_listener(listen)


@contextlib.contextmanager
def recording_calls():
    """Times every call of whatever ``reshard_pytree`` is installed, and counts the XLA
    compilations in it: yields the list of (seconds, compilations) it fills."""
    inner, calls = tunix_reshard.reshard_pytree, []

    def recorded(source, target, **kw):
        start = time.perf_counter()
        with counting_compiles() as compiles:
            out = jax.block_until_ready(inner(source, target, **kw))
        calls.append((time.perf_counter() - start, compiles[0]))
        return out

    with reshard_with(recorded):
        yield calls


def device_put_unguarded(source, target, **kw: Any):
    """Tunix's own ``reshard_pytree`` (``jax.device_put``) with the transfer guards lifted: on
    CPU ``jax.device_put`` between two layouts goes through the host, which the guards that
    ``sync_weights`` sets on CPU forbid."""
    with jax.transfer_guard("allow"):
        return TUNIX_RESHARD(source, target, **kw)


# ---------------------------------------------------------------------------------- checks


def sync_filter(model: nnx.Module) -> type:
    """What ``sync_weights`` moves: the LoRA parameters if there are any, else all params."""
    return nnx.LoRAParam if sft_utils.is_lora_enabled(model) else nnx.Param


def synced_states(cluster) -> tuple[nnx.State, nnx.State]:
    """(trainer's, rollout's) state of the leaves that ``sync_weights`` moves."""
    f = sync_filter(cluster.actor_trainer.model)
    return nnx.state(cluster.actor_trainer.model, f), nnx.state(cluster.rollout.model(), f)


def host_leaves(state: nnx.State) -> list[np.ndarray]:
    """The leaves as NumPy arrays (gathered to the host: call outside any transfer guard)."""
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def assert_bit_identical(a: nnx.State, b: nnx.State) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(host_leaves(a), host_leaves(b), strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, x.dtype, y.shape, y.dtype)
        np.testing.assert_array_equal(x.view(f"u{x.itemsize}"), y.view(f"u{y.itemsize}"))


def tunix_path_under_guard(cluster) -> str:
    """``sync_weights`` with Tunix's own path, under its own guards: "ok" or the error."""
    try:
        with reshard_with(TUNIX_RESHARD):
            cluster.sync_weights()
        return "ok"
    except jax.errors.JaxRuntimeError as e:
        return "fails: " + str(e).splitlines()[0][:100] + " ..."


# ------------------------------------------------------------------------------------- timing


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def compare_refits(cluster, reps: int) -> dict[str, list[float]]:
    """Seconds of ``sync_weights`` and of the bare ``reshard_pytree`` call, with jaxreshard and
    with Tunix's own path (``jax.device_put``), interleaved, ``reps + 1`` times each."""
    src, dst = synced_states(cluster)
    dst = jax.tree.map(lambda x: x.sharding, dst)  # shardings: nothing to donate or delete

    def sync():
        cluster.sync_weights()
        return nnx.state(cluster.rollout.model())

    runs = {
        "sync_weights, jaxreshard": (jr_tunix.reshard_pytree, sync),
        "sync_weights, device_put*": (device_put_unguarded, sync),
        "reshard_pytree, jaxreshard": (None, lambda: jr_tunix.reshard_pytree(src, dst)),
        "reshard_pytree, device_put": (None, lambda: TUNIX_RESHARD(src, dst)),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps + 1):
        for name, (fn, call) in runs.items():
            with reshard_with(fn) if fn else contextlib.nullcontext():
                times[name].append(_timed(call))
    return times


def metric_history(cluster, prefix: str, name: str) -> list[float]:
    logger = cluster._rl_metrics_logger  # Tunix keeps the metrics' history here
    if not logger.metric_exists(prefix, name, "train"):
        return []
    return [float(v) for v in logger.get_metric_history(prefix, name, "train")]


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:7.1f} ms"


# ---------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--colocated", action="store_true", help="trainer and rollout on devices 0-7")
    p.add_argument("--lora", action="store_true", help="train and sync a qwix LoRA only")
    p.add_argument(
        "--donate-target",
        action="store_true",
        help="install(donate_target=True): the sync reuses the rollout's old buffers",
    )
    p.add_argument("--steps", type=int, default=4, help="GRPO steps (one sync after each)")
    p.add_argument("--batch", type=int, default=4, help="prompts per step")
    p.add_argument("--generations", type=int, default=2, help="answers per prompt (GRPO group)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--reps", type=int, default=5, help="timed refits of each kind")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    at_least = {"--steps": 1, "--batch": 1, "--generations": 2, "--reps": 1, "--seed": 0}
    why = {"--generations": " (GRPO compares the answers to the same prompt)"}
    for flag, least in at_least.items():
        value = getattr(args, flag[2:])
        if value < least:
            p.error(f"{flag} must be at least {least}{why.get(flag, '')}, got {value}")
    if not np.isfinite(args.lr):
        p.error(f"--lr must be a finite number, got {args.lr}")
    return args


def train(args: argparse.Namespace):
    """Builds the cluster and runs GRPO with the adapter installed (no fallback allowed) and
    every ``reshard_pytree`` call recorded: (cluster, [(seconds, compilations)] of each call:
    the rollout model's load, then one sync per step)."""
    with (
        jr_tunix.installed(fallback=None, donate_target=args.donate_target),
        recording_calls() as calls,
    ):
        cluster = make_cluster(args)
        learner = make_learner(cluster, args)
        learner.train(dataset(args.steps, args.batch, args.seed))
    return cluster, calls


def _call(seconds: float, compiles: int) -> str:
    return f"{_ms(seconds).strip()} ({compiles} compiled)"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    jr_tunix.reset_counters()
    start = time.perf_counter()
    cluster, calls = train(args)
    trainer_mesh, rollout_mesh = (cluster.r2m[r] for r in (Role.ACTOR, Role.ROLLOUT))
    for name, mesh in (("trainer", trainer_mesh), ("rollout", rollout_mesh)):
        print(f"{name}: {dict(mesh.shape)} on devices {mesh.device_ids.ravel().tolist()}")
    print(f"{args.steps} GRPO steps in {time.perf_counter() - start:.1f} s")
    rewards = metric_history(cluster, "rewards", "mean")
    losses = metric_history(cluster, "actor", "loss")
    grads = metric_history(cluster, "actor", "grad_norm")
    for i, (r, loss, g) in enumerate(zip(rewards, losses, grads, strict=False)):
        print(f"  step {i + 1}: reward {r:.3f} | loss {loss:+.4f} | grad norm {g:.3f}")
    print(f"adapter counters: {jr_tunix.counters()}")
    print(f"reshard_pytree through jaxreshard: loading the rollout model {_call(*calls[0])}")
    print("  sync_weights after each step: " + ", ".join(_call(*c) for c in calls[1:]))

    src, dst = synced_states(cluster)
    assert_bit_identical(src, dst)
    print("rollout weights after the last sync: bit-identical to the trainer's")
    print("sync_weights with Tunix's own path (jax.device_put) under its transfer guards:")
    print("  " + tunix_path_under_guard(cluster))

    stats = jr.plan(src, jax.tree.map(lambda x: x.sharding, dst)).stats
    # Under the options the syncs ran with: the plan cache keys on them (fallback= included),
    # so other options would plan and compile the same layouts again in the first timed call.
    with jr_tunix.installed(fallback=None, donate_target=args.donate_target):
        times = compare_refits(cluster, args.reps)
    what = "LoRA params" if args.lora else "params"
    print(
        f"refit of the trained state: {len(jax.tree.leaves(src))} {what}, "
        f"{stats.bytes_sent / 1024:.1f} KiB sent by jaxreshard; "
        f"first timed call | median of the next {args.reps}:"
    )
    for name, ts in times.items():
        print(f"  {name:27s} {_ms(ts[0])} | {_ms(statistics.median(ts[1:]))}")
    print("  * transfer guards lifted: on CPU jax.device_put between layouts goes through the host")
    return {"cluster": cluster, "calls": calls, "times": times, "counters": jr_tunix.counters()}


if __name__ == "__main__":
    main()
