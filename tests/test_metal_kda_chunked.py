"""The KDA chunked-prefill Metal kernels (``metal_kernels/kda_chunked_prep.metal`` + ``kda_chunked_scan.metal`` via
``kimi_mlx.ops.kda_chunked_metal``) against the pure-MLX chunked and recurrent paths.

Runs the kernels on a Metal GPU when there is one, else in the CPU emulator (``tests/metal_support.py``). The op-level
tests use the strict emulator checks (forward / reverse / random schedules, uninitialised threadgroup memory and
locals), one test the ThreadSanitizer build, the gradient and model tests the default checks; no launch may report a
diagnostic. Shapes are tiny: each (dtypes, chunk, Dk, Dv, H) is one emulator compile per kernel.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from metal_support import KernelBackend, assert_matches
from metal_support import kernels_fixture, strict_kernels_fixture  # noqa: F401  (pytest fixtures)
from test_kda_ops import make_inputs

from kimi_mlx import metal
from kimi_mlx.ops import kda_chunked as chunked_mod
from kimi_mlx.ops.kda import kda_forward
from kimi_mlx.ops.kda_chunked import intra_chunk, kda_chunked
from kimi_mlx.ops.kda_recurrent import kda_recurrent, mask_gates
from kimi_mlx.ops.kda_chunked_metal import (
    PREP_KERNEL,
    SCAN_KERNEL,
    kda_chunked_metal,
    prep_slabs,
    prep_threadgroup_bytes,
)


def inputs(seed, B, T, H, Dk, Dv, dtype=mx.float32, extreme=False, pad=(0,)):
    """(q, k, v, g, beta, state, mask) as mx arrays; q/k/v in ``dtype``; row b left-padded with ``pad[b]`` tokens."""
    arrs, state = make_inputs(np.random.default_rng(seed), B, T, H, Dk, Dv, extreme=extreme)
    q, k, v, g, beta = (mx.array(x) for x in arrs)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    mask = np.ones((B, T), bool)
    for b, p in enumerate(pad):
        mask[b, :p] = False
    return q, k, v, g, beta, mx.array(state), mx.array(mask)


def run_both(backend, args, chunk_size, simdgroups=4):
    """(kernel o, kernel state), (pure chunked o, state) with the same chunk size, (recurrent o, state)."""
    with backend.active():
        got = kda_chunked_metal(*args, chunk_size=chunk_size, simdgroups=simdgroups)
        mx.eval(got)
    with metal.disabled():
        chunked = kda_chunked(*args, chunk_size=chunk_size)
        recurrent = kda_recurrent(*args)
        mx.eval(chunked, recurrent)
    return got, chunked, recurrent


def scan_launches(backend) -> int:
    """Launches of the scan kernel recorded by the test backend (GPU or emulator); each follows one prep launch."""
    names = [n for n in backend.launched if n in (f"kimi_{PREP_KERNEL}", f"kimi_{SCAN_KERNEL}")]
    assert names == [f"kimi_{PREP_KERNEL}", f"kimi_{SCAN_KERNEL}"] * (len(names) // 2), names
    return len(names) // 2


def check(backend, got, chunked, recurrent, launches=1):
    """Outputs and final state match both pure paths (fp32 1e-5 relative / half types 2 ulp); clean emulator run."""
    o, S = got
    assert o.dtype == chunked[0].dtype and S.dtype == mx.float32
    assert np.isfinite(np.array(o.astype(mx.float32))).all() and np.isfinite(np.array(S)).all()
    assert_matches(o, chunked[0], "output vs pure chunked")
    assert_matches(S, chunked[1], "state vs pure chunked")
    assert_matches(S, recurrent[1], "state vs recurrent")
    if o.dtype == mx.float32:
        assert_matches(o, recurrent[0], "output vs recurrent")
    assert scan_launches(backend) == launches, backend.launched
    backend.assert_clean()


# (B, T, H, Dk, Dv, chunk, left pads per row, SIMD-groups per threadgroup): T not a multiple of the chunk, T < chunk,
# ragged batches, Dk = Dv = 128, Dk != Dv, threadgroups that do not divide the Dv / 8 tiles, the largest chunk.
SHAPES = {
    "ragged_T21_C8_tg3": (2, 21, 2, 64, 64, 8, (0, 5), 3),
    "T5_lt_chunk": (1, 5, 2, 64, 64, 8, (0,), 4),
    "ragged_T37_C16": (2, 37, 2, 64, 64, 16, (3, 11), 4),
    "Dk128_Dv128_tg3": (1, 19, 1, 128, 128, 8, (0,), 3),
    "T70_C32_Dv96_tg5": (2, 70, 1, 64, 96, 32, (0, 37), 5),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_float32_matches_pure_paths(strict_kernels, name):
    """float32: kernel = pure chunked path = recurrent path to 1e-5 (relative to max |ref|) on outputs and final
    state, with an initial state and left-padding masks; masked positions output exactly 0."""
    B, T, H, Dk, Dv, C, pad, tg = SHAPES[name]
    args = inputs(1, B, T, H, Dk, Dv, pad=pad)
    got, chunked, recurrent = run_both(strict_kernels, args, C, tg)
    check(strict_kernels, got, chunked, recurrent)
    o = np.array(got[0])
    assert (o[~np.array(args[-1])] == 0).all()


# (Dk, Dv, chunk, prep SIMD-groups, BK, BV): two slabs of Dk with 3 SIMD-groups (rows 0..7 shared unevenly); the
# real head dims at the default chunk, one slab of 128 channels.
PREP_ALONE = {"Dk64_C8_sg3_two_slabs": (64, 64, 8, 3, 32, 64), "Dk128_C16_sg4": (128, 128, 16, 4, 128, 128)}


@pytest.mark.parametrize("name", list(PREP_ALONE))
def test_prep_kernel_equals_intra_chunk(strict_kernels, name):
    """The prep kernel alone, on a window [t0, t1) of a ragged batch with masked steps inside it and a partial last
    chunk, writes the same wq / uo / kg / decay as the pure ``kda_chunked.intra_chunk`` on the masked, padded window."""
    Dk, Dv, C, sg, BK, BV = PREP_ALONE[name]
    q, k, v, g, beta, _, _ = inputs(13, 2, 29 + C, 2, Dk, Dv, extreme=True)
    mask = np.random.default_rng(13).random((2, 29 + C)) > 0.3
    t0, t1 = 3, 22 + C
    N = -(-(t1 - t0) // C)
    with strict_kernels.active():
        got = metal.kernel(PREP_KERNEL)(
            inputs=[q, k, v, g, beta, mx.array(mask), 29 + C, t0, t1],
            template=[("QT", q.dtype), ("KT", k.dtype), ("VT", v.dtype), ("C", C), ("Dk", Dk), ("Dv", Dv), ("H", 2),
                      ("SG", sg), ("BK", BK), ("BV", BV)],  # fmt: skip
            grid=(32 * sg, N, 4),
            threadgroup=(32 * sg, 1, 1),
            output_shapes=[(N, 2, 2, 2 * C, Dk), (N, 2, 2, 2 * C, Dv), (N, 2, 2, C, Dk), (N, 2, 2, Dk)],
            output_dtypes=[mx.float32] * 4,
        )
        mx.eval(got)
    live = mx.array(mask[:, t0:t1])
    gw, bw = mask_gates(g[:, t0:t1], beta[:, t0:t1], live)
    pad = N * C - (t1 - t0)

    def chunks(x):  # [2, t1 - t0, 2, D] -> [N * 2 * 2, C, D], padded with zeros, chunk-major
        x = mx.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)])
        return x.reshape(2, N, C, 2, -1).transpose(1, 0, 3, 2, 4).reshape(N * 4, C, -1)

    ref = intra_chunk(
        *(chunks(x) for x in (q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], gw)), chunks(bw[..., None])[..., 0]
    )
    for name, a, r in zip(("wq", "uo", "kg", "decay"), got, ref):
        assert_matches(a, r.reshape(a.shape), name)
    strict_kernels.assert_clean()


def test_prep_threadgroup_memory_at_real_sizes():
    """Kimi-Linear-48B and K3 (Dk = Dv = 128): the prep kernel's slabs and threadgroup bytes at every chunk size
    the host takes, by hand: 4 (3 C (C + 4) + C + 3 C (BK + 4)) bytes within Metal's 32 KB; one slab (inputs read
    once) at C = 8 and 16, slabs of 32 channels at C = 32 (64 would need 40,064 bytes)."""
    assert prep_slabs(8, 128, 128) == (128, 128) and prep_threadgroup_bytes(8, 128) == 4 * (288 + 8 + 3168) == 13856
    assert prep_slabs(16, 128, 128) == (128, 128)
    assert prep_threadgroup_bytes(16, 128) == 4 * (960 + 16 + 6336) == 29248
    assert prep_slabs(32, 128, 128) == (32, 64) and prep_threadgroup_bytes(32, 32) == 4 * (3456 + 32 + 3456) == 27776
    assert prep_threadgroup_bytes(32, 64) == 40064 > metal.MAX_THREADGROUP_MEMORY == 32768
    assert max(prep_threadgroup_bytes(C, prep_slabs(C, 128, 128)[0]) for C in (8, 16, 32)) <= 32768


# Dk = Dv = 128 (both models' KDA heads), 2 heads, ragged batch, T not a multiple of the chunk:
# (chunk, prep SIMD-groups, q/k/v dtype, fast-decaying heads with steps at g = -1000).
REAL_DIMS = {
    "C8_sg4": (8, 4, mx.float32, False),
    "C16_sg4_fast_decay": (16, 4, mx.float32, True),
    "C16_sg3_bf16": (16, 3, mx.bfloat16, False),
    "C32_sg8_four_slabs": (32, 8, mx.float32, False),
}


@pytest.mark.parametrize("name", list(REAL_DIMS))
def test_real_head_dims(strict_kernels, name):
    """At Dk = Dv = 128 and every chunk size the host takes (SIMD-group counts that do and do not divide the rows
    of a chunk; bf16 inputs; decays down to exp(-1000)): kernels = both pure paths under the strict checks; the prep
    launch is grid (32 SG, N, B H), threadgroup (32 SG, 1, 1) with ``prep_threadgroup_bytes`` of threadgroup
    memory."""
    C, sg, dtype, extreme = REAL_DIMS[name]
    args = inputs(14, 2, 2 * C + 5, 2, 128, 128, dtype=dtype, extreme=extreme, pad=(0, 7))
    with strict_kernels.active():
        got = kda_chunked_metal(*args, chunk_size=C, prep_simdgroups=sg)
        mx.eval(got)
    with metal.disabled():
        chunked = kda_chunked(*args, chunk_size=C)
        recurrent = kda_recurrent(*args)
    check(strict_kernels, got, chunked, recurrent)
    assert strict_kernels.grids[0] == (32 * sg, 3, 4) and strict_kernels.threadgroups[0] == (32 * sg, 1, 1)
    if strict_kernels.name == "emulator":
        BK = prep_slabs(C, 128, 128)[0]
        assert [r.stats["threadgroup_bytes"] for n, r in strict_kernels.results if n == f"kimi_{PREP_KERNEL}"] == [
            prep_threadgroup_bytes(C, BK)
        ]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_inputs_within_two_ulp(strict_kernels, dtype):
    """bf16 / fp16 q, k, v (ragged batch, T not a multiple of the chunk): output in v's dtype within 2 ulp of the
    pure chunked path, float32 state within 1e-5 of both pure paths."""
    args = inputs(2, 2, 21, 2, 64, 64, dtype=dtype, pad=(0, 7))
    got, chunked, recurrent = run_both(strict_kernels, args, 8, 3)
    assert got[0].dtype == dtype
    check(strict_kernels, got, chunked, recurrent)


def test_fast_decaying_heads_stay_finite(strict_kernels):
    """exp(A_log) up to 201 and steps at exactly g = -1000 (per-step decay exp(-1000) = 0), ragged batch: finite
    and equal to both pure paths (the intra-chunk decays are products of exp(g <= 0), as in the pure path)."""
    args = inputs(3, 2, 29, 2, 64, 64, extreme=True, pad=(0, 4))
    got, chunked, recurrent = run_both(strict_kernels, args, 8, 4)
    check(strict_kernels, got, chunked, recurrent)


def test_masked_steps_anywhere(strict_kernels):
    """Masked steps at arbitrary positions (not only left padding), including a chunk's last token and the sequence's
    last token: identity steps on the state with zero output, as in both pure paths."""
    q, k, v, g, beta, state, _ = inputs(9, 2, 27, 2, 64, 64, extreme=True)
    mask = np.random.default_rng(9).random((2, 27)) > 0.35
    mask[0, [7, 15, 26]] = False
    got, chunked, recurrent = run_both(strict_kernels, (q, k, v, g, beta, state, mx.array(mask)), 8, 4)
    check(strict_kernels, got, chunked, recurrent)
    assert (np.array(got[0])[~mask] == 0).all()


def test_strided_inputs(strict_kernels):
    """q/k/v as slices of one fused [.., 3 * 64] projection and g, beta as transposed views (not row-contiguous):
    same result as the pure paths."""
    q, k, v, g, beta, state, mask = inputs(11, 2, 21, 2, 64, 64, pad=(0, 5))
    qkv = mx.concatenate([q, k, v], axis=-1)
    g_t, beta_t = mx.contiguous(g.transpose(0, 2, 1, 3)), mx.contiguous(beta.transpose(0, 2, 1))
    args = (qkv[..., :64], qkv[..., 64:128], qkv[..., 128:], g_t.transpose(0, 2, 1, 3), beta_t.transpose(0, 2, 1))
    got, chunked, recurrent = run_both(strict_kernels, (*args, state, mask), 8, 3)
    check(strict_kernels, got, chunked, recurrent)


@pytest.mark.parametrize("Dk, prep_sg, slab", [(32, 4, None), (64, 3, 32)], ids=["one_slab", "two_slabs"])
def test_thread_sanitizer_finds_no_race(Dk, prep_sg, slab):
    """Both kernels under the emulator's ThreadSanitizer build (lanes as TSan fibers; barriers and SIMD collectives
    the only happens-before edges), on a tiny ragged batch with partial threadgroups, the prep kernel with one slab
    of Dk and with two (its barriers before a slab is restaged): no report, same results. The schedules cannot see a
    missing barrier between plain threadgroup writes and a SIMD-group matrix load by another SIMD-group (every
    thread reaches the load before any load resolves); this build does."""
    backend = KernelBackend(race_check=True)
    args = inputs(10, 2, 11, 1, Dk, 32, pad=(0, 3))
    with backend.active():
        got = kda_chunked_metal(*args, chunk_size=8, simdgroups=3, prep_simdgroups=prep_sg, prep_slab=slab)
        mx.eval(got)
    with metal.disabled():
        chunked = kda_chunked(*args, chunk_size=8)
        recurrent = kda_recurrent(*args)
    check(backend, got, chunked, recurrent)


def test_state_carried_across_launches(strict_kernels, monkeypatch):
    """With one chunk per group (kda_chunked.GROUP_ELEMS = 1) each chunk is its own launch; the state handed from launch
    to launch gives the same result as the pure paths."""
    monkeypatch.setattr(chunked_mod, "GROUP_ELEMS", 1)
    args = inputs(4, 2, 21, 2, 64, 64, pad=(0, 9))
    got, chunked, recurrent = run_both(strict_kernels, args, 8, 4)
    check(strict_kernels, got, chunked, recurrent, launches=3)


def test_all_masked_and_empty(strict_kernels):
    """An all-masked batch returns the initial state bit for bit and zero outputs; T = 0 launches nothing."""
    q, k, v, g, beta, state, _ = inputs(5, 2, 11, 2, 64, 64)
    with strict_kernels.active():
        o, S = kda_chunked_metal(q, k, v, g, beta, state, mx.zeros((2, 11), dtype=mx.bool_), chunk_size=8)
        o0, S0 = kda_chunked_metal(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], state, chunk_size=8)
        mx.eval(o, S, o0, S0)
    assert (np.array(o) == 0).all() and np.array_equal(np.array(S), np.array(state))
    assert o0.shape == (2, 0, 2, 64) and np.array_equal(np.array(S0), np.array(state))
    strict_kernels.assert_clean()


def test_gradients_are_the_pure_paths(kernels, monkeypatch):
    """mx.value_and_grad through the kernels (two launches per group: GROUP_ELEMS = 1) gives the pure path's loss and
    gradients for q, k, v, g, beta and the initial state (the op's VJP is the pure path's)."""
    monkeypatch.setattr(chunked_mod, "GROUP_ELEMS", 1)
    args = inputs(12, 2, 19, 2, 64, 64, pad=(0, 6))
    mask = args[-1]
    W = mx.array(np.random.default_rng(12).standard_normal(64).astype(np.float32))

    def loss(fn):
        def f(*a):
            o, S = fn(*a, mask=mask, chunk_size=8)
            return (o * W).sum() + (S * S).sum()

        return f

    argnums = tuple(range(6))
    with kernels.active():
        val, grads = mx.value_and_grad(loss(kda_chunked_metal), argnums=argnums)(*args[:-1])
        mx.eval(val, grads)
    with metal.disabled():
        ref_val, ref_grads = mx.value_and_grad(loss(kda_chunked), argnums=argnums)(*args[:-1])
    assert scan_launches(kernels) == 3
    assert abs(val.item() - ref_val.item()) <= 1e-5 * abs(ref_val.item())
    for name, got, ref in zip("q k v g beta state".split(), grads, ref_grads):
        assert_matches(got, ref, f"d loss / d {name}")
    kernels.assert_clean()


def test_disabled_falls_back_to_pure_path():
    """Without enabled kernels (CPU default device here, or metal.disabled()) the op is the pure chunked path."""
    args = inputs(6, 1, 12, 2, 32, 32)
    with metal.disabled():
        o, S = kda_chunked_metal(*args, chunk_size=8)
        ro, rS = kda_chunked(*args, chunk_size=8)
    assert np.array_equal(np.array(o), np.array(ro)) and np.array_equal(np.array(S), np.array(rS))


@pytest.mark.parametrize(
    "Dk, Dv, chunk, tg, dtype, match",
    [
        (48, 64, 8, 4, mx.float32, r"multiples of 32.*Dk=48"),
        (64, 40, 8, 4, mx.float32, r"multiples of 32.*Dv=40"),
        (64, 64, 12, 4, mx.float32, "chunk_size must be 8, 16 or 32"),
        (64, 64, 4, 4, mx.float32, "chunk_size must be 8, 16 or 32"),
        (64, 64, 64, 4, mx.float32, "chunk_size must be 8, 16 or 32"),
        (64, 64, 8, 0, mx.float32, "simdgroups"),
        (64, 64, 8, 4, mx.int32, "v dtype"),
        (64, 64, 8, (4, 0, None), mx.float32, "prep_simdgroups"),
        (128, 64, 8, (4, 4, 48), mx.float32, r"prep_slab must be a multiple of 32 dividing Dk=128, got 48"),
        (96, 64, 8, (4, 4, 64), mx.float32, r"prep_slab must be a multiple of 32 dividing Dk=96, got 64"),
    ],
)
def test_bad_input_errors(Dk, Dv, chunk, tg, dtype, match):
    """Unsupported head dims, chunk sizes, threadgroup widths, slabs and dtypes are clear ValueErrors before any
    launch (``tg``: scan SIMD-groups, or (scan, prep SIMD-groups, prep slab))."""
    q = mx.zeros((1, 9, 1, Dk))
    v = mx.zeros((1, 9, 1, Dv), dtype=dtype)
    sg, prep_sg, slab = tg if isinstance(tg, tuple) else (tg, 4, None)
    with pytest.raises(ValueError, match=match):
        kda_chunked_metal(q, q, v, q, mx.zeros((1, 9, 1)), chunk_size=chunk, simdgroups=sg, prep_simdgroups=prep_sg,
                          prep_slab=slab)  # fmt: skip


def test_kda_forward_dispatches_to_kernel(strict_kernels):
    """kda_forward (the model's entry point) runs the kernel for a chunked-length input when kernels are enabled, and
    matches its own pure path; Dk not a multiple of 32 keeps the pure path even with kernels enabled."""
    args = inputs(7, 2, 40, 2, 64, 64, pad=(0, 13))
    with strict_kernels.active():
        got = kda_forward(*args)
        odd = kda_forward(*inputs(8, 1, 40, 1, 48, 32))
        mx.eval(got, odd)
    with metal.disabled():
        ref = kda_forward(*args)
    assert scan_launches(strict_kernels) == 1
    assert_matches(got[0], ref[0], "output")
    assert_matches(got[1], ref[1], "state")
    strict_kernels.assert_clean()


def test_model_prefill_with_kernel_matches_pure(kernels, arch):
    """A tiny Kimi Linear and a tiny Kimi-K3 forward over 70 tokens (past the recurrent kernel's range, so every KDA
    layer prefills through these kernels; K3 with its lower-bound gate) give the pure-MLX logits to 1e-4."""
    _, _, manifest, model = arch
    tokens = mx.array((list(manifest["token_ids"]) * 3)[:70])[None]
    with kernels.active():
        got = model(tokens)
        mx.eval(got)
    with metal.disabled():
        ref = model(tokens)
    assert scan_launches(kernels) == len(model.args.kda_layers) > 0
    err = float(mx.abs(got - ref).max() / mx.abs(ref).max())
    assert err <= 1e-4, err
    kernels.assert_clean()
