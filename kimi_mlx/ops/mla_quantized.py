"""MLA attention against a quantized latent cache (``cache.QuantizedMLALatentCache``), in key blocks with an online
softmax, like ``ops.mla_attention`` (same shapes, mask and absorbed/expanded choice), without ever dequantizing the
whole cache.

A latent part (``kv_latent`` [B, 1, S, r], ``k_pe`` [B, 1, S, dr]) is either a float array or the
``mx.quantize`` triple (codes [B, 1, S, w*bits/32] uint32, scales and biases [B, 1, S, w/group]) of the cache.

- Absorbed (decode and chunks up to ``ABSORBED_MAX_QUERIES`` queries): per key block, scores of q·W_kb against the
  quantized ``c_kv`` and of q_pe against ``k_pe`` by ``mx.quantized_matmul(..., transpose=True)``, and the weighted
  sum of the quantized ``c_kv`` by ``mx.quantized_matmul(..., transpose=False)``: the output stays in latent space
  until W_vb. Nothing is dequantized.
- Expanded (longer prefill chunks): each key block is dequantized (``key_block`` positions at a time: bounded
  memory), then expanded per head as in the float path.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from .mla_attention import ABSORBED_MAX_QUERIES, KEY_BLOCK, Mask, _block_mask


def _qmm(x: mx.array, part, transpose: bool, group_size: int, bits: int) -> mx.array:
    """``x @ part.T`` (transpose) or ``x @ part`` for a float part or a quantized triple."""
    if isinstance(part, tuple):
        return mx.quantized_matmul(x, *part, transpose=transpose, group_size=group_size, bits=bits)
    return x @ (part.swapaxes(-1, -2) if transpose else part)


def _dequantize(part, group_size: int, bits: int) -> mx.array:
    if isinstance(part, tuple):
        return mx.dequantize(*part, group_size=group_size, bits=bits)
    return part


def _block(part, s0: int, s1: int):
    return tuple(a[:, :, s0:s1] for a in part) if isinstance(part, tuple) else part[:, :, s0:s1]


def _after(parts: tuple, done: list[mx.array]) -> tuple:
    """``parts`` (float arrays or quantized triples) made to wait for ``done``: the previous block's running state,
    so the lazy graph does not compute (and hold) every block's scores first."""
    flat = [a for p in parts for a in (p if isinstance(p, tuple) else (p,))]
    flat = iter(mx.depends(flat, done))
    return tuple(tuple(next(flat) for _ in p) if isinstance(p, tuple) else next(flat) for p in parts)


def quantized_mla_attention(
    q_nope: mx.array,
    q_pe: mx.array,
    kv_latent,
    k_pe,
    embed_q: Callable,
    unembed_out: Callable,
    scale: float,
    mask: Mask = None,
    *,
    group_size: int,
    bits: int,
    key_block: int = KEY_BLOCK,
) -> mx.array:
    """Attention output [B, H, T, dv] of ``ops.mla_attention`` for quantized latent parts (see the module doc)."""
    B, H, T, _ = q_nope.shape
    first = kv_latent[0] if isinstance(kv_latent, tuple) else kv_latent
    S = first.shape[2]
    dtype = q_nope.dtype
    absorbed = T <= ABSORBED_MAX_QUERIES
    if absorbed:
        # one shared latent "head": heads folded into the query axis, so each block is one matmul for all heads
        q_lat = (embed_q(q_nope) * scale).reshape(B, 1, H * T, -1)
        q_rot = (q_pe * scale).reshape(B, 1, H * T, -1)
    else:
        q_nope, q_pe = q_nope * scale, q_pe * scale
    m = acc = den = None
    for s0 in range(0, S, key_block):
        s1 = min(s0 + key_block, S)
        c, kr = _block(kv_latent, s0, s1), _block(k_pe, s0, s1)
        if acc is not None:
            c, kr = _after((c, kr), [m, den, acc])
        if absorbed:
            s = _qmm(q_lat, c, True, group_size, bits) + _qmm(q_rot, kr, True, group_size, bits)
            s = s.reshape(B, H, T, s1 - s0)
        else:
            c, kr = _dequantize(c, group_size, bits), _dequantize(kr, group_size, bits)
            v = unembed_out(c)
            s = q_nope @ embed_q(c, transpose=False).swapaxes(-1, -2) + q_pe @ kr.swapaxes(-1, -2)
        s = s.astype(mx.float32)
        bm = _block_mask(mask, T, S, s0, s1)
        if bm is not None:
            s = mx.where(bm, s, mx.finfo(mx.float32).min)
        m_new = s.max(axis=-1, keepdims=True) if m is None else mx.maximum(m, s.max(axis=-1, keepdims=True))
        p = mx.exp(s - m_new)
        if absorbed:
            pv = _qmm(p.astype(dtype).reshape(B, 1, H * T, s1 - s0), c, False, group_size, bits).reshape(B, H, T, -1)
        else:
            pv = p.astype(v.dtype) @ v
        pv, l = pv.astype(mx.float32), p.sum(axis=-1, keepdims=True)
        if m is None:
            acc, den = pv, l
        else:
            r = mx.exp(m - m_new)
            acc, den = acc * r + pv, den * r + l
        m = m_new
    out = (acc / den).astype(dtype)
    return unembed_out(out) if absorbed else out
