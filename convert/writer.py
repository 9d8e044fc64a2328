"""Write an MLX model directory: safetensors shards (+ index), ``config.json`` and tokenizer files.

Model-free on purpose: it takes a flat ``{name: mx.array}`` dict of the model's parameters, the typed config (any
object with ``KimiConfig``'s fields) and the tokenizer files, and writes what ``kimi_mlx.load`` and (for Kimi
Linear) ``mlx_lm.load`` read back:

- Kimi Linear in mlx-lm's converted key layout: the fused short conv ``self_attn.qkv_conv.weight [3C, K]`` is split
  into ``self_attn.{q,k,v}_conv.conv.weight [C, K, 1]`` and ``A_log [H]`` is stored as ``[1, 1, H, 1]``;
- Kimi-K3 in mlx-lm's kimi_k3 layout: ``qkv_conv.conv.weight [3C, K, 1]``, ``*_res_{norm,proj}``, and the KDA
  q/k/v projections fused into ``qkv_proj`` when they match (our loader reads both);
- quantized modules as ``.weight`` / ``.scales`` / ``.biases`` with mlx-lm's ``"quantization"`` entry
  (``group_size``, ``bits``, ``mode`` and per-module overrides) in ``config.json``;
- GGML-block modules (GGUF types MLX has no layout for) as their uint8 ``.weight`` ``[..., rows, row_bytes]`` (the
  GGUF's bytes) with a per-module ``{"ggml_type": name}`` override in the same entry (kimi-mlx reads it, mlx-lm
  does not); K3's fused ``qkv_proj`` concatenates block rows like any other weight and carries the override.
"""

from __future__ import annotations

import base64
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx

HF_NORM_EPS = 1e-6  # MLA q/kv norm and KDA L2-norm eps of the HF reference (not stored in its config.json)
MAX_SHARD_BYTES = 5 << 30  # mlx-lm's default shard size (5 GB)
TOKENIZER_FILES = (
    "tiktoken.model", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
    "tokenization_kimi.py", "chat_template.jinja",
)


# --------------------------------------------------------------------------- config


def hf_text_config(cfg) -> dict:
    """HF-style Kimi Linear text config (1-based layer lists) from a ``KimiConfig``."""
    n = cfg.num_hidden_layers
    kda = sorted(i + 1 for i in cfg.kda_layers)
    lac: dict[str, Any] = {
        "full_attn_layers": [i for i in range(1, n + 1) if i not in kda],
        "kda_layers": kda,
        "head_dim": cfg.kda_head_dim,
        "num_heads": cfg.kda_num_heads,
        "short_conv_kernel_size": cfg.short_conv_kernel_size,
    }
    eos = list(cfg.eos_token_id)
    text: dict[str, Any] = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "head_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": True,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": cfg.moe_layer_freq,
        "moe_renormalize": cfg.moe_renormalize,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "num_expert_group": cfg.num_expert_group,
        "topk_group": cfg.topk_group,
        "use_grouped_topk": cfg.use_grouped_topk,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": 10000.0,
        "model_max_length": cfg.model_max_length or 1048576,
        "linear_attn_config": lac,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
    # Norm epsilons HF configs do not carry (fixed at 1e-6 there); a GGUF source uses llama.cpp's (rms_norm_eps for
    # every norm, eps^2 for the KDA L2 norm). Recorded when they differ so the config says what the weights ran with.
    for name in ("mla_kv_norm_eps", "mla_q_norm_eps", "kda_l2_eps"):
        value = getattr(cfg, name, HF_NORM_EPS)
        if value != HF_NORM_EPS:
            text[name] = value
    if cfg.model_type == "kimi_k3":
        if cfg.kda_gate_lower_bound is not None:
            lac["gate_lower_bound"] = cfg.kda_gate_lower_bound
        lac["use_full_rank_gate"] = cfg.kda_full_rank_gate
        text.update(
            mla_use_output_gate=cfg.mla_use_output_gate,
            routed_expert_hidden_size=cfg.routed_expert_hidden_size,
            latent_moe_use_norm=cfg.latent_moe_use_norm,
            attn_res_block_size=cfg.attn_res_block_size,
        )
        if cfg.hidden_act == "situ":
            text["activation_situ_beta"] = cfg.situ_beta
            text["activation_situ_linear_beta"] = cfg.situ_linear_beta
    return text


def hf_config(cfg, quantization: dict | None = None, base: dict | None = None,
              torch_dtype: str | None = None) -> dict:
    """The ``config.json`` our loader parses: kimi_linear at the top level, kimi_k3 with ``text_config``.

    ``base`` (the source's own config.json, when there is one) keeps keys we do not model; every key we do model is
    written from ``cfg``. ``quantization`` is mlx-lm's entry; a source ``quantization_config`` is dropped (the
    written tensors are described by ``quantization``).
    """
    base = json.loads(json.dumps(base or {}))
    for key in ("quantization", "quantization_config"):
        base.pop(key, None)
    text = hf_text_config(cfg)
    if torch_dtype:
        text["torch_dtype"] = torch_dtype
    if cfg.model_type == "kimi_k3":
        inner = base.get("text_config") if isinstance(base.get("text_config"), dict) else {}
        inner.pop("quantization_config", None)
        inner.update(text)
        out = dict(base)
        out.update(
            architectures=["KimiK3ForConditionalGeneration"], model_type="kimi_k3", text_config=inner,
            tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
            eos_token_id=text["eos_token_id"],
        )
        if torch_dtype:
            out["torch_dtype"] = torch_dtype
    else:
        base.pop("text_config", None)
        out = dict(base)
        out.update(text)
    for d in (out, out.get("text_config") or {}):
        if d.get("rope_scaling", 0) is None:  # NoPE; a null makes transformers warn when mlx_lm.load reads it
            del d["rope_scaling"]
    if quantization:
        out["quantization"] = quantization
    return out


# --------------------------------------------------------------------------- key layout


def _fuse_k3_qkv(out: dict, cfg, quantization: dict | None) -> dict | None:
    """mlx-lm's kimi_k3 fuses the KDA q/k/v projections into ``qkv_proj`` (rows q, k, v). Done for every KDA layer
    or none (our loader builds all-fused or all-separate): only when the three match in dtype, width and
    quantization in every layer."""
    prefixes = [f"language_model.model.layers.{i}.self_attn" for i in cfg.kda_layers]
    q = quantization or {}

    def spec(path):
        return json.dumps(q.get(path)) if isinstance(q.get(path), dict) else None

    for prefix in prefixes:
        names = [f"{prefix}.{n}_proj" for n in "qkv"]
        if not all(f"{n}.weight" in out for n in names) or len({spec(n) for n in names}) != 1:
            return quantization
        for part in ("weight", "scales", "biases"):
            tensors = [out.get(f"{n}.{part}") for n in names]
            if any(t is None for t in tensors) != all(t is None for t in tensors):
                return quantization
            if tensors[0] is not None and len({(t.dtype, tuple(t.shape[1:])) for t in tensors}) != 1:
                return quantization
    q = dict(q) if quantization else None
    for prefix in prefixes:
        names = [f"{prefix}.{n}_proj" for n in "qkv"]
        for part in ("weight", "scales", "biases"):
            tensors = [out.pop(f"{n}.{part}", None) for n in names]
            if tensors[0] is not None:
                out[f"{prefix}.qkv_proj.{part}"] = mx.concatenate(tensors, axis=0)
        if q is not None:
            overrides = [q.pop(n, None) for n in names]
            if overrides[0] is not None:
                q[f"{prefix}.qkv_proj"] = overrides[0]
    return q


def to_mlx_lm_layout(params: Mapping[str, mx.array], cfg,
                     quantization: dict | None = None) -> tuple[dict[str, mx.array], dict | None]:
    """Our parameter names -> mlx-lm's converted layout (Kimi Linear and Kimi-K3); returns the weights and the
    ``quantization`` entry with its per-module paths renamed to match."""
    out = dict(params)
    for i in cfg.kda_layers:
        prefix = f"{'language_model.' if cfg.model_type == 'kimi_k3' else ''}model.layers.{i}.self_attn"
        conv = out.pop(f"{prefix}.qkv_conv.weight", None)
        if conv is not None and cfg.model_type == "kimi_k3":  # mlx-lm's K3: one fused depthwise conv [3C, K, 1]
            out[f"{prefix}.qkv_conv.conv.weight"] = conv.reshape(*conv.shape, 1)
        elif conv is not None:  # mlx-lm's Kimi Linear: separate q/k/v convs [C, K, 1]
            c = conv.shape[0] // 3
            for j, name in enumerate("qkv"):
                out[f"{prefix}.{name}_conv.conv.weight"] = conv[j * c:(j + 1) * c].reshape(c, conv.shape[1], 1)
        a_log = out.get(f"{prefix}.A_log")
        if a_log is not None and a_log.ndim == 1 and cfg.model_type != "kimi_k3":
            out[f"{prefix}.A_log"] = a_log.reshape(1, 1, -1, 1)
    if cfg.model_type == "kimi_k3":
        for key in list(out):
            new = key.replace("_res.norm.", "_res_norm.").replace("_res.proj.", "_res_proj.")
            if new != key:
                out[new] = out.pop(key)
        quantization = _fuse_k3_qkv(out, cfg, quantization)
    return out, quantization


# --------------------------------------------------------------------------- tokenizer


def tiktoken_file_text(ranks: Mapping[bytes, int]) -> str:
    """A tiktoken BPE file: one ``<base64 token> <rank>`` line per rank, in rank order."""
    return "".join(
        f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for tok, rank in sorted(ranks.items(), key=lambda t: t[1])
    )


def tokenizer_config(specials: Mapping[str, int], flagged, *, bos=None, eos=None, pad=None, unk=None,
                     chat_template: str | None = None) -> dict:
    """``tokenizer_config.json`` with ``added_tokens_decoder`` for the special tokens (ids after the BPE ranks)."""
    decoder = {
        str(tid): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                   "special": tid in flagged}
        for name, tid in sorted(specials.items(), key=lambda t: t[1])
    }
    out: dict[str, Any] = {"added_tokens_decoder": decoder, "tokenizer_class": "TikTokenTokenizer",
                           "model_max_length": 1048576}
    for key, value in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad), ("unk_token", unk)):
        if value is not None:
            out[key] = value
    if chat_template:
        out["chat_template"] = chat_template
    return out


# --------------------------------------------------------------------------- weights


def make_shards(weights: Mapping[str, mx.array], max_bytes: int = MAX_SHARD_BYTES) -> list[dict[str, mx.array]]:
    """Split into shards of at most ``max_bytes`` each (a tensor bigger than that gets a shard of its own)."""
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for key in sorted(weights):
        value = weights[key]
        if shards[-1] and size + value.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += value.nbytes
    return shards


def progress_bar(total: int, desc: str, unit: str, progress: bool):
    """A tqdm bar on stderr (tqdm comes with gguf), disabled when ``progress`` is False."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr, disable=not progress,
                leave=False)


def save_weights(out_dir: Path, weights: Mapping[str, mx.array], max_shard_bytes: int = MAX_SHARD_BYTES,
                 progress: bool = True) -> list[str]:
    """Write ``model.safetensors`` or ``model-0000k-of-0000N.safetensors`` + ``model.safetensors.index.json``."""
    shards = make_shards(weights, max_shard_bytes)
    total = sum(v.nbytes for v in weights.values())
    names = (
        ["model.safetensors"] if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    bar = progress_bar(total, "writing", "B", progress)
    weight_map = {}
    for name, shard in zip(names, shards):
        for key, value in shard.items():  # materialise tensor by tensor (layout splits, casts), then write the shard
            mx.eval(value)
            weight_map[key] = name
            if bar is not None:
                bar.set_postfix_str(name, refresh=False)
                bar.update(value.nbytes)
        mx.save_safetensors(str(out_dir / name), shard, metadata={"format": "mlx"})
    if bar is not None:
        bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def write_model_dir(
    out_dir: str | Path,
    weights: Mapping[str, mx.array],
    config: dict,
    tokenizer_files: Mapping[str, str | bytes | Path],
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: bool = True,
) -> Path:
    """Write an MLX model dir. ``weights`` already in the on-disk layout (see ``to_mlx_lm_layout``); ``config`` the
    full config.json dict; ``tokenizer_files`` name -> text, bytes, or a file to copy."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:  # an earlier conversion's
        stale.unlink(missing_ok=True)
    save_weights(out, weights, max_shard_bytes, progress)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, content in tokenizer_files.items():
        target = out / name
        if isinstance(content, Path):
            shutil.copyfile(content, target)
        elif isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content, encoding="utf-8")
    return out
