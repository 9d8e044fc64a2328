"""The fused KDA recurrent Metal kernel (metal_kernels/kda_recurrent.metal) against the pure-MLX path of the same op
(``kimi_mlx.ops.kda.kda_gated``: L2 norm, gates, ``kda_forward``), run on a Metal GPU or in the CPU emulator."""

import mlx.core as mx
import numpy as np
import pytest
from metal_support import KernelBackend, assert_matches, kernels_fixture, strict_kernels_fixture  # noqa: F401

from kimi_mlx import metal
from kimi_mlx.ops.kda import RECURRENT_KERNEL_MAX_T, kda_gated
from kimi_mlx.ops.kda_recurrent_metal import kda_recurrent_metal

RECURRENT = "kimi_kda_recurrent"


def make_inputs(B, T, H, Dk, Dv, dtype, lower_bound, ragged, seed=0, gate_dtype=None):
    """Raw (unnormalised) q/k/v in ``dtype``, f/b in ``gate_dtype`` (default ``dtype``), gate parameters, a float32
    state and an optional left-pad mask (row 0 starts with two padding steps)."""
    gate_dtype = gate_dtype or dtype
    mx.random.seed(seed)
    q, k = (mx.random.normal((B, T, H, Dk)).astype(dtype) for _ in range(2))
    v = mx.random.normal((B, T, H, Dv)).astype(dtype)
    f = (2 * mx.random.normal((B, T, H, Dk))).astype(gate_dtype)
    b = mx.random.normal((B, T, H)).astype(gate_dtype)
    A_log = mx.log(mx.random.uniform(0.5, 8.0, (H,)))
    dt_bias = mx.random.normal((H * Dk,))
    state = 0.1 * mx.random.normal((B, H, Dv, Dk))
    mask = None
    if ragged:
        m = np.ones((B, T), bool)
        m[0, : min(2, T - 1)] = False
        mask = mx.array(m)
    return (q, k, v, f, b, A_log, dt_bias), {"lower_bound": lower_bound, "l2_eps": 1e-6, "state": state, "mask": mask}


CASES = {
    # name: (B, T, H, Dk, Dv, dtype, lower_bound, ragged, rows_per_group, gate dtype)
    "f32-dk64-ragged-softplus": (2, 5, 2, 64, 64, mx.float32, None, True, 4, None),
    "f32-dk128-T1-lowerbound-partial-tg": (1, 1, 3, 128, 64, mx.float32, -5.0, False, 3, None),
    "bf16-dk64-dv128-ragged-lowerbound": (2, 3, 2, 64, 128, mx.bfloat16, -5.0, True, 4, None),
    "f16-dk128-softplus-partial-tg": (1, 4, 2, 128, 96, mx.float16, None, False, 5, None),
    "bf16-qkv-f32-gates": (1, 2, 2, 64, 64, mx.bfloat16, None, False, 4, mx.float32),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_pure_path(case, kernels):
    """Output (in v's dtype) and final state: float32 within 1e-5 relative, float16/bfloat16 within 2 ulp; masked
    steps write exact zeros. Covers T = 1, ragged B = 2, Dk = 64 and 128, both decay-gate forms, Dv != Dk, gates in
    another dtype than q/k/v, inputs small enough to be bound as ``constant`` (mask, A_log) and threadgroups
    (rows_per_group 3, 5) that do not divide the Dv rows of the grid."""
    B, T, H, Dk, Dv, dtype, lb, ragged, rows, gate_dtype = CASES[case]
    args, kw = make_inputs(B, T, H, Dk, Dv, dtype, lb, ragged, gate_dtype=gate_dtype)
    with metal.disabled():
        ref_o, ref_s = kda_gated(*args, **kw)
    with kernels.active():
        o, s = kda_recurrent_metal(*args, **kw, rows_per_group=rows)
        mx.eval(o, s)
    assert o.dtype == dtype and s.dtype == mx.float32
    assert_matches(o, ref_o, f"{case} output")
    assert_matches(s, ref_s, f"{case} state")
    if ragged:
        assert not np.array(o[0, :2].astype(mx.float32)).any(), "masked steps must write zeros"
    kernels.assert_clean()


def test_fully_masked_row_keeps_state(kernels):
    """A row whose every step is masked leaves its state bit for bit and outputs zeros."""
    args, kw = make_inputs(2, 3, 2, 64, 64, mx.float32, None, False)
    kw["mask"] = mx.array([[False, False, False], [True, True, True]])
    with kernels.active():
        o, s = kda_recurrent_metal(*args, **kw)
        mx.eval(o, s)
    assert np.array_equal(np.array(s[0]), np.array(kw["state"][0]))
    assert not np.array(o[0]).any()
    kernels.assert_clean()


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_no_races_or_uninitialised_reads(lower_bound, strict_kernels):
    """Forward, reverse and random schedules give the same output and the uninitialised-memory checks stay silent
    (no diagnostics at all), on a ragged batch with a partial edge threadgroup."""
    args, kw = make_inputs(2, 2, 1, 64, 32, mx.float32, lower_bound, True)
    with metal.disabled():
        ref_o, ref_s = kda_gated(*args, **kw)
    with strict_kernels.active():
        o, s = kda_recurrent_metal(*args, **kw, rows_per_group=3)
        mx.eval(o, s)
    strict_kernels.assert_clean()
    assert_matches(o, ref_o)
    assert_matches(s, ref_s)


def test_gradients_through_the_chunked_kernel_path(kernels):
    """Past RECURRENT_KERNEL_MAX_T, kda_gated goes through kda_forward's chunked kernel; mx.grad through it gives the
    pure path's gradients too."""
    T = RECURRENT_KERNEL_MAX_T + 6
    args, kw = make_inputs(1, T, 1, 32, 32, mx.float32, None, False)
    state = kw.pop("state")
    wo = mx.array(np.random.default_rng(2).standard_normal((1, T, 1, 32)), mx.float32)

    def loss(q, v, f, st):
        o, s = kda_gated(q, args[1], v, f, *args[4:7], state=st, **kw)
        return (o * wo).sum() + s.sum()

    with metal.disabled():
        ref = mx.grad(loss, argnums=(0, 1, 2, 3))(args[0], args[2], args[3], state)
    with kernels.active():
        got = mx.grad(loss, argnums=(0, 1, 2, 3))(args[0], args[2], args[3], state)
        mx.eval(got)
        assert kernels.launched and RECURRENT not in kernels.launched, kernels.launched
    for name, g, r in zip(("q", "v", "f", "state"), got, ref):
        assert_matches(g, r, f"d loss / d {name}")


def test_thread_sanitizer_clean():
    """Under ThreadSanitizer (emulator lanes as TSan fibers; on a GPU a plain run) no data race is reported: only
    lane 0 of a SIMD-group writes an output element."""
    tsan = KernelBackend(race_check=True)
    args, kw = make_inputs(2, 2, 1, 64, 32, mx.bfloat16, -5.0, True)
    with tsan.active():
        mx.eval(kda_recurrent_metal(*args, **kw, rows_per_group=3))
    tsan.assert_clean()


def test_kda_gated_dispatch(kernels):
    """kda_gated launches the recurrent kernel for T <= RECURRENT_KERNEL_MAX_T with head dims that are multiples of
    32, and takes the pure path (no recurrent launch) for other head dims, with the same results."""
    args, kw = make_inputs(1, 2, 1, 64, 64, mx.float32, None, False)
    odd_args, odd_kw = make_inputs(1, 2, 1, 48, 48, mx.float32, None, False)
    with metal.disabled():
        ref = kda_gated(*args, **kw)
        odd_ref = kda_gated(*odd_args, **odd_kw)
    with kernels.active():
        got = kda_gated(*args, **kw)
        assert kernels.launched == [RECURRENT]
        odd = kda_gated(*odd_args, **odd_kw)
        mx.eval(got, odd)
        assert kernels.launched == [RECURRENT], "Dk = 48 must not reach the kernel"
    assert RECURRENT_KERNEL_MAX_T >= 1
    for a, r in zip(got + odd, ref + odd_ref):
        assert_matches(a, r)
    kernels.assert_clean()


def test_head_dims_not_multiple_of_32_is_an_error():
    args, kw = make_inputs(1, 1, 1, 48, 64, mx.float32, None, False)
    with pytest.raises(ValueError, match=r"multiples of 32.*Dk=48"):
        kda_recurrent_metal(*args, **kw)


def test_unsupported_dtype_is_an_error():
    args, kw = make_inputs(1, 1, 1, 64, 64, mx.float32, None, False)
    with pytest.raises(ValueError, match=r"f has dtype mlx.core.int32"):
        kda_recurrent_metal(*args[:3], args[3].astype(mx.int32), *args[4:], **kw)


def test_bad_shapes_name_the_argument():
    args, kw = make_inputs(1, 2, 2, 64, 64, mx.float32, None, False)
    bad_b = (*args[:4], args[4][:, :, :1], *args[5:])
    with pytest.raises(ValueError, match=r"b has shape \(1, 2, 1\), expected \(1, 2, 2\)"):
        kda_gated(*bad_b, **kw)
    with pytest.raises(ValueError, match=r"state has shape"):
        kda_recurrent_metal(*args, **{**kw, "state": kw["state"][:, :1]})


def test_kernel_entry_point_without_kernels_is_an_error():
    args, kw = make_inputs(1, 1, 1, 64, 64, mx.float32, None, False)
    with metal.disabled(), pytest.raises(RuntimeError, match="not enabled"):
        kda_recurrent_metal(*args, **kw)


def test_gradients_through_the_kernel_path(kernels):
    """mx.grad through kda_gated with the kernel on (training on a Mac) gives the pure path's gradients for every
    float input, state included."""
    args, kw = make_inputs(2, 3, 2, 64, 32, mx.float32, -5.0, True)
    state = kw.pop("state")
    rng = np.random.default_rng(1)
    wo, ws = (
        mx.array(rng.standard_normal((2, 3, 2, 32)), mx.float32),
        mx.array(rng.standard_normal(state.shape), mx.float32),
    )

    def loss(*arrays):
        o, s = kda_gated(*arrays[:7], state=arrays[7], **kw)
        return (o * wo).sum() + (s * ws).sum()

    argnums = tuple(range(8))
    with metal.disabled():
        ref = mx.grad(loss, argnums=argnums)(*args, state)
    with kernels.active():
        got = mx.grad(loss, argnums=argnums)(*args, state)
        mx.eval(got)
        assert RECURRENT in kernels.launched
    for name, g, r in zip(("q", "k", "v", "f", "b", "A_log", "dt_bias", "state"), got, ref):
        assert_matches(g, r, f"d loss / d {name}")
