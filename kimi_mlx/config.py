"""Typed, validated configuration for Kimi Linear and Kimi-K3 (HF ``config.json``).

- Kimi Linear: ``model_type: kimi_linear`` (``KimiLinearForCausalLM``), the config at the top level.
- Kimi-K3: ``model_type: kimi_k3`` (``KimiK3ForConditionalGeneration``) with the text model nested under
  ``text_config`` (whose own ``model_type`` says kimi_linear): routing is on the top level.

Conventions (see ../shared/spec/kimi_spec.md §1.2, §2.1 and §6):
- ``linear_attn_config.kda_layers`` / ``full_attn_layers`` are 1-based in the file; ``KimiConfig.kda_layers``
  holds them 0-based.
- ``head_dim`` (72 in the released Kimi Linear) is a legacy decoy and is ignored: KDA uses ``kda_head_dim``, MLA uses
  ``qk_nope_head_dim + qk_rope_head_dim`` for q/k (and for the softmax scale) and ``v_head_dim`` for v.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Optional

# MLX affine quantization a model can be loaded or planned with (``load(quantize=...)``): bits and group sizes
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


class ConfigError(ValueError):
    """A config.json we cannot run: names the file and key, says what was found and what was expected."""


def _fail(source: str, key: str, found: Any, expected: str) -> None:
    raise ConfigError(f"{source}: config key '{key}' is {found!r}; expected {expected}")


@dataclass
class KimiConfig:
    """Kimi Linear / Kimi-K3 text-model hyper-parameters, 0-based layer schedule. K3-only features default off."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    rms_norm_eps: float
    # KDA (linear attention)
    kda_layers: list[int]
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    # MLA (NoPE)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int] = None
    # MoE
    num_experts: int = 0
    num_experts_per_token: int = 1
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    tie_word_embeddings: bool = False
    mla_kv_norm_eps: float = 1e-6
    mla_q_norm_eps: float = 1e-6
    kda_l2_eps: float = 1e-6
    bos_token_id: Optional[int] = None
    eos_token_id: list[int] = field(default_factory=list)
    model_max_length: Optional[int] = None  # longest context the model takes (None: not given)
    model_type: str = "kimi_linear"
    # Kimi-K3 features
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "situ"
    situ_beta: float = 1.0
    situ_linear_beta: Optional[float] = None  # None: the up projection is not soft-clipped
    mla_use_output_gate: bool = False
    kda_full_rank_gate: bool = False
    kda_gate_lower_bound: Optional[float] = None  # set: g = lb * sigmoid(exp(A_log) * (f + dt_bias))
    routed_expert_hidden_size: Optional[int] = None  # set: latent MoE
    latent_moe_use_norm: bool = False
    attn_res_block_size: Optional[int] = None  # set: cross-layer attention residuals, counted in decoder layers

    @property
    def is_k3(self) -> bool:
        return self.model_type == "kimi_k3"

    def is_kda_layer(self, i: int) -> bool:
        return i in self.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @classmethod
    def from_hf(cls, raw: dict, source: str = "config.json") -> "KimiConfig":
        """Route on the top-level ``model_type``: kimi_linear, or kimi_k3 with its nested ``text_config``."""
        model_type = raw.get("model_type")
        if model_type == "kimi_k3":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                _fail(source, "text_config", text, "an object holding the K3 text model config")
            return cls._parse(text, source, k3=True, prefix="text_config.")
        if model_type == "kimi_linear":
            return cls._parse(raw, source, k3=False, prefix="")
        _fail(source, "model_type", model_type, "'kimi_linear' or 'kimi_k3'")

    @classmethod
    def _parse(cls, raw: dict, source: str, k3: bool, prefix: str) -> "KimiConfig":
        def key(name: str) -> str:
            return prefix + name

        def need(name: str, kind=int, d: dict = raw, at: str = ""):
            full = key(at + name)
            if name not in d or d[name] is None:
                _fail(source, full, None, f"a {kind.__name__} (missing)")
            value = d[name]
            if kind is float and isinstance(value, Real) and not isinstance(value, bool):
                return float(value)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                _fail(source, full, value, f"a {kind.__name__}")
            return value

        def positive(name: str, value) -> int:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(source, key(name), value, "an integer >= 1")
            return value

        def k3_only(name: str, value, off) -> None:
            if not k3 and value not in (None, off):
                _fail(source, key(name), value, f"absent or {off!r} for kimi_linear (a Kimi-K3 feature)")

        if raw.get("mla_use_nope") is not True:
            _fail(source, key("mla_use_nope"), raw.get("mla_use_nope"), "true (only NoPE MLA is supported)")
        act = raw.get("hidden_act", "silu")
        if act not in (("silu", "situ") if k3 else ("silu",)):
            _fail(source, key("hidden_act"), act, "'silu' (SwiGLU)" + (" or 'situ'" if k3 else " for kimi_linear"))
        router = raw.get("moe_router_activation_func", "sigmoid")
        if router != "sigmoid":
            _fail(source, key("moe_router_activation_func"), router, "'sigmoid'")

        n_layers = positive("num_hidden_layers", need("num_hidden_layers"))
        lac = raw.get("linear_attn_config")
        if not isinstance(lac, dict):
            _fail(source, key("linear_attn_config"), lac,
                  "an object with kda_layers/full_attn_layers/num_heads/head_dim")
        p = "linear_attn_config."
        kda_1 = need("kda_layers", list, lac, p)
        full_1 = need("full_attn_layers", list, lac, p)
        for name, lst in (("kda_layers", kda_1), ("full_attn_layers", full_1)):
            bad = [i for i in lst if not isinstance(i, int) or not 1 <= i <= n_layers]
            if bad:
                _fail(source, key(p + name), lst, f"1-based layer numbers in 1..{n_layers} (bad: {bad})")
        overlap = sorted(set(kda_1) & set(full_1))
        missing = sorted(set(range(1, n_layers + 1)) - set(kda_1) - set(full_1))
        if overlap or missing:
            _fail(source, key(p + "kda_layers/full_attn_layers"), {"kda": kda_1, "full": full_1},
                  f"a partition of layers 1..{n_layers} (overlap {overlap}, uncovered {missing})")

        lower_bound = lac.get("gate_lower_bound")
        k3_only(p + "gate_lower_bound", lower_bound, None)
        if lower_bound is not None:
            if not isinstance(lower_bound, Real) or isinstance(lower_bound, bool) or not lower_bound < 0:
                _fail(source, key(p + "gate_lower_bound"), lower_bound, "a negative number (e.g. -5.0) or null")
            lower_bound = float(lower_bound)
        full_rank_gate = lac.get("use_full_rank_gate", False)
        k3_only(p + "use_full_rank_gate", full_rank_gate, False)
        if not isinstance(full_rank_gate, bool):
            _fail(source, key(p + "use_full_rank_gate"), full_rank_gate, "true or false")
        block = raw.get("attn_res_block_size")
        k3_only("attn_res_block_size", block, None)
        if block is not None:
            if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= n_layers:
                _fail(source, key("attn_res_block_size"), block, f"an integer in 1..num_hidden_layers ({n_layers})")
        latent = raw.get("routed_expert_hidden_size")
        k3_only("routed_expert_hidden_size", latent, None)
        if latent is not None:
            positive("routed_expert_hidden_size", latent)
        out_gate = raw.get("mla_use_output_gate", False)
        k3_only("mla_use_output_gate", out_gate, False)
        q_lora = raw.get("q_lora_rank")
        k3_only("q_lora_rank", q_lora, None)
        if q_lora is not None:
            positive("q_lora_rank", q_lora)
        situ_beta, situ_linear = 1.0, None
        if act == "situ":
            situ_beta = need("activation_situ_beta", float)
            situ_linear = raw.get("activation_situ_linear_beta")
            if situ_linear is not None:
                situ_linear = need("activation_situ_linear_beta", float)
            for name, value in (("activation_situ_beta", situ_beta), ("activation_situ_linear_beta", situ_linear)):
                if value is not None and not value > 0:
                    _fail(source, key(name), value, "a positive number")

        eos = raw.get("eos_token_id")
        eos_list = [eos] if isinstance(eos, int) else list(eos or [])
        n_experts = raw.get("num_experts") or 0
        context_key = next((k for k in ("model_max_length", "max_position_embeddings") if raw.get(k) is not None),
                           None)
        cfg = cls(
            vocab_size=positive("vocab_size", need("vocab_size")),
            hidden_size=positive("hidden_size", need("hidden_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=positive("num_attention_heads", need("num_attention_heads")),
            intermediate_size=positive("intermediate_size", need("intermediate_size")),
            rms_norm_eps=need("rms_norm_eps", float),
            kda_layers=sorted(i - 1 for i in kda_1),
            kda_num_heads=positive(p + "num_heads", need("num_heads", int, lac, p)),
            kda_head_dim=positive(p + "head_dim", need("head_dim", int, lac, p)),
            short_conv_kernel_size=positive(p + "short_conv_kernel_size", lac.get("short_conv_kernel_size", 4)),
            kv_lora_rank=positive("kv_lora_rank", need("kv_lora_rank")),
            qk_nope_head_dim=positive("qk_nope_head_dim", need("qk_nope_head_dim")),
            qk_rope_head_dim=need("qk_rope_head_dim"),
            v_head_dim=positive("v_head_dim", need("v_head_dim")),
            q_lora_rank=q_lora,
            num_experts=n_experts,
            num_experts_per_token=raw.get("num_experts_per_token", 1),
            moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
            num_shared_experts=raw.get("num_shared_experts") or 0,
            moe_renormalize=raw.get("moe_renormalize", True),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            use_grouped_topk=raw.get("use_grouped_topk", True),
            num_expert_group=raw.get("num_expert_group") or 1,
            topk_group=raw.get("topk_group") or 1,
            first_k_dense_replace=raw.get("first_k_dense_replace", 0),
            moe_layer_freq=raw.get("moe_layer_freq", 1) or 1,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_list,
            model_max_length=positive(context_key, raw[context_key]) if context_key else None,
            model_type="kimi_k3" if k3 else "kimi_linear",
            hidden_act=act,
            situ_beta=situ_beta,
            situ_linear_beta=situ_linear,
            mla_use_output_gate=bool(out_gate),
            kda_full_rank_gate=full_rank_gate,
            kda_gate_lower_bound=lower_bound,
            routed_expert_hidden_size=latent,
            latent_moe_use_norm=bool(raw.get("latent_moe_use_norm", False)) and latent is not None,
            attn_res_block_size=block,
        )
        # Optional norm eps overrides, written by `kimi-mlx convert` for GGUF sources (llama.cpp's conventions).
        for name in ("mla_kv_norm_eps", "mla_q_norm_eps", "kda_l2_eps"):
            if raw.get(name) is not None:
                value = need(name, float)
                if not value > 0:
                    _fail(source, key(name), value, "a positive number")
                setattr(cfg, name, value)
        if n_experts:
            positive("moe_intermediate_size", cfg.moe_intermediate_size)
            k = cfg.num_experts_per_token
            if not 1 <= k <= n_experts:
                _fail(source, key("num_experts_per_token"), k, f"1..num_experts ({n_experts})")
            if n_experts % cfg.num_expert_group:
                _fail(source, key("num_expert_group"), cfg.num_expert_group, f"a divisor of num_experts ({n_experts})")
            if not 1 <= cfg.topk_group <= cfg.num_expert_group:
                _fail(source, key("topk_group"), cfg.topk_group, f"1..num_expert_group ({cfg.num_expert_group})")
        return cfg
