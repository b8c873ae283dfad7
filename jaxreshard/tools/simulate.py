"""Plan reshards of real models on virtual GPU clusters and price them with the cost model.

    python -m jaxreshard.simulate --scenario deepseek-v3
    python -m jaxreshard.simulate --all --json out.json
    python -m jaxreshard.simulate --model llama-3.1-70b --src FSDP64 --dst "TP8 DP8" \\
        --topology h100 --placement contiguous
    python -m jaxreshard.simulate --scenario deepseek-v3 --materialize  # + cutting the segments
    python -m jaxreshard.simulate --calibrate  # the model against this machine's executor
    python -m jaxreshard.simulate --calibrate-device  # one GPU's copies against the profiles

Nothing runs on a device (importing the package still loads JAX; the calibrations aside):
layouts are built on integer device ids, the planner and scheduler run as `jaxreshard.plan`
runs them, and `jaxreshard.tools.costmodel` prices the schedule (overheads included), the
physical bound and the baselines. Every time it prints is modeled.

Parameter inventories follow the models' public configs (Hugging Face ``config.json``); each
kind of layer weight is one leaf stacked over its layers, so pipeline parallelism is a sharded
stacked-layer axis and expert parallelism a sharded expert axis.

Layout strings name parallel axes with their sizes, e.g. ``"EP16 DP2 PP4"`` or ``"TP8 DP16"``
(order does not matter; the mesh is laid out PP, DP, CP, FSDP, EP, TP from outermost to
innermost, so a TP group is a run of consecutive device ids):

- ``PP``: pipeline stages split the stacked-layer axis into contiguous runs of layers (uneven
  when the layer count does not divide, as Megatron does: 61 layers over 4 stages are
  16/15/15/15); the embedding lives on the first stage, the final norm and LM head on the last.
- ``TP``: Megatron / vLLM tensor parallelism: column-parallel projections split their output
  features, row-parallel ones their input features, embedding and LM head the vocabulary; norms,
  routers and MLA's down-projections are replicated. Attention projections split by whole heads;
  with fewer KV heads than TP ranks each KV head is replicated over TP / heads ranks (vLLM).
  Experts split their intermediate features when there is no EP.
- ``EP``: experts are split over EP ranks (then not over TP: expert TP is 1). The written axes
  multiply: "EP16 DP2 PP4" is 128 GPUs, EP an axis of its own. Given a device count the
  written axes do not fill, EP folds over each pipeline stage's other axes (Megatron's MoE
  parallel folding, expert rank = stage rank mod EP) and an unwritten DP fills the rest:
  "TP2 EP16 PP4" on 64 GPUs has DP8 x TP2 = 16 expert ranks per stage, "EP16 PP4" on 128 GPUs
  DP32 per stage with each expert shard on 2 devices.
- ``FSDP``: every parameter is split on its first per-layer dimension that divides evenly
  (PyTorch FSDP2 shards dimension 0 of each parameter).
- ``DP``, ``CP``: replicas (context parallelism does not split parameters). With an explicit
  device count, a DP that is not written fills the remaining factor.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Imported up front, where the planner imports it on first use (`schedule._parted_rounds`):
# the model times planning, which a once-per-process import (0.15-0.3 s here) is not.
import scipy.sparse.csgraph  # noqa: F401

from jaxreshard.errors import ReshardError
from jaxreshard.planning.layout import Layout
from jaxreshard.planning.route import LeafSpec, gc_paused, planner_options
from jaxreshard.planning.route import route as assign
from jaxreshard.planning.schedule import (
    ALIGN,
    PlanStats,
    RoundPlan,
    Schedule,
    Unit,
    cut_plan_schedule,
    plan_stats,
    plan_unit_rounds,
    platform_options,
)
from jaxreshard.planning.topology import PROFILES, Profile, Topology
from jaxreshard.tools import costmodel
from jaxreshard.tools.cli import writable_path

MiB = 1 << 20
GPU_BUCKET_BYTES = 128 * MiB  # jaxreshard.api.GPU_BUCKET_BYTES (not imported: it pulls in JAX)

# ------------------------------------------------------------------------------ inventories


@dataclasses.dataclass(frozen=True)
class Param:
    """One leaf of a model's parameters and how each kind of parallelism splits it.

    Attributes:
      name: a path-like name.
      shape: the global shape (weights are ``(in_features, out_features)``, as in JAX).
      layers: ``(first_layer, count)`` when dimension 0 stacks ``count`` consecutive layers.
      tp_dim: the dimension tensor parallelism splits, if any.
      tp_unit: TP splits ``tp_dim`` in whole units of this many elements (an attention head).
      expert_dim: the dimension stacking routed experts, if any.
      stage: for a parameter not stacked over layers, the pipeline stage holding it under PP:
        "first", "last", or None (every stage).
      tp_replicates: with fewer units than TP ranks, each unit is held by several ranks (KV
        heads: vLLM replicates them); elsewhere such a TP is refused (vLLM refuses query
        heads that do not divide, Megatron experts that do not divide EP).
    """

    name: str
    shape: tuple[int, ...]
    layers: tuple[int, int] | None = None
    tp_dim: int | None = None
    tp_unit: int = 1
    expert_dim: int | None = None
    stage: str | None = None
    tp_replicates: bool = False


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    num_layers: int
    params: tuple[Param, ...]
    source: str

    @property
    def num_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)


def _attention_gqa(
    L: int, h: int, heads: int, kv_heads: int, head_dim: int, qk_norm: bool
) -> list[Param]:
    A, kv = (0, L), (L, h, kv_heads * head_dim)
    out = [
        Param("attn.norm", (L, h), layers=A),
        Param("attn.q", (L, h, heads * head_dim), layers=A, tp_dim=2, tp_unit=head_dim),
        *(  # KV heads: replicated where TP has more ranks than them (vLLM)
            Param(name, kv, layers=A, tp_dim=2, tp_unit=head_dim, tp_replicates=True)
            for name in ("attn.k", "attn.v")
        ),
        Param("attn.o", (L, heads * head_dim, h), layers=A, tp_dim=1, tp_unit=head_dim),
        Param("mlp.norm", (L, h), layers=A),
    ]
    if qk_norm:
        out += [
            Param("attn.q_norm", (L, head_dim), layers=A),
            Param("attn.k_norm", (L, head_dim), layers=A),
        ]
    return out


def _dense_mlp(prefix: str, layers: tuple[int, int], h: int, inter: int) -> list[Param]:
    n = layers[1]
    return [
        Param(f"{prefix}.gate", (n, h, inter), layers=layers, tp_dim=2),
        Param(f"{prefix}.up", (n, h, inter), layers=layers, tp_dim=2),
        Param(f"{prefix}.down", (n, inter, h), layers=layers, tp_dim=1),
    ]


def _experts(layers: tuple[int, int], experts: int, h: int, inter: int) -> list[Param]:
    n = layers[1]
    return [
        Param("moe.router", (n, h, experts), layers=layers),
        Param("moe.experts.gate", (n, experts, h, inter), layers=layers, tp_dim=3, expert_dim=1),
        Param("moe.experts.up", (n, experts, h, inter), layers=layers, tp_dim=3, expert_dim=1),
        Param("moe.experts.down", (n, experts, inter, h), layers=layers, tp_dim=2, expert_dim=1),
    ]


def _ends(vocab: int, h: int, tied: bool) -> list[Param]:
    out = [Param("embed", (vocab, h), tp_dim=0, stage="first")]
    out.append(Param("final_norm", (h,), stage="last"))
    if not tied:
        out.append(Param("lm_head", (h, vocab), tp_dim=1, stage="last"))
    return out


def _mla_moe(
    name: str,
    source: str,
    *,
    layers: int,
    dense: int,
    heads: int,
    experts: int,
    vocab: int,
    h: int = 7168,
    dense_inter: int = 18432,
    moe_inter: int = 2048,
) -> Model:
    """A DeepSeek-V3-style model: MLA attention (q_lora_rank 1536, kv_lora_rank 512, qk_nope
    128, qk_rope 64, v_head 128), ``dense`` dense layers first, then MoE layers of ``experts``
    routed experts + 1 shared expert with a router and its correction bias; untied head."""
    L, q_rank, kv_rank, nope, rope, v_dim = layers, 1536, 512, 128, 64, 128
    A, D, M = (0, L), (0, dense), (dense, L - dense)
    n_moe = L - dense
    params = [
        Param("attn.norm", (L, h), layers=A),
        Param("attn.q_a", (L, h, q_rank), layers=A),
        Param("attn.q_a_norm", (L, q_rank), layers=A),
        Param("attn.q_b", (L, q_rank, heads * (nope + rope)), layers=A, tp_dim=2,
              tp_unit=nope + rope),
        Param("attn.kv_a", (L, h, kv_rank + rope), layers=A),
        Param("attn.kv_a_norm", (L, kv_rank), layers=A),
        Param("attn.kv_b", (L, kv_rank, heads * (nope + v_dim)), layers=A, tp_dim=2,
              tp_unit=nope + v_dim),
        Param("attn.o", (L, heads * v_dim, h), layers=A, tp_dim=1, tp_unit=v_dim),
        Param("mlp.norm", (L, h), layers=A),
        *_dense_mlp("dense", D, h, dense_inter),
        *_experts(M, experts, h, moe_inter),
        Param("moe.router_bias", (n_moe, experts), layers=M),
        *_dense_mlp("moe.shared", M, h, moe_inter),
        *_ends(vocab, h, tied=False),
    ]  # fmt: skip
    return Model(name, L, tuple(params), source)


def deepseek_v3() -> Model:
    """DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): 61 layers, hidden 7168, the first 3
    dense (intermediate 18432), then 256 routed + 1 shared experts (moe_intermediate 2048);
    MLA with 128 heads; vocab 129280, untied. The multi-token-prediction layer is not part of
    the 671B and is left out."""
    return _mla_moe(
        "DeepSeek-V3", "deepseek-ai/DeepSeek-V3 config.json",
        layers=61, dense=3, heads=128, experts=256, vocab=129280,
    )  # fmt: skip


def kimi_k2() -> Model:
    """Kimi-K2 (moonshotai/Kimi-K2-Instruct config.json): DeepSeek-V3's architecture with 61
    layers, hidden 7168, the first layer dense (intermediate 18432), 384 routed + 1 shared
    experts (moe_intermediate 2048), MLA with 64 heads, vocab 163840, untied."""
    return _mla_moe(
        "Kimi-K2", "moonshotai/Kimi-K2-Instruct config.json",
        layers=61, dense=1, heads=64, experts=384, vocab=163840,
    )  # fmt: skip


def qwen3_235b() -> Model:
    """Qwen3-235B-A22B (Qwen/Qwen3-235B-A22B config.json): 94 layers, all MoE, hidden 4096, 128
    experts (moe_intermediate 1536, no shared expert), 64 query heads, 4 KV heads, head_dim 128,
    q/k norms, vocab 151936, untied."""
    L, h = 94, 4096
    params = [
        *_attention_gqa(L, h, 64, 4, 128, qk_norm=True),
        *_experts((0, L), 128, h, 1536),
        *_ends(151936, h, tied=False),
    ]
    return Model("Qwen3-235B-A22B", L, tuple(params), "Qwen/Qwen3-235B-A22B config.json")


def llama31_70b() -> Model:
    """Llama-3.1-70B (meta-llama/Llama-3.1-70B config.json): 80 layers, hidden 8192,
    intermediate 28672, 64 heads, 8 KV heads, head_dim 128, vocab 128256, untied."""
    L, h = 80, 8192
    params = [
        *_attention_gqa(L, h, 64, 8, 128, qk_norm=False),
        *_dense_mlp("mlp", (0, L), h, 28672),
        *_ends(128256, h, tied=False),
    ]
    return Model("Llama-3.1-70B", L, tuple(params), "meta-llama/Llama-3.1-70B config.json")


def qwen3_4b() -> Model:
    """Qwen3-4B (Qwen/Qwen3-4B config.json): 36 layers, hidden 2560, intermediate 9728, 32
    heads, 8 KV heads, head_dim 128, q/k norms, vocab 151936, tied embeddings."""
    L, h = 36, 2560
    params = [
        *_attention_gqa(L, h, 32, 8, 128, qk_norm=True),
        *_dense_mlp("mlp", (0, L), h, 9728),
        *_ends(151936, h, tied=True),
    ]
    return Model("Qwen3-4B", L, tuple(params), "Qwen/Qwen3-4B config.json")


MODELS: dict[str, Callable[[], Model]] = {
    "deepseek-v3": deepseek_v3,
    "kimi-k2": kimi_k2,
    "qwen3-235b-a22b": qwen3_235b,
    "llama-3.1-70b": llama31_70b,
    "qwen3-4b": qwen3_4b,
}

# ------------------------------------------------------------------------------- strategies

MESH_ORDER = ("pp", "dp", "cp", "fsdp", "ep", "tp")
"""Mesh axes from outermost to innermost (TP innermost: a TP group is consecutive ids)."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A parsed layout string: mesh axes (outermost first) and how experts are split.

    Attributes:
      text: the layout string as given.
      axes: ``(name, size)`` of the mesh, outermost first; every size > 1.
      ep: expert-parallel ways (1 without EP).
      ep_axes: the mesh axes expert ranks run over (``("ep",)``, or the axes EP is folded on).
    """

    text: str
    axes: tuple[tuple[str, int], ...]
    ep: int
    ep_axes: tuple[str, ...]

    @property
    def size(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def num_devices(self) -> int:
        return math.prod(n for _, n in self.axes)


def parse_strategy(text: str, devices: int | None = None) -> Strategy:
    """Parse ``"EP16 DP2 PP4"``-style layout strings (see the module docstring)."""
    tokens = re.findall(r"([A-Za-z]+)\s*(\d+)", text)
    if not tokens or re.sub(r"[A-Za-z]+\s*\d+|[\s,x*]", "", text):
        raise ValueError(f"cannot parse layout {text!r}: write axes like 'TP8 DP16'")
    size: dict[str, int] = {}
    for name, n in tokens:
        key = name.lower()
        if key not in MESH_ORDER:
            raise ValueError(f"unknown axis {name!r} in {text!r}; known: {MESH_ORDER}")
        if key in size:
            raise ValueError(f"axis {name!r} appears twice in {text!r}")
        if int(n) < 1:  # (not dropped as if it were 1: 'TP0' is a typo, not a layout)
            raise ValueError(f"axis {name!r} in {text!r} has size 0: write 1 or more")
        size[key] = int(n)
    ep = size.pop("ep", 1)
    base = math.prod(size.values())
    ep_axes: tuple[str, ...] = ("ep",)
    if devices is None or base * ep == devices:
        if ep > 1:
            size["ep"] = ep  # an axis of its own: "EP16 DP16 PP4" is 1024 devices
    else:
        # EP folds over a pipeline stage's other axes (Megatron's MoE parallel folding), and
        # an unwritten DP fills what the written axes leave: "EP16 PP4" on 128 devices is
        # DP32 per stage, each expert shard on 2 of its 32 devices.
        if devices % base:
            raise ValueError(f"layout {text!r} does not fit {devices} devices")
        if devices > base:
            if "dp" in size:
                raise ValueError(
                    f"layout {text!r} lays out {base * ep} devices, not {devices}; write the "
                    "DP that fills them, or leave DP out"
                )
            size["dp"] = devices // base
        inner = [a for a in MESH_ORDER if a in size and a != "pp" and size[a] > 1]
        stage = math.prod(size[a] for a in inner)
        if ep > 1:
            if stage % ep:
                raise ValueError(
                    f"layout {text!r}: EP{ep} must divide the {stage} devices of a pipeline "
                    f"stage to fold over them (or make EP an axis of its own: {base * ep} "
                    "devices)"
                )
            ep_axes = tuple(inner)
    axes = tuple((a, size[a]) for a in MESH_ORDER if size.get(a, 1) > 1)
    strategy = Strategy(text, axes, ep, ep_axes)
    if devices is not None and strategy.num_devices != devices:
        raise ValueError(f"layout {text!r} lays out {strategy.num_devices} devices, not {devices}")
    return strategy


def stage_layers(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer runs of the pipeline stages, earlier stages taking the remainder."""
    q, r = divmod(num_layers, stages)
    bounds, start = [], 0
    for s in range(stages):
        stop = start + q + (1 if s < r else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def layout(param: Param, model: Model, strategy: Strategy, device_ids: Sequence[int]) -> Layout:
    """The `Layout` of one parameter under ``strategy`` on ``device_ids`` (mesh order)."""
    size = strategy.size
    names = [a for a, _ in strategy.axes]
    strides = {a: math.prod(size[b] for b in names[i + 1 :]) for i, a in enumerate(names)}
    pp = size.get("pp", 1)
    stages = stage_layers(model.num_layers, pp)
    devices, boxes = [], []
    for flat, device in enumerate(device_ids):
        coord = {a: (flat // strides[a]) % size[a] for a in names}
        box = [(0, n) for n in param.shape]
        stage = coord.get("pp", 0)
        if param.layers is not None:
            first, count = param.layers
            lo, hi = stages[stage]
            lo, hi = max(lo, first) - first, min(hi, first + count) - first
            if lo >= hi:
                continue  # this stage holds none of these layers
            box[0] = (lo, hi)
        elif pp > 1 and param.stage == "first" and stage != 0:
            continue
        elif pp > 1 and param.stage == "last" and stage != pp - 1:
            continue
        split_experts = strategy.ep > 1 and param.expert_dim is not None
        if split_experts:
            rank = 0
            for a in strategy.ep_axes:
                rank = rank * size[a] + coord[a]
            rank %= strategy.ep  # folded: expert ranks repeat over the stage (expert DP)
            box[param.expert_dim] = _part(box[param.expert_dim], strategy.ep, rank, 1, param)
        tp = size.get("tp", 1)
        if tp > 1 and param.tp_dim is not None and not split_experts:
            box[param.tp_dim] = _part(
                box[param.tp_dim], tp, coord["tp"], param.tp_unit, param, param.tp_replicates
            )
        fsdp = size.get("fsdp", 1)
        if fsdp > 1:
            skip = {0} if param.layers is not None else set()
            for dim, (a, b) in enumerate(box):
                if dim not in skip and (b - a) % fsdp == 0:
                    box[dim] = _part(box[dim], fsdp, coord["fsdp"], 1, param)
                    break
        devices.append(int(device))
        boxes.append(tuple(box))
    return Layout(param.shape, tuple(devices), tuple(boxes))


def _laid_out(
    param: Param, model: Model, strategy: Strategy, device_ids: Sequence[int], side: str
) -> Layout:
    """`layout`, its refusal naming the side and the layout text."""
    try:
        return layout(param, model, strategy, device_ids)
    except ValueError as e:
        raise ValueError(f"{side}: {e}") from None


def _check_axes(model: Model, strategy: Strategy, side: str) -> None:
    """Refuse an axis that would split nothing of ``model`` (it would be taken as data
    parallelism without a word): EP on a dense model, PP over more stages than layers, FSDP
    that divides no dimension of any parameter."""
    size = strategy.size
    if strategy.ep > 1 and not any(p.expert_dim is not None for p in model.params):
        raise ValueError(f"{side}: EP{strategy.ep}, but the model has no routed experts")
    if size.get("pp", 1) > model.num_layers:
        raise ValueError(f"{side}: PP{size['pp']} stages for {model.num_layers} layers")
    fsdp = size.get("fsdp", 1)
    if fsdp > 1:
        # FSDP in JAX shards a dimension it divides; a matrix it divides nowhere would sit
        # whole on every device (frameworks refuse or pad it; neither is modeled).
        for p in model.params:
            dims = [n for dim, n in enumerate(p.shape) if not (dim == 0 and p.layers is not None)]
            if len(dims) >= 2 and not any(n % fsdp == 0 for n in dims):
                raise ValueError(
                    f"{side}: FSDP{fsdp} divides no dimension of {p.name} {list(p.shape)}"
                )


def _part(
    span: tuple[int, int],
    ways: int,
    rank: int,
    unit: int,
    param: Param,
    replicate: bool = False,
) -> tuple[int, int]:
    """Part ``rank`` of ``ways`` of ``span``, in whole units; with fewer units than ways and
    ``replicate``, each unit is replicated over ``ways / units`` consecutive ranks (KV heads
    under vLLM's TP)."""
    start, stop = span
    units, rest = divmod(stop - start, unit)
    if rest:
        raise ValueError(f"{param.name}: extent {stop - start} is not a multiple of {unit}")
    if units % ways == 0:
        per = units // ways * unit
        return (start + rank * per, start + (rank + 1) * per)
    if replicate and ways % units == 0:
        u = rank * units // ways
        return (start + u * unit, start + (u + 1) * unit)
    raise ValueError(
        f"{param.name}: {units} units of {unit} cannot be split {ways} ways (a TP beyond the "
        "heads, or an EP beyond the experts)"
    )


# -------------------------------------------------------------------------------- scenarios


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A reshard setup to reproduce: a published one, or one an audit asked for."""

    name: str
    model: str
    src: str
    dst: str
    topology: str
    src_devices: int | None = None
    dst_devices: int | None = None
    colocated: bool = False
    bytes_per_param: int = 2
    published: str = ""
    note: str = ""


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "deepseek-v3",
            "deepseek-v3",
            "EP16 DP2 PP4",
            "TP8 DP16",
            "gb200-nvl72",
            published=(
                "NCCL M2N on GB200 NVL72, 128 -> 128 GPUs: 1447 ms measured (direct "
                "point-to-point: 3838 ms measured)"
            ),
        ),
        Scenario(
            "deepseek-v3-512",
            "deepseek-v3",
            "EP16 DP2 PP4",
            "TP8 DP64",
            "gb200-nvl72",
            published="no published figure (the sampler has four times the trainer's GPUs)",
        ),
        Scenario(
            "nemo-rl-deepseek-v3",
            "deepseek-v3",
            "EP16 PP16",
            "TP32 DP8",
            "h100",
            src_devices=256,
            dst_devices=256,
            published=(
                "NeMo-RL refit (nccl_reshard), DeepSeek-V3 on H100, EP16 PP16 -> TP32 DP8: "
                "2.39-2.83 s measured for the whole refit"
            ),
            note="NeMo-RL sends only the bulk FFN weights through M2N; here every weight moves",
        ),
        Scenario(
            "qwen3-235b",
            "qwen3-235b-a22b",
            "TP2 EP16 PP4",
            "TP8 DP8",
            "gb200-nvl72",
            src_devices=64,
            dst_devices=64,
            published=(
                "NCCL M2N on GB200 NVL72, 64 -> 64 GPUs (TP2 CP2 EP16 PP4 -> TP8 DP8): 989 ms "
                "measured (direct point-to-point: 2175 ms measured)"
            ),
            note="trainer CP2 x DP4 modeled as DP8 (context parallelism does not split weights)",
        ),
        Scenario(
            "qwen3-235b-128",
            "qwen3-235b-a22b",
            "TP2 EP16 PP4",
            "TP8 DP16",
            "gb200-nvl72",
            src_devices=64,
            dst_devices=128,
            published="no published figure (the sampler has twice the trainer's GPUs)",
        ),
        Scenario(
            "kimi-k2-fp8",
            "kimi-k2",
            "EP64 PP4",
            "TP16 DP8",
            "h100",
            bytes_per_param=1,
            published=(
                "Perplexity: Kimi-K2 from 256 BF16 training GPUs to 128 FP8 inference GPUs in "
                "1.3 s measured (RDMA one-sided writes; their layouts are not published)"
            ),
            note=(
                "FP8 at the destination: 1 byte per parameter on the wire, quantized on the "
                "senders (jr.Fp8Blockwise); the float32 scales of 128 x 128 blocks (0.02% more "
                "bytes) are left out; layouts are this project's choice"
            ),
        ),
        Scenario(
            "llama-3.1-70b",
            "llama-3.1-70b",
            "FSDP64",
            "TP8 DP8",
            "h100",
            published="no published figure for this setup",
        ),
        Scenario(
            "qwen3-4b",
            "qwen3-4b",
            "FSDP8",
            "TP8",
            "h100",
            colocated=True,
            published="NeMo-RL refit, H100, DP8 -> TP8: 0.2-0.3 s (whole refit, measured)",
            note=(
                "trainer 'DP8' modeled as FSDP8 (NeMo-RL's DTensor policy shards parameters); a "
                "fully replicated DP8 would hold every TP8 shard already: 0 bytes to move"
            ),
        ),
        Scenario(
            "deepseek-v3-4096",
            "deepseek-v3",
            "EP32 DP16 PP4",
            "TP8 DP256",
            "gb200-nvl72",
            published="planning at scale: 4,096 virtual GPUs",
        ),
    )
}

NOT_IN_ALL: dict[str, str] = {}
"""Scenarios `--all` leaves out, and why (printed with the summary): none since the slabs of
large leaves stay uncut while planning (`schedule.SlabCut`), which brought 4,096 GPUs from
unfinished after 8 minutes to about 100 s here."""

PLACEMENTS = ("rack-aligned", "contiguous")
"""``rack-aligned``: the sampler's devices start on a fast domain (rack) of their own, as
clusters allocate them; ``contiguous``: they follow the trainer's ids, sharing its last rack."""

# ------------------------------------------------------------------------------- simulation


@dataclasses.dataclass(frozen=True)
class Result:
    """Everything the table reports for one simulated reshard (seconds unless said)."""

    title: str
    model: Model
    src: Strategy
    dst: Strategy
    topology: Topology
    profile: Profile
    placement: str
    stats: PlanStats
    rounds: RoundPlan
    modeled: costmodel.ModeledTime
    rounds_only: costmodel.ScheduleCost
    bound: costmodel.LowerBound
    round_model_bound: costmodel.LowerBound
    baselines: dict[str, float]
    planning_seconds: float
    full_planning_seconds: float | None
    peak_rss_bytes: int
    stages: dict[int, int]
    published: str
    note: str
    units: tuple[Unit, ...] = ()
    leaves: tuple[LeafSpec, ...] = ()  # what the units' leaf indices point into
    bound_at_efficiency: costmodel.LowerBound | None = None
    # What no plan beats with copies as programs of their own (`costmodel.executor_floor`).
    executor_floor: costmodel.LowerBound | None = None
    two_lanes: costmodel.ModeledTime | None = None  # if the lanes overlapped (`simulate`)
    without: dict[str, float] = dataclasses.field(default_factory=dict)  # (`WITHOUT`)
    # With ``materialize``: over the buckets of units with distinct streams (equal units share
    # their programs), the busiest device's copies (message segments) per bucket, summed, and
    # the most in one bucket: what a first call's pack and unpack programs compile.
    program_copies: tuple[int, int] | None = None
    # With ``materialize``: the same plan priced as `jr.plan` cuts it (`cut_plan_schedule`),
    # where a message sent alike to several peers is packed once (`lower.Step.shared`) and
    # each copy's rows are known; ``modeled`` prices its rounds, which hold no contents.
    modeled_as_cut: costmodel.ModeledTime | None = None

    @functools.cached_property
    def transfer_programs(self) -> int:
        """About the transfer programs the plan compiles on its first call: its buckets with
        distinct rounds (slot sizes and pairs; the executor shares one program between alike
        buckets, and slot dtypes, which a `RoundPlan` does not hold, may split them further).
        Each bucket of a distinct unit also has its pack and unpack programs."""
        return len(set(self.rounds.rounds_by_bucket()))

    @property
    def ratio(self) -> float:
        """Modeled time (overheads included) over the physical bound."""
        return self.modeled.seconds / self.bound.seconds if self.bound.seconds else 1.0

    def gap(self) -> dict[str, float]:
        """What the modeled time adds to the physical bound, by cause (they add up to
        ``modeled - bound``):

        - ``link_efficiency``: the bound again with links at the profile's efficiency;
        - ``rounds_beyond_bound``: the rounds' bandwidth time beyond that (uneven rounds,
          padding, one link a device at a time where the bound lets NVLink and NIC share);
        - ``round_latency``: the rounds' latency on the critical path;
        - ``copies``: pack, unpack and local copies on the critical path;
        - ``launches_and_host``: launch gaps and host work on it.
        """
        m = self.modeled
        at_efficiency = (self.bound_at_efficiency or self.bound).seconds
        return {
            "link_efficiency": at_efficiency - self.bound.seconds,
            "rounds_beyond_bound": m.transfer - m.latency - at_efficiency,
            "round_latency": m.latency,
            "copies": m.pack + m.unpack + m.local,
            "launches_and_host": m.overhead,
        }

    def record(self, scenario: str = "") -> dict[str, object]:
        """A JSON-ready summary (`--json`)."""
        s = self.stats
        intra_relayed = s.bytes_relayed - s.bytes_relayed_cross_domain
        return {
            "scenario": scenario or self.title.split(":")[0],
            "title": self.title,
            "model": self.model.name,
            "params": self.model.num_params,
            "src": self.src.text,
            "dst": self.dst.text,
            "src_gpus": self.src.num_devices,
            "dst_gpus": self.dst.num_devices,
            "topology": self.topology.name,
            "placement": self.placement,
            "bytes": {
                "destination_total": s.bytes_total,
                "already_local": s.bytes_local,
                "sent": s.bytes_sent,
                "lower_bound": s.bytes_lower_bound,
                "cross_domain": s.bytes_cross_domain,
                "intra_domain_direct": s.bytes_sent - s.bytes_cross_domain - intra_relayed,
                "intra_domain_relayed": intra_relayed,
                "cross_domain_forwarded": s.bytes_relayed_cross_domain,
                "must_cross": self.bound.bytes_cross_needed,
            },
            "modeled_s": self.modeled.seconds,
            "modeled_parts_s": self.modeled.parts(),
            # The same plan if the backend kept a bucket's two lanes in flight at once
            # (`Profile.permutes_overlap`; XLA GPU does not): None where the links cannot.
            "modeled_two_lanes_s": self.two_lanes.seconds if self.two_lanes else None,
            # The same plan re-priced with overheads taken away (`WITHOUT`): what each costs.
            "modeled_without_s": dict(self.without),
            "rounds_only_s": self.rounds_only.seconds,
            "lower_bound_s": self.bound.seconds,
            "lower_bound_binding": self.bound.binding,
            # No plan of this executor beats it (copies never overlap a device's rounds).
            "executor_floor_s": self.executor_floor.seconds if self.executor_floor else None,
            "executor_floor_binding": self.executor_floor.binding if self.executor_floor else None,
            "gap_to_bound_s": self.gap(),
            "round_model_bound_s": self.round_model_bound.seconds,
            "modeled_over_bound": self.ratio,
            "baselines": dict(self.baselines),
            "planning_s": self.planning_seconds,
            "peak_rss_bytes": self.peak_rss_bytes,
            "buckets": s.buckets,
            "units": len(self.units),
            "pipelined_units": sum(u.overlap for u in self.units),
            "rounds": s.rounds,
            "transfer_programs": self.transfer_programs,
            # (with --materialize) the pack and unpack programs' copies: sum and most.
            "program_copies": list(self.program_copies) if self.program_copies else None,
            # (with --materialize) the plan priced as cut: shared packs counted once.
            "modeled_as_cut_s": self.modeled_as_cut.seconds if self.modeled_as_cut else None,
            "published": self.published,
            "note": self.note,
        }


def device_ids(
    src_devices: int,
    dst_devices: int,
    domain_size: int,
    *,
    colocated: bool,
    placement: str,
    src_unit: int = 1,
    dst_unit: int = 1,
) -> tuple[list[int], list[int]]:
    """Cluster slots of the trainer and the sampler (see `PLACEMENTS`).

    Rack-aligned, each side takes the fewest racks that hold it, spread as evenly as whole
    units allow (a unit: a host, or a TP group in whole hosts, which never straddles racks),
    the sampler's racks after the trainer's: 128 GPUs on 72-GPU racks are 64 + 64, and 512 are
    8 racks of 64, not 7 full racks and 8 GPUs alone in an eighth.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; known: {PLACEMENTS}")
    if placement == "contiguous":
        src = list(range(src_devices))
        first = 0 if colocated else src_devices
        return src, list(range(first, first + dst_devices))
    src, racks = _spread(src_devices, domain_size, src_unit, first_rack=0)
    if colocated:  # the sampler on the trainer's GPUs, and on racks of its own beyond them
        more = dst_devices - src_devices
        extra = _spread(more, domain_size, dst_unit, first_rack=racks)[0] if more > 0 else []
        return src, src[:dst_devices] + extra
    dst, _ = _spread(dst_devices, domain_size, dst_unit, first_rack=racks)
    return src, dst


def _spread(n: int, size: int, unit: int, *, first_rack: int) -> tuple[list[int], int]:
    """``n`` slots over the fewest racks of ``size`` from ``first_rack`` that hold them in whole
    ``unit``s, the units dealt out as evenly as they go; returns the slots and racks used."""
    unit = max(1, min(unit, size))
    units, per_rack = math.ceil(n / unit), size // unit
    racks = math.ceil(units / per_rack)
    base, extra = divmod(units, racks)
    ids: list[int] = []
    for r in range(racks):
        start = (first_rack + r) * size
        take = min((base + (r < extra)) * unit, n - len(ids))
        ids.extend(range(start, start + take))
    return ids, racks


def _unit(strategy: Strategy, host: int) -> int:
    """The placement unit of a side: its TP group in whole hosts (or one host)."""
    return math.lcm(host, strategy.size.get("tp", 1))


WITHOUT: dict[str, tuple[str, ...]] = {
    "copies": ("copies",),
    "round_latency": ("round_latency",),
    "copies_and_latency": ("copies", "round_latency"),
    "copies_latency_host": ("copies", "round_latency", "host"),
}
"""The overheads each ``modeled_without_s`` figure takes away from the profile: ``copies``
(pack, unpack and local copies cost nothing), ``round_latency`` (none), ``host`` (no host
work per bucket or per argument, no launch gaps). The plan stays as it was chosen, for the
costs as they are, so these say what each cost adds, not what a plan could reach."""

WITHOUT_LABELS = {
    "copies": "copies free",
    "round_latency": "no round latency",
    "copies_and_latency": "both",
    "copies_latency_host": "and no host or launch cost",
}
"""How the report names each `WITHOUT` figure."""


def _without(profile: Profile, costs: Sequence[str]) -> Profile:
    """``profile`` with the overheads named in ``costs`` (`WITHOUT`) taken away."""
    free: dict[str, object] = {}
    if "copies" in costs:
        inf = float("inf")
        free.update(copy_bandwidth=inf, copy_overhead=0.0, run_overhead=0.0)
        for name in ("host_copy_bandwidth", "narrow_copy_bandwidth", "contiguous_copy_bandwidth"):
            if getattr(profile, name) is not None:
                free[name] = inf
    if "round_latency" in costs:
        free["round_latency"] = 0.0
    if "host" in costs:
        free.update(bucket_overhead=0.0, argument_overhead=0.0, launch_overhead=0.0)
    return dataclasses.replace(profile, **free)  # type: ignore[arg-type]


def simulate(
    model_name: str,
    src: str,
    dst: str,
    topology_name: str,
    *,
    src_devices: int | None = None,
    dst_devices: int | None = None,
    colocated: bool = False,
    placement: str = "rack-aligned",
    domain_size: int | None = None,
    bucket_bytes: int = GPU_BUCKET_BYTES,
    unit_buckets: int | None = None,
    itemsize: int = 2,
    fan_out: bool = True,
    materialize: bool = False,
    title: str = "",
    published: str = "",
    note: str = "",
) -> Result:
    """Plan ``model_name`` from layout ``src`` to ``dst`` on a virtual cluster and price it.

    Source devices are cluster slots ``0 ..``; destination devices start on the next rack
    (``placement="rack-aligned"``), right after them (``"contiguous"``), or are the same
    slots when ``colocated``. ``itemsize`` is the bytes per parameter at the destination.
    ``unit_buckets``: the most buckets a unit spans (default: `GPU_UNIT_BUCKETS`, what
    `jaxreshard.plan` takes on GPUs).

    Planning time covers layouts, sender choice and fan-out (`route`), units, chunk sizes and
    round colouring (`schedule.plan_unit_rounds`) and `plan_stats`; not the cost model's work.
    `plan_unit_rounds` makes exactly the units, rounds, slot sizes and buckets
    `build_plan_schedule` (`jaxreshard.plan`) makes, without cutting pieces into each message's
    segments, which the cost model does not need. With ``materialize``, those rounds are cut
    too (`cut_plan_schedule`; its stats are checked equal) and ``full_planning_seconds`` adds
    what cutting the segments takes.
    """
    if model_name not in MODELS:
        raise ValueError(f"unknown model {model_name!r}; known: {sorted(MODELS)}")
    if topology_name not in PROFILES:
        raise ValueError(f"unknown topology {topology_name!r}; known: {sorted(PROFILES)}")
    model = MODELS[model_name]()
    s = parse_strategy(src, src_devices)
    d = parse_strategy(dst, dst_devices)
    for side, text, strategy in (("--src", src, s), ("--dst", dst, d)):
        _check_axes(model, strategy, f"{side} {text!r}")
    profile = PROFILES[topology_name]
    size = profile.domain_size if domain_size is None else domain_size
    src_ids, dst_ids = device_ids(
        s.num_devices,
        d.num_devices,
        size,
        colocated=colocated,
        placement=placement,
        src_unit=_unit(s, min(profile.host_size, size)),
        dst_unit=_unit(d, min(profile.host_size, size)),
    )
    topo = Topology.profile(
        topology_name, ids=sorted(set(src_ids) | set(dst_ids)), domain_size=domain_size
    )
    dtype = {1: "float8", 2: "bfloat16", 4: "float32"}.get(itemsize, f"{itemsize}-byte")
    # The trainer holds bf16, or float32 where the sampler does: a wider destination than
    # the source would let a plan send the narrow type and widen it on the receivers, so the
    # bound (at the destination's bytes) would not bound it.
    src_dtype = "float32" if itemsize > 2 else "bfloat16"
    start = time.perf_counter()
    with gc_paused():  # as `route` and the schedule are: millions of boxes that all live on
        leaves = [
            LeafSpec(
                p.name,
                _laid_out(p, model, s, src_ids, f"--src {src!r}"),
                _laid_out(p, model, d, dst_ids, f"--dst {dst!r}"),
                src_dtype,
                dtype,
                itemsize,
            )
            for p in model.params
        ]
    platform = platform_options(
        "cpu" if topology_name == "cpu" else "gpu", bucket_bytes, unit_buckets
    )
    routing = planner_options(bucket_bytes)
    assignment = assign(leaves, topo, fan_out=fan_out, **routing)
    options = {
        "bucket_bytes": bucket_bytes,
        **platform,
        "link_class": topo.link_class,
        "class_latency_bytes": topo.class_latency_bytes(),
    }
    units, rounds = plan_unit_rounds(leaves, assignment, **options)  # type: ignore[arg-type]
    stats = plan_stats(leaves, assignment, rounds, crosses=topo.crosses)
    planning = time.perf_counter() - start
    full_seconds = None
    program_copies = None
    schedule = None
    if materialize:  # also cut every message's segments, as jaxreshard.plan does
        start = time.perf_counter()
        schedule = cut_plan_schedule(leaves, units, rounds, link_class=topo.link_class)
        full_seconds = planning + time.perf_counter() - start
        assert plan_stats(leaves, assignment, schedule, crosses=topo.crosses) == stats
        program_copies = _program_copies(schedule, leaves)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stages: dict[int, int] = {}
    for piece in (*assignment.sent, *assignment.fans):
        stages[piece.stage] = stages.get(piece.stage, 0) + len(piece.dsts)
    # NCCL M2N fans out inside each domain once, from balanced senders: destination domains
    # never forward to each other, so it is priced on an assignment that does not chain them.
    m2n = (
        assignment
        if fan_out and not stats.bytes_relayed_cross_domain
        else assign(leaves, topo, fan_out=True, **{**routing, "chain": False})
    )
    baselines = {
        "all-gather + broadcast": costmodel.allgather_broadcast(
            leaves, topo, profile, chunk_bytes=bucket_bytes
        ),
        "direct p2p (round-robin)": costmodel.direct_round_robin(
            leaves, topo, profile, chunk_bytes=bucket_bytes
        ),
        "M2N-like (stages in order)": costmodel.m2n_like(leaves, m2n, topo, profile),
        "rank-0 broadcast": costmodel.rank0_broadcast(leaves, topo),
    }
    bounds = costmodel.lower_bounds(leaves, topo, profile)
    # What each overhead costs is the same plan re-priced without it (`WITHOUT`). XLA GPU
    # runs a bucket's rounds one after another (`Profile.permutes_overlap`); the plan is also
    # priced with its two lanes at once, what a backend that kept both in flight would give.
    # One pass over the schedule counts it for all.
    profiles = [profile] + [_without(profile, costs) for costs in WITHOUT.values()]
    lanes = profile.overlap_links and not profile.permutes_overlap
    if lanes:
        profiles.append(dataclasses.replace(profile, permutes_overlap=True))
    times = costmodel.modeled_times(
        rounds, topo, profiles, leaves=leaves, local=assignment.local, units=units
    )
    modeled = times[0]
    as_cut = None
    if schedule is not None:  # (its messages' contents: packs shared, rows known)
        (as_cut,) = costmodel.modeled_times(
            schedule, topo, [profile], leaves=leaves, local=assignment.local, units=units
        )
    without = {
        name: t.seconds for name, t in zip(WITHOUT, times[1 : 1 + len(WITHOUT)], strict=True)
    }
    two_lanes = times[-1] if lanes else None
    return Result(
        title=title or f"{model.name}: {src} -> {dst}",
        model=model,
        src=s,
        dst=d,
        topology=topo,
        profile=profile,
        placement="colocated" if colocated else placement,
        stats=stats,
        rounds=rounds,
        modeled=modeled,
        two_lanes=two_lanes,
        without=without,
        rounds_only=costmodel.schedule_cost(rounds, topo),
        bound=bounds.physical,
        bound_at_efficiency=bounds.at_efficiency,
        executor_floor=bounds.executor,
        round_model_bound=costmodel.round_model_bound(leaves, topo),
        baselines=baselines,
        planning_seconds=planning,
        full_planning_seconds=full_seconds,
        program_copies=program_copies,
        modeled_as_cut=as_cut,
        peak_rss_bytes=peak,
        stages=stages,
        published=published,
        note=note,
        units=units,
        leaves=tuple(leaves),
    )


def _program_copies(schedule: Schedule, leaves: Sequence[LeafSpec]) -> tuple[int, int]:
    """Over the buckets of units with distinct streams (and overlap: `plan_unit_rounds` shares
    rounds on both), the busiest device's message segments (a pack's or an unpack's copies)
    per bucket: their sum and the most in one bucket."""
    first: dict[object, int] = {}
    for u, unit in enumerate(schedule.units):
        first.setdefault((unit.overlap, tuple(sorted(unit.stream_bytes(leaves).items()))), u)
    distinct = set(first.values())
    total = most = 0
    for bucket in schedule.buckets:
        if bucket.unit not in distinct:
            continue
        sends: Counter[int] = Counter()
        receives: Counter[int] = Counter()
        for m in bucket.messages:
            sends[m.src] += len(m.segments)
            receives[m.dst] += len(m.segments)
        busiest = max([*sends.values(), *receives.values(), 0])
        total += busiest
        most = max(most, busiest)
    return total, most


def run_scenario(name: str, **overrides: object) -> Result:
    """`simulate` one of `SCENARIOS` by name."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {sorted(SCENARIOS)}")
    sc = SCENARIOS[name]
    kwargs: dict[str, object] = {
        "src_devices": sc.src_devices,
        "dst_devices": sc.dst_devices,
        "colocated": sc.colocated,
        "itemsize": sc.bytes_per_param,
        "title": f"{name}: {sc.src} -> {sc.dst}",
        "published": sc.published,
        "note": sc.note,
    }
    kwargs.update(overrides)
    return simulate(sc.model, sc.src, sc.dst, sc.topology, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ table


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def _gb(n: int | float) -> str:
    return f"{n / 1e9:,.2f} GB"


def format_result(r: Result) -> str:
    """The report of one simulation, as a two-column table."""
    s, m, b = r.stats, r.modeled, r.bound
    lanes = (
        "a bucket's rounds across and inside domains at once"
        if r.profile.overlap_links and r.profile.permutes_overlap
        else "every round in turn"
    )
    order = (
        "each GPU runs its programs in order, the next bucket's packs beside the last one's unpacks"
        if r.profile.host_runs_ahead
        else "buckets in turn, each pack, rounds, unpack"
    )
    gap = ", ".join(f"{k.replace('_', ' ')} {v * 1e3:+,.1f} ms" for k, v in r.gap().items())
    domains = len({r.topology.domain_of[i] for i in r.topology.devices})
    relayed = s.bytes_relayed - s.bytes_relayed_cross_domain  # inside domains
    intra_direct = s.bytes_sent - s.bytes_cross_domain - relayed
    p = r.profile
    rows = [
        ("model", f"{r.model.name}, {r.model.num_params / 1e9:,.1f} B parameters "
                  f"({len(r.model.params)} stacked leaves), {r.model.source}"),
        ("layouts", f"{r.src.text} ({r.src.num_devices} GPUs) -> {r.dst.text} "
                    f"({r.dst.num_devices} GPUs), placement {r.placement}"),
        ("topology", f"{r.topology.name}: {len(r.topology.devices)} GPUs in {domains} domains, "
                     f"{r.topology.intra_bandwidth / 1e9:g} GB/s inside, "
                     f"{r.topology.inter_bandwidth / 1e9:g} GB/s across, per GPU per direction"),
        ("units", f"{len(r.units)} (each unit's relays run in the next unit's buckets)"
                  if any(u.overlap for u in r.units) else f"{len(r.units)}"),
        ("overheads", f"links at {p.intra_efficiency:.0%} / {p.inter_efficiency:.0%} of peak, "
                      f"copies {p.copy_bandwidth / 1e9:,.0f} GB/s per GPU, "
                      f"{p.bucket_overhead * 1e6:.0f} us per bucket, "
                      f"{p.round_latency * 1e6:.0f} us per round"),
        ("modeled time", f"{_ms(m.seconds)} (rounds {_ms(m.transfer)}, pack {_ms(m.pack)}, "
                         f"unpack {_ms(m.unpack)}, local {_ms(m.local)}, buckets "
                         f"{_ms(m.overhead)}; {order}; {lanes})"),
        *(
            [("modeled as cut", f"{_ms(r.modeled_as_cut.seconds)} (the same plan priced with "
                                f"its messages' contents, as jaxreshard.plan cuts them: a "
                                f"message sent alike to several peers packed once; pack "
                                f"{_ms(r.modeled_as_cut.pack)}, unpack "
                                f"{_ms(r.modeled_as_cut.unpack)})")]
            if r.modeled_as_cut else []
        ),
        *(
            [("two lanes at once", f"{_ms(r.two_lanes.seconds)} (the same plan if a bucket's "
                                   f"rounds across and inside domains ran at once: "
                                   f"{r.two_lanes.seconds / b.seconds:.3f}x the bound; XLA "
                                   f"GPU compiles a program's collective-permutes one after "
                                   f"another)")]
            if r.two_lanes and b.seconds else []
        ),
        *(
            [("without overheads", "the same plan re-priced, over the bound: "
                                   + ", ".join(f"{WITHOUT_LABELS[k]} {t / b.seconds:.2f}x"
                                               for k, t in r.without.items())
                                   + " (what each costs, not what a plan could reach)")]
            if r.without and b.seconds else []
        ),
        ("physical bound", f"{_ms(b.seconds)}  (modeled / bound = {r.ratio:.3f}; binding: "
                           f"{b.binding})" if b.seconds else _ms(0)),
        *(
            [("executor floor", f"{_ms(r.executor_floor.seconds)}  "
                                f"({r.executor_floor.seconds / b.seconds:.3f}x the bound: no plan "
                                f"beats it while each GPU's copies run beside its rounds, never "
                                f"during them, and links at their efficiency; binding: "
                                f"{r.executor_floor.binding})")]
            if r.executor_floor and b.seconds else []
        ),
        ("gap to the bound", gap),
        ("round-model bound", f"{_ms(r.round_model_bound.seconds)} (destination NICs only, "
                              f"one message at a time; rounds alone at peak: "
                              f"{_ms(r.rounds_only.seconds)})"),
        *((name, _speedup(t, m.seconds)) for name, t in r.baselines.items()),
        ("bytes: destination", f"{_gb(s.bytes_total)} total, {_gb(s.bytes_local)} already local"),
        ("bytes: sent", f"{_gb(s.bytes_sent)} (= lower bound {_gb(s.bytes_lower_bound)}: "
                        f"{s.bytes_sent == s.bytes_lower_bound})"),
        ("bytes: per link class", f"cross-domain {_gb(s.bytes_cross_domain)} "
                                  f"(must cross: {_gb(b.bytes_cross_needed)}; forwarded "
                                  f"between destination domains "
                                  f"{_gb(s.bytes_relayed_cross_domain)}), intra-domain "
                                  f"direct {_gb(intra_direct)}, intra-domain relayed "
                                  f"{_gb(relayed)}"),
        ("rounds", f"{m.rounds} in {s.buckets} buckets, chunk {s.chunk_bytes / MiB:.1f} MiB; "
                   f"pieces per stage {r.stages}"),
        ("programs", f"{r.transfer_programs} distinct transfer programs, each compiled once "
                     f"(and a pack and an unpack per bucket of each distinct unit"
                     + (f": the busiest device's copies in them {r.program_copies[0]:,}, at most "
                        f"{r.program_copies[1]:,} in one" if r.program_copies else "")
                     + ")"),
        ("busiest device", f"sends {_gb(s.max_device_send_bytes)}, receives "
                           f"{_gb(s.max_device_recv_bytes)}"),
        ("planning", f"{r.planning_seconds:.2f} s to rounds"
                     + (f", {r.full_planning_seconds:.2f} s with message segments"
                        if r.full_planning_seconds is not None else "")
                     + f"; peak RSS {r.peak_rss_bytes / 2**30:.2f} GiB (whole process)"),
        ("published", r.published or "-"),
    ]  # fmt: skip
    if r.note:
        rows.append(("note", r.note))
    width = max(len(k) for k, _ in rows)
    lines = [f"== {r.title}"]
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _speedup(baseline: float, ours: float) -> str:
    return f"{_ms(baseline)}  ({baseline / ours:.2f}x the modeled plan)" if ours else _ms(baseline)


def summary(records: Sequence[Mapping[str, Any]]) -> str:
    """One line per scenario, from its `Result.record`: modeled (overheads included),
    physical bound, their ratio, the executor floor over the bound (``floor``: what no plan
    beats with copies beside the rounds), the ratio if a bucket's two lanes ran at once
    (``2 lanes``; XLA GPU runs them in turn), and the baselines as multiples of the modeled
    time. Every figure is modeled."""
    head = (
        f"{'scenario':<22} {'placement':<12} {'modeled':>11} {'bound':>11} {'ratio':>6} "
        f"{'floor':>6} {'2 lanes':>7} {'AG+bcast':>9} {'direct':>7} {'M2N-like':>9} {'plan s':>7}"
    )
    lines = [head]
    for r in records:
        modeled, bound, baselines = r["modeled_s"], r["lower_bound_s"], r["baselines"]
        t = modeled or float("inf")
        ag, dp, m2n = (
            baselines[k] / t
            for k in (
                "all-gather + broadcast",
                "direct p2p (round-robin)",
                "M2N-like (stages in order)",
            )
        )
        two_lanes = r["modeled_two_lanes_s"]
        two = two_lanes / bound if two_lanes is not None and bound else r["modeled_over_bound"]
        floor = r.get("executor_floor_s")
        floor_ratio = f"{floor / bound:>6.2f}" if floor is not None and bound else f"{'-':>6}"
        lines.append(
            f"{r['title'].split(':')[0]:<22} {r['placement']:<12} {_ms(modeled):>11} "
            f"{_ms(bound):>11} {r['modeled_over_bound']:>6.2f} {floor_ratio} {two:>7.2f} "
            f"{ag:>8.2f}x {dp:>6.2f}x {m2n:>8.2f}x {r['planning_s']:>7.2f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxreshard.simulate",
        description="Plan a reshard of a real model on a virtual GPU cluster and price it.",
    )
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), help="a published setup")
    parser.add_argument("--all", action="store_true", help="every scenario, then a summary")
    parser.add_argument("--model", choices=sorted(MODELS))
    parser.add_argument("--src", help="source layout, e.g. 'EP16 DP2 PP4'")
    parser.add_argument("--dst", help="destination layout, e.g. 'TP8 DP16'")
    parser.add_argument("--topology", choices=sorted(PROFILES), help="default: h100")
    parser.add_argument(
        "--src-devices", type=_positive(int), help="source GPUs (fills an unwritten DP)"
    )
    parser.add_argument("--dst-devices", type=_positive(int), help="destination GPUs")
    parser.add_argument("--colocated", action="store_true", help="same GPUs for both")
    parser.add_argument("--placement", choices=PLACEMENTS, help="default: rack-aligned")
    parser.add_argument(
        "--domain-size", type=_positive(int), help="GPUs per fast domain (override)"
    )
    parser.add_argument("--bucket-mib", type=_positive(float), default=GPU_BUCKET_BYTES / MiB)
    parser.add_argument(
        "--unit-buckets",
        type=_positive(int),
        help="the most buckets a unit spans (default: what jaxreshard.plan takes on GPUs, "
        "schedule.GPU_UNIT_BUCKETS)",
    )
    parser.add_argument(
        "--bytes-per-param",
        type=int,
        choices=(1, 2, 4),
        help="at the destination: 2 for bf16, 1 for fp8, 4 for float32",
    )
    parser.add_argument("--no-fan-out", action="store_true", help="direct sends only")
    parser.add_argument(
        "--materialize",
        action="store_true",
        help="also cut the messages' segments (cut_plan_schedule, as jaxreshard.plan) and time it",
    )
    parser.add_argument(
        "--json", metavar="PATH", type=writable_path, help="write one record per scenario"
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure a CPU profile here and check the model against the executor on the bench "
        "scenarios (8 simulated CPU devices; about 2 minutes)",
    )
    parser.add_argument(
        "--calibrate-device",
        action="store_true",
        help="measure one device's copies, launches and compiles (on a GPU: the figures the GPU "
        "profiles assume), with copies of 1 GiB",
    )
    args = parser.parse_args(argv)
    setup = {  # what --scenario, --all and --calibrate fix themselves
        "--model": args.model,
        "--src": args.src,
        "--dst": args.dst,
        "--topology": args.topology,
        "--src-devices": args.src_devices,
        "--dst-devices": args.dst_devices,
        "--colocated": args.colocated or None,
        "--placement": args.placement,
        "--bytes-per-param": args.bytes_per_param,
        "--domain-size": args.domain_size,
    }
    modes = (
        ("--calibrate-device", args.calibrate_device),
        ("--calibrate", args.calibrate),
        ("--all", args.all),
        ("--scenario", args.scenario),
    )
    chosen = [flag for flag, on in modes if on]
    if len(chosen) > 1:
        parser.error(f"{' and '.join(chosen)}: choose one")
    fixed = chosen[0] if chosen else None
    if fixed is not None:
        given = [name for name, value in setup.items() if value is not None]
        if given:
            parser.error(
                f"{fixed} sets the model, layouts and cluster itself; drop {', '.join(given)} "
                "(or describe a setup with --model, --src and --dst instead)"
            )
    bucket_bytes = args.bucket_mib * MiB
    if not (math.isfinite(bucket_bytes) and ALIGN <= int(bucket_bytes) <= 1 << 48):
        parser.error(f"--bucket-mib: {args.bucket_mib} MiB is not {ALIGN} bytes to 256 TiB")
    if args.calibrate_device:
        return _calibrate_device(args.json)
    if args.calibrate:
        return _calibrate(args.json)
    try:
        records = _run(args, parser)
    except (ValueError, ReshardError) as e:  # a setup that cannot be laid out: say why
        parser.error(str(e))
    if len(records) > 1:
        print(summary(records))
    if args.json:
        _write_json(args.json, records)
    return 0


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: ``kind`` of the text, which must be above 0."""

    def parse(text: str) -> float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """The scenarios or the setup ``args`` ask for, each printed as it is done; their records.

    Each scenario's plan is let go once it is printed: held on, the plans of the scenarios
    before slowed planning the next ones (4,096 GPUs after four held plans: 10.7 s against
    9.0 s with the same four let go, no collections in either; memory, not the collector)."""
    common: dict[str, object] = {
        "bucket_bytes": int(args.bucket_mib * MiB),
        "unit_buckets": args.unit_buckets,
        "fan_out": not args.no_fan_out,
        "materialize": args.materialize,
        "placement": args.placement or "rack-aligned",
    }
    if args.bytes_per_param:
        common["itemsize"] = args.bytes_per_param
    if args.domain_size:
        common["domain_size"] = args.domain_size
    records: list[dict[str, Any]] = []
    if args.all or args.scenario:
        names = [n for n in SCENARIOS if n not in NOT_IN_ALL] if args.all else [args.scenario]
        for name in names:
            r = run_scenario(name, **common)
            print(format_result(r), flush=True)
            print(flush=True)
            records.append(r.record(name))
            del r
        if args.all:
            for name, why in NOT_IN_ALL.items():
                print(f"left out of --all: {name}: {why}", flush=True)
    else:
        if not (args.model and args.src and args.dst):
            parser.error("give --scenario NAME, --all, or --model, --src and --dst")
        r = simulate(
            args.model,
            args.src,
            args.dst,
            args.topology or "h100",
            src_devices=args.src_devices,
            dst_devices=args.dst_devices,
            colocated=args.colocated,
            **common,  # type: ignore[arg-type]
        )
        print(format_result(r))
        records.append(r.record())
    return records


def _calibrate(json_path: str | None) -> int:
    """``--calibrate``: see `jaxreshard.tools.calibrate`. The simulated CPU devices must be
    asked for before JAX starts its backend, which importing it does not do."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    from jaxreshard.tools import calibrate

    record = calibrate.run()
    if json_path:
        _write_json(json_path, record)
    return 0 if all(c["within"] for c in record["checks"]) else 1


def _calibrate_device(json_path: str | None) -> int:
    """``--calibrate-device``: `jaxreshard.tools.calibrate.run_device` on the first device."""
    from jaxreshard.tools import calibrate

    record = calibrate.run_device()
    if json_path:
        _write_json(json_path, record)
    return 0


def _write_json(path: str, record: Any) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
