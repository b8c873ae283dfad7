"""Which devices share a fast domain and how fast their links are.

A *fast domain* is a set of devices joined by a fast fabric (an NVLink island of 8 H100s, a
GB200 NVL72 rack of 72 GPUs, a TPU slice); between domains bytes cross a slower network (one
400 Gb/s NIC per GPU on the clusters modeled here). A `Topology` records, for integer device
ids, the domain and host of each device and the per-device bandwidth inside and across domains.
It is pure data (hashable, comparable), built from JAX devices (`Topology.from_devices`, the
default of every plan), from groups declared by hand (`Topology.from_groups`, e.g. to treat
4 + 4 of the 8 CPU test devices as two domains), or from a named cluster profile for virtual
clusters (`Topology.profile`). `jaxreshard.planning.route` plans with it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from jaxreshard.errors import ReshardError

GB = 1e9
"""Bandwidths are in bytes per second; vendors quote GB/s with GB = 10**9 bytes."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """A cluster kind: its fabric, and the costs a transfer pays beyond the wire.

    The first group of fields is what the planner uses (through `Topology`); the second is what
    `jaxreshard.tools.costmodel` adds to price an executor's run of a plan. ``sources`` says,
    per field, where its figure comes from (a datasheet, a measurement, or an assumption).

    Attributes:
      name: the profile's name.
      domain_size: devices per fast domain (NVLink island, NVL72 rack).
      host_size: devices per host (process).
      intra_bandwidth: peak bytes/s per device per direction inside a domain.
      inter_bandwidth: peak bytes/s per device per direction across domains (its NIC).
      round_latency: fixed seconds of one collective-permute round (launch and handshake).
      source: the fabric figures' provenance, in one sentence or two.
      intra_efficiency: the fraction of ``intra_bandwidth`` a large message reaches.
      inter_efficiency: the same for ``inter_bandwidth``.
      copy_bandwidth: bytes/s one device copies between its buffers (pack into staging,
        unpack out of it): each byte is read once and written once.
      host_copy_bandwidth: bytes/s all devices of one host copy together, when they share a
        memory system and cores (CPU devices); None when each device has its own (GPUs).
      narrow_copy_bandwidth: the same for elements narrower than 4 bytes (bf16, fp8), and for
        casts; None: as ``copy_bandwidth``. Like ``copy_overhead``, per device, or per host
        where ``host_copy_bandwidth`` says the host's devices share it.
      contiguous_copy_bandwidth: the same as ``copy_bandwidth`` (per device, or per host where
        ``host_copy_bandwidth`` says the host's devices share it) for a box that is one
        contiguous run of the shard it reads or writes (whole rows), of wide elements or of
        narrow ones copied without a cast: on CPU such a copy runs about twice as fast as a
        box of 16 KiB rows of float32, and 3x a box of bf16 half rows. None: as any other box.
      copy_overhead: seconds per box copied (one per piece in pack, and in unpack), beyond its
        bytes.
      run_overhead: seconds per contiguous run (a row, in C order) a box copy reads or writes
        in a shard, beyond its bytes: a box of half the columns of a matrix is copied row by
        row, and short rows copy far below the streaming speed on CPU. Pack counts the runs
        it reads, unpack those it writes. Per device, or per host like ``copy_overhead``.
      host_link_bandwidth: bytes/s all messages between devices of one host carry together
        when they share the host's cores (CPU devices); None for GPUs.
      launch_overhead: seconds a device idles per program it runs (three per bucket: pack,
        transfer, unpack).
      bucket_overhead: seconds of host work per bucket (dispatching its programs).
      argument_overhead: seconds of host work per array a bucket's programs take (leaves'
        shards and staging buffers, wrapped and checked on every call).
      host_runs_ahead: whether the host dispatches buckets while the devices still run
        earlier ones (GPUs: the executor never waits between buckets), so a bucket costs the
        longer of its host and device times; else (CPU) the two add.
      overlap_links: whether a device's NIC and NVLink transfers can run at the same time
        (separate engines on GPUs). The physical bound assumes it, and so do the baselines
        that are single NCCL collectives or groups (their kernels drive both links at once).
      permutes_overlap: whether the backend keeps a transfer program's independent
        collective-permutes in flight at once, so that (with ``overlap_links``) a bucket's
        cross-domain rounds run beside its rounds inside domains: two lanes. Else every round
        runs in turn, and a device takes one message at a time. XLA GPU compiles them
        synchronous, one after another (checked on one H200, see `PROFILES`' sources).
      sources: ``(field, where its figure comes from)`` for every field above but ``source``.
    """

    name: str
    domain_size: int
    host_size: int
    intra_bandwidth: float
    inter_bandwidth: float
    round_latency: float
    source: str
    intra_efficiency: float = 1.0
    inter_efficiency: float = 1.0
    copy_bandwidth: float = float("inf")
    host_copy_bandwidth: float | None = None
    narrow_copy_bandwidth: float | None = None
    contiguous_copy_bandwidth: float | None = None
    copy_overhead: float = 0.0
    run_overhead: float = 0.0
    host_link_bandwidth: float | None = None
    launch_overhead: float = 0.0
    bucket_overhead: float = 0.0
    argument_overhead: float = 0.0
    host_runs_ahead: bool = True
    overlap_links: bool = True
    permutes_overlap: bool = False
    sources: tuple[tuple[str, str], ...] = ()

    def source_of(self, field: str) -> str:
        """Where ``field``'s figure comes from."""
        return dict(self.sources).get(field, self.source)


_NCCL_EFFICIENCY = (
    "assumption: nccl-tests sendrecv/alltoall bus bandwidth reaches 80-90% of link peak on "
    "large messages (NVLink {intra}, InfiniBand/RoCE 400 Gb/s {inter})"
)
_LAUNCH = "assumption: CUDA kernel launch latency, ~5 us per program"
_H200 = (
    "measured on one H200 (jax 0.11.2, `python -m jaxreshard.simulate --calibrate-device`, two "
    "runs)"
)
_BUCKET = (
    f"{_H200}: dispatching a jitted program takes 25-29 us of the host; ~9 dispatches per host "
    "per bucket, 260 us taken. The executor never waits between buckets on GPUs, so this "
    "overlaps the devices' work"
)

COPY_EFFICIENCY = 0.61
"""The fraction of HBM peak over two (a copy reads and writes each byte) that a pack's or
unpack's box copy reaches: 1,455 and 1,481 GB/s on an H200 (4.8 TB/s), float32 rows of 16 KiB
copied into a donated buffer (`jaxreshard.tools.calibrate.measure_device`)."""

NARROW_COPY_EFFICIENCY = 0.44
"""The same for a casting bf16 pack and a bf16 unpack (bf16 bytes counted): 1,049 and
1,082 GB/s on the same H200."""

_GPU_OVERHEADS: dict[str, float] = {
    "intra_efficiency": 0.85,
    "inter_efficiency": 0.90,
    "copy_overhead": 1.2e-6,
    "launch_overhead": 5e-6,
    "bucket_overhead": 260e-6,
    "argument_overhead": 3.4e-6,
}
"""The overheads every GPU profile shares (their sources: `_gpu_sources`)."""


_PERMUTES = (
    "checked on one H200 with jax 0.11.2, programs over 8 GPUs compiled through JAX's mock "
    "GPU topology (scripts/gpu/mock_gpus_options.py): XLA GPU compiles every "
    "collective-permute of a transfer program, and of a plain program of two independent "
    "ppermutes, synchronous, one after another on one stream, with or without "
    "xla_gpu_experimental_parallel_collective_overlap_limit=2, the latency-hiding "
    "scheduler's options or a scheduling group (its latency estimate of a collective-permute "
    "is a kernel launch, so it sees nothing to gain)"
)


def _gpu_copies(hbm: float) -> dict[str, float]:
    """The copy speeds of a GPU of ``hbm`` bytes/s of HBM peak: the H200's measured fractions
    (`COPY_EFFICIENCY`, `NARROW_COPY_EFFICIENCY`)."""
    return {
        "copy_bandwidth": COPY_EFFICIENCY * hbm / 2,
        "narrow_copy_bandwidth": NARROW_COPY_EFFICIENCY * hbm / 2,
    }


def _gpu_sources(hbm: str) -> tuple[tuple[str, str], ...]:
    """The sources of a GPU profile's figures; only the HBM datasheet differs between them."""
    efficiency = _NCCL_EFFICIENCY.format(
        intra=f"{_GPU_OVERHEADS['intra_efficiency']:.0%}",
        inter=f"{_GPU_OVERHEADS['inter_efficiency']:.0%}",
    )
    return (
        ("round_latency", "assumption: nccl-tests small-message latency is ~10-20 us"),
        ("intra_efficiency", efficiency),
        ("inter_efficiency", efficiency),
        (
            "copy_bandwidth",
            f"{hbm}; a copy reads and writes each byte, at {COPY_EFFICIENCY:.0%} of peak / 2: "
            f"{_H200}, float32 rows of 16 KiB into a donated buffer (the same fraction assumed "
            "here)",
        ),
        ("host_copy_bandwidth", "GPUs copy with their own HBM: no shared limit"),
        (
            "narrow_copy_bandwidth",
            f"{NARROW_COPY_EFFICIENCY:.0%} of HBM peak / 2: {_H200}, a casting bf16 pack and a "
            "bf16 unpack (the same fraction assumed here)",
        ),
        (
            "copy_overhead",
            f"{_H200}: 1.1-1.3 us per box of a pack-like program (512 boxes against 64)",
        ),
        (
            "run_overhead",
            f"{_H200}: rows of 256 bytes copy as fast as rows of 16 KiB (0.00-0.01 ns a row)",
        ),
        ("host_link_bandwidth", "GPUs send through their own links: no shared limit"),
        ("launch_overhead", _LAUNCH),
        ("bucket_overhead", _BUCKET),
        ("argument_overhead", f"{_H200}: 3.0-3.8 us per array a program takes"),
        ("host_runs_ahead", "jaxreshard.run.runtime: no host sync between steps on GPUs"),
        (
            "overlap_links",
            "NVLink and the NIC are separate engines (the physical bound; NCCL's own "
            "collectives drive both at once)",
        ),
        ("permutes_overlap", _PERMUTES),
    )


PROFILES: dict[str, Profile] = {
    "h100": Profile(
        name="h100",
        domain_size=8,
        host_size=8,
        intra_bandwidth=450 * GB,
        inter_bandwidth=50 * GB,
        round_latency=20e-6,
        source=(
            "NVIDIA H100 SXM5 datasheet: NVLink 4 at 900 GB/s per GPU, both directions together "
            "(450 GB/s each way), 8 GPUs per NVSwitch domain (DGX/HGX H100). DGX H100 user "
            "guide: 8 ConnectX-7 NICs at 400 Gb/s, one per GPU (50 GB/s each way per GPU)."
        ),
        **_gpu_copies(3350 * GB),
        **_GPU_OVERHEADS,  # type: ignore[arg-type]
        sources=_gpu_sources("H100 SXM5 datasheet: HBM3 3.35 TB/s"),
    ),
    "cpu": Profile(
        name="cpu",
        domain_size=8,
        host_size=8,
        intra_bandwidth=1.4 * GB,
        inter_bandwidth=1.0 * GB,
        round_latency=350e-6,
        source=(
            "Measured on this project's 2-core machine: JAX's CPU backend with 8 simulated "
            "devices, a collective-permute round of 4 pairs into donated buffers takes about "
            "0.35 ms plus 1.4 GB/s per device (64 KiB to 8 MiB messages). Across processes "
            "(gloo over loopback) a rough 1 GB/s per device."
        ),
        copy_bandwidth=12 * GB,
        host_copy_bandwidth=12 * GB,
        host_link_bandwidth=5.6 * GB,
        bucket_overhead=1.0e-3,
        host_runs_ahead=False,
        overlap_links=False,
        sources=(
            (
                "copy_bandwidth",
                "measured here (DESIGN.md): a dynamic_update_slice into a "
                "donated buffer copies ~12 GB/s; `python -m jaxreshard.simulate "
                "--calibrate` measures it again",
            ),
            (
                "host_copy_bandwidth",
                "measured here: the 2 cores are shared by all 8 devices, "
                "so they copy ~12 GB/s together, not each",
            ),
            ("host_link_bandwidth", "measured here: 4 pairs at 1.4 GB/s each"),
            (
                "narrow_copy_bandwidth",
                "XLA CPU moves bf16 through bit-casts (DESIGN.md); `--calibrate` measures it",
            ),
            ("copy_overhead", "`--calibrate` measures it: many small copies against one"),
            (
                "run_overhead",
                "`--calibrate` measures it: a box of 256-byte rows against one of 16 KiB rows",
            ),
            (
                "bucket_overhead",
                "measured here: ~1 ms per bucket of launches and host work "
                "(`--calibrate` measures it again)",
            ),
            (
                "overlap_links",
                "CPU devices share the host's cores: nothing runs in parallel beyond them",
            ),
            ("permutes_overlap", "the executor waits for each step on CPU: rounds in turn"),
        ),
    ),
    "gb200-nvl72": Profile(
        name="gb200-nvl72",
        domain_size=72,
        host_size=4,
        intra_bandwidth=900 * GB,
        inter_bandwidth=50 * GB,
        round_latency=20e-6,
        source=(
            "NVIDIA GB200 NVL72 specifications: 72 Blackwell GPUs in one NVLink 5 domain at "
            "1.8 TB/s per GPU, both directions together (900 GB/s each way); 18 compute trays "
            "of 4 GPUs (one host each), one ConnectX-7 400 Gb/s NIC per GPU for the scale-out "
            "network (50 GB/s each way per GPU)."
        ),
        **_gpu_copies(8000 * GB),
        **_GPU_OVERHEADS,  # type: ignore[arg-type]
        sources=_gpu_sources("GB200 NVL72 specifications: HBM3e 8 TB/s per GPU"),
    ),
}
"""Named cluster profiles. The fabric figures are datasheet peaks; the efficiencies, copy
speeds and per-bucket costs say what a transfer reaches in practice, each with its source."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """Fast domains, hosts and link bandwidths of a set of integer device ids.

    Attributes:
      devices: device ids.
      domains: ``domains[i]`` is the fast domain of ``devices[i]`` (any integer label).
      hosts: ``hosts[i]`` is the host (process) of ``devices[i]``.
      intra_bandwidth: bytes/s one device sends (and, at the same time, receives) to another
        device of its domain.
      inter_bandwidth: bytes/s one device sends (and receives) to a device of another domain.
      round_latency: seconds of fixed cost per collective-permute round (cost model only).
      name: a label for reports.

    Hashable and comparable (it is part of `jaxreshard.reshard`'s plan cache key). Building one
    allocates nothing on any device.
    """

    devices: tuple[int, ...]
    domains: tuple[int, ...]
    hosts: tuple[int, ...]
    intra_bandwidth: float
    inter_bandwidth: float
    round_latency: float = 20e-6
    name: str = "custom"

    def __post_init__(self) -> None:
        if not len(self.devices) == len(self.domains) == len(self.hosts):
            raise ReshardError("a topology needs one domain and one host per device")
        if len(set(self.devices)) != len(self.devices):
            raise ReshardError(f"a device appears twice in the topology: {self.devices}")
        bandwidths = (self.intra_bandwidth, self.inter_bandwidth)
        if not all(0 < b < math.inf for b in bandwidths):  # (NaN fails both)
            raise ReshardError(
                f"bandwidths must be positive and finite (bytes per second), got {bandwidths}"
            )
        if not 0 <= self.round_latency < math.inf:
            raise ReshardError(
                f"round_latency must be finite and >= 0 seconds, got {self.round_latency}"
            )

    # ------------------------------------------------------------------------- construction

    @classmethod
    def from_groups(
        cls,
        groups: Iterable[Iterable[Any]],
        *,
        intra_bandwidth: float = PROFILES["h100"].intra_bandwidth,
        inter_bandwidth: float = PROFILES["h100"].inter_bandwidth,
        round_latency: float = PROFILES["h100"].round_latency,
        hosts: Iterable[Iterable[Any]] | None = None,
        name: str = "custom",
    ) -> Topology:
        """Declare domains by hand: each group (device ids or JAX devices) is one fast domain.

        ``hosts`` groups devices by host the same way; by default each domain is one host.
        Example: ``Topology.from_groups([devs[:4], devs[4:]])`` makes the 8 CPU test devices
        two domains of 4, so a plan over them routes and fans out as on two GPU nodes.
        """
        domain_lists = [[_device_id(d) for d in group] for group in groups]
        host_lists = domain_lists if hosts is None else [[_device_id(d) for d in g] for g in hosts]
        host_of: dict[int, int] = {}
        for h, group in enumerate(host_lists):
            for d in group:
                if host_of.setdefault(d, h) != h and hosts is not None:
                    raise ReshardError(f"hosts= places device {d} on two hosts")
        devices, domains = [], []
        for g, group in enumerate(domain_lists):
            for d in group:
                devices.append(d)
                domains.append(g)
        missing = [d for d in devices if d not in host_of]
        if missing:
            raise ReshardError(f"hosts= does not place devices {missing}")
        return cls(
            tuple(devices),
            tuple(domains),
            tuple(host_of[d] for d in devices),
            float(intra_bandwidth),
            float(inter_bandwidth),
            float(round_latency),
            name,
        )

    @classmethod
    def from_devices(
        cls,
        devices: Iterable[Any],
        *,
        intra_bandwidth: float | None = None,
        inter_bandwidth: float | None = None,
        round_latency: float | None = None,
        name: str = "from-devices",
    ) -> Topology:
        """The topology JAX reports: a device's domain is its ``slice_index`` when it has one
        (TPU slices; multi-node NVLink GPUs), else its ``process_index`` (one host, one domain);
        its host is its ``process_index``. CPU devices always take their process as domain
        (under ``jax.distributed`` they may report one ``slice_index`` for every host, but only
        the devices of one process share memory). Bandwidths are not discoverable: they
        default to the `cpu` profile on CPU devices and to the `h100` profile's otherwise; pass
        the right ones for other hardware.
        """
        devices = list(devices)
        default = PROFILES["cpu" if devices and devices[0].platform == "cpu" else "h100"]
        hosts = tuple(int(d.process_index) for d in devices)
        domains = tuple(
            int(s)
            if d.platform != "cpu" and (s := getattr(d, "slice_index", None)) is not None
            else h
            for d, h in zip(devices, hosts, strict=True)
        )
        return cls(
            tuple(int(d.id) for d in devices),
            domains,
            hosts,
            float(default.intra_bandwidth if intra_bandwidth is None else intra_bandwidth),
            float(default.inter_bandwidth if inter_bandwidth is None else inter_bandwidth),
            float(default.round_latency if round_latency is None else round_latency),
            name,
        )

    @classmethod
    def profile(
        cls,
        name: str,
        num_devices: int | None = None,
        *,
        domain_size: int | None = None,
        first_device: int = 0,
        ids: Iterable[int] | None = None,
    ) -> Topology:
        """A virtual cluster of a named kind (`PROFILES`).

        Device ids are slots of a cluster whose domains of ``domain_size`` (default: the
        profile's) and hosts (the profile's host size, or the domain's where that is smaller:
        a host never spans two domains) are numbered in order. Give either ``num_devices``
        (ids ``first_device ..``, consecutive; domains and hosts counted from
        ``first_device``: slot ``first_device + i`` is in domain ``i // domain_size``) or
        ``ids`` (any slots, counted from 0: slot ``i`` is in domain ``i // domain_size``, e.g.
        a trainer on racks 0-1 and a sampler starting on rack 2: rack-aligned placement).
        """
        if name not in PROFILES:
            raise ReshardError(f"unknown topology profile {name!r}; known: {sorted(PROFILES)}")
        if (num_devices is None) == (ids is None):
            raise ReshardError("give num_devices or ids")
        p = PROFILES[name]
        size = p.domain_size if domain_size is None else int(domain_size)
        if size < 1:
            raise ReshardError(f"domain_size must be at least 1 device, got {domain_size}")
        host = min(p.host_size, size)
        if ids is None:
            assert num_devices is not None
            slots = tuple(range(first_device, first_device + int(num_devices)))
            rel = tuple(i - first_device for i in slots)
        else:
            slots = rel = tuple(int(i) for i in ids)
        label = p.name if size == p.domain_size else f"{p.name} ({size} per domain)"
        return cls(
            slots,
            tuple(i // size for i in rel),
            tuple(i // host for i in rel),
            p.intra_bandwidth,
            p.inter_bandwidth,
            p.round_latency,
            label,
        )

    # ------------------------------------------------------------------------------ queries

    @functools.cached_property
    def domain_of(self) -> dict[int, int]:
        """Device id -> domain label."""
        return dict(zip(self.devices, self.domains, strict=True))

    @functools.cached_property
    def host_of(self) -> dict[int, int]:
        """Device id -> host label."""
        return dict(zip(self.devices, self.hosts, strict=True))

    @functools.cached_property
    def members(self) -> dict[int, tuple[int, ...]]:
        """Domain label -> its device ids, sorted."""
        out: dict[int, list[int]] = defaultdict(list)
        for d, g in zip(self.devices, self.domains, strict=True):
            out[g].append(d)
        return {g: tuple(sorted(ds)) for g, ds in sorted(out.items())}

    def crosses(self, src: int, dst: int) -> bool:
        """Whether bytes from ``src`` to ``dst`` leave a fast domain."""
        return self.domain_of[src] != self.domain_of[dst]

    def tier(self, src: int, dst: int) -> int:
        """A `planner.assign` tier: 0 inside the receiver's domain, 1 across domains."""
        return int(self.crosses(src, dst))

    def link_class(self, src: int, dst: int) -> int:
        """A `schedule.build_schedule` link class: 1 (slow) across domains, 0 inside one."""
        return int(self.crosses(src, dst))

    def class_latency_bytes(self) -> dict[int, int]:
        """Per `link_class`, the round latency in bytes that link moves meanwhile: how
        `schedule.build_schedule` weighs an extra round against padding when sizing chunks."""
        return {
            0: int(self.round_latency * self.intra_bandwidth),
            1: int(self.round_latency * self.inter_bandwidth),
        }

    def bandwidth(self, src: int, dst: int) -> float:
        """Bytes/s of one message from ``src`` to ``dst``."""
        return self.inter_bandwidth if self.crosses(src, dst) else self.intra_bandwidth

    def check_covers(self, device_ids: Iterable[int]) -> None:
        """Raise `ReshardError` naming the devices this topology does not place."""
        missing = sorted(set(device_ids) - set(self.domain_of))
        if missing:
            raise ReshardError(
                f"the topology {self.name!r} does not place devices {missing} (it knows "
                f"{len(self.devices)} devices)\nHow to fix: build it over every device of the "
                "source and destination shardings, e.g. jr.Topology.from_devices(jax.devices()) "
                "or jr.Topology.from_groups([...]) with every device in some group"
            )


def _device_id(d: Any) -> int:
    return int(d.id) if hasattr(d, "id") else int(d)
