"""Kimi Linear (``KimiLinearForCausalLM``): hybrid KDA / NoPE-MLA decoder with sigmoid-routed MoE.

Follows mlx-lm's model protocol: ``model(inputs [B, T] int, cache) -> logits [B, T, vocab]``, ``model.layers``,
``make_cache()``, ``sanitize(weights)``; parameter paths match mlx-lm's ``kimi_linear`` (LoRA adapters carry over).
An id outside ``[0, vocab_size)`` raises ``TokenIdError`` (``validation.check_token_ids``) before any layer runs,
except in one-token steps that continue a cache (decode: the generators check prompts and feed their own samples).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache import make_cache
from ..config import KimiConfig
from ..convert.hf import kimi_linear_to_mlx
from ..layers.kda import KimiDeltaAttention
from ..layers.mla import KimiMLA
from ..layers.moe import MLP, SparseMoE, make_activation
from ..layers.norm import RMSNorm
from ..layers.residual import Boundary, ResidualSum, Stream
from ..ops.mla_attention import LeftPaddedCausal, Mask
from ..validation import check_token_ids


class DecoderLayer(nn.Module):
    """Pre-norm block on a ``ResidualSum``: h += mixer(norm(h)); h += ffn(norm(h))."""

    def __init__(self, cfg: KimiConfig, index: int, fused_qkv: bool = False):
        super().__init__()
        self.is_linear = cfg.is_kda_layer(index)
        self.self_attn = KimiDeltaAttention(cfg, fused_qkv) if self.is_linear else KimiMLA(cfg)
        if cfg.is_moe_layer(index):
            self.mlp = SparseMoE(cfg)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, make_activation(cfg))
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, stream: ResidualSum, mask, cache=None) -> ResidualSum:
        """mask: the KDA or MLA mask of ``layer_masks``; cache: this layer's cache or None."""
        h = stream.h + self.self_attn(self.input_layernorm(stream.h), mask, cache)
        stream.h = h + self.mlp(self.post_attention_layernorm(h))
        return stream


def attention_mask(T: int, offset: int, left_padding: Optional[mx.array]) -> Mask:
    """Mask for T new queries over offset+T keys: None (one unpadded query), "causal" (no padding; SDPA aligns it
    to the last key), or ``LeftPaddedCausal`` for a left-padded batch (padded keys hidden, a padded query still sees
    itself; ``mla_attention`` builds it one key block at a time)."""
    if left_padding is None:
        return None if T == 1 else "causal"
    return LeftPaddedCausal(left_padding)


def layer_masks(T: int, cache) -> tuple[Optional[mx.array], Optional[mx.array]]:
    """(KDA mask [B, T] or None, MLA mask (see ``attention_mask``)) for T new tokens after ``cache``."""
    if cache is None:
        return None, attention_mask(T, 0, None)
    return cache[0].valid_mask(T), attention_mask(T, cache[0].offset, cache[0].left_padding)


class KimiLinearModel(nn.Module):
    """Embedding, decoder layers, final norm.

    ``__call__`` is the one forward loop of every text model and pipeline stage: ``enter`` starts the residual stream,
    each layer maps ``(stream, mask, cache) -> stream``, ``leave`` ends it with the hidden state before the final norm.
    A text model with another residual stream (Kimi-K3's AttnRes) sets ``layer_class`` and overrides ``new_stream``,
    ``final_hidden`` and ``boundary``; a pipeline stage (``parallel.pipeline``) overrides ``enter`` and ``leave``.
    """

    layer_class = DecoderLayer

    def __init__(self, cfg: KimiConfig, fused_qkv: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [self.layer_class(cfg, i, fused_qkv) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None) -> mx.array:
        """inputs [B, T] token ids, or input_embeddings [B, T, hidden] in their place; cache: one per layer or None
        -> the normed final hidden state [B, T, hidden]."""
        T = (inputs if input_embeddings is None else input_embeddings).shape[1]
        stream = self.enter(inputs, input_embeddings)
        kda_mask, attn_mask = layer_masks(T, cache)
        for layer, layer_cache in zip(self.layers, cache or [None] * len(self.layers)):
            stream = layer(stream, kda_mask if layer.is_linear else attn_mask, layer_cache)
        return self.norm(self.leave(stream, cache))

    def embed(self, inputs: mx.array) -> mx.array:
        """Token ids [B, T] -> embeddings [B, T, hidden]: what ``input_embeddings`` replaces."""
        return self.embed_tokens(inputs)

    def enter(self, inputs: mx.array, input_embeddings: Optional[mx.array]) -> Stream:
        """The residual stream before the first layer: ``inputs`` embedded, or ``input_embeddings``."""
        return self.new_stream(self.embed(inputs) if input_embeddings is None else input_embeddings)

    def leave(self, stream: Stream, cache) -> mx.array:
        """The hidden state [B, T, hidden] after the last layer (``cache``: the layers' caches)."""
        return self.final_hidden(stream)

    def new_stream(self, h: mx.array) -> Stream:
        """The residual stream that starts with h [B, T, hidden]."""
        return ResidualSum(h)

    def final_hidden(self, stream: Stream) -> mx.array:
        """The stream's hidden state after the last layer [B, T, hidden], before the final norm."""
        return stream.h

    def boundary(self, start: int) -> Boundary:
        """The residual stream entering layer ``start`` (what a pipeline stage starting there receives). The dtype is
        the embedding's output dtype (lazy: nothing is evaluated)."""
        dtype = self.embed_tokens(mx.zeros((1, 1), mx.int32)).dtype
        return Boundary(ResidualSum, self.norm.weight.shape[0], dtype)


class Model(nn.Module):
    """Causal LM head on top of ``text_model`` (``KimiLinearModel``; Kimi-K3 swaps in its own)."""

    text_model = KimiLinearModel

    def __init__(self, cfg: KimiConfig, fused_qkv: bool = False):
        super().__init__()
        self.args = cfg
        self.model_type = cfg.model_type
        self.model = self.text_model(cfg, fused_qkv)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None) -> mx.array:
        if input_embeddings is None and (cache is None or inputs.shape[-1] > 1):
            # a one-token step that continues a cache is a generator's own sample: no host sync per decode step
            check_token_ids(inputs, self.args.vocab_size)
        h = self.model(inputs, cache, input_embeddings)
        if "lm_head" in self:
            return self.lm_head(h)
        return self.model.embed_tokens.as_linear(h)

    def embed(self, inputs: mx.array) -> mx.array:
        """Token ids [B, T] -> the text model's input embeddings [B, T, hidden] (to edit and pass back as
        ``input_embeddings``)."""
        return self.model.embed(inputs)

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self, left_padding: Optional[list[int]] = None, max_checkpoints: int = 8,
                   kv_bits: Optional[int] = None, kv_group_size: int = 64):
        """A ``HybridCache`` of per-layer caches (KDA or MLA latent) keeping up to ``max_checkpoints`` checkpoints;
        ``left_padding`` for a ragged, left-padded batch; ``kv_bits`` (8 or 4) / ``kv_group_size`` (32, 64, 128)
        quantize the MLA latent cache."""
        return make_cache([layer.is_linear for layer in self.layers], left_padding, max_checkpoints, kv_bits,
                          kv_group_size)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map Moonshot's original or mlx-lm's key layout to this model's parameters."""
        return kimi_linear_to_mlx(weights, self.args)

    @property
    def cast_predicate(self):
        """``casts(path)``: True for the parameters cast to the model dtype (mlx-lm's convention), False for those
        that stay float32 whatever it is (the router bias, ``A_log``, ``dt_bias``, the short conv)."""

        def casts(path: str) -> bool:
            return not path.endswith(("e_score_correction_bias", "A_log", "dt_bias", "qkv_conv.weight"))

        return casts

    @property
    def quant_predicate(self):
        """``quantizes(path, module)``: True for the modules that may be quantized (Linear / Embedding / Switch
        layers), False for the routers, AttnRes score projections and norms (they stay float)."""

        def quantizes(path: str, module: nn.Module) -> bool:
            return not path.endswith(("mlp.gate", "_res.proj")) and hasattr(module, "to_quantized")

        return quantizes
