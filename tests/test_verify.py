"""Integrity on demand: ``plan(src, verify=True)`` / ``plan.verify(src, out)``.

Specification: an exact result passes for every dtype, cast and layout; a result with one
changed word, or with two rows swapped, is refused, naming the leaf and the device; the check
reads the source and the result on device (nothing but the sums reaches the host).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import assert_exact, random_array, sharding
from compiles import COMPILES

import jaxreshard as jr
from jaxreshard.run import runtime, verify, views
from jaxreshard.run.verify import box_checksum

SRC = (tuple(range(4)), (2, 2), ("fsdp", "tp"))
DST = (tuple(range(4, 8)), (2, 2), ("dp", "tp"))


def tree():
    host = {
        "w": random_array((16, 8), "float32", 1),
        "h": random_array((8, 4, 2), "bfloat16", 2),
        "i": random_array((12,), "int8", 3),
        "b": random_array((4, 4), "bool", 4),
        "x": random_array((8, 8), "uint16", 5),
    }
    src = {
        "w": jax.device_put(host["w"], sharding(*SRC, "fsdp", "tp")),
        "h": jax.device_put(host["h"], sharding(*SRC, "tp")),
        "i": jax.device_put(host["i"], sharding(*SRC, ("fsdp", "tp"))),
        "b": jax.device_put(host["b"], sharding(*SRC)),
        "x": jax.device_put(host["x"], sharding(*SRC, None, "fsdp")),
    }
    dst = {
        "w": sharding(*DST, None, "tp"),
        "h": sharding(*DST, "dp", None, "tp"),
        "i": sharding(*DST),
        "b": sharding(*DST, "tp"),
        "x": sharding(*DST, ("dp", "tp")),
    }
    src["k"] = jax.device_put(jax.random.split(jax.random.key(3), 8), sharding(*SRC, "fsdp"))
    dst["k"] = sharding(*DST, "tp")
    return host, src, dst


@pytest.fixture(scope="module")
def planned():
    """``(src, plan, out)``: `tree` planned without a cast, its result, and one `plan.verify`
    run (so its programs are compiled). Shared by the tests below that only read them: each
    changes a copy of a shard, never ``out``."""
    _, src, dst = tree()
    plan = jr.plan(src, dst)
    out = plan(src)
    plan.verify(src, out)
    return src, plan, out


def with_shard(x: jax.Array, device: int, change) -> jax.Array:
    """``x`` with the buffer on ``device`` replaced by ``change(its NumPy copy)``."""
    bufs = views.by_device(x)
    host = change(np.asarray(bufs[device]).copy())
    bufs[device] = jax.device_put(host, bufs[device].sharding)
    return jax.make_array_from_single_device_arrays(
        x.shape, x.sharding, views.ordered(bufs, x.sharding)
    )


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_an_exact_result_passes_for_every_dtype_cast_and_layout(dtype):
    _, src, dst = tree()
    plan = jr.plan(src, dst, dtype=dtype)
    out = plan(src, verify=True)
    out = plan(src, donate=out, verify=True)
    plan.verify(src, out)


def test_one_changed_word_is_found_naming_the_leaf_and_the_device():
    _, src, dst = tree()
    plan = jr.plan(src, dst, dtype=jnp.bfloat16)
    out = plan(src)

    def flip(a):
        a.view(np.uint16).reshape(-1)[3] ^= 1
        return a

    bad = dict(out, w=with_shard(out["w"], 6, flip))
    with pytest.raises(jr.ReshardError, match=r"\['w'\]: device 6: the shard .* differs"):
        plan.verify(src, bad)


@pytest.mark.parametrize("bit", [31, 30, 23])
def test_the_same_bit_flipped_in_two_words_is_found(bit, planned):
    """Regression: two sign flips (bit 31) cancelled in the sum mod 2**32 and verified as
    exact; two flips of bit 30 cancelled for half the pairs of positions. Every pair of
    positions of one shard row, with the bit flipped in both words."""
    src, plan, out = planned
    columns = views.by_device(out["w"])[4].shape[-1]
    for first in range(columns):
        for second in range(first + 1, columns):

            def flip(a, first=first, second=second):
                a.view(np.uint32)[0, [first, second]] ^= np.uint32(1 << bit)
                return a

            bad = dict(out, w=with_shard(out["w"], 4, flip))
            with pytest.raises(jr.ReshardError, match=r"\['w'\]: device 4"):
                plan.verify(src, bad)


def test_data_in_the_wrong_place_is_found(planned):
    src, plan, out = planned
    bad = dict(out, x=with_shard(out["x"], 5, lambda a: a[::-1].copy()))  # same words, moved
    with pytest.raises(jr.ReshardError, match=r"\['x'\]: device 5"):
        plan.verify(src, bad)


@pytest.mark.parametrize(
    "change",
    ["transposed", "swap (0, 1) and (1, 0)", "swap (0, 7) and (1, 2)"],
)
def test_words_moved_between_mirrored_positions_are_found(change):
    """Regression: an element's weight was (2r + 1)(2c + 1) times constants, the same at
    (r, c) and (c, r) and wherever that product agrees (1 x 15 == 3 x 5), so a transposed
    replica, or two words swapped between such positions, passed."""
    host = np.arange(64, dtype=np.float32).reshape(8, 8)
    src = jax.device_put(host, sharding(tuple(range(4)), (4,), ("a",), "a"))
    dst = sharding(tuple(range(4, 8)), (4,), ("t",))  # replicated on devices 4-7
    plan = jr.plan(src, dst)
    out = plan(src)

    def swapped(p, q):
        def swap(a):
            a[p], a[q] = a[q].copy(), a[p].copy()
            return a

        return swap

    fn = {
        "transposed": lambda a: a.T.copy(),
        "swap (0, 1) and (1, 0)": swapped((0, 1), (1, 0)),
        "swap (0, 7) and (1, 2)": swapped((0, 7), (1, 2)),
    }[change]
    with pytest.raises(jr.ReshardError, match="device 5"):
        plan.verify(src, with_shard(out, 5, fn))


def test_a_leaf_wrong_on_two_devices_counts_as_one_leaf(planned):
    """Regression: the error's header counted devices as leaves ("(2 leaves)")."""
    src, plan, out = planned
    flip = lambda a: a[::-1].copy()  # noqa: E731
    bad = dict(out, x=with_shard(with_shard(out["x"], 4, flip), 5, flip))
    with pytest.raises(jr.ReshardError, match=r"\(1 leaf\):\n.*\['x'\]: device 4.*\n.*device 5"):
        plan.verify(src, bad)


NARROW_AND_WIDE = ["int4", "uint4", "int2", "uint2", "float4_e2m1fn", "complex64"]


@pytest.mark.parametrize("dtype", NARROW_AND_WIDE)
@pytest.mark.parametrize("columns", [4, 8])
def test_sub_byte_and_complex_leaves_verify_and_a_moved_element_is_found(dtype, columns):
    """Regression: a 4-bit leaf was checked as bytes (two elements to a word: exact results
    refused, odd shapes crashed) and a complex one could not be checked at all."""
    host = random_array((8, columns), dtype, 6)
    src = jax.device_put(host, sharding(*SRC, "fsdp"))
    dst = sharding(*DST, None, "tp")
    plan = jr.plan(src, dst)
    out = plan(src, verify=True)
    plan.verify(src, jax.device_put(host, dst))  # XLA's own result passes too

    def rotate(a):  # the same elements, each moved along its row
        return np.roll(a, 1, axis=-1).copy()

    if np.array_equal(rotate(np.asarray(views.by_device(out)[4])), views.by_device(out)[4]):
        pytest.skip("the drawn rows are constant")
    with pytest.raises(jr.ReshardError, match="device 4"):
        plan.verify(src, with_shard(out, 4, rotate))


@pytest.mark.parametrize("dtype", ["complex64", "float64", "complex128"])
def test_an_element_of_several_words_changed_in_all_of_them_is_found(dtype):
    """Regression (a probe): a 64-bit or complex element was folded into one word
    (``low ^ high * K``) before hashing, so changing both halves so that the fold stayed the
    same passed. Every element of a shard, changed in every word so that the old fold is
    kept, and changed at random in every word."""
    with jax.enable_x64(True):
        host = random_array((4, 8), dtype, 7)
        src = jax.device_put(host, sharding(*SRC, "fsdp", "tp"))
        dst = sharding(*DST, None, "tp")
        plan = jr.plan(src, dst)
        out = plan(src)
        k = np.dtype(dtype).itemsize // 4  # words per element
        rng = np.random.default_rng(0)
        for element in range(host[:, :4].size):

            def kept_fold(a, element=element):  # low ^ high * K unchanged
                words = a.view(np.uint32).reshape(-1, k)[element]
                high = words[1] ^ np.uint32(1 << 20)
                with np.errstate(over="ignore"):
                    words[0] ^= (words[1] * np.uint32(0x85EBCA6B)) ^ (high * np.uint32(0x85EBCA6B))
                words[1] = high
                return a

            def random_words(a, element=element):
                words = a.view(np.uint32).reshape(-1, k)[element]
                words ^= rng.integers(1, 2**32, size=k, dtype=np.uint32)
                return a

            for change in (kept_fold, random_words):
                with pytest.raises(jr.ReshardError, match="device 4"):
                    plan.verify(src, with_shard(out, 4, change))


def test_two_words_swapped_far_apart_in_a_row_are_found():
    """Regression (a probe): column weights ``(2 c + 1) K`` were not mixed, so two words
    swapped ``2**16`` columns apart cancelled whenever their hashes agreed modulo 2**15 (odds
    2**-15). Such a pair, and 64 random pairs of one long row."""
    rng = np.random.default_rng(1)
    width = 1 << 17
    host = rng.standard_normal((2, width)).astype(np.float32)
    # A pair of values whose MurmurHash3 finalizers agree modulo 2**15 (the old blind spot).
    values = rng.standard_normal(4096).astype(np.float32)
    low = _np_mix(values.view(np.uint32)) & 0x7FFF
    first: dict[int, int] = {}
    for i, h in enumerate(low.tolist()):
        if h in first and values[first[h]] != values[i]:
            host[0, 0], host[0, 1 << 16] = values[first[h]], values[i]
            break
        first.setdefault(h, i)
    src = jax.device_put(host, sharding((0,), (1,), ("x",)))
    plan = jr.plan(src, sharding((1,), (1,), ("x",)))
    out = plan(src)
    pairs = [(0, 1 << 16)] + [tuple(rng.choice(width, 2, replace=False)) for _ in range(64)]
    for p, q in pairs:

        def swap(a, p=p, q=q):
            a[0, p], a[0, q] = a[0, q].copy(), a[0, p].copy()
            return a

        with pytest.raises(jr.ReshardError, match="device 1"):
            plan.verify(src, with_shard(out, 1, swap))


def _np_mix(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer in NumPy (an oracle for the test's choice of values)."""
    h = h.astype(np.uint64)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_the_checksum_of_a_box_is_the_sum_of_its_parts():
    """The property the check rests on: position weights make the sum additive."""
    x = jnp.asarray(random_array((6, 10), "float32", 9))
    whole = box_checksum(x, (0, 0), x.shape)
    top = box_checksum(x[:2], (0, 0), x.shape)
    bottom_left = box_checksum(x[2:, :4], (2, 0), x.shape)
    bottom_right = box_checksum(x[2:, 4:], (2, 4), x.shape)
    assert int(whole) == (int(top) + int(bottom_left) + int(bottom_right)) % 2**32
    swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])
    if not np.array_equal(np.asarray(x[0, 0]).view(np.uint32), np.asarray(x[0, 1]).view(np.uint32)):
        assert int(box_checksum(swapped, (0, 0), x.shape)) != int(whole)


def _np_checksum(x: np.ndarray, origin: tuple[int, ...], global_shape: tuple[int, ...]) -> int:
    """The module docstring's formula in NumPy, for elements of 32 bits or fewer (an oracle)."""
    bits = np.atleast_1d(x).view(f"uint{8 * x.dtype.itemsize}").astype(np.uint64)
    index = np.indices(x.shape, dtype=np.int64).reshape(x.ndim, x.size)
    index += np.asarray(origin, np.int64).reshape(x.ndim, 1)
    cols = index[-1] if x.ndim else np.zeros(1, np.int64)
    rows = (
        np.ravel_multi_index(tuple(index[:-1]), global_shape[:-1])
        if x.ndim > 1
        else np.zeros_like(cols)
    )
    col_hash = _np_mix(cols.astype(np.uint64) ^ 0x9E3779B9)
    weight = (2 * _np_mix(rows.astype(np.uint64)) + 1) & 0xFFFFFFFF
    terms = (_np_mix(bits.reshape(-1) ^ col_hash) * weight) & 0xFFFFFFFF
    return int(terms.sum() % 2**32)


@pytest.mark.parametrize(
    ("shape", "box", "dtype"),
    [
        ((6, 9, 7), ((1, 5), (2, 9), (0, 7)), "float32"),  # rows one at a time, then chunks
        ((4, 40), ((0, 4), (3, 38)), "bfloat16"),  # chunks of rows and a shorter last one
        ((101,), ((4, 99),), "int8"),  # a long row cut along its columns
        ((3, 2, 1, 50), ((1, 3), (0, 2), (0, 1), (10, 50)), "uint16"),
        ((), (), "float32"),
    ],
)
@pytest.mark.parametrize("chunk", [16, 1 << 18])
@pytest.mark.parametrize(
    "options", [None, runtime.CPU_COPY_OPTIONS], ids=["new-emitters", "old-emitters"]
)
def test_a_checksum_taken_in_pieces_is_the_formula(shape, box, dtype, chunk, options, monkeypatch):
    """Large boxes are summed a piece at a time (`CHUNK_WORDS`, made small here so that
    small boxes are cut too, along every dimension, with ragged last pieces): the result is
    the formula's, computed in NumPy, whether the box is the whole array or read out of it,
    with XLA's CPU emitters old and new (random bfloat16 bits hold NaNs, whose payloads a
    slice of values in a loop quietened)."""
    monkeypatch.setattr(verify, "CHUNK_WORDS", chunk)
    full = random_array(shape, dtype, 11)
    origin = tuple(s for s, _ in box)
    part = full[tuple(slice(s, e) for s, e in box)]
    want = _np_checksum(part, origin, shape)
    whole = jax.jit(lambda x: box_checksum(x, origin, shape), compiler_options=options)
    assert int(whole(jnp.asarray(part))) == want
    start, extent = origin, tuple(e - s for s, e in box)
    read = jax.jit(
        lambda x: verify.box_checksum_of(x, start, extent, origin, shape),
        compiler_options=options,
    )
    assert int(read(full)) == want


def test_a_changed_word_is_found_when_the_checksums_are_taken_in_pieces(monkeypatch):
    monkeypatch.setattr(verify, "CHUNK_WORDS", 8)
    _, src, dst = tree()
    plan = jr.plan(src, dst)
    out = plan(src)
    plan.verify(src, out)

    def flip(a):
        a.view(np.uint32).reshape(-1)[-1] ^= 1
        return a

    with pytest.raises(jr.ReshardError, match=r"\['w'\](.|\n)*device 6"):
        plan.verify(src, {**out, "w": with_shard(out["w"], 6, flip)})


@pytest.mark.parametrize(
    "cast",
    [
        ("bfloat16", "float16"),
        ("bfloat16", "float32"),
        ("bfloat16", "float8_e4m3fn"),
        ("float8_e4m3fn", "bfloat16"),
        ("float8_e5m2", "float16"),
    ],
    ids="->".join,
)
def test_an_exact_cast_of_nan_payloads_passes_when_taken_in_pieces(cast, monkeypatch):
    """A cast source whose values XLA's CPU backend computes through float32 (bfloat16,
    float8) is summed as the senders cast it, also in pieces, where it is sliced in a loop.
    Regression (a fuzz): bfloat16 NaNs with payloads cast to float16, in shards of more than
    `verify.CHUNK_WORDS` words, were sliced as values in the loop and summed otherwise than
    the exact result, and `verify` called that result corrupt."""
    monkeypatch.setattr(verify, "CHUNK_WORDS", 64)  # every box in pieces
    source, target = (jnp.dtype(d) for d in cast)
    bits = {1: [0x7F, 0xFF, 0x7D, 0x3C], 2: [0x7FC1, 0xFF81, 0x7F81, 0x3F80]}[source.itemsize]
    host = np.resize(np.array(bits, f"uint{8 * source.itemsize}"), (32, 48)).view(source)
    src = jax.device_put(host, sharding(*SRC, "fsdp", "tp"))
    dst = sharding(*DST, None, "tp")
    plan = jr.plan(src, dst, dtype=target)
    out = plan(src)
    assert_exact(out, np.asarray(jax.device_put(host, jax.devices()[0]).astype(target)), dst)
    plan.verify(src, out)
    out = plan(src, donate=out, verify=True)


def test_verify_reads_no_array_to_the_host(planned):
    src, plan, out = planned  # verified once: compiled
    with jax.transfer_guard_host_to_device("disallow"), jax.transfer_guard("disallow"):
        plan.verify(src, out)  # only the sums come back (allowed explicitly inside)


def test_host_memory_destinations_and_single_device_results_verify():
    _, src, dst = tree()
    dst = dict(dst, w=dst["w"].with_memory_kind("pinned_host"))
    dst["i"] = jax.sharding.SingleDeviceSharding(jax.devices()[5])
    plan = jr.plan(src, dst)
    plan(src, verify=True)


def test_a_result_tree_that_is_not_the_plans_result_is_refused_naming_the_leaf(planned):
    """Regression: verify took its result tree unchecked: a leaf on another sharding raised a
    bare KeyError, a deleted one JAX's RuntimeError, a NumPy one an AttributeError."""
    src, plan, out = planned
    deleted = jax.device_put(np.zeros(out["w"].shape, out["w"].dtype), out["w"].sharding)
    deleted.delete()
    for leaf, says in [
        (src["w"], "expected sharding"),
        (deleted, "the array has been deleted"),
        (np.asarray(out["w"]), "expected a jax.Array, got ndarray"),
    ]:
        with pytest.raises(jr.ReshardError, match=rf"\['w'\]: {says}"):
            plan.verify(src, {**out, "w": leaf})
    plan.verify(src, out)


def test_verify_and_a_verified_refit_run_under_rank_promotion_raise():
    """Regression (an adversarial probe): the checksums broadcast a row of weights over a
    shard, which ``jax.numpy_rank_promotion("raise")``, a check meant for the caller's code,
    refused with a plain ValueError, after the refit had consumed its ``donate=`` tree: the
    previous result and the new one were both lost."""
    host, src, dst = tree()
    plan = jr.plan(src, dst)
    out = plan(src)
    with jax.numpy_rank_promotion("raise"):
        again = plan(src, donate=out, verify=True)
        plan.verify(src, again)
    np.testing.assert_array_equal(np.asarray(again["w"]), host["w"])
    with jax.numpy_rank_promotion("raise"):  # (a public function: callers use it themselves)
        box_checksum(jnp.ones((4, 3), jnp.float32), (0, 0), (4, 3))


def test_fallback_leaves_are_verified_too():
    """Regression (an adversarial probe): ``fallback="device_put"`` leaves went unchecked, so a
    wrong one passed. They are compared, shard by shard and bit for bit, with a fresh
    ``device_put`` of their source, and named like the others."""
    _, src, dst = tree()
    host = random_array((8, 4), "float32", 9)
    src["n"], dst["n"] = host, sharding(*DST, "dp")
    plan = jr.plan(src, dst, fallback="device_put")
    out = plan(src, verify=True)
    bad = dict(out, n=jax.device_put(host + 1, dst["n"]))
    with pytest.raises(jr.ReshardError, match=r"\['n'\]: device \d: the shard differs"):
        plan.verify(src, bad)
    with pytest.raises(jr.ReshardError, match=r"\['n'\]: is not an array like float32\[8,4\]"):
        plan.verify(src, dict(out, n=np.asarray(out["n"])))
    # Bit for bit, not by the checksums' folded words: two complex values whose real part's
    # bits and imaginary part's (times the mixing constant) xor alike are still different.
    c = np.zeros((8,), np.complex64)
    parts = c.view(np.uint32).reshape(8, 2)
    parts[0] = (0x3F800000 ^ 0x85EBCA77, 1)  # real ^ imag * K2 is 0x3F800000, as 1 + 0j's
    one = np.ones((8,), np.complex64)
    plan = jr.plan({"c": one}, {"c": sharding(*DST)}, fallback="device_put")
    with pytest.raises(jr.ReshardError, match=r"\['c'\]: device \d: the shard differs"):
        plan.verify({"c": one}, {"c": jax.device_put(c + one * (np.arange(8) > 0), sharding(*DST))})


def test_a_later_verify_compiles_nothing_whatever_the_sources_weak_type():
    """Regression (an adversarial probe): verify's programs were traced for the call's
    arrays, so a weakly typed source where the plan's was strongly typed (or the other way)
    compiled them again."""
    x = jax.device_put(jnp.asarray(1.5), sharding(*SRC))  # weakly typed
    plan = jr.plan({"x": x}, {"x": sharding(*DST)})
    plan.verify({"x": x}, plan({"x": x}))
    strong = jax.device_put(jnp.asarray(1.5, jnp.float32), sharding(*SRC))
    out = plan({"x": strong})
    with COMPILES:
        plan.verify({"x": strong}, out)
    assert COMPILES.events == []


def test_verify_passes_an_exact_result_whose_layouts_cut_wide_elements_columns_differently():
    """A complex64 element is two 32-bit words side by side: a source cut in 2 along the last
    dimension and a destination cut in 4 (and the other way) verify an exact result."""
    host = random_array((8, 16), "complex64", 3)
    halves = sharding((0, 1), (2,), ("x",), None, "x")
    quarters = sharding((4, 5, 6, 7), (4,), ("x",), None, "x")
    for src_s, dst_s in ((halves, quarters), (quarters, halves)):
        src = jax.device_put(host, src_s)
        plan = jr.plan(src, dst_s)
        out = plan(src, verify=True)
        plan.verify(src, out)
        assert_exact(out, host, dst_s)


def test_verify_passes_an_exact_result_whose_layouts_cut_a_middle_dimension_differently():
    """Rows are numbered in the global array: a rank-3 leaf cut in 2 along its middle
    dimension on the sources and in 3 on the destinations verifies an exact result."""
    host = random_array((4, 6, 8), "float32", 5)
    src_s = sharding((0, 1), (2,), ("x",), None, "x")
    dst_s = sharding((4, 5, 6), (3,), ("y",), None, "y")
    src = jax.device_put(host, src_s)
    plan = jr.plan(src, dst_s)
    out = plan(src, verify=True)
    plan.verify(src, out)
    assert_exact(out, host, dst_s)


def test_verify_of_many_leaves_of_one_shape_compiles_a_few_programs_not_one_term_a_leaf(
    monkeypatch,
):
    """Regression: each device compiled one program summing every box it held, so the first
    `verify` of 1024 leaves of 256 KiB compiled for minutes (185 s, 4.4 GB). The programs are
    shared by the shape of the boxes they sum (up to `verify.GROUP_JOBS` boxes a run, starts
    from a table, one program over a side's devices): five times as many leaves of one shape
    trace no more box sums, and compile no more programs; a changed word in the last of them
    is still found."""
    traced = []
    checksum = verify.box_checksum_of
    monkeypatch.setattr(
        verify, "box_checksum_of", lambda *a, **k: traced.append(1) or checksum(*a, **k)
    )
    few = verify.GROUP_JOBS
    host = {f"w{i:03d}": random_array((16, 8), "float32", i) for i in range(5 * few)}
    src = {k: jax.device_put(v, sharding(*SRC, "fsdp", "tp")) for k, v in host.items()}
    dst = {k: sharding(*DST, None, "tp") for k in host}
    counts = []
    for n in (few, 5 * few):
        some = {k: src[k] for k in sorted(src)[:n]}
        plan = jr.plan(some, {k: dst[k] for k in some})
        out = plan(some)
        traced.clear()
        with COMPILES:
            plan.verify(some, out)
        counts.append((len(traced), COMPILES.count))
    assert counts[1][0] <= counts[0][0] and counts[1][1] <= counts[0][1], counts
    bad = dict(out)
    last = sorted(bad)[-1]
    changed = host[last].copy()
    changed.view(np.uint32)[3, 5] ^= 1
    bad[last] = jax.device_put(changed, dst[last])
    with pytest.raises(jr.ReshardError, match=rf"\['{last}'\]: device"):
        plan.verify(some, bad)
