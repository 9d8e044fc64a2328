"""Running one model across several processes / Macs with ``mx.distributed``: who holds what (``splits``), what
it costs (``accounting``: bytes from the model's module tree; ``cost``: memory and speed per rank), pipeline stages
(``pipeline``), tensor + expert parallel module swaps (``shard``). Model files know nothing of this.

A loader hands the distributed part of loading to ``load_parallel`` in one call, with its two steps: opening the
model (config, tokenizer, tensor list: ``Opened``) and reading the weights. ``load_parallel`` checks the arguments,
starts the watchdog, runs each step as one all ranks pass or fail together (``health.agree``, the ranks'
fingerprints compared), and between them decides what this rank holds (``rank_share``: ``Share.select`` tells the
loader which parameters to read at all, ``Share.apply`` turns the built model into this rank's part before its weights
are evaluated).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..config import KimiConfig
from .comm import broadcast_ids, comm_stream
from .health import agree, fingerprint
from .splits import Split
from .watchdog import watch

__all__ = ["MODES", "Opened", "Select", "Share", "Split", "check_arguments", "comm_stream", "init_group",
           "load_parallel", "param_bytes", "rank_share"]

MODES = ("pipeline", "tensor")

# select(param) -> False (not this rank's: never read), True (whole) or a range of rows of the outermost dimension
# (stacked routed experts: only those experts are read)
Select = Callable[[str], Union[bool, range]]


@dataclass(frozen=True)
class Share:
    """This rank's part of the model: ``select`` for loaders (None: every parameter) and ``apply(model) -> model``."""

    select: Optional[Select]
    apply: Callable[[nn.Module], nn.Module]


def check_arguments(parallel: Optional[str], group: Optional[mx.distributed.Group], split: Split,
                    adapter_path: Optional[Union[str, Path]] = None) -> None:
    """Reject bad ``parallel`` / ``group`` / ``split`` values, and an adapter with a parallel mode, before anything is
    loaded (ValueError naming them)."""
    if parallel is not None and parallel not in MODES:
        raise ValueError(f"parallel={parallel!r}: expected None, 'pipeline' or 'tensor'")
    if parallel is None and group is not None:
        raise ValueError("group= was given without parallel=; expected parallel='pipeline' or 'tensor' with it")
    if parallel is not None and adapter_path is not None:
        raise ValueError(f"adapter_path={str(adapter_path)!r} with parallel={parallel!r} is not supported; merge the "
                         "adapter first (kimi-mlx fuse --model ... --adapter-path ... --save-path DIR) and load DIR")
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
        from .pipeline import Stages  # the stages import the models (and mlx-lm): not for ``kimi-mlx plan --help``

        stages = Stages.split(layer_costs, group, split, cfg.tie_word_embeddings)  # checks ``split`` for 1 rank too
        layers = stages.layers
        where += f", layers {layers.start}-{layers.stop - 1}"
        return None if group.size() == 1 else Share(stages.select, _labelled(stages.apply, where, group))
    if group.size() == 1:
        return None
    from .shard import tensor_parallel, tensor_select

    return Share(tensor_select(cfg, group), _labelled(lambda model: tensor_parallel(model, group), where, group))


def _labelled(apply: Callable[[nn.Module], nn.Module], where: str, group: mx.distributed.Group
              ) -> Callable[[nn.Module], nn.Module]:
    """``apply``, then ``model.shard = where`` (e.g. "pipeline rank 1 of 2, layers 14-26"): what a prompt-cache file
    of this rank's part records, so another rank's file is refused; and ``model.rank0_ids``: ids -> rank 0's ids
    on every rank (``comm.broadcast_ids`` over the model's group), which speculative decoding uses to keep the ranks'
    decisions identical."""

    def labelled(model: nn.Module) -> nn.Module:
        model = apply(model)
        model.shard = where
        model.rank0_ids = functools.partial(broadcast_ids, group=group)
        return model

    return labelled


@dataclass
class Opened:
    """What a loader's first step (opening the model, no weights read) hands ``load_parallel``.

    cfg: the model's config. layer_bytes: () -> bytes of each decoder layer as the rank will hold it, called only for
    the default pipeline split (proportional to each rank's memory). fingerprint: ``(config, tensors, files)`` for
    ``health.fingerprint`` (the ranks must agree on it). state: anything the loader's second step needs (the open
    file, the built lazy model, the tokenizer).
    """

    cfg: KimiConfig
    layer_bytes: Callable[[], Sequence[int]]
    fingerprint: tuple[Mapping[str, Any], Iterable[tuple[str, Sequence[int], Any]], Iterable[Path]]
    state: Any = None
    group: Optional[mx.distributed.Group] = None  # set by ``load_parallel``: the group split over (None: one process)


def load_parallel(
    parallel: Optional[str], group: Optional[mx.distributed.Group], split: Split,
    adapter_path: Optional[Union[str, Path]], open_model: Callable[[], Opened],
    read_weights: Callable[[Opened, Optional[Share], Optional[mx.distributed.Group]], nn.Module],
) -> tuple[nn.Module, Opened]:
    """The distributed part of ``load(..., parallel=, group=, split=)`` around a loader's two steps:
    ``open_model()`` and ``read_weights(opened, share, group) -> model`` (``share``: this rank's ``Share``, None for
    a single process: read everything; ``group`` for messages).

    Checks the arguments (``check_arguments``), takes the group (``init_group``) and starts the watchdog (from then on
    a rank that is lost ends the others), runs each step as one every rank passes or fails together (``agree``: the
    ranks' fingerprints of the opened model must match), and decides this rank's share between them (every rank
    must call this). With ``parallel`` None the steps simply run. Returns (model, opened), ``opened.group`` set.
    """
    check_arguments(parallel, group, split, adapter_path)
    group = init_group(parallel, group)
    watch(group)  # no-op for one process
    with agree(group, "opening the model") as step:
        opened = open_model()
        costs = opened.layer_bytes() if parallel == "pipeline" else []
        step.fingerprint = fingerprint(*opened.fingerprint)
    share = rank_share(parallel, group, split, opened.cfg, costs)
    with agree(group, "loading the weights"):
        model = read_weights(opened, share, group)
    opened.group = group
    return model, opened


def param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (what ``kimi-mlx plan`` predicts per rank)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
