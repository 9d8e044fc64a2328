"""Tests for the KDA scans (kimi_mlx.ops.kda_recurrent, kda_chunked and the dispatcher kimi_mlx.ops.kda): recurrent /
chunked scans against a float64 numpy reference (spec §1.3, §1.4)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.ops import kda as kda_mod
from kimi_mlx.ops import kda_chunked as chunked_mod
from kimi_mlx.ops.kda import kda_forward
from kimi_mlx.ops.kda_chunked import kda_chunked
from kimi_mlx.ops.kda_recurrent import kda_recurrent

# Relative to the max abs of the reference; measured up to 2.5e-7 (float32 scans vs the float64 reference).
TOL = 1e-6


# ---------------------------------------------------------------------------------------------------------------------
# float64 reference (fla naive_recurrent_kda semantics, written from the math) and input generators


def ref_kda(q, k, v, g, beta, state=None, mask=None):
    """Token-by-token float64 reference. Shapes as the ops; state [B, H, Dv, Dk]. Returns (o, final state)."""
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    # fla orientation S[B, H, Dk, Dv]
    S = np.zeros((B, H, Dk, Dv)) if state is None else np.asarray(state, np.float64).swapaxes(-1, -2).copy()
    o = np.zeros((B, T, H, Dv))
    for t in range(T):
        live = np.ones(B, bool) if mask is None else np.asarray(mask)[:, t].astype(bool)
        Sp = np.exp(g[:, t])[..., None] * S  # S' = diag(exp g) S
        pred = np.einsum("bhkv,bhk->bhv", Sp, k[:, t])  # S'^T k
        Sn = Sp + beta[:, t, :, None, None] * np.einsum("bhk,bhv->bhkv", k[:, t], v[:, t] - pred)
        ot = np.einsum("bhkv,bhk->bhv", Sn, q[:, t])
        S = np.where(live[:, None, None, None], Sn, S)
        o[:, t] = np.where(live[:, None, None], ot, 0.0)
    return o, S.swapaxes(-1, -2)


def softplus(x):
    return np.logaddexp(0.0, x)


def make_inputs(rng, B, T, H, Dk, Dv, extreme=False, with_state=True):
    """Realistic inputs: L2-normalised q (scaled by Dk^-0.5) and k, g = -exp(A_log) * softplus(f).

    extreme=True: exp(A_log) up to ~200 on some heads and some steps at exactly -1000 (per-step decay exp(-1000) = 0).
    """
    q = rng.standard_normal((B, T, H, Dk))
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * Dk**-0.5
    k = rng.standard_normal((B, T, H, Dk))
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    v = rng.standard_normal((B, T, H, Dv))
    f = rng.standard_normal((B, T, H, Dk)) * 2.0 - 1.0
    if extreme:
        rate = np.exp(rng.uniform(np.log(0.5), np.log(201.0), H))
        rate[0] = 201.0  # ~max(exp(A_log)) seen in Kimi Linear
    else:
        rate = np.exp(rng.uniform(-4.0, 0.0, H))  # mild decay so long-range terms matter
    g = -rate[:, None] * softplus(f)
    if extreme:
        g[:, ::7] = -1000.0
        if T > 3:
            g[:, 3, :, : Dk // 2] = -1000.0
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))
    state = rng.standard_normal((B, H, Dv, Dk)) * 0.5 if with_state else None
    arrs = [x.astype(np.float32) for x in (q, k, v, g, beta)]
    return arrs, (None if state is None else state.astype(np.float32))


def to_mx(arrs, state):
    return [mx.array(x) for x in arrs], (None if state is None else mx.array(state))


def rel_err(x, ref):
    x = np.asarray(x, dtype=np.float64)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30))


def assert_close(o, S, ref_o, ref_S, tol=TOL):
    o, S = np.array(o), np.array(S)
    assert np.isfinite(o).all() and np.isfinite(S).all()
    assert rel_err(o, ref_o) <= tol, rel_err(o, ref_o)
    assert rel_err(S, ref_S) <= tol, rel_err(S, ref_S)


PATHS = {
    "recurrent": kda_recurrent,
    "chunked16": lambda *a, **kw: kda_chunked(*a, chunk_size=16, **kw),
    "chunked64": lambda *a, **kw: kda_chunked(*a, chunk_size=64, **kw),
    "chunked8": lambda *a, **kw: kda_chunked(*a, chunk_size=8, **kw),
    "forward": kda_forward,
}


# ---------------------------------------------------------------------------------------------------------------------
# forward accuracy


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("extreme", [False, True])
def test_matches_float64_reference(path, extreme):
    """Every path matches the float64 reference to TOL (relative to max |ref|) on outputs and final state, with an
    initial state, T = 77 (not a multiple of any chunk size), and (extreme=True) exp(A_log) up to 201 and steps at
    exactly -1000; no NaN/Inf."""
    rng = np.random.default_rng(1 + extreme)
    arrs, state = make_inputs(rng, 2, 77, 3, 32, 16, extreme=extreme)
    ref_o, ref_S = ref_kda(*arrs, state=state)
    a, s = to_mx(arrs, state)
    o, S = PATHS[path](*a, state=s)
    assert o.shape == (2, 77, 3, 16) and S.shape == (2, 3, 16, 32) and S.dtype == mx.float32
    assert_close(o, S, ref_o, ref_S)


def test_long_sequence_chunked_vs_reference():
    """Many chunks (T = 300, default chunk size) with Dk != Dv and zero initial state: state carried across chunks
    and groups of chunks matches the reference."""
    rng = np.random.default_rng(3)
    arrs, _ = make_inputs(rng, 1, 300, 2, 16, 24, extreme=True, with_state=False)
    ref_o, ref_S = ref_kda(*arrs)
    a, _ = to_mx(arrs, None)
    C = kda_mod.DEFAULT_CHUNK_SIZE
    old = chunked_mod.GROUP_ELEMS
    try:
        chunked_mod.GROUP_ELEMS = 1  # one chunk per group: exercises the group loop
        o1, S1 = kda_chunked(*a, chunk_size=C)
    finally:
        chunked_mod.GROUP_ELEMS = old
    o2, S2 = kda_chunked(*a, chunk_size=C)
    assert_close(o1, S1, ref_o, ref_S)
    assert_close(o2, S2, ref_o, ref_S)


@pytest.mark.parametrize("path", ["recurrent", "chunked16", "chunked64"])
def test_left_padding_ragged_batch(path):
    """B = 2 ragged batch with left padding (0 and 9 pad tokens): matches the masked reference, pad positions output
    exactly 0, and the padded row equals running the unpadded sequence on its own."""
    rng = np.random.default_rng(4)
    T, pad = 40, 9
    arrs, state = make_inputs(rng, 2, T, 2, 16, 16, extreme=True)
    mask = np.ones((2, T), bool)
    mask[1, :pad] = False
    ref_o, ref_S = ref_kda(*arrs, state=state, mask=mask)
    a, s = to_mx(arrs, state)
    o, S = PATHS[path](*a, state=s, mask=mx.array(mask))
    assert_close(o, S, ref_o, ref_S)
    assert (np.array(o)[1, :pad] == 0).all()
    # The padded row alone, without its padding.
    solo = [x[1:2, pad:] for x in arrs]
    o_solo, S_solo = PATHS[path](*[mx.array(x) for x in solo], state=mx.array(state[1:2]))
    np.testing.assert_allclose(np.array(o)[1:2, pad:], np.array(o_solo), atol=1e-6, rtol=1e-6)  # measured 7e-9
    np.testing.assert_allclose(np.array(S)[1:2], np.array(S_solo), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("path", ["recurrent", "chunked16"])
def test_masked_steps_leave_state_untouched(path):
    """Masked steps at arbitrary positions write zero output and leave the state exactly as it was: the result
    equals the reference on the sequence with those steps deleted, and an all-masked input returns the initial
    state bit-for-bit with all-zero output."""
    rng = np.random.default_rng(5)
    T = 37
    arrs, state = make_inputs(rng, 2, T, 2, 16, 8, extreme=False)
    mask = rng.random((2, T)) > 0.3
    mask[0, -1] = False  # trailing masked step too
    a, s = to_mx(arrs, state)
    o, S = PATHS[path](*a, state=s, mask=mx.array(mask))
    o, S = np.array(o), np.array(S)
    assert (o[~mask] == 0).all()
    for b in range(2):
        keep = mask[b]
        ro, rS = ref_kda(*[x[b : b + 1, keep] for x in arrs], state=state[b : b + 1])
        assert rel_err(o[b : b + 1, keep], ro) <= TOL
        assert rel_err(S[b : b + 1], rS) <= TOL

    none = mx.zeros((2, T), dtype=mx.bool_)
    o0, S0 = PATHS[path](*a, state=s, mask=none)
    assert (np.array(o0) == 0).all()
    assert np.array_equal(np.array(S0), state)


# ---------------------------------------------------------------------------------------------------------------------
# edge cases and dtypes


@pytest.mark.parametrize("path", list(PATHS))
def test_single_token_and_empty_state(path):
    """T = 1 with state=None (zeros) and with a given state, plus T = 5 from an empty state, all match the
    reference."""
    rng = np.random.default_rng(6)
    for T, with_state in [(1, False), (1, True), (5, False)]:
        arrs, state = make_inputs(rng, 2, T, 2, 16, 8, extreme=True, with_state=with_state)
        ref_o, ref_S = ref_kda(*arrs, state=state)
        a, s = to_mx(arrs, state)
        o, S = PATHS[path](*a, state=s)
        assert o.shape == (2, T, 2, 8) and S.shape == (2, 2, 8, 16)
        assert_close(o, S, ref_o, ref_S)


@pytest.mark.parametrize("path", ["recurrent", "chunked16", "forward"])
def test_bf16_inputs_give_float32_state(path):
    """bf16 q/k/v/beta (and bf16 initial state) are computed in float32: state is float32, output is v.dtype (bf16),
    and both match the float64 reference on the bf16-rounded inputs (output to bf16 precision)."""
    rng = np.random.default_rng(7)
    arrs, state = make_inputs(rng, 1, 20, 2, 16, 16)
    q, k, v, g, beta = (mx.array(x) for x in arrs)
    qb, kb, vb, bb = (x.astype(mx.bfloat16) for x in (q, k, v, beta))
    sb = mx.array(state).astype(mx.bfloat16)
    o, S = PATHS[path](qb, kb, vb, g, bb, state=sb)
    assert S.dtype == mx.float32 and o.dtype == mx.bfloat16
    rounded = [np.array(x.astype(mx.float32)) for x in (qb, kb, vb, g, bb)]
    ref_o, ref_S = ref_kda(*rounded, state=np.array(sb.astype(mx.float32)))
    assert rel_err(np.array(S), ref_S) <= TOL
    assert rel_err(np.array(o.astype(mx.float32)), ref_o) <= 7e-3  # measured 2.4e-3: the output's rounding to bf16


def test_forward_dispatch_threshold():
    """kda_forward (recurrent up to RECURRENT_MAX_T, chunk 8 below SHORT_CHUNK_T, DEFAULT_CHUNK_SIZE above) agrees
    with the recurrent path on both sides of each switch point."""
    rng = np.random.default_rng(8)
    r, c = kda_mod.RECURRENT_MAX_T, kda_mod.SHORT_CHUNK_T
    for T in (r, r + 1, c - 1, c):
        arrs, state = make_inputs(rng, 1, T, 2, 16, 16)
        a, s = to_mx(arrs, state)
        o, S = kda_forward(*a, state=s)
        o2, S2 = kda_recurrent(*a, state=s)
        np.testing.assert_allclose(np.array(o), np.array(o2), atol=1e-6)  # measured 3e-8
        np.testing.assert_allclose(np.array(S), np.array(S2), atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# gradients


def _loss_fn(fn, W, WS, mask):
    def loss(q, k, v, g, beta, state):
        o, S = fn(q, k, v, g, beta, state=state, mask=mask)
        return (o * W).sum() + (S * WS).sum()

    return loss


def _ref_loss(arrs, state, W, WS, mask):
    o, S = ref_kda(*arrs, state=state, mask=mask)
    return float((o * W).sum() + (S * WS).sum())


@pytest.mark.parametrize("extreme", [False, True])
def test_grad_chunked_matches_recurrent(extreme):
    """Gradients of a scalar loss (outputs and final state, with left padding and an initial state) w.r.t. q, k, v,
    g, beta and the state agree between the chunked and recurrent paths, and are finite even with -1000 steps."""
    rng = np.random.default_rng(10 + extreme)
    B, T, H, Dk, Dv = 2, 37, 2, 16, 8
    arrs, state = make_inputs(rng, B, T, H, Dk, Dv, extreme=extreme)
    mask = mx.array(np.arange(T)[None, :] >= np.array([[0], [6]]))
    W = mx.array(rng.standard_normal((B, T, H, Dv)).astype(np.float32))
    WS = mx.array(rng.standard_normal((B, H, Dv, Dk)).astype(np.float32))
    a, s = to_mx(arrs, state)
    argnums = tuple(range(6))
    g_rec = mx.grad(_loss_fn(kda_recurrent, W, WS, mask), argnums=argnums)(*a, s)
    chunked = lambda *x, **kw: kda_chunked(*x, chunk_size=16, **kw)  # noqa: E731
    val, g_chk = mx.value_and_grad(_loss_fn(chunked, W, WS, mask), argnums=argnums)(*a, s)
    assert np.isfinite(val.item())
    for name, gr, gc in zip(["q", "k", "v", "g", "beta", "state"], g_rec, g_chk):
        gr, gc = np.array(gr), np.array(gc)
        assert np.isfinite(gc).all() and np.isfinite(gr).all(), name
        scale = max(np.abs(gr).max(), 1e-6)
        assert np.abs(gr - gc).max() / scale <= 1.5e-6, name  # measured 4.6e-7
    # masked steps get no gradient
    pad = ~np.array(mask)
    for gc in g_chk[:5]:
        assert (np.array(gc)[pad] == 0).all()


@pytest.mark.parametrize("path", ["chunked8", "recurrent"])
def test_grad_matches_float64_finite_differences(path):
    """MLX gradients (float32) match central finite differences of the float64 reference loss (eps = 1e-6) on a few
    perturbed entries of q, k, v, g, beta and the initial state, to 1e-6 relative to each gradient's scale. Chunk 8
    with T = 19 covers several chunks plus a padded tail."""
    rng = np.random.default_rng(12)
    B, T, H, Dk, Dv = 1, 19, 2, 8, 4
    arrs, state = make_inputs(rng, B, T, H, Dk, Dv, extreme=False)
    arrs[3] = arrs[3] * 10.0  # stronger decay so g-gradients are substantial
    W = rng.standard_normal((B, T, H, Dv)).astype(np.float32)
    WS = rng.standard_normal((B, H, Dv, Dk)).astype(np.float32)
    a, s = to_mx(arrs, state)
    grads = mx.grad(_loss_fn(PATHS[path], mx.array(W), mx.array(WS), None), argnums=tuple(range(6)))(*a, s)
    grads = [np.array(x) for x in grads]
    base = [x.astype(np.float64) for x in arrs] + [state.astype(np.float64)]
    eps = 1e-6
    for idx, name in enumerate(["q", "k", "v", "g", "beta", "state"]):
        scale = np.abs(grads[idx]).max()
        assert scale > 0, name
        flat_choices = rng.choice(base[idx].size, size=4, replace=False)
        for flat in flat_choices:
            pos = np.unravel_index(flat, base[idx].shape)
            plus = [x.copy() for x in base]
            minus = [x.copy() for x in base]
            plus[idx][pos] += eps
            minus[idx][pos] -= eps
            fd = (_ref_loss(plus[:5], plus[5], W, WS, None) - _ref_loss(minus[:5], minus[5], W, WS, None)) / (2 * eps)
            # measured 2.3e-7 (the float32 gradient's rounding; the float64 difference quotient is far closer)
            assert abs(grads[idx][pos] - fd) <= 1e-6 * scale, (name, pos, grads[idx][pos], fd)


def test_grad_finite_with_extreme_decay_steps():
    """With per-step g at exactly -1000, g = 0 and tiny g, plus exp(A_log) = 201 heads, value_and_grad through
    kda_forward (chunked, T = 70) is finite everywhere, and the forward still matches the reference."""
    rng = np.random.default_rng(13)
    arrs, state = make_inputs(rng, 1, 70, 2, 16, 16, extreme=True)
    arrs[3][0, 10] = 0.0
    arrs[3][0, 11] = -1e-8
    arrs[3][0, 40:45] = -1000.0
    ref_o, ref_S = ref_kda(*arrs, state=state)
    a, s = to_mx(arrs, state)

    def loss(q, k, v, g, beta, st):
        o, S = kda_forward(q, k, v, g, beta, state=st)
        return (o * o).sum() + (S * S).sum()

    val, grads = mx.value_and_grad(loss, argnums=tuple(range(6)))(*a, s)
    assert np.isfinite(val.item())
    for gr in grads:
        assert np.isfinite(np.array(gr)).all()
    assert_close(*kda_forward(*a, state=s), ref_o, ref_S)
