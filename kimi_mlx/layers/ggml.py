"""Layers whose weights stay in a GGML block format (the GGUF tensor's bytes), computed exactly by ``ops.ggml``.

``weight`` is uint8: ``[out, row_bytes]`` (``GGMLLinear``; ``GGMLEmbedding``: ``[vocab, row_bytes]``) or
``[E, out, row_bytes]`` (``GGMLSwitchLinear``, the stacked routed experts), ``row_bytes = ops.ggml.row_bytes(type,
in)``; ``ggml_type`` names the format ("IQ2_XXS", "Q6_K", ...). Outputs are ``x Wᵀ`` with W exactly gguf-py's
dequantization and float32 accumulation, in x's dtype. The block weights are frozen (never trained): LoRA adapters
train beside them, and gradients flow to the inputs.

``to_ggml(model, types)`` swaps a built model's ``nn.Linear`` / ``SwitchLinear`` / ``nn.Embedding`` leaves for these,
as ``nn.quantize`` does for MLX's quantized layers.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchLinear

from ..ops.ggml import dequantize, get_format, ggml_gather_matmul, ggml_matmul, row_bytes

__all__ = ["GGMLEmbedding", "GGMLLinear", "GGMLSwitchLinear", "GGML_LAYERS", "ggml_type_of", "holds_ggml",
           "set_float_dtype", "to_ggml"]


class _GGMLBlocks(nn.Module):
    """Frozen uint8 blocks ``weight [*lead, out, row_bytes]`` of ``input_dims`` columns each, optional float
    ``bias [*lead, out]``."""

    def __init__(self, lead: tuple[int, ...], input_dims: int, output_dims: int, ggml_type: str, bias: bool):
        super().__init__()
        self.ggml_type = ggml_type
        self.weight = mx.zeros((*lead, output_dims, row_bytes(ggml_type, input_dims)), mx.uint8)
        if bias:
            self.bias = mx.zeros((*lead, output_dims))
        self.freeze()

    @property
    def input_dims(self) -> int:
        fmt = get_format(self.ggml_type)
        return self["weight"].shape[-1] // fmt.type_bytes * fmt.block_elems

    @property
    def output_dims(self) -> int:
        return self["weight"].shape[-2]


class GGMLLinear(_GGMLBlocks):
    """``nn.Linear`` over GGML blocks: x [..., in] -> [..., out]."""

    def __init__(self, input_dims: int, output_dims: int, ggml_type: str, bias: bool = False):
        super().__init__((), input_dims, output_dims, ggml_type, bias)

    def __call__(self, x: mx.array) -> mx.array:
        y = ggml_matmul(x, self["weight"], self.ggml_type)
        return y + self["bias"] if "bias" in self else y


class GGMLSwitchLinear(_GGMLBlocks):
    """mlx-lm's ``SwitchLinear`` over GGML blocks: ``(x, indices, sorted_indices)`` as ``gather_qmm`` takes them."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, ggml_type: str, bias: bool = False):
        super().__init__((num_experts,), input_dims, output_dims, ggml_type, bias)

    @property
    def num_experts(self) -> int:
        return self["weight"].shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = ggml_gather_matmul(x, self["weight"], self.ggml_type, indices, sorted_indices=sorted_indices)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


class GGMLEmbedding(_GGMLBlocks):
    """``nn.Embedding`` over GGML blocks: ids [...] -> [..., dims] in ``dtype``, the model's float dtype (``load``
    sets it with ``set_float_dtype``: a bfloat16 model's residual stream starts in bfloat16). Only the looked-up rows
    are decoded (exactly, in float32, then rounded to ``dtype``)."""

    def __init__(self, num_embeddings: int, dims: int, ggml_type: str, dtype: mx.Dtype = mx.float32):
        super().__init__((), dims, num_embeddings, ggml_type, False)
        self.dtype = dtype

    def __call__(self, ids: mx.array) -> mx.array:
        return dequantize(self["weight"][ids], self.ggml_type).astype(self.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return ggml_matmul(x, self["weight"], self.ggml_type)


GGML_LAYERS = (GGMLLinear, GGMLSwitchLinear, GGMLEmbedding)


def ggml_type_of(module: nn.Module):
    """The GGML type name of a GGML-block layer, None for any other module."""
    return module.ggml_type if isinstance(module, GGML_LAYERS) else None


def holds_ggml(module: nn.Module) -> bool:
    """Whether ``to_ggml`` can give ``module`` GGML blocks (nn.Linear, SwitchLinear, nn.Embedding)."""
    return type(module) in (nn.Linear, SwitchLinear, nn.Embedding)


def _twin(module: nn.Module, ggml_type: str, path: str) -> nn.Module:
    fmt = get_format(ggml_type)
    in_dims = module.weight.shape[-1]
    if in_dims % fmt.block_elems:
        raise ValueError(f"{path}: {ggml_type} needs an input width that is a multiple of {fmt.block_elems}, "
                         f"got {in_dims}")
    bias = "bias" in module
    if type(module) is nn.Linear:
        return GGMLLinear(in_dims, module.weight.shape[0], ggml_type, bias=bias)
    if type(module) is SwitchLinear:
        return GGMLSwitchLinear(in_dims, module.output_dims, module.num_experts, ggml_type, bias=bias)
    if type(module) is nn.Embedding:
        return GGMLEmbedding(module.weight.shape[0], in_dims, ggml_type)
    raise TypeError(f"{path}: a {type(module).__name__} cannot hold GGML blocks (expected nn.Linear, SwitchLinear or "
                    "nn.Embedding)")


def set_float_dtype(model: nn.Module, dtype: mx.Dtype) -> None:
    """Make ``model``'s GGML-block embeddings return ``dtype`` (the model's float dtype; ``nn.Module.set_dtype``
    casts parameters only, and their blocks are uint8)."""
    for _, module in model.named_modules():
        if isinstance(module, GGMLEmbedding):
            module.dtype = dtype


def to_ggml(model: nn.Module, types: dict[str, str]) -> nn.Module:
    """Swap the leaf modules at the paths of ``types`` (path -> GGML type name) for GGML-block layers, in place; their
    block weights are loaded afterwards (``model.load_weights``). Returns ``model``."""
    leaves = dict(tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)))
    missing = sorted(set(types) - set(leaves))
    if missing:
        raise ValueError(f"no layer at {', '.join(missing[:3])} to hold GGML blocks")
    model.update_modules(tree_unflatten([(path, _twin(leaves[path], t, path)) for path, t in types.items()]))
    return model
