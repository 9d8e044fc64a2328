"""Pipeline parallelism: each rank holds a contiguous range of decoder layers (rank 0 the first ones).

    stages = Stages.split(layer_bytes(model), group, split, tied)   # which layers each rank holds
    model = stages.apply(model)                                      # this rank's stage (a module swap)

Forward on rank r (every rank calls ``model(inputs, cache)`` with the same inputs, in lockstep):
rank 0 embeds; rank r > 0 receives ``h: [B, T, hidden]`` from r - 1 (for Kimi-K3 packed after the completed AttnRes
block snapshots: ``[K + 1, B, T, hidden]``, K = blocks stored before the rank's first layer), runs its layers with
its part of the cache and sends to r + 1 (ring neighbours only). The last rank applies K3's ``output_attn_res``; its
final hidden state reaches every rank with one ``all_sum`` (the other ranks add zeros: exact), and every rank applies
the replicated final norm and head, so ``model(...)`` returns the full logits ``[B, T, vocab]`` everywhere.
``model.make_cache()`` covers the rank's layers only, so ``generate`` / ``batch_generate`` / ``ChatSession`` run
unchanged on every rank.

Lockstep: every rank must build the same forwards in the same order (as ``generate`` and friends do on every rank).
All collectives run on one stream (``comm_stream``), so they keep the order in which they were scheduled, whichever
stream the caller evaluates on, and each forward schedules the previous forward's collectives before building its
own (``_Lockstep``), so one evaluation never mixes two forwards' messages. A MoE prefill on a rank > 0 receives while
its forward is being built (the expert routing counts are read on the host); the sender sends when it evaluates.

The embedding is dropped on ranks > 0 unless the head is the (tied) embedding; ``output_attn_res`` lives on the last
rank only. A stage numbers its layers from 0 (``model.layers.0`` is global layer ``stages_of(model).layers.start``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..cache import KDACache
from ..models.kimi_k3 import K3TextModel, Snapshots
from ..models.kimi_linear import KimiLinearModel, Model, layer_masks
from ..ops.attn_res import inv_rms
from ..ops.memory import usable_memory
from . import comm
from .splits import pipeline_ranges

Split = Union[None, str, Sequence[int]]
_LAYER = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")


def _language_model(model: nn.Module) -> Model:
    """The causal-LM module (embedding, layers, head) inside ``model`` (itself, or K3's ``language_model``)."""
    for _, m in model.named_modules():
        if isinstance(m, Model):
            return m
    raise TypeError(f"{type(model).__name__}: no Kimi causal LM inside; pipeline parallelism runs kimi-mlx models")


def stages_of(model: nn.Module) -> Optional[Stages]:
    """The split a pipeline-parallel ``model`` was made with (None for a whole model)."""
    return getattr(_language_model(model).model, "stages", None)


def layer_bytes(model: nn.Module) -> list[int]:
    """Parameter bytes of each decoder layer (known from shapes and dtypes: lazy weights stay unevaluated)."""
    return [sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in model.layers]


@dataclass(frozen=True)
class Stages:
    """Layer ranges per rank (contiguous, in rank order, covering every layer once) and this rank's place.

    tied: the head is the embedding, so every rank keeps ``embed_tokens``.
    """

    ranges: tuple[range, ...]
    rank: int
    group: mx.distributed.Group
    tied: bool

    @classmethod
    def split(cls, costs: Sequence[int], group: mx.distributed.Group, split: Split = None, tied: bool = False):
        """Split layers of the given byte ``costs`` over ``group``: ``split`` None (proportional to each rank's
        ``usable_memory``, exchanged with ``all_gather``: every rank must call this), ``"even"``, or layer counts
        per rank (a list or a string such as ``"20,7"``)."""
        capacities = [1] * group.size()
        if split is None:
            capacities = comm.all_gather(mx.array([usable_memory()], mx.int64), group).tolist()
        ranges = pipeline_ranges(costs, capacities, split)
        return cls(tuple(ranges), group.rank(), group, tied)

    @property
    def layers(self) -> range:
        """Global indices of this rank's layers."""
        return self.ranges[self.rank]

    @property
    def last(self) -> bool:
        return self.rank == len(self.ranges) - 1

    def select(self, param: str) -> bool:
        """Whether this rank holds the (global, unsplit) parameter ``param``: its own layers' parameters, the
        embedding on rank 0 (every rank when tied), ``output_attn_res`` on the last rank, the final norm and head
        everywhere. Loaders use it to skip everything else (a GGUF tensor not selected is never decoded)."""
        m = _LAYER.search(param)
        if m:
            return int(m.group(1)) in self.layers
        if ".embed_tokens." in param:
            return self.rank == 0 or self.tied
        if ".output_attn_res." in param:
            return self.last
        return True

    def apply(self, model: nn.Module) -> nn.Module:
        """Turn ``model`` (weights lazy or loaded) into this rank's stage, in place: keep the rank's layers, drop the
        modules ``select`` rejects, swap the text model's class for its pipeline stage. Returns ``model``."""
        lm = _language_model(model)
        text = lm.model
        stage_class = _STAGES.get(type(text))
        if stage_class is None:
            raise TypeError(f"{type(text).__name__}: no pipeline stage for this text model")
        if "lm_head" not in lm and not self.tied:
            raise ValueError("the model's head is its embedding (tied), but the split was made with tied=False")
        if len(text.layers) != self.ranges[-1].stop:
            raise ValueError(f"split covers {self.ranges[-1].stop} layers; the model has {len(text.layers)}")
        res_eps = text.output_attn_res.norm.eps if "output_attn_res" in text else None
        inbound = Boundary(
            hidden=text.norm.weight.shape[0],
            dtype=text.embed_tokens(mx.zeros((1, 1), mx.int32)).dtype,  # lazy: nothing is evaluated
            blocks=sum(layer.block_start for layer in text.layers[: self.layers.start]) if res_eps is not None else 0,
            eps=res_eps,
        )
        text.layers = text.layers[self.layers.start : self.layers.stop]
        if not self.select("model.embed_tokens.weight"):
            del text.embed_tokens
        if res_eps is not None and not self.last:
            del text.output_attn_res
        text.__class__ = stage_class
        text.stages, text.inbound = self, inbound
        return model


@dataclass(frozen=True)
class Boundary:
    """What a stage receives: h [B, T, hidden] of ``dtype`` (the embedding's output dtype), with AttnRes after the
    ``blocks`` snapshots completed before the stage's first layer (``eps``: their RMSNorm epsilon; None: no AttnRes)."""

    hidden: int
    dtype: mx.Dtype
    blocks: int
    eps: Optional[float]


class PipelineStage(KimiLinearModel):
    """One rank's part of the text model (set up by ``Stages.apply``); see the module docstring.

    Attributes: ``stages`` (the split) and ``inbound`` (the ``Boundary``).
    """

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None) -> mx.array:
        """inputs: [B, T] token ids (or input_embeddings [B, T, hidden], used by rank 0) -> normed final hidden
        [B, T, hidden], identical on every rank."""
        stages, inbound = self.stages, self.inbound
        _LOCKSTEP.schedule_previous()
        B, T = (inputs if input_embeddings is None else input_embeddings).shape[:2]
        dtype = inbound.dtype if input_embeddings is None else input_embeddings.dtype
        blocks = None if inbound.eps is None else Snapshots(inbound.eps)
        if stages.rank == 0:
            h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        else:
            h = self._receive((B, T, inbound.hidden), dtype, blocks)
        kda_mask, attn_mask = layer_masks(T, cache)
        for layer, layer_cache in zip(self.layers, cache or [None] * len(self.layers)):
            mask = kda_mask if layer.is_linear else attn_mask
            h = layer(h, mask, layer_cache) if blocks is None else layer(blocks, h, mask, layer_cache)
        if stages.last:
            share = (h if blocks is None else self.output_attn_res(blocks, h)).astype(dtype)
        else:
            share = mx.depends(mx.zeros(h.shape, dtype), self._send(h.astype(dtype), blocks))
        shared = comm.all_sum(share, stages.group)
        if cache:
            _depend_on(cache[-1], shared)
        _LOCKSTEP.previous = shared
        return self.norm(shared)

    def _receive(self, shape: tuple, dtype: mx.Dtype, blocks: Optional[Snapshots]) -> mx.array:
        """h [B, T, hidden] from the previous rank; with AttnRes also the K completed snapshots before it."""
        src, group = self.stages.rank - 1, self.stages.group
        if blocks is None:
            return comm.recv(shape, dtype, src, group)
        packed = comm.recv((self.inbound.blocks + 1, *shape), dtype, src, group)
        blocks.raw, blocks.inv_rms = packed[:-1], inv_rms(packed[:-1], blocks.eps)
        return packed[-1]

    def _send(self, h: mx.array, blocks: Optional[Snapshots]) -> mx.array:
        """Send h [B, T, hidden] (after the snapshots [K, B, T, hidden] with AttnRes) to the next rank."""
        msg = h if blocks is None else mx.concatenate([blocks.raw.astype(h.dtype), h[None]])
        return comm.send(msg, self.stages.rank + 1, self.stages.group)


def _depend_on(layer_cache, x: mx.array) -> None:
    """Make a layer cache's state depend on ``x``: evaluating the cache (as a chunked prefill does) then runs all of
    the forward's communication too."""
    if isinstance(layer_cache, KDACache):
        layer_cache.recurrent_state = mx.depends(layer_cache.recurrent_state, x)
    else:
        layer_cache.depend_on(x)


class _Lockstep:
    """Keeps every rank's collectives in one order across forwards (process-wide, like ``comm_stream``).

    MLX orders the operations of one evaluation by graph shape, which differs between ranks; two forwards evaluated
    together could pair one forward's message with another's. So each forward first schedules the previous
    forward's communication (``mx.async_eval``: a no-op once it ran, as in ``generate``), and one evaluation never
    holds the collectives of two forwards. A forward left unevaluated is thereby still run on every rank alike.
    """

    previous: Optional[mx.array] = None  # the last forward's shared hidden state (its final collective)

    def schedule_previous(self) -> None:
        if self.previous is not None:
            mx.async_eval(self.previous)
            self.previous = None


_LOCKSTEP = _Lockstep()


class K3PipelineStage(PipelineStage, K3TextModel):
    """Kimi-K3's text model as a pipeline stage (AttnRes snapshots travel with the hidden state)."""


_STAGES = {KimiLinearModel: PipelineStage, K3TextModel: K3PipelineStage}
