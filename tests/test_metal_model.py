"""Tiny Kimi Linear and Kimi-K3 (the float32 reference checkpoints) with the Metal kernels patched in give the same
logits as the pure-MLX forward: a plain prefill, and a ragged left-padded batch prefill followed by a decode step
through the cache. Kernels run on a Metal GPU or in the CPU emulator."""

import mlx.core as mx
import numpy as np
import pytest
from metal_support import kernels_fixture  # noqa: F401  (fixture)

from kimi_mlx import metal

TOL = 1e-4
ARCHS = {"kimi_linear": ("kl_model", {"kimi_kda_recurrent"}), "kimi_k3": ("k3_model", {"kimi_kda_recurrent", "kimi_attn_res_mix"})}  # fmt: skip


def _forward(model):
    """A cacheless single-sequence prefill; the same prefill through a cache and one decode step; a ragged batch
    prefill [2, 6] (row 1 left-padded by 2) and one decode step. Returns the float32 logits of each call."""
    rng = np.random.default_rng(0)
    vocab = 512  # both reference checkpoints
    prompt = mx.array(rng.integers(1, vocab, (2, 6)))
    prompt[1, :2] = 0
    outs = [model(prompt[:1, :5])]
    single = model.make_cache()  # no padding: the decode step takes the layer's compiled path (on a GPU)
    outs.append(model(prompt[:1, :5], cache=single))
    outs.append(model(prompt[:1, 5:], cache=single))
    cache = model.make_cache(left_padding=[0, 2])
    outs.append(model(prompt, cache=cache))
    outs.append(model(mx.array(rng.integers(1, vocab, (2, 1))), cache=cache))
    mx.eval(outs)
    return [o.astype(mx.float32) for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_model_forward_with_kernels_matches_pure(arch, kernels, request):
    fixture, expected_kernels = ARCHS[arch]
    model = request.getfixturevalue(fixture)
    with metal.disabled():
        ref = _forward(model)
    with kernels.active():
        got = _forward(model)
    assert expected_kernels <= set(kernels.launched), f"kernels launched: {sorted(set(kernels.launched))}"
    names = ("prefill", "cached prefill", "decode", "ragged prefill", "ragged decode")
    assert len(got) == len(ref) == len(names)
    for name, g, r in zip(names, got, ref):
        assert g.shape == r.shape
        err = float(mx.abs(g - r).max())
        assert err <= TOL, f"{arch} {name}: max |logit difference| {err:.3g} > {TOL}"
    kernels.assert_clean()
