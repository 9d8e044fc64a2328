"""Matmuls over GGML block weights, ``y = x Wᵀ`` with W the exact dequantization, float32 accumulation.

W is dequantized in bounded chunks, each chunk's product computed before the next chunk is dequantized
(``mx.depends``), so at most one chunk of dequantized weights is alive at a time. Gradients flow to ``x`` only
(blocks are uint8 data); the backward pass dequantizes again, chunk by chunk, instead of keeping the forward's
weights, so training on a GGML base stays within the same bound.

On Metal (``kimi_mlx.metal.enabled()``, :mod:`.metal`): up to ``MATVEC_MAX_ROWS`` rows of x (decode) go through the
mat-vec kernel straight from the blocks; more rows (prefill) dequantize each chunk with the dequantization kernel,
then MLX's GEMM. The pure path (any device) is the reference and gives the gradients.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ... import metal
from ..experts import expert_view
from .dequant import dequantize
from .formats import get_format, row_bytes
from .metal import dequantize_metal, matvec_metal

__all__ = ["DEQUANT_CHUNK_BYTES", "ggml_expert_matmul", "ggml_gather_matmul", "ggml_matmul"]

#: Default bound on the float32 bytes of weights dequantized at once (one chunk).
DEQUANT_CHUNK_BYTES = 64 << 20
#: Metal: rows of x (or (x, expert) pairs) up to which the mat-vec kernel reads the blocks directly.
MATVEC_MAX_ROWS = 8

F32 = mx.float32


def _check(x: mx.array, blocks: mx.array, name: str, ndim: int) -> None:
    get_format(name)
    if not mx.issubdtype(x.dtype, mx.floating):
        raise ValueError(f"{name}: x must be a float array, got {x.dtype}")
    if blocks.dtype != mx.uint8 or blocks.ndim != ndim:
        raise ValueError(f"{name}: blocks must be uint8 with {ndim} axes, got {blocks.dtype} {tuple(blocks.shape)}")
    expected = row_bytes(name, x.shape[-1])
    if blocks.shape[-1] != expected:
        raise ValueError(
            f"{name}: for K={x.shape[-1]} a weight row is {expected} bytes, got blocks {tuple(blocks.shape)}"
        )


def _after(a: mx.array, prev) -> mx.array:
    """``a``, made to wait for ``prev`` (the previous chunk's result) unless there is none."""
    return a if prev is None else mx.depends(a, prev)


def _spans(n: int, step: int) -> list[tuple[int, int]]:
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _dequantize(blocks: mx.array, name: str) -> mx.array:
    """float32 weights of ``blocks``: the Metal kernel when enabled, else the pure path (bitwise the same)."""
    w = dequantize_metal(blocks, name) if metal.enabled() else None
    return dequantize(blocks, name) if w is None else w


def _xw_rows(x: mx.array, blocks: mx.array, name: str, step: int) -> mx.array:
    """x [..., K] float32 @ Wᵀ, W = blocks [N, row_bytes] dequantized ``step`` rows at a time -> [..., N]."""
    outs = []
    for r0, r1 in _spans(blocks.shape[0], step):
        w = _dequantize(_after(blocks[r0:r1], outs[-1] if outs else None), name)
        outs.append(x @ w.T)
    return mx.concatenate(outs, axis=-1) if len(outs) > 1 else outs[0]


def _dy_w_rows(dy: mx.array, blocks: mx.array, name: str, step: int) -> mx.array:
    """dy [..., N] float32 @ W -> [..., K], same chunks as :func:`_xw_rows`, summed as it goes."""
    dx = None
    for r0, r1 in _spans(blocks.shape[0], step):
        w = dequantize(_after(blocks[r0:r1], dx), name)
        part = dy[..., r0:r1] @ w
        dx = part if dx is None else dx + part
    return dx


def _pairs(a: mx.array, blocks: mx.array, name: str, sel: mx.array, step: int, *, backward: bool) -> mx.array:
    """Per (x, expert) pair p: ``a[p] @ W[sel[p]]ᵀ`` (a = x [P, M, K] float32) -> [P, M, N], or with ``backward``
    ``a[p] @ W[sel[p]]`` (a = dy [P, M, N]) -> [P, M, K]; W[e] = blocks[e] [N, row_bytes] dequantized, ``step``
    pairs at a time, only for the selected experts."""
    outs = []
    for p0, p1 in _spans(sel.shape[0], step):
        w = (dequantize if backward else _dequantize)(_after(blocks[sel[p0:p1]], outs[-1] if outs else None), name)
        outs.append(a[p0:p1] @ (w if backward else w.swapaxes(-1, -2)))
    return mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]


def _x_only(forward, backward):
    """``f(x)`` = ``forward(x)`` with VJP ``backward(cotangent)`` (recomputing, not saving, the weights)."""

    @mx.custom_function
    def f(x):
        return forward(x)

    @f.vjp
    def f_vjp(primals, cotangent, output):
        return backward(cotangent)

    return f


def ggml_matmul(
    x: mx.array, blocks: mx.array, name: str, *, max_chunk_bytes: int = DEQUANT_CHUNK_BYTES
) -> mx.array:
    """x [..., K] (any float dtype) @ Wᵀ -> [..., N] in x's dtype; blocks: [N, row_bytes] uint8 in GGML type ``name``.

    Float32 math. W is dequantized ``max(1, max_chunk_bytes // (4*K))`` rows at a time, so at most
    ``max(max_chunk_bytes, 4*K)`` bytes of dequantized weights (default 64 MiB) exist at once, forward and backward;
    building one chunk takes temporaries of a few times its size (``test_chunk_memory_bound`` in
    tests/test_ggml_blocks.py holds the peak under 8 chunks)."""
    _check(x, blocks, name, 2)
    if metal.enabled() and x.size // x.shape[-1] <= MATVEC_MAX_ROWS:
        return matvec_metal(x, blocks, name)
    step = max(1, max_chunk_bytes // (4 * x.shape[-1]))
    f = _x_only(
        lambda x32: _xw_rows(x32, blocks, name, step),
        lambda dy: _dy_w_rows(dy, blocks, name, step),
    )
    return f(x.astype(F32)).astype(x.dtype)


def ggml_expert_matmul(
    x: mx.array, blocks: mx.array, name: str, e: int, *, max_chunk_bytes: int = DEQUANT_CHUNK_BYTES
) -> mx.array:
    """x [n, K] through expert ``e`` of blocks [E, N, row_bytes] uint8 -> [n, N] in x's dtype (chunked like
    :func:`ggml_matmul`); the per-expert product of the sorted MoE path. Reads the expert's blocks as a view of the
    stack (no copy)."""
    if blocks.ndim != 3:
        raise ValueError(f"{name}: expert blocks must be [E, N, row_bytes], got {tuple(blocks.shape)}")
    return ggml_matmul(x, expert_view(blocks, e), name, max_chunk_bytes=max_chunk_bytes)


def ggml_gather_matmul(
    x: mx.array,
    blocks: mx.array,
    name: str,
    indices: mx.array,
    *,
    sorted_indices: bool = False,
    max_chunk_bytes: int = DEQUANT_CHUNK_BYTES,
) -> mx.array:
    """``mx.gather_qmm(x, W, ..., rhs_indices=indices, transpose=True)`` over GGML blocks.

    x: [..., M, K] any float dtype; blocks: [E, N, row_bytes] uint8; indices: integer [...], broadcast with
    x.shape[:-2] (mlx-lm's SwitchGLU passes x [..., 1, 1, K] and indices [..., k]) -> [*batch, M, N] in x's
    dtype (e.g. [..., k, 1, N]). Only the selected experts are dequantized, ``max(1, max_chunk_bytes // (4*N*K))``
    (x, expert) pairs at a time (so at most ``max(max_chunk_bytes, 4*N*K)`` bytes of weights at once, forward and
    backward). ``sorted_indices`` is the kernels' hint; the result is the same either way."""
    _check(x, blocks, name, 3)
    if x.ndim < 2:
        raise ValueError(f"{name}: x must be [..., M, K], got {tuple(x.shape)}")
    if not mx.issubdtype(indices.dtype, mx.integer):
        raise ValueError(f"{name}: indices must be integers, got {indices.dtype}")
    (M, K), N = x.shape[-2:], blocks.shape[1]
    batch = mx.broadcast_shapes(x.shape[:-2], indices.shape)
    if metal.enabled() and M == 1 and math.prod(batch) <= MATVEC_MAX_ROWS:
        return mx.expand_dims(matvec_metal(x.squeeze(-2), blocks, name, indices), -2)
    sel = mx.broadcast_to(indices, batch).reshape(-1)
    step = max(1, max_chunk_bytes // (4 * N * K))
    f = _x_only(
        lambda xp: _pairs(xp, blocks, name, sel, step, backward=False),
        lambda dy: _pairs(dy, blocks, name, sel, step, backward=True),
    )
    xp = mx.broadcast_to(x.astype(F32), (*batch, M, K)).reshape(-1, M, K)
    return f(xp).reshape(*batch, M, N).astype(x.dtype)
