"""Kimi-K3 ``patchmergerv2`` projector: merged tokens [n, kh*kw, D] -> image features [n, T].

post_norm(proj.2(gelu(proj.0(x)))) on x flattened to M = kh*kw*D (patch order inside a token (0,0),(0,1),(1,0),(1,1));
proj.0: M -> M, proj.2: M -> T, bias-free; GELU is the exact erf form (``projector_hidden_act: gelu``); post_norm is
RMSNorm(T, eps = projector_ln_eps). No pre-norm. Parameter names match the checkpoint's ``mm_projector.*`` tensors.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import VisionConfig


class Projector(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        m, t = cfg.merged_size, cfg.text_hidden_size
        self.proj = [nn.Linear(m, m, bias=False), nn.GELU(), nn.Linear(m, t, bias=False)]  # proj.0, proj.2
        self.post_norm = nn.RMSNorm(t, eps=cfg.projector_ln_eps)

    def __call__(self, merged: mx.array) -> mx.array:
        x = merged.reshape(merged.shape[0], -1)  # [n, M]
        for layer in self.proj:
            x = layer(x)  # [n, M] -> [n, M] -> [n, T]
        return self.post_norm(x)  # [n, T]
