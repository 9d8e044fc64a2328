"""Loading HF directories: layouts, shards, quantization, and clear errors on bad input."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import edit_checkpoint, mlx_lm_quantized
from kimi_mlx.convert.hf import CheckpointError
from mlx_lm_reference import MlxLmReference

from kimi_mlx.config import ConfigError, KimiConfig
from kimi_mlx.loading import ModelNotFoundError, load, load_model


def _ids(manifest):
    return mx.array([manifest["token_ids"]])


def test_sharded_checkpoint_with_index(kl_copy, kl_model, kl_manifest):
    """A checkpoint split into two shards + model.safetensors.index.json loads to the same logits; a shard named
    in the index but absent gives an error naming it."""
    weights = dict(mx.load(str(kl_copy / "model.safetensors")))
    keys = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    (kl_copy / "model.safetensors").unlink()
    for name, ks in shards.items():
        mx.save_safetensors(str(kl_copy / name), {k: weights[k] for k in ks})
    index = {"weight_map": {k: name for name, ks in shards.items() for k in ks}}
    (kl_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _ = load_model(kl_copy, dtype=mx.float32)
    np.testing.assert_array_equal(np.array(model(_ids(kl_manifest))), np.array(kl_model(_ids(kl_manifest))))
    (kl_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_model(kl_copy)


def test_missing_tensor_is_named(kl_copy):
    """Dropping one tensor -> error naming that parameter and its expected shape."""
    edit_checkpoint(kl_copy, weights=lambda w: w.pop("model.layers.0.self_attn.b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors.*model\.layers\.0\.self_attn\.b_proj\.weight \(2, 256\)"):
        load_model(kl_copy)


def test_wrong_shape_is_named(kl_copy):
    """A tensor with the wrong shape -> error naming it with expected and found shapes."""
    edit_checkpoint(kl_copy, weights=lambda w: w.__setitem__("model.layers.2.self_attn.q_proj.weight", mx.zeros((190, 256))))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.q_proj\.weight: expected \(192, 256\), found \(190, 256\)"):
        load_model(kl_copy)


def test_unknown_extra_tensor_is_named(kl_copy):
    """An extra tensor the model does not have -> error naming it."""
    edit_checkpoint(kl_copy, weights=lambda w: w.__setitem__("model.layers.0.self_attn.surprise.weight", mx.zeros((2, 2))))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.surprise\.weight"):
        load_model(kl_copy)


def test_missing_expert_is_named(kl_copy):
    """One routed expert missing -> error naming the layer, the projection and the expert index."""
    edit_checkpoint(kl_copy, weights=lambda w: w.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.\*\.w2\.weight.*missing \[3\]"):
        load_model(kl_copy)


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda c: c.pop("hidden_size"), "hidden_size"),
        (lambda c: c.__setitem__("mla_use_nope", False), "mla_use_nope"),
        (lambda c: c.__setitem__("hidden_act", "gelu"), "hidden_act"),
        (lambda c: c["linear_attn_config"].__setitem__("kda_layers", [1, 2]), "kda_layers/full_attn_layers"),
        (lambda c: c["linear_attn_config"].__setitem__("full_attn_layers", [3, 4]), "kda_layers/full_attn_layers"),
        (lambda c: c.__setitem__("num_experts_per_token", 9), "num_experts_per_token"),
        (lambda c: c.__setitem__("model_type", "llama"), "model_type"),
        (lambda c: c.__setitem__("kv_lora_rank", "128"), "kv_lora_rank"),
    ],
)
def test_bad_config_names_the_key(kl_copy, edit, key):
    """Unsupported or inconsistent config values -> ConfigError naming the config file and the key."""
    edit_checkpoint(kl_copy, config=edit)
    with pytest.raises(ConfigError) as err:
        load_model(kl_copy)
    assert key in str(err.value) and "config.json" in str(err.value)


def test_config_decoys(kl_dir):
    """head_dim (a legacy decoy) is ignored, layer lists are 1-based, MLA scale uses qk_nope + qk_rope."""
    raw = json.loads((kl_dir / "hf" / "config.json").read_text())
    cfg = KimiConfig.from_hf(dict(raw, head_dim=12345))
    assert cfg.kda_layers == [0, 1, 3] and not cfg.is_kda_layer(2)
    from kimi_mlx.layers.mla import KimiMLA

    assert KimiMLA(cfg).scale == pytest.approx((64 + 32) ** -0.5)


def test_not_a_model_dir(tmp_path):
    """A directory without config.json, a file path, and an unreachable HF id each give a clear error."""
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "x.bin").write_text("x")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        load(tmp_path / "x.bin")
    with pytest.raises(ModelNotFoundError, match="no such directory"):
        load(tmp_path / "nope")


def test_hf_id_offline_error(monkeypatch):
    """An HF repo id with the Hub unreachable -> ModelNotFoundError that says so and suggests a local path."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="Offline"):
        load("moonshotai/definitely-not-cached-kimi")


def _rounded_as_quantized(model, group_size: int, bits: int) -> None:
    """Replace, in place, the weight of every layer that on-load quantization covers (projections, experts,
    embedding, lm_head; not the routers) by ``mx.dequantize(mx.quantize(weight))``: the float model that a quantized
    one computes."""
    kinds = ("Linear", "Embedding", "SwitchLinear", "MultiLinear")
    for path, module in model.named_modules():
        if type(module).__name__ in kinds and not path.endswith("mlp.gate"):
            q = mx.quantize(module["weight"], group_size=group_size, bits=bits)
            module["weight"] = mx.dequantize(*q, group_size=group_size, bits=bits)


def test_on_load_quantization_keeps_router_and_norms_float(kl_dir, kl_manifest):
    """quantize={bits: 8, group_size: 32}: projections/experts become quantized, routers, norms and A_log stay
    float; the logits are those of the float model with the same weights rounded by mx.quantize / mx.dequantize."""
    model, _ = load_model(kl_dir / "hf", dtype=mx.float32, quantize={"bits": 8, "group_size": 32})
    layer = model.layers[1]
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear)
    assert type(layer.mlp.switch_mlp.gate_proj).__name__ == "QuantizedSwitchLinear"
    assert isinstance(layer.mlp.gate, nn.Linear) and not isinstance(layer.mlp.gate, nn.QuantizedLinear)
    assert layer.self_attn.A_log.dtype == mx.float32
    reference, _ = load_model(kl_dir / "hf", dtype=mx.float32)
    _rounded_as_quantized(reference, group_size=32, bits=8)
    diff = mx.abs(model(_ids(kl_manifest)) - reference(_ids(kl_manifest))).max().item()
    # measured 0 on the CPU (against the unrounded float model: 0.094); quantized kernels that accumulate in another
    # order only round differently, which moves this model's logits by ~5e-6
    assert diff <= 1e-5, diff
    with pytest.raises(ValueError, match="bits=7"):
        load_model(kl_dir / "hf", quantize=7)


def test_mlx_lm_quantized_directory(kl_dir, kl_manifest, tmp_path):
    """A directory converted and 4-bit quantized by mlx-lm (its key layout, split kv_b_proj, stacked experts,
    8-bit router overrides) loads and matches mlx-lm's own float32 forward of that directory (with our norm
    epsilons: mlx-lm's kimi_linear uses rms_norm_eps for the MLA kv-norm)."""
    mlx_lm_quantized(kl_dir / "hf", tmp_path)
    ours, _ = load_model(tmp_path, dtype=mx.float32)
    assert "scales" in ours.layers[1].mlp.switch_mlp.gate_proj
    ids = kl_manifest["token_ids"]
    diff = np.abs(np.array(ours(mx.array([ids]))[0]) - MlxLmReference(tmp_path)(ids)).max()
    assert diff <= 1.2e-5, diff  # measured 4.3e-6 (with mlx-lm's own kv-norm eps: 1.6e-5)


def test_fused_qkv_checkpoint(kl_copy, kl_model, kl_manifest):
    """A checkpoint with KDA q/k/v projections fused into one qkv_proj gives the same logits as separate ones."""

    def fuse(w):
        for i in (0, 1, 3):
            p = f"model.layers.{i}.self_attn"
            w[f"{p}.qkv_proj.weight"] = mx.concatenate([w.pop(f"{p}.{n}_proj.weight") for n in "qkv"])

    edit_checkpoint(kl_copy, weights=fuse)
    model, _ = load_model(kl_copy, dtype=mx.float32)
    assert "qkv_proj" in model.layers[0].self_attn
    diff = mx.abs(model(_ids(kl_manifest)) - kl_model(_ids(kl_manifest))).max().item()
    assert diff <= 1e-6, diff  # measured 0


def test_tied_embeddings(kl_copy, kl_manifest):
    """tie_word_embeddings: lm_head.weight is dropped and the embedding matrix is the output projection."""
    edit_checkpoint(kl_copy, config=lambda c: c.__setitem__("tie_word_embeddings", True))
    model, _ = load_model(kl_copy, dtype=mx.float32)
    assert "lm_head" not in model
    h = model.model(_ids(kl_manifest))
    expected = h @ model.model.embed_tokens.weight.T
    assert mx.allclose(model(_ids(kl_manifest)), expected, rtol=0, atol=1e-6).item()  # measured 0
