"""Side-by-side benchmark: jaxreshard against what JAX users do today.

Run it as a module; it uses the devices of JAX's default backend (on CPU it asks XLA for 8
host devices before the backend starts, nothing else changes ``XLA_FLAGS``)::

    python -m jaxreshard.bench                                  # every scenario (full size)
    python -m jaxreshard.bench --scenario disjoint --pairs 20 --json out.json
    python -m jaxreshard.bench --size-mib 4 --big-leaf-mib 4 --many-leaves 64 --pairs 2 \\
        --gpt-d 128 --gpt-vocab 1024 --first-call-layers 1,2    # a quick smoke run

Scenarios (`SCENARIOS`) are named layout pairs over parameter trees; strategies are the ways to
move a tree: ``jaxreshard`` (plan once, then every call donates the previous result: the refit
loop), ``device_put`` (`jax.device_put` onto the destination shardings), ``gather_slice``
(all-gather to a full replica on the source devices, then each destination shard sliced out of
a replica and copied to its device) and ``xla_reshard`` (``jax.jit(identity,
out_shardings=dst)``: XLA's SPMD partitioner; one device set only). ``first_call`` times plan +
compile + first move of an unscanned Llama-like tree at several layer counts, each in a fresh
process; ``one_device`` is what one accelerator can measure (see below).

Method of a timing scenario (every strategy is treated alike):

* first call: each strategy's first call on the same source, timed, with the compile time summed
  from `jax.monitoring` events; every result is compared, element for element, with
  `jax.device_put`'s (JAX's ground truth);
* warm-up: ``--warmup`` more untimed calls of every strategy (the same number for each), each on a
  fresh source; the last is watched for host traffic;
* timing: for every other strategy X, ``--pairs`` rounds of X against jaxreshard interleaved
  ``J X, X J, ...`` (one pass per X, so one baseline's memory churn does not slow another).
  Before every call, untimed, the
  source is replaced by a fresh one (``x + 1`` with donation, as an optimizer step would; JAX
  caches the host copy of an array that `jax.device_put` pulled through host memory, which would
  flatter it on a repeated source). jaxreshard writes into the donated previous result (its refit
  mode); the other strategies allocate fresh outputs, and JAX offers no way to hand
  `jax.device_put` warm output buffers: the ``output`` column says which;
* ratios: ``jr/this`` is jaxreshard's time over the strategy's, given as the median of the
  per-round ratios and as the ratio of the medians; the targets use the ratio of the medians;
* host bytes: measured, by watching the host NumPy arrays JAX hands to its device-placement path
  (``watched``: `jax.device_put` between device sets pulls the whole array to NumPy and puts the
  shards back), or, for jaxreshard, a call under ``jax.transfer_guard("disallow")`` (``guard``:
  it would raise on any host transfer, so 0 is measured, not assumed);
* memory: one more call per strategy, alone, after returning free heap memory to the system
  (``malloc_trim``) and resetting the kernel's ``VmHWM``: peak resident memory beyond that just
  before the call; ``transient`` is that peak less a freshly allocated result. jaxreshard is
  measured twice: with its staging pool warm, and with the pool freed before the call
  (`Plan.free_staging`: the first call at that shape, which allocates the pool). On CPU device
  memory is host memory; on accelerators only host memory is measured (JAX cannot reset a
  device's peak counter), so the memory target is not judged there;
* stage profile: `Plan.profile` (every phase awaited and timed; median of ``--profile-reps``)
  next to a memcpy of each stage's bytes into a donated buffer, on the same devices in the same
  run: pack writes ``bytes_sent`` on the senders, the transfer ``bytes_wire`` into the
  receivers, unpack ``bytes_total`` (received + local copies) on the receivers;
* plan arithmetic (`PlanStats`: bytes, rounds, staging, programs) is printed apart from what is
  measured; gather-then-slice's device-to-device bytes are derived from the layouts.

Devices: the scenarios are written for 8 devices (trainer on 0-3, sampler on 4-7) and scale to
what the backend has (``--devices``): with 2-7 the meshes shrink to the largest power of two,
trainer on the first half, sampler on the second. With one device no transfer exists (a plan
whose source and destination lie on one device copies locally), so the harness runs
``one_device`` instead: kernels shaped like the runtime's pack and unpack at the bench's shard
shapes against a memcpy, the library's all-local plan, and ``first_call`` on one device (what
compiling the 32-layer tree's programs costs there). These paths run on CPU (``--devices 1``,
``--devices 2``) in the tests; on GPUs they have not run yet.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import itertools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

import jaxreshard as jr
from jaxreshard.tools.cli import writable_path

P = PartitionSpec
MiB = 1 << 20
N_DEVICES = 8
"""Devices the scenarios are written for; machines with fewer get scaled meshes."""
_HOST_FLAG = "--xla_force_host_platform_device_count"
_REEXEC_MARK = "JAXRESHARD_BENCH_REEXEC"

# ----------------------------------------------------------------------------------- trees


# Roles of parameters and how each layout splits them. "col" weights are column-parallel (qkv,
# mlp up, an untied output head), "row" weights row-parallel (attention out, mlp down), "embed"
# the (vocab, d) embedding, "bias" a column-parallel bias, "vec" a norm scale or bias of size
# d; "stacked_*" the same with a leading layer dimension (a scanned model), never split
# (`_with_stacked`).
def _with_stacked(specs: dict[str, PartitionSpec]) -> dict[str, PartitionSpec]:
    """``specs`` and, for each role, its ``stacked_`` role: the same spec after a leading
    dimension no axis splits."""
    return specs | {f"stacked_{role}": P(None, *spec) for role, spec in specs.items()}


TRAINER = _with_stacked(  # fsdp x tp
    {
        "col": P("fsdp", "tp"),
        "row": P("tp", "fsdp"),
        "embed": P("tp", "fsdp"),
        "bias": P("tp"),
        "vec": P("fsdp"),
        "lora_a_col": P("fsdp", None),
        "lora_b_col": P(None, "tp"),
        "lora_a_row": P("tp", None),
        "lora_b_row": P(None, "fsdp"),
    }
)
SAMPLER_TP = _with_stacked(  # tensor parallel (replicated over "dp" where the mesh has it)
    {
        "col": P(None, "tp"),
        "row": P("tp", None),
        "embed": P("tp", None),
        "bias": P("tp"),
        "vec": P(),
        # LoRA as a tensor-parallel server shards it: a column-parallel weight's A whole on
        # every device and its B split like the weight; a row-parallel weight's A split like
        # the weight and its B whole.
        "lora_a_col": P(),
        "lora_b_col": P(None, "tp"),
        "lora_a_row": P("tp", None),
        "lora_b_row": P(),
    }
)
FSDP_ONLY = _with_stacked(  # dp x fsdp: everything split on its first dimension, replicated over dp
    {
        "col": P("fsdp", None),
        "row": P("fsdp", None),
        "embed": P("fsdp", None),
        "bias": P("fsdp"),
        "vec": P("fsdp"),
        **{f"lora_{m}_{k}": P("fsdp", None) for m in "ab" for k in ("col", "row")},
    }
)


@dataclasses.dataclass(frozen=True)
class Tree:
    """Leaf shapes and roles, by name (a flat dict is a pytree), and the sources' dtype."""

    leaves: dict[str, tuple[tuple[int, ...], str]]
    dtype: str = "float32"

    @property
    def nbytes_f32(self) -> int:
        return sum(4 * math.prod(shape) for shape, _ in self.leaves.values())

    @property
    def nbytes(self) -> int:
        """The sources' bytes, in their dtype."""
        return self.nbytes_f32 // 4 * jnp.dtype(self.dtype).itemsize


def gpt_block(d: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """One GPT block of width ``d``, 10 leaves: ln1 scale/bias, qkv weight/bias, attention
    out, ln2 scale/bias, mlp up weight/bias, mlp down (4 d)."""
    return {
        "ln1.scale": ((d,), "vec"),
        "ln1.bias": ((d,), "vec"),
        "attn.qkv": ((d, 3 * d), "col"),
        "attn.qkv_bias": ((3 * d,), "bias"),
        "attn.out": ((d, d), "row"),
        "ln2.scale": ((d,), "vec"),
        "ln2.bias": ((d,), "vec"),
        "mlp.up": ((d, 4 * d), "col"),
        "mlp.up_bias": ((4 * d,), "bias"),
        "mlp.down": ((4 * d, d), "row"),
    }


def gpt_blocks(d: int, layers: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """``layers`` GPT blocks of width ``d`` (`gpt_block`), named ``layerNN.``."""
    return {
        f"layer{i:02d}.{name}": leaf for i in range(layers) for name, leaf in gpt_block(d).items()
    }


def gpt(d: int, layers: int, vocab: int, *, embed: bool = True, blocks: bool = True) -> Tree:
    """A GPT-like tree: a (vocab, d) embedding, ``layers`` blocks and a final layer norm."""
    leaves: dict[str, tuple[tuple[int, ...], str]] = {}
    if embed:
        leaves["embed"] = ((vocab, d), "embed")
    if blocks:
        leaves |= gpt_blocks(d, layers)
        leaves |= {"final_ln.scale": ((d,), "vec"), "final_ln.bias": ((d,), "vec")}
    return Tree(leaves)


def scanned_gpt(d: int, layers: int, vocab: int) -> Tree:
    """A scanned GPT-like tree: a (vocab, d) embedding, the blocks' 10 leaves each stacked
    over ``layers`` (a leading layer dimension, as `nnx.scan` or `nn.scan` lay them out), a
    final layer norm and an untied (d, vocab) output head."""
    leaves: dict[str, tuple[tuple[int, ...], str]] = {"embed": ((vocab, d), "embed")}
    leaves |= {
        f"layers.{name}": ((layers, *shape), f"stacked_{role}")
        for name, (shape, role) in gpt_block(d).items()
    }
    leaves |= {"final_ln.scale": ((d,), "vec"), "final_ln.bias": ((d,), "vec")}
    leaves["head"] = ((d, vocab), "col")
    return Tree(leaves)


def gpt_tree(size_mib: float, layers: int = 8) -> Tree:
    """A GPT-like tree of about ``size_mib`` MiB in fp32, with a (16 d, d) embedding: 10 leaves
    per block plus 3. ``d`` is the largest multiple of 16 that keeps the tree within the size
    (at least 16)."""
    d = 16
    while gpt(d + 16, layers, 16 * (d + 16)).nbytes_f32 <= size_mib * MiB:
        d += 16
    return gpt(d, layers, 16 * d)


def llama_tree(layers: int, d: int, mlp: int, vocab: int) -> Tree:
    """An unscanned Llama-like tree: an embedding, ``layers`` blocks of 9 leaves (attention and
    mlp norms, q, k, v, o, gate, up, down) and a final norm: 9 ``layers`` + 2 leaves."""
    leaves: dict[str, tuple[tuple[int, ...], str]] = {"embed": ((vocab, d), "embed")}
    for i in range(layers):
        p = f"layers.{i:02d}."
        leaves |= {
            p + "attn_norm": ((d,), "vec"),
            p + "q": ((d, d), "col"),
            p + "k": ((d, d), "col"),
            p + "v": ((d, d), "col"),
            p + "o": ((d, d), "row"),
            p + "mlp_norm": ((d,), "vec"),
            p + "gate": ((d, mlp), "col"),
            p + "up": ((d, mlp), "col"),
            p + "down": ((mlp, d), "row"),
        }
    leaves["final_norm"] = ((d,), "vec")
    return Tree(leaves)


def matrices_tree(size_mib: float, n: int, like: int | None = None) -> Tree:
    """``n`` equal (rows, cols) fp32 matrices, alternately column- and row-parallel.

    Sized as ``like`` matrices (default ``n``) of about ``size_mib / like`` MiB each, with rows
    and columns multiples of 16 (at least 16 x 16), so `matrices_tree(s, 8, like=1024)` holds
    exactly the bytes of `matrices_tree(s, 1024)`: the same columns, 128 x the rows.
    """
    like = like or n
    if like % n:
        raise ValueError(f"{n} matrices cannot hold the bytes of {like} equal ones")
    per = size_mib * MiB / 4 / like  # elements per matrix at `like` matrices
    cols = max(16, int(math.sqrt(per)) // 16 * 16)
    rows = max(16, int(per / cols) // 16 * 16) * (like // n)
    return Tree({f"w{i:04d}": ((rows, cols), "col" if i % 2 == 0 else "row") for i in range(n)})


def small_leaves_tree(d: int, layers: int) -> Tree:
    """The small leaves of ``layers`` GPT blocks of width ``d``: layer-norm scales and biases
    and the matrices' biases, 6 a block, a few KiB each (they move by gathers)."""
    return Tree({k: v for k, v in gpt_blocks(d, layers).items() if len(v[0]) == 1})


def lora_tree(d: int, layers: int, rank: int) -> Tree:
    """The LoRA adapters of ``layers`` Llama-like blocks of width ``d`` (an MLP of 4 d): an A
    (in, ``rank``) and a B (``rank``, out) matrix for each of q, k, v, o, gate, up and down,
    14 leaves a block of tens of KiB each (what a LoRA refit moves: many small leaves)."""
    weights = {"q": (d, d), "k": (d, d), "v": (d, d), "gate": (d, 4 * d), "up": (d, 4 * d)}
    rows = {"o": (d, d), "down": (4 * d, d)}
    leaves: dict[str, tuple[tuple[int, ...], str]] = {}
    for i in range(layers):
        for name, (n_in, n_out) in {**weights, **rows}.items():
            kind = "row" if name in rows else "col"
            leaves[f"layers.{i:02d}.{name}.lora_a"] = ((n_in, rank), f"lora_a_{kind}")
            leaves[f"layers.{i:02d}.{name}.lora_b"] = ((rank, n_out), f"lora_b_{kind}")
    return Tree(leaves)


def one_leaf_tree(size_mib: float) -> Tree:
    """One square fp32 matrix of about ``size_mib`` MiB (16384 x 16384 for 1024 MiB)."""
    n = max(16, int(math.sqrt(size_mib * MiB / 4)) // 16 * 16)
    return Tree({"w": ((n, n), "col")})


def gpt32k(args: argparse.Namespace, part: str) -> Tree:
    """The d 1024, 6-layer, 32k-vocabulary GPT tree (416 MiB fp32) of the executor targets, or
    its blocks alone (288 MiB), or its embedding alone (128 MiB); sizes from ``--gpt-*``."""
    return gpt(
        args.gpt_d, args.gpt_layers, args.gpt_vocab, embed=part != "blocks", blocks=part != "embed"
    )


# --------------------------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class Layouts:
    """A source and a destination layout: meshes (device positions, shape, axes) and specs."""

    src_devices: tuple[int, ...]
    src_mesh: tuple[tuple[int, ...], tuple[str, ...]]
    src_specs: dict[str, PartitionSpec]
    dst_devices: tuple[int, ...]
    dst_mesh: tuple[tuple[int, ...], tuple[str, ...]]
    dst_specs: dict[str, PartitionSpec]

    def describe(self) -> str:
        return f"{_describe_mesh(self.src_mesh, self.src_devices)} -> " + _describe_mesh(
            self.dst_mesh, self.dst_devices
        )


def _describe_mesh(mesh: tuple[tuple[int, ...], tuple[str, ...]], devices: Sequence[int]) -> str:
    shape, axes = mesh
    name = " x ".join(f"{a}{n}" for a, n in zip(axes, shape, strict=True) if n > 1) or "1 device"
    ids = list(devices)
    if ids == list(range(ids[0], ids[0] + len(ids))):
        where = f"device {ids[0]}" if len(ids) == 1 else f"devices {ids[0]}-{ids[-1]}"
    else:
        where = "devices " + ",".join(map(str, ids))
    return f"{name} on {where}"


def _grid(h: int) -> tuple[int, int]:
    """A 2-D mesh of ``h`` devices (a power of two): 2 x h/2 where it can be, else h x 1."""
    return (2, h // 2) if h >= 4 else (h, 1)


def disjoint_layouts(n: int) -> Layouts:
    """Trainer fsdp x tp on the first half of ``n`` devices -> sampler tp on the second half
    (n = 8: fsdp2 x tp2 on 0-3 -> tp4 on 4-7)."""
    h = n // 2
    return Layouts(
        tuple(range(h)),
        (_grid(h), ("fsdp", "tp")),
        TRAINER,
        tuple(range(h, 2 * h)),
        ((h,), ("tp",)),
        SAMPLER_TP,
    )


def same_layout_layouts(n: int) -> Layouts:
    """The sampler's layout on both halves of ``n`` devices: tp on the first half -> the same
    tp on the second (n = 8: tp4 on 0-3 -> tp4 on 4-7), so every destination shard is one
    whole source shard (trainer and sampler with the same tensor parallelism)."""
    sampler = disjoint_layouts(n)
    return dataclasses.replace(sampler, src_mesh=sampler.dst_mesh, src_specs=sampler.dst_specs)


def replicated_src_layouts(n: int) -> Layouts:
    return dataclasses.replace(
        disjoint_layouts(n), src_mesh=(_grid(n // 2), ("dp", "fsdp")), src_specs=FSDP_ONLY
    )


def replicated_dst_layouts(n: int) -> Layouts:
    return dataclasses.replace(disjoint_layouts(n), dst_mesh=(_grid(n // 2), ("dp", "tp")))


def colocated_layouts(n: int) -> Layouts:
    """All ``n`` devices on both sides: fsdp x tp2 -> dp2 x tp over the even then odd devices."""
    return Layouts(
        tuple(range(n)),
        ((n // 2, 2), ("fsdp", "tp")),
        TRAINER,
        (*range(0, n, 2), *range(1, n, 2)),
        ((2, n // 2), ("dp", "tp")),
        SAMPLER_TP,
    )


def shared_layouts(n: int) -> Layouts:
    """All ``n`` devices on both sides in one order: fsdp x tp2 -> tp over all of them (a
    sampler colocated with its trainer on the trainer's own mesh)."""
    return dataclasses.replace(
        colocated_layouts(n), dst_devices=tuple(range(n)), dst_mesh=((n,), ("tp",))
    )


def first_call_layouts(n: int) -> Layouts:
    """fsdp2 x tp2 on 0-3 -> dp2 x tp2 on 4-7 (scaled); one device: both on device 0."""
    return one_device_layouts(n) if n == 1 else replicated_dst_layouts(n)


def one_device_layouts(n: int) -> Layouts:
    """Both layouts on device 0 (with one device every spec places the whole array there)."""
    del n
    return Layouts(
        (0,), ((1, 1), ("fsdp", "tp")), TRAINER, (0,), ((1, 1), ("dp", "tp")), SAMPLER_TP
    )


# ------------------------------------------------------------------------------- scenarios


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A named benchmark case: what moves, from where to where, and the strategies that apply.

    ``family`` groups scenarios under one target ("disjoint": every GPT-like tree); ``kind``
    is "timing" (strategies side by side), "first_call" or "one_device".
    """

    name: str
    what: str
    layouts: Callable[[int], Layouts]
    tree: Callable[[argparse.Namespace], Tree] | None = None
    dtype: Any = None
    strategies: tuple[str, ...] = ("jaxreshard", "device_put", "gather_slice")
    family: str = ""
    kind: str = "timing"

    def describe(self, args: argparse.Namespace) -> str:
        """``what`` with this run's sizes filled in."""
        return self.what.format(a=args)


def _gpt_default(a: argparse.Namespace) -> Tree:
    return gpt_tree(a.size_mib, a.layers)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "disjoint",
            "GPT tree of {a.size_mib:g} MiB, {a.layers} blocks",
            disjoint_layouts,
            _gpt_default,
            family="disjoint",
        ),
        Scenario(
            "disjoint_gpt32k",
            "GPT tree d {a.gpt_d}, {a.gpt_layers} layers, vocab {a.gpt_vocab} (a large "
            "embedding leaf)",
            disjoint_layouts,
            lambda a: gpt32k(a, "all"),
            family="disjoint",
        ),
        Scenario(
            "disjoint_gpt32k_blocks",
            "the same tree without its embedding (d {a.gpt_d}, {a.gpt_layers} layers)",
            disjoint_layouts,
            lambda a: gpt32k(a, "blocks"),
            family="disjoint",
        ),
        Scenario(
            "disjoint_gpt32k_embed",
            "its ({a.gpt_vocab}, {a.gpt_d}) embedding alone",
            disjoint_layouts,
            lambda a: gpt32k(a, "embed"),
            family="disjoint",
        ),
        Scenario(
            "disjoint_gpt32k_bf16",
            "the whole tree in bf16 (d {a.gpt_d}, {a.gpt_layers} layers, vocab {a.gpt_vocab}): "
            "a leaf cut into slabs, in a dtype XLA CPU writes as bits",
            disjoint_layouts,
            lambda a: dataclasses.replace(gpt32k(a, "all"), dtype="bfloat16"),
            family="disjoint",
        ),
        Scenario(
            "disjoint_scanned_bf16",
            "a scanned GPT tree in bf16 (d {a.gpt_d}, {a.gpt_layers} layers stacked, vocab "
            "{a.gpt_vocab}, an untied output head whose columns over the sampler's devices "
            "make narrow rows)",
            disjoint_layouts,
            lambda a: dataclasses.replace(
                scanned_gpt(a.gpt_d, a.gpt_layers, a.gpt_vocab), dtype="bfloat16"
            ),
            family="disjoint",
        ),
        Scenario(
            "same_layout",
            "GPT tree of {a.size_mib:g} MiB, the sampler's layout on both sides (the same "
            "tensor parallelism: every destination shard is one whole source shard)",
            same_layout_layouts,
            _gpt_default,
            family="disjoint",
        ),
        Scenario(
            "colocated",
            "GPT tree of {a.size_mib:g} MiB, one device set in two orders",
            colocated_layouts,
            _gpt_default,
            strategies=("jaxreshard", "device_put", "gather_slice", "xla_reshard"),
        ),
        Scenario(
            "many_leaves",
            "{a.many_leaves} equal matrices, {a.size_mib:g} MiB; jaxreshard_8_leaves moves "
            "the same bytes as 8 matrices (per-leaf overhead)",
            disjoint_layouts,
            lambda a: matrices_tree(a.size_mib, a.many_leaves),
            strategies=("jaxreshard", "jaxreshard_8_leaves", "device_put", "gather_slice"),
        ),
        Scenario(
            "small_leaves",
            "the {a.small_leaves_layers} x 6 norm scales and biases of a GPT of width "
            "{a.gpt_d} (no matrices: a few KiB a leaf)",
            disjoint_layouts,
            lambda a: small_leaves_tree(a.gpt_d, a.small_leaves_layers),
            strategies=("jaxreshard", "device_put"),
        ),
        Scenario(
            "lora",
            "the rank-{a.lora_rank} LoRA adapters of {a.lora_layers} Llama-like blocks of "
            "width {a.gpt_d} (14 small matrices a block)",
            disjoint_layouts,
            lambda a: lora_tree(a.gpt_d, a.lora_layers, a.lora_rank),
            strategies=("jaxreshard", "device_put"),
        ),
        Scenario(
            "lora_colocated",
            "the same adapters ({a.lora_layers} blocks, rank {a.lora_rank}), the sampler's tp "
            "over the trainer's devices in their order (colocated, as LoRA RL often runs)",
            shared_layouts,
            lambda a: lora_tree(a.gpt_d, a.lora_layers, a.lora_rank),
            strategies=("jaxreshard", "device_put"),
        ),
        Scenario(
            "replicated_src",
            "GPT tree of {a.size_mib:g} MiB, every source shard held twice",
            replicated_src_layouts,
            _gpt_default,
        ),
        Scenario(
            "replicated_dst",
            "GPT tree of {a.size_mib:g} MiB, every destination shard held twice",
            replicated_dst_layouts,
            _gpt_default,
        ),
        Scenario(
            "cast",
            "GPT tree of {a.size_mib:g} MiB, fp32 -> bf16 on the way (the senders cast)",
            disjoint_layouts,
            _gpt_default,
            dtype=jnp.bfloat16,
        ),
        Scenario(
            "big_leaf",
            "one fp32 matrix of {a.big_leaf_mib:g} MiB",
            disjoint_layouts,
            lambda a: one_leaf_tree(a.big_leaf_mib),
        ),
        Scenario(
            "async_refit",
            "GPT tree of {a.size_mib:g} MiB, Plan.start while the sampler runs a decode-like "
            "loop lasting {a.async_work:g}x the synchronous refit",
            disjoint_layouts,
            _gpt_default,
            strategies=("jaxreshard",),
            kind="async",
        ),
        Scenario(
            "first_call",
            "unscanned Llama-like tree (d {a.first_call_d}, mlp {a.first_call_mlp}, vocab "
            "{a.first_call_vocab}), bf16 cast: plan + compile + first move, a fresh process "
            "per layer count",
            first_call_layouts,
            dtype=jnp.bfloat16,
            strategies=("jaxreshard", "device_put"),
            kind="first_call",
        ),
        Scenario(
            "one_device",
            "one device: pack/unpack-shaped kernels at the bench's shard shapes and the "
            "library's all-local plan, against a memcpy (a default only with one device)",
            one_device_layouts,
            _gpt_default,
            strategies=("jaxreshard",),
            kind="one_device",
        ),
    ]
}

STRATEGIES = ("jaxreshard", "jaxreshard_8_leaves", "device_put", "gather_slice", "xla_reshard")


def default_scenarios(n_devices: int) -> list[str]:
    """Every scenario that means something on ``n_devices`` devices."""
    if n_devices == 1:
        return ["one_device", "first_call"]
    return [name for name, s in SCENARIOS.items() if s.kind != "one_device"]


def _mesh(devices: Sequence[jax.Device], positions: Sequence[int], shape_axes: Any) -> Mesh:
    shape, axes = shape_axes
    return Mesh(np.array([devices[i] for i in positions]).reshape(shape), axes)


def shardings(tree: Tree, layouts: Layouts, devices: Sequence[jax.Device]) -> tuple[Any, Any]:
    """Source and destination `NamedSharding` trees of ``tree`` under ``layouts``."""
    src = _mesh(devices, layouts.src_devices, layouts.src_mesh)
    dst = _mesh(devices, layouts.dst_devices, layouts.dst_mesh)
    return (
        {k: NamedSharding(src, layouts.src_specs[role]) for k, (_, role) in tree.leaves.items()},
        {k: NamedSharding(dst, layouts.dst_specs[role]) for k, (_, role) in tree.leaves.items()},
    )


def make_source(tree: Tree, src_shardings: dict[str, NamedSharding]) -> dict[str, jax.Array]:
    """Build the source arrays on their devices (no host copy): distinct values per leaf, in
    the tree's dtype."""
    makers: dict[Any, Any] = {}
    dtype = jnp.dtype(tree.dtype)
    out = {}
    for k, ((shape, _), leaf) in enumerate(zip(tree.leaves.values(), tree.leaves, strict=True)):
        sharding = src_shardings[leaf]
        key = (shape, sharding)
        if key not in makers:

            def make(seed: jax.Array, shape: tuple[int, ...] = shape) -> jax.Array:
                i = jax.lax.iota(jnp.int32, math.prod(shape)).reshape(shape)
                return ((i * 7 + seed) % 4093).astype(dtype)

            makers[key] = jax.jit(make, out_shardings=sharding)
        out[leaf] = makers[key](jnp.int32(k))
    return out


def _dst_bytes(tree: Tree, dst: dict[str, NamedSharding], dtype: Any) -> int:
    """Bytes of every destination shard, summed over the destination devices."""
    itemsize = jnp.dtype(dtype or tree.dtype).itemsize
    return sum(
        _index_size(idx, shape) * itemsize
        for k, (shape, _) in tree.leaves.items()
        for idx in dst[k].devices_indices_map(shape).values()
    )


# ------------------------------------------------------------------------------ strategies


class Strategy:
    """One way of moving the source tree into the destination layout.

    ``__call__`` returns the destination tree; ``done`` disposes of it (frees it, or keeps it
    for the next call's donation). ``output`` says whether a call writes into the previous
    result ("donated") or allocates a new one ("fresh").
    """

    name = ""
    source = "main"  # which source tree it reads
    output = "fresh"
    notes = ""

    def prepare(self) -> None:
        """Untimed set-up (planning, building programs that are not compiled yet)."""

    def describe(self, src: Any) -> None:
        """Untimed, after the warm-up: fill in ``notes`` (may compile for inspection)."""

    def __call__(self, src: Any) -> Any:
        raise NotImplementedError

    def done(self, out: Any, src: Any) -> None:
        _delete(out, keep=src)


class JaxReshard(Strategy):
    """jaxreshard: one plan, then every call donates the previous result (a refit loop)."""

    output = "donated"

    def __init__(self, src: Any, dst: Any, dtype: Any, bucket_bytes: int | None, name: str):
        self.name, self.src, self.dst = name, src, dst
        self.dtype, self.bucket_bytes = dtype, bucket_bytes
        self.source = "main" if name == "jaxreshard" else name
        self.prev: Any = None
        self.plan_s = math.nan

    def prepare(self) -> None:
        t0 = time.perf_counter()
        self.plan = jr.plan(self.src, self.dst, bucket_bytes=self.bucket_bytes, dtype=self.dtype)
        self.plan_s = time.perf_counter() - t0

    def __call__(self, src: Any) -> Any:
        out = self.plan(src, donate=self.prev)
        self.prev = out
        return out

    def done(self, out: Any, src: Any) -> None:
        pass  # kept as self.prev, donated to the next call

    def describe(self, src: Any) -> None:
        counts: dict[str, int] = {}
        for text in self.plan.compiled_transfers():
            for op, n in _collective_counts(text).items():
                counts[op] = counts.get(op, 0) + n
        self.notes = "transfer HLO: " + (
            ", ".join(f"{k} x{v}" for k, v in counts.items()) or "no collectives"
        )


class DevicePut(Strategy):
    """`jax.device_put` onto the destination shardings (cast first on the source, if any).

    Between two orders of one device set JAX runs one XLA reshard program per leaf. Dispatched
    back to back, several such collective programs are in flight at once, and on the CPU
    backend they deadlock now and then (XLA aborts the process after 40 s). There the leaves
    are put one at a time, each awaited: a little slower than one tree-wide call.
    """

    name = "device_put"

    def __init__(self, src_shardings: Any, dst: Any, dtype: Any):
        self.dst = dst
        self.cast = (
            None
            if dtype is None
            else jax.jit(lambda t: _cast(t, dtype), out_shardings=src_shardings)
        )
        self.one_at_a_time = any(
            s.device_set == dst[k].device_set and jax.devices()[0].platform == "cpu"
            for k, s in src_shardings.items()
        )
        if self.one_at_a_time:
            self.notes = "one leaf at a time: a tree-wide call deadlocks XLA's CPU collectives"

    def __call__(self, src: Any) -> Any:
        if self.cast is not None:
            src = self.cast(src)
        if not self.one_at_a_time:
            return jax.device_put(src, self.dst)
        return {k: _ready(jax.device_put(x, self.dst[k])) for k, x in src.items()}


class XlaReshard(Strategy):
    """XLA's own reshard: ``jax.jit(identity, out_shardings=dst)``, for one device set.

    `jax.jit` refuses a destination whose mesh lists the same devices in another order, so the
    source is first re-wrapped, zero-copy, over the destination's device order (what
    `jax.device_put` does internally; jax private API, `xla_client.reorder_shards`).
    """

    name = "xla_reshard"

    def __init__(self, src_shardings: Any, dst: Any, dtype: Any):
        self.dst = dst
        self.fn = jax.jit(lambda t: _cast(t, dtype), out_shardings=dst)
        self.rewrap: dict[str, Any] = {}
        for k, s in src_shardings.items():
            d = dst[k]
            if s._internal_device_list != d._internal_device_list:
                self.rewrap[k] = _reordered_sharding(s, d)

    def _rewrapped(self, src: Any) -> Any:
        if not self.rewrap:
            return src
        from jax._src.lib import xla_client as xc

        return {
            k: xc.reorder_shards(x, self.rewrap[k], xc.ArrayCopySemantics.REUSE_INPUT)
            if k in self.rewrap
            else x
            for k, x in src.items()
        }

    def __call__(self, src: Any) -> Any:
        return self.fn(self._rewrapped(src))

    def describe(self, src: Any) -> None:
        counts = _collective_counts(self.fn.lower(self._rewrapped(src)).compile().as_text())
        self.notes = "HLO: " + (
            ", ".join(f"{k} x{v}" for k, v in counts.items()) or "no collectives"
        )


def _reordered_sharding(src: NamedSharding, dst: NamedSharding) -> NamedSharding:
    """``src``'s placement expressed over ``dst``'s device order (as jax.device_put does)."""
    from jax._src import dispatch

    mesh = Mesh(dst.mesh.devices.reshape(src.mesh.axis_sizes), src.mesh.axis_names)
    ids = dispatch._cached_logical_device_ids(
        src._internal_device_list,
        dst._internal_device_list,
    )
    return NamedSharding(mesh, src.spec, _logical_device_ids=ids)


def _collective_counts(hlo: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter"):
        n = len(re.findall(rf"= [^=]*? {op}(?:-start)?\(", hlo))
        if n:
            counts[op] = n
    return counts


class GatherSlice(Strategy):
    """All-gather to a full replica on every source device, then slice onto the destination.

    What many RL frameworks do: ``jit(identity, out_shardings=replicated on the source
    mesh)``, then per source device one jitted program cuts the destination shards it serves out
    of its replica (a destination device that holds a replica serves itself; the others are
    served round robin), `jax.device_put` copies each to its device, and
    `jax.make_array_from_single_device_arrays` assembles the result.

    ``bytes_derived`` is computed from the layouts (formula in ``formula``), not measured.
    """

    name = "gather_slice"

    def __init__(self, src_shardings: Any, dst: Any, dtype: Any, tree: Tree):
        self.dst, self.tree = dst, tree
        self.keys = list(tree.leaves)
        replicated = {k: NamedSharding(s.mesh, P()) for k, s in src_shardings.items()}
        self.gather = jax.jit(lambda t: _cast(t, dtype), out_shardings=replicated)
        itemsize = jnp.dtype(dtype if dtype is not None else tree.dtype).itemsize
        # Who serves which destination shard: (leaf, dst device) -> source device.
        self.serve: list[tuple[str, jax.Device, jax.Device, tuple[slice, ...]]] = []
        gathered = sliced = 0
        for k in self.keys:
            shape = tree.leaves[k][0]
            holders = list(src_shardings[k].mesh.devices.flat)
            nbytes = math.prod(shape) * itemsize
            for idx in src_shardings[k].devices_indices_map(shape).values():
                gathered += nbytes - _index_size(idx, shape) * itemsize
            for j, (d, idx) in enumerate(dst[k].devices_indices_map(shape).items()):
                holder = d if d in holders else holders[j % len(holders)]
                self.serve.append((k, d, holder, idx))
                if holder != d:
                    sliced += _index_size(idx, shape) * itemsize
        self.gathered_bytes, self.sliced_bytes = gathered, sliced
        self.bytes_derived = gathered + sliced
        self.slicers: dict[jax.Device, Any] = {}
        for holder in {h for _, _, h, _ in self.serve}:
            jobs = [(k, idx) for k, _, h, idx in self.serve if h == holder]
            self.slicers[holder] = (
                sorted({k for k, _ in jobs}),
                jax.jit(
                    _slicer(jobs, sorted({k for k, _ in jobs})),
                    out_shardings=SingleDeviceSharding(holder),
                ),
            )

    def __call__(self, src: Any) -> Any:
        full = self.gather(src)
        replica = {k: {s.device: s.data for s in full[k].addressable_shards} for k in self.keys}
        del full
        pieces: dict[tuple[str, jax.Device], jax.Array] = {}
        for holder, (keys, fn) in self.slicers.items():
            outs = fn(*[replica[k][holder] for k in keys])
            jobs = [(k, d) for k, d, h, _ in self.serve if h == holder]
            for (k, d), x in zip(jobs, outs, strict=True):
                pieces[k, d] = x
        del replica
        order = list(pieces)
        moved = jax.device_put([pieces[kd] for kd in order], [kd[1] for kd in order])
        del pieces
        placed = dict(zip(order, moved, strict=True))
        out = {}
        for k in self.keys:
            s = self.dst[k]
            out[k] = jax.make_array_from_single_device_arrays(
                self.tree.leaves[k][0], s, [placed[k, d] for d in s.addressable_devices]
            )
        return out


def _slicer(jobs: list[tuple[str, tuple[slice, ...]]], keys: list[str]) -> Callable[..., Any]:
    def cut(*replicas: jax.Array) -> tuple[jax.Array, ...]:
        by_key = dict(zip(keys, replicas, strict=True))
        return tuple(by_key[k][idx] for k, idx in jobs)

    return cut


def _delete(tree: Any, keep: Any = None) -> None:
    """Free ``tree``'s arrays now, except those sharing a buffer with a leaf of ``keep``: where
    a leaf's source and destination layouts are equal, `jax.device_put` and ``jit`` hand back
    the source's buffers (as the same array, or a new one over them)."""
    kept = {p for x in jax.tree_util.tree_leaves(keep) for p in _pointers(x)}
    for x in jax.tree_util.tree_leaves(tree):
        if kept.isdisjoint(_pointers(x)):
            x.delete()


def _pointers(x: jax.Array) -> set[int]:
    if x.is_deleted():
        return set()
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def _cast(tree: Any, dtype: Any) -> Any:
    return tree if dtype is None else jax.tree_util.tree_map(lambda x: x.astype(dtype), tree)


def _index_size(idx: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    return math.prod(len(range(*s.indices(n))) for s, n in zip(idx, shape, strict=True))


# ------------------------------------------------------------------------------ measuring


class _CompileClock:
    """Sums JAX's tracing, lowering and backend-compile durations while ``on``, and counts
    backend compiles (one `/jax/core/compile/backend_compile_duration` event per XLA compile).
    """

    EVENTS = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )
    BACKEND = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.on, self.total, self.compiles = False, 0.0, 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **_: Any) -> None:
        if self.on and event in self.EVENTS:
            self.total += duration
            self.compiles += event == self.BACKEND

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False


class _HostWatch:
    """Counts bytes that JAX moves through host NumPy arrays during a call.

    `jax.device_put` between different device sets falls back to pulling the array into one
    host NumPy array (``x._value``) and handing it to ``pxla.shard_args``, which copies each
    destination shard back to its device. Watching ``shard_args`` sees exactly those arrays.
    """

    @contextlib.contextmanager
    def measure(self) -> Iterator[list[int]]:
        from jax._src.interpreters import pxla

        counted = [0]
        original = pxla.shard_args

        def watched(shardings: Any, layouts: Any, copy: Any, args: Any, *a: Any, **k: Any) -> Any:
            for s, x in zip(shardings, args, strict=True):
                if isinstance(x, np.ndarray):
                    shard = math.prod(s.shard_shape(x.shape)) * x.itemsize
                    counted[0] += x.nbytes + shard * len(s.device_set)  # down, then back up
            return original(shardings, layouts, copy, args, *a, **k)

        pxla.shard_args = watched
        try:
            yield counted
        finally:
            pxla.shard_args = original


@contextlib.contextmanager
def _count_host_syncs() -> Iterator[list[int]]:
    """Counts ``jax.block_until_ready`` calls (how the runtime waits for devices) meanwhile."""
    counted = [0]
    original = jax.block_until_ready

    def counting(x: Any) -> Any:
        counted[0] += 1
        return original(x)

    jax.block_until_ready = counting
    try:
        yield counted
    finally:
        jax.block_until_ready = original


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"VmHWM:\s+(\d+) kB", f.read())
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class _RssSampler(threading.Thread):
    """Samples resident memory every ~0.2 ms until stopped; keeps the peak."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _rss()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.0002)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, _rss())
        return self.peak


def peak_rss_during(fn: Callable[[], Any]) -> tuple[Any, int, str]:
    """Run ``fn``; return its result, peak RSS beyond the RSS just before, and the method.

    Free heap memory is returned to the system first (``malloc_trim``), so pages the allocator
    kept from earlier calls do not hide this call's allocations.
    """
    gc.collect()
    _malloc_trim()
    have_hwm = os.path.exists("/proc/self/status") and _reset_hwm()
    base = _rss()
    sampler = _RssSampler()
    sampler.start()
    try:
        out = fn()
    finally:
        sampled = sampler.stop()
    if have_hwm:
        hwm = _hwm()
        if hwm is not None:
            return out, max(hwm, sampled) - base, "VmHWM"
    return out, sampled - base, "sampled statm"


def _ready(x: Any) -> Any:
    return jax.block_until_ready(x)


@jax.jit
def _equal(a: Any, b: Any) -> jax.Array:
    leaves = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x, y: jnp.all(x == y), a, b))
    return jnp.all(jnp.stack(leaves))


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    """Median wall time of ``reps`` awaited calls of ``fn`` after one untimed call."""
    _ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Memcpy:
    """A jitted copy of ``nbytes`` (spread evenly over ``devices``) into a donated buffer.

    The reference for a stage that writes ``nbytes`` on those devices: one flat read and one
    flat write per device, in place (warm pages), with nothing else in the program.
    """

    def __init__(self, devices: Sequence[jax.Device], nbytes: int) -> None:
        self.devices = list(devices)
        g = len(self.devices)
        self.words = max(1, math.ceil(nbytes / 4 / g))
        self.nbytes = 4 * self.words * g
        mesh = Mesh(np.array(self.devices), ("x",))
        s = NamedSharding(mesh, P("x"))
        shape = (g * self.words,)
        self.a = jax.jit(lambda: jnp.ones(shape, jnp.uint32), out_shardings=s)()
        self.b = jax.jit(lambda: jnp.zeros(shape, jnp.uint32), out_shardings=s)()
        self.fn = jax.jit(
            lambda a, b: lax.dynamic_update_slice(b, a, (np.int32(0),)),
            donate_argnums=1,
            out_shardings=s,
        )

    def _step(self) -> jax.Array:
        self.b = self.fn(self.a, self.b)
        return self.b

    def time(self, reps: int) -> float:
        t = _median_time(self._step, reps)
        self.a.delete()
        self.b.delete()
        return t


# ---------------------------------------------------------------------------------- results


@dataclasses.dataclass
class Result:
    """Measured figures of one strategy in one scenario (the JSON record).

    ``jr_over_this_*``: jaxreshard's time divided by this strategy's (above 1: jaxreshard is
    slower), as the median over rounds of the per-round ratio, and as median / median, both
    against jaxreshard's calls of the same interleaved pass (``paired_jr_times_s``).
    """

    strategy: str
    output: str = "fresh"
    times_s: list[float] = dataclasses.field(default_factory=list)
    min_s: float = math.nan
    median_s: float = math.nan
    max_s: float = math.nan
    paired_jr_times_s: list[float] = dataclasses.field(default_factory=list)
    jr_over_this_median_of_pairs: float | None = None
    jr_over_this_ratio_of_medians: float | None = None
    plan_s: float | None = None
    first_call_s: float = math.nan
    compile_s: float = math.nan
    compiles: int = 0
    untimed_calls: int = 0
    host_bytes: int | None = None
    host_method: str = ""
    peak_rss_bytes: int | None = None
    new_result_bytes: int = 0
    transient_bytes: int | None = None
    peak_rss_first_bytes: int | None = None
    transient_first_bytes: int | None = None
    rss_method: str = ""
    verified: bool | None = None
    notes: str = ""


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = max(total, 1), 0, enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(frac * 30)
        elapsed = time.perf_counter() - self.t0
        line = f"[{bar:<30}] {self.done:>4}/{self.total} {elapsed:6.0f}s  {label[:40]:<40}"
        sys.stderr.write(f"\r{line}" if self.tty else f"{line}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()


def _steps(scenario: Scenario, args: argparse.Namespace) -> int:
    if scenario.kind == "first_call":
        return len(args.first_call_layers)
    if scenario.kind == "one_device":
        return 3
    if scenario.kind == "async":
        return 2 + args.pairs
    # first call, warm-up, pairs, two memory calls, stage profile
    n = len(_chosen(scenario, args))
    return n * (args.warmup + 4) + max(1, 2 * (n - 1)) * args.pairs


def _chosen(scenario: Scenario, args: argparse.Namespace) -> list[str]:
    return [s for s in scenario.strategies if args.strategies is None or s in args.strategies]


def _stepper(shardings_tree: Any) -> Any:
    """An untimed "optimizer step": a new source tree in place of the old (donated) one."""
    return jax.jit(
        lambda t: jax.tree_util.tree_map(lambda x: x + 1, t),
        out_shardings=shardings_tree,
        donate_argnums=0,
    )


# ------------------------------------------------------------------------ timing scenarios


class _Bench:
    """The state of one timing scenario: sources, strategies, their results."""

    def __init__(
        self,
        scenario: Scenario,
        args: argparse.Namespace,
        devices: Sequence[jax.Device],
        clock: _CompileClock,
        progress: Progress,
    ) -> None:
        assert scenario.tree is not None
        self.scenario, self.args, self.clock, self.progress = scenario, args, clock, progress
        self.devices = devices
        self.layouts = scenario.layouts(len(devices))
        self.tree = scenario.tree(args)
        self.src_s, self.dst_s = shardings(self.tree, self.layouts, devices)
        self.sources: dict[str, Any] = {"main": make_source(self.tree, self.src_s)}
        self.steppers = {"main": _stepper(self.src_s)}
        self.references: dict[str, Any] = {}
        self.strategies = [self._make(name) for name in _chosen(scenario, args)]
        self.results = {s.name: Result(s.name, output=s.output) for s in self.strategies}
        self.dst_total = _dst_bytes(self.tree, self.dst_s, scenario.dtype)

    def _make(self, name: str) -> Strategy:
        sc, a = self.scenario, self.args
        if name == "jaxreshard":
            return JaxReshard(self.sources["main"], self.dst_s, sc.dtype, a.bucket_bytes, name)
        if name == "jaxreshard_8_leaves":
            few = matrices_tree(a.size_mib, 8, like=a.many_leaves)
            f_src, f_dst = shardings(few, self.layouts, self.devices)
            self.sources[name] = make_source(few, f_src)
            self.steppers[name] = _stepper(f_src)
            # Checked against device_put of its own source: it moves another tree.
            self.references[name] = _ready(DevicePut(f_src, f_dst, sc.dtype)(self.sources[name]))
            return JaxReshard(self.sources[name], f_dst, sc.dtype, a.bucket_bytes, name)
        if name == "device_put":
            return DevicePut(self.src_s, self.dst_s, sc.dtype)
        if name == "gather_slice":
            return GatherSlice(self.src_s, self.dst_s, sc.dtype, self.tree)
        if name == "xla_reshard":
            return XlaReshard(self.src_s, self.dst_s, sc.dtype)
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")

    def fresh_source(self, s: Strategy) -> Any:
        """Replace ``s``'s source by a new one (the untimed optimizer step)."""
        self.sources[s.source] = _ready(self.steppers[s.source](self.sources[s.source]))
        return self.sources[s.source]

    def step(self, label: str) -> None:
        self.progress.step(f"{self.scenario.name}: {label}")

    # ------------------------------------------------------------------------------ phases

    def first_calls(self) -> None:
        """Every strategy's first call on the same source (compiles), checked against
        `jax.device_put`'s result. device_put goes first, so that its reference result does
        not warm its own first call; without it, a device_put made here is the reference."""
        first = sorted(self.strategies, key=lambda s: s.name != "device_put")
        if first[0].name != "device_put":
            put = DevicePut(self.src_s, self.dst_s, self.scenario.dtype)
            self.references["main"] = _ready(put(self.sources["main"]))
        for s in first:
            r = self.results[s.name]
            s.prepare()
            if isinstance(s, JaxReshard):
                r.plan_s = s.plan_s
            before_s, before_n = self.clock.total, self.clock.compiles
            with self.clock.measure():
                t0 = time.perf_counter()
                out = _ready(s(self.sources[s.source]))
                r.first_call_s = time.perf_counter() - t0
            r.compile_s = self.clock.total - before_s
            r.compiles = self.clock.compiles - before_n
            if s.name == "device_put":
                self.references["main"] = out  # JAX's ground truth: the reference
                r.verified = None
            else:
                r.verified = bool(_equal(self.references[s.source], out))
                s.done(out, self.sources[s.source])
            r.untimed_calls = 1
            del out
            self.step(f"first call {s.name}")
        for name, ref in self.references.items():
            _delete(ref, keep=self.sources[name])
        self.references.clear()

    def warm_up(self) -> None:
        """``--warmup`` untimed calls of every strategy, interleaved, on fresh sources; the
        last one of each watched for host traffic."""
        for i in range(self.args.warmup):
            last = i == self.args.warmup - 1
            for s in self.strategies:
                src = self.fresh_source(s)
                if last:
                    out = self._watched_call(s, src)
                else:
                    out = _ready(s(src))
                s.done(out, src)
                del out
                self.results[s.name].untimed_calls += 1
                self.step(f"warm-up {s.name}")

    def _watched_call(self, s: Strategy, src: Any) -> Any:
        r = self.results[s.name]
        if isinstance(s, JaxReshard):
            # Under the transfer guard any host transfer raises: 0 bytes is then measured.
            try:
                with jax.transfer_guard("disallow"):
                    out = _ready(s(src))
                r.host_bytes, r.host_method = 0, "guard"
                return out
            except Exception as e:  # a library bug: say so, and measure by watching instead
                r.notes = f"transfer guard raised {type(e).__name__}: {str(e)[:120]}; "
                s.prev = None
        with _HostWatch().measure() as host:
            out = _ready(s(src))
        r.host_bytes, r.host_method = host[0], "watched"
        return out

    def time_pairs(self) -> None:
        """For every other strategy, ``--pairs`` rounds of it against jaxreshard, interleaved
        (J X, X J, ...), a fresh source before each call.

        Each comparison is a pass of its own, so a baseline that churns memory (gather-then-
        slice allocates gigabytes) does not slow the others it would otherwise be interleaved
        with: on CPU the allocator's state after one strategy changes the next one's time.
        jaxreshard's times of each pass are kept with that pass (``paired_jr_times_s``) and
        its ratios use them."""
        base = next((s for s in self.strategies if s.name == "jaxreshard"), None)
        others = [s for s in self.strategies if s is not base]
        passes = [[base, x] for x in others] if base is not None else [[x] for x in others]
        if base is not None and not others:
            passes = [[base]]
        for pair in passes:
            paired: list[float] = []
            for i in range(self.args.pairs):
                for s in pair if i % 2 == 0 else pair[::-1]:
                    src = self.fresh_source(s)
                    t0 = time.perf_counter()
                    out = _ready(s(src))
                    elapsed = time.perf_counter() - t0
                    self.results[s.name].times_s.append(elapsed)
                    if s is base and len(pair) > 1:
                        paired.append(elapsed)
                    s.done(out, src)
                    del out
                    self.step(f"round {i + 1} {s.name}")
            if len(pair) > 1:
                self.results[pair[1].name].paired_jr_times_s = paired

    def memory(self) -> None:
        """One call per strategy alone (trimmed heap, VmHWM reset); jaxreshard also with its
        staging pool freed first (the first call at that shape)."""
        for s in self.strategies:
            r = self.results[s.name]
            r.new_result_bytes = 0 if s.output == "donated" else self.dst_total
            src = self.fresh_source(s)
            out, peak, method = peak_rss_during(lambda s=s, src=src: _ready(s(src)))
            r.peak_rss_bytes, r.rss_method = peak, method
            r.transient_bytes = peak - r.new_result_bytes
            s.done(out, src)
            del out
            self.step(f"memory {s.name}")
            if isinstance(s, JaxReshard):
                src = self.fresh_source(s)
                s.plan.free_staging()
                _, peak, _ = peak_rss_during(lambda s=s, src=src: _ready(s(src)))
                r.peak_rss_first_bytes = peak
                r.transient_first_bytes = peak
                self.step(f"memory (first at shape) {s.name}")

    def stage_profile(self, s: JaxReshard) -> dict[str, Any]:
        """`Plan.profile` phases (median of ``--profile-reps``) against a memcpy of each
        stage's bytes on the same devices."""
        runs = []
        for _ in range(self.args.profile_reps):
            src = self.fresh_source(s)
            out, phases = s.plan.profile(src, donate=s.prev)
            s.prev = _ready(out)
            runs.append(phases)
        keys = sorted({k for p in runs for k in p}, key=_PHASES.index)
        phases = {k: statistics.median(p.get(k, 0.0) for p in runs) for k in keys}
        stages = []
        for stage, (ids, nbytes, what) in _stage_bytes(s.plan).items():
            row: dict[str, Any] = {"stage": stage, "bytes": nbytes, "devices": ids, "what": what}
            row["s"] = phases.get(stage)
            if nbytes > 0 and ids:
                by_id = {d.id: d for d in self.devices}
                ref = Memcpy([by_id[i] for i in ids], nbytes)
                row["memcpy_s"] = ref.time(self.args.profile_reps)
                row["memcpy_bytes"] = ref.nbytes
            stages.append(row)
        self.step(f"stage profile {s.name}")
        return {
            "strategy": s.name,
            "reps": self.args.profile_reps,
            "phases_s": phases,
            "stages": stages,
            "sum_s": sum(phases.values()),
            **self.verify_cost(s),
        }

    def verify_cost(self, s: JaxReshard) -> dict[str, Any]:
        """`Plan.verify` of a fresh result (median of ``--profile-reps`` after one untimed
        use, which compiles), against the refit's median in this run."""
        src = self.fresh_source(s)
        out = _ready(s.plan(src, donate=s.prev))
        s.prev = out
        verify_s = _median_time(lambda: s.plan.verify(src, out), self.args.profile_reps)
        times = self.results[s.name].times_s if s.name in self.results else []
        refit_s = statistics.median(times) if times else None
        return {"verify_s": verify_s, "verify_over_refit": verify_s / refit_s if refit_s else None}

    def plan_arithmetic(self, s: JaxReshard) -> dict[str, Any]:
        """The plan's `PlanStats` (computed, not measured), plus host syncs counted in a call."""
        src = self.fresh_source(s)
        with _count_host_syncs() as syncs:
            s.prev = s.plan(src, donate=s.prev)
        _ready(s.prev)
        st = dataclasses.asdict(s.plan.stats)
        return {
            "strategy": s.name,
            "plan_s": s.plan_s,
            **st,
            "bytes_packed": s.plan.lowered.packed_bytes,
            "bytes_kept": s.plan.lowered.kept_bytes,
            "bytes_whole": s.plan.lowered.whole_bytes,
            "host_syncs_counted": syncs[0],
            "sent_equals_lower_bound": st["bytes_sent"] == st["bytes_lower_bound"],
        }

    def summarize(self) -> None:
        base = self.results.get("jaxreshard")
        for s in self.strategies:
            r = self.results[s.name]
            r.notes = (r.notes + s.notes).strip()
            if r.times_s:
                r.min_s, r.max_s = min(r.times_s), max(r.times_s)
                r.median_s = statistics.median(r.times_s)
            if base is not None and r is not base and r.times_s and r.paired_jr_times_s:
                mine = r.paired_jr_times_s
                pairs = [a / b for a, b in zip(mine, r.times_s, strict=True)]
                r.jr_over_this_median_of_pairs = statistics.median(pairs)
                r.jr_over_this_ratio_of_medians = statistics.median(mine) / statistics.median(
                    r.times_s
                )


_PHASES = ("alloc", "pool", "pack", "transfer", "unpack")


def _stage_bytes(plan: jr.Plan) -> dict[str, tuple[list[int], int, str]]:
    """Per stage: the devices that write, the bytes they write, and what that is."""
    pieces, local = plan.assignment.pieces, plan.assignment.local
    st = plan.stats
    senders = sorted({p.src for p in pieces})
    receivers = sorted({p.dst for p in pieces})
    writers = sorted({p.dst for p in pieces} | {c.device for c in local})
    return {
        "pack": (
            sorted({*senders, *(d for s in plan.lowered.steps for d, _ in s.kept)}),
            plan.lowered.packed_bytes + plan.lowered.kept_bytes,
            "bytes packed on the senders (bytes_sent less what a sender sends twice from one "
            "buffer, plus the held parts devices pass themselves)",
        ),
        "transfer": (receivers, st.bytes_wire, "bytes_wire into the receivers"),
        "unpack": (
            writers,
            st.bytes_total - plan.lowered.whole_bytes,
            "bytes_total (received + local) on the receivers, less what whole-shard steps "
            "receive straight into the destination",
        ),
    }


def run_timing(
    scenario: Scenario,
    args: argparse.Namespace,
    devices: Sequence[jax.Device],
    clock: _CompileClock,
    progress: Progress,
) -> dict[str, Any]:
    """One timing scenario: first calls, warm-up, interleaved timing, memory, stage profile,
    plan arithmetic. A JSON-ready dict."""
    if len(devices) < 2:
        raise SystemExit(f"scenario {scenario.name!r} needs 2 or more devices")
    b = _Bench(scenario, args, devices, clock, progress)
    b.first_calls()
    b.warm_up()
    b.time_pairs()
    b.memory()
    jrs = [s for s in b.strategies if isinstance(s, JaxReshard)]
    stages = [b.stage_profile(s) for s in jrs]
    plans = [b.plan_arithmetic(s) for s in jrs]
    for s in b.strategies:
        s.describe(b.sources[s.source])
    b.summarize()
    derived = [
        {
            "strategy": s.name,
            "bytes_between_devices": s.bytes_derived,
            "formula": "all-gather: every source device receives the whole tree less its "
            f"shard ({_mib(s.gathered_bytes)} MiB), then every destination shard not on a "
            f"replica holder is copied over ({_mib(s.sliced_bytes)} MiB)",
        }
        for s in b.strategies
        if isinstance(s, GatherSlice)
    ]
    rec: dict[str, Any] = {
        "scenario": scenario.name,
        "kind": "timing",
        "family": scenario.family,
        "what": scenario.describe(args),
        "layouts": b.layouts.describe(),
        "leaves": len(b.tree.leaves),
        "bytes": b.tree.nbytes,
        "dst_bytes_total": b.dst_total,
        "src_dtype": jnp.dtype(b.tree.dtype).name,
        "dst_dtype": jnp.dtype(scenario.dtype or b.tree.dtype).name,
        "pairs": args.pairs,
        "warmup": args.warmup,
        "results": [dataclasses.asdict(b.results[s.name]) for s in b.strategies],
        "stage_profile": stages,
        "plans": plans,
        "derived_bytes": derived,
    }
    if scenario.dtype is not None and jrs:
        plain = jr.plan(b.sources["main"], b.dst_s, bucket_bytes=args.bucket_bytes)
        rec["bytes_sent_without_cast"] = plain.stats.bytes_sent
        rec["cast_halves_bytes_sent"] = 2 * jrs[0].plan.stats.bytes_sent == plain.stats.bytes_sent
    for s in jrs:
        s.prev = None
    return rec


# --------------------------------------------------------------------------- async refit


def _decode_step(mesh: Mesh) -> tuple[Callable[[jax.Array], jax.Array], jax.Array]:
    """A sampler's decode step on ``mesh``: a small jitted matmul chain, read back by the host
    after each step (as a sampler reads its tokens before dispatching the next step)."""
    axes = tuple(mesh.axis_names)
    x = jax.device_put(
        jnp.ones((64 * mesh.size, 256), jnp.float32), NamedSharding(mesh, PartitionSpec(axes))
    )
    w = jnp.full((256, 256), 0.01, jnp.float32)

    @jax.jit
    def step(v: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, 10, lambda _, y: jnp.tanh(y @ w), v)

    return step, x


def run_async(
    scenario: Scenario, args: argparse.Namespace, devices: Sequence[jax.Device], progress: Progress
) -> dict[str, Any]:
    """`Plan.start` against the synchronous call, with a sampler working meanwhile.

    Each round runs, interleaved: (a) sync: ``plan(src, donate=spare)`` awaited, then the
    sampler's work; (b) async: ``plan.start(src, donate=spare)``, the same work, then
    ``result()``. The work is a decode-like loop on the destination devices (dispatch a step,
    read it back, repeat) sized to ``--async-work`` synchronous refits when run alone. Exposed
    time = the ``start`` call + the wait in ``result``: what the loop waits on the refit.
    """
    tree = scenario.tree(args)
    layouts = scenario.layouts(len(devices))
    src_s, dst_s = shardings(tree, layouts, devices)
    src = make_source(tree, src_s)
    plan = jr.plan(src, dst_s, bucket_bytes=args.bucket_bytes)
    spare, current = plan(src), plan(src)
    _ready((spare, current))
    progress.step("async_refit: first calls")
    sync_alone = []
    for _ in range(max(3, args.warmup + 1)):
        t0 = time.perf_counter()
        spare = _ready(plan(src, donate=spare))
        sync_alone.append(time.perf_counter() - t0)
    refit_s = statistics.median(sync_alone)
    step, x = _decode_step(next(iter(dst_s.values())).mesh)
    _ready(step(x))
    one = _median_time(lambda: step(x), 5)
    n_steps = max(1, round(args.async_work * refit_s / one))

    def work() -> float:
        t0 = time.perf_counter()
        y = x
        for _ in range(n_steps):
            y = step(y)
            y.block_until_ready()
        return time.perf_counter() - t0

    work_alone = statistics.median(work() for _ in range(3))
    progress.step("async_refit: calibrated")
    rows = []
    for _ in range(args.pairs):
        t0 = time.perf_counter()
        spare = _ready(plan(src, donate=spare))
        t_sync = time.perf_counter() - t0
        w_sync = work()
        spare, current = current, spare
        t0 = time.perf_counter()
        refit = plan.start(src, donate=spare)
        t_start = time.perf_counter() - t0
        w_async = work()
        t0 = time.perf_counter()
        spare = refit.result()
        t_wait = time.perf_counter() - t0
        spare, current = current, spare
        rows.append((t_sync, w_sync, t_start, w_async, t_wait))
        progress.step("async_refit: rounds")
    same = bool(_equal(plan(src), plan.start(src).result()))
    med = [statistics.median(r[i] for r in rows) for i in range(5)]
    exposed = statistics.median(r[2] + r[4] for r in rows)
    return {
        "scenario": scenario.name,
        "kind": "async",
        "what": scenario.describe(args),
        "layouts": layouts.describe(),
        "leaves": len(tree.leaves),
        "bytes": tree.nbytes_f32,
        "pairs": args.pairs,
        "work_over_refit": args.async_work,
        "decode_steps": n_steps,
        "sync_refit_s": med[0],
        "work_alone_s": work_alone,
        "work_during_sync_s": med[1],
        "start_s": med[2],
        "work_during_async_s": med[3],
        "wait_s": med[4],
        "exposed_s": exposed,
        "exposed_over_sync": exposed / med[0],
        "iteration_sync_s": statistics.median(r[0] + r[1] for r in rows),
        "iteration_async_s": statistics.median(r[2] + r[3] + r[4] for r in rows),
        "bit_identical": same,
        "staging_bytes": plan.stats.staging_bytes,
    }


def format_async(rec: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"== {rec['scenario']}: {rec['what']}",
            f"   {rec['layouts']}; {rec['leaves']} leaves, {_mib(rec['bytes'])} MiB; "
            f"{rec['pairs']} interleaved rounds, medians; work = {rec['decode_steps']} decode "
            "steps (dispatch, read back, repeat) on the sampler devices",
            *table(
                ["", "refit (exposed)", "sampler work", "iteration"],
                [
                    [
                        "synchronous call",
                        _ms(rec["sync_refit_s"]),
                        _ms(rec["work_during_sync_s"]),
                        _ms(rec["iteration_sync_s"]),
                    ],
                    [
                        "plan.start + result",
                        f"{_ms(rec['exposed_s'])} (start {_ms(rec['start_s'])}, wait "
                        f"{_ms(rec['wait_s'])})",
                        _ms(rec["work_during_async_s"]),
                        _ms(rec["iteration_async_s"]),
                    ],
                ],
            ),
            f"   exposed / synchronous refit {rec['exposed_over_sync']:.3f}; sampler work alone "
            f"{_ms(rec['work_alone_s'])} (during the async refit it shares the CPU cores with "
            f"the transfer); results bit-identical to the call: "
            f"{'yes' if rec['bit_identical'] else 'NO'}",
        ]
    )


# ------------------------------------------------------------------------------ first call


def run_first_call(
    scenario: Scenario, args: argparse.Namespace, n_devices: int, progress: Progress
) -> dict[str, Any]:
    """Plan + compile + first move of the Llama-like tree at each ``--first-call-layers``,
    each in a fresh child process (no compile cache, no warm JAX caches)."""
    rows, failed = [], []
    with tempfile.TemporaryDirectory(prefix="jaxreshard-first-call-") as tmp:
        for layers in args.first_call_layers:
            path = os.path.join(tmp, f"{layers}.json")
            cmd = [*_self_cmd(), "--first-call-child", str(layers), "--json", path]
            cmd += [*_common_args(args), "--devices", str(n_devices)]
            ok, error = _run_with_retries(cmd, f"first_call {layers} layers", args.attempts)
            if ok:
                with open(path) as f:
                    rows.append(json.load(f))
            else:
                failed.append({"layers": layers, "error": error})
            progress.step(f"first_call: {layers} layers")
    return {
        "scenario": scenario.name,
        "kind": "first_call",
        "what": scenario.describe(args),
        "layouts": first_call_layouts(n_devices).describe(),
        "dst_dtype": "bfloat16",
        "rows": rows,
        "failed": failed,
        "note": "one device: source and destination on the same device, so nothing is sent; "
        "this times planning and compiling the local-copy (unpack) programs, no pack or transfer"
        if n_devices == 1
        else "",
    }


def first_call_child(args: argparse.Namespace, layers: int, devices: Sequence[jax.Device]) -> None:
    """In a fresh process: time plan, first call and jax.device_put's first call; count
    programs and XLA compiles. Writes one JSON row to ``--json``."""
    jax.config.update("jax_enable_compilation_cache", False)  # nothing from earlier runs
    tree = llama_tree(layers, args.first_call_d, args.first_call_mlp, args.first_call_vocab)
    src_s, dst_s = shardings(tree, first_call_layouts(len(devices)), devices)
    src = _ready(make_source(tree, src_s))  # compiles the makers: JAX is warm before timing
    clock = _CompileClock()
    with clock.measure():
        t0 = time.perf_counter()
        plan = jr.plan(src, dst_s, dtype=jnp.bfloat16, bucket_bytes=args.bucket_bytes)
        plan_s = time.perf_counter() - t0
        out = _ready(plan(src))
        first_s = time.perf_counter() - t0
    jr_compiles, jr_compile_s = clock.compiles, clock.total
    t0 = time.perf_counter()
    out = _ready(plan(src, donate=out))
    second_s = time.perf_counter() - t0
    clock.total, clock.compiles = 0.0, 0
    put = DevicePut(src_s, dst_s, jnp.bfloat16)
    with clock.measure():
        t0 = time.perf_counter()
        ref = _ready(put(src))
        put_s = time.perf_counter() - t0
    row = {
        "layers": layers,
        "leaves": len(tree.leaves),
        "bytes": tree.nbytes_f32,
        "plan_s": plan_s,
        "first_call_s": first_s,  # plan + compile + move
        "call_after_plan_s": first_s - plan_s,
        "second_call_s": second_s,
        "programs": plan.stats.programs,
        "dispatches": plan.stats.dispatches,
        "buckets": plan.stats.buckets,
        "xla_compiles": jr_compiles,
        "compile_s": jr_compile_s,
        "device_put_first_call_s": put_s,
        "device_put_xla_compiles": clock.compiles,
        "verified": bool(_equal(ref, out)),
    }
    _write(args.json, row)


# ------------------------------------------------------------------------------ one device


def _shard_shape(shape: tuple[int, ...], spec: PartitionSpec, axes: dict[str, int]) -> tuple:
    """The shard shape of ``shape`` under ``spec`` on a mesh of ``axes`` sizes (no devices)."""
    out = []
    for i, n in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(n // math.prod(axes[a] for a in names))
    return tuple(out)


def _blocks(shard: tuple[int, ...], piece: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Start offsets of the ``piece``-shaped blocks that tile ``shard``."""
    return list(itertools.product(*(range(0, s, p) for s, p in zip(shard, piece, strict=True))))


def bench_shard_shapes(tree: Tree) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple]]:
    """Per leaf of ``tree`` under the 8-device ``disjoint`` layouts: (source shard, destination
    shard, piece) shapes, where a piece is what one sender sends one receiver (the layouts
    split by powers of two, so the intersection of two shards is the smaller extent per
    dimension)."""
    lay = disjoint_layouts(N_DEVICES)
    src_axes = dict(zip(lay.src_mesh[1], lay.src_mesh[0], strict=True))
    dst_axes = dict(zip(lay.dst_mesh[1], lay.dst_mesh[0], strict=True))
    out = []
    for shape, role in tree.leaves.values():
        a = _shard_shape(shape, lay.src_specs[role], src_axes)
        b = _shard_shape(shape, lay.dst_specs[role], dst_axes)
        out.append((a, b, tuple(min(x, y) for x, y in zip(a, b, strict=True))))
    return out


def _pack_kernel(shapes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> Callable:
    """(source shard, piece) per leaf -> fn(staging, *shards): every piece of every shard cut
    out (a strided slice) and written flat into the donated staging buffer, as pack does."""

    def pack(staging: jax.Array, *shards: jax.Array) -> jax.Array:
        offset = 0
        for x, (shard, piece) in zip(shards, shapes, strict=True):
            for start in _blocks(shard, piece):
                end = tuple(s + p for s, p in zip(start, piece, strict=True))
                flat = lax.slice(x, start, end).reshape(-1)
                staging = lax.dynamic_update_slice(staging, flat, (np.int32(offset),))
                offset += flat.size
        return staging

    return jax.jit(pack, donate_argnums=0)


def _unpack_kernel(shapes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> Callable:
    """(destination shard, piece) per leaf -> fn(staging, *shards): every piece read flat from
    staging and written into its place in the donated destination shard, as unpack does."""

    def unpack(staging: jax.Array, *shards: jax.Array) -> tuple[jax.Array, ...]:
        out, offset = [], 0
        for x, (shard, piece) in zip(shards, shapes, strict=True):
            n = math.prod(piece)
            for start in _blocks(shard, piece):
                part = lax.slice(staging, (offset,), (offset + n,)).reshape(piece)
                x = lax.dynamic_update_slice(x, part, tuple(np.int32(s) for s in start))
                offset += n
            out.append(x)
        return tuple(out)

    return jax.jit(unpack, donate_argnums=tuple(range(1, len(shapes) + 1)))


def run_one_device(
    scenario: Scenario, args: argparse.Namespace, device: jax.Device, progress: Progress
) -> dict[str, Any]:
    """What one device can measure: pack- and unpack-shaped kernels at the bench's shard
    shapes, and the library's all-local plan, each against a memcpy of its bytes."""
    assert scenario.tree is not None
    tree = scenario.tree(args)
    shapes = bench_shard_shapes(tree)
    reps = max(3, args.profile_reps)
    on = SingleDeviceSharding(device)

    def filled(shape: tuple[int, ...]) -> jax.Array:  # made on the device, no host copy
        return jax.jit(lambda: jnp.ones(shape, jnp.float32), out_shardings=on)()

    kernels = []
    # One sender's pack: its source shards cut into pieces, written flat.
    src_pieces = [(a, p) for a, _, p in shapes]
    pack_bytes = 4 * sum(math.prod(a) for a, _ in src_pieces)
    shards = [filled(a) for a, _ in src_pieces]
    staging = [filled((pack_bytes // 4,))]
    pack = _pack_kernel(src_pieces)

    def run_pack() -> jax.Array:
        staging[0] = pack(staging[0], *shards)
        return staging[0]

    kernels.append(("pack", pack_bytes, _median_time(run_pack, reps)))
    # One receiver's unpack: its destination shards written from flat pieces.
    dst_pieces = [(b, p) for _, b, p in shapes]
    unpack_bytes = 4 * sum(math.prod(b) for b, _ in dst_pieces)
    targets = [filled(b) for b, _ in dst_pieces]
    flat = filled((unpack_bytes // 4,))
    unpack = _unpack_kernel(dst_pieces)

    def run_unpack() -> tuple[jax.Array, ...]:
        targets[:] = unpack(flat, *targets)
        return tuple(targets)

    kernels.append(("unpack", unpack_bytes, _median_time(run_unpack, reps)))
    for x in (*shards, *staging, *targets, flat):
        x.delete()
    rows = []
    for name, nbytes, t in kernels:
        rows.append(
            {
                "kernel": name,
                "bytes": nbytes,
                "s": t,
                "memcpy_s": Memcpy([device], nbytes).time(reps),
            }
        )
    progress.step("one_device: kernels")
    # The library on one device: every byte is a local copy (no pack, no transfer).
    layouts = one_device_layouts(1)
    src_s, dst_s = shardings(tree, layouts, [device])
    src = make_source(tree, src_s)
    t0 = time.perf_counter()
    plan = jr.plan(src, dst_s, bucket_bytes=args.bucket_bytes)
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = _ready(plan(src))
    first_s = time.perf_counter() - t0
    box = [out]

    def call() -> Any:
        box[0] = plan(src, donate=box[0])
        return box[0]

    call_s = _median_time(call, reps)
    runs = []
    for _ in range(reps):
        box[0], phases = plan.profile(src, donate=box[0])
        runs.append(phases)
    phases = {k: statistics.median(p.get(k, 0.0) for p in runs) for k in runs[0]}
    progress.step("one_device: all-local plan")
    local = {
        "plan_s": plan_s,
        "first_call_s": first_s,
        "call_s": call_s,
        "phases_s": phases,
        "bytes_local": plan.stats.bytes_local,
        "bytes_sent": plan.stats.bytes_sent,
        "programs": plan.stats.programs,
        "memcpy_s": Memcpy([device], plan.stats.bytes_total).time(reps),
        "verified": bool(_equal(jax.device_put(src, dst_s), box[0])),
    }
    progress.step("one_device: memcpy")
    return {
        "scenario": scenario.name,
        "kind": "one_device",
        "what": scenario.describe(args),
        "device": str(device),
        "leaves": len(tree.leaves),
        "bytes": tree.nbytes_f32,
        "kernels": rows,
        "kernels_note": "kernels written in the bench with the runtime's structure (strided "
        "slice -> flat staging; flat -> dynamic_update_slice into a donated shard), fp32, one "
        "sender's and one receiver's shards of the 8-device disjoint layouts; not the "
        "library's compiled programs",
        "all_local_plan": local,
        "all_local_note": "the library's plan between two layouts of one device: everything is "
        "a local copy by unpack programs (no pack, no transfer)",
    }


# ---------------------------------------------------------------------------------- output


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def _ms(t: float | None) -> str:
    if t is None or math.isnan(t):
        return "-"
    return f"{t * 1e3:.2f}" if t < 0.01 else f"{t * 1e3:.1f}"


def _s(t: float | None) -> str:
    return "-" if t is None or math.isnan(t) else f"{t:.2f}"


def _x(r: float | None) -> str:
    return "-" if r is None or math.isnan(r) else f"{r:.2f}"


def _gbs(nbytes: int | None, t: float | None) -> str:
    return "-" if not nbytes or not t else f"{nbytes / t / 1e9:.2f}"


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    align: str = "",
    indent: str = "   ",
) -> list[str]:
    """Aligned columns under a rule. ``align`` has one letter per column, ``l`` or ``r``
    (default: the first column left, the others right: names, then numbers)."""
    align = align or "l" + "r" * (len(headers) - 1)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.ljust(w) if a == "l" else c.rjust(w)
            for c, w, a in zip(cells, widths, align, strict=True)
        ]
        return indent + "  ".join(padded).rstrip()

    return [line(headers), indent + "-" * (sum(widths) + 2 * (len(widths) - 1)), *map(line, rows)]


def format_record(rec: dict[str, Any]) -> str:
    if rec.get("kind") == "first_call":
        return format_first_call(rec)
    if rec.get("kind") == "one_device":
        return format_one_device(rec)
    if rec.get("kind") == "async":
        return format_async(rec)
    return format_scenario(rec)


def format_scenario(rec: dict[str, Any]) -> str:
    """The tables of one timing scenario: measured, stage profile, plan arithmetic."""
    lines = [
        f"== {rec['scenario']}: {rec['what']}",
        f"   {rec['layouts']}; {rec['leaves']} leaves, {_mib(rec['bytes'])} MiB fp32 source, "
        f"destination {_mib(rec['dst_bytes_total'])} MiB {rec['dst_dtype']} over its devices",
        f"   measured: wall time of whole calls, {rec['pairs']} interleaved rounds after "
        f"{rec['warmup'] + 1} untimed calls each, fresh source before every call",
    ]
    ok = {True: "yes", False: "NO", None: "ref"}
    times = [
        [
            r["strategy"],
            r["output"],
            _ms(r["min_s"]),
            _ms(r["median_s"]),
            _ms(r["max_s"]),
            _x(r["jr_over_this_median_of_pairs"]),
            _x(r["jr_over_this_ratio_of_medians"]),
            _s(r["plan_s"]),
            _s(r["first_call_s"]),
            _s(r["compile_s"]),
            str(r["compiles"]),
            ok[r["verified"]],
        ]
        for r in rec["results"]
    ]
    lines += table(
        [
            "strategy",
            "output",
            "min ms",
            "median ms",
            "max ms",
            "jr/x pairs",
            "jr/x medians",
            "plan s",
            "1st call s",
            "compile s",
            "compiles",
            "= device_put",
        ],
        times,
        "llrrrrrrrrrr",
    )
    memory = [
        [
            r["strategy"],
            _mib(r["host_bytes"]),
            r["host_method"] or "-",
            _mib(r["peak_rss_bytes"]),
            _mib(r["transient_bytes"]),
            _mib(r["transient_first_bytes"]),
            r["notes"],
        ]
        for r in rec["results"]
    ]
    lines += table(
        [
            "strategy",
            "host MiB",
            "host how",
            "peak MiB",
            "transient MiB",
            "1st-shape transient MiB",
            "notes",
        ],
        memory,
        "lrlrrrl",
    )
    for st in rec["stage_profile"]:
        lines += _format_stages(st)
    lines += _format_plans(rec["plans"])
    for d in rec["derived_bytes"]:
        lines.append(
            f"   derived (not measured) {d['strategy']}: {_mib(d['bytes_between_devices'])} MiB "
            f"between devices = {d['formula']}"
        )
    if "cast_halves_bytes_sent" in rec:
        lines.append(
            f"   cast (plan arithmetic): {_mib(rec['plans'][0]['bytes_sent'])} MiB sent vs "
            f"{_mib(rec['bytes_sent_without_cast'])} MiB for the same plan without the cast "
            f"(exactly half: {rec['cast_halves_bytes_sent']})"
        )
    return "\n".join(lines)


def _format_stages(st: dict[str, Any]) -> list[str]:
    rows = []
    for phase in ("alloc", "pool"):
        if phase in st["phases_s"]:
            rows.append([phase, _ms(st["phases_s"][phase]), "-", "-", "-", "-", "-", ""])
    for row in st["stages"]:
        mem = row.get("memcpy_s")
        ratio = None if mem is None or row["s"] is None else row["s"] / mem
        rows.append(
            [
                row["stage"],
                _ms(row["s"]),
                _mib(row["bytes"]),
                _gbs(row["bytes"], row["s"]),
                _ms(mem),
                _gbs(row.get("memcpy_bytes"), mem),
                _x(ratio),
                f"{row['what']} ({len(row['devices'])} devices)",
            ]
        )
    rows.append(["sum", _ms(st["sum_s"]), "", "", "", "", "", "phases awaited one by one"])
    lines = [
        f"   stage profile of {st['strategy']} (Plan.profile, median of {st['reps']}) vs a "
        "memcpy of each stage's bytes",
        *table(
            ["stage", "ms", "MiB", "GB/s", "memcpy ms", "memcpy GB/s", "x memcpy", "bytes"],
            rows,
            "lrrrrrrl",
        ),
    ]
    if st.get("verify_s") is not None:
        ratio = st.get("verify_over_refit")
        lines.append(
            f"   plan.verify (checksums of source and result on device, median of {st['reps']}): "
            f"{_ms(st['verify_s']).strip()} ms"
            + ("" if ratio is None else f" = {ratio:.2f}x the refit's median")
        )
    return lines


def _format_plans(plans: Sequence[dict[str, Any]]) -> list[str]:
    """Plan arithmetic: what `PlanStats` computes from the layouts (nothing here is timed),
    and the host syncs counted in one call beside the count the stats report."""
    if not plans:
        return []
    bytes_rows = [
        [
            p["strategy"],
            _mib(p["bytes_total"]),
            _mib(p["bytes_local"]),
            _mib(p["bytes_lower_bound"]),
            _mib(p["bytes_sent"]),
            _mib(p["bytes_wire"]),
            "yes" if p["sent_equals_lower_bound"] else "NO",
        ]
        for p in plans
    ]
    schedule_rows = [
        [
            p["strategy"],
            str(p["rounds"]),
            str(p["buckets"]),
            _mib(p["chunk_bytes"]),
            _mib(p["staging_bytes"]),
            str(p["programs"]),
            str(p["dispatches"]),
            str(p["host_syncs"]),
            str(p["host_syncs_counted"]),
        ]
        for p in plans
    ]
    return [
        "   plan arithmetic (PlanStats, computed from the layouts: not measured)",
        *table(
            ["plan", "total MiB", "local MiB", "bound MiB", "sent MiB", "wire MiB", "sent = bound"],
            bytes_rows,
        ),
        *table(
            [
                "plan",
                "rounds",
                "buckets",
                "chunk MiB",
                "staging MiB/device",
                "programs",
                "dispatches/call",
                "host syncs",
                "counted",
            ],
            schedule_rows,
        ),
    ]


def format_first_call(rec: dict[str, Any]) -> str:
    rows = [
        [
            str(r["layers"]),
            str(r["leaves"]),
            _mib(r["bytes"]),
            _s(r["plan_s"]),
            _s(r["first_call_s"]),
            _s(r["compile_s"]),
            str(r["programs"]),
            str(r["xla_compiles"]),
            _ms(r["second_call_s"]),
            _s(r["device_put_first_call_s"]),
            str(r["device_put_xla_compiles"]),
            {True: "yes", False: "NO"}[r["verified"]],
        ]
        for r in rec["rows"]
    ]
    lines = [
        f"== first_call: {rec['what']}",
        f"   {rec['layouts']}; first call = plan + compile + move, measured in a fresh process",
        *table(
            [
                "layers",
                "leaves",
                "MiB fp32",
                "plan s",
                "first call s",
                "compile s",
                "programs",
                "XLA compiles",
                "2nd call ms",
                "device_put 1st s",
                "its compiles",
                "= device_put",
            ],
            rows,
        ),
        "   programs: plan.stats.programs; XLA compiles: backend_compile events during plan + "
        "first call (staging, tables and destinations included)",
    ]
    if rec.get("note"):
        lines.append(f"   {rec['note']}")
    lines += [f"   FAILED {f['layers']} layers: {f['error']}" for f in rec["failed"]]
    return "\n".join(lines)


def format_one_device(rec: dict[str, Any]) -> str:
    rows = [
        [
            k["kernel"],
            _mib(k["bytes"]),
            _ms(k["s"]),
            _gbs(k["bytes"], k["s"]),
            _ms(k["memcpy_s"]),
            _gbs(k["bytes"], k["memcpy_s"]),
            _x(k["s"] / k["memcpy_s"] if k["memcpy_s"] else None),
        ]
        for k in rec["kernels"]
    ]
    loc = rec["all_local_plan"]
    lines = [
        f"== one_device on {rec['device']}: {rec['leaves']} leaves, {_mib(rec['bytes'])} MiB",
        f"   {rec['kernels_note']}",
        *table(["kernel", "MiB", "ms", "GB/s", "memcpy ms", "memcpy GB/s", "x memcpy"], rows),
        f"   {rec['all_local_note']}:",
        *table(
            [
                "plan s",
                "first call s",
                "call ms",
                "unpack ms (profile)",
                "memcpy ms",
                "local MiB",
                "programs",
                "= device_put",
            ],
            [
                [
                    _s(loc["plan_s"]),
                    _s(loc["first_call_s"]),
                    _ms(loc["call_s"]),
                    _ms(loc["phases_s"].get("unpack")),
                    _ms(loc["memcpy_s"]),
                    _mib(loc["bytes_local"]),
                    str(loc["programs"]),
                    {True: "yes", False: "NO"}[loc["verified"]],
                ]
            ],
        ),
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------- targets


def targets(records: Sequence[dict[str, Any]], platform_name: str = "cpu") -> list[dict]:
    """The project's performance targets, checked against this run (goals, not tests).

    Speed targets use the ratio of medians; byte targets are plan arithmetic."""
    timing = {r["scenario"]: r for r in records if r.get("kind", "timing") == "timing"}
    out: list[dict[str, Any]] = []

    def add(goal: str, value: float | None, limit: float, unit: str = "x", why: str = "") -> None:
        met = None if value is None else value <= limit
        out.append(
            {"goal": goal, "value": value, "limit": limit, "unit": unit, "met": met, "why": why}
        )

    def ratio(scn: str, other: str) -> float | None:
        r = {x["strategy"]: x for x in timing.get(scn, {}).get("results", [])}.get(other)
        return None if r is None else r["jr_over_this_ratio_of_medians"]

    family = [n for n, r in timing.items() if r.get("family") == "disjoint"]
    for name in family or ["disjoint"]:
        add(
            f"disjoint speed ({name}): jaxreshard <= 1.5x device_put",
            ratio(name, "device_put"),
            1.5,
        )
    add(
        "colocated speed: jaxreshard <= 0.5x XLA's own reshard",
        ratio("colocated", "xla_reshard"),
        0.5,
    )
    many = timing.get("many_leaves", {}).get("leaves", "many")
    add(
        f"many-leaf overhead: jaxreshard ({many} leaves) <= 1.0x device_put",
        ratio("many_leaves", "device_put"),
        1.0,
    )
    add(
        f"many-leaf overhead: {many} leaves <= 1.2x the same bytes in 8 leaves",
        ratio("many_leaves", "jaxreshard_8_leaves"),
        1.2,
    )
    add(
        "small leaves: jaxreshard <= 1.0x device_put (norm scales and biases alone)",
        ratio("small_leaves", "device_put"),
        1.0,
    )
    add(
        "LoRA adapters: jaxreshard <= 1.5x device_put (many leaves of tens of KiB)",
        ratio("lora", "device_put"),
        1.5,
    )
    for name in family or ["disjoint"]:
        st = next(iter(timing.get(name, {}).get("stage_profile", [])), None)
        add(
            f"verify ({name}): plan.verify <= 0.1x the refit",
            st.get("verify_over_refit") if st else None,
            0.1,
        )
    asy = next((r for r in records if r.get("kind") == "async"), None)
    add(
        "async refit: exposed time (start + wait in result) <= 0.2x the synchronous refit, "
        f"with {asy['work_over_refit'] if asy else 3:g}x its time of sampler work between",
        asy["exposed_over_sync"] if asy else None,
        0.2,
    )
    fc = next((r for r in records if r.get("kind") == "first_call"), None)
    by_layers = {row["layers"]: row for row in (fc or {}).get("rows", [])}
    ls = sorted(by_layers)
    top = ls[-1] if ls else 32
    ref = ls[-2] if len(ls) > 1 else 8
    add(
        f"first call: {top}-layer tree <= 3 s (plan + compile + move)",
        by_layers[top]["first_call_s"] if top in by_layers else None,
        3.0,
        "s",
    )
    add(
        f"first call: {top}-layer tree <= 1.5x the {ref}-layer tree",
        by_layers[top]["first_call_s"] / by_layers[ref]["first_call_s"]
        if top in by_layers and ref in by_layers
        else None,
        1.5,
    )
    big = timing.get("big_leaf")
    jrr = next((r for r in (big or {}).get("results", []) if r["strategy"] == "jaxreshard"), None)
    value, why = None, ""
    if platform_name != "cpu":
        why = "host memory only on accelerators"
    elif jrr is not None and jrr["transient_first_bytes"] is not None:
        value = max(jrr["transient_first_bytes"], jrr["transient_bytes"] or 0) / big["bytes"]
    add(
        "big-leaf memory: peak transient <= 0.25 of a replica (first call at that shape)",
        value,
        0.25,
        "of a replica",
        why,
    )
    for name, rec in timing.items():
        for p in rec["plans"]:
            out.append(
                {
                    "goal": f"bytes ({name}, {p['strategy']}): bytes_sent == bytes_lower_bound "
                    "(plan arithmetic)",
                    "met": p["sent_equals_lower_bound"],
                    "value": p["bytes_sent"] / MiB,
                    "unit": "MiB",
                }
            )
    if "cast" in timing and "cast_halves_bytes_sent" in timing["cast"]:
        c = timing["cast"]
        out.append(
            {
                "goal": "cast: bf16 plan sends exactly half of the fp32 plan (plan arithmetic)",
                "met": c["cast_halves_bytes_sent"],
                "value": c["plans"][0]["bytes_sent"] / max(1, c["bytes_sent_without_cast"]),
                "unit": "of fp32",
            }
        )
    return out


def format_targets(ts: Sequence[dict[str, Any]]) -> str:
    lines = [
        "== targets (goals, not tests; speed = ratio of medians of whole calls, n/a = not run)"
    ]
    rows = []
    for t in ts:
        met = {True: "met", False: "NOT MET", None: "n/a"}[t["met"]]
        value = t.get("value")
        shown = "-" if value is None else f"{value:.2f} {t.get('unit', '')}".strip()
        if t.get("why"):
            shown += f" ({t['why']})"
        rows.append([met, t["goal"], shown])
    lines += table(["status", "target", "measured"], rows, "llr")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- main


def _layer_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive layer counts")
    return values


MIN_BUCKET_BYTES = 4096
"""The smallest ``--bucket-bytes`` taken: below it a transfer of a few MiB splits into so many
rounds that a run takes many minutes (jaxreshard itself takes any size from 1 byte)."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxreshard.bench",
        description="Benchmark jaxreshard against jax.device_put, gather-then-slice and XLA's "
        "own reshard on the default backend's devices (8 simulated CPU devices on CPU).",
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=list(SCENARIOS),
        help="run only this scenario (repeatable); default: all that fit the devices",
    )
    p.add_argument(
        "--strategies",
        type=lambda s: s.split(","),
        default=None,
        help=f"comma-separated subset of {','.join(STRATEGIES)} (default: all that apply)",
    )
    p.add_argument("--pairs", type=int, default=10, help="interleaved timing rounds (>= 10)")
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed calls of every strategy after its first"
    )
    p.add_argument(
        "--profile-reps", type=int, default=3, help="Plan.profile and memcpy repetitions"
    )
    p.add_argument(
        "--bucket-bytes",
        type=int,
        default=None,
        help="jaxreshard's staging limit per device, in bytes: at least "
        f"{MIN_BUCKET_BYTES} (default: jr.default_bucket_bytes)",
    )
    p.add_argument("--size-mib", type=float, default=256.0, help="size of the GPT tree (> 0)")
    p.add_argument("--layers", type=int, default=8, help="blocks of the GPT tree (10 leaves each)")
    p.add_argument("--gpt-d", type=int, default=1024, help="d_model of the disjoint_gpt32k trees")
    p.add_argument("--gpt-layers", type=int, default=6, help="blocks of the disjoint_gpt32k trees")
    p.add_argument("--gpt-vocab", type=int, default=32768, help="vocabulary of disjoint_gpt32k")
    p.add_argument(
        "--many-leaves", type=int, default=1024, help="leaves of many_leaves (a multiple of 8)"
    )
    p.add_argument(
        "--small-leaves-layers",
        type=int,
        default=96,
        help="blocks whose 6 small leaves make small_leaves",
    )
    p.add_argument(
        "--lora-layers", type=int, default=28, help="blocks whose LoRA adapters make lora"
    )
    p.add_argument("--lora-rank", type=int, default=16, help="rank of lora's adapters")
    p.add_argument(
        "--big-leaf-mib", type=float, default=1024.0, help="size of big_leaf's one matrix"
    )
    p.add_argument(
        "--first-call-layers",
        type=_layer_list,
        default=[2, 8, 32],
        help="layer counts of the first_call tree (default 2,8,32)",
    )
    p.add_argument(
        "--async-work",
        type=float,
        default=3.0,
        help="async_refit: the sampler's work between start and result, in synchronous refits",
    )
    p.add_argument("--first-call-d", type=int, default=256, help="d_model of the first_call tree")
    p.add_argument("--first-call-mlp", type=int, default=688, help="mlp width of first_call")
    p.add_argument("--first-call-vocab", type=int, default=32000, help="vocabulary of first_call")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help=f"use this many devices (default: all, up to {N_DEVICES}; scaled to a power of 2)",
    )
    p.add_argument(
        "--json", metavar="PATH", type=writable_path, help="also write every figure as JSON here"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run every scenario in this process (default: one child process per scenario)",
    )
    p.add_argument(
        "--attempts",
        type=int,
        default=3,
        help="runs of a child process that aborts before it is reported as failed",
    )
    p.add_argument("--quiet-header", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--first-call-child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pairs < 1 or args.warmup < 1 or args.profile_reps < 1:
        p.error("--pairs, --warmup and --profile-reps must be at least 1")
    if args.many_leaves < 8 or args.many_leaves % 8:
        p.error("--many-leaves must be a positive multiple of 8")
    if args.devices is not None and args.devices < 1:
        p.error("--devices must be at least 1")
    if args.bucket_bytes is not None and not MIN_BUCKET_BYTES <= args.bucket_bytes <= 1 << 48:
        p.error(
            f"--bucket-bytes must be {MIN_BUCKET_BYTES} (4 KiB) to 2**48 bytes, got "
            f"{args.bucket_bytes} (smaller buckets split a transfer into so many rounds that "
            "a run of a few MiB takes many minutes)"
        )

    def value(flag: str) -> Any:
        return getattr(args, flag[2:].replace("-", "_"))

    for flag in ("--size-mib", "--big-leaf-mib"):
        if not (math.isfinite(value(flag)) and value(flag) > 0):
            p.error(f"{flag} must be a positive number of MiB, got {value(flag):g}")
    if not (math.isfinite(args.async_work) and args.async_work >= 0):
        p.error(f"--async-work must be 0 or more, got {args.async_work:g}")
    for flag in (
        *("--layers", "--gpt-d", "--gpt-layers", "--gpt-vocab", "--small-leaves-layers"),
        *("--lora-layers", "--lora-rank"),
        *("--first-call-d", "--first-call-mlp", "--first-call-vocab", "--attempts"),
    ):
        if value(flag) < 1:
            p.error(f"{flag} must be at least 1, got {value(flag)}")
    if args.strategies is not None:
        bad = [s for s in args.strategies if s not in STRATEGIES]
        if bad:
            p.error(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
    return args


def _common_args(args: argparse.Namespace) -> list[str]:
    """The options a child process needs to measure what this process would."""
    out = [
        *("--pairs", str(args.pairs), "--warmup", str(args.warmup)),
        *("--profile-reps", str(args.profile_reps), "--size-mib", str(args.size_mib)),
        *("--layers", str(args.layers), "--many-leaves", str(args.many_leaves)),
        *("--small-leaves-layers", str(args.small_leaves_layers)),
        *("--lora-layers", str(args.lora_layers), "--lora-rank", str(args.lora_rank)),
        *("--big-leaf-mib", str(args.big_leaf_mib), "--gpt-d", str(args.gpt_d)),
        *("--gpt-layers", str(args.gpt_layers), "--gpt-vocab", str(args.gpt_vocab)),
        *("--first-call-layers", ",".join(map(str, args.first_call_layers))),
        *("--first-call-d", str(args.first_call_d), "--first-call-mlp", str(args.first_call_mlp)),
        *("--first-call-vocab", str(args.first_call_vocab), "--attempts", str(args.attempts)),
    ]
    if args.bucket_bytes:
        out += ["--bucket-bytes", str(args.bucket_bytes)]
    if args.strategies:
        out += ["--strategies", ",".join(args.strategies)]
    if args.no_progress:
        out.append("--no-progress")
    return out


def _self_cmd() -> list[str]:
    return [sys.executable, "-m", "jaxreshard.bench"]


def configure_backend(argv: Sequence[str] | None) -> None:
    """On the CPU backend, ask XLA for 8 host devices; on any other backend change nothing.

    Only the benchmark's entry point calls this (importing this module changes nothing). With
    ``JAX_PLATFORMS=cpu`` the flag is set before the backend starts; otherwise JAX starts
    its default backend, and if that is CPU with fewer than 8 devices the command runs again
    with the flag (from the command line only: a caller's process is never replaced).
    """
    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    if _HOST_FLAG in flags or xla_bridge.backends_are_initialized():
        return
    first = (os.environ.get("JAX_PLATFORMS") or "").split(",")[0].strip()
    if first == "cpu":
        os.environ["XLA_FLAGS"] = f"{flags} {_HOST_FLAG}={N_DEVICES}".strip()
        return
    if first or jax.default_backend() != "cpu" or len(jax.devices()) >= N_DEVICES:
        return
    if argv is None and not os.environ.get(_REEXEC_MARK):
        env = dict(os.environ, XLA_FLAGS=f"{flags} {_HOST_FLAG}={N_DEVICES}".strip())
        env[_REEXEC_MARK] = "1"
        sys.stdout.flush()
        os.execve(sys.executable, [*_self_cmd(), *sys.argv[1:]], env)


def _devices(args: argparse.Namespace) -> list[jax.Device]:
    """The devices to use: ``--devices`` or all (at most 8), rounded down to a power of two."""
    available = jax.devices()
    n = min(args.devices or N_DEVICES, len(available))
    return available[: 1 << (n.bit_length() - 1)]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the tables; return (and optionally write) the JSON record.

    With several scenarios, each runs in its own child process (``--in-process`` turns this
    off): XLA's own reshard program (`jax.device_put` or ``jit`` between two orders of the
    same CPU devices) deadlocks now and then in XLA's in-process CPU collectives, and XLA
    then aborts the whole process after 40 s. A scenario that aborts is run again, up to
    ``--attempts`` times, then reported as failed; the others still run. ``first_call``
    always runs each layer count in a child process of its own (a fresh process is what it
    measures).
    """
    args = parse_args(argv)
    configure_backend(argv)
    devices = _devices(args)
    if args.first_call_child is not None:
        first_call_child(args, args.first_call_child, devices)
        return {}
    names = args.scenario or default_scenarios(len(devices))
    if len(names) > 1 and not args.in_process:
        return _run_children(args, names, devices)
    if args.pairs < 10 and not args.quiet_header:
        print(f"note: --pairs {args.pairs} < 10: figures are indicative only", file=sys.stderr)
    clock = _CompileClock()
    progress = Progress(
        sum(_steps(SCENARIOS[n], args) for n in names), enabled=not args.no_progress
    )
    header = _header(args, devices)
    if not args.quiet_header:
        _print_header(header)
    records: list[dict[str, Any]] = []
    try:
        for name in names:
            rec = run_scenario(SCENARIOS[name], args, devices, clock, progress)
            records.append(rec)
            progress.close()
            print(format_record(rec), flush=True)
            # Written after every scenario: an abort in XLA keeps what was measured.
            _write(args.json, {"config": header, "scenarios": records, "complete": False})
    finally:
        progress.close()
    return _finish(args, header, records, [])


def run_scenario(
    scenario: Scenario,
    args: argparse.Namespace,
    devices: Sequence[jax.Device],
    clock: _CompileClock,
    progress: Progress,
) -> dict[str, Any]:
    if scenario.kind == "first_call":
        return run_first_call(scenario, args, len(devices), progress)
    if scenario.kind == "one_device":
        return run_one_device(scenario, args, devices[0], progress)
    if scenario.kind == "async":
        return run_async(scenario, args, devices, progress)
    return run_timing(scenario, args, devices, clock, progress)


def _header(args: argparse.Namespace, devices: Sequence[jax.Device]) -> dict[str, Any]:
    platform_name = devices[0].platform
    return {
        "jax": jax.__version__,
        "jaxreshard": jr.__version__,
        "platform": platform_name,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "devices_available": len(jax.devices()),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "command": "python -m jaxreshard.bench " + " ".join(sys.argv[1:]),
        "pairs": args.pairs,
        "warmup": args.warmup,
        "profile_reps": args.profile_reps,
        "size_mib": args.size_mib,
        "layers": args.layers,
        "gpt": {"d": args.gpt_d, "layers": args.gpt_layers, "vocab": args.gpt_vocab},
        "many_leaves": args.many_leaves,
        "small_leaves_layers": args.small_leaves_layers,
        "lora": {"layers": args.lora_layers, "rank": args.lora_rank},
        "big_leaf_mib": args.big_leaf_mib,
        "first_call": {
            "layers": args.first_call_layers,
            "d": args.first_call_d,
            "mlp": args.first_call_mlp,
            "vocab": args.first_call_vocab,
        },
        "bucket_bytes": args.bucket_bytes
        if args.bucket_bytes is not None
        else jr.default_bucket_bytes(platform_name),
    }


LEGEND = """\
   How to read the tables (every scenario):
   - measured: wall time of whole calls. Every strategy gets the same untimed calls (its first
     call, then --warmup more), then, for each other strategy X, --pairs rounds of X against
     jaxreshard interleaved J X, X J, ... (a pass per X), each call on a fresh source (x + 1,
     donated). output: donated = writes into its previous result (the
     refit mode); fresh = allocates its result (device_put cannot be given warm buffers).
   - jr/x: jaxreshard's time / this strategy's (> 1: jaxreshard slower), against jaxreshard's
     calls of the same pass; pairs = median of the per-round ratios, medians = ratio of the
     medians. Targets use the ratio of the medians.
   - 1st call: the first call after planning; compile s / compiles: JAX tracing, lowering and
     XLA compiles during it. = device_put: result equal element for element (ref: the reference).
   - host how: guard = the call ran under jax.transfer_guard("disallow"), so any host transfer
     would have raised; watched = NumPy arrays JAX placed on devices, counted (measured).
   - peak: resident memory beyond that just before the call (heap trimmed, VmHWM reset);
     transient = peak less a freshly allocated result; 1st-shape = jaxreshard with its staging
     pool freed before the call (the first call at that shape).
   - stage profile: Plan.profile phases, each awaited (the sum exceeds a plain call), against a
     jitted copy of the same bytes into a donated buffer on the same devices in the same run.
   - plan arithmetic: PlanStats, computed from the layouts, not measured; counted = host syncs
     (jax.block_until_ready calls) counted during one donated call, beside the stats' figure.
   - derived: computed from the layouts by the formula shown, not measured."""


def _print_header(header: dict[str, Any]) -> None:
    print(
        f"jaxreshard.bench: {header['devices']} of {header['devices_available']} "
        f"{header['platform']} devices ({header['device_kind']}), jax {header['jax']}, "
        f"{header['cpus']} CPUs, {header['pairs']} interleaved rounds, bucket "
        f"{_mib(header['bucket_bytes'])} MiB, XLA_FLAGS={header['xla_flags']!r}",
        flush=True,
    )
    print(LEGEND, flush=True)
    if header["platform"] != "cpu":
        print(
            "   not CPU: these code paths have not run on this backend before; memory figures "
            "are host RSS only",
            flush=True,
        )


def _finish(
    args: argparse.Namespace,
    header: dict[str, Any],
    records: list[dict[str, Any]],
    failed: list[dict[str, Any]],
) -> dict[str, Any]:
    ts = targets(records, header.get("platform", "cpu"))
    if not args.child:
        print(format_targets(ts), flush=True)
        for f in failed:
            print(f"   FAILED   {f['scenario']}: {f['error']}", flush=True)
    report = {
        "config": header,
        "scenarios": records,
        "goals": ts,
        "failed": failed,
        "complete": not failed,
    }
    _write(args.json, report)
    return report


def _run_children(
    args: argparse.Namespace, names: Sequence[str], devices: Sequence[jax.Device]
) -> dict[str, Any]:
    """Run every scenario in a child process (see `main`) and merge their records."""
    if args.pairs < 10:
        print(f"note: --pairs {args.pairs} < 10: figures are indicative only", file=sys.stderr)
    header = _header(args, devices)
    _print_header(header)
    records: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="jaxreshard-bench-") as tmp:
        for name in names:
            path = os.path.join(tmp, f"{name}.json")
            cmd = [*_self_cmd(), "--in-process", "--child", "--quiet-header"]
            cmd += ["--scenario", name, "--json", path, "--devices", str(len(devices))]
            cmd += _common_args(args)
            ok, error = _run_with_retries(cmd, name, args.attempts)
            if ok:
                with open(path) as f:
                    records.extend(json.load(f)["scenarios"])
            else:
                failed.append({"scenario": name, "error": error})
    args.child = False
    return _finish(args, header, records, failed)


def _run_with_retries(cmd: list[str], label: str, attempts: int) -> tuple[bool, str]:
    """Run ``cmd`` up to ``attempts`` times until it exits 0; (ok, last error line)."""
    error = ""
    for attempt in range(1, attempts + 1):
        returncode, err = _run_teeing_stderr(cmd)
        if returncode == 0:
            return True, ""
        lines = [ln for ln in err.splitlines() if ln.strip()]
        found = next((ln for ln in lines if "] Termination timeout" in ln), None)
        error = (found or (lines[-1] if lines else f"exit {returncode}"))[:300]
        print(
            f"   {label}: child exited with {returncode} (attempt {attempt}): {error}",
            file=sys.stderr,
            flush=True,
        )
    return False, error


def _run_teeing_stderr(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd``; its stdout goes to ours, its stderr to ours and into the returned text."""
    sys.stdout.flush()
    proc = subprocess.Popen(cmd, stdout=sys.stdout, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    kept = bytearray()
    while chunk := os.read(proc.stderr.fileno(), 4096):
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
        kept += chunk
        del kept[: max(0, len(kept) - 200_000)]
    return proc.wait(), kept.decode(errors="replace")


def _write(path: str | None, report: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(_no_nan(report), f, indent=1, default=str)


def _no_nan(x: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_no_nan(v) for v in x]
    return x


if __name__ == "__main__":
    main()
