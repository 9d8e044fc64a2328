"""Typed, validated configuration for Kimi Linear (HF ``config.json``, ``model_type: kimi_linear``).

Conventions (see ../shared/spec/kimi_spec.md §1.2 and §6):
- ``linear_attn_config.kda_layers`` / ``full_attn_layers`` are 1-based in the file; ``KimiLinearConfig.kda_layers``
  holds them 0-based.
- ``head_dim`` (72 in the released model) is a legacy decoy and is ignored: KDA uses ``kda_head_dim``, MLA uses
  ``qk_nope_head_dim + qk_rope_head_dim`` for q/k (and for the softmax scale) and ``v_head_dim`` for v.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """A config.json we cannot run: names the file and key, says what was found and what was expected."""


def _fail(source: str, key: str, found: Any, expected: str) -> None:
    raise ConfigError(f"{source}: config key '{key}' is {found!r}; expected {expected}")


@dataclass
class KimiLinearConfig:
    """Kimi Linear hyper-parameters, 0-based layer schedule."""

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
    kda_l2_eps: float = 1e-6
    bos_token_id: Optional[int] = None
    eos_token_id: list[int] = field(default_factory=list)
    model_type: str = "kimi_linear"

    def is_kda_layer(self, i: int) -> bool:
        return i in self.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def to_dict(self) -> dict:
        """Round-trippable HF-style dict (1-based layer lists), as written by our model writer."""
        d = asdict(self)
        kda = d.pop("kda_layers")
        d["linear_attn_config"] = {
            "kda_layers": [i + 1 for i in kda],
            "full_attn_layers": [i + 1 for i in range(self.num_hidden_layers) if i not in kda],
            "num_heads": d.pop("kda_num_heads"),
            "head_dim": d.pop("kda_head_dim"),
            "short_conv_kernel_size": d.pop("short_conv_kernel_size"),
        }
        d.pop("mla_kv_norm_eps")
        d.pop("kda_l2_eps")
        d["mla_use_nope"] = True
        d["hidden_act"] = "silu"
        d["moe_router_activation_func"] = "sigmoid"
        d["architectures"] = ["KimiLinearForCausalLM"]
        return d

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "KimiLinearConfig":
        """Parse and validate an HF Kimi Linear config dict; raise ConfigError naming the key on anything unsupported."""

        def need(key: str, kind=int, d: dict = raw, prefix: str = ""):
            if key not in d or d[key] is None:
                _fail(source, prefix + key, None, f"a {kind.__name__} (missing)")
            value = d[key]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
                _fail(source, prefix + key, value, f"a {kind.__name__}")
            return value

        def positive(key: str, value: int) -> int:
            if value < 1:
                _fail(source, key, value, "an integer >= 1")
            return value

        model_type = raw.get("model_type")
        if model_type != "kimi_linear":
            _fail(source, "model_type", model_type, "'kimi_linear' (Kimi-K3 configs are routed elsewhere)")
        if raw.get("mla_use_nope") is not True:
            _fail(source, "mla_use_nope", raw.get("mla_use_nope"), "true (only NoPE MLA is supported)")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            _fail(source, "hidden_act", act, "'silu' (SwiGLU) for kimi_linear")
        router = raw.get("moe_router_activation_func", "sigmoid")
        if router != "sigmoid":
            _fail(source, "moe_router_activation_func", router, "'sigmoid'")

        n_layers = positive("num_hidden_layers", need("num_hidden_layers"))
        lac = raw.get("linear_attn_config")
        if not isinstance(lac, dict):
            _fail(source, "linear_attn_config", lac, "an object with kda_layers/full_attn_layers/num_heads/head_dim")
        p = "linear_attn_config."
        kda_1 = need("kda_layers", list, lac, p)
        full_1 = need("full_attn_layers", list, lac, p)
        for name, lst in (("kda_layers", kda_1), ("full_attn_layers", full_1)):
            bad = [i for i in lst if not isinstance(i, int) or not 1 <= i <= n_layers]
            if bad:
                _fail(source, p + name, lst, f"1-based layer numbers in 1..{n_layers} (bad: {bad})")
        overlap = sorted(set(kda_1) & set(full_1))
        missing = sorted(set(range(1, n_layers + 1)) - set(kda_1) - set(full_1))
        if overlap or missing:
            _fail(source, p + "kda_layers/full_attn_layers", {"kda": kda_1, "full": full_1},
                  f"a partition of layers 1..{n_layers} (overlap {overlap}, uncovered {missing})")
        if lac.get("gate_lower_bound") is not None:
            _fail(source, p + "gate_lower_bound", lac["gate_lower_bound"], "absent for kimi_linear (K3 only)")
        if lac.get("use_full_rank_gate"):
            _fail(source, p + "use_full_rank_gate", True, "false/absent for kimi_linear (K3 only)")

        eos = raw.get("eos_token_id")
        eos_list = [eos] if isinstance(eos, int) else list(eos or [])
        n_experts = raw.get("num_experts") or 0
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
            q_lora_rank=raw.get("q_lora_rank"),
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
        )
        if cfg.q_lora_rank is not None:
            _fail(source, "q_lora_rank", cfg.q_lora_rank, "null for kimi_linear (q-LoRA MLA is a Kimi-K3 feature)")
        if n_experts:
            positive("moe_intermediate_size", cfg.moe_intermediate_size)
            k = cfg.num_experts_per_token
            if not 1 <= k <= n_experts:
                _fail(source, "num_experts_per_token", k, f"1..num_experts ({n_experts})")
            if n_experts % cfg.num_expert_group:
                _fail(source, "num_expert_group", cfg.num_expert_group, f"a divisor of num_experts ({n_experts})")
            if not 1 <= cfg.topk_group <= cfg.num_expert_group:
                _fail(source, "topk_group", cfg.topk_group, f"1..num_expert_group ({cfg.num_expert_group})")
        return cfg
