"""GGUF (ggml) tensor payloads -> MLX arrays / MLX quantized layouts.

Entry point: :func:`to_mlx`.  Conventions:

* ``data`` is the tensor's raw bytes (a uint8 numpy array, e.g. the memory-mapped slice from
  ``GGUFReader``; any other dtype is re-viewed as bytes).
* ``shape`` is the logical shape in numpy/PyTorch order, i.e. the *reversed* GGML ``ne``
  (``ne = [cols, rows, experts]`` -> ``shape = (experts, rows, cols)``).  The last axis is the
  quantized (block) axis; leading axes are preserved in every returned array.
* Float types (F32/F16/BF16) are passed through as ``{"weight": mx.array}`` in their own dtype
  (BF16 via a uint16 view).
* Quantized types return an MLX quantized layout::

      {"weight": uint32 [..., cols*bits/32], "scales": [..., cols/group_size],
       "biases": [..., cols/group_size] (affine only), "bits": int, "group_size": int,
       "mode": "affine" | "mxfp4", "exact": bool, "max_abs_error": float}

  such that ``mx.dequantize(weight, scales, biases, group_size=, bits=, mode=)`` reproduces the
  GGUF tensor (``exact=True``: bit-for-bit equal, in float32, to ggml's / gguf-py's dequantization;
  ``exact=False``: within ``max_abs_error`` of it: measured over the whole tensor for requantized
  types, an upper bound for narrow scale dtypes).
  Affine means ``w = scales * q + biases`` with unsigned codes ``q`` packed little-endian
  (bit-stream) into uint32 words; mxfp4 scales are uint8 E8M0 (``127 == 2**0``), no biases.

Paths:

* exact (:data:`SUPPORTED_EXACT`): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (affine g32, 8/4/4/5/5 bits),
  Q4_K, Q5_K (affine g32 over the 32-wide sub-blocks, 4/5 bits; ``scale = d*sc``,
  ``bias = -dmin*m``), MXFP4 (MLX ``mxfp4``), TQ2_0 / TQ1_0 (ternary -> 2-bit affine g32).
  Exactness holds with ``scale_dtype=mx.float32``; with a narrower ``scale_dtype`` (float16 or
  bfloat16) the scales/biases are rounded *and* MLX then dequantizes in that dtype, so ``exact`` is
  False and ``max_abs_error`` is an upper bound computed per group from the rounded scales/biases and
  the dtype's ulp (``bench/bench_gguf_quant_error.py`` measures the actual error).  MXFP4 scales are always uint8 (``scale_dtype`` is ignored); E8M0 0xFF
  (NaN in MLX, 2**128 in ggml) makes it inexact with a warning.
  Note ``mx.dequantize`` with uint8 mxfp4 scales returns bfloat16 unless ``dtype=mx.float32``.
* GGML blocks (:data:`GGML_BLOCKS`): Q6_K, Q3_K, Q2_K (16-wide sub-blocks, which MLX's group sizes 32/64/128
  cannot express) and the IQ* codebook types have no MLX layout. The loader keeps them as the file's blocks
  (``kimi_mlx.layers.ggml``, computed exactly by ``kimi_mlx.ops.ggml``), so ``to_mlx`` refuses them unless
  ``requantize=True``: then they are dequantized exactly (``gguf.quants.dequantize``) and re-quantized (round-to-nearest
  min/max, error <= half a step) to affine g32 with :data:`REQUANT_BITS` bits, with a warning stating bytes and error.
  :func:`dequantize_exact` gives their exact float32 values (for tensors whose module stays float).
"""

from __future__ import annotations

import math
import warnings

import gguf
import mlx.core as mx
import numpy as np

T = gguf.GGMLQuantizationType

__all__ = [
    "GGML_BLOCKS",
    "REQUANT_BITS",
    "SUPPORTED_EXACT",
    "SUPPORTED_FLOAT",
    "GGUFQuantError",
    "dequantize_exact",
    "mlx_layout",
    "to_mlx",
]


class GGUFQuantError(ValueError):
    """A GGUF tensor cannot be converted (names the tensor, the type and what is supported)."""


SUPPORTED_FLOAT: tuple[T, ...] = (T.F32, T.F16, T.BF16)
SUPPORTED_EXACT: tuple[T, ...] = (
    T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.MXFP4, T.TQ2_0, T.TQ1_0,
)
GGML_BLOCKS: tuple[T, ...] = (
    T.Q6_K, T.Q3_K, T.Q2_K,
    T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_XS, T.IQ4_NL,
)

#: MLX affine bits (group size 32) used when a type has to be re-quantized.
REQUANT_BITS: dict[T, int] = {
    T.Q6_K: 6, T.Q3_K: 4, T.Q2_K: 3,
    T.IQ4_NL: 4, T.IQ4_XS: 4, T.IQ3_S: 4, T.IQ3_XXS: 4,
    T.IQ2_S: 3, T.IQ2_XS: 3, T.IQ2_XXS: 3, T.IQ1_M: 2, T.IQ1_S: 2,
}

GROUP = 32
# Work on this many elements at a time to bound temporaries on huge (stacked-expert) tensors.
_CHUNK_ELEMS = 1 << 22

_FLOAT_NP = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}


def _supported_list() -> str:
    return ", ".join(t.name for t in SUPPORTED_FLOAT + SUPPORTED_EXACT) + (
        "; kept as GGML blocks by the loader (or with requantize=True re-quantized): "
        + ", ".join(t.name for t in GGML_BLOCKS)
    )


# --------------------------------------------------------------------------------------------
# small helpers


def _f16(b: np.ndarray) -> np.ndarray:
    """[nb, 2] uint8 -> [nb, 1] float32 (little-endian fp16)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes [..., n] (n % 8 == 0) little-endian bit-stream -> uint8 [..., n*bits/8].

    This is MLX's affine packing for every bit width (element 0 in the lowest bits)."""
    lead, n = codes.shape[:-1], codes.shape[-1]
    c = codes.reshape(-1, n)
    if bits == 8:
        out = c.astype(np.uint8)
    elif bits == 4:
        c = c.astype(np.uint8).reshape(c.shape[0], n // 2, 2)
        out = c[..., 0] | (c[..., 1] << 4)
    elif bits == 2:
        c = c.astype(np.uint8).reshape(c.shape[0], n // 4, 4)
        out = c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)
    else:
        c = c.reshape(-1, 8).astype(np.uint64)
        v = np.zeros(c.shape[0], np.uint64)
        for k in range(8):
            v |= c[:, k] << np.uint64(bits * k)
        out = v.view(np.uint8).reshape(-1, 8)[:, :bits]
    return np.ascontiguousarray(out).reshape(*lead, n * bits // 8)


def _k_scale_min(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte packed 6-bit (scale, min) pairs -> two [nb, 8] uint8 arrays."""
    s = sc12.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _lohi(qs: np.ndarray) -> np.ndarray:
    """qs [nb, 16] -> codes [nb, 32]: element j = low nibble of qs[j], j+16 = high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits_of(b: np.ndarray, nbits: int) -> np.ndarray:
    """uint8 [nb, k] -> [nb, k*8] bits, little-endian within each byte."""
    return np.unpackbits(b, axis=-1, bitorder="little")[:, :nbits]


# --------------------------------------------------------------------------------------------
# exact decoders: blocks [nb, type_size] uint8 -> (codes [nb, block] uint8, scales [nb, block/32]
# float32 (uint8 E8M0 for mxfp4), biases [nb, block/32] float32 or None)


def _q8_0(b):
    d = _f16(b[:, 0:2])
    codes = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128.0 * d


def _q4_0(b):
    d = _f16(b[:, 0:2])
    return _lohi(b[:, 2:18]), d, -8.0 * d


def _q4_1(b):
    return _lohi(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q5_hi(b4: np.ndarray) -> np.ndarray:
    return _bits_of(np.ascontiguousarray(b4), 32) << 4


def _q5_0(b):
    d = _f16(b[:, 0:2])
    return _lohi(b[:, 6:22]) | _q5_hi(b[:, 2:6]), d, -16.0 * d


def _q5_1(b):
    return _lohi(b[:, 8:24]) | _q5_hi(b[:, 4:8]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _k_affine(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """qs [nb, 128] -> [nb, 256]: chunk i of 32 bytes gives elements 64i..+31 (low), 64i+32..+63 (high)."""
    q = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=2).reshape(-1, 256)


def _q4_k(b):
    s, bias = _k_affine(b)
    return _k_low_nibbles(b[:, 16:144]), s, bias


def _q5_k(b):
    s, bias = _k_affine(b)
    qh = b[:, 16:48]  # bit s of qh[j] = 5th bit of element 32*s + j
    hi = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(-1, 256)
    return _k_low_nibbles(b[:, 48:176]) | (hi << 4), s, bias


def _mxfp4(b):
    return _lohi(b[:, 1:17]), b[:, 0:1].copy(), None


def _tq2_codes(qs: np.ndarray) -> np.ndarray:
    q = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (q & 3).reshape(-1, 256)


def _tq2_0(b):
    d = _f16(b[:, 64:66])
    return _tq2_codes(b[:, 0:64]), np.repeat(d, 8, axis=1), np.repeat(-d, 8, axis=1)


_POW3 = np.array([1, 3, 9, 27, 81], np.uint8)


def _trits(x: np.ndarray, k: int) -> np.ndarray:
    """bytes [nb, n] holding k base-3 digits (ggml's fixed-point encoding) -> [nb, k*n] in 0..2,
    digit i of byte j at position i*n + j."""
    y = x[:, None, :] * _POW3[:k].reshape(1, k, 1)  # uint8 wrap-around is intended
    return ((y.astype(np.uint16) * 3) >> 8).astype(np.uint8).reshape(x.shape[0], -1)


def _tq1_0(b):
    d = _f16(b[:, 52:54])
    codes = np.concatenate([_trits(b[:, 0:32], 5), _trits(b[:, 32:48], 5), _trits(b[:, 48:52], 4)], axis=-1)
    return codes, np.repeat(d, 8, axis=1), np.repeat(-d, 8, axis=1)


# bits, mode
_EXACT = {
    T.Q8_0: (_q8_0, 8, "affine"),
    T.Q4_0: (_q4_0, 4, "affine"),
    T.Q4_1: (_q4_1, 4, "affine"),
    T.Q5_0: (_q5_0, 5, "affine"),
    T.Q5_1: (_q5_1, 5, "affine"),
    T.Q4_K: (_q4_k, 4, "affine"),
    T.Q5_K: (_q5_k, 5, "affine"),
    T.MXFP4: (_mxfp4, 4, "mxfp4"),
    T.TQ2_0: (_tq2_0, 2, "affine"),
    T.TQ1_0: (_tq1_0, 2, "affine"),
}

def dequantize_exact(name: str, qtype: T, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A :data:`GGML_BLOCKS` tensor's exact float32 values (gguf-py's dequantization) in numpy ``shape``."""
    try:
        return gguf.quants.dequantize(np.ascontiguousarray(data).reshape(-1).view(np.uint8), qtype).reshape(shape)
    except ValueError as e:
        raise GGUFQuantError(f"tensor {name!r}: {T(qtype).name} shape {shape}: {e}") from None


def mlx_layout(qtype: T, requantize: bool = False) -> tuple[int, int, str]:
    """(bits, group_size, mode) of the MLX layout :func:`to_mlx` makes of a quantized GGML type: the exact types'
    (:data:`SUPPORTED_EXACT`), or with ``requantize`` the :data:`GGML_BLOCKS` types' affine :data:`REQUANT_BITS`;
    all with group size :data:`GROUP`."""
    qtype = T(int(qtype))
    if qtype in SUPPORTED_EXACT:
        return _EXACT[qtype][1], GROUP, _EXACT[qtype][2]
    if qtype in GGML_BLOCKS and requantize:
        return REQUANT_BITS[qtype], GROUP, "affine"
    raise GGUFQuantError(f"GGML type {qtype.name} has no MLX quantized layout"
                         + ("" if qtype in GGML_BLOCKS else f"; supported: {_supported_list()}"))


# --------------------------------------------------------------------------------------------


def to_mlx(name: str, qtype: gguf.GGMLQuantizationType, data: np.ndarray, shape: tuple[int, ...], *,
           requantize: bool = False, scale_dtype=mx.float32) -> dict:
    """Convert one GGUF tensor payload to MLX.

    Args:
        name: tensor name (only used in error messages / warnings).
        qtype: the GGML type (``gguf.GGMLQuantizationType`` or its int value).
        data: raw tensor bytes, uint8 numpy array of exactly ``n_elements / block * type_size``
            bytes (other dtypes are re-viewed as bytes).
        shape: logical numpy-order shape (reversed GGML ``ne``); last axis = block axis.
        requantize: allow lossy re-quantization of codebook (IQ*) types.
        scale_dtype: dtype of the returned affine scales/biases (float32 keeps exact types exact).

    Returns:
        ``{"weight": mx.array}`` for F32/F16/BF16 (dtype kept), else the MLX quantized layout
        described in the module docstring (leading dims of ``shape`` preserved).

    Raises:
        GGUFQuantError: unknown/unsupported type, codebook type without ``requantize``, wrong
            byte count, or last dim not a multiple of the block size.
    """
    try:
        qtype = T(int(qtype))
    except (ValueError, TypeError):
        raise GGUFQuantError(
            f"tensor {name!r}: unknown GGML type {qtype!r}; supported: {_supported_list()}"
        ) from None
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        shape = (1,)
    if qtype not in SUPPORTED_FLOAT + SUPPORTED_EXACT + GGML_BLOCKS:
        raise GGUFQuantError(
            f"tensor {name!r}: GGML type {qtype.name} is not supported; supported: {_supported_list()}"
        )
    if qtype in GGML_BLOCKS and not requantize:
        raise GGUFQuantError(
            f"tensor {name!r}: GGML type {qtype.name} has no MLX quantized layout; the loader keeps it as GGML "
            f"blocks (exact); pass requantize=True to dequantize it and re-quantize to MLX affine "
            f"{REQUANT_BITS[qtype]}-bit (lossy)"
        )
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    cols = shape[-1]
    if cols % block != 0 or (qtype not in SUPPORTED_FLOAT and cols % GROUP != 0):
        raise GGUFQuantError(
            f"tensor {name!r}: last dimension {cols} (shape {shape}) is not a multiple of the "
            f"{qtype.name} block size {block}"
        )
    n_el = math.prod(shape)
    expected = n_el // block * type_size
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.size != expected:
        raise GGUFQuantError(
            f"tensor {name!r}: {qtype.name} shape {shape} needs {expected} bytes, found {raw.size}"
        )

    if qtype in SUPPORTED_FLOAT:
        arr = raw.view(_FLOAT_NP[qtype]).reshape(shape)
        w = mx.array(arr)
        if qtype == T.BF16:
            w = w.view(mx.bfloat16)
        return {"weight": w}

    lead = shape[:-1]
    rows = n_el // cols
    bpr = cols // block  # blocks per row
    blocks = raw.reshape(rows * bpr, type_size)
    rows_per_chunk = max(1, _CHUNK_ELEMS // cols)

    if qtype in SUPPORTED_EXACT:
        return _convert_exact(name, qtype, blocks, lead, rows, cols, bpr, rows_per_chunk, scale_dtype)

    bits = mlx_layout(qtype, requantize=True)[0]

    def deq(b):
        return gguf.quants.dequantize(np.ascontiguousarray(b), qtype).reshape(b.shape[0], -1)

    out = _requant(deq, blocks, lead, rows, cols, bpr, rows_per_chunk, bits, scale_dtype)
    sbytes = np.dtype(np.float32 if scale_dtype == mx.float32 else np.float16).itemsize
    new_bytes = rows * cols * bits // 8 + 2 * rows * (cols // GROUP) * sbytes
    warnings.warn(
        f"tensor {name!r}: {qtype.name} re-quantized to MLX affine {bits}-bit g{GROUP}: "
        f"{expected} -> {new_bytes} bytes ({new_bytes / expected:.2f}x), "
        f"max abs error {out['max_abs_error']:.3g} vs the GGUF dequantization",
        stacklevel=2,
    )
    return out


def _convert_exact(name, qtype, blocks, lead, rows, cols, bpr, rpc, scale_dtype) -> dict:
    fn = _EXACT[qtype][0]
    bits, _, mode = mlx_layout(qtype)
    w = np.empty((rows, cols * bits // 8), np.uint8)
    ng = cols // GROUP
    if mode == "mxfp4":
        s = np.empty((rows, ng), np.uint8)
        b = None
    else:
        s = np.empty((rows, ng), np.float32)
        b = np.empty((rows, ng), np.float32)
    exact = True
    err = 0.0
    narrow = mode != "mxfp4" and scale_dtype != mx.float32
    for r0 in range(0, rows, rpc):
        r1 = min(rows, r0 + rpc)
        codes, sc, bi = fn(blocks[r0 * bpr:r1 * bpr])
        codes = codes.reshape(r1 - r0, cols)
        w[r0:r1] = _pack(codes, bits)
        s[r0:r1] = sc.reshape(r1 - r0, ng)
        if b is not None:
            b[r0:r1] = bi.reshape(r1 - r0, ng)
        elif exact and np.any(s[r0:r1] == 0xFF):
            # E8M0 0xFF: MLX (OCP MX) decodes NaN, ggml decodes 2**128 -- cannot be matched
            exact, err = False, math.inf
        if narrow:
            qmax = codes.reshape(r1 - r0, ng, GROUP).max(-1)
            exact, err = False, max(err, _narrow_error_bound(s[r0:r1], b[r0:r1], qmax, scale_dtype))
    if mode == "mxfp4" and not exact:
        warnings.warn(f"tensor {name!r}: MXFP4 has E8M0 scale bytes 0xFF: MLX decodes those blocks as NaN/inf, "
                      f"ggml as 2**128 (exact=False, max_abs_error=inf)", stacklevel=3)
    out = {
        "weight": mx.array(w.view(np.uint32).reshape(*lead, -1)),
        "scales": mx.array(s.reshape(*lead, ng)),
        "bits": bits,
        "group_size": GROUP,
        "mode": mode,
        "exact": exact,
        "max_abs_error": err,
    }
    if b is not None:
        out["scales"] = out["scales"].astype(scale_dtype)
        out["biases"] = mx.array(b.reshape(*lead, ng)).astype(scale_dtype)
    return out


_MANTISSA_BITS = {mx.float16: 10, mx.bfloat16: 7}
_MIN_SUBNORMAL = {mx.float16: 2.0 ** -24, mx.bfloat16: 2.0 ** -133}


def _ulp(x: np.ndarray, dtype) -> np.ndarray:
    """Spacing of ``dtype``'s numbers (float16 / bfloat16) at |x| (float64; subnormal spacing near 0)."""
    _, e = np.frexp(np.abs(x))
    return np.maximum(np.ldexp(1.0, e - 1 - _MANTISSA_BITS[dtype]), _MIN_SUBNORMAL[dtype])


def _narrow_error_bound(s32: np.ndarray, b32: np.ndarray, qmax: np.ndarray, dtype) -> float:
    """Upper bound of |MLX's dequantization - (s*q + b)| when scales/biases [rows, groups] are rounded to ``dtype``.

    Per group: the rounding of scale and bias (max over q in [0, qmax] of |(s' - s)*q + (b' - b)|, qmax the group's
    largest code), plus half an ulp of ``dtype`` for the product s'*q and half an ulp for the sum (MLX's CPU
    dequantizes in ``dtype``, rounding both; a backend that computes in float32 and rounds once stays within it),
    the ulps taken at the largest magnitudes the group can reach. O(groups), unlike a measurement.
    """
    s_n = np.array(mx.array(s32).astype(dtype).astype(mx.float32), np.float64)
    b_n = np.array(mx.array(b32).astype(dtype).astype(mx.float32), np.float64)
    ds = s_n - s32.astype(np.float64)
    db = b_n - b32.astype(np.float64)
    q = qmax.astype(np.float64)
    prod = np.abs(s_n) * q
    grow = 1 + 2.0 ** -_MANTISSA_BITS[dtype]  # the rounded product may sit half an ulp above the exact one
    with np.errstate(invalid="ignore", over="ignore"):
        bound = (np.maximum(np.abs(db), np.abs(ds * q + db)) + _ulp(prod, dtype) / 2
                 + _ulp((prod + np.abs(b_n)) * grow, dtype) / 2)
    if bound.size == 0:
        return 0.0
    return float(np.max(bound)) if np.all(np.isfinite(bound)) else math.inf


def _minmax_quant(x: np.ndarray, bits: int, scale_dtype):
    """Round-to-nearest min/max affine quantization of x [rows, cols] in groups of 32.

    scale = (max - min) / (2**bits - 1), bias = min (both rounded to scale_dtype first, the codes
    are chosen against the rounded values), so the error is at most half a step (plus clipping at
    the ends when the scale/bias rounding shifted the grid)."""
    n = 2 ** bits - 1
    g = mx.array(x).reshape(x.shape[0], -1, GROUP)
    lo = g.min(-1)
    hi = g.max(-1)
    s = ((hi - lo) / n).astype(scale_dtype)
    b = lo.astype(scale_dtype)
    s32 = s.astype(mx.float32)[..., None]
    b32 = b.astype(mx.float32)[..., None]
    q = mx.where(s32 > 0, mx.round((g - b32) / s32), 0.0)
    q = mx.clip(q, 0, n).astype(mx.uint8).reshape(x.shape)
    mx.eval(q, s, b)
    q = np.array(q)
    return _pack(q, bits), s, b


def _requant(deq, blocks, lead, rows, cols, bpr, rpc, bits, scale_dtype) -> dict:
    ng = cols // GROUP
    ws, ss, bs = [], [], []
    err = 0.0
    for r0 in range(0, rows, rpc):
        r1 = min(rows, r0 + rpc)
        ref = deq(blocks[r0 * bpr:r1 * bpr]).reshape(r1 - r0, cols)
        wq, sc, bi = _minmax_quant(ref, bits, scale_dtype)
        wq = mx.array(wq.view(np.uint32))
        x = mx.array(ref)
        back = mx.dequantize(wq, sc, bi, group_size=GROUP, bits=bits).astype(mx.float32)
        fin = mx.isfinite(x)
        e = mx.max(mx.where(fin, mx.abs(back - x), 0.0)).item() if ref.size else 0.0
        if not mx.all(fin).item():
            e = float("nan")  # non-finite GGUF values cannot be represented; flag it
        err = e if math.isnan(e) else max(err, float(e))
        mx.eval(wq, sc, bi)
        ws.append(wq)
        ss.append(sc)
        bs.append(bi)
    cat = (lambda xs: xs[0]) if len(ws) == 1 else (lambda xs: mx.concatenate(xs, axis=0))
    return {
        "weight": cat(ws).reshape(*lead, cols * bits // 32),
        "scales": cat(ss).reshape(*lead, ng),
        "biases": cat(bs).reshape(*lead, ng),
        "bits": bits,
        "group_size": GROUP,
        "mode": "affine",
        "exact": False,
        "max_abs_error": err,
    }
