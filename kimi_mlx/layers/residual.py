"""The residual stream: what flows from one decoder layer to the next, and across a pipeline boundary.

Two kinds, one protocol (every decoder layer maps ``(stream, mask, cache) -> stream``, updating it in place):

- ``ResidualSum`` (Kimi Linear; Kimi-K3 without AttnRes): ``h`` [B, T, d], to which each sublayer adds its output.
- ``AttnResStream`` (Kimi-K3's cross-layer attention residuals, spec §2.3): the completed block snapshots ``raw``
  [K, B, T, d] with their ``inv_rms`` [K, B, T, 1] float32, and the running ``partial`` sum [B, T, d] of the current
  block. A sublayer's input is a ``ResidualMix`` of snapshots and partial sum (softmax over depth); the first layer of
  a block stores the partial sum as a snapshot and its attention output starts the next one.

Across a pipeline boundary a stream travels as one array: ``message()`` in the dtype the stream started with, shaped
``message_shape(boundary, B, T)``; ``from_message`` rebuilds it on the next rank from a ``Boundary``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn

from ..ops.attn_res import attn_res_mix, attn_res_mix_scored, inv_rms


@dataclass(frozen=True)
class Boundary:
    """The residual stream entering a decoder layer, as a pipeline stage receives it: its ``stream_type``, the
    ``hidden`` size and ``dtype`` (the embedding's output dtype); for AttnRes the ``blocks`` snapshots completed
    before the layer and the RMSNorm ``eps`` of their mixes (a plain sum: 0 and None)."""

    stream_type: type
    hidden: int
    dtype: mx.Dtype
    blocks: int = 0
    eps: Optional[float] = None


class ResidualSum:
    """The plain residual stream ``h`` [B, T, d] (each layer adds its sublayers' outputs to it); ``dtype``: h's dtype
    at the first layer (messages travel in it)."""

    def __init__(self, h: mx.array):
        self.h = h
        self.dtype = h.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """[B, T, d] of the hidden state."""
        return self.h.shape

    def message(self) -> mx.array:
        """What the next pipeline stage receives: h [B, T, d] in ``dtype``."""
        return self.h.astype(self.dtype)

    @staticmethod
    def message_shape(boundary: Boundary, B: int, T: int) -> tuple[int, ...]:
        return (B, T, boundary.hidden)

    @classmethod
    def from_message(cls, message: mx.array, boundary: Boundary) -> ResidualSum:
        return cls(message)


class ResidualMix(nn.Module):
    """One AttnRes mix point: weightless RMSNorm of each source, scored by ``norm.weight * proj.weight``."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.proj = nn.Linear(hidden, 1, bias=False)

    def __call__(self, raw: mx.array, raw_inv_rms: mx.array, partial: mx.array) -> mx.array:
        """raw [K, B, T, d] snapshots (K >= 1), raw_inv_rms [K, B, T, 1] float32, partial [B, T, d] -> [B, T, d]."""
        eps = self.norm.eps
        w_n = self.norm.weight.astype(mx.float32)
        if type(self.proj) is nn.Linear:  # a plain projection: fold both weights into one score vector
            w_eff = w_n * self.proj.weight[0].astype(mx.float32)
            return attn_res_mix(raw, raw_inv_rms, partial, w_eff, eps)
        # a wrapped projection (e.g. LoRA) is called, never read
        return attn_res_mix_scored(raw, raw_inv_rms, partial, lambda k: self.proj(k * w_n), eps)


class AttnResStream:
    """Kimi-K3's AttnRes residual stream (see the module docstring): ``raw`` / ``inv_rms`` the completed snapshots
    (None before the first), ``partial`` [B, T, d] the running sum, ``eps`` the snapshots' RMSNorm epsilon.

    The snapshots are kept stacked, each ``inv_rms`` computed once when its block is stored (only the partial sum is
    new at each mix point; the stacked layout is what the Metal mix kernel reads, without a copy per mix).
    """

    def __init__(self, partial: mx.array, eps: float, raw: Optional[mx.array] = None):
        self.partial = partial
        self.dtype = partial.dtype
        self.eps = eps
        self.raw = raw
        self.inv_rms = None if raw is None else inv_rms(raw, eps)

    def mix(self, res: ResidualMix) -> mx.array:
        """The input of a sublayer (or the final hidden state) [B, T, d]: ``res`` over the snapshots and the partial
        sum, or the partial sum alone before the first snapshot."""
        return self.partial if self.raw is None else res(self.raw, self.inv_rms, self.partial)

    def add(self, y: mx.array, new_block: bool = False) -> None:
        """partial += y [B, T, d]; ``new_block``: the partial sum is stored as a snapshot and y starts the next."""
        if not new_block:
            self.partial = self.partial + y
            return
        x, r = self.partial[None], inv_rms(self.partial, self.eps)[None]
        if self.raw is None:
            self.raw, self.inv_rms = x, r
        else:
            self.raw = mx.concatenate([self.raw, x])
            self.inv_rms = mx.concatenate([self.inv_rms, r])
        self.partial = y

    @property
    def shape(self) -> tuple[int, ...]:
        """[B, T, d] of the hidden state."""
        return self.partial.shape

    def message(self) -> mx.array:
        """What the next pipeline stage receives: the snapshots, then the partial sum, [K + 1, B, T, d] in ``dtype``."""
        partial = self.partial.astype(self.dtype)
        return mx.concatenate([self.raw.astype(self.dtype), partial[None]])

    @staticmethod
    def message_shape(boundary: Boundary, B: int, T: int) -> tuple[int, ...]:
        return (boundary.blocks + 1, B, T, boundary.hidden)

    @classmethod
    def from_message(cls, message: mx.array, boundary: Boundary) -> AttnResStream:
        return cls(message[-1], boundary.eps, message[:-1])


Stream = Union[ResidualSum, AttnResStream]
