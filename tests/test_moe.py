"""Routed-expert fast path (sorted, one dense matmul per expert) against mlx-lm's SwitchGLU."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

from kimi_mlx.config import KimiLinearConfig
from kimi_mlx.layers import moe
from kimi_mlx.layers.moe import SORTED_MIN_PAIRS, SparseMoE, sorted_switch_glu, switch_glu

E, K, HIDDEN, INTER = 8, 2, 64, 32


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
    """sorted_switch_glu == SwitchGLU (f32 <= 1e-5; 4-bit affine within float rounding), for a token count below
    and above the dispatch threshold, with two experts that receive no tokens."""
    sw = _switch(quantized)
    x, inds = _inputs(n_tokens)
    assert not np.isin(np.array(inds), [3, 6]).any()
    ref = sw(x, inds)
    out = sorted_switch_glu(sw, x, inds)
    assert out.shape == ref.shape == (1, n_tokens, K, HIDDEN)
    tol = 1e-5 if not quantized else 1e-4 * float(mx.abs(ref).max())
    assert float(mx.abs(out - ref).max()) <= tol


def test_quantized_dequant_and_qmm_branches(monkeypatch):
    """4-bit experts give SwitchGLU's result both through quantized_matmul (few rows) and dequantize+matmul."""
    sw = _switch(True)
    x, inds = _inputs(200)
    ref = sw(x, inds)
    for rows in (1, 10**9):
        monkeypatch.setattr(moe, "DEQUANT_MIN_ROWS", rows)
        out = sorted_switch_glu(sw, x, inds)
        assert float(mx.abs(out - ref).max()) <= 1e-4 * float(mx.abs(ref).max())


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
        assert float(mx.abs(out - sw(x, inds)).max()) <= 1e-5


def test_compile_falls_back():
    """Inside mx.compile (no host reads) switch_glu falls back to SwitchGLU and still gives the same result."""
    sw = _switch(False)
    x, inds = _inputs(100)
    out = mx.compile(lambda a, b: switch_glu(sw, a, b))(x, inds)
    assert float(mx.abs(out - sw(x, inds)).max()) <= 1e-5


def test_gradients_match():
    """The sorted path is differentiable: gradients w.r.t. the input and the expert weights equal SwitchGLU's."""
    sw = _switch(False)
    x, inds = _inputs(100)
    w = mx.random.normal((1, 100, K, HIDDEN))

    def loss(params, x, fn):
        sw.update(params)
        return (fn(sw, x, inds) * w).sum()

    params = sw.trainable_parameters()
    g_ref = mx.grad(loss, argnums=(0, 1))(params, x, lambda s, a, b: s(a, b))
    g_new = mx.grad(loss, argnums=(0, 1))(params, x, sorted_switch_glu)
    assert float(mx.abs(g_ref[1] - g_new[1]).max()) <= 1e-4
    for name in ("gate_proj", "up_proj", "down_proj"):
        a, b = g_ref[0][name]["weight"], g_new[0][name]["weight"]
        assert float(mx.abs(a - b).max()) <= 1e-4 * max(1.0, float(mx.abs(a).max()))


def test_sparse_moe_uses_route_and_matches():
    """SparseMoE output (prefill-sized input, sorted path) equals route() + SwitchGLU + weighted sum + shared expert."""
    cfg = KimiLinearConfig(
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
    assert float(mx.abs(layer(x) - ref).max()) <= 1e-5
