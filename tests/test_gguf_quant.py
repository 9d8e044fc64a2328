"""GGUF quant payloads -> MLX layouts (kimi_mlx.convert.gguf.quant.to_mlx).

Every block format gets a small encoder written here from the format description (random codes and
random scales packed per the ggml block layout, with the expected float values computed from the
codes directly).  The converted MLX layout is checked against those values and, independently,
against gguf-py's reference ``gguf.quants.dequantize`` (bit-for-bit for exact types, within the
reported bound for re-quantized ones), and ``mx.quantized_matmul`` is checked against ``x @ W.T``.
"""

import math
import warnings

import gguf
import mlx.core as mx
import numpy as np
import pytest
from kimi_mlx.convert.gguf.quant import (
    GGML_BLOCKS,
    SUPPORTED_EXACT,
    GGUFQuantError,
    to_mlx,
)

T = gguf.GGMLQuantizationType
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


# ---------------------------------------------------------------------------------------------
# test-side encoders: return (raw uint8 bytes [nb * type_size], expected float32 [nb, block])


def _h(x):
    """fp16 little-endian bytes of x (array) -> uint8 [n, 2], and the fp32 value actually stored."""
    h = np.asarray(x, np.float16).reshape(-1)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _rand_d(rng, nb, lo=1e-3, hi=5e-2):
    return rng.uniform(lo, hi, nb) * rng.choice([-1, 1], nb)


def enc_q8_0(rng, nb):
    db, d = _h(_rand_d(rng, nb))
    q = rng.integers(-128, 128, (nb, 32)).astype(np.int8)
    return np.concatenate([db, q.view(np.uint8)], 1), d[:, None] * q.astype(np.float32)


def _nib32(q):
    """32 4-bit values -> 16 bytes: element j in the low nibble of byte j, j+16 in the high nibble."""
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def enc_q4_0(rng, nb):
    db, d = _h(_rand_d(rng, nb))
    q = rng.integers(0, 16, (nb, 32))
    return np.concatenate([db, _nib32(q)], 1), d[:, None] * (q - 8).astype(np.float32)


def enc_q4_1(rng, nb):
    db, d = _h(_rand_d(rng, nb))
    mb, m = _h(rng.uniform(-0.5, 0.5, nb))
    q = rng.integers(0, 16, (nb, 32))
    return np.concatenate([db, mb, _nib32(q)], 1), d[:, None] * q.astype(np.float32) + m[:, None]


def _qh32(q5):
    """bit 4 of element j -> bit j of a little-endian uint32."""
    bits = (q5 >> 4).astype(np.uint64)
    v = (bits << np.arange(32, dtype=np.uint64)).sum(1).astype(np.uint32)
    return v.view(np.uint8).reshape(-1, 4)


def enc_q5_0(rng, nb):
    db, d = _h(_rand_d(rng, nb))
    q = rng.integers(0, 32, (nb, 32))
    return np.concatenate([db, _qh32(q), _nib32(q & 15)], 1), d[:, None] * (q - 16).astype(np.float32)


def enc_q5_1(rng, nb):
    db, d = _h(_rand_d(rng, nb))
    mb, m = _h(rng.uniform(-0.5, 0.5, nb))
    q = rng.integers(0, 32, (nb, 32))
    return (np.concatenate([db, mb, _qh32(q), _nib32(q & 15)], 1),
            d[:, None] * q.astype(np.float32) + m[:, None])


def _k_scales12(sc, m):
    """Pack 8 six-bit scales and 8 six-bit mins (ggml get_scale_min_k4 layout) into 12 bytes."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    for j in range(4):
        out[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 15) | ((m[:, j + 4] & 15) << 4)
    return out


def _k_qs128(q):
    """256 4-bit values -> 128 bytes: byte 32p+l = q[64p+l] | q[64p+32+l] << 4."""
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _k_common(rng, nb):
    db, d = _h(_rand_d(rng, nb, 1e-4, 2e-3))
    mb, dmin = _h(rng.uniform(1e-4, 2e-3, nb))
    sc = rng.integers(0, 64, (nb, 8)).astype(np.uint8)
    m = rng.integers(0, 64, (nb, 8)).astype(np.uint8)
    scale = np.repeat(d[:, None] * sc.astype(np.float32), 32, 1)
    bias = np.repeat(dmin[:, None] * m.astype(np.float32), 32, 1)
    return np.concatenate([db, mb, _k_scales12(sc, m)], 1), scale, bias


def enc_q4_k(rng, nb):
    head, scale, bias = _k_common(rng, nb)
    q = rng.integers(0, 16, (nb, 256))
    return np.concatenate([head, _k_qs128(q)], 1), scale * q.astype(np.float32) - bias


def enc_q5_k(rng, nb):
    head, scale, bias = _k_common(rng, nb)
    q = rng.integers(0, 32, (nb, 256))
    qh = np.zeros((nb, 32), np.uint8)
    for s in range(8):  # bit s of qh[l] = bit 4 of element 32 s + l
        qh |= ((q[:, 32 * s:32 * s + 32] >> 4).astype(np.uint8) << s)
    return np.concatenate([head, qh, _k_qs128(q & 15)], 1), scale * q.astype(np.float32) - bias


def enc_q6_k(rng, nb):
    q = rng.integers(0, 64, (nb, 256)).astype(np.uint8)
    sc = rng.integers(-128, 128, (nb, 16)).astype(np.int8)
    db, d = _h(_rand_d(rng, nb, 1e-5, 1e-4))
    ql = np.zeros((nb, 128), np.uint8)
    qh = np.zeros((nb, 64), np.uint8)
    for n in range(2):
        for l in range(32):
            q1, q2, q3, q4 = (q[:, n * 128 + l + 32 * k] for k in range(4))
            ql[:, n * 64 + l] = (q1 & 15) | ((q3 & 15) << 4)
            ql[:, n * 64 + l + 32] = (q2 & 15) | ((q4 & 15) << 4)
            qh[:, n * 32 + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    scale = np.repeat(d[:, None] * sc.astype(np.float32), 16, 1)
    return (np.concatenate([ql, qh, sc.view(np.uint8), db], 1),
            scale * (q.astype(np.float32) - 32))


def _q2_qs64(q):
    """256 2-bit values -> 64 bytes: byte 32n+l bits 2k.. = q[128n + 32k + l]."""
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def enc_q2_k(rng, nb):
    q = rng.integers(0, 4, (nb, 256))
    sc = rng.integers(0, 16, (nb, 16)).astype(np.uint8)
    m = rng.integers(0, 16, (nb, 16)).astype(np.uint8)
    db, d = _h(_rand_d(rng, nb, 1e-3, 1e-2))
    mb, dmin = _h(rng.uniform(1e-3, 1e-2, nb))
    val = (np.repeat(d[:, None] * sc, 16, 1) * q.astype(np.float32) - np.repeat(dmin[:, None] * m, 16, 1))
    return np.concatenate([sc | (m << 4), _q2_qs64(q), db, mb], 1), val.astype(np.float32)


def enc_q3_k(rng, nb):
    u = rng.integers(0, 8, (nb, 256))  # stored 3-bit code; value q = u - 4
    s = rng.integers(0, 64, (nb, 16)).astype(np.uint8)  # 6-bit scale, value s - 32
    db, d = _h(_rand_d(rng, nb, 1e-3, 1e-2))
    hmask = np.zeros((nb, 32), np.uint8)
    for b in range(8):  # bit b of hmask[l] = bit 2 of element 32 b + l
        hmask |= ((u[:, 32 * b:32 * b + 32] >> 2).astype(np.uint8) << b)
    sc12 = np.zeros((nb, 12), np.uint8)
    for j in range(8):
        sc12[:, j] = (s[:, j] & 15) | ((s[:, j + 8] & 15) << 4)
    for j in range(4):
        for k in range(4):
            sc12[:, 8 + j] |= (s[:, 4 * k + j] >> 4) << (2 * k)
    val = np.repeat(d[:, None] * (s.astype(np.float32) - 32), 16, 1) * (u - 4).astype(np.float32)
    return np.concatenate([hmask, _q2_qs64(u & 3), sc12, db], 1), val


def enc_mxfp4(rng, nb):
    e = rng.integers(118, 137, (nb, 1)).astype(np.uint8)
    c = rng.integers(0, 16, (nb, 32))
    val = E2M1[c] * np.exp2(e.astype(np.float32) - 127)
    return np.concatenate([e, _nib32(c)], 1), val.astype(np.float32)


def enc_tq2_0(rng, nb):
    u = rng.integers(0, 3, (nb, 256))
    db, d = _h(_rand_d(rng, nb))
    return np.concatenate([_q2_qs64(u), db], 1), d[:, None] * (u - 1).astype(np.float32)


def _tq1_pack(u, k):
    """Columns of u [nb, k, n] (trits) -> bytes [nb, n]: ggml base-3 fixed point, digit i weighs 3^(4-i)."""
    v = sum(u[:, i].astype(np.uint16) * 3 ** (4 - i) for i in range(k))
    return ((v * 256 + 242) // 243).astype(np.uint8)


def enc_tq1_0(rng, nb):
    u = rng.integers(0, 3, (nb, 256))
    db, d = _h(_rand_d(rng, nb))
    qs0 = _tq1_pack(u[:, :160].reshape(nb, 5, 32), 5)
    qs1 = _tq1_pack(u[:, 160:240].reshape(nb, 5, 16), 5)
    qh = _tq1_pack(u[:, 240:].reshape(nb, 4, 4), 4)
    return np.concatenate([qs0, qs1, qh, db], 1), d[:, None] * (u - 1).astype(np.float32)


ENCODERS = {
    T.Q8_0: enc_q8_0, T.Q4_0: enc_q4_0, T.Q4_1: enc_q4_1, T.Q5_0: enc_q5_0, T.Q5_1: enc_q5_1,
    T.Q4_K: enc_q4_k, T.Q5_K: enc_q5_k, T.MXFP4: enc_mxfp4, T.TQ2_0: enc_tq2_0, T.TQ1_0: enc_tq1_0,
    T.Q6_K: enc_q6_k, T.Q2_K: enc_q2_k, T.Q3_K: enc_q3_k,
}


def make(qtype, shape, seed=0):
    """Random tensor of `qtype` with numpy shape `shape`: (raw bytes, expected float32 values)."""
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    nb = math.prod(shape) // block
    raw, val = ENCODERS[qtype](np.random.default_rng(seed), nb)
    assert raw.shape == (nb, gguf.GGML_QUANT_SIZES[qtype][1])
    return np.ascontiguousarray(raw).reshape(-1), val.astype(np.float32).reshape(shape)


def deq(o):
    return np.array(mx.dequantize(o["weight"], o["scales"], o.get("biases"), group_size=o["group_size"],
                                  bits=o["bits"], mode=o["mode"], dtype=mx.float32))


def check_matmul(o, w_ref):
    x = mx.array(np.random.default_rng(1).standard_normal((3, w_ref.shape[-1])).astype(np.float32))
    w2 = o["weight"].reshape(-1, o["weight"].shape[-1])
    s2 = o["scales"].reshape(-1, o["scales"].shape[-1])
    b2 = o["biases"].reshape(-1, o["biases"].shape[-1]) if "biases" in o else None
    y = np.array(mx.quantized_matmul(x, w2, s2, b2, transpose=True, group_size=o["group_size"],
                                     bits=o["bits"], mode=o["mode"]).astype(mx.float32))
    deq2 = deq(o).reshape(-1, w_ref.shape[-1]).astype(np.float64)
    ref = np.array(x).astype(np.float64) @ deq2.T
    assert np.max(np.abs(y - ref)) <= 1e-4 * max(1e-30, np.max(np.abs(ref))) + 1e-6 * np.max(np.abs(deq2))


def _shape(qtype):
    return (2, 3, 512) if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else (2, 3, 96)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", SUPPORTED_EXACT, ids=lambda t: t.name)
def test_exact_types_bit_exact(qtype):
    """Exact types: own-encoder tensor -> to_mlx -> mx.dequantize equals both the values computed from
    the codes and gguf-py's dequantize bit-for-bit (float32), leading dims kept, quantized_matmul agrees."""
    shape = _shape(qtype)
    raw, val = make(qtype, shape)
    ref = gguf.quants.dequantize(raw.reshape(*shape[:-1], -1), qtype)
    np.testing.assert_array_equal(ref, val)  # sanity of the test encoder against gguf-py
    o = to_mlx("blk.0.ffn_up_exps.weight", qtype, raw, shape)
    assert o["exact"] is True and o["max_abs_error"] == 0.0 and o["group_size"] == 32
    assert o["weight"].dtype == mx.uint32 and o["weight"].shape == (*shape[:-1], shape[-1] * o["bits"] // 32)
    assert o["scales"].shape == (*shape[:-1], shape[-1] // 32)
    assert ("biases" in o) == (o["mode"] == "affine")
    got = deq(o)
    assert got.shape == shape
    np.testing.assert_array_equal(got, ref)
    check_matmul(o, ref)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4, T.TQ2_0, T.TQ1_0],
                         ids=lambda t: t.name)
def test_gguf_py_quantize_roundtrip(qtype):
    """Tensors quantized by gguf-py's reference quantizer convert bit-exactly (vs gguf-py dequantize)."""
    shape = (4, 5, 256)
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    q = gguf.quants.quantize(x, qtype)
    ref = gguf.quants.dequantize(q, qtype)
    o = to_mlx("w", qtype, q, shape)  # q is [.., bytes] uint8; flattened inside
    np.testing.assert_array_equal(deq(o), ref)
    check_matmul(o, ref)


def test_mxfp4_scale_is_e_not_halved():
    """MXFP4: ggml's doubled table x 2^(e-128) equals E2M1 x 2^(e-127), so MLX scales are the raw e bytes,
    and nibbles are re-interleaved (element j low / j+16 high -> MLX low-nibble-first)."""
    raw, val = make(T.MXFP4, (1, 64))
    o = to_mlx("w", T.MXFP4, raw, (1, 64))
    assert o["mode"] == "mxfp4" and o["scales"].dtype == mx.uint8
    np.testing.assert_array_equal(np.array(o["scales"]).reshape(-1), raw.reshape(2, 17)[:, 0])
    # MLX stores element 0 in the lowest nibble of the first word
    codes = raw.reshape(2, 17)[:, 1:]
    w = np.array(o["weight"]).view(np.uint8).reshape(2, 16)
    np.testing.assert_array_equal(w[:, 0] & 15, codes[:, 0] & 15)  # element 0
    np.testing.assert_array_equal(w[:, 0] >> 4, codes[:, 1] & 15)  # element 1
    np.testing.assert_array_equal(w[:, 8] & 15, codes[:, 0] >> 4)  # element 16
    np.testing.assert_array_equal(deq(o), val)


@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q8_0, T.Q4_1, T.TQ2_0], ids=lambda t: t.name)
def test_narrow_scales_report_error_bound(qtype, scale_dtype):
    """scale_dtype=float16/bfloat16: compact scales, exact is False and max_abs_error bounds the true deviation of
    MLX's dequantization (in that dtype) from the GGUF values, without being loose."""
    shape = (4, 512)
    raw, val = make(qtype, shape, seed=3)
    o = to_mlx("w", qtype, raw, shape, scale_dtype=scale_dtype)
    assert o["scales"].dtype == scale_dtype and o["biases"].dtype == scale_dtype
    assert o["exact"] is False
    got = mx.dequantize(o["weight"], o["scales"], o["biases"], group_size=o["group_size"], bits=o["bits"])
    assert got.dtype == scale_dtype  # MLX dequantizes in the scales' dtype, as quantized matmuls in that dtype do
    err = float(np.max(np.abs(np.array(got.astype(mx.float32)) - val)))
    bound = o["max_abs_error"]
    assert err <= bound, (err, bound)
    ulp_of_max = np.abs(val).max() * 2.0 ** -(10 if scale_dtype == mx.float16 else 7)
    assert bound <= max(4 * err, 2 * ulp_of_max), (err, bound)  # not loose: 4x the error or 2 ulps of max |w|
    if qtype == T.Q8_0 and scale_dtype == mx.float16:  # fp16 d and -128 d are representable; MLX dequantizes in fp16
        np.testing.assert_array_equal(np.array(o["scales"].astype(mx.float32)).reshape(-1),
                                      raw.reshape(-1, 34)[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1))


def test_narrow_scale_bound_covers_extreme_groups():
    """The bound also holds for groups whose scale rounds to a float16 subnormal or overflows (inf bound)."""
    from kimi_mlx.convert.gguf.quant import _narrow_error_bound

    s = np.array([[3e-8, 1.0]], np.float32)
    b = np.array([[-1e-7, 0.5]], np.float32)
    q = np.array([[15, 15]], np.uint8)
    got = np.array(mx.dequantize(*_affine4(s, b), group_size=32, bits=4).astype(mx.float32))
    want = (s[..., None] * (np.arange(32) % 16)[None, None] + b[..., None]).reshape(1, -1)
    err = np.max(np.abs(got - want))
    assert 0 < err <= _narrow_error_bound(s, b, q, mx.float16)
    assert _narrow_error_bound(np.array([[1e6]], np.float32), b[:, :1], q[:, :1], mx.float16) == math.inf


def _affine4(s: np.ndarray, b: np.ndarray):
    """4-bit codes 0..15 repeated over each 32-wide group, scales/biases rounded to float16."""
    codes = np.tile(np.arange(32) % 16, s.size).astype(np.uint8).reshape(s.shape[0], -1)
    from kimi_mlx.convert.gguf.quant import _pack

    w = mx.array(_pack(codes, 4).view(np.uint32))
    return w, mx.array(s).astype(mx.float16), mx.array(b).astype(mx.float16)


@pytest.mark.parametrize("qtype", (T.Q6_K, T.Q3_K, T.Q2_K), ids=lambda t: t.name)
def test_requantized_k_types(qtype):
    """Q6_K/Q3_K/Q2_K (16-wide sub-blocks) with requantize=True: the encoder's values are gguf-py's and the MLX
    re-quantization is within the reported max_abs_error, which is within one quantization step."""
    shape = (2, 3, 512)
    raw, val = make(qtype, shape)
    ref = gguf.quants.dequantize(raw.reshape(*shape[:-1], -1), qtype)
    np.testing.assert_allclose(ref, val, rtol=1e-6, atol=0)
    with pytest.warns(UserWarning, match=rf"{qtype.name} re-quantized"):
        o = to_mlx("w", qtype, raw, shape, requantize=True)
    assert o["exact"] is False and o["mode"] == "affine" and o["group_size"] == 32
    got = deq(o)
    err = float(np.max(np.abs(got - ref)))
    assert math.isclose(err, o["max_abs_error"], rel_tol=1e-5, abs_tol=1e-12)
    g = ref.reshape(-1, 32)
    step = (g.max(1) - g.min(1)) / (2 ** o["bits"] - 1)
    gerr = np.abs(got - ref).reshape(-1, 32).max(1)
    assert np.all(gerr <= step * (0.5 + 1e-4) + 1e-7 * np.abs(ref).max())
    check_matmul(o, got)


def test_float_passthrough():
    """F32/F16 keep dtype and values; BF16 is read via a uint16 view and equals gguf-py's BF16 decode."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    o = to_mlx("norm", T.F32, x.view(np.uint8).reshape(-1), (3, 5))
    assert set(o) == {"weight"} and o["weight"].dtype == mx.float32
    np.testing.assert_array_equal(np.array(o["weight"]), x)
    h = x.astype(np.float16)
    o = to_mlx("h", T.F16, h.view(np.uint8), (3, 5))
    assert o["weight"].dtype == mx.float16
    np.testing.assert_array_equal(np.array(o["weight"]), h)
    bf = gguf.quants.quantize(x, T.BF16)
    o = to_mlx("b", T.BF16, bf, (3, 5))
    assert o["weight"].dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(o["weight"].astype(mx.float32)), gguf.quants.dequantize(bf, T.BF16))
    # a float32 array (as GGUFReader returns for F32) is accepted too; 1-element / trailing-1 shapes
    o = to_mlx("ssm_a", T.F32, x[0], (1, 5))
    assert o["weight"].shape == (1, 5)


def test_block_types_require_requantize():
    """The types with no MLX layout (kept as GGML blocks by the loader) raise GGUFQuantError in ``to_mlx`` naming
    tensor, type, the blocks and the requantize option."""
    for qtype in GGML_BLOCKS:
        block, ts = gguf.GGML_QUANT_SIZES[qtype]
        with pytest.raises(GGUFQuantError, match=rf"blk\.3\.ffn_down.*{qtype.name}.*GGML blocks.*requantize"):
            to_mlx("blk.3.ffn_down_exps.weight", qtype, np.zeros(ts * 2, np.uint8), (2, block))


def test_codebook_requantize_iq4_nl():
    """IQ4_NL with requantize=True: dequantized by gguf-py, re-quantized to MLX affine, exact False,
    error matches the measured one, a warning states size and error cost."""
    rng = np.random.default_rng(5)
    nb = 4 * 256 // 32
    db, _ = _h(rng.uniform(1e-3, 1e-2, nb))
    raw = np.concatenate([db, rng.integers(0, 256, (nb, 16)).astype(np.uint8)], 1).reshape(-1)
    ref = gguf.quants.dequantize(raw.reshape(4, -1), T.IQ4_NL)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        o = to_mlx("w", T.IQ4_NL, raw, (4, 256), requantize=True)
    assert any("IQ4_NL" in str(r.message) and "bytes" in str(r.message) and "error" in str(r.message)
               for r in rec)
    assert o["exact"] is False
    err = float(np.max(np.abs(deq(o) - ref)))
    assert math.isclose(err, o["max_abs_error"], rel_tol=1e-5) and err < 0.5 * np.abs(ref).max()


def test_errors():
    """Truncated data, unknown/unsupported type and a last dim not a multiple of the block size raise
    GGUFQuantError with the tensor name and the relevant numbers."""
    raw, _ = make(T.Q8_0, (2, 64))
    with pytest.raises(GGUFQuantError, match=r"'t\.w'.*Q8_0.*needs 136 bytes, found 135"):
        to_mlx("t.w", T.Q8_0, raw[:-1], (2, 64))
    with pytest.raises(GGUFQuantError, match=r"'t\.w'.*unknown GGML type 12345.*supported: .*Q8_0.*MXFP4"):
        to_mlx("t.w", 12345, raw, (2, 64))
    with pytest.raises(GGUFQuantError, match=r"'t\.w'.*Q8_1.*not supported.*Q4_K"):
        to_mlx("t.w", T.Q8_1, np.zeros(72, np.uint8), (1, 64))
    with pytest.raises(GGUFQuantError, match=r"'t\.w'.*last dimension 48.*Q8_0 block size 32"):
        to_mlx("t.w", T.Q8_0, np.zeros(34 * 3, np.uint8), (2, 48))
    with pytest.raises(GGUFQuantError, match=r"last dimension 128.*Q4_K block size 256"):
        to_mlx("t.w", T.Q4_K, np.zeros(144, np.uint8), (2, 128))
    assert issubclass(GGUFQuantError, ValueError)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.MXFP4, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.filterwarnings("ignore:.*re-quantized")
def test_chunked_conversion(monkeypatch, qtype):
    """Row chunking (used to bound memory on huge stacked-expert tensors) gives the same arrays as
    converting in one piece, including a ragged last chunk."""
    from kimi_mlx.convert.gguf import quant as Q

    shape = (5, 3, 512)
    raw, _ = make(qtype, shape, seed=8)
    whole = to_mlx("w", qtype, raw, shape, requantize=True)
    monkeypatch.setattr(Q, "_CHUNK_ELEMS", 512 * 4)  # 4 rows per chunk, 15 rows
    parts = to_mlx("w", qtype, raw, shape, requantize=True)
    for k in ("weight", "scales", "biases"):
        if k in whole:
            np.testing.assert_array_equal(np.array(parts[k]), np.array(whole[k]))
    assert parts["max_abs_error"] == whole["max_abs_error"]


def test_requantized_float16_scales():
    """Re-quantization with scale_dtype=mx.float16: scales/biases are float16 and the reported error is
    the real one (MLX dequantizing in fp16), still about half a step."""
    shape = (4, 512)
    raw, _ = make(T.Q6_K, shape, seed=9)
    ref = gguf.quants.dequantize(raw.reshape(4, -1), T.Q6_K)
    with pytest.warns(UserWarning, match="Q6_K re-quantized"):
        o = to_mlx("w", T.Q6_K, raw, shape, scale_dtype=mx.float16, requantize=True)
    assert o["scales"].dtype == mx.float16 and o["biases"].dtype == mx.float16
    got = np.array(mx.dequantize(o["weight"], o["scales"], o["biases"], group_size=32, bits=o["bits"])
                   .astype(mx.float32))
    err = float(np.max(np.abs(got - ref)))
    assert math.isclose(err, o["max_abs_error"], rel_tol=1e-6)
    g = ref.reshape(-1, 32)
    assert err <= 0.6 * ((g.max(1) - g.min(1)) / 63).max() + 1e-3 * np.abs(ref).max()


@pytest.mark.parametrize("fname", ["kimi_k3/kimi-k3-tiny-Q8_0.gguf", "kimi_linear/kimi-linear-tiny-Q8_0.gguf",
                                   "kimi_linear/kimi-linear-tiny-F16.gguf"])
def test_llamacpp_fixture_files(fname):
    """Every tensor of the llama.cpp-made fixture GGUFs (Q8_0/F16/F32, incl. stacked experts and
    trailing-1 shapes), read with GGUFReader and shape = reversed ne, converts bit-exactly."""
    from conftest import FIXTURES

    path = FIXTURES / fname
    assert path.exists(), f"reference fixture missing: {path}"
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        o = to_mlx(t.name, t.tensor_type, t.data, shape)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        got = deq(o) if "scales" in o else np.array(o["weight"].astype(mx.float32))
        np.testing.assert_array_equal(got, ref, err_msg=t.name)


def test_mxfp4_nan_scale_flagged():
    """An E8M0 scale byte 0xFF (NaN in MLX/OCP, 2**128 in ggml) makes the MXFP4 conversion inexact
    (max_abs_error=inf) with a warning naming the tensor; e = 0 (2**-127) still matches ggml."""
    raw = np.zeros((2, 17), np.uint8)
    raw[:, 1] = 0x21
    raw[1, 0] = 0
    o = to_mlx("w0", T.MXFP4, raw.reshape(-1), (2, 32))
    assert o["exact"]
    np.testing.assert_array_equal(deq(o), gguf.quants.dequantize(raw, T.MXFP4))
    raw[0, 0] = 0xFF
    with pytest.warns(UserWarning, match=r"'w1'.*0xFF"):
        o = to_mlx("w1", T.MXFP4, raw.reshape(-1), (2, 32))
    assert o["exact"] is False and o["max_abs_error"] == math.inf
