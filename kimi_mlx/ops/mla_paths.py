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
  (one shared key head [c_kv, k_pe], c_kv as the values) for few queries (decode, a verify pass); expanded, the
  plain full-attention call (per-head keys and values of the whole segment, memory O(H x T x S)), the yardstick the
  blockwise forms are measured and tested against.
- ``absorbed_blocks``: latent space (q_lat = q_nope W_kb, scores q_lat c^T + q_pe k_pe^T, output (p c) W_vb^T), all
  heads folded into the query axis so a block is one matmul; ~2(2r + dr) flops per query x key x head. A block may
  span several segments (one softmax over their concatenated scores, the weighted sum summed over their pieces).
  Quantized segments are read as stored (``mx.quantized_matmul``).
- ``expanded_blocks``: per-head keys and values of one block at a time (a block lies in one segment, dequantized
  when quantized), attended in tiles of a query block x the key block, each query block with its own running
  state, so a causal mask costs only its diagonal tiles; ~2(dn + dr + dv) flops per query x key x head plus
  2r(dn + dv) per key x head to expand.

Blockwise, the keys are visited ``key_block`` at a time with a running max / sum / output (float32), so the extra
memory is O(H x T x key_block) absorbed, O(H x query_block x key_block) per tile expanded, whatever S is; the whole
cache is never expanded per head nor concatenated. Every row must be allowed at least one key (our masks always let
a query see itself); blocks a row may not see at all are cancelled exactly by the later rescale.
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

    def block(self, T: int, S: int, s0: int, s1: int, r0: int = 0, r1: Optional[int] = None) -> mx.array:
        """Bool [B, 1, r1 - r0, s1 - s0] for query rows [r0, r1) (default all T) and keys [s0, s1) (True = may
        attend)."""
        q_pos = (S - T) + mx.arange(r0, T if r1 is None else r1)
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


def block_mask(mask: Mask, T: int, S: int, s0: int, s1: int, r0: int = 0, r1: Optional[int] = None
               ) -> Optional[mx.array]:
    """Bool mask of query rows [r0, r1) (default all T) for keys [s0, s1) ([B, 1, r1-r0, s1-s0] or [r1-r0, s1-s0]),
    or None when all of these rows see all of these keys."""
    r1 = T if r1 is None else r1
    if isinstance(mask, mx.array):
        return mask[..., r0:r1, s0:s1] if (r0, r1) != (0, T) else mask[..., s0:s1]
    if isinstance(mask, LeftPaddedCausal):
        return mask.block(T, S, s0, s1, r0, r1)
    if mask == "causal" and s1 - 1 > S - T + r0:  # row r's last visible key is S - T + r
        q_pos = (S - T) + mx.arange(r0, r1)
        return mx.arange(s0, s1)[None, :] <= q_pos[:, None]
    return None


def causal_split(mask: Mask, T: int, S: int, r0: int, r1: int) -> tuple[int, int]:
    """Keys (full, seen) of query rows [r0, r1) under ``mask``'s causal part: keys before ``full`` come before every
    one of these rows' positions, keys from ``seen`` on after all of them; the rows attend keys [0, seen), only
    [full, seen) needs the causal mask (a square diagonal tile: rows at positions S - T + r0 .. S - T + r1 - 1).
    Causal masks ("causal", ``LeftPaddedCausal``: queries at positions S - T .. S - 1): (S - T + r0, S - T + r1);
    other masks: (S, S), all keys (an array mask still applies to every tile, ``block_mask``)."""
    if isinstance(mask, LeftPaddedCausal) or (isinstance(mask, str) and mask == "causal"):
        return S - T + r0, S - T + r1
    return S, S


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


Attend = Callable[[list[Piece]], tuple[mx.array, Callable[[mx.array], mx.array]]]


State = tuple[mx.array, mx.array, mx.array]  # running (max [.., 1], sum [.., 1], output [.., d]), float32


def _softmax_step(state: Optional[State], s: mx.array, weigh: Callable[[mx.array], mx.array]) -> State:
    """The online softmax's running state after one more block of scores ``s`` [.., n] (float32, masked entries at
    the float32 minimum), ``weigh(p)`` giving the weighted sum of the block's values [.., d] for its probabilities."""
    if state is None:
        m = s.max(axis=-1, keepdims=True)
        p = mx.exp(s - m)
        return m, p.sum(axis=-1, keepdims=True), weigh(p).astype(mx.float32)
    m0, l0, acc0 = state
    m = mx.maximum(m0, s.max(axis=-1, keepdims=True))
    p = mx.exp(s - m)
    alpha = mx.exp(m0 - m)  # [.., 1]
    return m, l0 * alpha + p.sum(axis=-1, keepdims=True), acc0 * alpha + weigh(p)


def _online_softmax(kv_latent: list, k_pe: list, key_block: int, span: bool, mask: Mask, T: int,
                    attend: Attend) -> mx.array:
    """softmax(scores) @ values over the key blocks (``_blocks``), float32 [B, H, T, d]. ``attend(pieces)`` gives a
    block's scores [B, H, T, n] and the function that maps their probabilities (float32, same shape) to their weighted
    sum of values [B, H, T, d]."""
    widths = [latent.width(c) for c in kv_latent]
    S = sum(widths)
    state = None
    s0 = 0
    for block in _blocks(widths, key_block, span):
        pieces = [(latent.positions(kv_latent[i], b0, b1), latent.positions(k_pe[i], b0, b1)) for i, b0, b1 in block]
        if state is not None:
            pieces = _after(pieces, list(state))
        s, weigh = attend(pieces)
        s = s.astype(mx.float32)  # [B, H, T, n]
        n = s.shape[-1]
        bm = block_mask(mask, T, S, s0, s0 + n)
        if bm is not None:
            s = mx.where(bm, s, mx.finfo(mx.float32).min)
        state = _softmax_step(state, s, weigh)
        s0 += n
    _, l, acc = state
    return acc / l


def absorbed_blocks(q_nope, q_pe, kv_latent: list, k_pe: list, embed_q, unembed_out, scale: float, mask: Mask,
                    key_block: int) -> mx.array:
    """Latent-space attention over key blocks spanning segments -> [B, H, T, dv] (see the module docstring)."""
    B, H, T, _ = q_nope.shape
    # One shared latent "head": fold heads into the query axis so each block is one matmul for all heads.
    q_lat = (embed_q(q_nope) * scale).reshape(B, 1, H * T, -1)
    q_rot = (q_pe * scale).reshape(B, 1, H * T, -1)

    def attend(pieces: list[Piece]):
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
                    key_block: int, query_block: int) -> mx.array:
    """Per-head expanded attention in tiles of ``query_block`` queries x up to ``key_block`` keys -> [B, H, T, dv] (see
    the module docstring).

    Key blocks (each inside one segment) are expanded once each, ``k = [c W_kb^T, k_pe]`` [B, H, n, dn + dr] and
    ``v = c W_vb^T`` [B, H, n, dv]; every query block attends a key block's keys it may see, each with its own running
    softmax state, so a causal tile left of the diagonal needs no mask, a tile right of it is skipped and the square
    diagonal tile is the only one masked (``causal_split``); a query block whose keys all fit one tile has one plain
    softmax pass (no rescale). Memory: B x H x ``query_block`` x ``key_block`` float32 scores per tile, one key
    block's expansion and the running states (B x H x T x (dv + 2)), whatever S is."""
    T = q_nope.shape[2]
    widths = [latent.width(c) for c in kv_latent]
    S = sum(widths)
    q = mx.concatenate([q_nope, q_pe], axis=-1) * scale  # [B, H, T, dn + dr]
    rows = [(r0, min(r0 + query_block, T)) for r0 in range(0, T, query_block)]
    splits = [causal_split(mask, T, S, r0, r1) for r0, r1 in rows]
    states: list[Optional[State]] = [None] * len(rows)
    s0 = 0
    for [(i, b0, b1)] in _blocks(widths, key_block, False):
        s1 = s0 + b1 - b0
        piece = (latent.positions(kv_latent[i], b0, b1), latent.positions(k_pe[i], b0, b1))
        done = [x for state in states if state is not None for x in state]
        if done:  # this block's expansion waits for the previous block's tiles
            [piece] = _after([piece], done)
        c, kr = latent.dequantize(piece[0]), latent.dequantize(piece[1])  # [B, 1, n, r], [B, 1, n, dr]
        k_nope = embed_q(c, transpose=False)  # [B, H, n, dn]
        k = mx.concatenate([k_nope, mx.broadcast_to(kr, (*k_nope.shape[:-1], kr.shape[-1]))], axis=-1)
        v = unembed_out(c)  # [B, H, n, dv]
        for j, ((r0, r1), (full, seen)) in enumerate(zip(rows, splits)):
            for a, b in ((s0, min(s1, full)), (max(s0, full), min(s1, seen))):  # left of the diagonal, on it
                if a >= b:
                    continue
                ka, va = k[:, :, a - s0 : b - s0], v[:, :, a - s0 : b - s0]  # [B, H, b - a, .]
                s = (q[:, :, r0:r1] @ ka.swapaxes(-1, -2)).astype(mx.float32)  # [B, H, r1 - r0, b - a]
                bm = block_mask(mask, T, S, a, b, r0, r1)
                if bm is not None:
                    s = mx.where(bm, s, mx.finfo(mx.float32).min)
                states[j] = _softmax_step(states[j], s, lambda p, va=va: p.astype(va.dtype) @ va)
        s0 = s1
    out = mx.concatenate([acc / l for _, l, acc in states], axis=2)  # [B, H, T, dv]
    return out.astype(q_nope.dtype)
