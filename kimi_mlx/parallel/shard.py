"""Tensor + expert parallelism as module swaps on a built model: ``tensor_parallel(model, group)``.

Each rank keeps its ``TensorShare`` (``splits.tensor_shares``) of every layer and computes that part of each block,
as ``TENSOR_SPLITS`` declares per block type (which children split on which ``TensorShare`` field and axis; the
planner, ``parallel.accounting``, reads the same declaration):

- KDA: its heads: rows of q/k/v (or the three segments of a fused ``qkv_proj``), of the short conv, ``f_b_proj``,
  ``b_proj`` and the output gate (``g_proj`` or ``g_b_proj``), and of ``A_log`` / ``dt_bias``; ``f_a_proj``,
  ``g_a_proj`` and ``o_norm`` (per head_dim) stay whole. Its cache holds the conv and recurrent state of these heads
  only (the layer sizes them from the module's head count).
- MLA: its heads: rows of ``q_proj`` / ``q_b_proj`` and ``g_proj``, the heads' slices of ``embed_q`` /
  ``unembed_out``; ``kv_a_proj_with_mqa``, its norm and hence the latent cache stay whole on every rank.
- dense MLP and shared experts: a column range of the intermediate width (gate/up rows, down_proj columns).
- routed experts: its experts, whole (quantized and GGML-block stacks are cut on the expert axis, so quantization
  groups and blocks never need to divide); the router stays whole, each rank runs only the (token, slot) pairs routed
  to its experts (in decode too: two counts read on the host per MoE block), and the other slots add zero.

Output projections keep the matching input columns, and the ranks' partial outputs are summed with one ``all_sum``
per attention block and one per MLP / MoE block, so every rank carries the full hidden state and computes the full
logits (embeddings, norms, AttnRes, router and head are replicated, as is any child a declaration does not name). A
rank holding no part of a block (more ranks than heads or width units) keeps its idle twin, which adds zeros to that
block's sum.

The sums of one model run in the order they are made, on every rank (``OrderedSum``).

Layers may be float, MLX-quantized or GGML blocks (``layers.ggml``: uint8 ``[out, row_bytes]``, each row
``in / block_elems`` blocks): rows are plain slices; a column cut keeps whole quantization groups or whole blocks
(a byte range of every row), and widths are split on those units (``width_unit``).

Parameters are cut with lazy slices and copied (``mx.contiguous``): on a model whose weights are not evaluated yet,
only this rank's share is ever kept. ``tensor_select`` tells a GGUF reader which expert rows this rank decodes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from ..config import KimiConfig
from ..layers.ggml import GGMLLinear, GGMLSwitchLinear
from ..layers.kda import KimiDeltaAttention
from ..layers.mla import KimiMLA
from ..layers.moe import MLP, SparseMoE, switch_glu
from ..ops.ggml import get_format
from . import comm
from .splits import SPLIT_SIZES, TensorShare, tensor_shares

__all__ = ["COLS", "ROWS", "TENSOR_SPLITS", "BlockSplit", "Cut", "shard_model", "tensor_parallel", "tensor_select",
           "width_unit"]

# Layers whose every parameter has the output rows (or heads, or experts) on axis 0.
_ROW_LAYERS = (nn.Linear, nn.QuantizedLinear, MultiLinear, QuantizedMultiLinear, SwitchLinear, QuantizedSwitchLinear,
               GGMLLinear, GGMLSwitchLinear)
# Layers that can be cut by input column: weight [out, in] (quantized: packed words, scales, biases; GGML: blocks).
_COL_LAYERS = (nn.Linear, nn.QuantizedLinear, GGMLLinear)
_EXPERT_PARAM = re.compile(r"\.switch_mlp\.(gate|up|down)_proj\.(weight|scales|biases)$")


def tensor_parallel(model: nn.Module, group: mx.distributed.Group = None) -> nn.Module:
    """Shard ``model`` (Kimi Linear or K3, built, weights lazy or evaluated) in place for this rank of ``group``.

    ``group`` defaults to ``mx.distributed.init()``; a group of size 1 leaves the model unchanged. Intermediate widths
    are split on the quantization group size of the layers cut by column (``width_unit``). Returns the model.
    """
    group = group or mx.distributed.init()
    if group.size() == 1:
        return model
    share = tensor_shares(model.args, group.size(), width_unit(model))[group.rank()]
    return shard_model(model, share, group)


def shard_model(model: nn.Module, share: TensorShare, group: mx.distributed.Group) -> nn.Module:
    """Keep ``share`` of every layer of ``model`` (in place) and sum the blocks' outputs over ``group``: each
    layer's ``self_attn`` and ``mlp`` is cut as ``TENSOR_SPLITS`` declares for its type."""
    psum = OrderedSum(group)
    for i, layer in enumerate(model.layers):
        for block in ("self_attn", "mlp"):
            layer[block] = _shard_block(layer[block], share, model.args, psum, f"layers.{i}.{block}")
    return model


def tensor_select(cfg: KimiConfig, group: mx.distributed.Group = None) -> Callable[[str], Union[bool, range]]:
    """The GGUF reader's ``select(param) -> True | range`` for this rank: stacked routed-expert parameters
    (``...switch_mlp.{gate,up,down}_proj.{weight,scales,biases}``) -> this rank's expert rows, anything else -> True
    (read whole; ``tensor_parallel`` cuts it). ``tensor_parallel`` keeps expert stacks already read this way."""
    group = group or mx.distributed.init()
    experts = tensor_shares(cfg, group.size())[group.rank()].experts
    return lambda param: experts if _EXPERT_PARAM.search(param) else True


def width_unit(model: nn.Module) -> int:
    """Unit on which intermediate widths are split: the least common multiple of the column units (quantization group
    size, GGML block size; ``_col_unit``) of the dense MLP and shared-expert projections, 1 when all are float. Only
    ``down_proj`` (cut by column) needs it; counting gate/up too keeps it equal to the planner's
    ``Accounting.split_unit`` (group and block sizes are powers of 2)."""
    sizes = [
        _col_unit(proj)
        for layer in model.layers
        for mlp in (layer.mlp, layer.mlp.get("shared_experts"))
        if isinstance(mlp, MLP)
        for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    ]
    return math.lcm(1, *sizes)


def _col_unit(layer: nn.Module) -> int:
    """Input columns a column cut must keep together: the quantization group, the GGML block, 1 for float."""
    if isinstance(layer, nn.QuantizedLinear):
        return layer.group_size
    if isinstance(layer, GGMLLinear):
        return get_format(layer.ggml_type).block_elems
    return 1


# --- cutting parameters ------------------------------------------------------------------------------------------


def _take(a: mx.array, ranges: Sequence[range], total: int, name: str) -> mx.array:
    """Rows ``ranges`` of ``a`` ([total, ...]), concatenated, as a copy (the full array can then be freed)."""
    if a.shape[0] != total:
        raise ValueError(f"{name}: expected {total} rows on axis 0, got shape {tuple(a.shape)}")
    parts = [a[r.start : r.stop] for r in ranges]
    return mx.contiguous(mx.concatenate(parts) if len(parts) > 1 else parts[0])


def _rows(layer: nn.Module, ranges: Sequence[range], total: int, name: str) -> nn.Module:
    """``layer`` (in place) keeping its output rows / heads / experts ``ranges`` of ``total`` (axis 0 of every
    parameter: weight, scales, biases, bias)."""
    if type(layer) not in _ROW_LAYERS:
        raise TypeError(f"{name}: cannot shard a {type(layer).__name__} (expected a plain, quantized or GGML-block "
                        "Linear, MultiLinear or SwitchLinear)")
    for key, a in layer.parameters().items():
        layer[key] = _take(a, ranges, total, f"{name}.{key}")
    return layer


def _cols(layer: nn.Module, cols: range, total: int, name: str) -> nn.Module:
    """``layer`` (in place) keeping input columns ``cols`` of ``total``: weight [out, total] (quantized: packed
    weight [out, total * bits / 32], scales / biases [out, total / group_size]; GGML: blocks [out, total /
    block_elems * type_bytes] uint8), cut on group / block boundaries."""
    if type(layer) not in _COL_LAYERS:
        raise TypeError(f"{name}: cannot shard a {type(layer).__name__} by column "
                        "(expected a plain, quantized or GGML-block Linear)")
    if "bias" in layer:
        raise ValueError(f"{name}: has a bias, which every rank would add to the summed output")
    unit = _col_unit(layer)
    if type(layer) is nn.QuantizedLinear:
        width = layer.scales.shape[-1] * unit
    else:
        width = layer.input_dims if type(layer) is GGMLLinear else layer.weight.shape[-1]
    if width != total:
        raise ValueError(f"{name}: expected {total} input columns, got {width} "
                         f"(weight shape {tuple(layer.weight.shape)})")
    if cols.start % unit or cols.stop % unit:
        where = (f"{layer.ggml_type} block boundaries (block size {unit})" if type(layer) is GGMLLinear
                 else f"quantization group boundaries (group size {unit})")
        raise ValueError(f"{name}: columns {cols.start}:{cols.stop} do not fall on {where}")
    for key, a in layer.parameters().items():
        per = a.shape[-1]  # packed words / groups / block bytes / columns spanning all ``total`` columns
        layer[key] = mx.contiguous(a[:, cols.start * per // total : cols.stop * per // total])
    return layer


# --- summing over ranks --------------------------------------------------------------------------------------------


class OrderedSum:
    """``all_sum`` over ``group`` of arrays of the same shape on every rank, run in the order of the calls.

    MLX runs a lazy graph in an order of its own, and the ranks' graphs differ (a rank holding no heads sums zeros
    that depend on nothing; a cache can hold updates of a forward that was never evaluated, pulled in later), so two
    independent sums could run in different orders on two ranks and be paired wrongly. Each sum here depends on the
    previous one: they form one chain, made by the same code in the same order on every rank.
    """

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.last = None

    def __call__(self, x: mx.array) -> mx.array:
        if self.last is not None:
            x = mx.depends(x, self.last)
        self.last = comm.all_sum(x, self.group)
        return self.last


def _recast(module: nn.Module, cls: type, **attrs) -> nn.Module:
    """A shallow copy of ``module`` as its subclass ``cls`` (same children and parameters at the same paths, only
    the forward differs), with ``attrs`` set."""
    new = cls.__new__(cls)
    dict.update(new, module)
    new.__dict__.update(module.__dict__, **attrs)
    return new


class SumLinear(nn.Linear):
    """``nn.Linear`` over this rank's input columns; the ranks' partial outputs are summed (``all_sum``: an
    ``OrderedSum``)."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.all_sum(super().__call__(x))


class SumQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` over this rank's input columns; the ranks' partial outputs are summed."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.all_sum(super().__call__(x))


class SumGGMLLinear(GGMLLinear):
    """``GGMLLinear`` over this rank's input columns (whole blocks); the ranks' partial outputs are summed."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.all_sum(super().__call__(x))


_SUMMED = {nn.Linear: SumLinear, nn.QuantizedLinear: SumQuantizedLinear, GGMLLinear: SumGGMLLinear}


def _summed(layer: nn.Module, psum: OrderedSum) -> nn.Module:
    """``layer`` (cut by column, ``_cols``) as its twin whose output is summed over the ranks."""
    return _recast(layer, _SUMMED[type(layer)], all_sum=psum)


# --- blocks ------------------------------------------------------------------------------------------------------


class IdleMLP(nn.Module):
    """An MLP block of which this rank holds nothing: adds zeros to the block's all_sum ([B, T, hidden])."""

    KEEPS = ()  # children of the block kept (none)

    def __init__(self, mlp: MLP, psum: OrderedSum):
        super().__init__()
        self.all_sum = psum

    def __call__(self, x: mx.array) -> mx.array:
        return self.all_sum(mx.zeros_like(x))


class IdleKDA(nn.Module):
    """KDA on a rank holding none of its heads: adds zeros to the block's all_sum; its cache holds the states of zero
    heads (conv [B, K-1, 0], recurrent [B, 0, D, D]), made to depend on the layer input as every rank's states do, so
    evaluating the cache (a checkpoint) runs the same sums on every rank."""

    KEEPS = ()

    def __init__(self, attn: KimiDeltaAttention, psum: OrderedSum):
        super().__init__()
        self.conv_kernel, self.head_dim = attn.conv_kernel, attn.head_dim
        self.all_sum = psum

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if cache is not None:
            B, D = x.shape[0], self.head_dim
            cache.conv_state = mx.depends(mx.zeros((B, self.conv_kernel - 1, 0), x.dtype), x)
            cache.recurrent_state = mx.depends(mx.zeros((B, 0, D, D), mx.float32), x)
            for at in cache.cuts(x.shape[1]):
                cache.keep(at, cache.conv_state, cache.recurrent_state)
            cache.advance(x.shape[1])
        return self.all_sum(mx.zeros_like(x))


class IdleMLA(nn.Module):
    """MLA on a rank holding none of its heads: keeps the latent cache whole and in step like every rank (so cache
    offsets, trims and checkpoints agree) and adds zeros to the block's all_sum."""

    KEEPS = ("kv_a_proj_with_mqa", "kv_a_layernorm")  # the latent projection and its norm

    def __init__(self, attn: KimiMLA, psum: OrderedSum):
        super().__init__()
        for child in self.KEEPS:
            self[child] = attn[child]
        self.kv_lora_rank = attn.rank
        self.all_sum = psum

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        out = mx.zeros_like(x)
        if cache is not None:
            kv_latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
            cache.update_and_fetch(self.kv_a_layernorm(kv_latent)[:, None], k_pe[:, None])
            out = mx.depends(out, cache.state)  # evaluating the output evaluates the cache update
        return self.all_sum(out)


# --- what each block type splits: read by ``shard_model`` and by the planner (``parallel.accounting``) ----------

ROWS, COLS = 0, -1


@dataclass(frozen=True)
class Cut:
    """How one child of a block (a parameter, or a layer: all its parameters) is cut across ranks.

    The rank keeps its ``TensorShare.<field>`` range of items (heads, experts, width columns), each ``width(cfg)``
    wide, in each of ``segments`` equal consecutive parts (a fused q | k | v): on ``ROWS`` (axis 0 of every
    parameter: output rows, heads or experts) or on ``COLS`` (input columns of a Linear, whole quantization groups /
    GGML blocks; the ranks' partial outputs are summed). ``read_by_loader``: a loader may have read only the rank's
    rows already (``tensor_select``), so a layer holding exactly that many is kept as it is.
    """

    field: str
    axis: int = ROWS
    width: Callable[[KimiConfig], int] = lambda cfg: 1
    segments: int = 1
    read_by_loader: bool = False

    def ranges(self, held: range, cfg: KimiConfig) -> tuple[list[range], int]:
        """(the kept ranges along the axis, the axis' full size) for the rank's ``held`` items."""
        k = self.width(cfg)
        part = SPLIT_SIZES[self.field](cfg) * k  # one segment's full size
        kept = [range(s * part + held.start * k, s * part + held.stop * k) for s in range(self.segments)]
        return kept, self.segments * part


@dataclass(frozen=True)
class BlockSplit:
    """How tensor parallelism splits one block type.

    cuts: child path within the block (``"q_proj"``, ``"qkv_conv.weight"``, ``"switch_mlp.up_proj"``) -> its ``Cut``;
        every child not named is held whole by every rank (a parameter added to a layer is replicated).
    field: the ``TensorShare`` range a rank must hold some of to compute the block; a rank holding none of it keeps
        the ``idle`` twin instead (which keeps only the children ``idle.KEEPS`` names); ``idle`` None: never idle.
    sums_columns: each ``COLS`` cut layer's output is summed over the ranks (False: the block's own forward sums).
    """

    field: str
    cuts: Mapping[str, Cut]
    idle: Optional[type] = None
    sums_columns: bool = True


def _kda_split() -> BlockSplit:
    def head(axis=ROWS, segments=1):
        return Cut("kda_heads", axis, lambda c: c.kda_head_dim, segments)

    one = Cut("kda_heads")
    return BlockSplit("kda_heads", {
        "q_proj": head(), "k_proj": head(), "v_proj": head(), "qkv_proj": head(segments=3),
        "qkv_conv.weight": head(segments=3), "f_b_proj": head(), "b_proj": one, "g_proj": head(), "g_b_proj": head(),
        "A_log": one, "dt_bias": head(), "o_proj": head(COLS),
    }, IdleKDA)


def _mla_split() -> BlockSplit:
    qk = Cut("mla_heads", ROWS, lambda c: c.qk_nope_head_dim + c.qk_rope_head_dim)
    one = Cut("mla_heads")

    def value(axis=ROWS):
        return Cut("mla_heads", axis, lambda c: c.v_head_dim)

    return BlockSplit("mla_heads", {
        "q_proj": qk, "q_b_proj": qk, "embed_q": one, "unembed_out": one, "g_proj": value(), "o_proj": value(COLS),
    }, IdleMLA)


def _moe_split() -> BlockSplit:
    experts = Cut("experts", read_by_loader=True)
    return BlockSplit("experts", {
        "switch_mlp.gate_proj": experts, "switch_mlp.up_proj": experts, "switch_mlp.down_proj": experts,
        "shared_experts.gate_proj": Cut("shared"), "shared_experts.up_proj": Cut("shared"),
        "shared_experts.down_proj": Cut("shared", COLS),
    }, sums_columns=False)


# KDA and MLA: by head; the dense MLP: by intermediate column; the MoE: routed experts whole, shared experts by column
TENSOR_SPLITS: dict[type, BlockSplit] = {
    KimiDeltaAttention: _kda_split(),
    KimiMLA: _mla_split(),
    MLP: BlockSplit("ffn", {"gate_proj": Cut("ffn"), "up_proj": Cut("ffn"), "down_proj": Cut("ffn", COLS)}, IdleMLP),
    SparseMoE: _moe_split(),
}


def _shard_block(block: nn.Module, share: TensorShare, cfg: KimiConfig, psum: OrderedSum, name: str) -> nn.Module:
    """``block`` (in place, or its idle / expert-parallel twin) keeping the rank's ``share`` as its type's
    ``TENSOR_SPLITS`` entry declares."""
    spec = TENSOR_SPLITS.get(type(block))
    if spec is None:
        raise TypeError(f"{name}: no tensor split is declared for a {type(block).__name__} block")
    held = getattr(share, spec.field)
    if spec.idle is not None and not held:
        return spec.idle(block, psum)
    if isinstance(block, SparseMoE) and not share.shared and "shared_experts" in block:
        del block["shared_experts"]  # this rank holds none of the shared experts' width
    for child, cut in spec.cuts.items():
        parent, _, key = child.rpartition(".")
        owner = _child(block, parent)
        if owner is None or key not in owner:
            continue
        cut_child = _cut(owner[key], cut, getattr(share, cut.field), cfg, f"{name}.{child}")
        owner[key] = _summed(cut_child, psum) if cut.axis == COLS and spec.sums_columns else cut_child
    if "num_heads" in vars(block):
        block.num_heads = len(held)
    if isinstance(block, SparseMoE):
        return _recast(block, ExpertParallelMoE, experts=share.experts, all_sum=psum)
    return block


def _child(block: nn.Module, path: str) -> Optional[nn.Module]:
    """The submodule at dotted ``path`` of ``block`` (``""``: the block itself); None when it has none there."""
    for key in filter(None, path.split(".")):
        if key not in block:
            return None
        block = block[key]
    return block


def _cut(child: Union[nn.Module, mx.array], cut: Cut, held: range, cfg: KimiConfig, name: str):
    """``child`` (a parameter, or a layer cut in place) keeping ``held`` items as ``cut`` says."""
    ranges, total = cut.ranges(held, cfg)
    if isinstance(child, mx.array):
        return _take(child, ranges, total, name)
    if cut.axis == COLS:
        return _cols(child, ranges[0], total, name)
    if cut.read_by_loader and type(child) in _ROW_LAYERS and child.weight.shape[0] == sum(map(len, ranges)):
        return child  # read so (``tensor_select``)
    return _rows(child, ranges, total, name)


class ExpertParallelMoE(SparseMoE):
    """``SparseMoE`` holding routed experts ``experts`` (whole; ``switch_mlp`` stacks of that many) and a column share
    of the shared experts (or none), computing the rank's part of the block with one ``all_sum``.

    Routing is replicated. Without ``routed_expert_norm`` everything after the routed experts is linear, so the
    partial outputs (routed through ``routed_expert_up_proj``, plus shared) are summed at the hidden width; with it
    the partial latent sums must be complete before the norm, so [latent sum | shared] is summed in one message and
    norm + up projection run replicated.
    """

    def __call__(self, x: mx.array) -> mx.array:
        """x: [..., hidden] -> [..., hidden] (the full block output, on every rank)."""
        inds, weights = self.routing(x)
        width = self.cfg.routed_expert_hidden_size or self.cfg.hidden_size
        if self.experts:
            z = self.routed_expert_down_proj(x) if "routed_expert_down_proj" in self else x
            y = self._local_experts(z, inds, weights)
        else:
            y = mx.zeros((*x.shape[:-1], width), x.dtype)
        shared = self.shared_experts(x) if "shared_experts" in self else mx.zeros_like(x)
        if "routed_expert_norm" in self:
            y, shared = mx.split(self.all_sum(mx.concatenate([y, shared], -1)), [width], -1)
            return self.routed_expert_up_proj(self.routed_expert_norm(y)) + shared
        if "routed_expert_up_proj" in self:
            y = self.routed_expert_up_proj(y)
        return self.all_sum(y + shared)

    def _local_experts(self, z: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        """Routing-weighted sum over the slots that chose this rank's experts: z [..., width], inds / weights
        [..., k] (global expert ids) -> [..., width]. Only the local (token, slot) pairs go through the experts, for
        any number of tokens (decode included: with n ranks about k / n of a token's k slots are local); inside
        ``mx.compile`` / ``mx.vmap``, where the local count cannot be read, every slot runs (``_masked``)."""
        local = (inds >= self.experts.start) & (inds < self.experts.stop)  # [..., k]
        y = self._compacted(z, inds, local)  # [..., k, width], zero on other ranks' slots
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)

    def _compacted(self, z: mx.array, inds: mx.array, local: mx.array) -> mx.array:
        """[..., k, width]: only the local (token, slot) pairs go through the experts (sorted by expert, they form
        one run; ``switch_glu`` picks its gather or sorted path by their count); the other slots are zero. Reads
        two counts on the host (one sync per MoE block), so the expert rows computed are exactly the local pairs;
        inside ``mx.compile`` / ``mx.vmap`` (no host reads) it is ``_masked``."""
        k, lo = inds.shape[-1], self.experts.start
        flat = inds.flatten()  # [P] global expert ids, P = tokens * k
        order = mx.argsort(flat)
        try:
            before, count = mx.stack([(flat < lo).sum(), local.sum()]).tolist()
        except ValueError:  # inside mx.compile / mx.vmap
            return self._masked(z, inds, local)
        out = mx.zeros((flat.size, z.shape[-1]), z.dtype)  # [P, width]
        if count:
            pairs = order[before : before + count]  # [count] the local pairs, by expert
            rows = z.reshape(-1, z.shape[-1])[pairs // k]  # [count, width] their tokens' inputs
            out[pairs] = switch_glu(self.switch_mlp, rows, (flat[pairs] - lo)[:, None])[:, 0]
        return out.reshape(*inds.shape, -1)

    def _masked(self, z: mx.array, inds: mx.array, local: mx.array) -> mx.array:
        """[..., k, width] without host reads: every slot runs, other ranks' slots on local expert 0, and their
        rows are zeroed (k expert rows per token, of which about k / n are this rank's)."""
        y = switch_glu(self.switch_mlp, z, mx.where(local, inds - self.experts.start, 0))
        return mx.where(local[..., None], y, 0)
