"""Exact dequantization of GGML blocks in MLX (lazy, any device).

``dequantize(blocks, name)`` is bitwise equal to ``gguf.quants.dequantize``: every weight is computed from the
fp16 scale (converted to float32) by the same float32 operations, in the same order, as gguf-py's
``dequantize_blocks``; everything before that (bit fields, table lookups, integer scales) is exact. The order is
in fact free: the fp16 scale has an 11-bit significand and the other factors of a weight (sub-scale, grid value,
level, code, ``0.5 + s``, ``1 ± 1/8``) add at most 12 significant bits, so every product is exact in float32;
only Q2_K's ``d*sc*q - dmin*m`` can round, once. Any order, and fused multiply-adds, give the same bits.
Each ``_<type>`` below maps blocks ``[..., type_bytes]`` uint8 to weights ``[..., block_elems]`` float32;
block layouts are in :mod:`.formats`.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from .formats import IQ1_DELTA, get_format, tables

__all__ = ["dequantize"]

F32 = mx.float32


def dequantize(blocks: mx.array, name: str) -> mx.array:
    """blocks: [..., rows, row_bytes] uint8 (the GGUF tensor's bytes) -> [..., rows, cols] float32,
    ``cols = row_bytes / type_bytes * block_elems``."""
    f = get_format(name)
    if blocks.dtype != mx.uint8:
        raise ValueError(f"{name}: blocks must be uint8, got {blocks.dtype}")
    if blocks.ndim < 1 or blocks.shape[-1] == 0 or blocks.shape[-1] % f.type_bytes:
        raise ValueError(
            f"{name}: blocks' last axis (row_bytes) must be a positive multiple of {f.type_bytes}, "
            f"got shape {tuple(blocks.shape)}"
        )
    lead, nb = blocks.shape[:-1], blocks.shape[-1] // f.type_bytes
    w = _compiled(name)(blocks.reshape(*lead, nb, f.type_bytes))
    return w.reshape(*lead, nb * f.block_elems)


@functools.cache
def _compiled(name: str):
    """``_DEQUANT[name]`` under ``mx.compile``: its elementwise steps fused, with the same bits, since no product
    rounds."""
    return mx.compile(_DEQUANT[name])


# ---------------------------------------------------------------------------------------------------------------
# shared pieces


@functools.cache
def _table(name: str, key: str) -> mx.array:
    """A lookup table of ``name`` as float32 (grid / values; exact small integers), or as stored (signs)."""
    t = tables(name)[key]
    return mx.array(t if key == "signs" else t.astype(np.float32))


def _f16(b: mx.array) -> mx.array:
    """[..., 2] uint8 (little-endian fp16) -> [..., 1] float32."""
    return b.view(mx.float16).astype(F32)


def _fields(x: mx.array, width: int, count: int, *, interleave: bool = False) -> mx.array:
    """Unsigned x [..., n] -> bit fields ``(x >> width*i) & (2**width - 1)``, i < count:
    [..., count, n] (field-major), or [..., n, count] with ``interleave``."""
    shifts = mx.arange(0, width * count, width).astype(x.dtype)
    mask = (1 << width) - 1
    if interleave:
        return (x[..., None] >> shifts) & mask
    return (x[..., None, :] >> shifts[:, None]) & mask


def _six_bit(lo: mx.array, hi: mx.array) -> mx.array:
    """6-bit K-scales from their low 4 and high 2 bits, minus 32 -> float32 (Q3_K, IQ4_XS)."""
    return ((lo | (hi.astype(lo.dtype) << 4)).astype(mx.int32) - 32).astype(F32)


def _iq_scale(d: mx.array, s: mx.array, mult: float) -> mx.array:
    """IQ2/IQ3_XXS sub-block scale ``d * (0.5 + s) * mult`` (gguf-py's order)."""
    return d * (0.5 + s.astype(F32)) * mult


def _grid(name: str, idx: mx.array) -> mx.array:
    """Grid rows for indices [...] -> [..., lanes] float32."""
    return mx.take(_table(name, "grid"), idx, axis=0)


def _ksign_bytes(idx: mx.array) -> mx.array:
    """7-bit sign indices [...] -> their 8 sign bits as uint8 (bit j: lane j negative), by the parity sign table."""
    return mx.take(_table("IQ2_XXS", "signs"), idx, axis=0)


@functools.cache
def _signed_grid(name: str) -> mx.array:
    """[entries * 2**lanes, lanes] float32: grid row e with lane j negated where bit j of p is set, at row
    ``e * 2**lanes + p``. One lookup then gives the signed row (instead of a grid lookup and a sign-bit lookup); a
    negation is exact, so ``d * row`` equals gguf-py's ``(d * grid) * sign`` bit for bit.
    Sizes: 2 MiB (IQ2_XXS), 4 MiB (IQ2_XS), 8 MiB (IQ2_S), 64 KiB (IQ3_XXS), 128 KiB (IQ3_S)."""
    grid = tables(name)["grid"].astype(np.float32)
    n, lanes = grid.shape
    negative = ((np.arange(1 << lanes)[:, None] >> np.arange(lanes)) & 1).astype(bool)  # [patterns, lanes]
    return mx.array(np.where(negative[None], -grid[:, None], grid[:, None]).reshape(n << lanes, lanes))


def _signed_rows(name: str, idx: mx.array, signs: mx.array) -> mx.array:
    """Grid rows of ``idx`` [...] with lane j negated where bit j of ``signs`` [...] is set -> [..., lanes] float32."""
    lanes = tables(name)["grid"].shape[1]
    return mx.take(_signed_grid(name), (idx.astype(mx.uint32) << lanes) | signs.astype(mx.uint32), axis=0)


def _nibbles(x: mx.array) -> mx.array:
    """Bytes [..., n] -> [..., 2n]: low then high nibble of each (the 4-lane halves of an 8-bit sign pattern)."""
    return _fields(x, 4, 2, interleave=True).reshape(*x.shape[:-1], 2 * x.shape[-1])


# ---------------------------------------------------------------------------------------------------------------
# K-quants


def _q2_k(b):
    lead = b.shape[:-1]
    sc, d, dmin = b[..., 0:16], _f16(b[..., 80:82]), _f16(b[..., 82:84])
    dl = (d * (sc & 0xF).astype(F32))[..., None]
    ml = (dmin * (sc >> 4).astype(F32))[..., None]
    q = _fields(b[..., 16:80].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 16, 16).astype(F32)
    return (dl * q - ml).reshape(*lead, 256)


def _q3_k(b):
    lead = b.shape[:-1]
    lo = _fields(b[..., 96:104], 4, 2).reshape(*lead, 16)
    hi = _fields(b[..., 104:108], 2, 4).reshape(*lead, 16)
    dl = (_f16(b[..., 108:110]) * _six_bit(lo, hi))[..., None]
    ql = _fields(b[..., 32:96].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 16, 16)
    qh = _fields(b[..., 0:32], 1, 8).reshape(*lead, 16, 16)  # a clear high bit subtracts 4
    q = (ql.astype(mx.int32) - 4 * (1 - qh.astype(mx.int32))).astype(F32)
    return (dl * q).reshape(*lead, 256)


def _q6_k(b):
    lead = b.shape[:-1]
    d = (_f16(b[..., 208:210]) * b[..., 192:208].view(mx.int8).astype(F32))[..., None]
    ql = _fields(b[..., 0:128].reshape(*lead, 2, 64), 4, 2).reshape(*lead, 8, 32)
    qh = _fields(b[..., 128:192].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 8, 32)
    q = ((ql | (qh << 4)).astype(mx.int32) - 32).astype(F32).reshape(*lead, 16, 16)
    return (d * q).reshape(*lead, 256)


# ---------------------------------------------------------------------------------------------------------------
# non-linear 4-bit


def _iq4_nl(b):
    lead = b.shape[:-1]
    q = _fields(b[..., 2:18], 4, 2).reshape(*lead, 32)
    return _f16(b[..., 0:2]) * mx.take(_table("IQ4_NL", "values"), q, axis=0)


def _iq4_xs(b):
    lead = b.shape[:-1]
    lo = _fields(b[..., 4:8], 4, 2, interleave=True).reshape(*lead, 8)
    hi = _fields(b[..., 2:4].view(mx.uint16), 2, 8).reshape(*lead, 8)
    dl = (_f16(b[..., 0:2]) * _six_bit(lo, hi))[..., None]
    q = _fields(b[..., 8:136].reshape(*lead, 8, 16), 4, 2).reshape(*lead, 8, 32)
    return (dl * mx.take(_table("IQ4_XS", "values"), q, axis=0)).reshape(*lead, 256)


# ---------------------------------------------------------------------------------------------------------------
# lattice (grid) types: w = db * grid, negated where the sign bit is set


def _iq2_xxs(b):
    lead = b.shape[:-1]
    g = b[..., 2:66].reshape(*lead, 8, 8)  # per 32 weights: 4 grid indices, then a u32 of signs + scale
    aux = g[..., 4:8].view(mx.uint32)[..., 0]
    db = _iq_scale(_f16(b[..., 0:2]), aux >> 28, 0.25)[..., None, None]
    signs = _ksign_bytes(_fields(aux, 7, 4, interleave=True))  # [..., 8, 4]
    return (db * _signed_rows("IQ2_XXS", g[..., 0:4], signs)).reshape(*lead, 256)


def _iq2_xs(b):
    lead = b.shape[:-1]
    qs = b[..., 2:66].view(mx.uint16)
    s = _fields(b[..., 66:74], 4, 2, interleave=True).reshape(*lead, 16)
    db = _iq_scale(_f16(b[..., 0:2]), s, 0.25)[..., None, None]
    w = _signed_rows("IQ2_XS", qs & 511, _ksign_bytes(qs >> 9)).reshape(*lead, 16, 2, 8)
    return (db * w).reshape(*lead, 256)


def _iq2_s(b):
    lead = b.shape[:-1]
    s = _fields(b[..., 74:82], 4, 2, interleave=True).reshape(*lead, 16)
    db = _iq_scale(_f16(b[..., 0:2]), s, 0.25)[..., None, None]
    qh = _fields(b[..., 66:74], 2, 4, interleave=True).reshape(*lead, 32)
    idx = b[..., 2:34].astype(mx.uint16) | (qh.astype(mx.uint16) << 8)
    w = _signed_rows("IQ2_S", idx, b[..., 34:66]).reshape(*lead, 16, 2, 8)
    return (db * w).reshape(*lead, 256)


def _iq3_xxs(b):
    lead = b.shape[:-1]
    aux = b[..., 66:98].view(mx.uint32)
    db = _iq_scale(_f16(b[..., 0:2]), aux >> 28, 0.5)[..., None, None]
    signs = _nibbles(_ksign_bytes(_fields(aux, 7, 4, interleave=True))).reshape(*lead, 64)
    w = _signed_rows("IQ3_XXS", b[..., 2:66], signs).reshape(*lead, 8, 4, 8)
    return (db * w).reshape(*lead, 256)


def _iq3_s(b):
    lead = b.shape[:-1]
    s = _fields(b[..., 106:110], 4, 2, interleave=True).reshape(*lead, 8)
    db = (_f16(b[..., 0:2]) * (1 + 2 * s).astype(F32))[..., None, None]
    qh = _fields(b[..., 66:74], 1, 8, interleave=True).reshape(*lead, 64)
    idx = b[..., 2:66].astype(mx.uint16) | (qh.astype(mx.uint16) << 8)
    w = _signed_rows("IQ3_S", idx, _nibbles(b[..., 74:106])).reshape(*lead, 8, 4, 8)
    return (db * w).reshape(*lead, 256)


# ---------------------------------------------------------------------------------------------------------------
# 1-bit lattice: w = dl * (grid + delta)


def _iq1(name: str, dl: mx.array, idx: mx.array, delta_neg: mx.array) -> mx.array:
    """``dl * (grid[idx] + delta)``: idx [...] grid indices, delta_neg (1: -IQ1_DELTA) and dl broadcastable to
    idx's shape + a lane axis -> [..., 8] float32."""
    delta = mx.where(delta_neg.astype(mx.bool_), -IQ1_DELTA, IQ1_DELTA).astype(F32)[..., None]
    return dl * (_grid(name, idx) + delta)


def _iq1_s(b):
    lead = b.shape[:-1]
    qh = b[..., 34:50].view(mx.uint16)  # per 32 weights: 4 x 3 high index bits, a 3-bit scale, the delta sign
    dl = (_f16(b[..., 0:2]) * (2 * ((qh >> 12) & 7) + 1).astype(F32))[..., None, None]
    idx = b[..., 2:34].reshape(*lead, 8, 4).astype(mx.uint16) | (_fields(qh, 3, 4, interleave=True) << 8)
    return _iq1("IQ1_S", dl, idx, (qh >> 15)[..., None]).reshape(*lead, 256)


def _iq1_m(b):
    lead = b.shape[:-1]
    sc = b[..., 48:56].view(mx.uint16)
    top = sc >> 12  # the fp16 d, one nibble per word
    d_bits = top[..., 0:1] | (top[..., 1:2] << 4) | (top[..., 2:3] << 8) | (top[..., 3:4] << 12)
    s = _fields(sc, 3, 4, interleave=True).reshape(*lead, 8, 2)
    dl = (d_bits.view(mx.float16).astype(F32)[..., None] * (2 * s + 1).astype(F32))[..., None, None]
    qh = _fields(b[..., 32:48], 4, 2, interleave=True).reshape(*lead, 8, 2, 2)
    idx = b[..., 0:32].reshape(*lead, 8, 2, 2).astype(mx.uint16) | ((qh & 7).astype(mx.uint16) << 8)
    return _iq1("IQ1_M", dl, idx, qh >> 3).reshape(*lead, 256)


_DEQUANT = {
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
    "IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s, "IQ3_XXS": _iq3_xxs, "IQ3_S": _iq3_s,
    "IQ1_S": _iq1_s, "IQ1_M": _iq1_m,
}
