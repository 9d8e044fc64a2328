"""The whole KDA step as one Metal kernel launch (``metal_kernels/kda_recurrent.metal``): the prologue of
``kimi_mlx.ops.kda_gates`` (q/k L2 norm, q scale, decay gate, beta) and the recurrence of ``kda_recurrent``, T
sequential steps inside one launch.

Shapes (``B`` batch, ``T`` tokens, ``H`` heads), as ``kimi_mlx.ops.kda.kda_gated``: raw ``q``, ``k``: ``[B, T, H, Dk]``;
``v``: ``[B, T, H, Dv]``; ``f``: ``[B, T, H, Dk]``; ``b``: ``[B, T, H]``; ``A_log``: ``[H]``; ``dt_bias``:
``[H * Dk]``; ``state``: ``[B, H, Dv, Dk]`` float32 or None (zeros); ``mask``: ``[B, T]`` bool or None (True = real
token). q/k/v in float32, float16 or bfloat16 (one type; mixed types run in float32), f/b likewise. Dk and Dv are
multiples of 32 (one SIMD-group lane per 1/32 of a state row). Returns ``(o [B, T, H, Dv] in v.dtype, final state
[B, H, Dv, Dk] float32)``.

Custom kernels have no VJP: the launch is wrapped in ``kimi_mlx.metal.with_reference_vjp``, so gradients are those of
the pure prologue followed by the pure scan (``kda_recurrent`` unless the caller names another form of the same scan),
recomputed at the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from .. import metal
from .kda_gates import check_gated_shapes, kda_prologue
from .kda_recurrent import kda_recurrent

__all__ = ["KERNEL", "kda_recurrent_metal"]

KERNEL = "kda_recurrent"
metal.register(KERNEL)

_IO_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _check_launch(q, k, v, f, b, rows_per_group: int) -> None:
    """Errors the kernel cannot handle (head dims, dtypes, threadgroup size), raised before any work."""
    Dk, Dv = q.shape[-1], v.shape[-1]
    if Dk % 32 or Dv % 32:
        raise ValueError(f"kda_recurrent Metal kernel: Dk and Dv must be multiples of 32, got Dk={Dk}, Dv={Dv}")
    if rows_per_group < 1:
        raise ValueError(f"kda_recurrent Metal kernel: rows_per_group must be >= 1, got {rows_per_group}")
    most = metal.MAX_THREADS_PER_THREADGROUP // 32  # 16: fewer than the Dv rows of any grid, nothing to cap
    metal.check_threadgroup(KERNEL, f"rows_per_group={rows_per_group}", 32 * rows_per_group,
                            hint=f"at most {most} rows")  # fmt: skip
    for name, x in (("q", q), ("k", k), ("v", v), ("f", f), ("b", b)):
        if x.dtype not in _IO_DTYPES:
            raise ValueError(
                f"kda_recurrent Metal kernel: {name} has dtype {x.dtype}, expected float32/float16/bfloat16"
            )


def kda_recurrent_metal(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    f: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    *,
    lower_bound: float | None,
    l2_eps: float,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    rows_per_group: int = 4,
    reference_scan: Callable = kda_recurrent,
) -> tuple[mx.array, mx.array]:
    """One launch of ``metal_kernels/kda_recurrent.metal``; same arguments and result as ``kda_gated``.

    ``rows_per_group``: state rows (SIMD-groups) per threadgroup; the grid is ``(32, Dv, B*H)``; more than
    ``kimi_mlx.metal.MAX_THREADS_PER_THREADGROUP / 32`` (16) is a ValueError. ``reference_scan``: the pure scan
    (``kda_recurrent`` or ``kda_chunked`` at some chunk size, same arguments) whose gradient the op takes after the pure
    prologue. A RuntimeError when kernels are not ``kimi_mlx.metal.enabled()``.
    """
    check_gated_shapes(q, k, v, f, b, A_log, dt_bias, state, mask)
    _check_launch(q, k, v, f, b, rows_per_group)
    kernel = metal.kernel(KERNEL)
    if kernel is None:
        raise RuntimeError("kda_recurrent_metal: Metal kernels are not enabled (see kimi_mlx.metal.enabled)")
    B, T, H, Dk = q.shape
    if state is None:
        state = mx.zeros((B, H, v.shape[-1], Dk), dtype=mx.float32)
    live = mx.ones((B, T), dtype=mx.bool_) if mask is None else mask.astype(mx.bool_)

    def launch(*arrays):
        return _launch(kernel, *arrays, live, lower_bound, l2_eps, rows_per_group)

    def reference(q, k, v, f, b, A_log, dt_bias, state):
        qn, kn, g, beta = kda_prologue(q, k, f, b, A_log, dt_bias, lower_bound=lower_bound, l2_eps=l2_eps)
        return reference_scan(qn, kn, v, g, beta, state=state, mask=mask)

    return metal.with_reference_vjp(launch, reference)(q, k, v, f, b, A_log, dt_bias, state)


def _launch(kernel, q, k, v, f, b, A_log, dt_bias, state, mask, lower_bound, l2_eps, rows_per_group):
    """The launch itself, on arguments checked by ``kda_recurrent_metal`` (state an array, mask ``[B, T]`` bool)."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    out_dtype = v.dtype
    # q, k, v share one input type, f and b another; mixed inputs run in float32 (the pure path's precision).
    if not q.dtype == k.dtype == v.dtype:
        q, k, v = (x.astype(mx.float32) for x in (q, k, v))
    if f.dtype != b.dtype:
        f, b = f.astype(mx.float32), b.astype(mx.float32)
    y, state_out = kernel(
        inputs=[
            q, k, v, f, b, A_log.astype(mx.float32), dt_bias.astype(mx.float32), state.astype(mx.float32), mask,
            T, Dk**-0.5, float(l2_eps), 0.0 if lower_bound is None else float(lower_bound),
        ],
        template=[("InT", v.dtype), ("GT", f.dtype), ("Dk", Dk), ("Dv", Dv), ("LOWER_BOUND", lower_bound is not None)],
        grid=(32, Dv, B * H),
        threadgroup=(32, rows_per_group, 1),
        output_shapes=[(B, T, H, Dv), (B, H, Dv, Dk)],
        output_dtypes=[v.dtype, mx.float32],
    )  # fmt: skip
    return y.astype(out_dtype), state_out
