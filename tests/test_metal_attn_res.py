"""The AttnRes mix Metal kernel (metal_kernels/attn_res_mix.metal) against the pure-MLX path of
``kimi_mlx.ops.attn_res.attn_res_mix``, run on a Metal GPU or in the CPU emulator."""

import mlx.core as mx
import numpy as np
import pytest
from metal_support import KernelBackend, assert_matches, kernels_fixture, strict_kernels_fixture  # noqa: F401

from kimi_mlx import metal
from kimi_mlx.ops.attn_res import attn_res_mix, attn_res_mix_metal, inv_rms

MIX = "kimi_attn_res_mix"
EPS = 1e-6


def make_inputs(K, B, T, d, dtype, seed=0):
    """K snapshots with very different scales (list form), their inv_rms, a partial sum and a score vector."""
    rng = np.random.default_rng(seed)
    blocks = [mx.array(rng.standard_normal((B, T, d)) * 10.0 ** rng.uniform(-1.5, 1.5), mx.float32).astype(dtype)
              for _ in range(K)]  # fmt: skip
    scales = [inv_rms(b, EPS) for b in blocks]
    partial = mx.array(rng.standard_normal((B, T, d)), mx.float32).astype(dtype)
    w_eff = mx.array(rng.standard_normal(d) * d**-0.5, mx.float32)
    return blocks, scales, partial, w_eff


CASES = {
    # name: (K, B, T, d, dtype, threads, rows_per_group)
    "K1-f32-one-row": (1, 1, 1, 64, mx.float32, None, 1),
    "K2-bf16-rows3-partial-tg": (2, 2, 5, 96, mx.bfloat16, 64, 3),
    "K8-f16-d-not-multiple-of-threads": (8, 1, 3, 200, mx.float16, 64, 2),
    "K8-f32-stacked": (8, 2, 2, 256, mx.float32, None, 1),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_pure_path(case, kernels):
    """float32 within 1e-5 relative, float16/bfloat16 within 2 ulp; K = 1, 2, 8; list and stacked snapshots;
    rows per threadgroup that do not divide the B*T rows and hidden sizes that are not a multiple of the threads."""
    K, B, T, d, dtype, threads, rows = CASES[case]
    blocks, scales, partial, w_eff = make_inputs(K, B, T, d, dtype)
    if "stacked" in case:
        blocks, scales = mx.stack(blocks), mx.stack(scales)
    with metal.disabled():
        ref = attn_res_mix(blocks, scales, partial, w_eff, EPS)
    with kernels.active():
        got = attn_res_mix_metal(blocks, scales, partial, w_eff, EPS, threads=threads, rows_per_group=rows)
        mx.eval(got)
    assert got.dtype == dtype and got.shape == partial.shape
    assert_matches(got, ref, case)
    kernels.assert_clean()


def test_no_races_or_uninitialised_reads(strict_kernels):
    """Three schedules agree and no uninitialised threadgroup/local read is reported (two SIMD-groups per row, three
    rows per threadgroup, a partial edge threadgroup)."""
    blocks, scales, partial, w_eff = make_inputs(2, 1, 4, 80, mx.float32)
    with metal.disabled():
        ref = attn_res_mix(blocks, scales, partial, w_eff, EPS)
    with strict_kernels.active():
        got = attn_res_mix_metal(blocks, scales, partial, w_eff, EPS, threads=64, rows_per_group=3)
        mx.eval(got)
    strict_kernels.assert_clean()
    assert_matches(got, ref)


def test_thread_sanitizer_clean():
    """Under ThreadSanitizer (emulator; on a GPU a plain run) the threadgroup reduction reports no data race."""
    tsan = KernelBackend(race_check=True)
    blocks, scales, partial, w_eff = make_inputs(2, 1, 4, 80, mx.float32)
    with tsan.active():
        mx.eval(attn_res_mix_metal(blocks, scales, partial, w_eff, EPS, threads=64, rows_per_group=3))
    tsan.assert_clean()


def test_dispatch(kernels):
    """attn_res_mix launches the kernel when kernels are enabled; with no snapshots it is the partial sum itself."""
    blocks, scales, partial, w_eff = make_inputs(1, 1, 2, 64, mx.float32)
    with kernels.active():
        attn_res_mix(blocks, scales, partial, w_eff, EPS)
        assert kernels.launched == [MIX]
        alone = attn_res_mix([], [], partial, w_eff, EPS)
        assert kernels.launched == [MIX]
    assert np.array_equal(np.array(alone), np.array(partial))


def test_bad_arguments_are_errors():
    blocks, scales, partial, w_eff = make_inputs(2, 1, 2, 64, mx.float32)
    with pytest.raises(ValueError, match="block shapes"):
        attn_res_mix([blocks[0][:, :1], blocks[1]], scales, partial, w_eff, EPS)
    with pytest.raises(ValueError, match="block_inv_rms shapes"):
        attn_res_mix(blocks, scales[:1], partial, w_eff, EPS)
    with pytest.raises(ValueError, match=r"w_eff shape \(32,\), expected \(64,\)"):
        attn_res_mix(blocks, scales, partial, w_eff[:32], EPS)
    with pytest.raises(ValueError, match="multiple of 32"):
        attn_res_mix_metal(blocks, scales, partial, w_eff, EPS, kernel=lambda **kw: None, threads=48)
    with pytest.raises(ValueError, match="partial has dtype mlx.core.int32"):
        attn_res_mix_metal(blocks, scales, partial.astype(mx.int32), w_eff, EPS, kernel=lambda **kw: None)
    with pytest.raises(ValueError, match="at least one block"):
        attn_res_mix_metal([], [], partial, w_eff, EPS, kernel=lambda **kw: None)


def test_gradients_through_the_kernel_path(kernels):
    """mx.grad through attn_res_mix with the kernel on gives the pure path's gradients (snapshots, partial, w_eff)."""
    blocks, scales, partial, w_eff = make_inputs(2, 1, 3, 64, mx.float32)
    wo = mx.array(np.random.default_rng(1).standard_normal(partial.shape), mx.float32)

    def loss(raw, part, w):
        return (attn_res_mix(raw, mx.stack([inv_rms(b, EPS) for b in raw]), part, w, EPS) * wo).sum()

    with metal.disabled():
        ref = mx.grad(loss, argnums=(0, 1, 2))(mx.stack(blocks), partial, w_eff)
    with kernels.active():
        got = mx.grad(loss, argnums=(0, 1, 2))(mx.stack(blocks), partial, w_eff)
        mx.eval(got)
        assert kernels.launched == [MIX]
    for name, g, r in zip(("blocks", "partial", "w_eff"), got, ref):
        assert_matches(g, r, f"d loss / d {name}")
