"""Routed-expert fast path (sorted, one dense matmul per expert) against mlx-lm's SwitchGLU."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from ggml_random import random_blocks
from mlx_lm.models.switch_layers import SwitchGLU

from kimi_mlx.config import KimiConfig
from kimi_mlx.layers import moe
from kimi_mlx.layers.moe import (
    SORTED_MIN_PAIRS,
    SparseMoE,
    sorted_switch_glu,
    switch_glu,
)

E, K, HIDDEN, INTER = 8, 2, 64, 32
# Two paths to the same result (sorted vs SwitchGLU, quantized_matmul vs dequantize + matmul, compiled, gradients):
# max difference relative to the result's largest entry. Measured 0 on the CPU, where both paths run the same float32
# kernels; other backends may accumulate in another order (about 1e-7 relative per rounding).
PATH_TOL = 2e-6


def _switch(quantized: bool) -> SwitchGLU:
    mx.random.seed(1)
    sw = SwitchGLU(HIDDEN, INTER, E)
    if quantized:
        nn.quantize(sw, group_size=32, bits=4, mode="affine")
    mx.eval(sw.parameters())
    return sw


def _inputs(n_tokens: int, skip=(3, 6)):
    """x [1, n, HIDDEN] and top-K indices [1, n, K] that never pick the experts in ``skip``."""
    mx.random.seed(n_tokens)
    x = mx.random.normal((1, n_tokens, HIDDEN))
    logits = mx.random.normal((1, n_tokens, E))
    logits[..., list(skip)] = -1e9
    inds = mx.argpartition(-logits, kth=K - 1, axis=-1)[..., :K].astype(mx.uint32)
    return x, inds


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4-affine"])
@pytest.mark.parametrize("n_tokens", [3, SORTED_MIN_PAIRS // K + 37])
def test_sorted_path_matches_switchglu(quantized, n_tokens):
    """sorted_switch_glu == SwitchGLU (float32 and 4-bit affine, up to float32 rounding), for a token count below
    and above the dispatch threshold, with two experts that receive no tokens."""
    sw = _switch(quantized)
    x, inds = _inputs(n_tokens)
    assert not np.isin(np.array(inds), [3, 6]).any()
    ref = sw(x, inds)
    out = sorted_switch_glu(sw, x, inds)
    assert out.shape == ref.shape == (1, n_tokens, K, HIDDEN)
    assert float(mx.abs(out - ref).max()) <= PATH_TOL * float(mx.abs(ref).max())


def test_quantized_dequant_and_qmm_branches(monkeypatch):
    """4-bit experts give SwitchGLU's result both through quantized_matmul (few rows) and dequantize+matmul."""
    sw = _switch(True)
    x, inds = _inputs(200)
    ref = sw(x, inds)
    for rows in (1, 10**9):
        monkeypatch.setattr(moe, "DEQUANT_MIN_ROWS", rows)
        out = sorted_switch_glu(sw, x, inds)
        assert float(mx.abs(out - ref).max()) <= PATH_TOL * float(mx.abs(ref).max())


def test_dispatch_threshold(monkeypatch):
    """switch_glu takes the sorted path from SORTED_MIN_PAIRS pairs on, SwitchGLU below; decode (1 token) never sorts."""
    sw = _switch(False)
    calls = []
    real = moe.sorted_switch_glu
    monkeypatch.setattr(moe, "sorted_switch_glu", lambda *a: calls.append(1) or real(*a))
    below, above = SORTED_MIN_PAIRS // K - 1, SORTED_MIN_PAIRS // K
    for n, expect in ((1, 0), (below, 0), (above, 1)):
        calls.clear()
        x, inds = _inputs(n)
        out = switch_glu(sw, x, inds)
        assert len(calls) == expect, n
        assert float(mx.abs(out - sw(x, inds)).max()) <= PATH_TOL  # outputs are below 1 in size


@pytest.mark.parametrize("kind", ["float32", "q4-affine", "lora", "ggml"])
def test_gpu_dispatch(monkeypatch, kind):
    """On a GPU backend switch_glu runs SwitchGLU (its sorted gather_mm / gather_qmm is one segmented matmul per
    projection there) for float, MLX-quantized and LoRA-wrapped experts at any pair count, and keeps the sorted path
    for GGML blocks; the result is SwitchGLU's either way."""
    from mlx_lm.tuner.lora import LoRASwitchLinear

    from kimi_mlx.layers.ggml import to_ggml

    sw = _switch(kind == "q4-affine")
    if kind == "lora":
        sw.gate_proj = LoRASwitchLinear.from_base(sw.gate_proj, r=4)
        sw.gate_proj.lora_b = mx.random.normal(sw.gate_proj.lora_b.shape) * 0.1
    if kind == "ggml":
        to_ggml(sw, {"gate_proj": "IQ4_NL"})
        sw.gate_proj.weight = mx.array(random_blocks("IQ4_NL", (E, INTER, HIDDEN), np.random.default_rng(0)))
    mx.eval(sw.parameters())
    calls = []
    real = moe.sorted_switch_glu
    monkeypatch.setattr(moe, "sorted_switch_glu", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(moe, "_on_gpu", lambda: True)
    x, inds = _inputs(SORTED_MIN_PAIRS // K + 37)
    out = switch_glu(sw, x, inds)
    assert len(calls) == (kind == "ggml")
    ref = sw(x, inds)
    assert float(mx.abs(out - ref).max()) <= PATH_TOL * float(mx.abs(ref).max())


def test_compile_falls_back():
    """Inside mx.compile (no host reads) switch_glu falls back to SwitchGLU and still gives the same result."""
    sw = _switch(False)
    x, inds = _inputs(100)
    out = mx.compile(lambda a, b: switch_glu(sw, a, b))(x, inds)
    assert float(mx.abs(out - sw(x, inds)).max()) <= PATH_TOL  # outputs are below 1 in size


def _gradients(sw: SwitchGLU, n_tokens: int = 100):
    """Gradients of a fixed weighted sum of the routed output w.r.t. (the trainable parameters, the input), through
    SwitchGLU and through the sorted path: (reference, sorted)."""
    x, inds = _inputs(n_tokens)
    w = mx.random.normal((1, n_tokens, K, HIDDEN))

    def loss(params, x, fn):
        sw.update(params)
        return (fn(sw, x, inds) * w).sum()

    params = sw.trainable_parameters()
    ref = mx.grad(loss, argnums=(0, 1))(params, x, lambda s, a, b: s(a, b))
    return ref, mx.grad(loss, argnums=(0, 1))(params, x, sorted_switch_glu)


def test_gradients_match():
    """The sorted path is differentiable: gradients w.r.t. the input and the expert weights equal SwitchGLU's."""
    g_ref, g_new = _gradients(_switch(False))
    assert float(mx.abs(g_ref[1] - g_new[1]).max()) <= PATH_TOL * float(mx.abs(g_ref[1]).max())
    for name in ("gate_proj", "up_proj", "down_proj"):
        a, b = g_ref[0][name]["weight"], g_new[0][name]["weight"]
        assert float(mx.abs(a - b).max()) <= PATH_TOL * float(mx.abs(a).max())


def test_lora_gradients_match():
    """Per-expert LoRA adapters (mlx-lm's LoRASwitchLinear on every projection) through the sorted path: the output
    and the gradients w.r.t. every lora_a / lora_b stack and the input equal SwitchGLU's."""
    from mlx_lm.tuner.lora import LoRASwitchLinear

    sw = _switch(False)
    for name in ("gate_proj", "up_proj", "down_proj"):
        lora = LoRASwitchLinear.from_base(getattr(sw, name), r=4)
        lora.lora_b = mx.random.normal(lora.lora_b.shape) * 0.1  # nonzero, so lora_a gets a gradient too
        setattr(sw, name, lora)
    sw.freeze()
    sw.unfreeze(keys=["lora_a", "lora_b"])
    x, inds = _inputs(100)
    ref, out = sw(x, inds), sorted_switch_glu(sw, x, inds)
    assert float(mx.abs(out - ref).max()) <= PATH_TOL * float(mx.abs(ref).max())
    g_ref, g_new = _gradients(sw)
    assert float(mx.abs(g_ref[1] - g_new[1]).max()) <= PATH_TOL * float(mx.abs(g_ref[1]).max())
    for name in ("gate_proj", "up_proj", "down_proj"):
        for key in ("lora_a", "lora_b"):
            a, b = g_ref[0][name][key], g_new[0][name][key]
            assert a.shape == b.shape and float(mx.abs(a).max()) > 0
            assert float(mx.abs(a - b).max()) <= PATH_TOL * float(mx.abs(a).max()), (name, key)


def test_sparse_moe_uses_route_and_matches():
    """SparseMoE output (prefill-sized input, sorted path) equals route() + SwitchGLU + weighted sum + shared expert."""
    cfg = KimiConfig(
        vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        rms_norm_eps=1e-5, kda_layers=[0], kda_num_heads=1, kda_head_dim=16, short_conv_kernel_size=4,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_experts=E,
        num_experts_per_token=K, moe_intermediate_size=INTER, num_shared_experts=1, routed_scaling_factor=2.5,
    )
    mx.random.seed(3)
    layer = SparseMoE(cfg)
    layer.e_score_correction_bias = mx.random.normal((E,)) * 0.1
    x = mx.random.normal((2, 50, HIDDEN))
    inds, weights = moe.route(layer.gate(x), layer.e_score_correction_bias, K, 1, 1, True, 2.5)
    ref = (layer.switch_mlp(x, inds) * weights[..., None]).sum(-2) + layer.shared_experts(x)
    assert float(mx.abs(layer(x) - ref).max()) <= PATH_TOL * float(mx.abs(ref).max())


def _route_reference(logits, bias, top_k, n_group, topk_group, renormalize, scaling):
    """HF KimiMoEGate routing, written out in float64 numpy for one token."""
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    choice = scores + bias
    if n_group > 1 and topk_group < n_group:
        groups = choice.reshape(n_group, -1)
        group_score = np.sort(groups, axis=-1)[:, -2:].sum(-1)
        keep = np.argsort(-group_score)[:topk_group]
        masked = np.full_like(groups, -np.inf)
        masked[keep] = groups[keep]
        choice = masked.reshape(-1)
    idx = np.argsort(-choice)[:top_k]
    w = scores[idx]
    if renormalize and top_k > 1:
        w = w / (w.sum() + 1e-20)
    return set(idx.tolist()), dict(zip(idx.tolist(), w * scaling))


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (4, 2), (8, 3)])
def test_route_matches_reference(n_group, topk_group):
    """route(): selection by sigmoid + correction bias (within the kept expert groups), weights = unbiased sigmoid
    scores renormalised then scaled -- equal to a float64 reference of HF's gate for 64 random tokens."""
    from kimi_mlx.layers.moe import route

    rng = np.random.default_rng(3)
    E, k = 32, 4
    logits = rng.standard_normal((64, E)).astype(np.float32)
    bias = (0.3 * rng.standard_normal(E)).astype(np.float32)
    inds, weights = route(mx.array(logits), mx.array(bias), k, n_group, topk_group, True, 2.446)
    for t in range(64):
        ref_idx, ref_w = _route_reference(logits[t], bias, k, n_group, topk_group, True, 2.446)
        got = np.array(inds[t]).tolist()
        assert set(got) == ref_idx, f"token {t}"
        for e, w in zip(got, np.array(weights[t]).tolist()):
            assert abs(w - ref_w[e]) < 1e-6, f"token {t} expert {e}"  # measured 1.5e-7: ~1 ulp of weights up to 2.4
