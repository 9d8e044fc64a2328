"""NoPE MLA attention of T queries against S cached latent keys: which path runs (the paths: ``ops/mla_paths.py``,
shapes and conventions there; the Metal kernels: ``ops/mla_attention_metal.py``).

- Metal on (``kimi_mlx.metal.enabled()``), absorbed, float keys: ``mla_attention_metal``, one kernel launch per key
  segment whatever its length (a long cache's decode step: the split-K kernels, one launch per segment and one
  reduce, ``decode_splits``), with ``absorbed_blocks``' gradients;
- one float segment of at most ``key_block`` keys: ``fused`` (one ``scaled_dot_product_attention`` call), absorbed up
  to ``FUSED_ABSORBED_MAX_QUERIES`` queries (decode, a verify pass: expanding the segment per head for a few queries
  costs more than the attention), expanded beyond;
- else ``absorbed_blocks`` up to ``ABSORBED_MAX_QUERIES`` queries (decode, short chunks), ``expanded_blocks`` beyond
  (prefill): expanding a block pays off past T* = r(dn + dv) / (2r - dn - dv) queries (128 for the tiny fixtures,
  170 for Kimi-Linear-48B). Both read float and quantized segments (``ops/latent.py``).

Key blocks: ``auto_key_block`` unless given. The measured costs behind these thresholds are in ``bench/README.md``
(MLA attention).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import mlx.core as mx

from .. import metal
from . import latent
from .mla_attention_metal import mla_attention_metal
from .mla_paths import Keys, LeftPaddedCausal, Mask, absorbed_blocks, expanded_blocks, fused, segments

__all__ = ["ABSORBED_MAX_QUERIES", "FUSED_ABSORBED_MAX_QUERIES", "KEY_BLOCK", "SCORE_BUDGET_BYTES", "Keys",
           "LeftPaddedCausal", "Mask", "auto_key_block", "mla_attention"]  # fmt: skip

KEY_BLOCK = 512  # keys per block: ~9 x H x T x KEY_BLOCK floats in flight; S <= KEY_BLOCK takes the fused SDPA
SCORE_BUDGET_BYTES = 32 << 20  # key_block=None: blocks as large as B x H x T x block float32 scores fit in this
ABSORBED_MAX_QUERIES = 128  # blockwise: latent-space (absorbed) attention up to this many queries, expanded beyond
FUSED_ABSORBED_MAX_QUERIES = 32  # fused: absorbed up to this many queries (decode, speculative verify passes), expanded
# beyond (prefill and training chunks: one expansion of the segment serves every query)


def auto_key_block(B: int, H: int, T: int) -> int:
    """Keys per block when none is given. Absorbed (T <= ``ABSORBED_MAX_QUERIES``: decode, short chunks): the largest
    multiple of ``KEY_BLOCK`` whose float32 scores (B x H x T x block) fit ``SCORE_BUDGET_BYTES``, so decode runs few,
    large blocks (per-block overhead dominates small ones); over a paged cache such a block spans several pages.
    Expanded prefill chunks: ``KEY_BLOCK`` (larger blocks are slower there and take more memory). Either way memory
    does not grow with the context."""
    if T > ABSORBED_MAX_QUERIES:
        return KEY_BLOCK
    return max(1, SCORE_BUDGET_BYTES // (4 * B * H * T * KEY_BLOCK)) * KEY_BLOCK


def mla_attention(
    q_nope: mx.array, q_pe: mx.array, kv_latent: Keys, k_pe: Keys, embed_q: Callable, unembed_out: Callable,
    scale: float, mask: Mask = None, *, key_block: Optional[int] = None, absorbed: Optional[bool] = None,
) -> mx.array:
    """Attention output [B, H, T, dv] (shapes: ``ops/mla_paths.py``). ``kv_latent`` / ``k_pe``: one part each or lists
    of segments of the same widths (a paged cache's pages, ``fetch()``), each float or quantized (``QuantizedLatent``:
    read as stored, never dequantized whole). ``key_block`` keys per block (None: ``auto_key_block``); ``absorbed``
    forces the blockwise form (default: absorbed for T <= ``ABSORBED_MAX_QUERIES``)."""
    B, H, T, _ = q_nope.shape
    kv_latent, k_pe = segments(kv_latent), segments(k_pe)
    key_block = key_block or auto_key_block(B, H, T)
    absorbed = T <= ABSORBED_MAX_QUERIES if absorbed is None else absorbed
    args = (q_nope, q_pe, kv_latent, k_pe, embed_q, unembed_out, scale, mask)
    floats = not (latent.is_quantized(kv_latent[0]) or latent.is_quantized(k_pe[0]))
    if floats and absorbed and metal.enabled():
        return mla_attention_metal(*args, key_block=key_block)
    if floats and len(kv_latent) == 1 and latent.width(kv_latent[0]) <= key_block:
        return fused(q_nope, q_pe, kv_latent[0], k_pe[0], embed_q, unembed_out, scale, mask,
                     absorbed and T <= FUSED_ABSORBED_MAX_QUERIES)
    return (absorbed_blocks if absorbed else expanded_blocks)(*args, key_block)
