"""Integrity on demand: per-shard checksums of a refit's result against its source, on device.

The checksum of a box of a global array is a sum of hashes of its words, each hashed together
with its global column and weighted by its global row:

    checksum(box) = sum over words w in box of  mix(bits(w) ^ mix(c(w) ^ C)) * (2 mix(r(w)) + 1)
                                                                              (mod 2**32)

where ``bits(w)`` is the word's bits as an unsigned 32-bit number, ``mix`` MurmurHash3's
32-bit finalizer, ``c(w)`` the word's column and ``r(w)`` the row-major index of its row
(every dimension but the last) in the *global* array, and ``C`` a constant. A word is one
element of 32 bits or fewer (narrower dtypes widened); a 64-bit element is two words and a
complex one its parts' words, side by side along the last dimension (so the columns there
count words, not elements). Because a word's term depends on its global position only, the
checksum of a box is the sum of the checksums of any partition of it: each source device
computes the part of every destination box it holds, each destination device the checksum of
its whole shard, and only those 4-byte sums reach the host. ``mix`` is a bijection and a row
weight is odd, so changing one word always changes the sum. Several changed or moved words
cancel with odds of about 2**-32: a word's hash depends on its column, so a word moved along
its row hashes anew, and rows weigh differently. Two words swapped within one column are the
exception, at about 2**-27: the difference of two odd weights is even. (Hashing the row into
the word too would close it, but cost a fifth more time on XLA CPU, where these sums are
bound by integer arithmetic; the row's weight is applied to its sum, once per row.)
Earlier forms had structural blind spots, each a regression test now: words summed unmixed
(two sign flips cancel), weights ``(2 r + 1)(2 c + 1)`` (the same at ``(r, c)`` and
``(c, r)``), unmixed column weights (two words swapped ``2**16`` columns apart cancelled with
odds of 2**-15), and a 64-bit or complex element folded into one word before hashing (a
crafted change of both halves kept the fold, and the sum).

The source side is cast to the destination dtype first (the same XLA convert the senders run),
so a cast refit verifies bit for bit too. Typed PRNG keys are checked as their key data.

Cost: one read of the source and one of the result, in pieces (`CHUNK_WORDS`), and a few
bytes per shard to the host (read explicitly even under ``jax.transfer_guard``: the caller
asked for it). The programs are shared by the shape of the boxes they sum, each summing a
few boxes (`GROUP_WORDS`) on every device of one side at once (a ``shard_map`` over those
devices, each reading its own buffers, as the runtime's programs do), their starts from a
small table kept on the devices: built on the first `verify` and reused. So a side compiles
one program per box shape, not one per device.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxreshard.errors import ReshardError, leaf_error
from jaxreshard.planning.layout import Box, shift
from jaxreshard.planning.route import LeafSpec
from jaxreshard.run import runtime, views
from jaxreshard.run.codec import from_bits, to_bits

C = np.uint32(0x9E3779B9)  # sets the columns' hashes apart from the rows'

Job = tuple[int, Box, Box]
"""(leaf, box relative to the shard, the same box in global coordinates)."""


def _words(x: jax.Array) -> jax.Array:
    """Each element's bits as uint32 words: shape ``x.shape + (k,)``, ``k`` words per element
    (1 up to 32 bits, 2 for 64 bits and complex64, 4 for complex128)."""
    dtype = jnp.dtype(x.dtype)
    if dtype == jnp.bool_:
        return x.astype(jnp.uint32)[..., None]
    if jnp.issubdtype(dtype, jnp.complexfloating):  # its two parts' words, side by side
        return jnp.concatenate([_words(jnp.real(x)), _words(jnp.imag(x))], axis=-1)
    bits = jax.dtypes.itemsize_bits(dtype)  # not itemsize: 4-bit and 2-bit types take 1 byte
    if bits == 32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)[..., None]
    if bits < 32:
        # Bits as the unsigned type of the same width, then widened: element by element (a
        # bit-cast to a wider type would pack several sub-byte elements into one word).
        narrow = {2: jnp.uint2, 4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16}[bits]
        return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)[..., None]
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 64 bits: (..., 2)


def _mix(words: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer, element by element: a bijection of uint32 in which
    every input bit flips about half of the output bits."""
    h = words ^ (words >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


CHUNK_WORDS = 1 << 16
"""Words a checksum sums in one piece (256 KiB of 32-bit words). XLA's CPU backend writes a
reduction's hashed words to a temporary array before it sums them (it rewrites large
reductions as trees of windowed ones, which the hash does not fuse into), so a box summed in
one piece wrote, and page-faulted, a temporary as large as itself: about 1 GB/s for a 64 MiB box
on one device here. In pieces, a loop whose temporary stays in cache, `plan.verify` of the
bench's disjoint trees (8 devices on 2 cores; fp32, then bf16) took 0.82x and 0.76x the refit
with pieces of 2**16 words, 0.70x and 0.79x with 2**15, 0.86x and 0.83x with 2**14, 1.29x and
0.69x with 2**18, 1.98x and 2.12x with 2**20, and 2.4x and 3.1x in one piece."""


def box_checksum(x: jax.Array, origin: Sequence[Any], global_shape: Sequence[int]) -> jax.Array:
    """The checksum (uint32 scalar) of ``x``, the elements of a box starting at ``origin`` of
    an array of ``global_shape`` (the module docstring's formula). Traceable; ``origin`` may
    hold traced integers.

    Taken piece by piece (`CHUNK_WORDS`, the box cut along its dimensions: the checksum of a
    box is the sum of its pieces'), each as ``sum_rows(row_weight * sum_cols(mix(word ^
    col_hash)))``: a xor, the mix and an add per word; the positions' hashes and weights on
    the (small) row and column grids.
    """
    return box_checksum_of(x, (0,) * x.ndim, x.shape, origin, global_shape)


def box_checksum_of(
    x: jax.Array,
    start: Sequence[Any],
    shape: Sequence[int],
    origin: Sequence[Any],
    global_shape: Sequence[int],
    dtype: Any = None,
    *,
    nan: int | None = None,
) -> jax.Array:
    """`box_checksum` of the box of ``shape`` of ``x`` starting at ``start`` (cast to
    ``dtype`` first when given), without slicing it out first: each piece is read from ``x``
    where it lies. With ``nan`` (bits of ``dtype``), every NaN is summed as those bits."""
    dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    per = _words_per_element(dtype)
    # Values XLA's CPU backend computes through float32 (bfloat16, float8: a slice of them in
    # a loop quietened NaN payloads) are sliced as their bits, a cast source too, made values
    # again right before its cast. (How XLA converts a NaN's payload still depends on what
    # the convert is fused with, so a cast leaf's NaNs are compared as NaNs: `nan`,
    # `canonical_nan`.)
    as_bits = not _sliced_exactly(jnp.dtype(x.dtype))

    def piece(start: Sequence[Any], shape: Sequence[int], origin: Sequence[Any]) -> jax.Array:
        part = to_bits(x) if as_bits else x
        if tuple(shape) != tuple(x.shape):
            part = lax.dynamic_slice(part, [jnp.int32(s) for s in start], tuple(shape))
        is_bits = as_bits
        if x.dtype != dtype:
            part = (from_bits(part, x.dtype) if as_bits else part).astype(dtype)
            is_bits = False
        if nan is not None:
            bits = part if is_bits else to_bits(part)
            values = from_bits(part, dtype) if is_bits else part
            part = jnp.where(jnp.isnan(values), bits.dtype.type(nan), bits)
        return _checksum(part, origin, global_shape)

    def cut(start: list[Any], shape: list[int], origin: list[Any], d: int) -> jax.Array:
        # Dimensions before d are one element wide here.
        if d >= len(shape) or math.prod(shape) * per <= CHUNK_WORDS:
            return piece(start, shape, origin)

        def part(offset: Any, n: int) -> tuple[list[Any], list[int], list[Any]]:
            """The sub-box of ``n`` indices of dimension d from ``offset`` on."""
            return _moved(start, d, offset), _with(shape, d, n), _moved(origin, d, offset)

        inner = math.prod(shape[d + 1 :]) * per
        if inner > CHUNK_WORDS:  # one index of dimension d at a time, the next one cut
            one = lambda i, acc: acc + cut(*part(i, 1), d + 1)  # noqa: E731
            return lax.fori_loop(0, shape[d], one, np.uint32(0))
        k = max(1, CHUNK_WORDS // inner)
        whole, tail = divmod(shape[d], k)
        chunk = lambda i, acc: acc + piece(*part(i * k, k))  # noqa: E731
        acc = lax.fori_loop(0, whole, chunk, np.uint32(0))
        return acc + piece(*part(whole * k, tail)) if tail else acc

    return cut(list(start), list(shape), list(origin), 0)


def canonical_nan(dtype: Any) -> int | None:
    """The bits `plan.verify` sums for every NaN of a leaf cast to ``dtype`` (None: a dtype
    without NaN, or not floating). XLA's CPU backend converts a NaN's payload differently
    with what the convert is fused with (bfloat16 0x7fc1 -> float16 0x7e08 alone, 0x7e00
    after a slice in a loop; float8_e5m2 0x7f -> float16 0x7e00 alone, 0x7f00 after a
    bit-cast), so the sums of a cast leaf compare its NaNs as NaNs, and its other values bit
    for bit."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    value = np.array(np.nan, np.float32).astype(dtype)
    if not np.isnan(value.astype(np.float32)):
        return None
    width = jax.dtypes.itemsize_bits(dtype)
    return int(value.view(f"uint{max(8, width)}")) if width >= 8 else None


def _sliced_exactly(dtype: np.dtype) -> bool:
    """Whether slicing values of ``dtype`` keeps their bits on every backend (not so for
    bfloat16 and the float8 and float4 types on CPU, computed there through float32)."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return True  # integers, booleans, complex numbers
    return dtype in (jnp.dtype(jnp.float16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))


def _moved(at: Sequence[Any], d: int, by: Any) -> list[Any]:
    return [a + by if i == d else a for i, a in enumerate(at)]


def _with(shape: Sequence[int], d: int, n: int) -> list[int]:
    return [n if i == d else s for i, s in enumerate(shape)]


def _words_per_element(dtype: np.dtype) -> int:
    """How many uint32 words `_words` makes of one element of ``dtype``."""
    bits = jax.dtypes.itemsize_bits(dtype)
    return max(1, bits // 32)


def _u32(v: Any) -> Any:
    """A position (a Python or traced integer) as uint32, modulo 2**32."""
    if isinstance(v, (int, np.integer)):
        return np.uint32(int(v) % 2**32)
    return lax.convert_element_type(v, jnp.uint32)


def _checksum(x: jax.Array, origin: Sequence[Any], global_shape: Sequence[int]) -> jax.Array:
    """`box_checksum` in one piece."""
    words = _words(x)
    k = words.shape[-1]  # words per element: they sit side by side along the last dimension
    if x.ndim == 0:
        words = words.reshape(1, k)
        origin, global_shape = (0, 0), (1, k)
    else:
        words = words.reshape(*x.shape[:-1], x.shape[-1] * k)
        origin = (*origin[:-1], _u32(origin[-1]) * np.uint32(k))
        global_shape = (*global_shape[:-1], global_shape[-1] * k)
        if x.ndim == 1:
            words = words.reshape(1, -1)
            origin, global_shape = (0, *origin), (1, *global_shape)
    cols = jax.lax.iota(jnp.uint32, words.shape[-1]) + _u32(origin[-1])
    col_hash = _mix(cols ^ C)
    lead = words.shape[:-1]
    row = jnp.zeros(lead, jnp.uint32)
    stride = 1
    for d in range(len(lead) - 1, -1, -1):
        pos = jax.lax.broadcasted_iota(jnp.uint32, lead, d) + _u32(origin[d])
        row = row + pos * np.uint32(stride % 2**32)
        stride *= int(global_shape[d])
    row_weight = _mix(row) * np.uint32(2) + np.uint32(1)
    col_hash = col_hash.reshape((1,) * len(lead) + col_hash.shape)  # (no rank promotion)
    per_row = jnp.sum(_mix(words ^ col_hash), axis=-1, dtype=jnp.uint32)
    return jnp.sum(per_row * row_weight, dtype=jnp.uint32)


@jax.jit
def _same_bits(a: jax.Array, b: jax.Array) -> jax.Array:
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    return jnp.array_equal(to_bits(a), to_bits(b))


def differing_shards(a: jax.Array, b: jax.Array) -> list[int]:
    """The ids of this process's devices where ``a``'s shard and ``b``'s (two arrays of one
    shape, dtype and sharding) differ in any bit, compared on device (a flag per shard
    reaches the host)."""
    theirs = {s.device.id: s.data for s in b.addressable_shards}
    flags = {s.device.id: _same_bits(s.data, theirs[s.device.id]) for s in a.addressable_shards}
    with jax.transfer_guard_device_to_host("allow"):
        return sorted(d for d, same in flags.items() if not bool(same))


GROUP_JOBS = 16
"""The most boxes a device sums in one run of a checksum program (`Verifier._build`): fewer
runs, at the cost of compiling that many boxes' sums into one program."""

GROUP_WORDS = 1 << 18
"""About how many words a device sums in one run: boxes of ``w`` words are summed
``GROUP_WORDS // w`` a run (at least 1, at most `GROUP_JOBS`), so that small boxes share a
dispatch and large ones, whose sums are loops that take long to compile, each take one."""


def _group_jobs(signature: Any) -> int:
    """How many boxes of one shape (`Verifier._build`'s signature) a device sums a run."""
    _, source, extent, dtype, _, _ = signature
    words = max(1, math.prod(extent) * _words_per_element(dtype or source))
    return max(1, min(GROUP_JOBS, GROUP_WORDS // words))


@dataclasses.dataclass(frozen=True)
class _Run:
    """One run of a checksum program over the devices of one side that hold boxes of one
    shape: each device sums ``len(jobs)`` of its boxes (its jobs ``jobs[j][k]`` for device
    ``k`` of ``devices``; a device with fewer such boxes than the others sums its first one
    again, and that sum is not read: ``None``)."""

    fn: Any
    table: jax.Array  # per device, per box: its starts in the shard, then its global origin
    view: views.View  # the re-wrapping of the ``j``-th boxes' buffers onto the run's mesh
    devices: tuple[int, ...]
    jobs: tuple[tuple[int | None, ...], ...]  # [j][k]: job index on device k, None: padding
    padded: tuple[tuple[int, ...], ...]  # [j][k]: the job whose buffer device k reads

    def dispatch(self, buffers: Sequence[Sequence[jax.Array]]) -> jax.Array:
        """Start the run on ``buffers[k][job]`` (device ``k``'s buffer of each job)."""
        operands = [
            self.view([buffers[k][job] for k, job in enumerate(row)]) for row in self.padded
        ]
        return self.fn(self.table, *operands)


def _collect(
    started: Sequence[tuple[_Run, jax.Array]], jobs: dict[int, list[Job]]
) -> dict[int, np.ndarray]:
    """The sums of `Verifier._start`'s runs, read back: per device, in the order of its
    ``jobs`` (a padding sum is not read)."""
    out = {d: np.zeros(len(js), np.uint32) for d, js in jobs.items()}
    for run, value in started:
        value = np.asarray(value).reshape(len(run.devices), len(run.jobs))
        for j, row in enumerate(run.jobs):
            for k, job in enumerate(row):
                if job is not None:
                    out[run.devices[k]][job] = value[k, j]
    return out


class Verifier:
    """The checksum programs of one plan (built on first use), and the comparison."""

    def __init__(self, leaves: Sequence[LeafSpec], paths: Sequence[str]) -> None:
        self.leaves = tuple(leaves)
        self.paths = tuple(paths)
        self._src_jobs, self._expected_of = self._source_jobs()
        # Per leaf, the bits its NaNs are summed as on both sides: a cast leaf's (see
        # `canonical_nan`), None for the others.
        self._nans = [
            canonical_nan(leaf.dst_dtype) if leaf.src_dtype != leaf.dst_dtype else None
            for leaf in self.leaves
        ]
        self._dst_jobs: dict[int, list[Job]] = defaultdict(list)  # every destination shard
        for i, leaf in enumerate(self.leaves):
            for device, box in zip(leaf.dst.devices, leaf.dst.boxes, strict=True):
                self._dst_jobs[device].append((i, tuple((0, e - s) for s, e in box), box))
        self._fns: dict[Any, Any] = {}  # programs by the shape of the boxes they sum
        self._runs: dict[str, list[_Run]] = {}

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
        # Both sides' sums are dispatched before either is read, so that they run together.
        started = (
            self._start("src", self._src_jobs, src_buffers, cast=True),
            self._start("dst", self._dst_jobs, dst_buffers, cast=False),
        )
        with jax.transfer_guard_device_to_host("allow"):
            sums, got = (_collect(runs, jobs) for runs, jobs in started)
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

    def _start(
        self,
        side: str,
        jobs: dict[int, list[Job]],
        buffers: Sequence[dict[int, jax.Array]],
        cast: bool,
    ) -> tuple[list[tuple[_Run, jax.Array]], dict[int, list[Job]]]:
        """Dispatch the sums of every job of one side (``jobs`` per device, over
        ``buffers[leaf]`` by device id): each run with its (pending) sums, and the jobs."""
        runs = self._runs.get(side)
        if runs is None:
            runs = self._runs[side] = self._build(jobs, buffers, cast)
        per_device = {d: [buffers[i][d] for i, _, _ in js] for d, js in jobs.items()}
        return [(run, run.dispatch([per_device[d] for d in run.devices])) for run in runs], jobs

    def _build(
        self, jobs: dict[int, list[Job]], buffers: Sequence[dict[int, jax.Array]], cast: bool
    ) -> list[_Run]:
        """One side's jobs as runs of programs over its devices: the jobs of one shape
        (`_program`) of every device that has some, `_group_jobs` of each device's a run,
        each run with its table of box starts and origins, kept on the devices."""
        alike: dict[Any, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        by_id = {}  # (the devices of the buffers: a plan's backend need not be the default)
        for device, js in jobs.items():
            for j, (i, local, _) in enumerate(js):
                a = buffers[i][device]
                by_id.setdefault(device, next(iter(a.devices())))
                leaf = self.leaves[i]
                dtype = jnp.dtype(leaf.dst_dtype) if cast else None
                extent = tuple(e - s for s, e in local)
                key = (a.shape, jnp.dtype(a.dtype), extent, dtype, leaf.shape, self._nans[i])
                alike[key][device].append(j)
        runs = []
        for signature, members in alike.items():
            devices = tuple(sorted(members))
            mesh = Mesh(np.array([by_id[d] for d in devices]), ("v",))
            view = runtime.shard_view(signature[0], signature[1], mesh)
            longest = max(len(m) for m in members.values())
            # Every run of a shape sums as many boxes (the last one re-sums some), so that the
            # shape compiles one program.
            g = min(_group_jobs(signature), longest)
            for at in range(0, longest, g):
                rows, real, padded = [], [], []
                for k in range(g):
                    got = [
                        members[d][at + k] if at + k < len(members[d]) else None for d in devices
                    ]
                    real.append(tuple(got))
                    padded.append(
                        tuple(
                            members[d][0] if j is None else j
                            for d, j in zip(devices, got, strict=True)
                        )
                    )
                for k, d in enumerate(devices):
                    for row in padded:
                        _, local, box = jobs[d][row[k]]
                        rows.append([*(s for s, _ in local), *(s for s, _ in box)])
                rank = len(signature[2])
                table = np.array(rows, np.int32).reshape(len(devices) * g, 2 * rank)
                # The table is verify's own: made once, under any transfer guard.
                with jax.transfer_guard_host_to_device("allow"):
                    table = jax.device_put(table, NamedSharding(mesh, PartitionSpec("v")))
                fn = self._program(signature, g, view)
                runs.append(_Run(fn, table, view, devices, tuple(real), tuple(padded)))
        return runs

    def _program(self, signature: Any, n: int, view: views.View) -> Any:
        """The checksums of ``n`` boxes of one ``(shard shape, shard dtype, box extent, cast
        dtype or None, global shape)`` on every device of ``view``'s mesh (its operands the
        boxes' shards re-wrapped by ``view``), their starts and origins in a table (one row
        per box and device): one program for every such group of every leaf.

        Shared so that a tree of many leaves compiles a few programs, not one term per box
        (one program per device summing every box took 185 s and 4.4 GB to compile for 1024
        leaves of 256 KiB), and one program over the devices of a side, not one per device."""
        mesh = view.sharding.mesh
        key = (signature, n, mesh)
        fn = self._fns.get(key)
        if fn is not None:
            return fn
        _, source, extent, dtype, global_shape, nan = signature
        rank = len(extent)

        def sums(table: jax.Array, *xs: jax.Array) -> jax.Array:
            out = []
            for g, x in enumerate(xs):
                start = [table[g, d] for d in range(rank)]
                origin = [table[g, rank + d] for d in range(rank)]
                out.append(box_checksum_of(x, start, extent, origin, global_shape, dtype, nan=nan))
            return jnp.stack(out)

        split = PartitionSpec("v")
        mapped = jax.shard_map(
            sums,
            mesh=mesh,
            in_specs=(split, *(view.sharding.spec,) * n),
            out_specs=split,
            check_vma=False,
        )
        # XLA's older CPU emitters compile a bit-cast hoisted out of a loop (`CHUNK_WORDS`) to
        # no copy at all (the newer ones copy the array), but take 3-4x as long to compile a
        # box's sums: a program that loops over pieces compiles with the older ones, one of
        # boxes summed in one piece with the newer; a program that casts keeps the options
        # the senders' casts compile with (`runtime.program_options`).
        platform = mesh.devices.flat[0].platform
        casts = dtype is not None and dtype != source
        loops = math.prod(extent) * _words_per_element(dtype or source) > CHUNK_WORDS
        fn = self._fns[key] = jax.jit(
            mapped,
            out_shardings=NamedSharding(mesh, split),
            compiler_options=runtime.program_options(platform, casts or not loops),
        )
        return fn
