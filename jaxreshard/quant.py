"""FP8 refit: quantize on the senders, with per-block scales laid out for the sampler.

    plan = jr.plan(params, sampler_shardings, dtype={"experts": jr.Fp8Blockwise(), "norm": None})
    sampler = plan(params)  # sampler["experts"] is a jr.QuantizedArray(values, scales)

**Format.** `Fp8Blockwise(block=(128, 128), fmt=jnp.float8_e4m3fn)` splits the trailing
``len(block)`` dimensions of a leaf into blocks (leading dimensions, such as experts, are
blocked one by one) and keeps one float32 scale per block, DeepSeek-V3's ``weight_scale_inv``
convention: ``dequantized = values.astype(float32) * scale`` (the scale broadcast over its
block), with ``scale = max(amax(|block|) * float32(1 / max(fmt)), TINY)`` (1 for an all-zero
block or one holding a NaN; ``TINY`` is float32's smallest normal, below which XLA flushes) and
``values = clip(x * (1 / scale), -max, max)`` rounded to ``fmt`` (round to nearest even), all in
float32. ``block=None`` scales
the whole tensor by one scale. ``fmt`` is ``jnp.float8_e4m3fn`` (max 448, 3 mantissa bits) or
``jnp.float8_e5m2`` (max 57344, 2 mantissa bits).

**Where it runs.** On the senders: one compiled program over the source layout computes the
fp8 values (in the source sharding) and the scales, then the plan moves both like any other
leaves, so ``bytes_sent`` counts 1 byte per value plus 4 per block (0.50x a bf16 refit for
128 x 128 blocks). Blocks that straddle source shards need the amax of parts on several
devices: the quantize program combines the partial amaxes (XLA inserts a max-reduction over
the devices that split the block, a few bytes per block) and keeps those scales replicated
on the source devices; where blocks align with the source shards, it runs no collective at
all. The quantized copy lives in the source layout for the duration of a call (a quarter of an
fp32 source).

**Destination layout.** Every destination shard must hold whole blocks (its boundaries are
multiples of the block): the scales then take the values' own sharding over the grid of blocks,
so each destination device holds exactly the scales of its values. A destination that cuts
blocks is refused before anything moves.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from jaxreshard.errors import ReshardError, deleted_sources_error, leaf_error
from jaxreshard.run import runtime, views
from jaxreshard.run.boundary import on_device_memory

TINY = np.float32(np.finfo(np.float32).tiny)
"""The least scale: float32's smallest normal (XLA flushes subnormal floats to zero)."""


@dataclasses.dataclass(frozen=True)
class Fp8Blockwise:
    """A scaled FP8 destination format (see the module docstring).

    Attributes:
      block: block size along each of the trailing dimensions (``(128, 128)``: DeepSeek-V3's
        blocks), or None for one scale per tensor.
      fmt: ``jnp.float8_e4m3fn`` (default) or ``jnp.float8_e5m2``.
    """

    block: tuple[int, ...] | None = (128, 128)
    fmt: Any = jnp.float8_e4m3fn

    def __post_init__(self) -> None:
        if self.block is not None:
            block = _sizes(self.block)
            if block is None:
                raise ReshardError(
                    f"Fp8Blockwise block must be positive integer sizes, got {self.block!r}\n"
                    "How to fix: pass one size per trailing dimension, such as (128, 128), or "
                    "None for one scale per tensor"
                )
            object.__setattr__(self, "block", block)
        try:
            fmt = jnp.dtype(self.fmt)
        except TypeError:
            fmt = None
        if fmt not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
            raise ReshardError(
                f"Fp8Blockwise fmt must be jnp.float8_e4m3fn or jnp.float8_e5m2, got "
                f"{self.fmt!r}\n"
                "How to fix: pass fmt=jnp.float8_e4m3fn (the default) or jnp.float8_e5m2; "
                "for another dtype, pass it as the plan's dtype= instead of an Fp8Blockwise"
            )
        object.__setattr__(self, "fmt", fmt)

    @property
    def max(self) -> float:
        """The largest finite value of ``fmt``."""
        return float(jnp.finfo(self.fmt).max)

    def blocks(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The block size along every dimension of ``shape`` (1 on leading dimensions; the
        whole dimension for per-tensor scaling)."""
        if self.block is None:
            return tuple(shape)
        lead = len(shape) - len(self.block)
        return (1,) * lead + self.block

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of the scales of a leaf of ``shape``."""
        if self.block is None:
            return ()
        return tuple(n // b for n, b in zip(shape, self.blocks(shape), strict=True))


@jax.tree_util.register_pytree_with_keys_class
class QuantizedArray:
    """A leaf moved as `Fp8Blockwise`: fp8 ``values`` and float32 ``scales`` (a pytree).

    ``values`` has the destination sharding; ``scales`` (one per block, ``weight_scale_inv``
    convention) the same sharding over the grid of blocks, so every device holds the scales of
    its own values. `dequantize` gives the array back (within the format's rounding).
    """

    def __init__(self, values: Any, scales: Any, fmt: Fp8Blockwise) -> None:
        self.values = values
        self.scales = scales
        self.format = fmt

    def tree_flatten(self) -> tuple[tuple[Any, Any], Fp8Blockwise]:
        return (self.values, self.scales), self.format

    def tree_flatten_with_keys(self) -> tuple[tuple[tuple[Any, Any], ...], Fp8Blockwise]:
        # Keyed, so that a path names the part: ``['w'].values``, ``['w'].scales``.
        keys = jax.tree_util.GetAttrKey("values"), jax.tree_util.GetAttrKey("scales")
        return tuple(zip(keys, (self.values, self.scales), strict=True)), self.format

    @classmethod
    def tree_unflatten(cls, fmt: Fp8Blockwise, children: Sequence[Any]) -> QuantizedArray:
        return cls(children[0], children[1], fmt)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """``values * scales`` (each scale over its block) as ``dtype``, on the values'
        devices."""
        return dequantize(self.values, self.scales, self.format).astype(dtype)

    def __repr__(self) -> str:
        return (
            f"QuantizedArray(values={self.values.dtype}{list(self.values.shape)}, "
            f"scales=float32{list(self.scales.shape)}, block={self.format.block})"
        )


def _sizes(block: Any) -> tuple[int, ...] | None:
    """``block`` as a tuple of positive ints, or None where it is not one (a bare int, a
    string, floats or bools, which ``int()`` would quietly truncate)."""
    if isinstance(block, (str, bytes)) or not isinstance(block, (Sequence, np.ndarray)):
        return None
    if len(block) == 0 or not all(
        isinstance(b, (int, np.integer)) and not isinstance(b, (bool, np.bool_)) and b >= 1
        for b in block
    ):
        return None
    return tuple(int(b) for b in block)


def quantize(x: jax.Array, fmt: Fp8Blockwise) -> tuple[jax.Array, jax.Array]:
    """The fp8 values and float32 scales of ``x`` (traceable; global view)."""
    x32 = x.astype(jnp.float32)
    blocks = fmt.blocks(x.shape)
    grid = fmt.scale_shape(x.shape) if fmt.block is not None else (1,) * x.ndim
    split = tuple(d for pair in zip(grid, blocks, strict=True) for d in pair)
    xb = x32.reshape(split)
    inner = tuple(range(1, 2 * x.ndim, 2))
    # (initial: a zero-size leaf's one block has no element, and scale 1 as a block of zeros.)
    amax = jnp.max(jnp.abs(xb), axis=inner, keepdims=True, initial=np.float32(0))
    # A block holding a NaN has a NaN amax, so its scale is 1, as inside one shard. Where a
    # block straddles source shards the max of its parts is a cross-device reduction, which
    # need not propagate NaN (XLA CPU's drops it), so NaN is looked for on its own.
    nan = jnp.any(jnp.isnan(xb), axis=inner, keepdims=True)
    amax = jnp.where(nan, np.float32(np.nan), amax)
    # Multiplications by reciprocals, spelled out: XLA rewrites a division by a constant into
    # one, so the format is defined that way for every backend (and the NumPy reference).
    # A scale below float32's smallest normal would be flushed to zero (XLA's CPU and GPU
    # backends flush subnormals) and its block with it: it is held at the smallest normal.
    scale = jnp.where(amax > 0, jnp.maximum(amax * np.float32(1 / fmt.max), TINY), np.float32(1))
    inverse = np.float32(1) / scale
    values = jnp.clip(xb * inverse, -fmt.max, fmt.max).astype(fmt.fmt).reshape(x.shape)
    scales = scale.reshape(grid)
    return values, scales.reshape(fmt.scale_shape(x.shape))


def dequantize(values: jax.Array, scales: jax.Array, fmt: Fp8Blockwise) -> jax.Array:
    """``values * scales`` in float32 (each scale broadcast over its block; traceable).

    Values over Explicit mesh axes (sharding in types) are computed with those axes as
    Auto ones (`jax.sharding.auto_axes`), the result typed as the values are: the block
    reshapes below would otherwise need an output sharding of their own (a review found
    `QuantizedArray.dequantize` failing on a sampler mesh of Explicit axes)."""
    if _explicit(values):
        body = functools.partial(_dequantize, fmt=fmt)
        typed = jax.typeof(values).sharding
        return jax.sharding.auto_axes(body, out_sharding=typed)(values, scales)
    return _dequantize(values, scales, fmt)


def _explicit(x: Any) -> bool:
    """Whether ``x``'s type carries a sharding over Explicit mesh axes."""
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return explicit is not None and explicit in getattr(mesh, "axis_types", ())


def _dequantize(values: jax.Array, scales: jax.Array, fmt: Fp8Blockwise) -> jax.Array:
    shape = values.shape
    blocks = fmt.blocks(shape)
    grid = fmt.scale_shape(shape) if fmt.block is not None else (1,) * len(shape)
    split = tuple(d for pair in zip(grid, blocks, strict=True) for d in pair)
    expanded = jnp.reshape(scales, tuple(d for g in grid for d in (g, 1)))
    return (values.astype(jnp.float32).reshape(split) * expanded).reshape(shape)


def check_leaf(shape: Sequence[int], fmt: Fp8Blockwise, dst: Sharding) -> str | None:
    """Why ``fmt`` cannot apply to a leaf of ``shape`` with destination ``dst`` (None: it can)."""
    if fmt.block is None:
        return None
    if len(shape) < len(fmt.block):
        return f"has rank {len(shape)}, fewer dimensions than the block {fmt.block}"
    blocks = fmt.blocks(shape)
    bad = [d for d, (n, b) in enumerate(zip(shape, blocks, strict=True)) if n % b]
    if bad:
        return (
            f"dimension(s) {bad} of shape {tuple(shape)} are not multiples of the block {fmt.block}"
        )
    for spans in _spans(dst, shape).values():
        for d, ((start, stop), b) in enumerate(zip(spans, blocks, strict=True)):
            if start % b or stop % b:
                return (
                    f"the destination shards cut blocks: dimension {d} is split at {start}:{stop}, "
                    f"not a multiple of the block size {b}"
                )
    return None


def crosses_processes(shape: Sequence[int], fmt: Fp8Blockwise, src: Sharding) -> bool:
    """Whether quantizing a leaf of ``shape`` held in ``src`` combines values of source shards
    held by different processes: a per-tensor scale over a split source, or a block that
    straddles source shards, where the source spans several processes. Its quantizer then
    runs a collective across processes, which a call issues before the calls' order check
    (`Plan` refuses such leaves under ``jax.distributed``: a probe hung)."""
    if len({d.process_index for d in src.device_set}) < 2:
        return False
    spans = _spans(src, shape)
    if fmt.block is None:
        return len({tuple(v) for v in spans.values()}) > 1
    blocks = fmt.blocks(shape)
    return any(
        start % b or stop % b
        for device_spans in spans.values()
        for (start, stop), b in zip(device_spans, blocks, strict=True)
    )


def _spans(sharding: Sharding, shape: Sequence[int]) -> dict[Any, list[tuple[int, int]]]:
    """Each device's ``(start, stop)`` along every dimension of an array of ``shape``."""
    return {
        device: [sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True)]
        for device, index in sharding.devices_indices_map(tuple(shape)).items()
    }


def scale_sharding(sharding: Sharding, shape: Sequence[int], fmt: Fp8Blockwise) -> Sharding:
    """The scales' sharding: the values' own over the grid of blocks when it divides it (each
    device then holds the scales of its values), else replicated on the same devices."""
    grid = fmt.scale_shape(shape)
    if isinstance(sharding, NamedSharding):
        if fmt.block is not None and _fits(sharding, shape, grid, fmt):
            return sharding
        return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    raise ReshardError(
        f"an Fp8Blockwise leaf needs a NamedSharding, got {type(sharding).__name__}\nHow to "
        "fix: give the leaf's destination as a jax.sharding.NamedSharding (one device: "
        "NamedSharding(Mesh(np.array([device]), ('x',)), PartitionSpec()))"
    )


def _fits(s: NamedSharding, shape: Sequence[int], grid: Sequence[int], fmt: Fp8Blockwise) -> bool:
    """Whether ``s`` over ``grid`` gives every device the blocks of its values' shard."""
    try:
        values, scales = _spans(s, shape), _spans(s, grid)
    except ValueError:
        return False
    blocks = fmt.blocks(shape)
    return all(
        start % b == 0 and stop % b == 0 and (start // b, stop // b) == scale_span
        for device, spans in values.items()
        for (start, stop), b, scale_span in zip(spans, blocks, scales[device], strict=True)
    )


class Quantizer:
    """The senders' quantize programs of a plan's fp8 leaves: one compiled program for the
    leaves whose sources share an order of devices (a jitted program's arrays must)."""

    def __init__(
        self,
        formats: Sequence[Fp8Blockwise],
        src_shardings: Sequence[Sharding],
        scale_shardings: Sequence[Sharding],
    ) -> None:
        self.formats = tuple(formats)
        self.src_shardings = tuple(src_shardings)  # values stay in the source layout
        self.scale_shardings = tuple(scale_shardings)
        self._platforms = {d.platform for s in self.src_shardings for d in s.device_set}
        self._groups = [
            (tuple(ks), self._program(ks)) for ks in views.by_device_order(self.src_shardings)
        ]

    def _program(self, leaves: Sequence[int]) -> Callable[..., Any]:
        """The jitted quantize program of ``leaves`` (indices), sources in, (values, scales)
        out."""
        shardings = [self.src_shardings[k] for k in leaves]
        formats = [self.formats[k] for k in leaves]
        # Sources in host memory (pinned_host) are quantized in device memory: XLA does not
        # compute on host-memory operands (its select_n refuses mixed memory spaces).
        on_device = [on_device_memory(s) for s in shardings]

        def run(*xs: jax.Array) -> tuple[tuple[jax.Array, jax.Array], ...]:
            xs = tuple(
                x if d is s else jax.device_put(x, d)
                for x, s, d in zip(xs, shardings, on_device, strict=True)
            )
            return tuple(quantize(x, f) for x, f in zip(xs, formats, strict=True))

        out = tuple((self.src_shardings[k], self.scale_shardings[k]) for k in leaves)
        return jax.jit(run, out_shardings=out)

    def __call__(
        self, xs: Sequence[Any], paths: Sequence[str] | None = None
    ) -> list[tuple[Any, Any]]:
        """Each leaf's (values, scales). Under ``jax.distributed`` a leaf this process holds
        none of may be a ``jax.ShapeDtypeStruct``; a process that holds none of a program's
        leaves runs nothing of it (the program is not its to run) and gets placeholders of
        their results.

        Raises `ReshardError` naming the leaves (``paths``) deleted while the programs waited
        for the plans' calls in flight (`runtime.between_calls`): one donated meanwhile,
        through another array over the same buffers, would be read after it was freed."""
        if not xs:
            return []
        out: list[Any] = [None] * len(xs)
        mine = []
        for leaves, fn in self._groups:
            if any(self.src_shardings[k].addressable_devices for k in leaves):
                mine.append((leaves, fn))
                continue
            for k in leaves:
                x, f = xs[k], self.formats[k]
                out[k] = (
                    jax.ShapeDtypeStruct(x.shape, f.fmt, sharding=self.src_shardings[k]),
                    jax.ShapeDtypeStruct(
                        f.scale_shape(x.shape), jnp.float32, sharding=self.scale_shardings[k]
                    ),
                )
        if not mine:
            return out
        # Placeholders as arrays with no shard here (the callback is never called).
        arrays = [
            jax.make_array_from_callback(x.shape, x.sharding, lambda _: None, dtype=x.dtype)
            if isinstance(x, jax.ShapeDtypeStruct)
            else _as_planned(x, s)
            for x, s in zip(xs, self.src_shardings, strict=True)
        ]
        names = list(paths) if paths is not None else [f"[{k}]" for k in range(len(xs))]

        def dispatch() -> list[tuple[tuple[int, ...], Any]]:
            gone = [k for k, x in enumerate(xs) if isinstance(x, jax.Array) and x.is_deleted()]
            if gone:
                raise deleted_sources_error("the fp8 quantizer", [names[k] for k in gone])
            return [(leaves, fn(*(arrays[k] for k in leaves))) for leaves, fn in mine]

        for leaves, results in runtime.between_calls(self._platforms, dispatch):
            for k, r in zip(leaves, results, strict=True):
                out[k] = r
        return out


def _as_planned(x: jax.Array, sharding: Sharding) -> jax.Array:
    """``x`` in exactly the planned ``sharding`` object, zero-copy: an equivalent sharding
    spelled otherwise (another mesh's axis names, ``P("a", None)`` for ``P("a")``) would make
    ``jax.jit`` compile the quantizer again."""
    if x.sharding is sharding or x.sharding == sharding:
        return x
    return views.View(x.shape, x.dtype, sharding, x.weak_type).of(x)


def refuse(problems: list[tuple[str, str]]) -> ReshardError:
    """The error for leaves an `Fp8Blockwise` cannot apply to."""
    return leaf_error(
        "these leaves cannot take their Fp8Blockwise format",
        problems,
        "give those leaves a plain dtype (jnp.bfloat16, None), another block size, or a "
        "destination whose shards hold whole blocks",
    )
