"""Integrity on demand: per-shard checksums of a refit's result against its source, on device.

The checksum of a box of a global array is a position-weighted sum of its words,

    checksum(box) = sum over elements e in box of
                    mix(word(e)) * (2 mix(r(e)) + 1) * (2 c(e) + 1) K    (mod 2**32)

where ``word(e)`` is the element's bits as an unsigned 32-bit number (narrower dtypes widened,
64-bit dtypes folded), ``mix`` MurmurHash3's 32-bit finalizer, ``c(e)`` the element's index
along the last dimension and ``r(e)`` the row-major index of its row (every other dimension) in
the *global* array, and ``K`` an odd constant. Because the weight depends on the global
position only, the checksum of a box is the sum of the checksums of any partition of it: each
source device computes the part of every destination box it holds, each destination device the
checksum of its whole shard, and only those 4-byte sums reach the host. ``mix`` is a bijection
and a weight is odd, so changing one word always changes the sum; moving data to another
position changes its weight. The row's factor is mixed, the column's is not: with both of
the form ``2 i + 1``, an element's weight was the same at ``(r, c)`` and ``(c, r)`` (and at any
two positions of equal ``(2 r + 1)(2 c + 1)``), so a transposed shard, or two words swapped
between such positions, went unseen. ``mix`` is there for several changed words: summed as
they are, a flip of bit ``k`` adds ``2**k`` times an odd weight, so two sign flips (bit 31)
always cancel mod 2**32 and two flips of bit 30 do for half the pairs of positions; mixed, a
flipped bit changes about half of the word's bits and such patterns cancel with odds of about
2**-32.

The source side is cast to the destination dtype first (the same XLA convert the senders run),
so a cast refit verifies bit for bit too. Typed PRNG keys are checked as their key data.

Cost: one read of the source and one of the result, and a few bytes per shard to the host
(read explicitly even under ``jax.transfer_guard``: the caller asked for it). One compiled
program per device, built on the first `verify` and reused.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxreshard.errors import ReshardError, leaf_error
from jaxreshard.planning.layout import Box, shift
from jaxreshard.planning.route import LeafSpec
from jaxreshard.run import views
from jaxreshard.run.codec import to_bits

K = np.uint32(0x9E3779B1)  # odd multiplier of the column weights
K2 = np.uint32(0x85EBCA77)  # mixes a complex value's two parts

Job = tuple[int, Box, Box]
"""(leaf, box relative to the shard, the same box in global coordinates)."""


def _words(x: jax.Array) -> jax.Array:
    """Each element's bits as uint32 (one word per element)."""
    dtype = jnp.dtype(x.dtype)
    if dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(dtype, jnp.complexfloating):  # its two parts' words, mixed
        return _words(jnp.real(x)) ^ (_words(jnp.imag(x)) * K2)
    bits = jax.dtypes.itemsize_bits(dtype)  # not itemsize: 4-bit and 2-bit types take 1 byte
    if bits == 32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if bits < 32:
        # Bits as the unsigned type of the same width, then widened: element by element (a
        # bit-cast to a wider type would pack several sub-byte elements into one word).
        narrow = {2: jnp.uint2, 4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16}[bits]
        return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)
    pair = jax.lax.bitcast_convert_type(x, jnp.uint32)  # 64 bits: (..., 2)
    return pair[..., 0] ^ (pair[..., 1] * np.uint32(0x85EBCA6B))


def _mix(words: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer, element by element: a bijection of uint32 in which
    every input bit flips about half of the output bits."""
    h = words ^ (words >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def box_checksum(x: jax.Array, origin: Sequence[int], global_shape: Sequence[int]) -> jax.Array:
    """The checksum (uint32 scalar) of ``x``, the elements of a box starting at ``origin`` of
    an array of ``global_shape``. Traceable.

    The weight of an element is ``row_weight * col_weight``: one odd number for its global
    row (its index over every dimension but the last) times one for its global column (the
    last dimension). So the sum is taken as ``sum_rows(row_weight * sum_cols(word *
    col_weight))``: the mix and a multiply-add per element, the rest on the (small) row grid
    (the mix costs no measurable time here: the sums are bound by memory).
    """
    words = _mix(_words(x))
    if words.ndim == 0:
        words = words.reshape(1, 1)
        origin, global_shape = (0, *origin, 0), (1, *global_shape, 1)
    elif words.ndim == 1:
        words = words.reshape(1, -1)
        origin, global_shape = (0, *origin), (1, *global_shape)
    cols = jax.lax.iota(jnp.uint32, words.shape[-1]) + np.uint32(origin[-1] % 2**32)
    col_weight = (cols * np.uint32(2) + np.uint32(1)) * K
    lead = words.shape[:-1]
    row = jnp.zeros(lead, jnp.uint32)
    stride = 1
    for d in range(len(lead) - 1, -1, -1):
        pos = jax.lax.broadcasted_iota(jnp.uint32, lead, d) + np.uint32(origin[d] % 2**32)
        row = row + pos * np.uint32(stride % 2**32)
        stride *= int(global_shape[d])
    row_weight = _mix(row) * np.uint32(2) + np.uint32(1)
    col_weight = col_weight.reshape((1,) * len(lead) + col_weight.shape)  # (no rank promotion)
    per_row = jnp.sum(words * col_weight, axis=-1, dtype=jnp.uint32)
    return jnp.sum(per_row * row_weight, dtype=jnp.uint32)


def _strong(x: jax.Array) -> jax.Array:
    """``x`` (a buffer on one device), strongly typed, zero-copy."""
    if not getattr(x, "weak_type", False):
        return x
    return views.View(x.shape, x.dtype, x.sharding)([x])


@jax.jit
def _same_bits(a: jax.Array, b: jax.Array) -> jax.Array:
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    return jnp.array_equal(to_bits(a), to_bits(b))  # (unfolded, unlike `_words`)


def differing_shards(a: jax.Array, b: jax.Array) -> list[int]:
    """The ids of this process's devices where ``a``'s shard and ``b``'s (two arrays of one
    shape, dtype and sharding) differ in any bit, compared on device (a flag per shard
    reaches the host)."""
    theirs = {s.device.id: s.data for s in b.addressable_shards}
    flags = {s.device.id: _same_bits(s.data, theirs[s.device.id]) for s in a.addressable_shards}
    with jax.transfer_guard_device_to_host("allow"):
        return sorted(d for d, same in flags.items() if not bool(same))


class Verifier:
    """The checksum programs of one plan (built on first use), and the comparison."""

    def __init__(self, leaves: Sequence[LeafSpec], paths: Sequence[str]) -> None:
        self.leaves = tuple(leaves)
        self.paths = tuple(paths)
        self._src_jobs, self._expected_of = self._source_jobs()
        self._dst_jobs: dict[int, list[Job]] = defaultdict(list)  # every destination shard
        for i, leaf in enumerate(self.leaves):
            for device, box in zip(leaf.dst.devices, leaf.dst.boxes, strict=True):
                self._dst_jobs[device].append((i, tuple((0, e - s) for s, e in box), box))
        self._fns: dict[Any, Any] = {}

    def _source_jobs(self) -> tuple[dict[int, list[Job]], list[list[tuple[int, int]]]]:
        """Per source device, the parts of every distinct destination box it computes (one
        replica of each part: the first holder); and per leaf and destination box, which
        (device, job index) sums make its expected checksum."""
        jobs: dict[int, list[Job]] = defaultdict(list)
        expected: list[list[tuple[int, int]]] = []
        for i, leaf in enumerate(self.leaves):
            for box in leaf.dst.replicas:
                parts = []
                for held, holders, common in leaf.src.overlapping(box):
                    device = holders[0]
                    origin = tuple(s for s, _ in held)
                    jobs[device].append((i, shift(common, origin), common))
                    parts.append((device, len(jobs[device]) - 1))
                expected.append(parts)
        return jobs, expected

    @staticmethod
    def refuse_distributed() -> None:
        """Raise `ReshardError` under ``jax.distributed`` (not supported yet)."""
        if jax.process_count() > 1:
            raise ReshardError(
                "verify is not supported under jax.distributed yet (the per-shard sums would "
                "need combining across processes)\nHow to fix: verify in a single-controller "
                "run, or compare the checksums yourself (jaxreshard.run.verify.box_checksum)"
            )

    def check(
        self,
        src: Sequence[Any],
        out: Sequence[jax.Array],
        also: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Raise `ReshardError` naming every (leaf, device) whose result differs from the
        source (every device of this process; single-controller JAX only), and the
        ``(path, problem)`` pairs found otherwise (``also``)."""
        self.refuse_distributed()
        src_buffers = [views.by_device(x) for x in src]
        dst_buffers = [views.by_device(x) for x in out]
        sums = {}
        for device, jobs in self._src_jobs.items():
            args = [src_buffers[i][device] for i, _, _ in jobs]
            sums[device] = self._run(("src", device), jobs, args, cast=True)
        got = {}
        for device, jobs in self._dst_jobs.items():
            args = [dst_buffers[i][device] for i, _, _ in jobs]
            got[device] = self._run(("dst", device), jobs, args, cast=False)
        with jax.transfer_guard_device_to_host("allow"):
            sums = {d: np.asarray(v) for d, v in sums.items()}
            got = {d: np.asarray(v) for d, v in got.items()}
        want_of: dict[tuple[int, Box], int] = {}
        n = 0
        for i, leaf in enumerate(self.leaves):
            for box in leaf.dst.replicas:
                total = sum(int(sums[d][j]) for d, j in self._expected_of[n]) % 2**32
                want_of[i, box] = total
                n += 1
        problems = list(also)
        for device, jobs in self._dst_jobs.items():
            for k, (i, _, box) in enumerate(jobs):
                if int(got[device][k]) != want_of[i, box]:
                    problems.append(
                        (
                            self.paths[i],
                            f"device {device}: the shard {list(box)} differs from the source "
                            f"(checksum {int(got[device][k]):08x}, source {want_of[i, box]:08x})",
                        )
                    )
        if problems:
            raise leaf_error(
                "verify: these destination shards do not match their source",
                problems,
                "the result is corrupt; do not use it (report it with the plan's describe())",
            )

    def _run(self, key: Any, jobs: Sequence[Job], args: Sequence[jax.Array], cast: bool) -> Any:
        fn = self._fns.get(key)
        if fn is None:
            device = next(iter(args[0].devices()))
            specs = [
                (
                    local,
                    tuple(s for s, _ in glob),
                    self.leaves[i].shape,
                    jnp.dtype(self.leaves[i].dst_dtype) if cast else None,
                )
                for i, local, glob in jobs
            ]

            def sums(*xs: jax.Array) -> jax.Array:
                out = []
                for x, (local, origin, shape, dtype) in zip(xs, specs, strict=True):
                    part = x[tuple(slice(s, e) for s, e in local)]
                    if dtype is not None and part.dtype != dtype:
                        part = part.astype(dtype)
                    out.append(box_checksum(part, origin, shape))
                return jnp.stack(out) if out else jnp.zeros((0,), jnp.uint32)

            fn = self._fns[key] = jax.jit(sums, out_shardings=SingleDeviceSharding(device))
        # Strongly typed views of the same buffers: a call whose source is weakly typed where
        # the first call's was not (or the other way) runs the same program.
        return fn(*(_strong(a) for a in args))
