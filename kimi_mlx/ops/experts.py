"""Stacked expert weights (``[E, ...]``, mlx-lm's ``SwitchLinear`` layout, float, MLX-quantized or GGML blocks)."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["expert_view"]


def expert_view(stack: mx.array, e: int) -> mx.array:
    """``stack[e]`` ([E, ...] -> [...]) without a copy: integer indexing gathers (copies the expert's whole weight
    at every call), a one-expert slice reshaped is a view of the stack."""
    return stack[e : e + 1].reshape(stack.shape[1:])
