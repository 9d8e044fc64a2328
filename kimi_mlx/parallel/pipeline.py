"""Pipeline parallelism: each rank holds a contiguous range of decoder layers (rank 0 the first ones).

    stages = Stages.split(layer_bytes(model), group, split, tied)   # which layers each rank holds
    model = stages.apply(model)                                      # this rank's stage (a module swap)

Forward on rank r (every rank calls ``model(inputs, cache)`` with the same inputs, in lockstep):
rank 0 embeds; rank r > 0 receives the residual stream from r - 1 as one array (``h: [B, T, hidden]``; for
Kimi-K3's AttnRes the completed block snapshots, then the partial sum: ``[K + 1, B, T, hidden]``, K = blocks stored
before the rank's first layer; see ``layers/residual.py``), runs the text model's own forward loop over its layers
with its part of the cache and sends the stream to r + 1 (ring neighbours only). The last rank ends the stream (K3:
its ``output_attn_res`` mix); its final hidden state reaches every rank with one ``all_sum`` (the other ranks add
zeros: exact), and every rank applies the replicated final norm and head, so ``model(...)`` returns the full logits
``[B, T, vocab]`` everywhere.
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

import functools
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..models.kimi_linear import Model
from ..ops.memory import usable_memory
from . import comm
from .splits import Split, pipeline_ranges

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
        modules ``select`` rejects, mix ``PipelineStage`` into the text model's class. Returns ``model``."""
        lm = _language_model(model)
        text = lm.model
        if "lm_head" not in lm and not self.tied:
            raise ValueError("the model's head is its embedding (tied), but the split was made with tied=False")
        if len(text.layers) != self.ranges[-1].stop:
            raise ValueError(f"split covers {self.ranges[-1].stop} layers; the model has {len(text.layers)}")
        inbound = text.boundary(self.layers.start)
        text.layers = text.layers[self.layers.start : self.layers.stop]
        for name in [name for name in text.children() if not self.select(f"model.{name}.")]:
            del text[name]
        text.__class__ = _stage_class(type(text))
        text.stages, text.inbound = self, inbound
        return model


class PipelineStage:
    """One rank's part of a text model (mixed into its class by ``Stages.apply``); see the module docstring. The text
    model's forward loop runs unchanged; ``enter`` receives the residual stream, ``leave`` sends it or ends it.

    Attributes: ``stages`` (the split) and ``inbound`` (the ``Boundary`` of the rank's first layer).
    """

    def enter(self, inputs: mx.array, input_embeddings: Optional[mx.array]):
        """Rank 0: the text model's own stream (``inputs`` [B, T] embedded, or ``input_embeddings`` [B, T, hidden]);
        rank r > 0: the stream received from r - 1, in the embedding's dtype (or that of ``input_embeddings``)."""
        _LOCKSTEP.schedule_previous()
        if self.stages.rank == 0:
            return super().enter(inputs, input_embeddings)
        B, T = (inputs if input_embeddings is None else input_embeddings).shape[:2]
        dtype = self.inbound.dtype if input_embeddings is None else input_embeddings.dtype
        stream_type = self.inbound.stream_type
        shape = stream_type.message_shape(self.inbound, B, T)
        message = comm.recv(shape, dtype, self.stages.rank - 1, self.stages.group)
        return stream_type.from_message(message, self.inbound)

    def embed(self, inputs: mx.array) -> mx.array:
        """Rank 0: the embeddings [B, T, hidden]; rank r > 0 (no embedding, and ``enter`` reads only the shape and
        dtype of ``input_embeddings``): zeros of that shape."""
        if self.stages.rank == 0:
            return super().embed(inputs)
        return mx.zeros((*inputs.shape, self.inbound.hidden), self.inbound.dtype)

    def leave(self, stream, cache) -> mx.array:
        """The final hidden state [B, T, hidden], identical on every rank: the last rank's, summed with zeros from the
        others (which send their stream to the next rank first)."""
        stages = self.stages
        if stages.last:
            share = super().leave(stream, cache).astype(stream.dtype)
        else:
            sent = comm.send(stream.message(), stages.rank + 1, stages.group)
            share = mx.depends(mx.zeros(stream.shape, stream.dtype), sent)
        shared = comm.all_sum(share, stages.group)
        if cache:
            cache[-1].depend_on(shared)  # evaluating the cache (a chunked prefill) runs the communication
        _LOCKSTEP.previous = shared
        return shared


@functools.cache
def _stage_class(text_class: type) -> type:
    """``text_class`` with ``PipelineStage`` mixed in (made once per class)."""
    return type(text_class.__name__ + "Stage", (PipelineStage, text_class), {"__doc__": PipelineStage.__doc__})


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
