"""NoPE MLA attention of T queries against S cached latent keys: which path runs (the paths: ``ops/mla_paths.py``,
shapes and conventions there; the Metal kernels: ``ops/mla_attention_metal.py``).

The form (``absorbs``): latent space (absorbed) where that takes fewer multiply-adds than expanding the keys per
head, up to ``ABSORBED_MAX_QUERIES`` queries (decode, short chunks over a longer cache); expanded otherwise (prefill
chunks, and any chunk on an empty or short cache). Then:

- absorbed, Metal on (``kimi_mlx.metal.enabled()``), float keys: ``mla_attention_metal``, one kernel launch per key
  segment whatever its length (a long cache's decode step: the split-K kernels, one launch per segment and one
  reduce, ``decode_splits``), with ``absorbed_blocks``' gradients;
- absorbed, one float segment of at most ``key_block`` keys and up to ``FUSED_ABSORBED_MAX_QUERIES`` queries (decode,
  a verify pass): ``fused``, one ``scaled_dot_product_attention`` call in latent space;
- else absorbed: ``absorbed_blocks``; expanded: ``expanded_blocks``, tiles of ``QUERY_BLOCK`` queries x
  ``KEY_BLOCK`` keys (a causal chunk skips the tiles right of its diagonal and masks only the diagonal ones). Both
  read float and quantized segments (``ops/latent.py``).

No path is slower than one plain ``scaled_dot_product_attention`` call over the whole cache expanded per head
(``fused(..., absorbed=False)``, memory O(H x T x S)) at any context length, and none holds more than a bounded
number of scores whatever S is; measured by ``bench/bench_mla_attention.py --vs-plain`` (``bench/README.md``,
MLA attention).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import mlx.core as mx

from .. import metal
from . import latent
from .mla_attention_metal import mla_attention_metal
from .mla_paths import Keys, LeftPaddedCausal, Mask, absorbed_blocks, expanded_blocks, fused, segments

__all__ = ["ABSORBED_MAX_QUERIES", "FUSED_ABSORBED_MAX_QUERIES", "KEY_BLOCK", "QUERY_BLOCK", "SCORE_BUDGET_BYTES",
           "Keys", "LeftPaddedCausal", "Mask", "absorbs", "auto_key_block", "mla_attention"]  # fmt: skip

KEY_BLOCK = 512  # keys per block: expanded tiles are QUERY_BLOCK x KEY_BLOCK; absorbed blocks a multiple of it
QUERY_BLOCK = 128  # expanded: queries per tile (a causal chunk of T queries on an empty cache computes
# ~(1 + QUERY_BLOCK / T) / 2 of its T x T scores)
SCORE_BUDGET_BYTES = 32 << 20  # key_block=None, absorbed: blocks as large as B x H x T x block float32 scores fit in this
ABSORBED_MAX_QUERIES = 128  # latent-space (absorbed) attention up to this many queries, expanded beyond
FUSED_ABSORBED_MAX_QUERIES = 32  # one fused absorbed call up to this many queries (decode, speculative verify passes)


def auto_key_block(B: int, H: int, T: int, absorbed: bool) -> int:
    """Keys per block when none is given. Absorbed (decode, short chunks): the largest multiple of ``KEY_BLOCK`` whose
    float32 scores (B x H x T x block) fit ``SCORE_BUDGET_BYTES``, so decode runs few, large blocks (per-block overhead
    dominates small ones); over a paged cache such a block spans several pages. Expanded: ``KEY_BLOCK``, in tiles of
    ``QUERY_BLOCK`` queries (B x H x QUERY_BLOCK x KEY_BLOCK scores each; larger blocks measured no faster and take
    more memory). Either way memory does not grow with the context."""
    if not absorbed:
        return KEY_BLOCK
    return max(1, SCORE_BUDGET_BYTES // (4 * B * H * T * KEY_BLOCK)) * KEY_BLOCK


def absorbs(T: int, S: int, r: int, dn: int, dv: int) -> bool:
    """Whether T queries over S keys run in latent space: at most ``ABSORBED_MAX_QUERIES`` queries, and fewer
    multiply-adds per head than the expanded form, T r d + T S (2r + dr) < S r d + T S (d + dr) with d = dn + dv
    (absorbed: each query mapped into and its output out of latent space, scores and weighted sum r + dr and r wide;
    expanded: each key expanded, scores dn + dr and weighted sum dv wide), i.e. T < S r d / (r d + S (2r - d)). So
    decode and short chunks over a longer cache run absorbed, a chunk on an empty or short cache expanded (T = S:
    always, for 2r > d). Both forms compute the same T x S exponentials."""
    d = dn + dv
    return T <= ABSORBED_MAX_QUERIES and T * (r * d + S * (2 * r - d)) < S * r * d


def mla_attention(
    q_nope: mx.array, q_pe: mx.array, kv_latent: Keys, k_pe: Keys, embed_q: Callable, unembed_out: Callable,
    scale: float, mask: Mask = None, *, key_block: Optional[int] = None, absorbed: Optional[bool] = None,
) -> mx.array:
    """Attention output [B, H, T, dv] (shapes: ``ops/mla_paths.py``). ``kv_latent`` / ``k_pe``: one part each or lists
    of segments of the same widths (a paged cache's pages, ``fetch()``), each float or quantized (``QuantizedLatent``:
    read as stored, never dequantized whole). ``key_block`` keys per block (None: ``auto_key_block``); ``absorbed``
    forces the form (default: ``absorbs``)."""
    B, H, T, dn = q_nope.shape
    kv_latent, k_pe = segments(kv_latent), segments(k_pe)
    if absorbed is None:
        r = latent.features(kv_latent[0])
        dv = unembed_out(mx.zeros((1, 1, 1, r), q_nope.dtype)).shape[-1]  # a shape only: nothing is computed
        absorbed = absorbs(T, sum(map(latent.width, kv_latent)), r, dn, dv)
    key_block = key_block or auto_key_block(B, H, T, absorbed)
    args = (q_nope, q_pe, kv_latent, k_pe, embed_q, unembed_out, scale, mask)
    floats = not (latent.is_quantized(kv_latent[0]) or latent.is_quantized(k_pe[0]))
    if floats and absorbed and metal.enabled():
        return mla_attention_metal(*args, key_block=key_block)
    if not absorbed:
        return expanded_blocks(*args, key_block, QUERY_BLOCK)
    if floats and len(kv_latent) == 1 and latent.width(kv_latent[0]) <= key_block and T <= FUSED_ABSORBED_MAX_QUERIES:
        return fused(q_nope, q_pe, kv_latent[0], k_pe[0], embed_q, unembed_out, scale, mask, True)
    return absorbed_blocks(*args, key_block)
