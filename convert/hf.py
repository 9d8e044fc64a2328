"""HF checkpoint key layouts -> kimi-mlx parameter names (pure functions over ``{key: mx.array}``).

Accepted layouts for Kimi Linear:
- Moonshot's original (``block_sparse_moe.experts.{e}.w1/w2/w3``, ``{q,k,v}_conv1d.weight: [C, 1, K]``,
  ``A_log: [1, 1, H, 1]``, ``kv_b_proj.weight: [H*(nope+v), r]``);
- mlx-lm converted / quantized dirs (``mlp.switch_mlp.*``, ``{q,k,v}_conv.conv.weight: [C, K, 1]``,
  ``embed_q`` / ``unembed_out``, with ``.scales`` / ``.biases`` for quantized modules).

Kimi-K3 adds the ``language_model.`` prefix (added when a text-only export lacks it), AttnRes pairs
``{self_attention,mlp,output_attn}_res_{norm,proj}``, latent-MoE projections, ``A_log`` stored padded (the first
``num_heads`` entries are the per-head values), vision tensors (not the text model's: ``kimi_mlx.load`` reads
them apart as the image encoder when config.json has a ``vision_config``), MTP tensors (dropped), and compressed-tensors
``mxfp4-pack-quantized`` routed experts (``weight_packed`` uint8 ``[out, in/2]``, two E2M1 codes per byte, low
nibble = even element; ``weight_scale`` uint8 ``[out, in/32]``, E8M0). That is byte for byte MLX's
``mode="mxfp4"`` layout (uint32 words of 8 low-nibble-first codes, uint8 E8M0 scales), so the experts are
stacked and reinterpreted, never dequantized.
"""

from __future__ import annotations

import logging
import re

import mlx.core as mx

log = logging.getLogger("kimi_mlx")

_EXPERT = re.compile(
    r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\."
    r"(weight|scales|biases|weight_packed|weight_scale)$"
)
_EXPERT_NAME = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# compressed-tensors MXFP4 part -> MLX quantized part
_PACKED_PART = {"weight_packed": "weight", "weight_scale": "scales"}


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit the model: names the tensor and what was expected."""


def _stack_experts(weights: dict, num_experts: int) -> dict:
    groups: dict[tuple, dict[int, mx.array]] = {}
    out = {}
    for key, value in weights.items():
        m = _EXPERT.match(key)
        if m is None:
            out[key] = value
            continue
        layer, e, w, part = m.groups()
        groups.setdefault((layer, w, part), {})[int(e)] = value
    for (layer, w, part), experts in groups.items():
        missing = sorted(set(range(num_experts)) - set(experts))
        extra = sorted(set(experts) - set(range(num_experts)))
        if missing or extra:
            raise CheckpointError(
                f"{layer}.block_sparse_moe.experts.*.{w}.{part}: expected experts 0..{num_experts - 1}, "
                f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, unexpected {extra[:8]}"
            )
        shapes = {tuple(experts[e].shape) for e in experts}
        if len(shapes) != 1:
            raise CheckpointError(f"{layer}.block_sparse_moe.experts.*.{w}.{part}: experts differ in shape {shapes}")
        stacked = mx.stack([experts[e] for e in range(num_experts)])
        if part == "weight_packed":
            if stacked.dtype != mx.uint8 or stacked.shape[-1] % 4:
                raise CheckpointError(
                    f"{layer}.block_sparse_moe.experts.*.{w}.weight_packed: expected uint8 [out, in/2] with in/2 a "
                    f"multiple of 4, got {stacked.dtype} {tuple(stacked.shape[1:])}"
                )
            stacked = stacked.view(mx.uint32)  # 8 E2M1 codes per word, low nibble first: MLX's mxfp4 packing
        elif part == "weight_scale" and stacked.dtype != mx.uint8:
            raise CheckpointError(
                f"{layer}.block_sparse_moe.experts.*.{w}.weight_scale: expected uint8 E8M0 scales, got {stacked.dtype}"
            )
        out[f"{layer}.mlp.switch_mlp.{_EXPERT_NAME[w]}.{_PACKED_PART.get(part, part)}"] = stacked
    return out


def _fuse_conv(weights: dict, prefix: str) -> None:
    """{q,k,v}_conv1d.weight [C,1,K], {q,k,v}_conv.conv.weight [C,K,1] or mlx-lm's fused
    qkv_conv.conv.weight [3C,K,1] -> qkv_conv.weight [3C, K]."""
    fused = weights.pop(f"{prefix}.qkv_conv.conv.weight", None)
    if fused is not None:
        weights[f"{prefix}.qkv_conv.weight"] = fused.reshape(fused.shape[0], fused.shape[1])
        return
    parts = []
    for name in "qkv":
        for key, to_ck in (
            (f"{prefix}.{name}_conv1d.weight", lambda w: w.reshape(w.shape[0], w.shape[-1])),
            (f"{prefix}.{name}_conv.conv.weight", lambda w: w.reshape(w.shape[0], w.shape[1])),
        ):
            if key in weights:
                w = weights.pop(key)
                if w.ndim != 3:
                    raise CheckpointError(f"{key}: expected a depthwise conv weight with 3 dims, got shape {w.shape}")
                parts.append(to_ck(w))
                break
    if parts:
        if len(parts) != 3:
            raise CheckpointError(f"{prefix}: expected q, k and v short-conv weights, found {len(parts)} of 3")
        weights[f"{prefix}.qkv_conv.weight"] = mx.concatenate(parts, axis=0)


def _split_kv_b(weights: dict, prefix: str, cfg) -> None:
    """kv_b_proj.weight [H*(nope+v), r] -> embed_q.weight [H, r, nope], unembed_out.weight [H, v, r]."""
    key = f"{prefix}.kv_b_proj.weight"
    if key not in weights:
        return
    H, nope, vd, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    w = weights.pop(key)
    quant = None
    if f"{prefix}.kv_b_proj.scales" in weights:
        scales = weights.pop(f"{prefix}.kv_b_proj.scales")
        biases = weights.pop(f"{prefix}.kv_b_proj.biases", None)
        bits = (w.shape[-1] * 32) // r
        group_size = r // scales.shape[-1]
        quant = dict(group_size=group_size, bits=bits)
        w = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    if w.shape != (H * (nope + vd), r):
        raise CheckpointError(f"{key}: expected shape {(H * (nope + vd), r)} (heads*(qk_nope+v), kv_lora_rank), got {w.shape}")
    w = w.reshape(H, nope + vd, r)
    split = {
        "embed_q": mx.contiguous(w[:, :nope, :].swapaxes(-1, -2)),
        "unembed_out": mx.contiguous(w[:, nope:, :]),
    }
    for name, value in split.items():
        if quant is None:
            weights[f"{prefix}.{name}.weight"] = value
        else:
            q, s, b = mx.quantize(value, **quant)
            weights.update({f"{prefix}.{name}.weight": q, f"{prefix}.{name}.scales": s, f"{prefix}.{name}.biases": b})


def kimi_linear_to_mlx(weights: dict[str, mx.array], cfg) -> dict[str, mx.array]:
    """Rename/reshape a Kimi Linear checkpoint into kimi-mlx parameters (see module docstring)."""
    mtp = {k for k in weights if k.startswith(("model.mtp", "mtp."))}
    if mtp:
        log.warning("note: ignoring %d multi-token-prediction (MTP) tensors; kimi-mlx decodes one token per step",
                    len(mtp))
        weights = {k: v for k, v in weights.items() if k not in mtp}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    weights = _stack_experts(weights, cfg.num_experts)
    renames = (
        (".block_sparse_moe.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"),
        (".block_sparse_moe.", ".mlp."),
        ("_res_norm.", "_res.norm."),
        ("_res_proj.", "_res.proj."),
    )
    for key in list(weights):
        for old, new in renames:
            if old in key:
                weights[key.replace(old, new)] = weights.pop(key)
                break
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}.self_attn"
        if cfg.is_kda_layer(i):
            _fuse_conv(weights, prefix)
            if f"{prefix}.dt_bias" in weights:
                weights[f"{prefix}.dt_bias"] = weights[f"{prefix}.dt_bias"].reshape(-1)
            if f"{prefix}.A_log" in weights:  # per head; K3 stores it padded: keep the first num_heads entries
                a_log = weights[f"{prefix}.A_log"].reshape(-1)
                weights[f"{prefix}.A_log"] = a_log[: cfg.kda_num_heads] if cfg.is_k3 else a_log
        else:
            _split_kv_b(weights, prefix, cfg)
    return weights


_K3_DROPPED = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
# The other AttnRes spelling seen in the wild (e.g. sglang): layers.N.attn_res_* and model.final_attn_res_*.
_K3_ALIASES = (
    (re.compile(r"^(model\.layers\.\d+)\.attn_res_(norm|proj)\."), r"\1.self_attention_res_\2."),
    (re.compile(r"^model\.final_attn_res_(norm|proj)\."), r"model.output_attn_res_\1."),
)


def kimi_k3_to_mlx(weights: dict[str, mx.array], cfg) -> dict[str, mx.array]:
    """Kimi-K3 checkpoint -> kimi-mlx parameters under ``language_model.`` (see module docstring)."""
    text = {}
    for key, value in weights.items():
        bare = key[len("language_model."):] if key.startswith("language_model.") else key
        if bare.startswith(_K3_DROPPED):
            continue  # the vision tower's: read apart, as the image encoder (or ignored when config.json has none)
        for pattern, replacement in _K3_ALIASES:
            bare = pattern.sub(replacement, bare)
        text[bare] = value
    return {f"language_model.{k}": v for k, v in kimi_linear_to_mlx(text, cfg).items()}
