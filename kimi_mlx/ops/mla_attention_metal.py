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

Split-K decode (flash decoding, ``mla_latent_attention_split``) for long caches: ``mla_decode`` runs B x H
threadgroups whatever S is (32 for Kimi Linear at batch 1) and each of them reads the whole latent cache, so a long
cache leaves most of a GPU idle and reads the latent H times. ``mla_decode_split`` cuts the keys into splits of
``keys_per_split`` consecutive keys (inside one segment; a page holds several) and gives each threadgroup one split
for HG = simdgroups x heads_per_simdgroup heads, staging the split's latent rows through threadgroup memory, so a row
is read once per HG heads (the latent is shared by all heads); each writes per (head, split) a partial softmax state
(max, sum, unnormalised output [r], float32) and ``mla_decode_reduce`` merges a row's partials with the online-softmax
rescale (also across segments: their partials are concatenated along the split axis, one reduce for all).
``decode_splits`` picks the split count from B, H, S and the GPU's core count (``gpu_cores``): enough threadgroups
to fill the GPU (``THREADGROUPS_PER_CORE`` per core), splits of at least ``MIN_KEYS_PER_SPLIT`` keys, and the
one-pass ``mla_decode`` where that would launch fewer threadgroups than its B x H (short caches, large batches:
B = 1 switches at S = 4096 for both 32 and 96 heads with the defaults).

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

__all__ = ["DECODE_KERNEL", "DEFAULT_GPU_CORES", "MIN_KEYS_PER_SPLIT", "PREFILL_KERNEL", "REDUCE_KERNEL",
           "SPLIT_KERNEL", "THREADGROUPS_PER_CORE", "decode_splits", "decode_threadgroup_bytes", "mla_attention_metal",
           "mla_latent_attention_metal", "mla_latent_attention_segments", "mla_latent_attention_split",
           "split_keys_per_tile", "split_threadgroup_bytes"]  # fmt: skip

DECODE_KERNEL = "mla_decode"  # one query per (sequence, head), keys split across SIMD-groups
PREFILL_KERNEL = "mla_prefill"  # T queries, one SIMD-group per query row
SPLIT_KERNEL = "mla_decode_split"  # split-K decode, pass 1: one key split x HG heads per threadgroup
REDUCE_KERNEL = "mla_decode_reduce"  # split-K decode, pass 2: merges a row's partial states
for _name in (DECODE_KERNEL, PREFILL_KERNEL, SPLIT_KERNEL, REDUCE_KERNEL):
    metal.register(_name)

_IO_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
DEFAULT_SIMDGROUPS = 8
DEFAULT_HEADS_PER_SIMDGROUP = 2  # split kernel: HPS (2 EL + ER + 2) + TK = 80 float registers per thread at r = 512
DEFAULT_GPU_CORES = 32  # Apple GPU cores assumed by decode_splits (M1/M2/M3/M4 Max: 32-40; base chips 8-10)
THREADGROUPS_PER_CORE = 4  # split-K decode aims at this many threadgroups per core (latency hiding)
MIN_KEYS_PER_SPLIT = 256  # a split's partial ([HG, r] float32) stays ~1/10 of its latent rows' bytes (bfloat16)
REDUCE_SIMDGROUPS = 4  # mla_decode_reduce: 128 threads, 4 output dims each at r = 512
TILE_BUDGET_BYTES = metal.MAX_THREADGROUP_MEMORY // 2  # split kernel's key tile: two threadgroups fit a 32 KB core


def decode_threadgroup_bytes(simdgroups: int, r: int) -> int:
    """Threadgroup memory of ``mla_decode`` with ``simdgroups`` SIMD-groups at latent rank r: float sg_max[NSG],
    sg_sum[NSG], sg_out[NSG * r]."""
    return 4 * simdgroups * (r + 2)


def split_threadgroup_bytes(keys_per_tile: int, r: int, dr: int, itemsize: int) -> int:
    """Threadgroup memory of ``mla_decode_split``: its key tile, ``keys_per_tile`` latent and rope rows in the cache's
    dtype (``itemsize`` bytes): KT tile_c[TK * r], tile_r[TK * dr]."""
    return itemsize * keys_per_tile * (r + dr)


def split_keys_per_tile(r: int, dr: int, itemsize: int) -> int:
    """Default keys per tile of ``mla_decode_split``: the largest power of two up to 32 (a SIMD-group's lanes) whose
    tile fits ``TILE_BUDGET_BYTES`` (at r = 512, dr = 64: 8 for bfloat16 / float16 caches, 4 for float32; 1 at
    least)."""
    tk = 32
    while tk > 1 and split_threadgroup_bytes(tk, r, dr, itemsize) > TILE_BUDGET_BYTES:
        tk //= 2
    return tk


def decode_splits(B: int, H: int, S: int, *, simdgroups: int = DEFAULT_SIMDGROUPS,
                  heads_per_simdgroup: int = DEFAULT_HEADS_PER_SIMDGROUP, gpu_cores: int = DEFAULT_GPU_CORES) -> int:
    """Splits of the split-K decode for B rows of H heads over S keys, or 0 for the one-pass ``mla_decode``.

    The split kernel runs ``B * ceil(H / HG)`` head groups (HG = simdgroups x heads_per_simdgroup, at most H) times
    the splits as threadgroups: enough splits for ``max(B * H, THREADGROUPS_PER_CORE * gpu_cores)`` threadgroups, at
    most ``S // MIN_KEYS_PER_SPLIT``. With fewer than 2 splits, or fewer threadgroups than ``mla_decode``'s B x H
    (short caches, large batches), the one-pass kernel runs (0). E.g. B = 1, 32 heads, 32 cores: 2 head groups, 0 below
    S = 4096, 64 splits from S = 16384."""
    groups = B * -(-H // min(H, simdgroups * heads_per_simdgroup))
    want = -(-max(B * H, THREADGROUPS_PER_CORE * gpu_cores) // groups)
    splits = min(want, S // MIN_KEYS_PER_SPLIT)
    return splits if splits >= 2 and splits * groups >= B * H else 0


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


def _decode_mask(mask: Mask, B: int, S: int, s0: int, s1: int) -> Optional[mx.array]:
    """A decode step's mask for keys [s0, s1) as bool [B, s1 - s0], or None when all are visible (None, "causal":
    the query is the last position)."""
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"mla_latent_attention_split: mask must be None, 'causal' or a bool array, got {mask!r}")
    m = block_mask(mask, 1, S, s0, s1)
    return None if m is None else mx.broadcast_to(m, (B, 1, 1, s1 - s0)).reshape(B, s1 - s0)


def _split_settings(q_lat, q_rot, cs: list, pes: list, splits: int, simdgroups: Optional[int],
                    heads_per_simdgroup: Optional[int], keys_per_tile: Optional[int]) -> tuple[int, int, int]:
    """Checked launch settings of ``mla_decode_split``: (SIMD-groups, heads per SIMD-group, keys per tile)."""
    B, H, T, r = q_lat.shape
    dr = q_rot.shape[-1]
    if T != 1:
        raise ValueError(f"mla_latent_attention_split: the split decode takes one query per row, got T={T}")
    if len(cs) != len(pes) or any(c.shape != (B, 1, c.shape[2], r) or kr.shape != (B, 1, c.shape[2], dr)
                                  for c, kr in zip(cs, pes)):
        raise ValueError(
            f"mla_latent_attention_split: segments {[c.shape for c in cs]}, {[kr.shape for kr in pes]} do not fit "
            f"[B, 1, S_i, r], [B, 1, S_i, dr] for q_lat {q_lat.shape}"
        )
    for name, x in (("q_lat", q_lat), ("q_rot", q_rot), ("kv_latent", cs[0]), ("k_pe", pes[0])):
        if x.dtype not in _IO_DTYPES:
            raise ValueError(f"mla_latent_attention_split: {name} dtype {x.dtype} not supported (float32/16, bfloat16)")
    if splits < 1:
        raise ValueError(f"mla_latent_attention_split: splits must be >= 1, got {splits}")
    hps = DEFAULT_HEADS_PER_SIMDGROUP if heads_per_simdgroup is None else heads_per_simdgroup
    if hps < 1:
        raise ValueError(f"mla_latent_attention_split: heads_per_simdgroup must be >= 1, got {hps}")
    nsg = min(DEFAULT_SIMDGROUPS if simdgroups is None else simdgroups, -(-H // hps))
    if nsg < 1:
        raise ValueError(f"mla_latent_attention_split: simdgroups must be >= 1, got {simdgroups}")
    size = cs[0].dtype.size
    tk = split_keys_per_tile(r, dr, size) if keys_per_tile is None else keys_per_tile
    if tk not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"mla_latent_attention_split: keys_per_tile must be a power of two up to 32, got {tk}")
    metal.check_threadgroup(SPLIT_KERNEL, f"simdgroups={nsg}, keys_per_tile={tk}", 32 * nsg,
                            split_threadgroup_bytes(tk, r, dr, size),
                            f"at most {metal.MAX_THREADS_PER_THREADGROUP // 32} SIMD-groups and "
                            f"{split_keys_per_tile(r, dr, size)} keys per tile at kv_lora_rank {r}")  # fmt: skip
    return nsg, hps, tk


def mla_latent_attention_split(
    q_lat: mx.array,
    q_rot: mx.array,
    kv_latent: Keys,
    k_pe: Keys,
    mask: Mask = None,
    *,
    splits: int,
    simdgroups: Optional[int] = None,
    heads_per_simdgroup: Optional[int] = None,
    keys_per_tile: Optional[int] = None,
    with_lse: bool = False,
):
    """Split-K decode: latent output ``[B, H, 1, r]`` in q_lat's dtype for one query per row (q_lat ``[B, H, 1, r]``,
    q_rot ``[B, H, 1, dr]``, scaled) over keys given as one part or as segments ``[B, 1, S_i, ·]`` (float).

    The S keys are cut into splits of ``ceil(S / splits)`` keys (a segment's last split is shorter, so the launch
    count can pass ``splits`` by up to the number of segments minus one); one ``mla_decode_split`` launch per segment
    writes every (head, split) partial state, one ``mla_decode_reduce`` launch merges them. ``simdgroups`` (default
    8, at most ``ceil(H / heads_per_simdgroup)``) times ``heads_per_simdgroup`` (default 2) heads per threadgroup;
    ``keys_per_tile`` (a power of two up to 32; default ``split_keys_per_tile``) keys staged at a time. Mask as
    ``mla_latent_attention_metal`` (T = 1). ``with_lse``: also each row's log-sum-exp ``[B, H, 1]`` float32."""
    cs, pes = segments(kv_latent), segments(k_pe)
    nsg, hps, tk = _split_settings(q_lat, q_rot, cs, pes, splits, simdgroups, heads_per_simdgroup, keys_per_tile)
    split_k, reduce_k = metal.kernel(SPLIT_KERNEL), metal.kernel(REDUCE_KERNEL)
    if split_k is None or reduce_k is None:
        raise RuntimeError("mla_latent_attention_split: Metal kernels are not enabled (see kimi_mlx.metal.enabled)")
    B, H, _, r = q_lat.shape
    dr, kdt = q_rot.shape[-1], cs[0].dtype
    S = sum(c.shape[2] for c in cs)
    kps = -(-S // splits)  # keys per split
    q, qr = q_lat.reshape(B, H, r), q_rot.astype(q_lat.dtype).reshape(B, H, dr)
    parts, s0 = [], 0  # per segment: (o [B, H, ns, r], m [B, H, ns], l [B, H, ns]) float32
    for c, kr in zip(cs, pes):
        w = c.shape[2]
        seg_mask = _decode_mask(mask, B, S, s0, s0 + w)
        ns = -(-w // kps)
        parts.append(split_k(
            inputs=[q, qr, c.reshape(B, w, r), kr.astype(kdt).reshape(B, w, dr),
                    mx.zeros((1,), mx.bool_) if seg_mask is None else seg_mask, kps],
            template=[("QT", q_lat.dtype), ("KT", kdt), ("DL", r), ("DR", dr), ("NSG", nsg), ("HPS", hps),
                      ("TK", tk), ("HAS_MASK", seg_mask is not None)],
            grid=(32 * nsg, -(-H // (nsg * hps)), B * ns),
            threadgroup=(32 * nsg, 1, 1),
            output_shapes=[(B, H, ns, r), (B, H, ns), (B, H, ns)],
            output_dtypes=[mx.float32] * 3,
        ))  # fmt: skip
        s0 += w
    out, lse = reduce_k(
        inputs=[p[0] if len(parts) == 1 else mx.concatenate(p, axis=2) for p in zip(*parts)],  # along the splits
        template=[("QT", q_lat.dtype), ("DL", r), ("NSG", REDUCE_SIMDGROUPS)],
        grid=(32 * REDUCE_SIMDGROUPS, H, B),
        threadgroup=(32 * REDUCE_SIMDGROUPS, 1, 1),
        output_shapes=[(B, H, 1, r), (B, H, 1)],
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
    splits: Optional[int] = None,
    gpu_cores: int = DEFAULT_GPU_CORES,
) -> mx.array:
    """``mla_latent_attention_metal`` over keys given as one part or as lists of segments ``[B, 1, S_i, ·]`` (a
    paged cache's pages): one launch per segment, with float32 outputs merged by the rows' log-sum-exps (a segment
    a row cannot see at all weighs 0), then cast to q_lat's dtype. One segment: one launch, as
    ``mla_latent_attention_metal``. A decode step (T = 1) with ``splits`` >= 1 (None: ``decode_splits(B, H, S,
    gpu_cores=gpu_cores)``, 0 = one pass) runs the split-K decode instead (``mla_latent_attention_split``)."""
    cs, pes = segments(kv_latent), segments(k_pe)
    B, H, T, _ = q_lat.shape
    if T == 1:
        S = sum(c.shape[2] for c in cs)
        n = decode_splits(B, H, S, gpu_cores=gpu_cores) if splits is None else splits
        if n >= 1:
            return mla_latent_attention_split(q_lat, q_rot, cs, pes, mask, splits=n, simdgroups=simdgroups)
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
    splits: Optional[int] = None,
    gpu_cores: int = DEFAULT_GPU_CORES,
) -> mx.array:
    """``mla_attention`` (same arguments and result ``[B, H, T, dv]``) through the kernels: for one query the split-K
    decode or ``mla_decode`` (``splits``, ``gpu_cores``: ``mla_latent_attention_segments``), ``mla_prefill``
    otherwise, one launch per key segment (``simdgroups`` as ``mla_latent_attention_metal``); gradients are
    ``absorbed_blocks``' with ``key_block`` keys per block (None: all keys in one)."""
    q_lat = embed_q(q_nope) * scale
    q_rot = (q_pe * scale).astype(q_lat.dtype)
    cs, pes = segments(kv_latent), segments(k_pe)
    n = len(cs)
    op = metal.with_reference_vjp(
        lambda q, qr, *kv: [mla_latent_attention_segments(q, qr, list(kv[:n]), list(kv[n:]), mask,
                                                          simdgroups=simdgroups, splits=splits, gpu_cores=gpu_cores)],
        lambda q, qr, *kv: [_latent_pure(q, qr, list(kv[:n]), list(kv[n:]), mask, key_block)],
    )
    return unembed_out(op(q_lat, q_rot, *cs, *pes)[0])
