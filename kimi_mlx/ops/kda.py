"""Kimi Delta Attention (KDA, spec §1.3, §1.4): which path runs, decided here and only here.

The model calls ``kda_gated`` (raw projections in); ``kda_forward`` is the scan on prepared inputs. Paths:

- ``kda_gated``, Metal, ``T <= RECURRENT_KERNEL_MAX_T``: ``kda_recurrent_metal``, prologue and recurrence in one launch;
- ``kda_gated`` otherwise: ``kda_prologue`` (``kda_gates``), then ``kda_forward``;
- ``kda_forward``, ``T <= RECURRENT_MAX_T``: ``kda_recurrent`` (token by token; decode);
- ``kda_forward``, longer: the chunked scan with ``chunk_size_for(T)`` tokens per chunk, ``kda_chunked_metal`` on
  Metal, else ``kda_chunked``.

"Metal" means ``kimi_mlx.metal.enabled()`` and head dims Dk, Dv that are multiples of ``KERNEL_HEAD_DIM_MULTIPLE``.
The pure functions live in ``kda_recurrent``, ``kda_chunked`` and ``kda_gates``; each Metal module takes its gradient
from the pure function it mirrors. Shapes (``B`` batch, ``T`` tokens, ``H`` heads): q, k, g ``[B, T, H, Dk]``; v
``[B, T, H, Dv]``; beta ``[B, T, H]``; f ``[B, T, H, Dk]``; b ``[B, T, H]``; A_log ``[H]``; dt_bias ``[H * Dk]``;
state ``[B, H, Dv, Dk]`` float32 or None (zeros); mask ``[B, T]`` bool or None (True = real token). Every path returns
``(o [B, T, H, Dv] in v.dtype, final state [B, H, Dv, Dk] float32)``. How the thresholds were chosen: bench/README.md.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from .. import metal
from .kda_chunked import kda_chunked
from .kda_chunked_metal import kda_chunked_metal
from .kda_gates import check_gated_shapes, kda_prologue
from .kda_recurrent import kda_recurrent
from .kda_recurrent_metal import kda_recurrent_metal

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "KERNEL_HEAD_DIM_MULTIPLE",
    "RECURRENT_KERNEL_MAX_T",
    "RECURRENT_MAX_T",
    "SHORT_CHUNK_SIZE",
    "SHORT_CHUNK_T",
    "chunk_size_for",
    "kda_forward",
    "kda_gated",
]  # fmt: skip

RECURRENT_MAX_T = 4  # kda_forward: token by token up to this many tokens, chunked above
SHORT_CHUNK_T = 32  # chunk size SHORT_CHUNK_SIZE below this many tokens, DEFAULT_CHUNK_SIZE from here on
SHORT_CHUNK_SIZE = 8
DEFAULT_CHUNK_SIZE = 16
RECURRENT_KERNEL_MAX_T = 64  # kda_gated on Metal: the fused recurrent kernel up to this many tokens
KERNEL_HEAD_DIM_MULTIPLE = 32  # both kernels need Dk and Dv multiples of this (one SIMD-group across a state row)


def chunk_size_for(T: int) -> int:
    """Tokens per chunk of the chunked scan for a T-token input (T > ``RECURRENT_MAX_T``)."""
    return SHORT_CHUNK_SIZE if T < SHORT_CHUNK_T else DEFAULT_CHUNK_SIZE


def _kernels_fit(q: mx.array, v: mx.array) -> bool:
    """Kernels enabled and head dims the kernels take."""
    m = KERNEL_HEAD_DIM_MULTIPLE
    return metal.enabled() and q.shape[-1] % m == 0 and v.shape[-1] % m == 0


def _pure_scan(T: int):
    """The pure scan ``kda_forward`` runs for T tokens (same arguments as ``kda_recurrent``)."""
    return kda_recurrent if T <= RECURRENT_MAX_T else partial(kda_chunked, chunk_size=chunk_size_for(T))


def kda_forward(q, k, v, g, beta, state=None, mask=None) -> tuple[mx.array, mx.array]:
    """The KDA scan on prepared inputs (q, k L2-normalised, q scaled by ``Dk**-0.5``; g log-decay; beta in (0, 1))."""
    T = q.shape[1]
    if T > RECURRENT_MAX_T and _kernels_fit(q, v):
        return kda_chunked_metal(q, k, v, g, beta, state=state, mask=mask, chunk_size=chunk_size_for(T))
    return _pure_scan(T)(q, k, v, g, beta, state=state, mask=mask)


def kda_gated(q, k, v, f, b, A_log, dt_bias, *, lower_bound, l2_eps, state=None, mask=None):
    """KDA from the raw projections: normalise q/k, compute the gates, run the scan. The model's one entry point.

    q, k raw (post short-conv), v, f, b, A_log, dt_bias, state, mask: shapes above, any float dtype.
    ``lower_bound``: None (softplus decay gate) or K3's lb < 0 (``kda_gates.kda_decay``); ``l2_eps``: eps inside the
    sqrt of the q/k L2 norm. Returns ``(o [B, T, H, Dv] in v.dtype, final state [B, H, Dv, Dk] float32)``.
    """
    check_gated_shapes(q, k, v, f, b, A_log, dt_bias, state, mask)
    T = q.shape[1]
    if 0 < T <= RECURRENT_KERNEL_MAX_T and _kernels_fit(q, v):
        # Gradients are those of the pure path this function takes with kernels off.
        return kda_recurrent_metal(q, k, v, f, b, A_log, dt_bias, lower_bound=lower_bound, l2_eps=l2_eps,
                                   state=state, mask=mask, reference_scan=_pure_scan(T))  # fmt: skip
    qn, kn, g, beta = kda_prologue(q, k, f, b, A_log, dt_bias, lower_bound=lower_bound, l2_eps=l2_eps)
    return kda_forward(qn, kn, v, g, beta, state=state, mask=mask)
