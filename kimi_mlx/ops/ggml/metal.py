"""GGML block tensors through Metal kernels: ``metal_kernels/ggml_dequant.metal`` (blocks -> float rows, for
prefill: dequantize a bounded chunk of rows, then MLX's GEMM) and ``metal_kernels/ggml_matvec.metal`` (decode
mat-vec straight from the blocks, plain or gathered by expert id).

Blocks are the GGUF bytes: uint8 ``[..., rows, row_bytes]`` with ``row_bytes = cols / block_elems * type_bytes``
(:mod:`.formats`); the kernels read the type's lookup tables (``formats.mx_tables``) as buffers. Dequantized weights
are bitwise ``gguf.quants.dequantize`` (the kernel header says what a compiler could change). Both functions return
None when kernels are not enabled (``kimi_mlx.metal.enabled()``), so callers fall back to the pure path
(:mod:`.dequant`, :mod:`.matmul`). ``matvec_metal``'s gradient w.r.t. x is the pure ``x @ dequantize(W)ᵀ``'s
(``kimi_mlx.metal.with_reference_vjp``); blocks and indices get none.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ... import metal
from .dequant import dequantize
from .formats import get_format, mx_tables

__all__ = ["DEQUANT_KERNEL", "MATVEC_KERNEL", "dequantize_metal", "matvec_metal"]

DEQUANT_KERNEL = "ggml_dequant"
MATVEC_KERNEL = "ggml_matvec"
metal.register(DEQUANT_KERNEL)
metal.register(MATVEC_KERNEL)

_FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_CHUNK = 16  # weights one thread decodes (every block size is a multiple)
_PLACEHOLDER = {"grid": mx.uint8, "signs": mx.uint8, "values": mx.int8}


def _check_blocks(blocks: mx.array, name: str, min_ndim: int, what: str) -> int:
    """The format's block count per row; ValueError for an unknown type, a non-uint8 array or a bad shape."""
    f = get_format(name)
    if blocks.dtype != mx.uint8:
        raise ValueError(f"{what}: {name} blocks must be uint8, got {blocks.dtype}")
    if blocks.ndim < min_ndim or blocks.shape[-1] == 0 or blocks.shape[-1] % f.type_bytes:
        raise ValueError(
            f"{what}: {name} blocks must be [{'E, ' if min_ndim == 3 else '..., '}rows, k * {f.type_bytes}] bytes, "
            f"got shape {tuple(blocks.shape)}"
        )
    return blocks.shape[-1] // f.type_bytes


@functools.cache
def _tables(name: str) -> tuple[mx.array, ...]:
    """grid, signs, values of ``name`` (formats' arrays), 1-element placeholders for those it has none of."""
    t = mx_tables(name)
    return tuple(t[k] if k in t else mx.zeros((1,), dt) for k, dt in _PLACEHOLDER.items())


def dequantize_metal(blocks: mx.array, name: str, dtype: mx.Dtype = mx.float32) -> Optional[mx.array]:
    """blocks ``[..., rows, row_bytes]`` uint8 -> weights ``[..., rows, cols]`` in ``dtype`` (float32: bitwise
    gguf-py; float16/bfloat16: those values rounded once). One launch; grid ``(cols / 16, rows, 1)``, one thread per
    16 weights. None when kernels are not enabled."""
    nb = _check_blocks(blocks, name, 2, "dequantize_metal")
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dequantize_metal: {name} output dtype must be float32/float16/bfloat16, got {dtype}")
    kernel = metal.kernel(DEQUANT_KERNEL)
    if kernel is None:
        return None
    f = get_format(name)
    lead, rows = blocks.shape[:-2], blocks.shape[-2]
    total = math.prod(blocks.shape[:-1])
    cols = nb * f.block_elems
    chunks = cols // _CHUNK
    tx = min(chunks, 256)
    (out,) = kernel(
        inputs=[blocks.reshape(total, blocks.shape[-1]), *_tables(name)],
        template=[("TYPE", int(f.qtype)), ("OT", dtype)],
        grid=(chunks, total, 1),
        threadgroup=(tx, max(1, 256 // tx), 1),
        output_shapes=[(total, cols)],
        output_dtypes=[dtype],
    )
    return out.reshape(*lead, rows, cols)


def matvec_metal(
    x: mx.array,
    blocks: mx.array,
    name: str,
    indices: Optional[mx.array] = None,
    *,
    rows_per_threadgroup: int = 4,
) -> Optional[mx.array]:
    """Decode product ``y = x Wᵀ`` straight from the blocks, float32 accumulation, y in x's dtype.

    Plain: x ``[..., K]``, blocks ``[N, row_bytes]`` -> ``[..., N]``. Gathered (``indices`` given, like
    ``gather_qmm`` for decode): blocks ``[E, N, row_bytes]``, integer ``indices`` in [0, E) (not checked: that
    would wait for them) whose shape broadcasts with ``x.shape[:-1]`` to S; pair s multiplies x[s] with expert
    ``indices[s]`` -> ``[*S, N]`` (e.g. x ``[T, 1, K]`` with indices ``[T, k]`` for top-k routing). One launch, grid
    ``(32, N, pairs)``: one SIMD-group per output element, ``rows_per_threadgroup`` output rows per threadgroup
    (capped at N; more than ``kimi_mlx.metal.MAX_THREADS_PER_THREADGROUP / 32`` = 16 is a ValueError); every pair
    decodes its own row, so this is for few rows of x. None when kernels are not enabled.
    Gradient w.r.t. x: the pure path's."""
    rows = _check_matvec(x, blocks, name, indices, rows_per_threadgroup)
    kernel = metal.kernel(MATVEC_KERNEL)
    if kernel is None:
        return None
    pairs = _MatvecPairs.of(x, blocks, indices)
    run = functools.partial(_matvec_launch, kernel, pairs, name, rows)
    reference = functools.partial(_matvec_reference, pairs, blocks, name, indices is None)
    return metal.with_reference_vjp(run, reference)(x)[0]


def _check_matvec(x: mx.array, blocks: mx.array, name: str, indices: Optional[mx.array],
                  rows_per_threadgroup: int) -> int:
    """The output rows per threadgroup (``rows_per_threadgroup`` capped at N); ValueError for arguments
    ``matvec_metal`` does not take."""
    what = "matvec_metal"
    nb = _check_blocks(blocks, name, 2 if indices is None else 3, what)
    if indices is None and blocks.ndim != 2:
        raise ValueError(f"{what}: {name} blocks must be [N, row_bytes] without indices, got {tuple(blocks.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{what}: x dtype must be float32/float16/bfloat16, got {x.dtype}")
    K = nb * get_format(name).block_elems
    if x.ndim < 1 or x.shape[-1] != K:
        raise ValueError(f"{what}: x must be [..., {K}] for {name} rows of {blocks.shape[-1]} bytes, got {x.shape}")
    if rows_per_threadgroup < 1:
        raise ValueError(f"{what}: rows_per_threadgroup must be >= 1, got {rows_per_threadgroup}")
    N = blocks.shape[-2]
    rows = max(1, min(rows_per_threadgroup, N))  # more would only idle (MLX checks the uncapped threadgroup)
    most = metal.MAX_THREADS_PER_THREADGROUP // 32
    metal.check_threadgroup(MATVEC_KERNEL, f"rows_per_threadgroup={rows_per_threadgroup}", 32 * rows,
                            hint=f"at most {most} rows")  # fmt: skip
    if indices is not None and not mx.issubdtype(indices.dtype, mx.integer):
        raise ValueError(f"{what}: indices must be integers, got {indices.dtype}")
    return rows


@dataclass(frozen=True)
class _MatvecPairs:
    """The (x row, expert) pairs of a mat-vec: ``shape`` S of the output's leading dimensions, their count P, the
    experts ``[E, N, row_bytes]`` (one, ``[1, N, row_bytes]``, for a plain product) and each pair's expert ``idx``
    ``[P]`` int32."""

    shape: tuple
    count: int
    experts: mx.array
    idx: mx.array

    @classmethod
    def of(cls, x: mx.array, blocks: mx.array, indices: Optional[mx.array]) -> _MatvecPairs:
        if indices is None:  # one expert, every pair reads it
            shape = tuple(x.shape[:-1])
            P = math.prod(shape)
            return cls(shape, P, blocks[None], mx.zeros((P,), mx.int32))
        shape = tuple(mx.broadcast_shapes(x.shape[:-1], indices.shape))
        P = math.prod(shape)
        return cls(shape, P, blocks, mx.broadcast_to(indices, shape).reshape(P).astype(mx.int32))


def _matvec_launch(kernel, pairs: _MatvecPairs, name: str, rows: int, x: mx.array) -> list[mx.array]:
    """The kernel's ``[*S, N]`` product: grid ``(32, N, P)``, threadgroup ``(32, rows, 1)``."""
    S, P, K = pairs.shape, pairs.count, x.shape[-1]
    N = pairs.experts.shape[-2]
    (y,) = kernel(
        inputs=[mx.broadcast_to(x, (*S, K)).reshape(P, K), pairs.experts, *_tables(name), pairs.idx],
        template=[("TYPE", int(get_format(name).qtype)), ("OT", x.dtype)],
        grid=(32, N, P),
        threadgroup=(32, rows, 1),
        output_shapes=[(P, N)],
        output_dtypes=[x.dtype],
    )
    return [y.reshape(*S, N)]


def _matvec_reference(pairs: _MatvecPairs, blocks: mx.array, name: str, plain: bool, x: mx.array) -> list[mx.array]:
    """The same product through the pure path (``x @ dequantize(W)ᵀ``), for the gradient."""
    if plain:
        return [x @ dequantize(blocks, name).astype(x.dtype).T]
    S, P, K = pairs.shape, pairs.count, x.shape[-1]
    w = dequantize(blocks[pairs.idx], name).astype(x.dtype)  # [P, N, K]: only the selected experts
    x2 = mx.broadcast_to(x, (*S, K)).reshape(P, 1, K)
    return [(x2 @ w.swapaxes(-1, -2)).reshape(*S, w.shape[-2])]
