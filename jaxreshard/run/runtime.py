"""Runs a schedule on JAX devices: pack -> collective-permute rounds -> unpack.

A thin layer over JAX. For every bucket:

1. *pack*: each participating device runs a small jitted program that slices its source shards
   (or, for relays, its destination shards), casts them to the destination dtype and lays their
   bytes into one staging buffer (of the widest unsigned word every leaf's elements allow);
2. *transfer*: the per-device buffers are wrapped, zero-copy, into one array over a 1-D mesh of
   every participating device (`jax.make_array_from_single_device_arrays`), and one compiled
   ``shard_map`` program moves them with one ``jax.lax.ppermute`` per round (XLA
   collective-permute; NCCL send/recv on GPU);
3. *unpack*: each receiver writes the bytes into its destination shards in place (donated).

Destination shards are first created by a per-device *init* program that copies the part the
device already holds (or writes into donated buffers of a previous result). Programs are built
once per plan and cached; only this process's devices run pack/init/unpack, so the same code
serves multi-controller JAX. Buckets run one after the other: before the next bucket is packed,
the previous one is unpacked, so at most one send and one receive buffer exist per device.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxreshard.plan.layout import Box, box_shape, shift
from jaxreshard.plan.route import Assignment, LeafSpec
from jaxreshard.plan.schedule import Bucket, Schedule

AXIS = "jaxreshard"
"""Name of the 1-D mesh axis spanning every device of a transfer."""


class Executor:
    """Compiled programs of one plan, for the devices of this process.

    Construction builds no program and moves no data; programs are compiled on first use and
    kept for the life of the plan.
    """

    def __init__(
        self,
        leaves: Sequence[LeafSpec],
        assignment: Assignment,
        schedule: Schedule,
        dst_shardings: Sequence[NamedSharding],
    ) -> None:
        self.leaves = tuple(leaves)
        self.schedule = schedule
        self.dst_shardings = tuple(dst_shardings)
        self._device = {d.id: d for d in _all_devices(dst_shardings)}
        here = jax.process_index()
        self._local = {i for i, d in self._device.items() if d.process_index == here}
        dst_leaves: dict[int, list[int]] = defaultdict(list)
        for index, leaf in enumerate(self.leaves):
            for device in leaf.dst.devices:
                dst_leaves[device].append(index)
        self._dst_leaves = {d: tuple(v) for d, v in dst_leaves.items() if d in self._local}
        copies: dict[tuple[int, int], list[Box]] = defaultdict(list)
        for c in assignment.local:
            copies[c.device, c.leaf].append(c.box)
        self._copies = dict(copies)
        union = sorted({i for b in schedule.buckets for m in b.messages for i in (m.src, m.dst)})
        self._position = {device: i for i, device in enumerate(union)}
        self._mesh = Mesh(np.array([self._device[i] for i in union]), (AXIS,)) if union else None
        self._union_local = [i for i in union if i in self._local]
        self._programs: dict[Any, Any] = {}
        # Staging buffers hold words as wide as the narrowest element: XLA's CPU backend copies
        # uint32 words several times faster than the same bytes as uint8.
        self._word = np.dtype(
            f"uint{8 * min((bits_dtype(lf.dst_dtype).itemsize for lf in leaves), default=1)}"
        )
        self._staging_sharding = (
            NamedSharding(self._mesh, PartitionSpec(AXIS)) if self._mesh is not None else None
        )

    # ----------------------------------------------------------------------------------- run

    def run(
        self, src: Sequence[jax.Array], donate: Sequence[jax.Array] | None = None
    ) -> list[jax.Array]:
        """Move ``src`` (one array per leaf) into new destination arrays.

        With ``donate`` (previous results of this plan), their buffers receive the data and are
        consumed. The source arrays are only read.
        """
        src_shards = [_shards(x) for x in src]
        fresh = donate if donate is not None else self._allocate()
        dst = [_shards(x) if x is not None else {} for x in fresh]
        for device in self._dst_leaves:
            leaf_ids = self._init_sources(device)
            if not leaf_ids:
                continue
            outs = self._init_program(device)(
                *[src_shards[i][device] for i in leaf_ids], *[dst[i][device] for i in leaf_ids]
            )
            for i, arr in zip(leaf_ids, outs, strict=True):
                dst[i][device] = arr
        if self._union_local:  # a process owning no device of the transfer issues none of it
            self._run_buckets(src_shards, dst)
        return [self._assemble(i, dst[i]) for i in range(len(self.leaves))]

    def _assemble(self, i: int, shards: dict[int, jax.Array]) -> jax.Array:
        leaf, sharding = self.leaves[i], self.dst_shardings[i]
        if not math.prod(leaf.shape):
            # JAX gives zero-size jit outputs full-shape shards; an empty array needs no data.
            dtype = jnp.dtype(leaf.dst_dtype)
            empty = np.zeros(leaf.dst.shard_shape, dtype)
            return jax.make_array_from_callback(leaf.shape, sharding, lambda _: empty, dtype=dtype)
        order = [shards[d] for d in leaf.dst.devices if d in shards]
        # dtype= because a process holding no destination shard has no buffer to take it from.
        return jax.make_array_from_single_device_arrays(
            leaf.shape, sharding, order, dtype=jnp.dtype(leaf.dst_dtype)
        )

    def _run_buckets(
        self, src: list[dict[int, jax.Array]], dst: list[dict[int, jax.Array]]
    ) -> None:
        """Pack, move and unpack every bucket in order.

        Each round's chunk is an array of its own from pack to unpack, so the transfer is one
        collective-permute per round and nothing else (no slicing or re-assembly copies). A
        device that sends nothing in a round still passes an array of the round's size, which
        the collective never reads: a buffer received in the previous bucket, recycled (zeros
        only when none fits). Before a bucket's transfer starts, the previous bucket's unpack
        has finished, so a device holds at most one bucket of sent and one of received chunks.
        """
        assert self._mesh is not None
        spare: dict[int, dict[int, jax.Array]] = {d: {} for d in self._union_local}
        pending: list[jax.Array] = []
        for b, bucket in enumerate(self.schedule.buckets):
            words = [n // self._word.itemsize for n in bucket.slot_bytes]
            chunks: dict[int, list[jax.Array]] = {}
            for device in self._union_local:
                sent = self._sent_slots(bucket, device)
                packed = {}
                if sent:
                    step = self._pack_step(b, device)
                    args = [(dst if d else src)[i][device] for i, d in step.inputs]
                    packed = dict(zip(sent, step.program(*step.starts, *args), strict=True))
                chunks[device] = [
                    packed[t] if t in packed else self._spare(spare[device], device, n)
                    for t, n in enumerate(words)
                ]
            # Bound staging: the previous bucket has arrived and been unpacked, on senders too.
            jax.block_until_ready(pending)
            moved = self._transfer_program(b)(
                *[
                    jax.make_array_from_single_device_arrays(
                        (len(self._position) * n,),
                        self._staging_sharding,
                        [chunks[d][t] for d in self._union_local],
                    )
                    for t, n in enumerate(words)
                ]
            )
            del chunks
            received = [_shards(x) for x in moved]
            del moved
            pending = [x for r in received for x in r.values()]
            for device in self._union_local:
                slots = self._received_slots(bucket, device)
                if slots:
                    step = self._unpack_step(b, device)
                    outs = step.program(
                        *step.starts,
                        *[received[t][device] for t in slots],
                        *[dst[i][device] for i in step.inputs],
                    )
                    for i, arr in zip(step.inputs, outs, strict=True):
                        dst[i][device] = arr
                    pending.extend(outs)
                keep = self._spare_sizes(b + 1, device)
                spare[device] = {n: received[t][device] for t, n in enumerate(words) if n in keep}
            del received

    def _spare(self, pool: dict[int, jax.Array], device: int, words: int) -> jax.Array:
        """An array of ``words`` words on ``device`` whose contents do not matter."""
        if words not in pool:
            pool[words] = jnp.zeros((words,), self._word, device=self._device[device])
        return pool[words]

    def _sent_slots(self, bucket: Bucket, device: int) -> list[int]:
        return sorted(m.slot for m in bucket.sends(device))

    def _received_slots(self, bucket: Bucket, device: int) -> list[int]:
        return sorted(m.slot for m in bucket.recvs(device))

    def _spare_sizes(self, b: int, device: int) -> set[int]:
        """Word counts of the rounds of bucket ``b`` in which ``device`` sends nothing."""
        if b >= len(self.schedule.buckets):
            return set()
        bucket = self.schedule.buckets[b]
        sent = set(self._sent_slots(bucket, device))
        return {n // self._word.itemsize for t, n in enumerate(bucket.slot_bytes) if t not in sent}

    # ------------------------------------------------------------------------------ programs

    def _cached(self, key: Any, build: Any) -> Any:
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = build()
        return program

    def _init_sources(self, device: int) -> list[int]:
        return [i for i in self._dst_leaves.get(device, ()) if (device, i) in self._copies]

    def _allocate(self) -> list[jax.Array | None]:
        """Fresh zero destination arrays, one compiled program per destination device set."""
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, s in enumerate(self.dst_shardings):
            if not math.prod(self.leaves[i].shape):
                continue  # zero-size leaves are made in `_assemble`
            if not s.addressable_devices:
                continue  # multi-process: another process's destination; nothing to make here
            groups[tuple(d.id for d in s.mesh.devices.flat)].append(i)
        out: list[jax.Array | None] = [None] * len(self.leaves)
        for key, leaf_ids in groups.items():

            def build(leaf_ids: list[int] = leaf_ids) -> Any:
                leaves = [self.leaves[i] for i in leaf_ids]

                def alloc() -> tuple[jax.Array, ...]:
                    return tuple(jnp.zeros(lf.shape, jnp.dtype(lf.dst_dtype)) for lf in leaves)

                shardings = tuple(self.dst_shardings[i] for i in leaf_ids)
                return jax.jit(alloc, out_shardings=shardings)

            arrays = self._cached(("alloc", key), build)()
            for i, arr in zip(leaf_ids, arrays, strict=True):
                out[i] = arr
        return out

    def _init_program(self, device: int) -> Any:
        """Writes the parts ``device`` already holds into its (donated) destination buffers.

        One program serves fresh and donated buffers alike, so a refit loop that starts without
        ``donate=`` and continues with it compiles nothing after its first call. Only leaves
        with a local part on ``device`` take part; devices with none run no init program.
        """

        def build() -> Any:
            leaf_ids = self._init_sources(device)

            def init(*args: jax.Array) -> tuple[jax.Array, ...]:
                given = dict(zip(leaf_ids, args[: len(leaf_ids)], strict=True))
                outs = []
                for i, old in zip(leaf_ids, args[len(leaf_ids) :], strict=True):
                    leaf = self.leaves[i]
                    dst_box = leaf.dst.box_of[device]
                    dtype = jnp.dtype(leaf.dst_dtype)
                    bits = to_bits(old)
                    for box in self._copies.get((device, i), ()):
                        src_box = shift(box, _origin(leaf.src.box_of[device]))
                        part = read_bits(given[i], _origin(src_box), box_shape(src_box), dtype)
                        if box == dst_box:
                            bits = part
                        else:
                            bits = _write(bits, part, shift(box, _origin(dst_box)))
                    outs.append(from_bits(bits, dtype))
                return tuple(outs)

            n = len(leaf_ids)
            return self._jit(init, device, tuple(range(n, 2 * n)))

        return self._cached(("init", device), build)

    # Pack and unpack programs are keyed by their structure (shapes, dtypes, chunk offsets),
    # not by bucket: where a tensor is split over many buckets, or layers repeat, the buckets
    # differ only in where their boxes start, which is then passed at run time. A plan compiles
    # a few programs per device however many buckets it has. A structure that only one bucket
    # has gets its starts baked in (index arithmetic on device costs compile time per box).

    def _step(self, kind: str, b: int, device: int, layout: Any) -> _Step:
        key, inputs, starts, build = layout(b, device)
        if self._structure_count(kind, device, layout)[key] > 1:
            program = self._cached(key, lambda: build(None))
            return _Step(program, inputs, (self._index_array(starts, device),))
        program = self._cached((*key, tuple(starts)), lambda: build(tuple(starts)))
        return _Step(program, inputs, ())

    def _structure_count(self, kind: str, device: int, layout: Any) -> collections.Counter:
        def count() -> collections.Counter:
            keys = collections.Counter()
            for b, bucket in enumerate(self.schedule.buckets):
                if (bucket.sends if kind == "pack" else bucket.recvs)(device):
                    keys[layout(b, device)[0]] += 1
            return keys

        return self._cached(("count", kind, device), count)

    def _pack_step(self, b: int, device: int) -> _Step:
        return self._cached(
            ("pack step", b, device), lambda: self._step("pack", b, device, self._pack_layout)
        )

    def _pack_layout(self, b: int, device: int) -> tuple[Any, tuple, list[int], Any]:
        def build() -> tuple[Any, tuple, list[int], Any]:
            bucket = self.schedule.buckets[b]
            word = self._word.itemsize
            inputs: dict[tuple[int, bool], int] = {}
            structure, starts = [], []
            for m in sorted(bucket.sends(device), key=lambda m: m.slot):
                segments = []
                for seg in m.segments:
                    index = inputs.setdefault((seg.leaf, seg.from_dst), len(inputs))
                    leaf = self.leaves[seg.leaf]
                    held = (leaf.dst if seg.from_dst else leaf.src).box_of[device]
                    starts.extend(_origin(shift(seg.box, _origin(held))))
                    segments.append((index, box_shape(seg.box)))
                structure.append((bucket.slot_bytes[m.slot] // word, tuple(segments)))
            avals = []
            for leaf_id, from_dst in inputs:
                leaf = self.leaves[leaf_id]
                layout, dtype = (
                    (leaf.dst, leaf.dst_dtype) if from_dst else (leaf.src, leaf.src_dtype)
                )
                avals.append((layout.shard_shape, dtype, leaf.dst_dtype))
            key = ("pack", device, tuple(structure), tuple(avals), self._word.name)

            def program(static: tuple[int, ...] | None) -> Any:
                return self._build_pack(device, structure, avals, static)

            return key, tuple(inputs), starts, program

        return self._cached(("pack layout", b, device), build)

    def _build_pack(
        self, device: int, structure: list, avals: list, static: tuple[int, ...] | None
    ) -> Any:
        word = self._word

        def pack(*args: jax.Array) -> tuple[jax.Array, ...]:
            starts, shards = (None, args) if static is not None else (args[0], args[1:])
            chunks, k = [], 0
            for words, segments in structure:
                parts, used = [], 0
                for index, shape in segments:
                    _, _, dtype = avals[index]
                    at = _starts(starts, static, k, len(shape))
                    k += len(shape)
                    part = bits_to_words(read_bits(shards[index], at, shape, dtype), word)
                    parts.append(part)
                    used += part.shape[0]
                if used < words:
                    parts.append(jnp.zeros((words - used,), word))
                chunks.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
            return tuple(chunks)

        return self._jit(pack, device, ())

    def _unpack_step(self, b: int, device: int) -> _Step:
        return self._cached(
            ("unpack step", b, device),
            lambda: self._step("unpack", b, device, self._unpack_layout),
        )

    def _unpack_layout(self, b: int, device: int) -> tuple[Any, tuple, list[int], Any]:
        def build() -> tuple[Any, tuple, list[int], Any]:
            bucket = self.schedule.buckets[b]
            word = self._word.itemsize
            leaves: dict[int, int] = {}
            structure, starts = [], []
            for m in sorted(bucket.recvs(device), key=lambda m: m.slot):
                segments = []
                for seg in m.segments:
                    index = leaves.setdefault(seg.leaf, len(leaves))
                    held = self.leaves[seg.leaf].dst.box_of[device]
                    starts.extend(_origin(shift(seg.box, _origin(held))))
                    segments.append((index, box_shape(seg.box), seg.offset // word))
                structure.append((bucket.slot_bytes[m.slot] // word, tuple(segments)))
            avals = tuple(
                (self.leaves[i].dst.shard_shape, self.leaves[i].dst_dtype) for i in leaves
            )
            key = ("unpack", device, tuple(structure), avals, self._word.name)

            def program(static: tuple[int, ...] | None) -> Any:
                return self._build_unpack(device, structure, avals, static)

            return key, tuple(leaves), starts, program

        return self._cached(("unpack layout", b, device), build)

    def _build_unpack(
        self, device: int, structure: list, avals: tuple, static: tuple[int, ...] | None
    ) -> Any:
        word = self._word
        n_chunks = len(structure)

        def unpack(*args: jax.Array) -> tuple[jax.Array, ...]:
            starts, args = (None, args) if static is not None else (args[0], args[1:])
            chunks, shards = args[:n_chunks], args[n_chunks:]
            out = [to_bits(x) for x in shards]
            k = 0
            for (_, segments), chunk in zip(structure, chunks, strict=True):
                for index, shape, offset in segments:
                    dtype = jnp.dtype(avals[index][1])
                    size = math.prod(shape) * bits_dtype(dtype).itemsize // word.itemsize
                    size *= 2 if jnp.issubdtype(dtype, jnp.complexfloating) else 1
                    raw = lax.slice(chunk, (offset,), (offset + size,))
                    at = _starts(starts, static, k, len(shape))
                    k += len(shape)
                    out[index] = _write(out[index], words_to_bits(raw, dtype, shape), at)
            return tuple(
                from_bits(x, jnp.dtype(dtype)) for x, (_, dtype) in zip(out, avals, strict=True)
            )

        first = n_chunks + (static is None)
        donated = tuple(range(first, first + len(avals)))
        return self._jit(unpack, device, donated)

    def _index_array(self, starts: list[int], device: int) -> jax.Array:
        """Box starts of a step shared by several buckets: a few int32s uploaded once per plan
        and kept on the device (plan metadata, not array data)."""
        return jax.device_put(np.asarray(starts, np.int32), self._device[device])

    def _transfer_program(self, b: int) -> Any:
        bucket = self.schedule.buckets[b]
        perms = tuple(
            tuple((self._position[s], self._position[d]) for s, d in perm)
            for perm in bucket.perms()
        )

        def build() -> Any:
            def transfer(*chunks: jax.Array) -> tuple[jax.Array, ...]:
                return tuple(
                    lax.ppermute(chunk, AXIS, list(perm))
                    for chunk, perm in zip(chunks, perms, strict=True)
                )

            spec = (PartitionSpec(AXIS),) * len(perms)
            mapped = jax.shard_map(transfer, mesh=self._mesh, in_specs=spec, out_specs=spec)
            return jax.jit(mapped)

        return self._cached(("transfer", bucket.slot_bytes, perms), build)

    def compiled_transfer_text(self, b: int) -> str:
        """Optimized HLO of bucket ``b``'s transfer program (compiles it if needed)."""
        assert self._mesh is not None
        args = [
            jax.ShapeDtypeStruct(
                (len(self._position) * n // self._word.itemsize,),
                self._word,
                sharding=self._staging_sharding,
            )
            for n in self.schedule.buckets[b].slot_bytes
        ]
        return self._transfer_program(b).lower(*args).compile().as_text()

    def _jit(self, fn: Any, device: int, donate: tuple[int, ...]) -> Any:
        sharding = SingleDeviceSharding(self._device[device])
        return jax.jit(fn, out_shardings=sharding, donate_argnums=donate)


@dataclasses.dataclass(frozen=True)
class _Step:
    """A compiled pack or unpack program with what one bucket feeds it on one device.

    ``inputs`` are ``(leaf, from_dst)`` pairs for pack and leaf indices for unpack; ``starts``
    are the boxes' start indices (on the device), the only thing that differs between buckets
    sharing ``program``.
    """

    program: Any
    inputs: tuple[Any, ...]
    starts: tuple[jax.Array, ...]  # () when the starts are baked into the program


# ------------------------------------------------------------------------------------ helpers


def _all_devices(shardings: Sequence[Any]) -> list[jax.Device]:
    devices = {d.id: d for d in jax.devices()}
    for s in shardings:
        for d in s.device_set:
            devices[d.id] = d
    return list(devices.values())


def _shards(x: jax.Array | jax.ShapeDtypeStruct) -> dict[int, jax.Array]:
    """This process's per-device buffers of ``x`` (zero-copy views); none for a placeholder."""
    if not isinstance(x, jax.Array):
        return {}
    return {s.device.id: s.data for s in x.addressable_shards}


def _origin(box: Box) -> tuple[int, ...]:
    return tuple(start for start, _ in box)


def _starts(starts: jax.Array | None, static: tuple[int, ...] | None, k: int, n: int) -> list[Any]:
    """Start indices ``k .. k + n`` of a step: baked-in ints, or read from ``starts``."""
    if static is not None:
        return list(static[k : k + n])
    return [starts[k + j] for j in range(n)]


def _write(x: jax.Array, part: jax.Array, at: Box | Sequence[Any]) -> jax.Array:
    """``x`` with ``part`` written from ``at`` (a box, or its start indices; in place when
    ``x`` is donated)."""
    starts = _origin(at) if at and isinstance(at[0], tuple) else tuple(at)
    return lax.dynamic_update_slice(x, part, (*starts, *(0,) * (x.ndim - len(starts))))


# Every byte is moved as unsigned integers of the element's width: XLA's CPU backend computes
# some ops on 16-bit floats in float32 and would quieten NaN payloads (bit-exactness is a
# promise). A cast requested by the user is the only floating-point operation.


def wire_itemsize(dtype: Any) -> int:
    """Bytes one element of ``dtype`` takes in a staging buffer (sub-byte types take one)."""
    return max(1, jnp.dtype(dtype).itemsize)


def bits_dtype(dtype: Any) -> np.dtype:
    """The unsigned type that carries ``dtype``'s bits (complex: per real component)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return np.dtype(f"uint{dtype.itemsize * 4}")
    return np.dtype(f"uint{wire_itemsize(dtype) * 8}")


def bits_shape(shape: tuple[int, ...], dtype: Any) -> tuple[int, ...]:
    """Shape of `to_bits` of an array: complex values gain a trailing (real, imag) axis."""
    complex_ = jnp.issubdtype(jnp.dtype(dtype), jnp.complexfloating)
    return (*shape, 2) if complex_ else tuple(shape)


def to_bits(x: jax.Array) -> jax.Array:
    """``x``'s bits as unsigned integers (a free bitcast for the common dtypes)."""
    dtype = jnp.dtype(x.dtype)
    if dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        x = jnp.stack([lax.real(x), lax.imag(x)], axis=-1)
        return lax.bitcast_convert_type(x, bits_dtype(dtype))
    width = jax.dtypes.itemsize_bits(dtype)
    if width < 8:  # int4, fp4, ...: widen losslessly to one byte
        return lax.bitcast_convert_type(x, jnp.dtype(f"uint{width}")).astype(jnp.uint8)
    return lax.bitcast_convert_type(x, bits_dtype(dtype))


def from_bits(bits: jax.Array, dtype: Any) -> jax.Array:
    """Inverse of `to_bits`."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return bits != 0
    if jnp.issubdtype(dtype, jnp.complexfloating):
        real = lax.bitcast_convert_type(bits, jnp.finfo(dtype).dtype)
        return lax.complex(real[..., 0], real[..., 1])
    width = jax.dtypes.itemsize_bits(dtype)
    if width < 8:
        return lax.bitcast_convert_type(bits.astype(jnp.dtype(f"uint{width}")), dtype)
    return lax.bitcast_convert_type(bits, dtype)


def read_bits(shard: jax.Array, at: Sequence[Any], shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """The bits of the ``shape`` block of ``shard`` starting at ``at``, cast to ``dtype`` (the
    cast runs only when dtypes differ). ``at`` may hold traced indices."""
    if jnp.dtype(shard.dtype) != jnp.dtype(dtype):
        return to_bits(lax.dynamic_slice(shard, tuple(at), shape).astype(dtype))
    bits = to_bits(shard)
    extra = bits.shape[len(shape) :]
    return lax.dynamic_slice(bits, (*at, *(0,) * len(extra)), (*shape, *extra))


def bits_to_words(bits: jax.Array, word: np.dtype) -> jax.Array:
    """Unsigned-integer bits as a flat vector of ``word`` (no wider than the bits' type)."""
    if bits.dtype != word:
        bits = lax.bitcast_convert_type(bits, word)
    return bits.reshape(-1)


def words_to_bits(raw: jax.Array, dtype: Any, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of `bits_to_words` for an array of ``dtype`` and ``shape``."""
    target = bits_dtype(dtype)
    full = bits_shape(shape, dtype)
    if target == raw.dtype:
        return raw.reshape(full)
    ratio = target.itemsize // raw.dtype.itemsize
    return lax.bitcast_convert_type(raw.reshape((*full, ratio)), target)
