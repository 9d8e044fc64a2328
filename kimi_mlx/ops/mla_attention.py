"""NoPE MLA attention of T queries against S cached latent keys, in key blocks with an online softmax.

Shapes (B batch, H heads, T queries, S keys, r = kv_lora_rank, dn = qk_nope, dr = qk_rope, dv = v_head_dim)::

    q_nope [B, H, T, dn]   q_pe [B, H, T, dr]   kv_latent (c_kv) [B, 1, S, r]   k_pe [B, 1, S, dr]
    (or each a list of segments [B, 1, S_i, .] with sum S_i = S: a paged cache's pages, read where they lie)
    embed_q:     embed_q(x) [.., dn] -> [.., r] (= x W_kb);  embed_q(c, transpose=False) [B, 1, S, r] -> [B, H, S, dn]
    unembed_out: [.., r] -> [.., dv] per head (W_vb)
    mask: None, "causal" (queries are the last T positions of the S keys), ``LeftPaddedCausal`` (a left-padded batch,
          built per key block), or bool [B, 1, T, S] (True = may attend)
    -> out [B, H, T, dv]

score(t, s) = scale * (q_nope . k_nope_s + q_pe . k_pe_s) with k_nope_s = c_kv_s W_kb^T and v_s = c_kv_s W_vb^T.

When the keys are one segment of S <= key_block (one block) this is the fused path the layer always had:
``mx.fast.scaled_dot_product_attention`` absorbed in latent space for one query (the k_pe scores enter as an
additive mask) and per-head expanded keys and values otherwise. Beyond one block the keys are visited ``key_block``
at a time with a running max / sum / output (float32), so the extra memory is O(H x T x key_block) (scores of one
block, plus that block's expansion), whatever S is; the whole cache is never expanded per head. Segments are never
concatenated: an absorbed block may span several (one softmax over their concatenated scores, the weighted sum
summed over their pieces), an expanded block lies in one. Every row must be allowed at least one key (our masks
always let a query see itself); blocks a row may not see at all are cancelled exactly by the later rescale.

Absorbed vs expanded per key block (bench/bench_mla_attention.py, CPU, S=8192, key_block=512, float32): absorbed
costs ~2(2r + dr) flops per query x key x head; expanded ~2(dn + dr + dv) per query x key x head plus 2r(dn + dv)
per key x head to expand the block, so expanding pays off past T* = r(dn + dv) / (2r - dn - dv) queries (128 for
the tiny fixtures, 170 for Kimi-Linear-48B). Measured (time / fused path, tiny fixture): decode T=1 absorbed 1.1-1.8x
(per-block overhead; expanded 59x), T=16 absorbed 0.27x (expanded 1.2x), T=128 1.08x vs 1.04x, T=512 1.89x vs 1.13x,
T=2048 1.41x vs 0.76x; 48B dims (4 heads) T=1 1.09x (expanded 115x), T=16 0.22x vs 1.40x. So blockwise attention runs
absorbed up to ``ABSORBED_MAX_QUERIES`` = 128 queries (decode, short chunks) and expanded per block beyond (prefill).
On Metal (``kimi_mlx.metal.enabled()``) the absorbed form runs as one kernel launch per key segment, whatever its
length (``ops/mla_attention_metal.py``: ``mla_decode`` for one query, ``mla_prefill`` for a chunk; segments merged by
their log-sum-exps), with this pure path's gradients; elsewhere, and for the expanded form, this pure path
(differentiable).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional, Union

import mlx.core as mx

from .. import metal
from . import mla_attention_metal

KEY_BLOCK = 512  # keys per block: ~9 x H x T x KEY_BLOCK floats in flight; S <= KEY_BLOCK takes the fused SDPA
SCORE_BUDGET_BYTES = 32 << 20  # key_block=None: blocks as large as B x H x T x block float32 scores fit in this
ABSORBED_MAX_QUERIES = 128  # blockwise: latent-space (absorbed) attention up to this many queries, expanded beyond



@dataclass(frozen=True)
class LeftPaddedCausal:
    """The causal mask of a left-padded batch, built one key block at a time (never [B, T, S] at once).

    Queries are the last T of the S positions; row b's keys before ``left_padding[b]`` ([B] int) are hidden, except
    that a (padded) query always sees itself, so no row is empty."""

    left_padding: mx.array

    def block(self, T: int, S: int, s0: int, s1: int) -> mx.array:
        """Bool [B, 1, T, s1 - s0] for keys [s0, s1) (True = may attend)."""
        q_pos = (S - T) + mx.arange(T)
        k_pos = mx.arange(s0, s1)
        causal = k_pos[None, :] <= q_pos[:, None]
        real_key = k_pos[None, None, :] >= self.left_padding[:, None, None]
        itself = k_pos[None, None, :] == q_pos[None, :, None]
        return (causal[None] & (real_key | itself))[:, None]


Mask = Union[None, str, mx.array, LeftPaddedCausal]
Keys = Union[mx.array, tuple, list]  # one part (a float array or a quantized triple) or a list of segment parts


def auto_key_block(B: int, H: int, T: int) -> int:
    """Keys per block when none is given. Absorbed (T <= ``ABSORBED_MAX_QUERIES``: decode, short chunks): the largest
    multiple of ``KEY_BLOCK`` whose float32 scores (B x H x T x block) fit ``SCORE_BUDGET_BYTES``, so decode runs
    few, large blocks (in 512-key blocks the tiny fixture decoded at 0.67x mlx-lm's speed after 128K tokens: per-block
    overhead); over a paged cache such a block spans several pages (``_blocks``). Expanded prefill chunks:
    ``KEY_BLOCK`` (larger blocks measured slower there, 1.15x instead of 1.9x mlx-lm's prefill at 32K, and 3x the
    memory). Either way memory does not grow with the context."""
    if T > ABSORBED_MAX_QUERIES:
        return KEY_BLOCK
    return max(1, SCORE_BUDGET_BYTES // (4 * B * H * T * KEY_BLOCK)) * KEY_BLOCK


def _fused(q_nope, q_pe, kv_latent, k_pe, embed_q, unembed_out, scale, mask):
    T = q_nope.shape[2]
    if T == 1:
        pe_scores = (q_pe * scale) @ k_pe.swapaxes(-1, -2)
        if isinstance(mask, mx.array):
            pe_scores = mx.where(mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
        out = mx.fast.scaled_dot_product_attention(embed_q(q_nope), kv_latent, kv_latent, scale=scale, mask=pe_scores)
        return unembed_out(out)
    k_nope = embed_q(kv_latent, transpose=False)
    k = mx.concatenate([k_nope, mx.broadcast_to(k_pe, (*k_nope.shape[:-1], k_pe.shape[-1]))], axis=-1)
    v = unembed_out(kv_latent)
    q = mx.concatenate([q_nope, q_pe], axis=-1)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _block_mask(mask: Mask, T: int, S: int, s0: int, s1: int) -> Optional[mx.array]:
    """Bool mask for keys [s0, s1) ([B, 1, T, s1-s0] or [T, s1-s0]), or None when the block is fully visible."""
    if isinstance(mask, mx.array):
        return mask[..., s0:s1]
    if isinstance(mask, LeftPaddedCausal):
        return mask.block(T, S, s0, s1)
    if mask == "causal" and s1 > S - T + 1:
        q_pos = (S - T) + mx.arange(T)
        return mx.arange(s0, s1)[None, :] <= q_pos[:, None]
    return None


Quant = Optional[tuple[int, int]]  # (bits, group_size) of a quantized latent cache, None for a float one


def _mm(x: mx.array, part, transpose: bool, quant: Quant) -> mx.array:
    """``x @ part.T`` (transpose) or ``x @ part`` for a float part or an ``mx.quantize`` triple (read as stored)."""
    if isinstance(part, tuple):
        bits, group_size = quant
        return mx.quantized_matmul(x, *part, transpose=transpose, group_size=group_size, bits=bits)
    return x @ (part.swapaxes(-1, -2) if transpose else part)


def _scores(q_lat: mx.array, q_rot: mx.array, c, kr, quant: Quant) -> mx.array:
    """Absorbed scores ``q_lat c^T + q_rot k_pe^T`` of one piece of keys (one fused multiply-add when both are float)."""
    if isinstance(c, tuple) or isinstance(kr, tuple):
        return _mm(q_lat, c, True, quant) + _mm(q_rot, kr, True, quant)
    return mx.addmm(q_rot @ kr.swapaxes(-1, -2), q_lat, c.swapaxes(-1, -2))


def _dequantized(part, quant: Quant) -> mx.array:
    if isinstance(part, tuple):
        bits, group_size = quant
        return mx.dequantize(*part, group_size=group_size, bits=bits)
    return part


def _block(part, s0: int, s1: int):
    """Positions [s0, s1) of a part (the part itself when that is all of it: one op less per page)."""
    if (s0, s1) == (0, _width(part)):
        return part
    return tuple(a[:, :, s0:s1] for a in part) if isinstance(part, tuple) else part[:, :, s0:s1]


def _width(part) -> int:
    return (part[0] if isinstance(part, tuple) else part).shape[2]


def segments(keys: Keys) -> list:
    """The key segments of ``kv_latent`` / ``k_pe``: a list as given, or one part as a list of one."""
    return keys if isinstance(keys, list) else [keys]


def _blocks(widths: list[int], key_block: int, span: bool) -> Iterator[list[tuple[int, int, int]]]:
    """Key blocks of at most ``key_block`` keys, in key order: lists of pieces (segment, start, end), each inside one
    segment of ``widths``. With ``span`` a block packs consecutive pieces across segments (their scores are
    concatenated, never their keys: a paged cache's decode takes one block for all the pages its budget allows);
    else each piece is a block."""
    block, size = [], 0
    for i, w in enumerate(widths):
        for b0 in range(0, w, key_block):
            b1 = min(b0 + key_block, w)
            if block and (not span or size + b1 - b0 > key_block):
                yield block
                block, size = [], 0
            block.append((i, b0, b1))
            size += b1 - b0
    if block:
        yield block


def _after(parts: tuple, done: list[mx.array]) -> tuple:
    """``parts`` (float arrays or quantized triples) made to wait for ``done``, the previous block's running state:
    else the lazy graph may compute every block's scores first and hold them all (memory O(S) again)."""
    flat = iter(mx.depends([a for p in parts for a in (p if isinstance(p, tuple) else (p,))], done))
    return tuple(tuple(next(flat) for _ in p) if isinstance(p, tuple) else next(flat) for p in parts)


def mla_attention(
    q_nope: mx.array,
    q_pe: mx.array,
    kv_latent: Keys,
    k_pe: Keys,
    embed_q: Callable,
    unembed_out: Callable,
    scale: float,
    mask: Mask = None,
    *,
    key_block: Optional[int] = None,
    absorbed: Optional[bool] = None,
    quant: Quant = None,
) -> mx.array:
    """Attention output [B, H, T, dv] (see the module docstring for shapes); ``key_block`` keys per block (None:
    ``auto_key_block``); ``absorbed`` forces the blockwise form (default: absorbed for T <= ``ABSORBED_MAX_QUERIES``).

    ``kv_latent`` / ``k_pe``: one part each, or lists of segments (the pages of a paged cache, ``fetch()``), of the
    same widths, read where they lie (``_blocks``).

    ``quant`` = (bits, group_size): the parts may be ``mx.quantize`` triples (codes, scales, biases) of a quantized
    cache (a part its group size does not divide stays float). They are read as stored: absorbed blocks by
    ``mx.quantized_matmul`` (scores with ``transpose=True``, the weighted sum with ``False``), expanded blocks
    dequantized one block at a time; never the whole cache at once."""
    B, H, T, _ = q_nope.shape
    kv_latent, k_pe = segments(kv_latent), segments(k_pe)
    widths = [_width(c) for c in kv_latent]
    S = sum(widths)
    key_block = key_block or auto_key_block(B, H, T)
    if absorbed is None:
        absorbed = T <= ABSORBED_MAX_QUERIES
    if quant is None and absorbed and metal.enabled():
        # Metal: the absorbed form as one kernel launch per segment (ops/mla_attention_metal.py); the pure path's
        # gradients.
        return mla_attention_metal.mla_attention_metal(
            q_nope, q_pe, kv_latent, k_pe, embed_q, unembed_out, scale, mask
        )
    if quant is None and len(kv_latent) == 1 and S <= key_block:
        whole_mask = mask.block(T, S, 0, S) if isinstance(mask, LeftPaddedCausal) else mask  # [B, 1, T, S]
        return _fused(q_nope, q_pe, kv_latent[0], k_pe[0], embed_q, unembed_out, scale, whole_mask)
    if absorbed:
        # One shared latent "head": fold heads into the query axis so each block is one matmul for all heads.
        q_lat = (embed_q(q_nope) * scale).reshape(B, 1, H * T, -1)
        q_rot = (q_pe * scale).reshape(B, 1, H * T, -1)
    else:
        q_nope, q_pe = q_nope * scale, q_pe * scale
    m = l = acc = None
    s0 = 0
    for block in _blocks(widths, key_block, span=absorbed):
        n = sum(b1 - b0 for _, b0, b1 in block)
        cs = [_block(kv_latent[i], b0, b1) for i, b0, b1 in block]
        krs = [_block(k_pe[i], b0, b1) for i, b0, b1 in block]
        if acc is not None:
            waited = _after((*cs, *krs), [m, l, acc])
            cs, krs = waited[: len(cs)], waited[len(cs) :]
        if absorbed:
            s = mx.concatenate([_scores(q_lat, q_rot, c, kr, quant) for c, kr in zip(cs, krs)], axis=-1)
            s = s.reshape(B, H, T, n)
        else:
            c, kr = _dequantized(cs[0], quant), _dequantized(krs[0], quant)
            v = unembed_out(c)
            s = q_nope @ embed_q(c, transpose=False).swapaxes(-1, -2) + q_pe @ kr.swapaxes(-1, -2)
        s = s.astype(mx.float32)
        bm = _block_mask(mask, T, S, s0, s0 + n)
        if bm is not None:
            s = mx.where(bm, s, mx.finfo(mx.float32).min)
        m_new = s.max(axis=-1, keepdims=True) if m is None else mx.maximum(m, s.max(axis=-1, keepdims=True))
        p = mx.exp(s - m_new)
        if absorbed:  # each piece's weighted sum in the cache's dtype, summed in float32
            p_dtype = q_lat.dtype if isinstance(cs[0], tuple) else cs[0].dtype
            p_lat, pv, o = p.astype(p_dtype).reshape(B, 1, H * T, n), mx.array(0, mx.float32), 0
            for c, (_, b0, b1) in zip(cs, block):
                pv = pv + _mm(p_lat if len(cs) == 1 else p_lat[..., o : o + b1 - b0], c, False, quant)
                o += b1 - b0
            pv = pv.reshape(B, H, T, -1)
        else:
            pv = p.astype(v.dtype) @ v
        if m is None:
            l, acc = p.sum(axis=-1, keepdims=True), pv.astype(mx.float32)
        else:
            alpha = mx.exp(m - m_new)
            l, acc = l * alpha + p.sum(axis=-1, keepdims=True), acc * alpha + pv
        m = m_new
        s0 += n
    out = (acc / l).astype(q_nope.dtype)
    return unembed_out(out) if absorbed else out
