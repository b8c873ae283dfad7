"""Resharding on 8 CPU devices: a table of named layout pairs, each checked bit for bit.

Every case moves a random array from a source NamedSharding to a destination NamedSharding
and checks: each destination shard equals NumPy slicing of the source; the result carries the
requested sharding; the source is unchanged; bytes sent equal the lower bound; staging stays
within two buckets. The layout and dtype tables run both ways pieces move: by gathers (small
leaves) and by one copy each (large leaves).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import assert_exact, random_array, sharding
from compiles import COMPILES
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import pack_reads, slot_widths

import jaxreshard as jr
from jaxreshard.planning import schedule
from jaxreshard.planning.lower import contiguous


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]
    src: tuple  # (ids, mesh shape, axis names, *spec)
    dst: tuple
    dtype: str = "float32"


A = tuple(range(4))
B = tuple(range(4, 8))
ALL = tuple(range(8))
CASES = [
    Case(
        "disjoint fsdp2xtp2 -> tp4",
        (64, 32),
        (A, (2, 2), ("fsdp", "tp"), "fsdp", "tp"),
        (B, (4,), ("tp",), None, "tp"),
    ),
    Case(
        "disjoint -> replicated on every sampler device",
        (16, 8),
        (A, (2, 2), ("fsdp", "tp"), "fsdp", "tp"),
        (B, (4,), ("tp",)),
    ),
    Case(
        "replicated source dp2xtp2 -> tp4",
        (32, 16),
        (A, (2, 2), ("dp", "tp"), None, "tp"),
        (B, (4,), ("tp",), "tp"),
    ),
    Case(
        "replicated destination dp2xtp2",
        (32, 16),
        (A, (4,), ("x",), "x"),
        (B, (2, 2), ("dp", "tp"), None, "tp"),
    ),
    Case(
        "colocated, other mesh and device order",
        (64, 32),
        (ALL, (4, 2), ("fsdp", "tp"), "fsdp", "tp"),
        (ALL[::-1], (2, 4), ("dp", "tp"), None, "tp"),
    ),
    Case(
        "identical layouts copy locally",
        (16, 16),
        (A, (2, 2), ("a", "b"), "a", "b"),
        (A, (2, 2), ("a", "b"), "a", "b"),
    ),
    Case(
        "same devices, transposed split",
        (24, 16),
        (A, (4,), ("x",), "x", None),
        (A, (4,), ("x",), None, "x"),
    ),
    Case(
        "overlapping device sets",
        (30, 12),
        ((0, 1, 2, 3, 4, 5), (2, 3), ("a", "b"), "b", "a"),
        ((3, 4, 5, 6, 7), (5,), ("y",), "y"),
    ),
    Case(
        "destination inside the source",
        (16, 16),
        (ALL, (8,), ("x",), "x"),
        ((2, 3, 4, 5), (2, 2), ("a", "b"), "b", "a"),
    ),
    Case(
        "source inside the destination",
        (16, 16),
        ((2, 3), (2,), ("x",), None, "x"),
        (ALL, (2, 4), ("a", "b"), "b", "a"),
    ),
    Case("one device -> eight", (8, 8), ((5,), (1,), ("x",)), (ALL, (8,), ("x",), "x")),
    Case("eight -> one device", (8, 8), (ALL, (2, 4), ("a", "b"), "a", "b"), ((0,), (1,), ("x",))),
    Case(
        "1-axis -> 4-axis mesh, tuple axes",
        (16, 8),
        (ALL, (8,), ("x",), "x"),
        (ALL[::-1], (2, 1, 2, 2), ("a", "b", "c", "d"), ("a", "c"), ("d", "b")),
    ),
    Case(
        "tuple axes change order",
        (32,),
        (A, (2, 2), ("p", "q"), ("p", "q")),
        (A, (2, 2), ("p", "q"), ("q", "p")),
    ),
    Case(
        "3-d array over 3 axes",
        (4, 6, 8),
        (ALL, (2, 2, 2), ("a", "b", "c"), "a", None, ("b", "c")),
        (B, (2, 2), ("x", "y"), None, "x", "y"),
    ),
    Case("scalar", (), (A, (2, 2), ("a", "b")), (B, (4,), ("x",))),
    Case(
        "zero-size array", (0, 8), (A, (2, 2), ("a", "b"), None, "b"), (B, (4,), ("x",), None, "x")
    ),
    Case(
        "vector replicated over fsdp -> tp",
        (64,),
        (A, (2, 2), ("fsdp", "tp"), "tp"),
        (B, (4,), ("tp",), "tp"),
    ),
]
DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "float16",
    "bfloat16",
    "float32",
    "complex64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int4",
    "uint4",
]


def run_case(case: Case, dtype: str | None = None, bucket_bytes: int | None = None):
    dtype = dtype or case.dtype
    host = random_array(case.shape, dtype, seed=len(case.name))
    src_sharding = sharding(*case.src)
    dst = sharding(*case.dst)
    src = jax.device_put(host, src_sharding)
    plan = jr.plan(src, dst, bucket_bytes=bucket_bytes)
    out = plan(src)
    assert_exact(out, host, dst)
    assert_exact(src, host, src_sharding)  # the source is left valid and unchanged
    stats = plan.stats
    assert stats.bytes_sent == stats.bytes_lower_bound
    assert stats.staging_bytes <= 2 * plan.bucket_bytes
    return plan, out


MOVES = {
    "by gathers": None,  # these shapes are small: every leaf moves by gathers
    "by copies": 0,  # every piece a copy of its own, as a large leaf's are
}


@pytest.fixture(params=list(MOVES))
def moves(request, monkeypatch):
    """Each executor test below runs both ways a leaf's pieces can move
    (`schedule.GATHER_BYTES`)."""
    if MOVES[request.param] is not None:
        monkeypatch.setattr(schedule, "GATHER_BYTES", MOVES[request.param])
    return request.param


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_layout_pair(case, moves):
    run_case(case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_is_moved_bit_for_bit(dtype, moves):
    run_case(CASES[4], dtype)  # colocated: local copies and sends in one plan
    small = dataclasses.replace(CASES[0], shape=(16, 8))
    run_case(small, dtype, bucket_bytes=96)  # pieces cut across chunks and buckets


def test_identical_layouts_send_nothing():
    plan, _ = run_case(CASES[5])
    assert plan.stats.bytes_sent == 0 and plan.stats.rounds == 0
    assert plan.stats.bytes_local == plan.stats.bytes_total


def test_two_replicas_each_send_half():
    case = Case("dp2 -> one device", (64, 16), ((0, 1), (2,), ("dp",)), ((2,), (1,), ("x",)))
    plan, _ = run_case(case)
    assert plan.stats.max_device_send_bytes == plan.stats.bytes_lower_bound // 2


def test_a_leaf_larger_than_a_bucket_is_split_across_buckets():
    plan, _ = run_case(CASES[0], bucket_bytes=1024)
    assert plan.stats.buckets > 1
    assert plan.stats.staging_bytes <= 2 * 1024


def test_units_of_several_buckets_are_exact_and_cached_apart():
    """``unit_buckets=N``: consecutive leaves share a unit of up to ``N`` buckets a device
    (CPU's default is 1), so a unit runs in several buckets; values stay exact, staging within
    the bucket, and `jr.reshard` caches the plans of different ``unit_buckets`` apart."""
    hosts = {f"w{i}": random_array((64, 16 * (i + 1)), "float32", seed=i) for i in range(6)}
    src_s, dst_s = sharding(*CASES[0].src), sharding(*CASES[0].dst)
    tree = {k: jax.device_put(v, src_s) for k, v in hosts.items()}
    plans = {n: jr.plan(tree, dst_s, bucket_bytes=1024, unit_buckets=n) for n in (None, 8)}
    assert len(plans[8].schedule.units) < len(plans[None].schedule.units)
    assert max(len(u.leaves) for u in plans[8].schedule.units) > 1
    per_unit = Counter(b.unit for b in plans[8].schedule.buckets)
    assert max(per_unit.values()) > 1
    for p in plans.values():
        out = p(tree)
        for k, host in hosts.items():
            assert_exact(out[k], host, dst_s)
        assert p.stats.staging_bytes <= 2 * 1024
    a = jr.cached_plan(tree, dst_s, bucket_bytes=1024, unit_buckets=8)
    b = jr.cached_plan(tree, dst_s, bucket_bytes=1024)
    assert a is not b and a is jr.cached_plan(tree, dst_s, bucket_bytes=1024, unit_buckets=8)
    assert len(a.schedule.units) == len(plans[8].schedule.units)


def test_a_scalar_larger_than_a_bucket_moves_whole():
    """Regression: a scalar over ``bucket_bytes`` was cut into slabs it has no rows for."""
    src = jax.device_put(np.float32(1.5), sharding(*CASES[0].src[:3]))
    dst = sharding(*CASES[0].dst[:3])
    for bucket_bytes in (4, 3, 1):
        assert_exact(jr.plan(src, dst, bucket_bytes=bucket_bytes)(src), np.float32(1.5), dst)


def test_cast_runs_on_the_senders_and_halves_the_bytes():
    host = random_array((64, 32), "float32")
    src = jax.device_put(host, sharding(*CASES[0].src))
    dst = sharding(*CASES[0].dst)
    full = jr.plan(src, dst)
    half = jr.plan(src, dst, dtype=jnp.bfloat16)
    out = half(src)
    assert_exact(out, host.astype(jnp.bfloat16), dst)
    assert half.stats.bytes_sent * 2 == full.stats.bytes_sent


NARROW_FLOATS = [
    "bfloat16",
    "float16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float4_e2m1fn",
]


@pytest.mark.parametrize("cast", NARROW_FLOATS)
def test_a_cast_gives_the_bits_of_astype_sent_and_copied_locally(cast):
    """The oracle is JAX's own ``astype`` on one device, bit for bit, from every bit pattern
    of float32, bfloat16 and float16 (NaN payloads, -0.0, denormals) and from negative values
    too small for the narrow type. Regression: XLA's older CPU fusion emitters, which the
    copy programs used, turned such negatives into 0x80 (NaN) in the fnuz formats, gave
    other NaN bits for bfloat16 -> float8_e5m2 and float16 -> bfloat16, and could not compile
    a cast to float4_e2m1fn. Moved between disjoint meshes (cast by the senders' packs) and
    onto the same devices (local parts cast by the receivers' unpacks); verified too."""
    one = jax.devices()[0]
    where = {"sent": sharding(*CASES[0].dst), "local": sharding(*(A, (4,), ("x",), None, "x"))}
    src, dst, want = {}, {}, {}
    for source in ("float32", "bfloat16", "float16"):  # one plan: one compile of each program
        host = random_array((16, 8), source, 7)
        host.reshape(-1)[:4] = np.array([-1e-30, -1e-7, -0.0, 1e-30]).astype(host.dtype)
        x = jax.device_put(host, sharding(*CASES[0].src))
        cast_once = np.asarray(jax.jit(lambda v: v.astype(cast))(jax.device_put(host, one)))
        for k, d in where.items():
            src[source, k], dst[source, k], want[source, k] = x, d, cast_once
    out = jr.plan(src, dst, dtype=cast)(src, verify=True)
    for key, d in dst.items():
        assert_exact(out[key], want[key], d)


def test_pytree_with_prefix_shardings_and_dtype_tree():
    host = {
        "layers": [
            {"w": random_array((16, 8), "float32", i), "b": random_array((8,), "float32", i)}
            for i in range(3)
        ],
        "step": np.int32(7),
    }
    src_mesh = CASES[0].src
    src = {
        "layers": [
            {
                "w": jax.device_put(layer["w"], sharding(*src_mesh)),
                "b": jax.device_put(layer["b"], sharding(*src_mesh[:3], "tp")),
            }
            for layer in host["layers"]
        ],
        "step": jax.device_put(host["step"], sharding(*src_mesh[:3])),
    }
    tp = sharding(B, (4,), ("tp",), None, "tp")
    rep = sharding(B, (4,), ("tp",))
    dst = {"layers": [{"w": tp, "b": rep}] * 3, "step": rep}
    out = jr.plan(src, dst, dtype={"layers": jnp.bfloat16, "step": None})(src)
    for i in range(3):
        assert_exact(out["layers"][i]["w"], host["layers"][i]["w"].astype(jnp.bfloat16), tp)
        assert_exact(out["layers"][i]["b"], host["layers"][i]["b"].astype(jnp.bfloat16), rep)
    assert_exact(out["step"], np.asarray(host["step"]), rep)
    one = jr.plan(src, rep)(src)  # one sharding for the whole tree
    assert_exact(one["layers"][2]["w"], host["layers"][2]["w"], rep)


def test_shape_dtype_struct_plans_ahead_of_data():
    src_sharding = sharding(*CASES[0].src)
    dst = sharding(*CASES[0].dst)
    spec = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=src_sharding)
    plan = jr.plan({"w": spec}, {"w": dst})
    host = random_array((64, 32), "float32")
    out = plan({"w": jax.device_put(host, src_sharding)})
    assert_exact(out["w"], host, dst)


def test_donation_reuses_the_previous_destination_buffers():
    host = random_array((64, 32), "float32")
    src = jax.device_put(host, sharding(*CASES[4].src))
    dst = sharding(*CASES[4].dst)
    plan = jr.plan(src, dst)
    first = plan(src)
    pointers = {s.device.id: s.data.unsafe_buffer_pointer() for s in first.addressable_shards}
    host2 = random_array((64, 32), "float32", seed=9)
    second = plan(jax.device_put(host2, src.sharding), donate=first)
    assert first.is_deleted()
    assert_exact(second, host2, dst)
    reused = {s.device.id: s.data.unsafe_buffer_pointer() for s in second.addressable_shards}
    assert reused == pointers


@pytest.mark.parametrize("context", ["source mesh", "destination mesh", "explicit mesh"])
def test_a_plan_runs_inside_a_mesh_context(context):
    """``jax.set_mesh(trainer_mesh)`` around a refit (how explicit sharding runs) leaves the
    plan's own programs alone: calls, donated calls, starts, verification and `jr.reshard`."""
    host = random_array((64, 32), "float32")
    src_sharding, dst = sharding(*CASES[0].src), sharding(*CASES[0].dst)
    src = jax.device_put(host, src_sharding)
    explicit = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    meshes = {"source mesh": src_sharding.mesh, "destination mesh": dst.mesh}
    with jax.set_mesh(meshes.get(context, explicit)):
        plan = jr.plan(src, dst)
        out = plan(src, verify=True)
        out = plan(src, donate=out)
        out = plan.start(src, donate=out).result()
        again = jr.reshard(src, dst)
    assert_exact(out, host, dst)
    assert_exact(again, host, dst)


AUTO, EXPLICIT = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit


@pytest.mark.parametrize(
    "src_types, dst_types",
    [((EXPLICIT,), (AUTO,)), ((AUTO,), (EXPLICIT,)), ((EXPLICIT,), (EXPLICIT,))],
    ids=["explicit->auto", "auto->explicit", "explicit->explicit"],
)
@pytest.mark.parametrize("dst_spec", [P("dp"), P()], ids=str)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_meshes_of_the_same_devices_and_names_whose_axis_types_differ_are_different_meshes(
    src_types, dst_types, dst_spec, dtype
):
    """An array carries its mesh's axis types, and the result carries the destination's
    (`jax.typeof` included), even where the two meshes differ in nothing else: an
    explicit-sharding trainer and a colocated sampler in the default Auto mode. Regression (a
    fuzz): the two were one mesh to the plan, so the result carried the source's axis types,
    and an Explicit source to an Auto destination failed in `shard_map` on the first call."""
    devices = np.array(jax.devices())
    src_sharding = NamedSharding(Mesh(devices, ("dp",), axis_types=src_types), P("dp"))
    dst = NamedSharding(Mesh(devices, ("dp",), axis_types=dst_types), dst_spec)
    host = random_array((64,), dtype)
    src = jax.device_put(host, src_sharding)
    plan = jr.plan(src, dst)
    out = plan(src, verify=True)
    out = plan(src, donate=out)
    assert_exact(out, host, dst)
    assert out.sharding.mesh.axis_types == dst_types
    assert jax.typeof(out).sharding.spec == jax.typeof(jax.device_put(src, dst)).sharding.spec


def test_bits_written_over_a_mesh_of_mixed_axis_types_keep_their_nan_payloads():
    """A mesh of Auto and Explicit axes types its arrays by the Explicit ones alone; a
    destination split over both is written shard by shard, NaN payloads and all. Regression
    (a fuzz): the bitcasts around a bfloat16 unpack ran as a plain jit to that sharding,
    which resharded the values between the two spellings and quietened the NaNs."""
    mesh = Mesh(np.array(jax.devices()[4:]).reshape(2, 2), ("a", "b"), axis_types=(AUTO, EXPLICIT))
    dst = NamedSharding(mesh, P(("a", "b")))
    for dtype, bits in [
        ("bfloat16", [0x7FB2, 0x7FC1, 0xFF81, 0x3F80]),
        ("float8_e5m2", [0x7D, 0xFE]),
    ]:
        width = jnp.dtype(dtype).itemsize * 8
        host = np.resize(np.array(bits, f"uint{width}"), (64,)).view(jnp.dtype(dtype))
        src = jax.device_put(host, sharding(tuple(range(4)), (4,), ("x",), "x"))
        plan = jr.plan(src, dst)
        out = plan(src)
        out = plan(src, donate=out, verify=True)
        assert_exact(out, host, dst)


def test_reshard_caches_plans_by_signature():
    jr.clear_cache()
    host = random_array((64, 32), "float32")
    src = jax.device_put(host, sharding(*CASES[0].src))
    dst = sharding(*CASES[0].dst)
    out = jr.reshard(src, dst)
    out = jr.reshard(src, dst, donate=out)
    assert_exact(out, host, dst)
    from jaxreshard import api

    assert len(api._CACHE) == 1
    jr.reshard(src, dst, dtype=jnp.bfloat16)
    assert len(api._CACHE) == 2


def test_a_sync_cut_into_more_chunks_than_plans_kept_with_staging_plans_once():
    """Regression (a probe of Tunix's chunked sync, ``reshard_chunk_size``): each chunk is a
    tree of its own, so a plan of its own, and with more chunks than the cache kept (64) every
    sync planned and compiled every chunk again. The cache keeps 256 plans; only the 8 most
    recently used keep their staging buffers, so a sync cut into chunks to bound device memory
    does not hold every chunk's staging."""
    from jaxreshard import api

    jr.clear_cache()
    src_sh, dst = sharding(*CASES[0].src), sharding(*CASES[0].dst)
    hosts = [random_array((8 * (i + 1), 32), "float32", i) for i in range(api._STAGING_PLANS + 4)]
    chunks = [{f"w{i}": jax.device_put(h, src_sh)} for i, h in enumerate(hosts)]
    outs = [jr.reshard(c, {k: dst for k in c}) for c in chunks]  # the first sync
    plans = list(api._CACHE.values())
    with COMPILES as later:
        for _ in range(2):
            outs = [
                jr.reshard(c, {k: dst for k in c}, donate=o)
                for c, o in zip(chunks, outs, strict=True)
            ]
    assert later.count == 0 and list(api._CACHE.values()) == plans
    for i, (host, out) in enumerate(zip(hosts, outs, strict=True)):
        assert_exact(out[f"w{i}"], host, dst)
    held = [max(p.runtime.pool_bytes().values(), default=0) > 0 for p in plans]
    assert held == [False] * 4 + [True] * api._STAGING_PLANS
    # describe() says which (a review: it said "kept between calls" of every plan).
    assert "freed after each call" in plans[0].describe()
    assert "kept between calls" in plans[-1].describe()
    # Started refits run on the worker after later lookups pushed their plans out (a review:
    # they kept the staging they then made): each frees it when done, and a lookup never
    # waits for a plan's call to free another's.
    big_src = jax.device_put(random_array((2048, 1024), "float32", 99), src_sh)
    big = jr.plan(big_src, dst)
    busy = big.start(big_src)  # the worker is busy while the chunks' refits are started
    refits = [
        jr.cached_plan(c, {k: dst for k in c}).start(c, donate=o)
        for c, o in zip(chunks, outs, strict=True)
    ]
    outs = [r.result() for r in refits]
    busy.result()
    for i, (host, out) in enumerate(zip(hosts, outs, strict=True)):
        assert_exact(out[f"w{i}"], host, dst)
    held = [max(p.runtime.pool_bytes().values(), default=0) > 0 for p in plans]
    assert sum(held) <= api._STAGING_PLANS, held


def test_a_cached_plan_is_not_reused_across_jax_enable_x64():
    """Regression (a probe): the plan cache ignored ``jax_enable_x64``, so a plan cached with
    it off (a float64 cast canonicalized to float32) was reused with it on, and the other way
    round. Each setting gets its own plan, as ``astype`` gives."""
    jr.clear_cache()
    host = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)  # (no NaNs)
    src = jax.device_put(host, sharding(*CASES[0].src))
    dst = sharding(*CASES[0].dst)
    assert jr.reshard(src, dst, dtype=jnp.float64).dtype == jnp.float32
    with jax.enable_x64(True):
        out = jr.reshard(src, dst, dtype=jnp.float64)
        assert out.dtype == jnp.float64
        assert_exact(out, host.astype(np.float64), dst)
    assert jr.reshard(src, dst, dtype=jnp.float64).dtype == jnp.float32


def test_a_plan_runs_under_the_x64_setting_it_was_made_under():
    """Regression (a probe): a plan made under ``jax.enable_x64`` with a float64 cast, called
    with x64 off, traced its programs with 32-bit words beside its 64-bit ones and failed in
    XLA with a bare TypeError. A plan runs with the setting it was made under, either way."""
    host = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    src = jax.device_put(host, sharding(*CASES[0].src))
    dst = sharding(*CASES[0].dst)
    with jax.enable_x64(True):
        wide = jr.plan(src, dst, dtype=jnp.float64)
    narrow = jr.plan(src, dst, dtype=jnp.float64)  # (x64 off: float64 is float32)
    out = wide(src)
    assert out.dtype == jnp.float64
    with jax.enable_x64(True):
        assert_exact(out, host.astype(np.float64), dst)
        wide.verify(src, out)
        assert narrow(src).dtype == jnp.float32
    assert_exact(wide(src, donate=out), host.astype(np.float64), dst)
    # 64-bit arrays made under x64 and planned outside it (a review: forcing the planning
    # setting failed them in XLA): their plan runs with x64 on, called either way.
    with jax.enable_x64(True):
        wide_src = {
            "f": jax.device_put(host.astype(np.float64), sharding(*CASES[0].src)),
            "c": jax.device_put(host.astype(np.complex128) * 1j, sharding(*CASES[0].src)),
        }
    plan = jr.plan(wide_src, {"f": dst, "c": dst})
    for x64 in (False, True):
        with jax.enable_x64(x64):
            out = plan(wide_src, verify=True)
        with jax.enable_x64(True):
            assert_exact(out["f"], host.astype(np.float64), dst)
            assert_exact(out["c"], host.astype(np.complex128) * 1j, dst)


def test_describe_reports_bytes_against_the_bound():
    plan, _ = run_case(CASES[0])
    text = plan.describe()
    assert "lower bound" in text and "100% of bound" in text and "rounds" in text


@pytest.mark.parametrize("other", ["uint16", "bfloat16", "float16"])
@pytest.mark.parametrize("source", ["int8", "int32", "uint32", "bool"])
def test_an_integer_cast_to_bfloat16_leaves_other_16_bit_leaves_bit_for_bit(source, other):
    """Regression (a fuzz of dtype trees): a leaf cast from an integer (or bool) to bfloat16,
    packed beside an uncast 16-bit leaf, made XLA CPU's fused gather treat every word as
    bfloat16 through float32: the other leaf's subnormals became zero and its NaNs quiet
    (uint16 words 1 and 2 came out 0), silently. Both leaves arrive with their exact bits."""
    words = np.array([1, 2, 0x807F, 0x7F81, 0xFF81, 0x3F80, 0x8001, 0x7C01], np.uint16)
    for src_ids, dst_ids in (((0,), (1,)), ((0, 1), (2, 3))):
        src_sh = sharding(src_ids, (len(src_ids),), ("x",))
        dst_sh = sharding(dst_ids, (len(dst_ids),), ("x",))
        host = np.asarray(np.array([3, -7, 1 << 20]).astype(source))
        tree = {
            "i": jax.device_put(host, src_sh),
            "w": jax.device_put(words.view(jnp.dtype(other)), src_sh),
        }
        plan = jr.plan(tree, {"i": dst_sh, "w": dst_sh}, dtype={"i": jnp.bfloat16, "w": None})
        out = plan(tree)
        assert np.asarray(out["w"]).view(np.uint16).tolist() == words.tolist()
        want = np.asarray(jax.jit(lambda x: x.astype(jnp.bfloat16))(host)).view(np.uint16)
        assert np.asarray(out["i"]).view(np.uint16).tolist() == want.tolist()


def test_integers_rounded_to_bfloat16_bit_for_bit_as_xla_converts_them():
    """The CPU packs round an integer to bfloat16 from its float32 bits in integer arithmetic
    (`codec._cast_bits`, the workaround of the test above): the same bits as XLA's own
    conversion, on every 8- and 16-bit value and on random 32-bit ones."""
    from jaxreshard.run.codec import _cast_bits, to_bits

    rng = np.random.default_rng(0)
    values = [
        np.arange(-128, 128).astype(np.int8),
        np.arange(256).astype(np.uint8),
        np.arange(-(1 << 15), 1 << 15).astype(np.int16),
        np.arange(1 << 16).astype(np.uint16),
        rng.integers(-(2**31), 2**31, 1 << 16, dtype=np.int64).astype(np.int32),
        rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32),
        np.array([0, 1, 2**24 + 1, 2**24 + 3, 2**31 - 1, 2**32 - 1], np.uint32),
        np.array([True, False]),
    ]
    ours = jax.jit(lambda x: _cast_bits(x, jnp.bfloat16, "cpu"))
    xla = jax.jit(lambda x: to_bits(x.astype(jnp.bfloat16)))
    for v in values:
        assert np.array_equal(np.asarray(ours(v)), np.asarray(xla(v))), v.dtype


# ------------------------------------------------------------------ staging slots held as rows


WIDE = {  # layouts of a (32, 1024)-wide leaf: every box is whole rows of 16 words or more
    "disjoint fsdp2xtp2 -> tp4": (CASES[0].src, CASES[0].dst),
    "colocated, other mesh and device order": (CASES[4].src, CASES[4].dst),
    "destination inside the source": (CASES[9].src, CASES[9].dst),
    "rows -> columns (boxes at four starts in a shard's row)": (
        (A, (4,), ("x",), "x"),
        (B, (4,), ("tp",), None, "tp"),
    ),
}


@pytest.mark.parametrize("layouts", WIDE)
@pytest.mark.parametrize(
    "dtype", ["bfloat16", "float32", "int8", "complex64", "int4", "bool", "float8_e4m3fn"]
)
def test_boxes_packed_as_rows_of_their_shards_arrive_bit_for_bit(dtype, layouts, monkeypatch):
    """Where every box a slot carries is whole rows of its shard (a wide leaf of a regular
    layout), the pack copies each box that is not one run of its shard's words row by row
    into a slot held as rows (`lower.Slot.width`, `Read.rows`): the same words in the same
    order as a flat slot, checked bit for bit for every width of element (complex values as
    two words, int4 and bool as a byte); every piece a copy of its own, as a large leaf's
    are."""
    monkeypatch.setattr(schedule, "GATHER_BYTES", 0)
    src_layout, dst_layout = WIDE[layouts]
    host = random_array((32, 1024), dtype, seed=3)
    src = jax.device_put(host, sharding(*src_layout))
    dst = sharding(*dst_layout)
    plan = jr.plan(src, dst, bucket_bytes=max(1, host.nbytes // 8))  # two buckets a device
    reads = pack_reads(plan.lowered)
    strided = [r for r, p in reads if not contiguous(r.shape, p.operands[r.operand].shard)]
    assert all(r.rows for r in strided) and plan.stats.buckets > 1
    if layouts != "destination inside the source":  # its boxes are whole rows of its shards
        assert strided
    assert_exact(plan(src), host, dst)
    assert_exact(plan(src, donate=plan(src)), host, dst)


def test_rows_carry_casts_and_words_narrower_than_an_element(monkeypatch):
    """A bfloat16 cast of float32 rows (the senders cast each row), and float32 leaves in
    one bucket with bfloat16 ones (each float32 element two 16-bit words of a row); every
    piece a copy of its own (these leaves are small enough to move by gathers)."""
    monkeypatch.setattr(schedule, "GATHER_BYTES", 0)
    src_sh, dst = sharding(*CASES[0].src), sharding(*CASES[0].dst)
    host = {
        "f32": random_array((32, 512), "float32", 1),
        "bf16": random_array((32, 512), "bfloat16", 2),
        "int32": random_array((64, 256), "int32", 3),
        "f32 narrow": random_array((32, 256), "float32", 4),  # boxes of 64 elements, 128 words
    }
    tree = {k: jax.device_put(v, src_sh) for k, v in host.items()}
    dsts = {k: dst for k in tree}
    for dtype in (None, {"f32": jnp.bfloat16, "bf16": None, "int32": None, "f32 narrow": None}):
        plan = jr.plan(tree, dsts, dtype=dtype)
        words = {s.word for step in plan.lowered.steps for s in step.slots}
        assert words == {"uint16"} and max(slot_widths(plan.lowered)) > 1
        out = plan(tree)
        cast = (dtype or {}).get("f32") or jnp.float32
        want = np.asarray(jax.jit(lambda x, c=cast: x.astype(c))(host["f32"]))
        assert_exact(out["f32"], want, dst)
        assert_exact(out["bf16"], host["bf16"], dst)
        assert_exact(out["int32"], host["int32"], dst)
        assert_exact(out["f32 narrow"], host["f32 narrow"], dst)


def test_boxes_of_narrow_rows_beside_wide_ones_arrive_bit_for_bit(monkeypatch):
    """Vocabulary-like leaves whose boxes are rows of 2,000 elements (not whole rows of 128
    words) share a slot held as rows with a leaf whose boxes are: their words are laid flat
    wherever they fall, as the part of a row they start in, whole rows and the part of a row
    they end in (`runtime._put_words`). Exact, fresh and donated, in float32 and
    bfloat16."""
    monkeypatch.setattr(schedule, "GATHER_BYTES", 0)
    src_sh, dst = sharding(*CASES[0].src), sharding(*CASES[0].dst)
    for dtype in ("float32", "bfloat16"):
        host = {
            "w": random_array((64, 1024), dtype, 1),
            "y": random_array((24, 8000), dtype, 2),
            "z": random_array((24, 8000), dtype, 3),
        }
        tree = {k: jax.device_put(v, src_sh) for k, v in host.items()}
        plan = jr.plan(tree, {k: dst for k in tree}, bucket_bytes=1 << 19)
        reads = [(r, p.slots[r.slot].width) for r, p in pack_reads(plan.lowered)]
        assert any(r.rows for r, _ in reads)
        assert any(w > 1 and r.offset % w for r, w in reads)  # starts mid-row
        assert any(w > 1 and (r.offset + r.shape[0] * 2000) % w for r, w in reads)  # ends so
        out = plan(tree)
        for _ in range(2):
            for k, v in host.items():
                assert_exact(out[k], v, dst)
            out = plan(tree, donate=out)


def test_boxes_that_are_not_whole_rows_keep_their_slots_flat(monkeypatch):
    """A leaf whose boxes are 250 elements wide, each a copy of its own, packs into flat
    slots, as before; exact."""
    monkeypatch.setattr(schedule, "GATHER_BYTES", 0)
    host = random_array((16, 1000), "float32", 4)
    src = jax.device_put(host, sharding(*CASES[0].src))
    dst = sharding(*CASES[0].dst)
    plan = jr.plan(src, dst)
    assert slot_widths(plan.lowered) == {1}
    assert_exact(plan(src), host, dst)


def test_leaves_cut_into_slabs_whose_steps_join_across_units_move_exactly():
    """Regression (a fuzz, 2026-12-07): two leaves cut into slabs by tiny buckets, onto five
    devices in another order; a joined step wrote the second leaf before the step that
    makes its destination ran, and the call died in the runtime (KeyError). Also with the
    destinations donated (nothing made then)."""
    src_s = sharding(tuple(range(8)), (8,), ("x",), None, "x")
    dst_s = sharding((4, 1, 3, 7, 2), (5,), ("y",), None, "y")
    hosts = [random_array((4, 200, 7), "uint16", k) for k in range(2)]
    src = [jax.device_put(h, src_s) for h in hosts]
    plan = jr.plan(src, [dst_s] * 2, bucket_bytes=300)
    out = plan(src)
    out = plan(src, donate=out)
    for o, h in zip(out, hosts, strict=True):
        assert_exact(o, h, dst_s)
