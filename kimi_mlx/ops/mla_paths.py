"""The pure-MLX paths of NoPE MLA attention (``ops/mla_attention.py`` picks one): T queries against S cached latent
keys, in one fused call or in key blocks with an online softmax. Differentiable; the Metal path
(``ops/mla_attention_metal.py``) takes its gradients from ``absorbed_blocks``.

Shapes (B batch, H heads, T queries, S keys, r = kv_lora_rank, dn = qk_nope, dr = qk_rope, dv = v_head_dim)::

    q_nope [B, H, T, dn]   q_pe [B, H, T, dr]   kv_latent (c_kv) [B, 1, S, r]   k_pe [B, 1, S, dr]
    (each a list of segments [B, 1, S_i, .] with sum S_i = S: a paged cache's pages, read where they lie; each
    segment a float array or a ``QuantizedLatent``, ``ops/latent.py``)
    embed_q:     embed_q(x) [.., dn] -> [.., r] (= x W_kb);  embed_q(c, transpose=False) [B, 1, S, r] -> [B, H, S, dn]
    unembed_out: [.., r] -> [.., dv] per head (W_vb)
    mask: None, "causal" (queries are the last T positions of the S keys), ``LeftPaddedCausal`` (a left-padded batch,
          built per key block), or bool [B, 1, T, S] (True = may attend)
    -> out [B, H, T, dv]

score(t, s) = scale * (q_nope . k_nope_s + q_pe . k_pe_s) with k_nope_s = c_kv_s W_kb^T and v_s = c_kv_s W_vb^T.

- ``fused``: one float segment in one call of ``mx.fast.scaled_dot_product_attention``: absorbed in latent space
  (one shared key head [c_kv, k_pe], c_kv as the values) for few queries (decode, a verify pass), per-head expanded
  keys and values otherwise.
- ``absorbed_blocks``: latent space (q_lat = q_nope W_kb, scores q_lat c^T + q_pe k_pe^T, output (p c) W_vb^T), all
  heads folded into the query axis so a block is one matmul; ~2(2r + dr) flops per query x key x head. A block may
  span several segments (one softmax over their concatenated scores, the weighted sum summed over their pieces).
  Quantized segments are read as stored (``mx.quantized_matmul``).
- ``expanded_blocks``: per-head keys and values of one block at a time (a block lies in one segment, dequantized
  when quantized); ~2(dn + dr + dv) flops per query x key x head plus 2r(dn + dv) per key x head to expand.

Blockwise, the keys are visited ``key_block`` at a time with a running max / sum / output (float32), so the extra
memory is O(H x T x key_block), whatever S is; the whole cache is never expanded per head nor concatenated. Every
row must be allowed at least one key (our masks always let a query see itself); blocks a row may not see at all are
cancelled exactly by the later rescale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional, Union

import mlx.core as mx

from . import latent
from .latent import Latent


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
Keys = Union[Latent, list]  # one part or a list of segment parts


def segments(keys: Keys) -> list:
    """The key segments of ``kv_latent`` / ``k_pe``: a list as given, or one part as a list of one."""
    return keys if isinstance(keys, list) else [keys]


def block_mask(mask: Mask, T: int, S: int, s0: int, s1: int) -> Optional[mx.array]:
    """Bool mask for keys [s0, s1) ([B, 1, T, s1-s0] or [T, s1-s0]), or None when the block is fully visible."""
    if isinstance(mask, mx.array):
        return mask[..., s0:s1]
    if isinstance(mask, LeftPaddedCausal):
        return mask.block(T, S, s0, s1)
    if mask == "causal" and s1 > S - T + 1:
        q_pos = (S - T) + mx.arange(T)
        return mx.arange(s0, s1)[None, :] <= q_pos[:, None]
    return None


def fused(q_nope, q_pe, kv_latent: mx.array, k_pe: mx.array, embed_q, unembed_out, scale: float, mask: Mask,
          absorbed: bool):
    """One float segment ``[B, 1, S, .]`` in one ``scaled_dot_product_attention`` call -> [B, H, T, dv]. ``absorbed``:
    in latent space, one shared key head ``[c_kv, k_pe]`` (r + dr wide) against queries ``[q_nope W_kb, q_pe]`` with
    ``c_kv`` as the values; else per-head expanded keys and values."""
    T, S = q_nope.shape[2], kv_latent.shape[2]
    if isinstance(mask, LeftPaddedCausal):
        mask = mask.block(T, S, 0, S)
    if absorbed:
        q = mx.concatenate([embed_q(q_nope), q_pe], axis=-1)  # [B, H, T, r + dr]
        k = mx.concatenate([kv_latent, k_pe], axis=-1)  # [B, 1, S, r + dr]
        out = mx.fast.scaled_dot_product_attention(q, k, kv_latent, scale=scale, mask=mask)  # [B, H, T, r]
        return unembed_out(out)  # [B, H, T, dv]
    k_nope = embed_q(kv_latent, transpose=False)  # [B, H, S, dn]
    k = mx.concatenate([k_nope, mx.broadcast_to(k_pe, (*k_nope.shape[:-1], k_pe.shape[-1]))], axis=-1)
    v = unembed_out(kv_latent)  # [B, H, S, dv]
    q = mx.concatenate([q_nope, q_pe], axis=-1)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


Piece = tuple[Latent, Latent]  # (kv_latent, k_pe) of consecutive keys inside one segment


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


def _after(pieces: list[Piece], done: list[mx.array]) -> list[Piece]:
    """``pieces`` made to wait for ``done``, the previous block's running state: else the lazy graph may compute every
    block's scores first and hold them all (memory O(S) again)."""
    parts = [p for piece in pieces for p in piece]
    flat = iter(mx.depends([a for p in parts for a in latent.arrays(p)], done))
    waited = [latent.with_arrays(p, [next(flat) for _ in latent.arrays(p)]) for p in parts]
    return list(zip(waited[::2], waited[1::2]))


Attend = Callable[[list[Piece], int], tuple[mx.array, Callable[[mx.array], mx.array]]]


def first_row(mask: Mask, T: int, S: int, s0: int) -> int:
    """The first of the T query rows that may see key ``s0`` or a later one: under a causal mask ("causal" or
    ``LeftPaddedCausal``, queries at positions S - T .. S - 1) the rows before position ``s0`` see no key from ``s0``
    on; 0 for other masks."""
    if mask == "causal" or isinstance(mask, LeftPaddedCausal):
        return max(0, s0 - (S - T))
    return 0


def _online_softmax(kv_latent: list, k_pe: list, key_block: int, span: bool, mask: Mask, T: int,
                    attend: Attend, trim_rows: bool = False) -> mx.array:
    """softmax(scores) @ values over the key blocks (``_blocks``), float32 [B, H, T, d]. ``attend(pieces, r0)`` gives
    a block's scores for query rows r0.. [B, H, T - r0, n] and the function that maps their probabilities (float32,
    same shape) to their weighted sum of values [B, H, T - r0, d]. With ``trim_rows`` a block is attended only by the
    rows that may see one of its keys (``first_row``: under a causal mask, a prefill chunk's later key blocks skip
    its earlier rows, whose running state a fully hidden block leaves unchanged); else r0 = 0."""
    widths = [latent.width(c) for c in kv_latent]
    S = sum(widths)
    m = l = acc = None
    s0 = 0
    for block in _blocks(widths, key_block, span):
        pieces = [(latent.positions(kv_latent[i], b0, b1), latent.positions(k_pe[i], b0, b1)) for i, b0, b1 in block]
        if acc is not None:
            pieces = _after(pieces, [m, l, acc])
        r0 = first_row(mask, T, S, s0) if trim_rows and m is not None else 0
        s, weigh = attend(pieces, r0)
        s = s.astype(mx.float32)  # [B, H, T - r0, n]
        n = s.shape[-1]
        bm = block_mask(mask, T, S, s0, s0 + n)
        if bm is not None:
            s = mx.where(bm[..., r0:, :], s, mx.finfo(mx.float32).min)
        if m is None:
            m_new = s.max(axis=-1, keepdims=True)
            p = mx.exp(s - m_new)
            l, acc = p.sum(axis=-1, keepdims=True), weigh(p).astype(mx.float32)
        else:
            mt, lt, at = (x[..., r0:, :] for x in (m, l, acc)) if r0 else (m, l, acc)
            m_new = mx.maximum(mt, s.max(axis=-1, keepdims=True))
            p = mx.exp(s - m_new)
            alpha = mx.exp(mt - m_new)
            lt, at = lt * alpha + p.sum(axis=-1, keepdims=True), at * alpha + weigh(p)
            if r0:  # rows before r0 keep their state
                m_new, lt, at = (mx.concatenate([x[..., :r0, :], y], axis=-2) for x, y in ((m, m_new), (l, lt),
                                                                                        (acc, at)))
            l, acc = lt, at
        m = m_new
        s0 += n
    return acc / l


def absorbed_blocks(q_nope, q_pe, kv_latent: list, k_pe: list, embed_q, unembed_out, scale: float, mask: Mask,
                    key_block: int) -> mx.array:
    """Latent-space attention over key blocks spanning segments -> [B, H, T, dv] (see the module docstring)."""
    B, H, T, _ = q_nope.shape
    # One shared latent "head": fold heads into the query axis so each block is one matmul for all heads.
    q_lat = (embed_q(q_nope) * scale).reshape(B, 1, H * T, -1)
    q_rot = (q_pe * scale).reshape(B, 1, H * T, -1)

    def attend(pieces: list[Piece], r0: int):  # r0 = 0: blocks are not trimmed here
        s = mx.concatenate([latent.addmm(latent.matmul(q_rot, kr), q_lat, c) for c, kr in pieces], axis=-1)
        n = s.shape[-1]

        def weigh(p: mx.array) -> mx.array:  # each piece's weighted sum in the cache's dtype, summed in float32
            p_lat = p.astype(latent.float_dtype(pieces[0][0]) or q_lat.dtype).reshape(B, 1, H * T, n)
            pv, o = mx.array(0, mx.float32), 0
            for c, _ in pieces:
                w = latent.width(c)
                pv = pv + latent.matmul(p_lat if len(pieces) == 1 else p_lat[..., o : o + w], c, transpose=False)
                o += w
            return pv.reshape(B, H, T, -1)

        return s.reshape(B, H, T, n), weigh

    out = _online_softmax(kv_latent, k_pe, key_block, True, mask, T, attend)
    return unembed_out(out.astype(q_nope.dtype))


def expanded_blocks(q_nope, q_pe, kv_latent: list, k_pe: list, embed_q, unembed_out, scale: float, mask: Mask,
                    key_block: int) -> mx.array:
    """Per-head expanded attention, one block (inside one segment) at a time -> [B, H, T, dv] (see the module
    docstring)."""
    T = q_nope.shape[2]
    q_nope, q_pe = q_nope * scale, q_pe * scale

    def attend(pieces: list[Piece], r0: int):
        [(c, kr)] = pieces
        c, kr = latent.dequantize(c), latent.dequantize(kr)
        v = unembed_out(c)  # [B, H, n, dv]
        qn, qp = (q_nope[:, :, r0:], q_pe[:, :, r0:]) if r0 else (q_nope, q_pe)  # [B, H, T - r0, .]
        s = qn @ embed_q(c, transpose=False).swapaxes(-1, -2) + qp @ kr.swapaxes(-1, -2)
        return s, lambda p: p.astype(v.dtype) @ v

    return _online_softmax(kv_latent, k_pe, key_block, False, mask, T, attend, trim_rows=True).astype(q_nope.dtype)
