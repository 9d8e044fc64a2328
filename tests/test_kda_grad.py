"""Gradients through a whole KDA layer (projections with LoRA adapters, short conv, gates, chunked scan, gated
RMSNorm) as LoRA training uses it: the chunked path against the token-by-token recurrent path and against finite
differences, for Kimi Linear's and Kimi-K3's KDA variants, with and without left padding.
(The scan alone is checked against a float64 reference and finite differences in tests/test_kda_ops.py.)"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

import kimi_mlx.ops.kda as kda_ops
from kimi_mlx.loading import load_model
from kimi_mlx.ops.kda_recurrent import kda_recurrent
from kimi_mlx.tuner.adapters import apply_adapters, select_modules

T = 40  # > SHORT_CHUNK_T: kda_forward runs chunks of 16 with a padded tail


@pytest.fixture(scope="module", params=["kimi_linear", "kimi_k3"])
def layer(request, kl_dir, k3_dir):
    """The first KDA mixer of a fresh fixture model, LoRA on all its projections with random adapter weights."""
    path = (kl_dir if request.param == "kimi_linear" else k3_dir) / "hf"
    model, _ = load_model(path, dtype=mx.float32)
    mx.random.seed(0)
    paths = [p for p in select_modules(model, ["kda", "kda_gates"]) if ".layers.0." in p]
    apply_adapters(model, paths, rank=4, scale=2.0)
    mixer = model.layers[0].self_attn
    params = tree_flatten(mixer.trainable_parameters())
    keys = mx.random.split(mx.random.key(1), len(params))
    mixer.load_weights(
        [(k, v + 0.05 * mx.random.normal(v.shape, key=kk)) for (k, v), kk in zip(params, keys)], strict=False
    )
    mx.eval(mixer.parameters())
    return request.param, mixer


def loss_and_grads(mixer, x, mask, recurrent: bool, monkeypatch):
    """(loss, grads of the adapters, grad of x) for loss = mean(out * fixed weights)."""
    calls = []
    scan = kda_recurrent if recurrent else kda_ops.kda_chunked
    name = "kda_forward" if recurrent else "kda_chunked"  # recurrent: replace the dispatch; chunked: just count
    monkeypatch.setattr(kda_ops, name, lambda *a, **k: calls.append(a[0].shape[1]) or scan(*a, **k))
    w = mx.random.normal((*x.shape[:2], x.shape[-1]), key=mx.random.key(9))

    def loss(params, x):
        mixer.update(params)
        return (mixer(x, mask) * w).mean()

    val, (gp, gx) = mx.value_and_grad(loss, argnums=(0, 1))(mixer.trainable_parameters(), x)
    mx.eval(val, gp, gx)
    monkeypatch.undo()
    assert calls and all(t == x.shape[1] for t in calls), f"{name} not called on the whole sequence: {calls}"
    return val.item(), dict(tree_flatten(gp)), gx


def inputs(mixer, B: int = 2):
    hidden = mixer.o_proj.linear.weight.shape[0]
    return mx.random.normal((B, T, hidden), key=mx.random.key(5))


@pytest.mark.parametrize("padded", [False, True])
def test_chunked_layer_grads_match_recurrent(layer, padded, monkeypatch):
    """Loss and gradients (every adapter tensor and the layer input) of the chunked path equal the recurrent path's
    to 1e-4 relative to each gradient's scale; with left padding (3 and 0 masked steps) as well."""
    _, mixer = layer
    x = inputs(mixer)
    mask = mx.arange(T)[None, :] >= mx.array([3, 0])[:, None] if padded else None
    v_chk, g_chk, gx_chk = loss_and_grads(mixer, x, mask, False, monkeypatch)
    v_rec, g_rec, gx_rec = loss_and_grads(mixer, x, mask, True, monkeypatch)
    assert abs(v_chk - v_rec) <= 1e-5 * abs(v_rec) + 1e-7
    assert g_chk.keys() == g_rec.keys() and len(g_chk) >= 8
    for k in g_chk:
        scale = mx.abs(g_rec[k]).max().item()
        assert scale > 0, k
        assert mx.abs(g_chk[k] - g_rec[k]).max().item() <= 1e-4 * scale, k
    assert mx.abs(gx_chk - gx_rec).max().item() <= 1e-4 * mx.abs(gx_rec).max().item()
    if padded:  # padded positions of the input get exactly no gradient
        assert mx.abs(gx_chk[0, :3]).max().item() == 0.0


def test_chunked_layer_grads_match_finite_differences(layer, monkeypatch):
    """Directional derivatives along random directions in adapter space (one per adapter tensor group, plus one over
    all of them) and in input space: the chunked path's gradient . d equals the central finite difference
    (L(p + h d) - L(p - h d)) / 2h (float32, h = 1e-2, |d| = 1) to 2% of its magnitude + 0.1% of the gradient's norm
    (the float32 noise floor for directions the loss barely depends on)."""
    _, mixer = layer
    x = inputs(mixer, B=1)
    _, grads, gx = loss_and_grads(mixer, x, None, False, monkeypatch)
    w = mx.random.normal(x.shape, key=mx.random.key(9))
    base = mixer.trainable_parameters()

    def loss_at(params, x_):
        mixer.update(params)
        out = (mixer(x_, None) * w).mean().item()
        mixer.update(base)
        return out

    rng = np.random.default_rng(0)
    flat = dict(tree_flatten(base))
    names = sorted(flat)
    groups = [[n for n in names if n.endswith("lora_b")], [n for n in names if n.endswith("lora_a")], names]
    h = 1e-2
    for group in groups:
        direction = {n: mx.array(rng.standard_normal(flat[n].shape).astype(np.float32)) for n in group}
        norm = float(np.sqrt(sum((d * d).sum().item() for d in direction.values())))
        direction = {n: d / norm for n, d in direction.items()}
        analytic = sum((grads[n] * direction[n]).sum().item() for n in group)
        gnorm = float(np.sqrt(sum((grads[n] * grads[n]).sum().item() for n in group)))

        plus = dict(flat)
        minus = dict(flat)
        for n, d in direction.items():
            plus[n], minus[n] = flat[n] + h * d, flat[n] - h * d
        fd = (loss_at(tree_unflatten(list(plus.items())), x) - loss_at(tree_unflatten(list(minus.items())), x)) / (
            2 * h
        )
        assert abs(fd - analytic) <= 0.02 * abs(analytic) + 1e-3 * gnorm, (group[:2], fd, analytic, gnorm)
    dx = mx.array(rng.standard_normal(x.shape).astype(np.float32))
    dx = dx / mx.sqrt((dx * dx).sum())
    analytic = (gx * dx).sum().item()
    fd = (loss_at(base, x + h * dx) - loss_at(base, x - h * dx)) / (2 * h)
    assert abs(fd - analytic) <= 0.02 * abs(analytic) + 1e-3 * mx.sqrt((gx * gx).sum()).item(), (fd, analytic)
