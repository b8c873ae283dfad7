"""Bits <-> staging words, and the casts between them, traced inside the runtime's programs.

Every byte is moved as unsigned integers of the element's width: XLA's CPU backend computes
some ops on 16-bit floats in float32 and would quieten NaN payloads, and bit-exactness is a
promise. A cast the caller asked for (``dtype=``) is the only floating-point operation, and it
runs on the senders, before the bytes travel.

Index arguments are always int32 (the table of box starts is int32, and literal zeros are made
int32 here), so the programs trace the same with ``jax_enable_x64`` on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ZERO = np.int32(0)


def wire_itemsize(dtype: Any) -> int:
    """Bytes one element of ``dtype`` takes in a staging buffer (sub-byte types take one)."""
    return max(1, jnp.dtype(dtype).itemsize)


def bits_dtype(dtype: Any) -> np.dtype:
    """The unsigned type that carries ``dtype``'s bits (complex: per real component)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return np.dtype(f"uint{dtype.itemsize * 4}")
    return np.dtype(f"uint{wire_itemsize(dtype) * 8}")


def bits_shape(shape: Sequence[int], dtype: Any) -> tuple[int, ...]:
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


def read_bits(
    shard: jax.Array,
    at: Sequence[Any],
    shape: Sequence[int],
    dtype: Any,
    platform: str | None = None,
) -> jax.Array:
    """The bits of the ``shape`` block of ``shard`` starting at ``at`` (int32 scalars, may be
    traced), cast to ``dtype`` first when the dtypes differ (on ``platform``: `_cast_bits`)."""
    at = tuple(at)
    if jnp.dtype(shard.dtype) != jnp.dtype(dtype):
        return _cast_bits(lax.dynamic_slice(shard, at, tuple(shape)), dtype, platform)
    bits = to_bits(shard)
    extra = bits.shape[len(shape) :]
    return lax.dynamic_slice(bits, (*at, *(ZERO,) * len(extra)), (*shape, *extra))


def whole_bits(shard: jax.Array, dtype: Any, platform: str | None = None) -> jax.Array:
    """The bits of all of ``shard``, cast to ``dtype`` first when the dtypes differ (on
    ``platform``: `_cast_bits`)."""
    if jnp.dtype(shard.dtype) != jnp.dtype(dtype):
        return _cast_bits(shard, dtype, platform)
    return to_bits(shard)


def _cast_bits(x: jax.Array, dtype: Any, platform: str | None) -> jax.Array:
    """The bits of ``x`` cast to ``dtype`` (`astype`'s bits).

    On the CPU backend an integer or boolean cast to bfloat16 is rounded here from its
    float32 value's bits, in integer arithmetic. Converted by XLA, a pack program that
    gathers such a cast beside other leaves' 16-bit words corrupted those words on XLA CPU
    (jax 0.10.2; subnormals flushed, NaNs quietened: uint16 words 1 and 2 came out 0; found
    by a fuzz of dtype trees): one fusion of ``gather(concatenate(bitcast(convert(s8 ->
    bf16)), u16 words))`` computes every word as bfloat16, through float32. The integer
    rounding gives the bits XLA's conversion gives, which also goes through float32 (tested
    on every int8, int16 and uint16 value and on random 32- and 64-bit ones). Elsewhere XLA
    converts (a GPU may round an integer to bfloat16 in one step, which this would not
    match).
    """
    dtype = jnp.dtype(dtype)
    source = jnp.dtype(x.dtype)
    if (
        platform == "cpu"
        and dtype == jnp.dtype(jnp.bfloat16)
        and (source == jnp.bool_ or jnp.issubdtype(source, jnp.integer))
    ):
        u = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)  # finite: no NaN
        lsb = (u >> np.uint32(16)) & np.uint32(1)
        return ((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(jnp.uint16)
    return to_bits(x.astype(dtype))


def write_bits(bits: jax.Array, part: jax.Array, at: Sequence[Any]) -> jax.Array:
    """``bits`` with ``part`` written from ``at`` (in place when ``bits`` is donated)."""
    return lax.dynamic_update_slice(bits, part, (*at, *(ZERO,) * (bits.ndim - len(at))))


def bits_to_words(bits: jax.Array, word: Any) -> jax.Array:
    """Unsigned-integer bits as a flat vector of ``word`` (no wider than the bits' type)."""
    word = np.dtype(word)
    if bits.dtype != word:
        bits = lax.bitcast_convert_type(bits, word)
    return bits.reshape(-1)


def words_to_bits(raw: jax.Array, dtype: Any, shape: Sequence[int]) -> jax.Array:
    """Inverse of `bits_to_words` for an array of ``dtype`` and ``shape``."""
    target = bits_dtype(dtype)
    full = bits_shape(shape, dtype)
    if target == raw.dtype:
        return raw.reshape(full)
    ratio = target.itemsize // raw.dtype.itemsize
    return lax.bitcast_convert_type(raw.reshape((*full, ratio)), target)


def words_of(shape: Sequence[int], dtype: Any, word: Any) -> int:
    """How many ``word``-sized words an array of ``shape`` and ``dtype`` takes."""
    n = int(np.prod(bits_shape(shape, dtype), dtype=np.int64))
    return n * bits_dtype(dtype).itemsize // np.dtype(word).itemsize
