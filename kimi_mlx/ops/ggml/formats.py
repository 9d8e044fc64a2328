"""GGML block formats kept as the file's bytes: sizes and the lookup tables each type needs.

A tensor of ``rows x cols`` weights in format ``name`` is stored as ``rows`` rows of
``row_bytes(name, cols) = cols / block_elems * type_bytes`` bytes (exactly the GGUF tensor's bytes); each row
is ``cols / block_elems`` consecutive blocks. Block layouts (byte offsets; fp16/u16/u32 little-endian):

========  =====  ==============================================================================================
type      bytes  fields
========  =====  ==============================================================================================
Q2_K      84     scales[16] @0 (low nibble scale, high nibble min) · qs[64] @16 · d f16 @80 · dmin f16 @82
Q3_K      110    hmask[32] @0 · qs[64] @32 · scales[12] @96 (16 x 6 bits) · d f16 @108
Q6_K      210    ql[128] @0 · qh[64] @128 · scales i8[16] @192 · d f16 @208
IQ4_NL    18     d f16 @0 · qs[16] @2 (nibbles -> ``values``)
IQ4_XS    136    d f16 @0 · scales_h u16 @2 · scales_l[4] @4 · qs[128] @8
IQ2_XXS   66     d f16 @0 · 8 x (grid idx u8[4], u32: 4 x 7-bit sign idx, 4-bit scale) @2
IQ2_XS    74     d f16 @0 · qs u16[32] @2 (9-bit grid idx, 7-bit sign idx) · scales[8] @66
IQ2_S     82     d f16 @0 · qs[32] @2 · signs[32] @34 · qh[8] @66 (2 high idx bits each) · scales[8] @74
IQ3_XXS   98     d f16 @0 · qs[64] @2 (grid idx) · u32[8] @66 (4 x 7-bit sign idx, 4-bit scale)
IQ3_S     110    d f16 @0 · qs[64] @2 · qh[8] @66 (9th idx bit) · signs[32] @74 · scales[4] @106
IQ1_S     50     d f16 @0 · qs[32] @2 · qh u16[8] @34 (3 x 4 high idx bits, 3-bit scale, delta sign)
IQ1_M     56     qs[32] @0 · qh[16] @32 (2 x (3 high idx bits, delta sign)) · scales u16[4] @48 (3-bit scales;
                 the fp16 ``d`` is the four top nibbles, lowest word first)
========  =====  ==============================================================================================

:func:`tables` returns, per type (numpy arrays, read-only, built once from the format description that gguf-py
publishes; :func:`mx_tables` gives the same as ``mx.array``):

* ``"grid"``: the lattice codebook, one row per index.
  IQ2_XXS uint8 [256, 8], IQ2_XS uint8 [512, 8], IQ2_S uint8 [1024, 8] (values 8, 25, 43);
  IQ3_XXS uint8 [256, 4] (4, 12, ..., 52, 62); IQ3_S uint8 [512, 4] (1, 3, ..., 15);
  IQ1_S, IQ1_M int8 [2048, 8] (-1, 0, 1; the weight is ``dl * (grid + delta)``, ``delta = ±IQ1_DELTA``).
* ``"signs"``: uint8 [128], IQ2_XXS, IQ2_XS, IQ3_XXS: a 7-bit sign index -> 8 sign bits (bit j set: lane j
  negative); bit 7 is the parity of the other seven, so every entry has an even number of minus signs.
* ``"values"``: int8 [16], IQ4_NL and IQ4_XS: the non-linear 4-bit levels.
* Q6_K, Q3_K, Q2_K need no table (empty dict).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import gguf
import mlx.core as mx
import numpy as np
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES

__all__ = ["BlockFormat", "FORMATS", "IQ1_DELTA", "get_format", "mx_tables", "row_bytes", "tables"]

#: IQ1_S / IQ1_M shift every grid value by +-IQ1_DELTA (sign from the block's delta bit).
IQ1_DELTA = 0.125


@dataclass(frozen=True)
class BlockFormat:
    """A GGML block type: ``block_elems`` weights stored in ``type_bytes`` bytes."""

    name: str
    qtype: gguf.GGMLQuantizationType
    block_elems: int
    type_bytes: int


def _format(name: str) -> BlockFormat:
    qtype = gguf.GGMLQuantizationType[name]
    return BlockFormat(name, qtype, *GGML_QUANT_SIZES[qtype])


FORMATS: dict[str, BlockFormat] = {
    n: _format(n)
    for n in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
              "Q6_K", "Q3_K", "Q2_K")
}


def get_format(name: str) -> BlockFormat:
    """The :class:`BlockFormat` of ``name``; ValueError for a type this package does not compute."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown GGML block type {name!r}; supported: {', '.join(FORMATS)}") from None


def row_bytes(name: str, cols: int) -> int:
    """Bytes of one row of ``cols`` weights; ValueError unless ``cols`` is a multiple of the block size."""
    f = get_format(name)
    if cols <= 0 or cols % f.block_elems:
        raise ValueError(f"{name}: cols must be a positive multiple of {f.block_elems}, got {cols}")
    return cols // f.block_elems * f.type_bytes


# gguf-py class holding each grid type's published description (grid_map, grid_hex, grid_shape)
_GRID_SOURCE = {
    "IQ2_XXS": gq.IQ2_XXS, "IQ2_XS": gq.IQ2_XS, "IQ2_S": gq.IQ2_S, "IQ3_XXS": gq.IQ3_XXS,
    "IQ3_S": gq.IQ3_S, "IQ1_S": gq.IQ1_S, "IQ1_M": gq.IQ1_M,
}
_SIGNED = ("IQ2_XXS", "IQ2_XS", "IQ3_XXS")


def _expand_grid(levels: tuple, packed_hex: bytes, shape: tuple[int, int]) -> np.ndarray:
    """Grid [entries, lanes]: ``packed_hex`` is hex text of bytes each holding ``8 // bits`` level codes
    (``bits = ceil(log2(len(levels)))``, first code in the lowest bits); code c stands for ``levels[c]``."""
    packed = np.frombuffer(bytes.fromhex(packed_hex.decode("ascii")), np.uint8)
    bits = math.ceil(math.log2(len(levels)))
    per_byte = 8 // bits
    stride = 8 // per_byte  # 2-bit codes at shifts 0,2,4,6; 3-bit codes at 0,4 (one per nibble)
    codes = (packed[:, None] >> (stride * np.arange(per_byte, dtype=np.uint8))) & ((1 << bits) - 1)
    dtype = np.int8 if min(levels) < 0 else np.uint8
    return np.asarray(levels, dtype)[codes].reshape(shape)


def _sign_table() -> np.ndarray:
    """[128] uint8: index i (7 sign bits) plus bit 7 = parity of popcount(i)."""
    i = np.arange(128, dtype=np.uint8)
    parity = np.unpackbits(i[:, None], axis=1).sum(axis=1) & 1
    return (i | (parity.astype(np.uint8) << 7)).astype(np.uint8)


@functools.cache
def tables(name: str) -> dict[str, np.ndarray]:
    """Lookup tables of ``name`` (keys, dtypes and shapes in the module docstring); computed once, read-only."""
    get_format(name)
    out: dict[str, np.ndarray] = {}
    if name in _GRID_SOURCE:
        src = _GRID_SOURCE[name]
        out["grid"] = _expand_grid(src.grid_map, src.grid_hex, src.grid_shape)
    if name in _SIGNED:
        out["signs"] = _sign_table()
    if name in ("IQ4_NL", "IQ4_XS"):
        out["values"] = np.asarray(gq.IQ4_NL.kvalues, np.int8)
    for a in out.values():
        a.flags.writeable = False
    return out


@functools.cache
def mx_tables(name: str) -> dict[str, mx.array]:
    """:func:`tables` as ``mx.array`` (same keys, dtypes and shapes), computed once."""
    return {k: mx.array(v) for k, v in tables(name).items()}
