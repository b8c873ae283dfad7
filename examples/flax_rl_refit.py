"""RL post-training of a small Flax NNX GPT, refitting trainer -> sampler with jaxreshard.

    pip install -e ".[examples]" && python examples/flax_rl_refit.py

What it shows: the policy's parameters carry logical-axis annotations
(``nnx.with_partitioning``); two sets of logical-axis rules turn them into two layouts:

- trainer: FSDP x TP (default 2 x 2 on devices 0-3), fp32 parameters, optax AdamW;
- sampler: data-parallel replicas x TP (default 2 x 2 on devices 4-7), bf16 parameters,
  a jitted autoregressive decode loop with a KV cache.

Every iteration samples a group of answers per prompt on the sampler mesh, scores them with a
verifiable reward, takes one GRPO-style policy-gradient step (group-relative advantages) on the
trainer mesh, and refits the sampler with a jaxreshard plan made once: fp32 -> bf16, the old
sampler weights donated. One line per iteration; at the end a summary that also times the same
refit done with ``jax.device_put`` and prints ``plan.describe()``.

The task: the prompt is the start of a counting sequence modulo ``--vocab`` (``a, a+d, a+2d,
...``); the answer must go on counting. The verifier scores an answer by the fraction of its
tokens that add the stride ``d`` to the token before them. The default stride is 1 (count up),
which a fresh policy learns within the default 60 iterations; ``--max-stride 2`` mixes strides
that the policy must read from the prompt, and learns more slowly (a reward near 0.5 after 200
iterations in our runs).

Checkpoints (orbax-checkpoint): ``--ckpt-dir DIR`` saves the trainer state every ``--ckpt-every``
steps and at the end; ``--resume`` restores the latest one onto the trainer mesh and continues.
At the end the latest checkpoint's parameters are also restored straight into the sampler's
layout (bf16, sampler shardings) and compared with the refit ones.

With no accelerator the script runs on 8 simulated CPU devices (it sets
``--xla_force_host_platform_device_count=8`` unless ``XLA_FLAGS`` already asks for a count).
On CPU every "device" shares the same cores and memory, so the timings show the mechanics,
not what an accelerator cluster would see.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr

# ------------------------------------------------------------------------ layouts from rules

# Logical axes the model's parameters are annotated with, and where each layout puts them.
# The trainer shards the model dimension over "fsdp" and heads / MLP / vocabulary over "tp";
# the sampler keeps whole rows (no "fsdp") and replicates over its "dp" axis.
TRAINER_RULES = (("embed", "fsdp"), ("heads", "tp"), ("mlp", "tp"), ("vocab", "tp"))
SAMPLER_RULES = (("embed", None), ("heads", "tp"), ("mlp", "tp"), ("vocab", "tp"))
TRAINER_AXES = ("fsdp", "tp")
SAMPLER_AXES = ("dp", "tp")


def shardings_from_rules(abstract_params: nnx.State, mesh: Mesh, rules: Any) -> dict:
    """NamedShardings for every parameter: its logical annotation mapped by ``rules``."""
    with nnx.logical_axis_rules(rules):
        return nnx.get_named_sharding(abstract_params, mesh).to_pure_dict()


def make_mesh(devices: Sequence[jax.Device], shape: tuple[int, int], axes: tuple[str, str]):
    # Auto axes: jit's sharding propagation handles the model code; the layouts are explicit
    # in the parameters' NamedShardings.
    return Mesh(np.array(devices).reshape(shape), axes, axis_types=(AxisType.Auto,) * 2)


# ------------------------------------------------------------------------------------ model


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 16
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    mlp: int = 256
    prompt_len: int = 4
    answer_len: int = 6

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.answer_len


def _dense(d_in: int, d_out: int, axes: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
    init = nnx.with_partitioning(nnx.initializers.normal(0.02), axes)
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=init, rngs=rngs)


def _norm(d: int, rngs: nnx.Rngs) -> nnx.RMSNorm:
    init = nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",))
    return nnx.RMSNorm(d, scale_init=init, rngs=rngs)


class Attention(nnx.Module):
    """Causal multi-head self-attention; with a KV cache when decoding one token."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.heads = cfg.heads
        self.q = _dense(cfg.d_model, cfg.d_model, ("embed", "heads"), rngs)
        self.k = _dense(cfg.d_model, cfg.d_model, ("embed", "heads"), rngs)
        self.v = _dense(cfg.d_model, cfg.d_model, ("embed", "heads"), rngs)
        self.o = _dense(cfg.d_model, cfg.d_model, ("heads", "embed"), rngs)

    def __call__(self, x: jax.Array, cache: jax.Array | None, pos: jax.Array | None):
        b, s, d = x.shape
        split = (b, s, self.heads, d // self.heads)
        q, k, v = (f(x).reshape(split) for f in (self.q, self.k, self.v))
        if cache is None:  # the whole sequence at once (training)
            mask = jnp.tril(jnp.ones((s, s), bool))
        else:  # one new token at position `pos`; cache is (2, batch, seq_len, heads, head_dim)
            k = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache.dtype), pos, 1)
            v = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache.dtype), pos, 1)
            cache = jnp.stack([k, v])
            mask = (jnp.arange(k.shape[1]) <= pos)[None, :]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(split[-1])
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
        return self.o(out), cache


class Block(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.norm1 = _norm(cfg.d_model, rngs)
        self.attn = Attention(cfg, rngs)
        self.norm2 = _norm(cfg.d_model, rngs)
        self.up = _dense(cfg.d_model, cfg.mlp, ("embed", "mlp"), rngs)
        self.down = _dense(cfg.mlp, cfg.d_model, ("mlp", "embed"), rngs)

    def __call__(self, x, cache=None, pos=None):
        h, cache = self.attn(self.norm1(x), cache, pos)
        x = x + h
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x)))), cache


class GPT(nnx.Module):
    """A small decoder-only transformer; every parameter carries logical axis names."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        normal = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(
            cfg.vocab,
            cfg.d_model,
            embedding_init=nnx.with_partitioning(normal, ("vocab", "embed")),
            rngs=rngs,
        )
        self.pos = nnx.Param(
            nnx.with_partitioning(normal, (None, "embed"))(
                rngs.params(), (cfg.seq_len, cfg.d_model)
            )
        )
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.norm = _norm(cfg.d_model, rngs)
        self.head = _dense(cfg.d_model, cfg.vocab, ("embed", "vocab"), rngs)

    def __call__(self, tokens: jax.Array, caches=None, pos=None):
        """Logits for every position (``caches=None``), or for one new token at ``pos``."""
        at = jnp.arange(tokens.shape[1]) if pos is None else pos[None]
        x = self.embed(tokens) + self.pos[at].astype(self.embed.embedding.dtype)
        new = []
        for i, block in enumerate(self.blocks):
            x, c = block(x, None if caches is None else caches[i], pos)
            new.append(c)
        return self.head(self.norm(x)).astype(jnp.float32), new


def abstract_model(cfg: Config) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and its parameters as shapes with their annotations (no data)."""
    with nnx.use_eager_sharding(False):
        return nnx.split(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))))


def init_params(cfg: Config, seed: int, shardings: dict) -> dict:
    """Fresh fp32 parameters, created directly in the ``shardings`` layout.

    Parameters travel as a plain nested dict of arrays (``State.to_pure_dict()``), which optax,
    orbax and jaxreshard all take as is; ``nnx.merge(graphdef, params)`` rebuilds the module
    inside jitted code.
    """

    def make() -> dict:
        with nnx.use_eager_sharding(False):
            return nnx.state(GPT(cfg, nnx.Rngs(seed))).to_pure_dict()

    return jax.jit(make, out_shardings=shardings)()


# ------------------------------------------------------------------------------------- task


def make_prompts(cfg: Config, max_stride: int, n: int, seed: int, step: int) -> np.ndarray:
    """``n`` counting sequences ``a, a+d, ...`` modulo the vocabulary, one per row."""
    rng = np.random.default_rng((seed, step))
    start = rng.integers(0, cfg.vocab, size=(n, 1))
    stride = rng.integers(1, max_stride + 1, size=(n, 1))
    return ((start + stride * np.arange(cfg.prompt_len)) % cfg.vocab).astype(np.int32)


def reward(cfg: Config, tokens: np.ndarray) -> np.ndarray:
    """The verifier: the fraction of answer tokens that add the prompt's stride to the token
    before them (modulo the vocabulary)."""
    stride = (tokens[:, 1:2] - tokens[:, 0:1]) % cfg.vocab
    before = tokens[:, cfg.prompt_len - 1 : -1]
    answer = tokens[:, cfg.prompt_len :]
    return (answer == (before + stride) % cfg.vocab).mean(axis=1)


def group_advantages(rewards: np.ndarray, group: int) -> np.ndarray:
    """GRPO: each answer's reward relative to the other answers to the same prompt."""
    r = rewards.reshape(-1, group)
    adv = (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + 1e-4)
    return adv.reshape(-1).astype(np.float32)


# ---------------------------------------------------------------------------- the two jobs


def make_sampler(cfg: Config, graphdef: nnx.GraphDef, mesh: Mesh):
    """A jitted decode loop on the sampler mesh: prompt in, prompt + sampled answer out."""
    batch = NamedSharding(mesh, P("dp"))
    cache_sharding = NamedSharding(mesh, P(None, "dp", None, "tp", None))

    @jax.jit
    def generate(params: dict, prompts: jax.Array, key: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, params)
        b = prompts.shape[0]
        head_dim = cfg.d_model // cfg.heads
        cache = jnp.zeros((2, b, cfg.seq_len, cfg.heads, head_dim), jnp.bfloat16)
        caches = [jax.lax.with_sharding_constraint(cache, cache_sharding)] * cfg.layers
        tokens = jnp.zeros((b, cfg.seq_len), jnp.int32).at[:, : cfg.prompt_len].set(prompts)
        tokens = jax.lax.with_sharding_constraint(tokens, batch)

        def step(t, carry):
            tokens, caches, key = carry
            logits, caches = model(jax.lax.dynamic_slice_in_dim(tokens, t, 1, 1), caches, t)
            key, sub = jax.random.split(key)
            sampled = jax.random.categorical(sub, logits[:, 0]).astype(jnp.int32)
            given = jax.lax.dynamic_slice_in_dim(tokens, t + 1, 1, 1)[:, 0]
            nxt = jnp.where(t + 1 < cfg.prompt_len, given, sampled)
            tokens = jax.lax.dynamic_update_slice_in_dim(tokens, nxt[:, None], t + 1, 1)
            return tokens, caches, key

        tokens, _, _ = jax.lax.fori_loop(0, cfg.seq_len - 1, step, (tokens, caches, key))
        return tokens

    return generate


def make_trainer(cfg: Config, graphdef: nnx.GraphDef, tx, param_shardings, opt_shardings):
    """One jitted policy-gradient step on the trainer mesh (params and optimizer donated)."""

    def loss_fn(params: dict, tokens: jax.Array, adv: jax.Array) -> jax.Array:
        logits, _ = nnx.merge(graphdef, params)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        taken = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        answer = taken[:, cfg.prompt_len - 1 :]  # log-probs of the sampled answer tokens
        return -(adv[:, None] * answer).mean()

    @functools.partial(
        jax.jit, donate_argnums=(0, 1), out_shardings=(param_shardings, opt_shardings, None)
    )
    def train_step(params, opt_state, tokens, adv):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, adv)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def optimizer_shardings(tx, params_abstract: Any, param_shardings: dict, mesh: Mesh) -> Any:
    """The optimizer state's layout: moments like their parameters, counters replicated."""
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        jax.eval_shape(tx.init, params_abstract),
        param_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def abstract_tree(shapes: Any, shardings: Any, dtype: Any = None) -> Any:
    """ShapeDtypeStructs carrying shardings (and optionally another dtype), for orbax restore."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s),
        shapes,
        shardings,
    )


# ------------------------------------------------------------------------------ checkpoints


def checkpoint_manager(directory: str) -> ocp.CheckpointManager:
    """Checkpoints of the trainer state in ``directory`` (the last three are kept)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=3)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def save_checkpoint(mngr: ocp.CheckpointManager, step: int, params: dict, opt_state: Any) -> None:
    """Save the trainer state as two items, so that the parameters can be restored alone.

    Waits until the checkpoint is written (orbax writes in the background otherwise).
    """
    args = ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state)
    )
    mngr.save(step, args=args, force=True)
    mngr.wait_until_finished()


def restore_trainer_state(
    mngr: ocp.CheckpointManager, step: int, params_target: Any, opt_target: Any
) -> tuple[dict, Any]:
    """Params and optimizer state of checkpoint ``step``, laid out as the targets say."""
    out = mngr.restore(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardRestore(params_target),
            opt_state=ocp.args.StandardRestore(opt_target),
        ),
    )
    return out["params"], out["opt_state"]


def checkpoint_fits(mngr: ocp.CheckpointManager, step: int, shapes: Any) -> bool:
    """Whether checkpoint ``step``'s parameters have the tree and shapes of ``shapes`` (read
    from its metadata: orbax's restore of another shape fails with a long traceback)."""

    def by_path(tree: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {
            tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): tuple(x.shape)
            for path, x in flat
        }

    stored = ocp.StandardCheckpointHandler().metadata(mngr.directory / str(step) / "params")
    return by_path(stored.tree) == by_path(shapes)


def restore_params(mngr: ocp.CheckpointManager, step: int, target: Any) -> dict:
    """Only the parameters of checkpoint ``step``, in ``target``'s shardings and dtypes."""
    out = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
    return out["params"]


# --------------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Result:
    """What `main` returns (for tests and notebooks)."""

    history: list[dict]
    params: dict
    opt_state: Any
    sampler_params: dict
    plan: jr.Plan
    summary: dict


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="RL iterations to run (total)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    p.add_argument("--group", type=int, default=8, help="answers sampled per prompt")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--max-stride", type=int, default=1, help="counting strides 1..N")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--mlp", type=int, default=256)
    p.add_argument(
        "--trainer-mesh", default=(2, 2), type=_mesh_shape, help="FSDP x TP of the trainer"
    )
    p.add_argument(
        "--sampler-mesh", default=(2, 2), type=_mesh_shape, help="DP x TP of the sampler"
    )
    p.add_argument(
        "--colocate",
        action="store_true",
        help="put the sampler on the trainer's devices instead of the next ones",
    )
    p.add_argument("--ckpt-dir", default=None, help="save orbax checkpoints here")
    p.add_argument("--ckpt-every", type=int, default=10, help="save every N steps and at the end")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--compare-reps", type=int, default=10, help="refits timed in the summary")
    p.add_argument(
        "--async-refit",
        action="store_true",
        help="refit with plan.start while the next step samples (one step off-policy); "
        "reports the exposed refit time beside the synchronous refit",
    )
    args = p.parse_args(argv)
    at_least = {
        **{"--steps": 0, "--seed": 0, "--layers": 0},
        **{"--prompts": 1, "--group": 1, "--d-model": 1, "--heads": 1, "--mlp": 1},
        **{"--vocab": 2, "--max-stride": 1, "--ckpt-every": 1, "--compare-reps": 1},
    }
    for flag, least in at_least.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < least:
            p.error(f"{flag} must be at least {least}, got {value}")
    if not np.isfinite(args.lr):
        p.error(f"--lr must be a finite number, got {args.lr}")
    if args.d_model % args.heads:
        p.error(
            f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads}): each head "
            "gets d_model / heads dimensions"
        )
    # Every parameter dimension that a layout splits over a mesh axis must divide by its size.
    sizes = {  # logical axis -> (the option that sets its size, the size)
        "embed": ("--d-model", args.d_model),
        "heads": ("--d-model", args.d_model),  # the heads x head_dim columns of q, k, v
        "mlp": ("--mlp", args.mlp),
        "vocab": ("--vocab", args.vocab),
    }
    layouts = (
        ("trainer", TRAINER_RULES, TRAINER_AXES, args.trainer_mesh),
        ("sampler", SAMPLER_RULES, SAMPLER_AXES, args.sampler_mesh),
    )
    for name, rules, axes, shape in layouts:
        for logical, mesh_axis in rules:
            flag, size = sizes[logical]
            split = dict(zip(axes, shape, strict=True)).get(mesh_axis, 1)
            if size % split:
                p.error(
                    f"{flag} ({size}) must be a multiple of {split}: --{name}-mesh "
                    f"{shape[0]}x{shape[1]} splits it over its {mesh_axis} axis"
                )
    batch = args.prompts * args.group
    for name, (split, _) in (("trainer", args.trainer_mesh), ("sampler", args.sampler_mesh)):
        if batch % split:
            p.error(
                f"--{name}-mesh: its first axis ({split}) must divide the batch of "
                f"--prompts x --group = {batch} sequences"
            )
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    return args


def _mesh_shape(text: str) -> tuple[int, int]:
    """``"2x4"`` -> ``(2, 4)`` (an argparse type: a bad value is a usage error)."""
    try:
        a, b = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not AxB, e.g. 2x2") from None
    if a < 1 or b < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: both sizes must be at least 1")
    return a, b


def pick_devices(n: int) -> list[jax.Device]:
    """The default backend's devices if there are enough, else the simulated CPU devices."""
    devices = jax.devices()
    if len(devices) < n and devices[0].platform != "cpu":
        print(f"only {len(devices)} {devices[0].platform} devices for {n}: using CPU devices")
        devices = jax.devices("cpu")
    if len(devices) < n:
        raise SystemExit(
            f"the meshes need {n} devices, found {len(devices)}: use smaller --trainer-mesh/"
            "--sampler-mesh, --colocate, or raise --xla_force_host_platform_device_count"
        )
    return devices


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.1f} ms"


def _block(tree: Any) -> Any:
    return jax.block_until_ready(tree)


def main(argv: Sequence[str] | None = None) -> Result:
    args = parse_args(argv)
    cfg = Config(
        vocab=args.vocab,
        d_model=args.d_model,
        heads=args.heads,
        layers=args.layers,
        mlp=args.mlp,
    )
    n_train, n_sample = int(np.prod(args.trainer_mesh)), int(np.prod(args.sampler_mesh))
    devices = pick_devices(n_train if args.colocate else n_train + n_sample)
    trainer_devices = devices[:n_train]
    sampler_devices = devices[:n_sample] if args.colocate else devices[n_train:][:n_sample]
    trainer_mesh = make_mesh(trainer_devices, args.trainer_mesh, TRAINER_AXES)
    sampler_mesh = make_mesh(sampler_devices, args.sampler_mesh, SAMPLER_AXES)

    # Both layouts come from the same annotations, through two sets of rules.
    graphdef, abstract = abstract_model(cfg)
    train_sh = shardings_from_rules(abstract, trainer_mesh, TRAINER_RULES)
    sample_sh = shardings_from_rules(abstract, sampler_mesh, SAMPLER_RULES)
    tx = optax.adamw(args.lr, b2=0.99, weight_decay=0.0)
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), abstract)
    shapes = shapes.to_pure_dict()
    opt_sh = optimizer_shardings(tx, shapes, train_sh, trainer_mesh)
    opt_shapes = jax.eval_shape(tx.init, shapes)

    platform = devices[0].platform
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    print(
        f"policy: GPT {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, vocab "
        f"{cfg.vocab}: {n_params:,} parameters ({n_params * 4 / 2**20:.2f} MiB fp32)"
    )
    print(
        f"trainer: fsdp{args.trainer_mesh[0]} x tp{args.trainer_mesh[1]} on {platform} devices "
        f"{[d.id for d in trainer_devices]}, fp32 | sampler: dp{args.sampler_mesh[0]} x "
        f"tp{args.sampler_mesh[1]} on devices {[d.id for d in sampler_devices]}, bf16"
    )

    mngr = checkpoint_manager(args.ckpt_dir) if args.ckpt_dir else None
    start = 0
    if args.resume and mngr.latest_step() is not None:
        start = mngr.latest_step()
        if not checkpoint_fits(mngr, start, shapes):
            mngr.close()
            raise SystemExit(
                f"--resume: checkpoint {start} in {args.ckpt_dir} was made with another model "
                "shape: resume with the --vocab, --d-model, --layers and --mlp it was saved with"
            )
        params, opt_state = restore_trainer_state(
            mngr, start, abstract_tree(shapes, train_sh), abstract_tree(opt_shapes, opt_sh)
        )
        print(f"resumed from step {start} of {args.ckpt_dir} onto the trainer mesh")
    else:
        if args.resume:
            print(f"no checkpoint in {args.ckpt_dir}: starting from scratch")
        params = init_params(cfg, args.seed, train_sh)
        opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)

    # The refit: planned once from the trainer layout to the sampler layout, cast to bf16.
    plan = jr.plan(params, sample_sh, dtype=jnp.bfloat16)
    t0 = time.perf_counter()
    sampler_params = _block(plan(params))
    print(f"first refit (compiles the transfer): {_ms(time.perf_counter() - t0).strip()}")

    generate = make_sampler(cfg, graphdef, sampler_mesh)
    train_step = make_trainer(cfg, graphdef, tx, train_sh, opt_sh)
    prompt_sharding = NamedSharding(sampler_mesh, P("dp"))
    data_sharding = NamedSharding(trainer_mesh, P("fsdp"))

    # --async-refit: the refit of step k's weights streams into a second sampler tree (the
    # spare) while step k+1 samples with the current one: one step off-policy, as
    # asynchronous RL systems run. The loop waits only for what is left of the refit.
    spare = _block(plan(params)) if args.async_refit else None
    pending: jr.Refit | None = None
    started_s = 0.0

    history: list[dict] = []
    for step in range(start + 1, args.steps + 1):
        t_start = time.perf_counter()
        prompts = make_prompts(cfg, args.max_stride, args.prompts, args.seed, step)
        prompts = jax.device_put(np.repeat(prompts, args.group, axis=0), prompt_sharding)
        key = jax.random.fold_in(jax.random.key(args.seed), step)
        tokens = np.asarray(generate(sampler_params, prompts, key))
        t_sampled = time.perf_counter()
        wait_s = 0.0
        if pending is not None:  # the weights refit during this sample are needed now
            t0 = time.perf_counter()
            spare, sampler_params = sampler_params, pending.result()
            wait_s = time.perf_counter() - t0
            t_sampled = time.perf_counter()

        rewards = reward(cfg, tokens)
        adv = group_advantages(rewards, args.group)
        params, opt_state, loss = train_step(
            params,
            opt_state,
            jax.device_put(tokens, data_sharding),
            jax.device_put(adv, data_sharding),
        )
        _block(params)
        t_trained = time.perf_counter()

        if args.async_refit:
            t0 = time.perf_counter()
            pending = plan.start(params, donate=spare)  # streams during the next sample
            spare = None
            t_end = time.perf_counter()
            refit_s = wait_s + started_s  # exposed: this wait, and the start that caused it
            started_s = t_end - t0
        else:
            sampler_params = _block(plan(params, donate=sampler_params))
            t_end = time.perf_counter()
            refit_s = t_end - t_trained

        row = {
            "step": step,
            "reward": float(rewards.mean()),
            "solved": float((rewards == 1.0).mean()),
            "loss": float(loss),
            "sample_s": t_sampled - t_start,
            "train_s": t_trained - t_sampled,
            "refit_s": refit_s,
            "iter_s": t_end - t_start,
        }
        history.append(row)
        print(
            f"step {step:4d} | reward {row['reward']:.3f} (solved {row['solved']:4.0%}) | "
            f"sample {_ms(row['sample_s'])} | train {_ms(row['train_s'])} | "
            f"refit {_ms(row['refit_s'])} | refit share {row['refit_s'] / row['iter_s']:5.1%}"
        )
        if mngr is not None and (step % args.ckpt_every == 0 or step == args.steps):
            save_checkpoint(mngr, step, params, opt_state)
            print(f"           saved checkpoint {step} to {args.ckpt_dir}")

    if pending is not None:  # the last step's weights
        sampler_params = pending.result()
    summary, sampler_params = summarize(
        history, plan, params, sampler_params, train_sh, sample_sh, args
    )
    if mngr is not None:
        if mngr.latest_step() is not None:
            final = history[-1]["step"] if history else start
            summary.update(check_checkpoint(mngr, plan, shapes, train_sh, sample_sh, params, final))
        mngr.close()
    return Result(history, params, opt_state, sampler_params, plan, summary)


def _bits(tree: Any) -> list[np.ndarray]:
    """Every leaf as raw bits (so that comparisons are exact, NaNs and -0.0 included)."""
    out = []
    for x in jax.tree.leaves(tree):
        a = np.asarray(x)
        out.append(a.view(np.dtype(f"u{a.dtype.itemsize}")))
    return out


def identical(a: Any, b: Any) -> bool:
    """Same structure, shapes, dtypes and bits."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return all(x.dtype == y.dtype for x, y in zip(la, lb, strict=True)) and all(
        x.shape == y.shape and np.array_equal(x, y) for x, y in zip(_bits(a), _bits(b), strict=True)
    )


def summarize(history, plan, params, sampler_params, train_sh, sample_sh, args) -> tuple:
    """Print and return the run's figures, timing the same refit with jax.device_put; and the
    sampler's parameters (the timed refits donate and replace them)."""
    # Iteration 1 compiles the decode loop and the train step; leave it out of the means.
    warm = history[1:] or history
    summary: dict[str, Any] = {}
    if history:
        k = min(3, len(history))
        first = statistics.mean(r["reward"] for r in history[:k])
        last = statistics.mean(r["reward"] for r in history[-k:])
        mean = {f: statistics.mean(r[f] for r in warm) for f in warm[0] if f.endswith("_s")}
        share = mean["refit_s"] / mean["iter_s"]
        summary.update(
            reward_first=first, reward_last=last, mean_refit_s=mean["refit_s"], refit_share=share
        )
        if len(history) > 1:
            span = f"iterations {warm[0]['step']}-{warm[-1]['step']}; the first, which compiles, "
            span += "is left out"
        else:
            span = f"iteration {warm[0]['step']} only, compilation included"
        print(f"\nsummary ({span}):")
        print(f"  reward        {first:.3f} (first {k} iterations) -> {last:.3f} (last {k})")
        print(
            f"  iteration  {_ms(mean['iter_s'])}: sample {_ms(mean['sample_s']).strip()}, "
            f"train {_ms(mean['train_s']).strip()}, refit {_ms(mean['refit_s']).strip()}"
        )
        median = statistics.median(r["refit_s"] for r in warm)
        exposed = "exposed refit (start + wait in result)" if args.async_refit else "refit"
        summary["exposed_refit_median_s"] = median
        print(
            f"  refit share   {share:.1%} of the iteration ({exposed} mean "
            f"{_ms(mean['refit_s']).strip()}, median {_ms(median).strip()})"
        )

    # The same refit (fp32 trainer params -> bf16 sampler layout) with jax.device_put: cast on
    # the trainer mesh (as jaxreshard does, so that both move bf16 bytes), then device_put.
    cast = jax.jit(
        lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p), out_shardings=train_sh
    )

    def device_put_refit(p):
        return _block(jax.device_put(cast(p), sample_sh))

    def jaxreshard_refit(p):
        nonlocal sampler_params
        sampler_params = _block(plan(p, donate=sampler_params))
        return sampler_params

    same = identical(device_put_refit(params), jaxreshard_refit(params))
    times: dict[str, list[float]] = {"jaxreshard": [], "device_put": []}
    for _ in range(args.compare_reps):  # interleaved, so both see the same machine load
        for name, fn in (("jaxreshard", jaxreshard_refit), ("device_put", device_put_refit)):
            t0 = time.perf_counter()
            fn(params)
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    summary.update(
        refit_median_s=med["jaxreshard"],
        device_put_median_s=med["device_put"],
        device_put_identical=same,
    )
    if args.async_refit and history:
        print(
            f"  async refit   exposed median {_ms(summary['exposed_refit_median_s']).strip()} "
            f"against the synchronous refit's {_ms(med['jaxreshard']).strip()} (timed below): "
            f"{summary['exposed_refit_median_s'] / med['jaxreshard']:.2f}x"
        )
    print(
        f"  same refit, same run, median of {args.compare_reps}: jaxreshard "
        f"{_ms(med['jaxreshard']).strip()} | jax.device_put (cast, then device_put) "
        f"{_ms(med['device_put']).strip()} | bit-identical results: {'yes' if same else 'NO'}"
    )
    print("\nplan.describe():")
    print(plan.describe())
    return summary, sampler_params


def check_checkpoint(mngr, plan, shapes, train_sh, sample_sh, params, step) -> dict:
    """Restore the latest checkpoint onto the trainer mesh and straight into the sampler's
    layout, and check both: against the live parameters and against a refit."""
    latest = mngr.latest_step()
    trainer = restore_params(mngr, latest, abstract_tree(shapes, train_sh))
    # Straight into the sampler's layout: orbax reads each device's bf16 shard from the
    # checkpoint, no trainer involved.
    sampler = restore_params(mngr, latest, abstract_tree(shapes, sample_sh, jnp.bfloat16))
    on_sampler_mesh = all(
        x.sharding.is_equivalent_to(s, x.ndim)
        for x, s in zip(jax.tree.leaves(sampler), jax.tree.leaves(sample_sh), strict=True)
    )
    matches_refit = on_sampler_mesh and identical(sampler, plan(trainer))
    out = {"orbax_sampler_matches_refit": matches_refit}
    print(f"\norbax checkpoint {latest} in {mngr.directory}:")
    if latest == step:
        out["orbax_roundtrip_exact"] = identical(trainer, params)
        same = out["orbax_roundtrip_exact"]
        print(
            "  restored onto the trainer mesh: "
            + ("bit-identical to the live parameters" if same else "DIFFERS from the live ones")
        )
    print(
        "  restored straight into the sampler layout (bf16, dp x tp): "
        + ("bit-identical to jaxreshard's refit" if matches_refit else "DIFFERS from the refit")
    )
    return out


if __name__ == "__main__":
    main()
