"""NoPE multi-head latent attention (spec §1.5).

Per head, q/k have ``qk_nope + qk_rope`` dims (the "rope" part is never rotated: NoPE), v has ``v_head_dim``; the
softmax scale is ``(qk_nope + qk_rope) ** -0.5``. Only the normalised latent ``c_kv`` and the shared ``k_pe`` are
cached. ``kv_b_proj`` is stored split (as mlx-lm does) into ``embed_q.weight: [H, r, qk_nope]`` (= W_kb^T) and
``unembed_out.weight: [H, v_head_dim, r]`` (= W_vb); attention over the cache (``ops.mla_attention``) runs absorbed
in latent space for decode and per-head expanded for prefill, in key blocks with an online softmax past one block.
Kimi-K3 adds q-LoRA (``q_a_proj`` -> ``q_a_layernorm`` (eps ``mla_q_norm_eps``, 1e-6) -> ``q_b_proj``) and a sigmoid
output gate ``g_proj`` applied to the block input x, multiplied into the concatenated heads before ``o_proj``.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.mla import MultiLinear

from ..cache import MLALatentCache
from ..config import KimiConfig
from ..ops.mla_attention import Mask, mla_attention
from .norm import RMSNorm


class KimiMLA(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.num_heads = H = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        self.key_block = None  # keys per attention block (ops/mla_attention.py; None: auto_key_block); tests set it
        hidden = cfg.hidden_size
        q_dim = H * (self.nope + self.rope)
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=cfg.mla_q_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, eps=cfg.mla_kv_norm_eps)
        self.embed_q = MultiLinear(self.nope, self.rank, H)
        self.unembed_out = MultiLinear(self.rank, self.v_dim, H)
        self.o_proj = nn.Linear(H * self.v_dim, hidden, bias=False)
        if cfg.mla_use_output_gate:
            self.g_proj = nn.Linear(hidden, H * self.v_dim, bias=False)

    def _q(self, x: mx.array) -> mx.array:
        if "q_proj" in self:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def __call__(
        self, x: mx.array, mask: Mask = None, cache: Optional[MLALatentCache] = None
    ) -> mx.array:
        """x: [B, T, hidden]; mask: None (single query), "causal", ``LeftPaddedCausal`` or [B, 1, T, S] bool (True = may
        attend)."""
        B, T, _ = x.shape
        q = self._q(x).reshape(B, T, self.num_heads, self.nope + self.rope).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [self.nope], axis=-1)
        kv_latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.rank], axis=-1)
        kv_latent = self.kv_a_layernorm(kv_latent)[:, None]
        k_pe = k_pe[:, None]
        if cache is not None:
            kv_latent, k_pe = cache.update_and_fetch(kv_latent, k_pe)
        out = mla_attention(
            q_nope, q_pe, kv_latent, k_pe, self.embed_q, self.unembed_out, self.scale, mask, key_block=self.key_block
        )
        out = out.transpose(0, 2, 1, 3).reshape(B, T, -1)
        if "g_proj" in self:
            out = out * mx.sigmoid(self.g_proj(x))
        return self.o_proj(out)
