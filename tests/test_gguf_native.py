"""GGUF tensors in block types MLX has no layout for (IQ*, Q6_K, Q3_K, Q2_K) load as GGML-block layers that keep the
file's bytes and compute exactly (issue 15). Reference: the same model loaded from a twin GGUF whose tensors are
gguf-py's F32 dequantization of the same blocks.

The tiny fixtures' expert widths (32, K3's latent 128) are below the 256-wide super-blocks of most IQ types, so
``_wide_pair`` rewrites them with 256-wide experts (metadata and tensors, random values).
"""

import warnings
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import K3_FIXTURE, KL_FIXTURE
from ggml_random import random_blocks
from metal_support import kernels_fixture  # noqa: F401  (the kernels fixture)
from test_gguf_load import _file, _logits, _manifest, _rewrite
from test_gguf_quant import make

import kimi_mlx
from kimi_mlx.layers.ggml import GGML_LAYERS

T = gguf.GGMLQuantizationType

# arch prefix, metadata overrides, old -> new widths of the routed-expert tensors (expert FFN 32 -> 256; K3's latent
# 128 -> 256 and its two shared experts' 64 -> 512)
WIDE = {
    KL_FIXTURE: ("kimi-linear", {"expert_feed_forward_length": 256}, {32: 256}),
    K3_FIXTURE: ("kimi-k3", {"expert_feed_forward_length": 256, "expert_latent_length": 256},
                 {32: 256, 128: 256, 64: 512}),
}
EXPERT_TENSORS = ("_exps.weight", "_shexp.weight", "ffn_routed_down.weight", "ffn_routed_up.weight",
                  "ffn_routed_norm.weight")

# tensor name suffix -> GGML type, per fixture
NATIVE_TYPES = {
    KL_FIXTURE: {"ffn_gate_exps.weight": "IQ2_XXS", "ffn_up_exps.weight": "IQ3_XXS", "ffn_down_exps.weight": "IQ1_S",
                 "ffn_down_shexp.weight": "Q3_K", "ffn_up_shexp.weight": "Q2_K", "token_embd.weight": "IQ1_M",
                 "output.weight": "Q6_K"},
    K3_FIXTURE: {"ffn_gate_exps.weight": "IQ4_NL", "ffn_up_exps.weight": "IQ2_S", "ffn_down_exps.weight": "IQ2_XS",
                 "ffn_routed_up.weight": "IQ3_S", "ffn_routed_down.weight": "IQ4_XS", "output.weight": "Q6_K"},
}


def _shape(t) -> tuple[int, ...]:
    return tuple(int(x) for x in reversed(t.shape))


def _wide_pair(d: Path, tmp: Path, types: dict) -> tuple[Path, Path, int]:
    """(GGUF with ``types`` stored as GGML blocks, its F32 twin, bytes of those block tensors) from the F32 fixture
    with 256-wide routed experts."""
    arch, meta, widths = WIDE[d]
    src = _file(d, "F32")
    rng = np.random.default_rng(0)
    raw, floats, block_bytes = {}, {}, 0
    for t in gguf.GGUFReader(str(src)).tensors:
        shape = _shape(t)
        values = None
        if t.name.endswith(EXPERT_TENSORS):
            shape = tuple(widths.get(n, n) for n in shape)
            norm = t.name.endswith("norm.weight")
            values = (1.0 if norm else 0.0) + rng.normal(0, 0.1 if norm else 0.05, shape).astype(np.float32)
        name = next((v for k, v in types.items() if t.name == k or t.name.endswith("." + k)), None)
        if name is not None:
            blocks = random_blocks(name, shape, rng)
            raw[t.name] = (T[name], blocks)
            block_bytes += blocks.nbytes
            values = gguf.quants.dequantize(blocks, T[name]).reshape(shape)
        if values is not None:
            floats[t.name] = values
    meta = {f"{arch}.{k}": (v, gguf.GGUFValueType.UINT32, None) for k, v in meta.items()}
    return (_rewrite(src, tmp / "blocks.gguf", raw=raw, replace=floats, meta=meta),
            _rewrite(src, tmp / "f32.gguf", replace=floats, meta=meta), block_bytes)


def _load_quiet(path: Path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # native types load without any warning
        return kimi_mlx.load(str(path), dtype=mx.float32, **kw)[0]


def _ggml_layers(model) -> dict[str, nn.Module]:
    return {p: m for p, m in model.named_modules() if isinstance(m, GGML_LAYERS)}


@pytest.mark.parametrize("d", [KL_FIXTURE, K3_FIXTURE], ids=["kimi_linear", "kimi_k3"])
def test_native_blocks_match_their_f32_twin(tmp_path, d):
    """IQ experts, K-quant shared experts, an IQ embedding and a Q6_K head: the logits of a prompt (prefill: the
    sorted per-expert path) and of decode steps (gathered experts) within 1e-4 of the F32 twin's; the block layers
    hold exactly the file's bytes (<= 1.02x asked)."""
    blocks, twin, block_bytes = _wide_pair(d, tmp_path, NATIVE_TYPES[d])
    model, ref = _load_quiet(blocks), _load_quiet(twin)
    held = _ggml_layers(model)
    assert {m.ggml_type for m in held.values()} == set(NATIVE_TYPES[d].values())
    assert {m["weight"].dtype for m in held.values()} == {mx.uint8}
    assert sum(m["weight"].nbytes for m in held.values()) == block_bytes, "block layers hold the GGUF bytes exactly"
    ids = _manifest(d)["token_ids"]
    got, want = _logits(model, ids), _logits(ref, ids)
    assert np.abs(want).max() > 0.1
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
    cache, ref_cache = model.make_cache(), ref.make_cache()
    model(mx.array([ids[:5]]), cache=cache)
    ref(mx.array([ids[:5]]), cache=ref_cache)
    for t in ids[5:9]:
        step = model(mx.array([[t]]), cache=cache)[0, -1]
        ref_step = ref(mx.array([[t]]), cache=ref_cache)[0, -1]
        assert mx.abs(step - ref_step).max().item() <= 1e-4


def test_q4_k_m_mix_matches_its_f32_twin(tmp_path):
    """llama.cpp's Q4_K_M mix on the Kimi Linear fixture: Q4_K for most matrices (Q5_0 where the width is not a
    multiple of 256), Q8_0 for the embedding and the MLA down-projection, Q6_K for the head, the KDA value projection
    and the dense FFN down-projection: logits within 1e-4 of the F32 twin, no warning."""
    src = _file(KL_FIXTURE, "F32")
    raw, floats = {}, {}
    for i, t in enumerate(gguf.GGUFReader(str(src)).tensors):
        shape = _shape(t)
        if len(shape) < 2 or not t.name.endswith(".weight") or "norm" in t.name or "conv1d" in t.name:
            continue
        if t.name.endswith(("ffn_gate_inp.weight", "ssm_beta.weight", "attn_k_b.weight", "attn_v_b.weight")):
            continue  # the router and small per-head tensors stay float, as in llama.cpp's mixes
        if t.name == "output.weight" or t.name.endswith((".attn_v.weight", ".ffn_down.weight")):
            qtype = T.Q6_K
        elif t.name == "token_embd.weight" or t.name.endswith(".attn_kv_a_mqa.weight"):
            qtype = T.Q8_0
        else:
            qtype = T.Q4_K if shape[-1] % 256 == 0 else T.Q5_0
        blocks, values = make(qtype, shape, seed=i)
        raw[t.name] = (qtype, blocks)
        floats[t.name] = values
    types = {q for q, _ in raw.values()}
    assert types == {T.Q4_K, T.Q5_0, T.Q8_0, T.Q6_K}
    model = _load_quiet(_rewrite(src, tmp_path / "q4_k_m.gguf", raw=raw))
    ref = _load_quiet(_rewrite(src, tmp_path / "f32.gguf", replace=floats))
    assert {m.ggml_type for m in _ggml_layers(model).values()} == {"Q6_K"}
    ids = _manifest(KL_FIXTURE)["token_ids"]
    assert np.abs(_logits(model, ids) - _logits(ref, ids)).max() <= 1e-4


def test_requantize_is_the_opt_in_lossy_path(tmp_path):
    """``requantize=True`` still converts the block types to MLX affine (warned with bytes and error); without it
    the same file loads with no MLX-quantized expert at all."""
    blocks, _, _ = _wide_pair(KL_FIXTURE, tmp_path, {"ffn_gate_exps.weight": "IQ2_XXS", "output.weight": "Q6_K"})
    with pytest.warns(UserWarning, match=r"IQ2_XXS re-quantized to MLX affine 3-bit.*max abs error"):
        model, _ = kimi_mlx.load(str(blocks), dtype=mx.float32, requantize=True)
    assert not _ggml_layers(model)
    native = _ggml_layers(_load_quiet(blocks))
    assert sorted(m.ggml_type for m in native.values()) == ["IQ2_XXS"] * 3 + ["Q6_K"]


def test_native_model_with_metal_kernels(tmp_path, kernels):
    """The Kimi Linear model with IQ / Q6_K block layers, every kernel on (real Metal or the emulator): prefill and a
    decode step equal the pure path within 1e-4 (the GGML kernels, the KDA and MLA kernels all launched)."""
    blocks, _, _ = _wide_pair(KL_FIXTURE, tmp_path, NATIVE_TYPES[KL_FIXTURE])
    model = _load_quiet(blocks)
    ids = mx.array([_manifest(KL_FIXTURE)["token_ids"][:12]])

    def run():
        cache = model.make_cache()
        prefill = model(ids, cache=cache)
        return prefill, model(ids[:, -1:], cache=cache)

    with kernels.active():
        got = run()
        mx.eval(got)
    with kimi_mlx.metal.disabled():
        want = run()
    assert {"kimi_ggml_matvec", "kimi_ggml_dequant"} <= set(kernels.launched)
    for g, w in zip(got, want):
        assert mx.abs(g - w).max().item() <= 1e-4
    kernels.assert_clean()


def _residual_dtypes(model, ids: mx.array) -> list:
    """The dtype of the residual stream after the embedding and after each decoder layer (a prefill, no cache)."""
    from kimi_mlx.models.kimi_linear import layer_masks

    text = model.model
    stream = text.new_stream(text.embed_tokens(ids))
    kda_mask, attn_mask = layer_masks(ids.shape[1], None)
    dtypes = [stream.h.dtype]
    for layer in text.layers:
        stream = layer(stream, kda_mask if layer.is_linear else attn_mask, None)
        dtypes.append(stream.h.dtype)
    return dtypes


def test_block_embedding_keeps_a_bfloat16_model_in_bfloat16(tmp_path):
    """A bfloat16 model with an IQ1_M embedding (GGML blocks): the embedding returns bfloat16, so the residual stream
    stays bfloat16 through every layer (a float32 embedding would promote all of it to float32, twice the activation
    bytes). Logits: within 0.05 of the same model's F32 twin loaded in bfloat16 (MLX's own bfloat16 path: the same
    rows rounded to bfloat16; measured 0.0195, the block layers accumulate in float32 where MLX's bfloat16 matmuls
    round), and as far from the float32 logits as that twin is from its own (bfloat16's error, measured on this
    fixture: max 0.747 and mean 0.0154 for both, on logits of std 0.40). Loaded from a converted MLX directory, the
    same. """
    blocks, twin, _ = _wide_pair(KL_FIXTURE, tmp_path, NATIVE_TYPES[KL_FIXTURE])
    ids = _manifest(KL_FIXTURE)["token_ids"]
    model = kimi_mlx.load(str(blocks), dtype=mx.bfloat16)[0]
    assert type(model.model.embed_tokens).__name__ == "GGMLEmbedding"
    assert set(_residual_dtypes(model, mx.array([ids]))) == {mx.bfloat16}
    got, exact = _logits(model, ids), _logits(kimi_mlx.load(str(blocks), dtype=mx.float32)[0], ids)
    ref = _logits(kimi_mlx.load(str(twin), dtype=mx.bfloat16)[0], ids)
    ref_exact = _logits(kimi_mlx.load(str(twin), dtype=mx.float32)[0], ids)
    assert np.abs(got - ref).max() <= 0.05
    twin_error = np.abs(ref - ref_exact)
    assert np.abs(got - exact).max() <= 1.1 * twin_error.max()
    assert np.abs(got - exact).mean() <= 1.1 * twin_error.mean()

    from kimi_mlx.cli.convert import convert
    from test_ggml_convert_lora import _args

    out = convert(_args(blocks, tmp_path / "out"))
    converted = kimi_mlx.load(out, dtype=mx.bfloat16)[0]
    assert set(_residual_dtypes(converted, mx.array([ids]))) == {mx.bfloat16}
    assert np.array_equal(_logits(converted, ids), got)
