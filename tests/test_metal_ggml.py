"""The GGML block kernels (metal_kernels/ggml_dequant.metal, ggml_matvec.metal via kimi_mlx.ops.ggml.metal) on a
Metal GPU or in the CPU emulator: dequantized float32 weights bitwise equal to gguf-py's ``gguf.quants.dequantize``
(the independent reference), mat-vec products within 1e-5 of a float64 reference, for every type, at 37 rows (no
multiple of any tile), 2 blocks per row (3 for the 32-weight IQ4_NL)."""

import mlx.core as mx
import numpy as np
import pytest
from ggml_random import set_scale, random_blocks
from gguf import quants as gq
from metal_support import assert_matches, kernels_fixture, strict_kernels_fixture  # noqa: F401

from kimi_mlx import metal
from kimi_mlx.ops.ggml.dequant import dequantize
from kimi_mlx.ops.ggml.formats import FORMATS
from kimi_mlx.ops.ggml.matmul import ggml_gather_matmul, ggml_matmul
from kimi_mlx.ops.ggml.metal import DEQUANT_KERNEL, MATVEC_KERNEL, dequantize_metal, matvec_metal

DEQUANT, MATVEC = f"kimi_{DEQUANT_KERNEL}", f"kimi_{MATVEC_KERNEL}"
TYPES = list(FORMATS)
ROWS = 37


def blocks_for(name: str, lead: tuple = (), seed: int = 0) -> np.ndarray:
    """[*lead, ROWS, row_bytes] random valid blocks (``ggml_random``), 2 blocks per row (3 of the 32-weight IQ4_NL);
    the first three blocks get a zero, a negative and an fp16-subnormal scale."""
    f = FORMATS[name]
    cols = (3 if f.block_elems == 32 else 2) * f.block_elems
    blocks = random_blocks(name, (*lead, ROWS, cols), np.random.default_rng(seed))
    set_scale(blocks.reshape(-1, f.type_bytes)[:3], name, np.array([0.0, -0.05, 3e-6]))
    return blocks


def reference(blocks: np.ndarray, name: str) -> np.ndarray:
    return gq.dequantize(blocks, FORMATS[name].qtype)


def assert_bitwise(got: mx.array, ref: np.ndarray, what: str) -> None:
    g = np.array(got)
    assert g.dtype == np.float32 and g.shape == ref.shape, (what, g.dtype, g.shape, ref.shape)
    diff = g.view(np.uint32) != ref.view(np.uint32)
    assert not diff.any(), (
        f"{what}: {int(diff.sum())} of {diff.size} weights differ, e.g. {g[diff][:4]} vs {ref[diff][:4]}"
    )


def assert_close64(got: mx.array, ref64: np.ndarray, what: str) -> None:
    """float32 result within 1e-5 of max |ref| of a float64 reference."""
    g = np.array(got).astype(np.float64)
    assert g.shape == ref64.shape, (what, g.shape, ref64.shape)
    rel = np.abs(g - ref64).max() / np.abs(ref64).max()
    assert rel <= 1e-5, f"{what}: relative error {rel:.3g} > 1e-5"


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_bitwise_equals_gguf_py(name, kernels):
    """float32 weights of 37 rows bitwise equal to gguf-py's dequantization (zero, negative and subnormal scales
    included); the pure path (dequant.py) too, as a cross-check."""
    blocks = blocks_for(name)
    ref = reference(blocks, name)
    with kernels.active():
        got = dequantize_metal(mx.array(blocks), name)
        mx.eval(got)
    assert kernels.launched == [DEQUANT]
    assert_bitwise(got, ref, f"{name} kernel")
    assert_bitwise(dequantize(mx.array(blocks), name), ref, f"{name} pure path")
    kernels.assert_clean()


@pytest.mark.parametrize("name", TYPES)
def test_matvec_plain_and_gathered(name, kernels):
    """y = x Wᵀ within 1e-5 of float64: plain (x [2, K], W [37, row_bytes], 4 rows per threadgroup: a partial last
    threadgroup) and gathered (blocks [3, 37, row_bytes], x [2, 1, K] with top-3 expert ids [2, 3] repeating
    expert 2, 8 rows per threadgroup)."""
    E = 3
    blocks = blocks_for(name, (E,), seed=1)
    w = reference(blocks, name).astype(np.float64)  # [E, N, K]
    K = w.shape[-1]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 1, K)).astype(np.float32)
    idx = np.array([[2, 0, 2], [1, 2, 2]], np.int32)
    with kernels.active():
        plain = matvec_metal(mx.array(x[:, 0]), mx.array(blocks[1]), name)
        gathered = matvec_metal(mx.array(x), mx.array(blocks), name, mx.array(idx), rows_per_threadgroup=8)
        mx.eval(plain, gathered)
    assert kernels.launched == [MATVEC, MATVEC]
    assert plain.dtype == gathered.dtype == mx.float32
    x64 = x.astype(np.float64)
    assert_close64(plain, x64[:, 0] @ w[1].T, f"{name} plain")
    assert_close64(gathered, np.einsum("tk,tsnk->tsn", x64[:, 0], w[idx]), f"{name} gathered")
    kernels.assert_clean()


def test_leading_axes_and_half_outputs(kernels):
    """dequantize_metal keeps leading axes ([E, rows, row_bytes] -> [E, rows, cols]); bfloat16 output is the float32
    weights rounded once; a bfloat16 x gives a bfloat16 y within 2 ulp of the float32 computation."""
    name = "IQ2_XXS"
    blocks = blocks_for(name, (2,), seed=3)
    ref = reference(blocks, name)
    x = mx.array(np.random.default_rng(4).standard_normal((3, ref.shape[-1])), mx.bfloat16)
    with kernels.active():
        got = dequantize_metal(mx.array(blocks), name)
        half = dequantize_metal(mx.array(blocks), name, mx.bfloat16)
        y = matvec_metal(x, mx.array(blocks[0]), name)
        mx.eval(got, half, y)
    assert_bitwise(got, ref, "leading axis")
    assert half.dtype == mx.bfloat16
    assert np.array_equal(np.array(half.view(mx.uint16)), np.array(mx.array(ref).astype(mx.bfloat16).view(mx.uint16)))
    assert y.dtype == mx.bfloat16
    y32 = (x.astype(mx.float32) @ mx.array(ref[0]).T).astype(mx.bfloat16)
    assert_matches(y, y32, "bfloat16 mat-vec")
    kernels.assert_clean()


def test_no_races_or_uninitialised_reads(strict_kernels):
    """Three schedules agree and no uninitialised read is reported (IQ1_M: the most fields per block)."""
    name = "IQ1_M"
    blocks = blocks_for(name, (2,), seed=5)
    w = reference(blocks, name).astype(np.float64)
    x = np.random.default_rng(6).standard_normal((3, w.shape[-1])).astype(np.float32)
    idx = np.array([1, 1, 0], np.int32)
    with strict_kernels.active():
        got = dequantize_metal(mx.array(blocks[0]), name)
        y = matvec_metal(mx.array(x), mx.array(blocks), name, mx.array(idx), rows_per_threadgroup=3)
        mx.eval(got, y)
    strict_kernels.assert_clean()
    assert_bitwise(got, reference(blocks[0], name), name)
    assert_close64(y, np.einsum("pk,pnk->pn", x.astype(np.float64), w[idx]), name)


def test_gradient_wrt_x_is_the_pure_paths(kernels):
    """mx.grad w.r.t. x through matvec_metal (plain and gathered) equals that of x @ dequantize(W)ᵀ."""
    name = "IQ4_NL"
    blocks = mx.array(blocks_for(name, (3,), seed=7))
    x = mx.array(np.random.default_rng(8).standard_normal((2, 1, 96)), mx.float32)
    idx = mx.array([[0, 2], [2, 2]], mx.int32)
    cot = mx.array(np.random.default_rng(9).standard_normal((2, 2, ROWS)), mx.float32)
    w = dequantize(blocks, name)

    def pure(x):
        return ((x[:, 0] @ w[1].T) * cot[:, 0]).sum() + ((x[:, None] @ w[idx].swapaxes(-1, -2))[:, :, 0] * cot).sum()

    with kernels.active():
        got = mx.grad(
            lambda x: (
                (matvec_metal(x[:, 0], blocks[1], name) * cot[:, 0]).sum()
                + (matvec_metal(x, blocks, name, idx) * cot).sum()
            )
        )(x)
        mx.eval(got)
    assert kernels.launched == [MATVEC, MATVEC]
    assert_matches(got, mx.grad(pure)(x), "d loss / d x")


def test_bad_arguments_and_fallback(kernels):
    """Unsupported types, dtypes and shapes are ValueErrors naming them; with kernels off both functions return
    None (callers take the pure path)."""
    blocks = mx.array(blocks_for("IQ4_NL"))
    x = mx.zeros((1, 96))
    with kernels.active():
        with pytest.raises(ValueError, match="Q4_K"):
            dequantize_metal(blocks, "Q4_K")
        with pytest.raises(ValueError, match="IQ4_NL blocks must be uint8, got mlx.core.float32"):
            matvec_metal(x, blocks.astype(mx.float32), "IQ4_NL")
        with pytest.raises(ValueError, match=r"IQ4_NL blocks must be \[..., rows, k \* 18\]"):
            dequantize_metal(blocks[:, :20], "IQ4_NL")
        with pytest.raises(ValueError, match="output dtype must be float32/float16/bfloat16, got mlx.core.int32"):
            dequantize_metal(blocks, "IQ4_NL", mx.int32)
        with pytest.raises(ValueError, match="x dtype must be float32/float16/bfloat16, got mlx.core.int32"):
            matvec_metal(x.astype(mx.int32), blocks, "IQ4_NL")
        with pytest.raises(ValueError, match=r"x must be \[..., 96\]"):
            matvec_metal(mx.zeros((1, 64)), blocks, "IQ4_NL")
        with pytest.raises(ValueError, match=r"blocks must be \[E, rows"):
            matvec_metal(x, blocks, "IQ4_NL", mx.array([0]))
        with pytest.raises(ValueError, match="without indices"):
            matvec_metal(x, blocks[None], "IQ4_NL")
        with pytest.raises(ValueError, match=r"rows_per_threadgroup must be >= 1, got 0"):
            matvec_metal(x, blocks, "IQ4_NL", rows_per_threadgroup=0)
    with metal.disabled():
        assert dequantize_metal(blocks, "IQ4_NL") is None
        assert matvec_metal(x, blocks, "IQ4_NL") is None
    assert not kernels.launched


def test_kernel_files_include_the_shared_decoders():
    """Both kernel files pull the block decoders from metal_kernels/ggml_blocks.h (one copy)."""
    for name in (DEQUANT_KERNEL, MATVEC_KERNEL):
        f = metal.register(name)
        assert f.includes == ("ggml_blocks.h",) and "struct Block" in f.header


def test_matmuls_dispatch_to_the_kernels(kernels):
    """``ggml_matmul`` / ``ggml_gather_matmul`` on Metal: up to MATVEC_MAX_ROWS rows run the mat-vec kernel, more rows
    dequantize chunks with the dequantization kernel then multiply; both equal the pure path within 1e-5 (2 chunks)."""
    name = "IQ2_XXS"
    blocks = mx.array(blocks_for(name, (3,), seed=3))
    K = 2 * FORMATS[name].block_elems
    rng = np.random.default_rng(4)
    x_dec, x_pre = (mx.array(rng.normal(size=s).astype(np.float32)) for s in ((2, K), (12, K)))
    inds = mx.array([[2, 0], [1, 2]])
    chunk = 20 * K * 4  # 20 of the 37 rows per chunk

    def products():
        return (ggml_matmul(x_dec, blocks[0], name), ggml_matmul(x_pre, blocks[1], name, max_chunk_bytes=chunk),
                ggml_gather_matmul(x_dec[:, None, None], blocks, name, inds),
                ggml_gather_matmul(x_pre[:, None, None], blocks, name, mx.array([[0, 2]] * 12), max_chunk_bytes=chunk))

    with kernels.active():
        got = products()
        mx.eval(got)
    # 37 rows in chunks of 20: 2 launches; gathered prefill: 24 (x, expert) pairs, one expert (37 rows) per chunk
    assert kernels.launched == [MATVEC, DEQUANT, DEQUANT, MATVEC] + [DEQUANT] * 24
    with metal.disabled():
        want = products()
    for g, w in zip(got, want):
        assert_matches(g, w, "ggml matmul on Metal vs pure")
    kernels.assert_clean()
