"""Absorbed MLA attention over a float latent cache as Metal kernels (``metal_kernels/mla_decode.metal``,
``metal_kernels/mla_prefill.metal``), the same op as ``ops/mla_paths.absorbed_blocks``.

Shapes as in ``ops/mla_paths.py``: q_nope ``[B, H, T, dn]``, q_pe ``[B, H, T, dr]``, kv_latent (c_kv)
``[B, 1, S, r]``, k_pe ``[B, 1, S, dr]``, or each a list of segments (a paged cache's pages); mask None,
``"causal"`` (the queries are the last T of the S positions), ``LeftPaddedCausal`` or bool broadcastable to
``[B, 1, T, S]`` (True = may attend; every query must see at least one key).

The host computes ``q_lat = embed_q(q_nope) * scale`` and ``q_rot = q_pe * scale`` (as the pure absorbed path does),
a kernel computes the latent output ``softmax(q_lat c_kv^T + q_rot k_pe^T) c_kv`` with an online softmax over blocks
of 32 keys (float32 running max / sum / output, never a [T, S] score matrix), and ``unembed_out`` maps it to
``[B, H, T, dv]``. ``mla_decode`` (T = 1) splits the keys of one (sequence, head) row across the SIMD-groups of a
threadgroup and merges their states in threadgroup memory; ``mla_prefill`` gives each query row one SIMD-group that
scans its visible keys (a causal row stops at its last one). Both also return each row's log-sum-exp of its scores,
so keys in several segments (pages, which are never concatenated) take one launch per segment, with float32
outputs, merged by their log-sum-exps (``mla_latent_attention_segments``).

Custom kernels have no VJP: ``mla_attention_metal`` wraps the launch in ``kimi_mlx.metal.with_reference_vjp`` around
the latent part only (q_lat, q_rot, c_kv, k_pe), whose backward is ``absorbed_blocks``' (identity embed / unembed);
embed_q / unembed_out stay ordinary MLX ops, so their weights get their gradients as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import mlx.core as mx

from .. import metal
from .mla_paths import Keys, LeftPaddedCausal, Mask, absorbed_blocks, block_mask, segments

__all__ = ["DECODE_KERNEL", "PREFILL_KERNEL", "decode_threadgroup_bytes", "mla_attention_metal",
           "mla_latent_attention_metal", "mla_latent_attention_segments"]  # fmt: skip

DECODE_KERNEL = "mla_decode"  # one query per (sequence, head), keys split across SIMD-groups
PREFILL_KERNEL = "mla_prefill"  # T queries, one SIMD-group per query row
metal.register(DECODE_KERNEL)
metal.register(PREFILL_KERNEL)

_IO_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
DEFAULT_SIMDGROUPS = 8


def decode_threadgroup_bytes(simdgroups: int, r: int) -> int:
    """Threadgroup memory of ``mla_decode`` with ``simdgroups`` SIMD-groups at latent rank r: float sg_max[NSG],
    sg_sum[NSG], sg_out[NSG * r]."""
    return 4 * simdgroups * (r + 2)


def _simdgroups(simdgroups: Optional[int], r: int, decode: bool, name: str) -> int:
    """The launch's SIMD-groups per threadgroup: ``simdgroups``, by default DEFAULT_SIMDGROUPS or as many as fit;
    ValueError (``metal.check_threadgroup``) past the thread limit or, for ``mla_decode``, 32 KB of merge buffers."""
    most = metal.MAX_THREADS_PER_THREADGROUP // 32
    if decode:
        most = min(most, metal.MAX_THREADGROUP_MEMORY // decode_threadgroup_bytes(1, r))
    simdgroups = max(1, min(DEFAULT_SIMDGROUPS, most)) if simdgroups is None else simdgroups
    if simdgroups < 1:
        raise ValueError(f"mla_latent_attention_metal: simdgroups must be >= 1, got {simdgroups}")
    memory = decode_threadgroup_bytes(simdgroups, r) if decode else 0
    hint = f"at most {most} SIMD-groups" + (f" at kv_lora_rank {r}" if decode else "")
    metal.check_threadgroup(name, f"simdgroups={simdgroups}", 32 * simdgroups, memory, hint)
    return simdgroups


def _identity(x: mx.array, transpose: bool = True) -> mx.array:
    return x


def _latent_pure(q_lat, q_rot, kv_latent: list, k_pe: list, mask: Mask, key_block: Optional[int]) -> mx.array:
    """The pure path of the latent part (``absorbed_blocks`` on prescaled latent queries, identity embed / unembed),
    ``key_block`` keys per block (None: all in one)."""
    key_block = key_block or sum(c.shape[2] for c in kv_latent)
    return absorbed_blocks(q_lat, q_rot, kv_latent, k_pe, _identity, _identity, 1.0, mask, key_block)


def mla_latent_attention_metal(
    q_lat: mx.array,
    q_rot: mx.array,
    kv_latent: mx.array,
    k_pe: mx.array,
    mask: Mask = None,
    *,
    decode: Optional[bool] = None,
    simdgroups: Optional[int] = None,
    with_lse: bool = False,
):
    """One kernel launch: latent attention output ``[B, H, T, r]`` in q_lat's dtype for scaled queries q_lat
    ``[B, H, T, r]`` and q_rot ``[B, H, T, dr]``. ``decode`` picks ``mla_decode`` (needs T = 1; default when T = 1)
    or ``mla_prefill``; ``simdgroups`` per threadgroup: at most ``MAX_THREADS_PER_THREADGROUP / 32`` (16), and for
    the decode kernel at most ``MAX_THREADGROUP_MEMORY / decode_threadgroup_bytes(1, r)`` (15 at r = 512); default 8
    (fewer where r > 1022). Kernels must be enabled (``kimi_mlx.metal``). ``with_lse``: also each row's log-sum-exp
    of its visible scores ``[B, H, T]`` float32 (-inf for a row that sees no key; its output is then undefined)."""
    B, H, T, r = q_lat.shape
    S, dr = kv_latent.shape[2], k_pe.shape[-1]
    if q_rot.shape != (B, H, T, dr) or kv_latent.shape != (B, 1, S, r) or k_pe.shape != (B, 1, S, dr):
        raise ValueError(
            f"mla_latent_attention_metal: shapes q_lat {q_lat.shape}, q_rot {q_rot.shape}, kv_latent "
            f"{kv_latent.shape}, k_pe {k_pe.shape} do not fit [B, H, T, r], [B, H, T, dr], [B, 1, S, r], [B, 1, S, dr]"
        )
    for name, x in (("q_lat", q_lat), ("q_rot", q_rot), ("kv_latent", kv_latent), ("k_pe", k_pe)):
        if x.dtype not in _IO_DTYPES:
            raise ValueError(f"mla_latent_attention_metal: {name} dtype {x.dtype} not supported (float32/16, bfloat16)")
    decode = T == 1 if decode is None else decode
    if decode and T != 1:
        raise ValueError(f"mla_latent_attention_metal: the decode kernel takes one query per row, got T={T}")
    name = DECODE_KERNEL if decode else PREFILL_KERNEL
    simdgroups = _simdgroups(simdgroups, r, decode, name)
    kernel = metal.kernel(name)
    if kernel is None:
        raise RuntimeError("mla_latent_attention_metal: Metal kernels are not enabled (see kimi_mlx.metal.enabled)")
    if isinstance(mask, LeftPaddedCausal):
        mask = mask.block(T, S, 0, S)
    causal = isinstance(mask, str)
    if causal and mask != "causal":
        raise ValueError(f"mla_latent_attention_metal: mask must be None, 'causal' or a bool array, got {mask!r}")
    has_mask = isinstance(mask, mx.array)
    m = mx.broadcast_to(mask, (B, 1, T, S)).reshape(B, T, S) if has_mask else mx.zeros((1,), mx.bool_)
    kdt = kv_latent.dtype
    inputs = [q_lat, q_rot.astype(q_lat.dtype), kv_latent.reshape(B, S, r), k_pe.astype(kdt).reshape(B, S, dr), m]
    template = [("QT", q_lat.dtype), ("KT", kdt), ("DL", r), ("DR", dr), ("NSG", simdgroups)]
    if decode:
        template.append(("HAS_MASK", has_mask))
        grid = (32 * simdgroups, H, B)
    else:
        template += [("CAUSAL", causal), ("HAS_MASK", has_mask)]
        grid = (32 * simdgroups, -(-(T * H) // simdgroups), B)
    out, lse = kernel(
        inputs=inputs,
        template=template,
        grid=grid,
        threadgroup=(32 * simdgroups, 1, 1),
        output_shapes=[(B, H, T, r), (B, H, T)],
        output_dtypes=[q_lat.dtype, mx.float32],
    )
    return (out, lse) if with_lse else out


def mla_latent_attention_segments(
    q_lat: mx.array,
    q_rot: mx.array,
    kv_latent: Keys,
    k_pe: Keys,
    mask: Mask = None,
    *,
    simdgroups: Optional[int] = None,
) -> mx.array:
    """``mla_latent_attention_metal`` over keys given as one part or as lists of segments ``[B, 1, S_i, ·]`` (a
    paged cache's pages): one launch per segment, with float32 outputs merged by the rows' log-sum-exps (a segment
    a row cannot see at all weighs 0), then cast to q_lat's dtype. One segment: one launch, as
    ``mla_latent_attention_metal``."""
    cs, pes = segments(kv_latent), segments(k_pe)
    if len(cs) == 1:
        return mla_latent_attention_metal(q_lat, q_rot, cs[0], pes[0], mask, simdgroups=simdgroups)
    T, S = q_lat.shape[2], sum(c.shape[2] for c in cs)
    q32, r32 = q_lat.astype(mx.float32), q_rot.astype(mx.float32)
    outs, lses, s0 = [], [], 0
    for c, kr in zip(cs, pes):
        s1 = s0 + c.shape[2]
        # the last segment ends at S: a causal mask there is the kernel's own; elsewhere the block's bool mask
        seg_mask = "causal" if mask == "causal" and s1 == S else block_mask(mask, T, S, s0, s1)
        out, lse = mla_latent_attention_metal(q32, r32, c, kr, seg_mask, simdgroups=simdgroups, with_lse=True)
        outs.append(out)
        lses.append(lse)
        s0 = s1
    top = mx.logsumexp(mx.stack(lses), axis=0)  # [B, H, T]: every row sees some key in some segment
    acc = 0.0
    for out, lse in zip(outs, lses):
        w = mx.exp(lse - top)[..., None]
        acc = acc + w * mx.where(w > 0, out, 0.0)  # an unseen segment's output is undefined (0 / 0)
    return acc.astype(q_lat.dtype)


def mla_attention_metal(
    q_nope: mx.array,
    q_pe: mx.array,
    kv_latent: Keys,
    k_pe: Keys,
    embed_q: Callable,
    unembed_out: Callable,
    scale: float,
    mask: Mask = None,
    *,
    simdgroups: Optional[int] = None,
    key_block: Optional[int] = None,
) -> mx.array:
    """``mla_attention`` (same arguments and result ``[B, H, T, dv]``) through the kernels: ``mla_decode`` for one
    query, ``mla_prefill`` otherwise, one launch per key segment (``simdgroups`` as ``mla_latent_attention_metal``);
    gradients are ``absorbed_blocks``' with ``key_block`` keys per block (None: all keys in one)."""
    q_lat = embed_q(q_nope) * scale
    q_rot = (q_pe * scale).astype(q_lat.dtype)
    cs, pes = segments(kv_latent), segments(k_pe)
    n = len(cs)
    op = metal.with_reference_vjp(
        lambda q, qr, *kv: [mla_latent_attention_segments(q, qr, list(kv[:n]), list(kv[n:]), mask,
                                                          simdgroups=simdgroups)],
        lambda q, qr, *kv: [_latent_pure(q, qr, list(kv[:n]), list(kv[n:]), mask, key_block)],
    )
    return unembed_out(op(q_lat, q_rot, *cs, *pes)[0])
