"""Blockwise MLA attention (ops/mla_attention.py): equals the fused single-block path, bounds prefill memory."""

import mlx.core as mx
import pytest

import kimi_mlx.ops.mla_attention as mla_ops
from kimi_mlx.cache import MLALatentCache
from kimi_mlx.models.kimi_linear import attention_mask

FUSED = 10**9  # a key block larger than any cache here: the fused path the layer had before blockwise attention


def mla_layers(model):
    return [layer.self_attn for layer in model.layers if not layer.is_linear]


def set_key_block(model, key_block: int) -> None:
    for attn in mla_layers(model):
        attn.key_block = key_block


def layer_chunk(attn, x, prefix: int, left_padding, key_block: int) -> mx.array:
    """The layer's output for x[:, prefix:] after x[:, :prefix] went into a fresh latent cache."""
    attn.key_block = key_block
    cache = MLALatentCache(None if left_padding is None else mx.array(left_padding))
    T = x.shape[1] - prefix
    if prefix:
        attn(x[:, :prefix], attention_mask(prefix, 0, cache.left_padding), cache)
    return attn(x[:, prefix:], attention_mask(T, prefix, cache.left_padding), cache)


@pytest.mark.parametrize("absorbed_max", [0, 10**6], ids=["expanded", "absorbed"])
@pytest.mark.parametrize(
    "prefix,T,left_padding",
    [
        (0, 40, None),  # prefill from empty, 3 blocks, the last partial
        (16, 16, None),  # exactly 2 full blocks
        (63, 1, None),  # decode over 4 blocks
        (64, 1, None),  # decode over 5 blocks, the last with one key
        (33, 7, None),  # chunk straddling a block boundary
        (100, 37, [0, 29]),  # ragged batch: bool mask, one row's first blocks entirely padding
        (70, 1, [5, 40]),  # ragged decode
        (8, 9, [3, 0]),  # 2 blocks, padding inside the first
    ],
)
@pytest.mark.parametrize("arch_name", ["kl_model", "k3_model"])
def test_layer_blockwise_equals_fused(request, arch_name, prefix, T, left_padding, absorbed_max, monkeypatch):
    model = request.getfixturevalue(arch_name)
    attn = mla_layers(model)[0]
    monkeypatch.setattr(mla_ops, "ABSORBED_MAX_QUERIES", absorbed_max)
    B = 1 if left_padding is None else len(left_padding)
    x = mx.random.normal((B, prefix + T, model.args.hidden_size), key=mx.random.key(prefix * 1000 + T))
    try:
        ref = layer_chunk(attn, x, prefix, left_padding, FUSED)
        out = layer_chunk(attn, x, prefix, left_padding, 16)
    finally:
        attn.key_block = mla_ops.KEY_BLOCK
    err = mx.abs(out - ref).max().item()
    assert err <= 1e-5 * max(1.0, mx.abs(ref).max().item()), err

