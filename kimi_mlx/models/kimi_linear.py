"""Kimi Linear (``KimiLinearForCausalLM``): hybrid KDA / NoPE-MLA decoder with sigmoid-routed MoE.

Follows mlx-lm's model protocol: ``model(inputs [B, T] int, cache) -> logits [B, T, vocab]``, ``model.layers``,
``make_cache()``, ``sanitize(weights)``; parameter paths match mlx-lm's ``kimi_linear`` (LoRA adapters carry over).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache import make_cache
from ..config import KimiLinearConfig
from ..convert.hf import kimi_linear_to_mlx
from ..layers.kda import KimiDeltaAttention
from ..layers.mla import KimiMLA
from ..layers.moe import MLP, SparseMoE


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + mixer(norm(x)); out = h + ffn(norm(h))."""

    def __init__(self, cfg: KimiLinearConfig, index: int, fused_qkv: bool = False):
        super().__init__()
        self.is_linear = cfg.is_kda_layer(index)
        self.self_attn = KimiDeltaAttention(cfg, fused_qkv) if self.is_linear else KimiMLA(cfg)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array], cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def attention_mask(
    T: int, offset: int, left_padding: Optional[mx.array]
) -> Optional[mx.array]:
    """Causal mask over cached + new keys, [B or 1, 1, T, offset+T] bool (None for one unpadded query).

    Padded keys (position < left_padding[b]) are hidden; a padded query still sees itself so no row is empty.
    """
    if T == 1 and left_padding is None:
        return None
    q_pos = offset + mx.arange(T)
    k_pos = mx.arange(offset + T)
    mask = k_pos[None, :] <= q_pos[:, None]
    if left_padding is None:
        return mask[None, None]
    real_key = k_pos[None, None, :] >= left_padding[:, None, None]
    itself = k_pos[None, None, :] == q_pos[None, :, None]
    return (mask[None] & (real_key | itself))[:, None]


class KimiLinearModel(nn.Module):
    def __init__(self, cfg: KimiLinearConfig, fused_qkv: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, i, fused_qkv) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None) -> mx.array:
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        T = h.shape[1]
        if cache is None:
            cache = [None] * len(self.layers)
            offset, kda_mask, left_padding = 0, None, None
        else:
            offset, left_padding = cache[0].offset, cache[0].left_padding
            kda_mask = cache[0].valid_mask(T)
        attn_mask = attention_mask(T, offset, left_padding)
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, kda_mask if layer.is_linear else attn_mask, layer_cache)
        return self.norm(h)


class Model(nn.Module):
    """Causal LM head on top of ``KimiLinearModel``."""

    def __init__(self, cfg: KimiLinearConfig, fused_qkv: bool = False):
        super().__init__()
        self.args = cfg
        self.model_type = cfg.model_type
        self.model = KimiLinearModel(cfg, fused_qkv)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None) -> mx.array:
        h = self.model(inputs, cache, input_embeddings)
        if "lm_head" in self:
            return self.lm_head(h)
        return self.model.embed_tokens.as_linear(h)

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self, left_padding: Optional[list[int]] = None):
        """Per-layer caches (KDA or MLA latent); ``left_padding`` for a ragged, left-padded batch."""
        return make_cache([layer.is_linear for layer in self.layers], left_padding)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map Moonshot's original or mlx-lm's key layout to this model's parameters."""
        return kimi_linear_to_mlx(weights, self.args)

    @property
    def cast_predicate(self):
        """Parameters that keep float32 whatever the model dtype."""

        def keep_dtype(path: str) -> bool:
            return not path.endswith(("e_score_correction_bias", "A_log", "dt_bias", "qkv_conv.weight"))

        return keep_dtype

    @property
    def quant_predicate(self):
        """Routers and norms stay unquantized (only Linear/Embedding/Switch layers are considered at all)."""

        def predicate(path: str, module: nn.Module) -> bool:
            return not path.endswith("mlp.gate") and hasattr(module, "to_quantized")

        return predicate
