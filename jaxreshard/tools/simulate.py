"""Plan reshards of real models on virtual GPU clusters and price them with the cost model.

    python -m jaxreshard.simulate --scenario deepseek-v3
    python -m jaxreshard.simulate --all
    python -m jaxreshard.simulate --model llama-3.1-70b --src FSDP64 --dst "TP8 DP8" \\
        --topology h100
    python -m jaxreshard.simulate --scenario deepseek-v3 --materialize  # + build_schedule time

Nothing runs on a device (importing the package still loads JAX): layouts are built on integer
device ids, the planner and scheduler run as `jaxreshard.plan` runs them, and
`jaxreshard.costmodel` prices the schedule, the lower bound and the baselines.

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
- ``EP``: experts are split over EP ranks (then not over TP: expert TP is 1). When EP equals the
  product of the innermost non-pipeline axes it is folded over them (Megatron's MoE parallel
  folding: "TP2 EP16 PP4" on 64 GPUs has DP8 x TP2 = 16 expert ranks per stage); otherwise it
  is a mesh axis of its own.
- ``FSDP``: every parameter is split on its first per-layer dimension that divides evenly
  (PyTorch FSDP2 shards dimension 0 of each parameter).
- ``DP``, ``CP``: replicas (context parallelism does not split parameters). With an explicit
  device count, a DP that is not written fills the remaining factor.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import resource
import sys
import time
from collections.abc import Callable, Sequence

from jaxreshard.planning.layout import Layout
from jaxreshard.planning.route import LeafSpec
from jaxreshard.planning.route import route as assign
from jaxreshard.planning.schedule import (
    PlanStats,
    RoundPlan,
    build_schedule,
    plan_rounds,
    plan_stats,
)
from jaxreshard.planning.topology import PROFILES, Topology
from jaxreshard.tools import costmodel

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
    """

    name: str
    shape: tuple[int, ...]
    layers: tuple[int, int] | None = None
    tp_dim: int | None = None
    tp_unit: int = 1
    expert_dim: int | None = None
    stage: str | None = None


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
    A = (0, L)
    out = [
        Param("attn.norm", (L, h), layers=A),
        Param("attn.q", (L, h, heads * head_dim), layers=A, tp_dim=2, tp_unit=head_dim),
        Param("attn.k", (L, h, kv_heads * head_dim), layers=A, tp_dim=2, tp_unit=head_dim),
        Param("attn.v", (L, h, kv_heads * head_dim), layers=A, tp_dim=2, tp_unit=head_dim),
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


def deepseek_v3() -> Model:
    """DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): 61 layers, hidden 7168, the first 3
    dense (intermediate 18432), then 256 routed + 1 shared experts (moe_intermediate 2048) with a
    router and its correction bias; MLA with q_lora_rank 1536, kv_lora_rank 512, 128 heads,
    qk_nope 128, qk_rope 64, v_head 128; vocab 129280, untied. The multi-token-prediction layer
    is not part of the 671B and is left out."""
    L, h, dense, vocab = 61, 7168, 3, 129280
    heads, q_rank, kv_rank, nope, rope, v_dim = 128, 1536, 512, 128, 64, 128
    experts, moe_inter, dense_inter = 256, 2048, 18432
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
    return Model("DeepSeek-V3", L, tuple(params), "deepseek-ai/DeepSeek-V3 config.json")


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
        size[key] = int(n)
    ep = size.pop("ep", 1)
    base = math.prod(size.values())
    if devices is not None and base * ep != devices:
        if devices % base:
            raise ValueError(f"layout {text!r} does not fit {devices} devices")
        size["dp"] = size.get("dp", 1) * (devices // base)  # the DP left unwritten
    ep_axes: tuple[str, ...] = ("ep",)
    if ep > 1:
        inner = [a for a in reversed(MESH_ORDER) if a in size and a != "pp" and size[a] > 1]
        product = 1
        for i, a in enumerate(inner):
            product *= size[a]
            if product == ep:
                ep_axes = tuple(reversed(inner[: i + 1]))
                break
        if ep_axes == ("ep",):
            size["ep"] = ep
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
            box[param.expert_dim] = _part(box[param.expert_dim], strategy.ep, rank, 1, param)
        tp = size.get("tp", 1)
        if tp > 1 and param.tp_dim is not None and not split_experts:
            box[param.tp_dim] = _part(box[param.tp_dim], tp, coord["tp"], param.tp_unit, param)
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


def _part(span: tuple[int, int], ways: int, rank: int, unit: int, param: Param) -> tuple[int, int]:
    """Part ``rank`` of ``ways`` of ``span``, in whole units; with fewer units than ways, each
    unit is replicated over ``ways / units`` consecutive ranks (KV heads under vLLM's TP)."""
    start, stop = span
    units, rest = divmod(stop - start, unit)
    if rest:
        raise ValueError(f"{param.name}: extent {stop - start} is not a multiple of {unit}")
    if units % ways == 0:
        per = units // ways * unit
        return (start + rank * per, start + (rank + 1) * per)
    if ways % units == 0:
        u = rank * units // ways
        return (start + u * unit, start + (u + 1) * unit)
    raise ValueError(f"{param.name}: {units} units cannot be split {ways} ways")


# -------------------------------------------------------------------------------- scenarios


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A published reshard setup to reproduce."""

    name: str
    model: str
    src: str
    dst: str
    topology: str
    src_devices: int | None = None
    dst_devices: int | None = None
    colocated: bool = False
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
                "NCCL M2N on GB200 NVL72, 128 -> 128 GPUs: 1447 ms (direct point-to-point: "
                "3838 ms). NeMo-RL refit, H100, PP16xEP16 -> TP32xDP8 (another setup): 2.4-2.8 s"
            ),
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
                "(direct point-to-point: 2175 ms)"
            ),
            note="trainer CP2 x DP4 modeled as DP8 (context parallelism does not split weights)",
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
    )
}

# ------------------------------------------------------------------------------- simulation


@dataclasses.dataclass(frozen=True)
class Result:
    """Everything the table reports for one simulated reshard."""

    title: str
    model: Model
    src: Strategy
    dst: Strategy
    topology: Topology
    stats: PlanStats
    rounds: RoundPlan
    cost: costmodel.ScheduleCost
    bound: costmodel.LowerBound
    allgather_broadcast: float
    rank0_broadcast: float
    direct: float
    planning_seconds: float
    full_planning_seconds: float | None
    peak_rss_bytes: int
    stages: dict[int, int]
    published: str
    note: str


def simulate(
    model_name: str,
    src: str,
    dst: str,
    topology_name: str,
    *,
    src_devices: int | None = None,
    dst_devices: int | None = None,
    colocated: bool = False,
    domain_size: int | None = None,
    bucket_bytes: int = GPU_BUCKET_BYTES,
    itemsize: int = 2,
    fan_out: bool = True,
    materialize: bool = False,
    title: str = "",
    published: str = "",
    note: str = "",
) -> Result:
    """Plan ``model_name`` from layout ``src`` to ``dst`` on a virtual cluster and price it.

    Source devices are ids ``0 ..``; destination devices follow them, or are the same ids
    when ``colocated``.

    Planning time covers layouts, sender choice and fan-out (`topology.assign`), chunk sizes
    and round colouring (`schedule.plan_rounds`) and `plan_stats`; not the cost model's work.
    `plan_rounds` makes exactly the rounds, slot sizes and buckets `build_schedule` (and so
    `jaxreshard.plan`) makes, without cutting pieces into each message's segments, which the
    cost model does not need. With ``materialize``, `build_schedule` runs too (its stats are
    checked equal) and ``full_planning_seconds`` is what `jaxreshard.plan` would spend.
    """
    if model_name not in MODELS:
        raise ValueError(f"unknown model {model_name!r}; known: {sorted(MODELS)}")
    model = MODELS[model_name]()
    s = parse_strategy(src, src_devices)
    d = parse_strategy(dst, dst_devices)
    src_ids = list(range(s.num_devices))
    first_dst = 0 if colocated else s.num_devices
    dst_ids = list(range(first_dst, first_dst + d.num_devices))
    total = max(src_ids + dst_ids) + 1
    topo = Topology.profile(topology_name, total, domain_size=domain_size)
    dtype = {1: "int8", 2: "bfloat16", 4: "float32"}.get(itemsize, f"{itemsize}-byte")
    start = time.perf_counter()
    leaves = [
        LeafSpec(
            p.name,
            layout(p, model, s, src_ids),
            layout(p, model, d, dst_ids),
            dtype,
            dtype,
            itemsize,
        )
        for p in model.params
    ]
    assignment = assign(leaves, topo, fan_out=fan_out)
    options = {
        "bucket_bytes": bucket_bytes,
        "link_class": topo.link_class,
        "class_latency_bytes": topo.class_latency_bytes(),
    }
    rounds = plan_rounds(leaves, assignment.pieces, **options)  # type: ignore[arg-type]
    stats = plan_stats(leaves, assignment, rounds, crosses=topo.crosses)
    planning = time.perf_counter() - start
    full_seconds = None
    if materialize:  # also cut every message's segments, as jaxreshard.plan does
        start = time.perf_counter()
        schedule = build_schedule(leaves, assignment.pieces, **options)  # type: ignore[arg-type]
        full_seconds = planning + time.perf_counter() - start
        assert plan_stats(leaves, assignment, schedule, crosses=topo.crosses) == stats
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stages: dict[int, int] = {}
    for p in assignment.pieces:
        stages[p.stage] = stages.get(p.stage, 0) + 1
    return Result(
        title=title or f"{model.name}: {src} -> {dst}",
        model=model,
        src=s,
        dst=d,
        topology=topo,
        stats=stats,
        rounds=rounds,
        cost=costmodel.schedule_cost(rounds, topo),
        bound=costmodel.lower_bound(leaves, topo),
        allgather_broadcast=costmodel.allgather_broadcast(leaves, topo),
        rank0_broadcast=costmodel.rank0_broadcast(leaves, topo),
        direct=costmodel.direct(leaves, topo, chunk_bytes=bucket_bytes),
        planning_seconds=planning,
        full_planning_seconds=full_seconds,
        peak_rss_bytes=peak,
        stages=stages,
        published=published,
        note=note,
    )


def run_scenario(name: str, **overrides: object) -> Result:
    """`simulate` one of `SCENARIOS` by name."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {sorted(SCENARIOS)}")
    sc = SCENARIOS[name]
    kwargs: dict[str, object] = {
        "src_devices": sc.src_devices,
        "dst_devices": sc.dst_devices,
        "colocated": sc.colocated,
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
    s, c, b = r.stats, r.cost, r.bound
    domains = len({r.topology.domain_of[i] for i in r.topology.devices})
    relayed = s.bytes_relayed
    intra_direct = s.bytes_sent - s.bytes_cross_domain - relayed
    rows = [
        ("model", f"{r.model.name}, {r.model.num_params / 1e9:,.1f} B parameters "
                  f"({len(r.model.params)} stacked leaves), {r.model.source}"),
        ("layouts", f"{r.src.text} ({r.src.num_devices} GPUs) -> {r.dst.text} "
                    f"({r.dst.num_devices} GPUs)"),
        ("topology", f"{r.topology.name}: {len(r.topology.devices)} GPUs in {domains} domains, "
                     f"{r.topology.intra_bandwidth / 1e9:g} GB/s inside, "
                     f"{r.topology.inter_bandwidth / 1e9:g} GB/s across, per GPU per direction"),
        ("modeled time", _ms(c.seconds)),
        ("lower bound", f"{_ms(b.seconds)}  (modeled / bound = {c.seconds / b.seconds:.3f}; "
                        f"binding: {b.binding})" if b.seconds else _ms(0)),
        ("all-gather + broadcast", _speedup(r.allgather_broadcast, c.seconds)),
        ("rank-0 broadcast", _speedup(r.rank0_broadcast, c.seconds)),
        ("direct p2p (no balance)", _speedup(r.direct, c.seconds)),
        ("bytes: destination", f"{_gb(s.bytes_total)} total, {_gb(s.bytes_local)} already local"),
        ("bytes: sent", f"{_gb(s.bytes_sent)} (= lower bound {_gb(s.bytes_lower_bound)}: "
                        f"{s.bytes_sent == s.bytes_lower_bound})"),
        ("bytes: per link class", f"cross-domain {_gb(s.bytes_cross_domain)} "
                                  f"(must cross: {_gb(b.bytes_cross_needed)}), intra-domain "
                                  f"direct {_gb(intra_direct)}, intra-domain relayed "
                                  f"{_gb(relayed)}"),
        ("bytes: wire", f"{_gb(c.wire_bytes_cross)} cross + {_gb(c.wire_bytes_intra)} intra "
                        f"(padding {(s.bytes_wire - s.bytes_sent) / max(1, s.bytes_sent):.2%})"),
        ("rounds", f"{c.rounds} ({c.slow_rounds} with cross-domain messages) in {s.buckets} "
                   f"buckets, chunk {s.chunk_bytes / MiB:.1f} MiB; pieces per stage {r.stages}"),
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
    return f"{_ms(baseline)}  (plan is {baseline / ours:.1f}x faster)" if ours else _ms(baseline)


def summary(results: Sequence[Result]) -> str:
    """One line per scenario: modeled, bound, ratio, baselines."""
    head = (
        f"{'scenario':<36} {'modeled':>11} {'bound':>11} {'ratio':>6} {'AG+bcast':>11} "
        f"{'x':>6} {'rank0':>11} {'direct':>11} {'plan s':>7}"
    )
    lines = [head]
    for r in results:
        ratio = r.cost.seconds / r.bound.seconds if r.bound.seconds else 1.0
        ag = r.allgather_broadcast / r.cost.seconds if r.cost.seconds else float("inf")
        lines.append(
            f"{r.title.split(':')[0]:<36} {_ms(r.cost.seconds):>11} {_ms(r.bound.seconds):>11} "
            f"{ratio:>6.3f} {_ms(r.allgather_broadcast):>11} {ag:>6.1f} "
            f"{_ms(r.rank0_broadcast):>11} {_ms(r.direct):>11} {r.planning_seconds:>7.2f}"
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
    parser.add_argument("--topology", choices=sorted(PROFILES), default="h100")
    parser.add_argument("--src-devices", type=int, help="source GPUs (fills an unwritten DP)")
    parser.add_argument("--dst-devices", type=int, help="destination GPUs")
    parser.add_argument("--colocated", action="store_true", help="same GPUs for both")
    parser.add_argument("--domain-size", type=int, help="GPUs per fast domain (override)")
    parser.add_argument("--bucket-mib", type=float, default=GPU_BUCKET_BYTES / MiB)
    parser.add_argument("--bytes-per-param", type=int, default=2, help="2 for bf16")
    parser.add_argument("--no-fan-out", action="store_true", help="direct sends only")
    parser.add_argument(
        "--materialize",
        action="store_true",
        help="also cut the messages' segments (build_schedule, as jaxreshard.plan) and time it",
    )
    args = parser.parse_args(argv)
    common: dict[str, object] = {
        "bucket_bytes": int(args.bucket_mib * MiB),
        "itemsize": args.bytes_per_param,
        "fan_out": not args.no_fan_out,
        "materialize": args.materialize,
    }
    if args.domain_size:
        common["domain_size"] = args.domain_size
    results = []
    if args.all or args.scenario:
        for name in sorted(SCENARIOS) if args.all else [args.scenario]:
            results.append(run_scenario(name, **common))
            print(format_result(results[-1]), flush=True)
            print(flush=True)
    else:
        if not (args.model and args.src and args.dst):
            parser.error("give --scenario NAME, --all, or --model, --src and --dst")
        results.append(
            simulate(
                args.model,
                args.src,
                args.dst,
                args.topology,
                src_devices=args.src_devices,
                dst_devices=args.dst_devices,
                colocated=args.colocated,
                **common,  # type: ignore[arg-type]
            )
        )
        print(format_result(results[-1]))
    if len(results) > 1:
        print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
