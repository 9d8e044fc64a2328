"""Running one model across several processes / Macs with ``mx.distributed``: who holds what (``splits``), what
it costs (``accounting``: bytes from the model's module tree; ``cost``: memory and speed per rank), pipeline stages
(``pipeline``), tensor + expert parallel module swaps (``shard``). Model files know nothing of this.

``load(..., parallel=, group=, split=)`` uses this package in two steps: ``rank_share`` decides what this rank holds
(``Share.select`` tells a loader which parameters to read at all), then ``Share.apply`` turns the built model into
this rank's part before its weights are evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..config import KimiConfig
from .comm import comm_stream
from .pipeline import Split, Stages, layer_bytes

__all__ = ["MODES", "Select", "Share", "Split", "check_arguments", "comm_stream", "init_group", "param_bytes",
           "parallelize", "rank_share"]

MODES = ("pipeline", "tensor")

# select(param) -> False (not this rank's: never read), True (whole) or a range of rows of the outermost dimension
# (stacked routed experts: only those experts are read)
Select = Callable[[str], Union[bool, range]]


@dataclass(frozen=True)
class Share:
    """This rank's part of the model: ``select`` for loaders (None: every parameter) and ``apply(model) -> model``."""

    select: Optional[Select]
    apply: Callable[[nn.Module], nn.Module]


def check_arguments(parallel: Optional[str], group: Optional[mx.distributed.Group], split: Split) -> None:
    """Reject bad ``parallel`` / ``group`` / ``split`` values before anything is loaded (ValueError naming them)."""
    if parallel is not None and parallel not in MODES:
        raise ValueError(f"parallel={parallel!r}: expected None, 'pipeline' or 'tensor'")
    if parallel is None and group is not None:
        raise ValueError("group= was given without parallel=; expected parallel='pipeline' or 'tensor' with it")
    if split is None:
        return
    if parallel != "pipeline":
        raise ValueError(f"split={split!r}: only parallel='pipeline' takes a split (parallel={parallel!r})")
    if isinstance(split, str):
        if split != "even" and not all(part.strip().lstrip("-").isdigit() for part in split.split(",")):
            raise ValueError(f"split={split!r}: expected 'even' or comma-separated layer counts such as '20,7'")
    elif not (isinstance(split, Sequence) and split and all(isinstance(c, int) for c in split)):
        raise ValueError(f"split={split!r}: expected None (by memory), 'even', or layer counts per rank "
                         "(a list of ints or a string such as '20,7')")


def init_group(parallel: Optional[str], group: Optional[mx.distributed.Group]) -> Optional[mx.distributed.Group]:
    """The group to split over: ``group``, else ``mx.distributed.init()`` (None when ``parallel`` is None)."""
    if parallel is None:
        return None
    return group if group is not None else mx.distributed.init()


def rank_share(
    parallel: Optional[str], group: mx.distributed.Group, split: Split, cfg: KimiConfig, layer_costs: Sequence[int]
) -> Optional[Share]:
    """What this rank of ``group`` holds under ``parallel`` for a model of config ``cfg``; None for a single process
    (no mode, or a group of 1: the plain model).

    layer_costs: bytes of each decoder layer (the default pipeline split is proportional to each rank's memory).
    Every rank must call this (the default split exchanges memory sizes).
    """
    if parallel is None:
        return None
    where = f"{parallel} rank {group.rank()} of {group.size()}"
    if parallel == "pipeline":
        stages = Stages.split(layer_costs, group, split, cfg.tie_word_embeddings)  # checks ``split`` for 1 rank too
        layers = stages.layers
        where += f", layers {layers.start}-{layers.stop - 1}"
        return None if group.size() == 1 else Share(stages.select, _labelled(stages.apply, where))
    if group.size() == 1:
        return None
    from .shard import tensor_parallel, tensor_select

    return Share(tensor_select(cfg, group), _labelled(lambda model: tensor_parallel(model, group), where))


def _labelled(apply: Callable[[nn.Module], nn.Module], where: str) -> Callable[[nn.Module], nn.Module]:
    """``apply``, then ``model.shard = where`` (e.g. "pipeline rank 1 of 2, layers 14-26"): what a prompt-cache file
    of this rank's part records, so another rank's file is refused."""

    def labelled(model: nn.Module) -> nn.Module:
        model = apply(model)
        model.shard = where
        return model

    return labelled


def parallelize(model: nn.Module, parallel: Optional[str], group: Optional[mx.distributed.Group] = None,
                split: Split = None) -> nn.Module:
    """``model`` (weights best still lazy: only what the rank keeps is then read) as this rank's part."""
    check_arguments(parallel, group, split)
    group = init_group(parallel, group)
    share = rank_share(parallel, group, split, model.args, layer_bytes(model))
    return model if share is None else share.apply(model)


def param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (what ``kimi-mlx plan`` predicts per rank)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
