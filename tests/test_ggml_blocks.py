"""GGML block tensors (kimi_mlx.ops.ggml): tables from the format description, exact dequantization against
gguf-py, matmuls (plain, per expert, gathered) against a float64 reference, gradients, the chunk memory bound."""

import numpy as np
import pytest
from gguf import quants as gq

import mlx.core as mx
from ggml_random import random_blocks
from kimi_mlx.ops.ggml import (
    FORMATS,
    dequantize,
    ggml_expert_matmul,
    ggml_gather_matmul,
    ggml_matmul,
    mx_tables,
    row_bytes,
    tables,
)

NAMES = list(FORMATS)


def blocks_for(name: str, rows: int, seed: int, lead: tuple = ()) -> np.ndarray:
    """Random valid blocks [*lead, rows, 3 blocks' bytes] (any index, sign and code bits; finite fp16 scales)."""
    return random_blocks(name, (*lead, rows, cols_for(name)), np.random.default_rng(seed))


def reference(b: np.ndarray, name: str) -> np.ndarray:
    return gq.dequantize(b, FORMATS[name].qtype)


def cols_for(name: str) -> int:
    return 3 * FORMATS[name].block_elems


def rel_err(y, ref) -> float:
    return float(np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max())


# ---------------------------------------------------------------------------------------------------------------
# tables


@pytest.mark.parametrize("name", [n for n in NAMES if "grid" in tables(n)])
def test_grid_equals_gguf_init_grid(name):
    cls = getattr(gq, name)
    cls.init_grid()  # gguf-py's own expansion of the same description
    grid = tables(name)["grid"]
    assert grid.shape == tuple(cls.grid_shape)
    assert np.array_equal(grid.astype(np.float32), cls.grid.reshape(cls.grid_shape))
    assert np.array_equal(np.array(mx_tables(name)["grid"]), grid)


def test_sign_table_rule():
    for name in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS"):
        signs = tables(name)["signs"]
        assert signs.dtype == np.uint8 and signs.shape == (128,)
        assert np.array_equal(signs & 0x7F, np.arange(128))
        assert (np.unpackbits(signs[:, None], axis=1).sum(axis=1) % 2 == 0).all()  # even count of minus signs
        assert signs.tobytes() == gq.IQ2_XXS.ksigns


def test_table_keys():
    assert tables("IQ4_NL")["values"].dtype == np.int8 and tables("IQ4_XS")["values"].shape == (16,)
    assert tables("IQ1_S")["grid"].dtype == np.int8 and tables("IQ1_M")["grid"].shape == (2048, 8)
    assert tables("IQ2_S").keys() == {"grid"} and tables("Q6_K") == {}
    assert row_bytes("IQ2_XXS", 512) == 132 and row_bytes("IQ4_NL", 64) == 36


# ---------------------------------------------------------------------------------------------------------------
# dequantization


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_bitwise(name):
    b = blocks_for(name, 9, seed=0, lead=(2,))
    ref = reference(b, name)
    got = np.array(dequantize(mx.array(b), name))
    assert got.dtype == np.float32 and got.shape == ref.shape == (2, 9, cols_for(name))
    assert np.isfinite(got).all()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_errors():
    b = mx.array(random_blocks("IQ2_XXS", (2, 512), np.random.default_rng(0)))
    with pytest.raises(ValueError, match="IQ9_Z"):
        dequantize(b, "IQ9_Z")
    with pytest.raises(ValueError, match="uint8"):
        dequantize(b.astype(mx.int32), "IQ2_XXS")
    with pytest.raises(ValueError, match="multiple of 66"):
        dequantize(b[:, :100], "IQ2_XXS")
    with pytest.raises(ValueError, match="IQ2_XXS.*198 bytes"):
        ggml_matmul(mx.zeros((1, 768)), b, "IQ2_XXS")
    with pytest.raises(ValueError, match="multiple of 256"):
        row_bytes("Q6_K", 100)


# ---------------------------------------------------------------------------------------------------------------
# matmuls


@pytest.mark.parametrize("name", NAMES)
def test_matmul_chunked(name):
    K, N = cols_for(name), 37
    b = blocks_for(name, N, seed=1)
    w64 = reference(b, name).astype(np.float64)
    x = np.random.default_rng(2).standard_normal((2, 3, K)).astype(np.float32)
    ref = x.astype(np.float64) @ w64.T
    for chunk in (5 * 4 * K, 1 << 20):  # 5 rows per chunk (8 chunks), one chunk
        y = ggml_matmul(mx.array(x), mx.array(b), name, max_chunk_bytes=chunk)
        assert y.dtype == mx.float32 and y.shape == (2, 3, N)
        assert rel_err(y, ref) < 1e-5
    e = ggml_expert_matmul(mx.array(x[0]), mx.array(np.stack([b, b[::-1]])), name, 1, max_chunk_bytes=4 * 4 * K)
    assert rel_err(e, ref[0][:, ::-1]) < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_gather_matmul(name):
    K, E, N = cols_for(name), 4, 37
    b = blocks_for(name, N, seed=3, lead=(E,))
    w64 = reference(b, name).astype(np.float64)
    x = np.random.default_rng(4).standard_normal((3, 1, 1, K)).astype(np.float32)
    idx = np.array([[3, 1], [1, 1], [0, 3]], np.uint32)  # repeated, unsorted; expert 2 unused
    ref = np.einsum("tk,tjnk->tjn", x[:, 0, 0].astype(np.float64), w64[idx])[:, :, None, :]
    for chunk in (1, 1 << 22):  # one (token, expert) pair at a time, all pairs at once
        y = ggml_gather_matmul(mx.array(x), mx.array(b), name, mx.array(idx), max_chunk_bytes=chunk)
        assert y.shape == (3, 2, 1, N)
        assert rel_err(y, ref) < 1e-5


@pytest.mark.parametrize("name", ["IQ2_XXS", "Q6_K", "IQ4_NL"])
def test_matmul_dtype(name):
    K = cols_for(name)
    b = blocks_for(name, 37, seed=5)
    x = mx.array(np.random.default_rng(6).standard_normal((4, K)).astype(np.float32)).astype(mx.bfloat16)
    y = ggml_matmul(x, mx.array(b), name)
    ref = np.array(x.astype(mx.float32), np.float64) @ reference(b, name).astype(np.float64).T
    assert y.dtype == mx.bfloat16 and rel_err(y.astype(mx.float32), ref) < 1e-2


@pytest.mark.parametrize("name", ["IQ1_M", "IQ3_S", "Q3_K"])
def test_gradients_match_float_weights(name):
    K, N, E = cols_for(name), 37, 3
    b = blocks_for(name, N, seed=7, lead=(E,))
    w = mx.array(reference(b, name))  # [E, N, K] float32
    rng = np.random.default_rng(8)
    x = mx.array(rng.standard_normal((5, K)).astype(np.float32))
    c = mx.array(rng.standard_normal((5, N)).astype(np.float32))
    g = mx.grad(lambda x: (ggml_matmul(x, mx.array(b[1]), name, max_chunk_bytes=6 * 4 * K) * c).sum())(x)
    g_ref = mx.grad(lambda x: ((x @ w[1].T) * c).sum())(x)
    assert np.allclose(np.array(g), np.array(g_ref), rtol=1e-5, atol=1e-5 * float(mx.abs(g_ref).max()))

    idx = mx.array([[2, 0], [0, 0], [1, 2], [2, 1], [0, 1]], mx.uint32)
    cg = mx.array(rng.standard_normal((5, 2, 1, N)).astype(np.float32))
    xg = x[:, None, None, :]
    g = mx.grad(lambda x: (ggml_gather_matmul(x, mx.array(b), name, idx, max_chunk_bytes=1) * cg).sum())(xg)
    g_ref = mx.grad(lambda x: ((x @ w[idx].swapaxes(-1, -2)) * cg).sum())(xg)
    assert g.shape == xg.shape
    assert np.allclose(np.array(g), np.array(g_ref), rtol=1e-5, atol=1e-5 * float(mx.abs(g_ref).max()))


def test_chunk_memory_bound():
    """Only one chunk of dequantized weights is alive at a time, forward and backward: the peak (dequantization
    temporaries included) stays a few chunks, far below the whole dequantized weight."""
    name, K, N, chunk = "IQ2_XXS", 512, 2048, 1 << 18  # W is 4 MiB float32, 16 chunks of 256 KiB
    b = mx.array(random_blocks(name, (N, K), np.random.default_rng(9)))
    x = mx.array(np.random.default_rng(10).standard_normal((2, K)).astype(np.float32))
    mx.eval(b, x)
    for f in (
        lambda: ggml_matmul(x, b, name, max_chunk_bytes=chunk),
        lambda: mx.grad(lambda x: ggml_matmul(x, b, name, max_chunk_bytes=chunk).sum())(x),
    ):
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(f())
        assert mx.get_peak_memory() - base < 8 * chunk + 4 * 2 * N * 4  # ~2 MiB; 4.6-9 MiB unsequenced
