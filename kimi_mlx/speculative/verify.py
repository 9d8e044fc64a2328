"""One verify pass of ``[last token, d_1 .. d_k]`` through the target, and the exact rollback of a rejected suffix.

``verify_pass`` takes a checkpoint of the ``HybridCache`` (``cache.checkpoint()``: the KDA conv and recurrent states,
and the offset) before it feeds the 1 + k tokens in one forward pass. ``rollback`` then leaves the cache holding
exactly ``last`` and the accepted drafts: when some drafts were rejected it trims the cache back to the checkpoint
(``HybridCache.trim``: the MLA latents cut by length, float or quantized, the KDA states set back) and re-feeds the
accepted tokens (one forward pass of n + 1 tokens). The cache then equals a fresh prefill of the same tokens.

Why re-feed rather than keep per-step KDA states during the verify pass (the two options of issue 24), with the
numbers of ``bench/bench_speculative.py`` (CPU, float32, 2 shared cores; it prints the cost curve, re-feeds included):

- keeping per-step states needs every KDA scan path (recurrent, chunked, their Metal kernels) to hand out the state
  after every position (1 + k states of [B, H, Dv, Dk] float32 per KDA layer: 2 MiB per layer per position on Kimi
  Linear 48B, 64 MiB per pass at k = 16 on its 24 KDA layers) and the conv window per position; it then costs
  nothing after a rejection. It costs at least the verify pass alone, which is the bound measured for it.
- re-feeding costs one more forward pass of n + 1 tokens, only after a rejection, and changes nothing below the
  cache: the states it leaves are those the model's own forward computes (bitwise those of the same segments fed
  to a fresh cache, tests/test_speculative.py).

Measured: a re-feed of n + 1 tokens costs about what a verify pass of that many tokens costs (1.0x a decode step for
n = 0; 2-4x for n = 1..4 on CPU, where a multi-token pass is compute- not weight-bound), so on CPU a pass with a
rejection costs up to ~1.8x the per-step bound. Re-feed is what is built, for exactness and for touching no scan
path; the adaptive length keeps re-feeds short (after a rejection it drafts accepted + 1). The per-step option is
the next step if the cost curve on a Mac (weight-bound: a 2..17-token pass near one decode step) shows re-feeds
matter; ``rollback`` is then the one place that changes.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..cache import HybridCache

__all__ = ["rollback", "verify_pass"]


def verify_pass(model: nn.Module, cache: HybridCache, last: int, drafts: Sequence[int]) -> mx.array:
    """Feed ``[last, *drafts]`` (``last``: the newest token, not yet in ``cache``) in one pass, after a transient
    checkpoint (it releases none of the caller's: ``rollback`` releases it). Returns the logits ``[1 + k, vocab]``:
    row i predicts the token after ``last, d_1 .. d_i``."""
    if drafts:
        cache.checkpoint(transient=True)
    return model(mx.array([[last, *drafts]], dtype=mx.int32), cache=cache)[0]


def rollback(model: nn.Module, cache: HybridCache, last: int, drafts: Sequence[int], accepted: int) -> None:
    """After ``verify_pass(model, cache, last, drafts)``: keep ``last`` and the first ``accepted`` drafts in
    ``cache``, drop the rest (back to the pass's checkpoint, then re-feed what was accepted), and release the pass's
    checkpoint (transient: the caller's checkpoints are those it had before the pass, however many it keeps)."""
    if not 0 <= accepted <= len(drafts):
        raise ValueError(f"accepted must be in [0, {len(drafts)}], got {accepted}")
    if not drafts:
        return
    if accepted < len(drafts):
        cache.trim(len(drafts) + 1)
        model(mx.array([[last, *drafts[:accepted]]], dtype=mx.int32), cache=cache)
        mx.eval([c.state for c in cache])
    cache.checkpoints.pop()  # the pass's own checkpoint (the newest): the caller's checkpoints stay as they were
