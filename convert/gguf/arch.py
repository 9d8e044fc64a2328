"""``kimi-linear`` / ``kimi-k3`` GGUF -> ``KimiConfig`` and this package's parameter names.

Every llama.cpp converter transform is undone here (see shared/spec/gguf_kimi_layout.md §1-§4):
``ssm_a = -exp(A_log)`` -> ``A_log``; ranks of trailing-1 tensors ignored (element counts checked);
``ssm_conv1d_{q,k,v}`` -> one ``qkv_conv.weight [3P, K]``; ``attn_k_b`` / ``attn_v_b`` (or the legacy fused
``attn_kv_b``) -> ``embed_q`` / ``unembed_out``; stacked ``ffn_*_exps`` -> ``switch_mlp``; pre-fused ``*_res_score``
-> ``norm.weight = score``, ``proj.weight = ones``; ``ssm_dt.bias`` -> ``dt_bias``; K3 ``ssm_g`` vs ``attn_gate``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kimi_mlx.config import KimiConfig

from .quant import GGML_BLOCKS, to_mlx
from .reader import GGUFFile, GGUFFormatError, TensorInfo

ARCHS = ("kimi-linear", "kimi-k3")
FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_TYPES = tuple(t.name for t in GGML_BLOCKS)  # no MLX layout: kept as GGML blocks unless re-quantized


def gguf_storage(type_name: str, quantizable: bool, holds_blocks: bool, requantize: bool) -> str:
    """How ``load`` holds a GGUF tensor of GGML type ``type_name``: "blocks" (the file's blocks, in a GGML-block
    layer), "mlx" (the MLX quantized layout ``quant.to_mlx`` makes: ``quant.mlx_layout``) or "float" (decoded).

    quantizable: the tensor is the weight of a module the model lets ``load`` quantize (its ``quant_predicate``);
    holds_blocks: that module has a GGML-block twin (``layers.ggml.holds_ggml``); requantize: the block types are
    re-quantized to MLX affine instead of kept (``load(requantize=True)``).
    """
    if not quantizable or type_name in FLOAT_TYPES:
        return "float"
    if type_name in BLOCK_TYPES and not requantize:
        return "blocks" if holds_blocks else "float"  # a block type on a MultiLinear ([H, ...]) is decoded
    return "mlx"

# GGUF per-layer suffix -> (param suffix relative to the layer, kind); kind: "linear" (2-D/3-D matrix that may be
# quantized), "vec" (1-D float), "special" (handled by code)
COMMON = {
    "attn_norm.weight": ("input_layernorm.weight", "vec"),
    "ffn_norm.weight": ("post_attention_layernorm.weight", "vec"),
    "attn_output.weight": ("self_attn.o_proj.weight", "linear"),
}
KDA = {
    "attn_q.weight": ("self_attn.q_proj.weight", "linear"),
    "attn_k.weight": ("self_attn.k_proj.weight", "linear"),
    "attn_v.weight": ("self_attn.v_proj.weight", "linear"),
    "ssm_f_a.weight": ("self_attn.f_a_proj.weight", "linear"),
    "ssm_f_b.weight": ("self_attn.f_b_proj.weight", "linear"),
    "ssm_beta.weight": ("self_attn.b_proj.weight", "linear"),
    "ssm_g_a.weight": ("self_attn.g_a_proj.weight", "linear"),
    "ssm_g_b.weight": ("self_attn.g_b_proj.weight", "linear"),
    "ssm_g.weight": ("self_attn.g_proj.weight", "linear"),
    "ssm_norm.weight": ("self_attn.o_norm.weight", "vec"),
    "ssm_dt.bias": ("self_attn.dt_bias", "vec"),
    "ssm_a": ("self_attn.A_log", "special"),
    "ssm_conv1d_q.weight": ("self_attn.qkv_conv.weight", "special"),
    "ssm_conv1d_k.weight": ("self_attn.qkv_conv.weight", "special"),
    "ssm_conv1d_v.weight": ("self_attn.qkv_conv.weight", "special"),
}
MLA = {
    "attn_q.weight": ("self_attn.q_proj.weight", "linear"),
    "attn_q_a.weight": ("self_attn.q_a_proj.weight", "linear"),
    "attn_q_a_norm.weight": ("self_attn.q_a_layernorm.weight", "vec"),
    "attn_q_b.weight": ("self_attn.q_b_proj.weight", "linear"),
    "attn_kv_a_mqa.weight": ("self_attn.kv_a_proj_with_mqa.weight", "linear"),
    "attn_kv_a_norm.weight": ("self_attn.kv_a_layernorm.weight", "vec"),
    "attn_k_b.weight": ("self_attn.embed_q.weight", "linear"),
    "attn_v_b.weight": ("self_attn.unembed_out.weight", "linear"),
    "attn_kv_b.weight": ("self_attn.embed_q.weight", "special"),
    "attn_gate.weight": ("self_attn.g_proj.weight", "linear"),
}
DENSE = {
    "ffn_gate.weight": ("mlp.gate_proj.weight", "linear"),
    "ffn_up.weight": ("mlp.up_proj.weight", "linear"),
    "ffn_down.weight": ("mlp.down_proj.weight", "linear"),
}
MOE = {
    "ffn_gate_inp.weight": ("mlp.gate.weight", "router"),
    "exp_probs_b.bias": ("mlp.e_score_correction_bias", "vec"),
    "ffn_gate_exps.weight": ("mlp.switch_mlp.gate_proj.weight", "linear"),
    "ffn_up_exps.weight": ("mlp.switch_mlp.up_proj.weight", "linear"),
    "ffn_down_exps.weight": ("mlp.switch_mlp.down_proj.weight", "linear"),
    "ffn_gate_shexp.weight": ("mlp.shared_experts.gate_proj.weight", "linear"),
    "ffn_up_shexp.weight": ("mlp.shared_experts.up_proj.weight", "linear"),
    "ffn_down_shexp.weight": ("mlp.shared_experts.down_proj.weight", "linear"),
    "ffn_routed_down.weight": ("mlp.routed_expert_down_proj.weight", "linear"),
    "ffn_routed_up.weight": ("mlp.routed_expert_up_proj.weight", "linear"),
    "ffn_routed_norm.weight": ("mlp.routed_expert_norm.weight", "vec"),
}
K3_ONLY = {"ssm_g.weight", "attn_gate.weight", "ffn_routed_down.weight", "ffn_routed_up.weight",
           "ffn_routed_norm.weight", "attn_res_score.weight", "ffn_res_score.weight"}
KL_ONLY = {"ssm_g_a.weight", "ssm_g_b.weight"}


def build_config(g: GGUFFile) -> KimiConfig:
    """Metadata -> ``KimiConfig`` (validated; raises GGUFFormatError naming the key)."""
    arch = g.get_str("general.architecture")
    if arch not in ARCHS:
        g._fail("general.architecture", arch, f"one of {ARCHS}")
    k3 = arch == "kimi-k3"
    p = arch + "."
    n_layer = g.get_int(p + "block_count", minimum=1)
    E = g.get_int(p + "embedding_length", minimum=1)
    context = g.get_int(p + "context_length", minimum=1)
    H = g.get_int(p + "attention.head_count", minimum=1)
    kv = g.get_array(p + "attention.head_count_kv", "int", length=n_layer)
    bad = [x for x in kv if x not in (0, 1)]
    if bad:
        g._fail(p + "attention.head_count_kv", kv, "per-layer 0 (KDA) or 1 (MLA)")
    eps = g.get_float(p + "attention.layer_norm_rms_epsilon")
    if not eps > 0:
        g._fail(p + "attention.layer_norm_rms_epsilon", eps, "a positive float")
    D = g.get_int(p + "kda.head_dim", minimum=1)
    K = g.get_int(p + "ssm.conv_kernel", minimum=1)
    R = g.get_int(p + "attention.kv_lora_rank", minimum=1)
    Dr = g.get_int(p + "rope.dimension_count", 0, required=False, minimum=0)
    k_mla = g.get_int(p + "attention.key_length_mla", minimum=1)
    Dv = g.get_int(p + "attention.value_length_mla", minimum=1)
    if k_mla <= Dr:
        g._fail(p + "attention.key_length_mla", k_mla, f"> rope.dimension_count ({Dr})")
    X = g.get_int(p + "expert_count", 0, required=False, minimum=0)
    top_k = g.get_int(p + "expert_used_count", 0 if X == 0 else None, required=X > 0, minimum=0)
    if X > 0 and not 1 <= top_k <= X:
        g._fail(p + "expert_used_count", top_k, f"1..expert_count ({X})")
    Fe = g.get_int(p + "expert_feed_forward_length", minimum=1 if X else 0)
    S = g.get_int(p + "expert_shared_count", minimum=0)
    n_dense = g.get_int(p + "leading_dense_block_count", 0, required=False, minimum=0)
    if n_dense > n_layer:
        g._fail(p + "leading_dense_block_count", n_dense, f"<= block_count ({n_layer})")
    F = g.get_int(p + "feed_forward_length", None if n_dense else Fe or 1, required=n_dense > 0, minimum=1)
    gating = g.get_int(p + "expert_gating_func", minimum=0)
    if gating != 2:
        g._fail(p + "expert_gating_func", gating, "2 (sigmoid)")
    scale = g.get_float(p + "expert_weights_scale", 0.0, required=False)
    if g.get_int(p + "expert_group_count", 0, required=False) > 1:
        g._fail(p + "expert_group_count", g.values[p + "expert_group_count"], "0 or 1 (grouped routing not supported)")
    names = g.tensors
    _cross_check(g, p, n_layer, E, H, D, kv)
    tokens = g.values.get("tokenizer.ggml.tokens")
    V = len(tokens) if isinstance(tokens, list) else g.get_int(p + "vocab_size", None, required=False)
    if V is None:
        emb = names.get("token_embd.weight")
        V = emb.shape[0] if emb is not None else None
    if not V:
        g._fail("tokenizer.ggml.tokens", None, "a token list (or vocab_size) giving the vocabulary size")
    q_lora = None
    if any(f"blk.{i}.attn_q_a_norm.weight" in names for i in range(n_layer)):
        if not k3:
            raise GGUFFormatError(f"{g.source}: tensor 'attn_q_a_norm' (q-LoRA MLA) is not supported for kimi-linear")
        q_lora = names[next(f"blk.{i}.attn_q_a_norm.weight" for i in range(n_layer)
                             if f"blk.{i}.attn_q_a_norm.weight" in names)].shape[-1]
    bos = g.get_int("tokenizer.ggml.bos_token_id", None, required=False)
    eos = g.get_int("tokenizer.ggml.eos_token_id", None, required=False)
    kw = dict(
        vocab_size=V, hidden_size=E, num_hidden_layers=n_layer, num_attention_heads=H, intermediate_size=F,
        rms_norm_eps=eps, kda_layers=[i for i in range(n_layer) if kv[i] == 0], kda_num_heads=H, kda_head_dim=D,
        short_conv_kernel_size=K, kv_lora_rank=R, qk_nope_head_dim=k_mla - Dr, qk_rope_head_dim=Dr, v_head_dim=Dv,
        q_lora_rank=q_lora, num_experts=X, num_experts_per_token=max(top_k, 1), moe_intermediate_size=Fe,
        num_shared_experts=S, routed_scaling_factor=scale if scale not in (0.0,) else 1.0,
        use_grouped_topk=False, num_expert_group=1, topk_group=1, first_k_dense_replace=n_dense, moe_layer_freq=1,
        tie_word_embeddings="output.weight" not in names,
        # llama.cpp uses rms_norm_eps for every norm, and x / max(|x|, eps) for the KDA q/k L2 norm
        mla_kv_norm_eps=eps, mla_q_norm_eps=eps, kda_l2_eps=eps * eps,
        bos_token_id=bos, eos_token_id=[eos] if eos is not None else [], model_max_length=context,
    )
    if not k3:
        kw.update(model_type="kimi_linear", moe_renormalize=True)
        return KimiConfig(**kw)
    lb = g.get_float(p + "kda.gate_lower_bound", None, required=False)
    if lb is not None and not lb < 0:
        g._fail(p + "kda.gate_lower_bound", lb, "a negative float")
    Lt = g.get_int(p + "expert_latent_length", 0, required=False, minimum=0)
    block = g.get_int(p + "attn_res.block_size", minimum=0)
    if block > n_layer:
        g._fail(p + "attn_res.block_size", block, f"0..block_count ({n_layer})")
    beta = g.get_float(p + "activation.situ_beta")
    lin = g.get_float(p + "activation.situ_linear_beta")
    if not beta > 0:
        g._fail(p + "activation.situ_beta", beta, "a positive float")
    kw.update(
        model_type="kimi_k3", moe_renormalize=g.get_bool(p + "expert_weights_norm", False), hidden_act="situ",
        situ_beta=beta, situ_linear_beta=lin if lin > 0 else None,
        mla_use_output_gate=any(f"blk.{i}.attn_gate.weight" in names for i in range(n_layer)),
        kda_full_rank_gate=True, kda_gate_lower_bound=lb, routed_expert_hidden_size=Lt or None,
        latent_moe_use_norm=bool(Lt) and any(f"blk.{i}.ffn_routed_norm.weight" in names for i in range(n_layer)),
        attn_res_block_size=block or None,
    )
    return KimiConfig(**kw)


def _cross_check(g: GGUFFile, p: str, n_layer: int, E: int, H: int, D: int, kv: list) -> None:
    """Metadata sizes against the tensor shapes, so a wrong key is named (not just the first mismatching tensor)."""
    t = g.tensors.get("token_embd.weight")
    if t is not None and t.shape[-1] != E:
        g._fail(p + "embedding_length", E, f"{t.shape[-1]} (tensor '{t.name}' has ne {list(reversed(t.shape))})")
    for i in range(n_layer):
        if kv[i] != 0:
            continue
        t = g.tensors.get(f"blk.{i}.ssm_dt.bias")
        if t is not None and int(np.prod(t.shape)) != H * D:
            got = int(np.prod(t.shape))
            exp = f"{got // H} (tensor '{t.name}' has {got} = head_count {H} x head_dim elements)" if got % H == 0 \
                else f"head_count {H} x kda.head_dim == {got} (tensor '{t.name}')"
            g._fail(p + "kda.head_dim", D, exp)
        break


def layer_prefix(cfg: KimiConfig) -> str:
    return "language_model." if cfg.is_k3 else ""


def _expect(info: TensorInfo, shape: tuple, source: str, *, loose: bool = False) -> None:
    """Exact numpy shape, or (loose) same element count ignoring size-1 dims."""
    got = tuple(info.shape)
    ok = got == tuple(shape)
    if not ok and loose:
        ok = tuple(d for d in got if d != 1) == tuple(d for d in shape if d != 1)
    if not ok:
        raise GGUFFormatError(
            f"{source}: tensor '{info.name}' has ne {list(reversed(got))} (numpy {got}); "
            f"expected numpy {tuple(shape)} (ne {list(reversed(shape))})"
        )


class Plan:
    """What to load: param name -> (TensorInfo, transform) for direct tensors, plus special builders."""

    def __init__(self):
        self.direct: dict[str, TensorInfo] = {}  # param -> tensor, taken as is (may be quantized)
        self.built: dict[str, Callable[[Callable[[TensorInfo], np.ndarray]], np.ndarray]] = {}
        self.ones: dict[str, tuple] = {}


def plan_tensors(g: GGUFFile, cfg: KimiConfig, expected: dict[str, tuple]) -> Plan:
    """Map every GGUF tensor to a model parameter, checking names and shapes against ``expected`` (param -> shape).

    Unknown, missing and wrongly shaped tensors raise GGUFFormatError naming them.
    """
    src = g.source
    pre = layer_prefix(cfg)
    plan = Plan()
    unknown, used = [], set()
    n_layer = cfg.num_hidden_layers
    H, D, K = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    P = H * D
    conv: dict[int, dict[str, TensorInfo]] = {}

    def put(param: str, info: TensorInfo, loose: bool = False):
        if param not in expected:
            unknown.append(f"{info.name} (-> {param}, which this config has no parameter for)")
            return
        _expect(info, expected[param], src, loose=loose)
        plan.direct[param] = info
        used.add(param)

    for name, info in g.tensors.items():
        _check_type(info, src)
        if name == "token_embd.weight":
            put(pre + "model.embed_tokens.weight", info)
        elif name == "output_norm.weight":
            if info.type_name not in FLOAT_TYPES:
                raise GGUFFormatError(f"{src}: tensor '{name}' (a 1-D norm) has type {info.type_name}; "
                                      f"expected one of {FLOAT_TYPES}")
            put(pre + "model.norm.weight", info)
        elif name == "output.weight":
            put(pre + "lm_head.weight", info)
        elif name == "output_res_score.weight" and cfg.is_k3:
            _res(plan, pre + "model.output_attn_res", info, expected, src, used, unknown)
        elif name.startswith("blk."):
            parts = name.split(".", 2)
            if len(parts) < 3 or not parts[1].isdigit() or int(parts[1]) >= n_layer:
                unknown.append(name)
                continue
            i, suffix = int(parts[1]), parts[2]
            lp = f"{pre}model.layers.{i}."
            kda = cfg.is_kda_layer(i)
            table = dict(COMMON)
            table.update(KDA if kda else MLA)
            table.update(DENSE if not cfg.is_moe_layer(i) else MOE)
            if (suffix in K3_ONLY and not cfg.is_k3) or (suffix in KL_ONLY and cfg.is_k3):
                unknown.append(name)
                continue
            if suffix in ("attn_res_score.weight", "ffn_res_score.weight"):
                mix = "self_attention_res" if suffix.startswith("attn") else "mlp_res"
                _res(plan, lp + mix, info, expected, src, used, unknown)
                continue
            if suffix not in table:
                unknown.append(name)
                continue
            param, kind = table[suffix]
            if kind == "vec" and info.type_name not in FLOAT_TYPES:
                raise GGUFFormatError(f"{src}: tensor '{name}' (a 1-D norm/bias) has type {info.type_name}; "
                                      f"expected one of {FLOAT_TYPES}")
            if suffix == "ssm_a":
                full = lp + param
                if full not in expected:
                    unknown.append(name)
                    continue
                if int(np.prod(info.shape)) != H or info.type_name not in FLOAT_TYPES:
                    raise GGUFFormatError(f"{src}: tensor '{name}' has ne {list(reversed(info.shape))} type "
                                          f"{info.type_name}; expected {H} float elements ([1,{H},1,1], [1,{H}] or [{H}])")

                def build_a(decode, info=info, name=name):
                    a = decode(info).reshape(-1).astype(np.float64)
                    if not np.all(a < 0):
                        raise GGUFFormatError(f"{src}: tensor '{name}' holds {a.tolist()[:8]}; expected -exp(A_log) < 0")
                    return np.log(-a).astype(np.float32)

                plan.built[full] = build_a
                used.add(full)
            elif suffix.startswith("ssm_conv1d_"):
                if tuple(d for d in info.shape if d != 1) != (P, K) or info.type_name not in FLOAT_TYPES:
                    raise GGUFFormatError(f"{src}: tensor '{name}' has ne {list(reversed(info.shape))} type "
                                          f"{info.type_name}; expected float ne [{K},1,{P},1] or [{K},1,{P}]")
                conv.setdefault(i, {})[suffix[11]] = info
            elif suffix == "attn_kv_b.weight":
                Dn, Dv, R = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
                _expect(info, (H * (Dn + Dv), R), src)

                def kv_split(decode, info=info, which=0, Dn=Dn, Dv=Dv, R=R):
                    w = decode(info).reshape(H, Dn + Dv, R)
                    return np.ascontiguousarray(w[:, :Dn, :].transpose(0, 2, 1) if which == 0 else w[:, Dn:, :])

                plan.built[lp + "self_attn.embed_q.weight"] = kv_split
                plan.built[lp + "self_attn.unembed_out.weight"] = lambda d, info=info: kv_split(d, info, 1)
                used.update({lp + "self_attn.embed_q.weight", lp + "self_attn.unembed_out.weight"})
            else:
                put(lp + param, info)
        else:
            unknown.append(name)

    for i, parts in conv.items():
        full = f"{pre}model.layers.{i}.self_attn.qkv_conv.weight"
        if set(parts) != {"q", "k", "v"}:
            raise GGUFFormatError(f"{src}: layer {i} has ssm_conv1d_{sorted(parts)}; expected all of q, k, v")

        def build_conv(decode, parts=parts):
            return np.concatenate([decode(parts[c]).reshape(P, K) for c in "qkv"], axis=0)

        plan.built[full] = build_conv
        used.add(full)

    missing = [f"{k} {tuple(v)}" for k, v in expected.items() if k not in used]
    problems = []
    if unknown:
        problems.append("unknown tensors: " + ", ".join(unknown[:10]) + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""))
    if missing:
        problems.append("missing tensors for parameters (expected shape): " + ", ".join(missing[:10])
                        + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))
    if problems:
        raise GGUFFormatError(f"{src}: tensors do not match the {cfg.model_type} model described by the metadata: "
                              + " | ".join(problems))
    return plan


def _check_type(info: TensorInfo, source: str) -> None:
    """The tensor's ggml type is one ``quant.to_mlx`` can convert (checked before any weight is read)."""
    from .quant import GGML_BLOCKS, SUPPORTED_EXACT, SUPPORTED_FLOAT

    if info.qtype not in SUPPORTED_FLOAT + SUPPORTED_EXACT + GGML_BLOCKS:
        supported = ", ".join(t.name for t in SUPPORTED_FLOAT + SUPPORTED_EXACT + GGML_BLOCKS)
        raise GGUFFormatError(f"{source}: tensor '{info.name}' has ggml type {info.type_name}, which cannot be "
                              f"loaded; expected one of {supported}")


def _res(plan: Plan, mix: str, info: TensorInfo, expected, src, used, unknown) -> None:
    norm, proj = mix + ".norm.weight", mix + ".proj.weight"
    if norm not in expected:
        unknown.append(info.name)
        return
    if info.type_name not in FLOAT_TYPES:
        raise GGUFFormatError(f"{src}: tensor '{info.name}' (a 1-D score) has type {info.type_name}; "
                              f"expected one of {FLOAT_TYPES}")
    _expect(info, expected[norm], src)
    plan.direct[norm] = info  # score = norm ⊙ proj[0]: norm := score, proj := ones
    plan.ones[proj] = tuple(expected[proj])
    used.update({norm, proj})


# ---------------------------------------------------------------------------------------------------- loading


def decode_float(info: TensorInfo) -> np.ndarray:
    """Any supported GGUF tensor -> its exact float32 values as a numpy array in numpy shape (the GGML-block types by
    gguf-py's dequantization; the others through their exact MLX layout)."""
    import mlx.core as mx

    from .quant import GGML_BLOCKS, GGUFQuantError, dequantize_exact

    try:
        if info.qtype in GGML_BLOCKS:
            return dequantize_exact(info.name, info.qtype, info.raw(), tuple(info.shape))
        layout = to_mlx(info.name, info.qtype, info.raw(), tuple(info.shape))
    except GGUFQuantError as e:
        raise GGUFFormatError(f"{info.file}: {e}") from None
    w = layout["weight"]
    if "scales" in layout:
        w = mx.dequantize(w, layout["scales"], layout.get("biases"), group_size=layout["group_size"],
                          bits=layout["bits"], mode=layout["mode"], dtype=mx.float32)
    return np.array(w.astype(mx.float32)).reshape(info.shape)
