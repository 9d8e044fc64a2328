"""Kimi-K3 pieces against their formulas (written here in float64 numpy), MXFP4 experts against an independent
compressed-tensors decoder, LoRA-safety, and clear errors on bad K3 configs/checkpoints."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from conftest import edit_checkpoint, mlx_lm_quantized
from kimi_mlx.convert.hf import CheckpointError
from mlx.utils import tree_flatten, tree_unflatten

from kimi_mlx.config import ConfigError, KimiConfig
from kimi_mlx.ops.kda_gates import kda_decay
from kimi_mlx.layers.moe import situ
from kimi_mlx.loading import load, load_model
from kimi_mlx.ops.attn_res import attn_res_mix

# E2M1 (FP4) code -> value, from the OCP MX spec: sign bit 3, exponent bits 2-1, mantissa bit 0.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def decode_compressed_tensors_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Independent decoder of compressed-tensors 'mxfp4-pack-quantized': packed uint8 [out, in/2] holds two E2M1
    codes per byte, low nibble = even element; scale uint8 [out, in/32] is E8M0 (2**(e - 127)), one per 32."""
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    values = E2M1[codes]
    return values * np.repeat(np.exp2(scale.astype(np.float64) - 127.0), 32, axis=1)


def test_attn_res_mix_matches_formula():
    """attn_res_mix == softmax over depth of (RMSNorm(V_i) . (norm_w * proj_w)) weighting the RAW V_i, float64
    reference, for 1, 2 and 8 sources with very different scales; the called-projection form (used for LoRA-wrapped
    projections) gives the same result."""
    from kimi_mlx.ops.attn_res import attn_res_mix_scored, inv_rms

    rng = np.random.default_rng(0)
    d, eps = 64, 1e-5
    norm_w = 1 + 0.3 * rng.standard_normal(d)
    proj_w = rng.standard_normal((1, d))
    proj = nn.Linear(d, 1, bias=False)
    proj.weight = mx.array(proj_w, mx.float32)
    nw = mx.array(norm_w, mx.float32)
    for n in (1, 2, 8):
        V = [rng.standard_normal((2, 5, d)) * 10.0 ** rng.uniform(-2, 2) for _ in range(n)]
        K = [v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) for v in V]
        logits = np.stack([k @ (norm_w * proj_w[0]) for k in K])
        p = np.exp(logits - logits.max(0))
        p /= p.sum(0)
        expected = sum(p[i][..., None] * V[i] for i in range(n))
        blocks = [mx.array(v, mx.float32) for v in V[:-1]]
        scales = [inv_rms(b, eps) for b in blocks]
        partial = mx.array(V[-1], mx.float32)
        got = attn_res_mix(blocks, scales, partial, nw * proj.weight[0], eps)
        # measured: the error uses 0.30 of this tolerance (n = 8)
        np.testing.assert_allclose(np.array(got), expected, rtol=2.5e-6, atol=2.5e-6 * np.abs(expected).max())
        scored = attn_res_mix_scored(blocks, scales, partial, lambda k: proj(k * nw), eps)
        # measured: the difference uses 0.55 of this tolerance (n = 8)
        np.testing.assert_allclose(np.array(scored), np.array(got), rtol=1e-5, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize("linear_beta", [2.5, None])
def test_situ_matches_formula(linear_beta):
    """SiTU(up, gate) = beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta) (up unclipped when
    linear_beta is None), vs float64, over a range that exercises both soft clips."""
    rng = np.random.default_rng(1)
    up, gate, beta = rng.uniform(-40, 40, (4, 33)), rng.uniform(-12, 12, (4, 33)), 1.5
    clipped = up if linear_beta is None else linear_beta * np.tanh(up / linear_beta)
    expected = beta * np.tanh(gate / beta) / (1 + np.exp(-gate)) * clipped
    got = situ(mx.array(up, mx.float32), mx.array(gate, mx.float32), beta, linear_beta)
    np.testing.assert_allclose(np.array(got), expected, rtol=1e-6, atol=1e-6)  # measured: error uses 0.22 of it


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_decay_gate_matches_formula(lower_bound):
    """Lower-bound gate g = lb*sigmoid(exp(A_log)*(f + dt_bias)) (not a clamp of the softplus form), and the
    Kimi Linear gate g = -exp(A_log)*softplus(f + dt_bias), per channel, vs float64."""
    rng = np.random.default_rng(2)
    H, D = 3, 8
    f = rng.standard_normal((2, 4, H, D)) * 5
    a_log, dt = rng.uniform(-1, 5, H), rng.standard_normal(H * D)
    z = f + dt.reshape(H, D)
    rate = np.exp(a_log)[:, None]
    if lower_bound is None:
        expected = -rate * np.logaddexp(0, z)
    else:
        expected = lower_bound / (1 + np.exp(-rate * z))
    got = kda_decay(mx.array(f, mx.float32), mx.array(a_log, mx.float32), mx.array(dt, mx.float32), lower_bound)
    np.testing.assert_allclose(np.array(got), expected, rtol=1e-6, atol=1e-6)  # measured: error uses 0.33 of it


def _mxfp4_hand_packed(rng, out_dim, in_dim):
    codes = rng.integers(0, 16, (out_dim, in_dim), dtype=np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scale = rng.integers(120, 127, (out_dim, in_dim // 32), dtype=np.uint8)  # 2^-7..2^-1: sane activations
    return packed, scale


def _mxfp4_from_mlx(rng, out_dim, in_dim):
    w = mx.array(rng.standard_normal((out_dim, in_dim)).astype(np.float32))
    q, s = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
    return np.array(q.view(mx.uint8)), np.array(s)


def _experts_to_mxfp4(path, make, rng) -> dict:
    """Rewrite every routed expert of the checkpoint at ``path`` as compressed-tensors MXFP4 (``make`` builds the
    packed bytes and scales) and declare it in config.json; returns {original key: independently decoded floats}."""
    decoded = {}

    def to_mxfp4(w):
        for key in [k for k in w if ".experts." in k and k.endswith(".weight")]:
            out_dim, in_dim = w[key].shape
            packed, scale = make(rng, out_dim, in_dim)
            decoded[key] = decode_compressed_tensors_mxfp4(packed, scale)
            del w[key]
            w[key.replace(".weight", ".weight_packed")] = mx.array(packed)
            w[key.replace(".weight", ".weight_scale")] = mx.array(scale)

    edit_checkpoint(path, weights=to_mxfp4, config=lambda c: c.__setitem__(
        "quantization_config", {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}))
    return decoded


@pytest.mark.parametrize("make", [_mxfp4_hand_packed, _mxfp4_from_mlx])
def test_mxfp4_experts_load_byte_for_byte(k3_copy, make):
    """compressed-tensors MXFP4 routed experts (hand-packed nibbles, or produced by mx.quantize) load into MLX's
    mxfp4 layout unchanged, so mx.dequantize of our stacked weights == the independent decoder, and the model's
    logits equal those of the same checkpoint with the experts stored as the decoded floats."""
    cfg = json.loads((k3_copy / "config.json").read_text())["text_config"]
    decoded = _experts_to_mxfp4(k3_copy, make, np.random.default_rng(4))
    model, _ = load_model(k3_copy, dtype=mx.float32)
    layer = 1
    switch = model.language_model.model.layers[layer].mlp.switch_mlp
    for ours, name in ((switch.gate_proj, "w1"), (switch.down_proj, "w2"), (switch.up_proj, "w3")):
        assert ours.mode == "mxfp4" and ours["weight"].dtype == mx.uint32
        got = mx.dequantize(ours["weight"], ours["scales"], group_size=32, bits=4, mode="mxfp4")
        got = np.array(got.astype(mx.float32))  # E2M1 x 2^k is exact in any float dtype
        for e in range(cfg["num_experts"]):
            ref = decoded[f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{name}.weight"]
            np.testing.assert_array_equal(got[e], ref.astype(np.float32))

    float_dir = k3_copy.parent / "float"
    shutil.copytree(k3_copy, float_dir)

    def to_float(w):
        for key, value in decoded.items():
            del w[key.replace(".weight", ".weight_packed")], w[key.replace(".weight", ".weight_scale")]
            w[key] = mx.array(value.astype(np.float32))

    edit_checkpoint(float_dir, weights=to_float, config=lambda c: c.pop("quantization_config"))
    reference, _ = load_model(float_dir, dtype=mx.float32)
    ids = mx.array([list(range(30))])
    # Weights are identical (checked above); quantized vs float matmuls only round differently: measured 6.2e-6 and
    # 2.5e-5 (K3's tiny model amplifies float32 rounding: weight noise of one ulp moves its logits by ~4e-5).
    assert mx.abs(model(ids) - reference(ids)).max().item() <= 7.5e-5


def test_lora_on_every_linear_trains_one_step(k3_model):
    """LoRA on every nn.Linear of the K3 model (incl. gates, AttnRes projections, latent-MoE projections, lm_head):
    the forward never reads a wrapped projection's .weight, the loss is finite, and after one step only adapter
    parameters changed (the frozen base is bit-for-bit unchanged)."""
    from mlx_lm.tuner.lora import LoRALinear

    model = k3_model.__class__(k3_model.args)
    model.update(k3_model.parameters())
    wrapped = [(path, LoRALinear.from_base(m, r=4)) for path, m in model.named_modules() if type(m) is nn.Linear]
    model.freeze()
    model.update_modules(tree_unflatten(wrapped))
    for _, m in wrapped:
        m.unfreeze(keys=["lora_a", "lora_b"], strict=True)
    base_before = {k: mx.array(v) for k, v in tree_flatten(model.parameters()) if "lora_" not in k}
    ids = mx.array([list(range(24))])

    def loss_fn(m):
        logits = m(ids[:, :-1])
        return nn.losses.cross_entropy(logits, ids[:, 1:]).mean()

    loss, grads = nn.value_and_grad(model, loss_fn)(model)
    trainable = dict(tree_flatten(grads))
    assert np.isfinite(loss.item())
    assert trainable and all("lora_" in k for k in trainable)
    assert sum(mx.abs(g).sum().item() for g in trainable.values()) > 0
    optim.SGD(learning_rate=0.1).update(model, grads)
    for k, v in tree_flatten(model.parameters()):
        if "lora_" not in k:
            assert mx.array_equal(v, base_before[k]).item(), k
    assert len(wrapped) > 40


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda c: c["text_config"]["linear_attn_config"].__setitem__("gate_lower_bound", "-5"), "gate_lower_bound"),
        (lambda c: c["text_config"]["linear_attn_config"].__setitem__("gate_lower_bound", 5.0), "gate_lower_bound"),
        (lambda c: c["text_config"].__setitem__("attn_res_block_size", 0), "attn_res_block_size"),
        (lambda c: c["text_config"].__setitem__("attn_res_block_size", 99), "attn_res_block_size"),
        (lambda c: c["text_config"].__setitem__("hidden_act", "gelu"), "hidden_act"),
        (lambda c: c.pop("text_config"), "text_config"),
    ],
)
def test_bad_k3_config_names_the_key(k3_copy, edit, key):
    """Unsupported K3 config values -> ConfigError naming the key (under text_config where it lives)."""
    edit_checkpoint(k3_copy, config=edit)
    with pytest.raises(ConfigError, match=key):
        load_model(k3_copy)


def test_k3_features_rejected_in_kimi_linear(kl_dir):
    """K3-only keys in a kimi_linear config are an error, not silently ignored."""
    raw = json.loads((kl_dir / "hf" / "config.json").read_text())
    with pytest.raises(ConfigError, match="attn_res_block_size"):
        KimiConfig.from_hf(dict(raw, attn_res_block_size=2))


def test_missing_res_proj_is_named(k3_copy):
    """A missing AttnRes projection -> error naming the parameter."""
    edit_checkpoint(k3_copy, weights=lambda w: w.pop("language_model.model.layers.1.mlp_res_proj.weight"))
    with pytest.raises(CheckpointError, match=r"language_model\.model\.layers\.1\.mlp_res\.proj\.weight"):
        load_model(k3_copy)


def test_unsupported_quantization_config(k3_copy):
    """A compressed-tensors format other than mxfp4-pack-quantized -> error naming it."""
    edit_checkpoint(k3_copy, config=lambda c: c.__setitem__(
        "quantization_config", {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}))
    with pytest.raises(CheckpointError, match="nvfp4-pack-quantized"):
        load_model(k3_copy)


def test_mlx_lm_quantized_k3_directory(k3_dir, tmp_path):
    """A K3 directory converted and 4-bit quantized by mlx-lm (fused qkv_proj/qkv_conv, split kv_b_proj, its
    AttnRes names) loads and matches mlx-lm's own forward of that directory in float32."""
    ref = mlx_lm_quantized(k3_dir / "hf", tmp_path)
    ours, _ = load_model(tmp_path, dtype=mx.float32)
    assert "qkv_proj" in ours.layers[0].self_attn
    ids = mx.array([list(range(40))])
    diff = mx.abs(ours(ids) - ref(ids)).max().item()
    assert diff <= 5e-5, diff  # measured 1.6e-5


def test_on_load_quantization_of_non_expert_weights(k3_copy):
    """quantize=8 on a K3 checkpoint with MXFP4 experts: the bf16 non-expert projections become 8-bit affine,
    the MXFP4 experts stay as stored, routers and AttnRes projections stay float."""
    _experts_to_mxfp4(k3_copy, _mxfp4_from_mlx, np.random.default_rng(5))
    model, _ = load_model(k3_copy, quantize={"bits": 8, "group_size": 32})
    layer = model.layers[1]
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear) and layer.self_attn.q_proj.bits == 8
    assert isinstance(layer.mlp.routed_expert_down_proj, nn.QuantizedLinear)
    assert layer.mlp.switch_mlp.gate_proj.mode == "mxfp4"
    assert type(layer.mlp.gate) is nn.Linear and type(layer.mlp_res.proj) is nn.Linear
    assert mx.isfinite(model(mx.array([[1, 2, 3]]))).all().item()


def test_other_attn_res_spelling_and_no_prefix(k3_copy, k3_model):
    """The alternative AttnRes names (layers.N.attn_res_*, model.final_attn_res_*) and keys without the
    language_model. prefix load to the same model as the official layout."""

    def respell(w):
        for k in list(w):
            new = k.removeprefix("language_model.")
            new = new.replace("self_attention_res_", "attn_res_").replace("output_attn_res_", "final_attn_res_")
            w[new] = w.pop(k)

    edit_checkpoint(k3_copy, weights=respell)
    model, _ = load_model(k3_copy, dtype=mx.float32)
    ids = mx.array([list(range(20))])
    assert mx.array_equal(model(ids), k3_model(ids)).item()


def test_vision_and_mtp_tensors_ignored_with_a_note(k3_copy, k3_model, caplog):
    """The fixture's stray vision tower/projector tensors (no vision_config in its config.json) and an added MTP
    tensor are skipped (same logits) with notes that say how many and what follows: text only, no images."""
    edit_checkpoint(k3_copy, weights=lambda w: w.__setitem__("language_model.model.mtp.0.proj.weight", mx.zeros((4,))))
    with caplog.at_level("WARNING", logger="kimi_mlx"):
        model, _ = load(k3_copy, dtype=mx.float32)
    notes = " ".join(r.getMessage() for r in caplog.records)
    assert "holds 2 vision tower / projector tensors but its config.json has no vision_config" in notes
    assert "images are unavailable" in notes and "ignoring 1 multi-token-prediction" in notes
    assert model.image_encoder is None and "no vision tower" in model.no_images_reason
    ids = mx.array([list(range(12))])
    assert mx.array_equal(model(ids), k3_model(ids)).item()
