"""One part of an MLA latent cache as stored: a float array, or a ``QuantizedLatent`` that carries its own layout.

A part is ``[B, 1, S, w]``: B rows, S positions (axis 2), width w (``kv_lora_rank`` for ``kv_latent``,
``qk_rope_head_dim`` for ``k_pe``). A ``QuantizedLatent`` is that part as ``mx.quantize`` lays it out along w (affine:
codes uint32 ``[B, 1, S, w * bits / 32]``, scales and biases ``[B, 1, S, w / group_size]`` in the model dtype), with
its ``bits`` and ``group_size``. Float parts stay plain ``mx.array``s.

The functions below take either kind, so the cache and the attention paths never ask which a part is (only the
dispatcher does, ``is_quantized``: the fused and Metal paths take float keys). Array-wise operations (slicing
positions or rows, copying, writing, concatenating, waiting on other arrays) go through ``arrays`` / ``with_arrays``
(a quantized part's three arrays share their leading axes, so one function applies to all three); the arithmetic
(``matmul``, ``addmm``, ``dequantize``, ``float_dtype``) reads a quantized part as stored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import mlx.core as mx


@dataclass(frozen=True, eq=False)
class QuantizedLatent:
    """``mx.quantize(x, group_size, bits)`` of a latent part x ``[B, 1, S, w]`` (see the module docstring)."""

    codes: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int


Latent = Union[mx.array, QuantizedLatent]


def quantize(x: mx.array, bits: int, group_size: int) -> Latent:
    """``x [.., w]`` as a cache quantized with ``bits`` / ``group_size`` stores it: quantized along w, or ``x`` itself
    when ``group_size`` does not divide w."""
    if x.shape[-1] % group_size:
        return x
    return QuantizedLatent(*mx.quantize(x, group_size=group_size, bits=bits), bits, group_size)


def is_quantized(part: Latent) -> bool:
    return isinstance(part, QuantizedLatent)


def arrays(part: Latent) -> tuple[mx.array, ...]:
    """The arrays that hold ``part``: (codes, scales, biases) of a quantized part, (part,) of a float one."""
    if isinstance(part, QuantizedLatent):
        return part.codes, part.scales, part.biases
    return (part,)


def with_arrays(like: Latent, new: Sequence[mx.array]) -> Latent:
    """A part of ``like``'s kind (and bits / group size) held by ``new`` (in the order of ``arrays``)."""
    if isinstance(like, QuantizedLatent):
        return QuantizedLatent(*new, like.bits, like.group_size)
    (x,) = new
    return x


def map_arrays(part: Latent, fn: Callable[[mx.array], mx.array]) -> Latent:
    """``fn`` applied to each array of ``part`` (e.g. a slice of positions or rows, a copy, zeros of another size)."""
    return with_arrays(part, [fn(a) for a in arrays(part)])


def width(part: Latent) -> int:
    """Number of positions (axis 2)."""
    return arrays(part)[0].shape[2]


def features(part: Latent) -> int:
    """The width w of a position (axis 3; a quantized part's as dequantized)."""
    if isinstance(part, QuantizedLatent):
        return part.scales.shape[-1] * part.group_size
    return part.shape[-1]


def rows(part: Latent) -> int:
    """Number of rows (axis 0)."""
    return arrays(part)[0].shape[0]


def positions(part: Latent, s0: int, s1: int) -> Latent:
    """Positions [s0, s1) (a view; the part itself when that is all of it: one op less per page)."""
    if (s0, s1) == (0, width(part)):
        return part
    return map_arrays(part, lambda a: a[:, :, s0:s1])


def concatenate(parts: Sequence[Latent], axis: int) -> Latent:
    """Parts of one kind concatenated along ``axis`` (2: positions, 0: rows); one part: itself."""
    if len(parts) == 1:
        return parts[0]
    return with_arrays(parts[0], [mx.concatenate(list(a), axis=axis) for a in zip(*map(arrays, parts))])


def write(part: Latent, new: Latent, at: int) -> Latent:
    """``part`` with ``new`` (same kind, rows and width) written from position ``at``, as a new part (MLX writes the
    buffer in place when ``part`` has no other holder, and copies it otherwise)."""
    start = mx.array([at])
    return with_arrays(part, [mx.slice_update(x, y, start, (2,)) for x, y in zip(arrays(part), arrays(new))])


def matmul(x: mx.array, part: Latent, transpose: bool = True) -> mx.array:
    """``x @ part^T`` (``transpose``: [.., n, w] x [.., S, w] -> [.., n, S]) or ``x @ part`` ([.., n, S] ->
    [.., n, w]); a quantized part is read as stored (``mx.quantized_matmul``)."""
    if isinstance(part, QuantizedLatent):
        return mx.quantized_matmul(x, part.codes, part.scales, part.biases, transpose=transpose,
                                   group_size=part.group_size, bits=part.bits)
    return x @ (part.swapaxes(-1, -2) if transpose else part)


def addmm(acc: mx.array, x: mx.array, part: Latent) -> mx.array:
    """``acc + x @ part^T`` (one fused multiply-add for a float part)."""
    if isinstance(part, QuantizedLatent):
        return acc + matmul(x, part)
    return mx.addmm(acc, x, part.swapaxes(-1, -2))


def dequantize(part: Latent) -> mx.array:
    """The part as a float array (a float part as it is)."""
    if isinstance(part, QuantizedLatent):
        return mx.dequantize(part.codes, part.scales, part.biases, group_size=part.group_size, bits=part.bits)
    return part


def float_dtype(part: Latent) -> Optional[mx.Dtype]:
    """A float part's dtype; None for a quantized one (a product with it takes the other operand's dtype)."""
    return None if isinstance(part, QuantizedLatent) else part.dtype
