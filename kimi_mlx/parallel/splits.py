"""Contiguous splits across ranks: of layers (pipeline: ``pipeline_ranges``) and of heads / experts / intermediate
widths (tensor: ``tensor_shares``). Plain arithmetic on counts, shared by ``load(parallel=...)`` and ``kimi-mlx plan``
so the planner predicts exactly the split a load makes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from ..config import KimiConfig

Split = Union[None, str, Sequence[int]]  # a pipeline split: None (by memory), "even", or layer counts per rank


def split_evenly(n: int, parts: int, unit: int = 1) -> list[range]:
    """``n`` items in ``parts`` contiguous ranges whose sizes differ by at most ``unit`` (earlier ranges larger).

    ``unit``: every boundary falls on a multiple of it (e.g. a quantization group); ``n`` must be a multiple.
    Ranges may be empty when there are fewer units than parts.
    """
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts; expected at least 1")
    if unit < 1 or n % unit:
        raise ValueError(f"{n} items cannot be split in units of {unit}")
    units, extra = divmod(n // unit, parts)
    out, start = [], 0
    for r in range(parts):
        size = (units + (r < extra)) * unit
        out.append(range(start, start + size))
        start += size
    return out


def split_proportional(costs: Sequence[float], capacities: Sequence[float]) -> list[range]:
    """Contiguous ranges of items (e.g. layers with their byte ``costs``) for ranks of the given ``capacities``.

    Each rank's share of the total cost is as close as a contiguous split allows to its share of the capacity
    (boundary i is placed where the running cost is nearest to the capacity prefix); every rank gets at least one
    item, so there must be at least as many items as ranks.
    """
    n, parts = len(costs), len(capacities)
    if parts < 1 or any(c <= 0 for c in capacities):
        raise ValueError(f"capacities {list(capacities)}: expected one positive value per rank")
    if n < parts:
        raise ValueError(f"{n} layers cannot be split over {parts} ranks; expected at most {n} ranks")
    total, cap = float(sum(costs)), float(sum(capacities))
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    bounds, acc = [0], 0.0
    for r in range(parts - 1):
        acc += capacities[r]
        target = total * acc / cap
        lo, hi = bounds[-1] + 1, n - (parts - 1 - r)  # leave at least one item for each later rank
        bounds.append(min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] - target), i)))
    bounds.append(n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def parse_split(text: str, n_layers: int, parts: int) -> list[int] | str:
    """``--split`` / ``split=``: ``"even"`` or comma-separated layer counts per rank (summing to ``n_layers``)."""
    if text == "even":
        return "even"
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"split {text!r}: expected 'even' or comma-separated layer counts such as '20,7'") from None
    check_counts(counts, n_layers, parts)
    return counts


def check_counts(counts: Sequence[int], n_layers: int, parts: int) -> None:
    """Layer counts per rank: one per rank, each at least 1, summing to the model's layer count."""
    if len(counts) != parts:
        raise ValueError(f"split {list(counts)}: {len(counts)} layer counts for {parts} ranks; expected one per rank")
    if any(c < 1 for c in counts) or sum(counts) != n_layers:
        raise ValueError(f"split {list(counts)}: expected positive layer counts summing to the model's {n_layers} "
                         f"layers (they sum to {sum(counts)})")


def ranges_from_counts(counts: Sequence[int]) -> list[range]:
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


@dataclass(frozen=True)
class TensorShare:
    """One rank's part of every layer under tensor + expert parallelism (the same ranges in every layer).

    kda_heads / mla_heads: head ranges; experts: routed expert ids (each held whole); ffn: columns of the dense
    MLP's intermediate width; shared: columns of the shared experts' intermediate width. Ranges may be empty.
    """

    kda_heads: range
    mla_heads: range
    experts: range
    ffn: range
    shared: range


# TensorShare field -> the size in the config that it ranges over.
SPLIT_SIZES = {
    "kda_heads": lambda c: c.kda_num_heads,
    "mla_heads": lambda c: c.num_attention_heads,
    "experts": lambda c: c.num_experts,
    "ffn": lambda c: c.intermediate_size,
    "shared": lambda c: c.moe_intermediate_size * c.num_shared_experts,
}
WIDTHS = ("ffn", "shared")  # the intermediate widths (split on ``unit``)


def tensor_shares(cfg: KimiConfig, parts: int, unit: int = 1) -> list[TensorShare]:
    """Split heads, experts and intermediate widths over ``parts`` ranks as evenly as the counts allow.

    ``unit``: intermediate widths are split on multiples of it (the quantization group size of a quantized
    model, so each rank's slice of a quantized ``down_proj`` holds whole groups).
    """
    ranges = {field: split_evenly(size(cfg), parts, unit if field in WIDTHS else 1)
              for field, size in SPLIT_SIZES.items()}
    return [TensorShare(**{field: r[rank] for field, r in ranges.items()}) for rank in range(parts)]


def pipeline_ranges(costs: Sequence[float], capacities: Sequence[float],
                    split: Union[None, str, Sequence[int]] = None) -> list[range]:
    """Layer ranges per rank: ``split`` None (proportional to ``capacities``), ``"even"``, or layer counts per rank
    (a list, or a string such as ``"20,7"``). ``costs``: bytes of each layer; ``capacities``: one per rank."""
    n, parts = len(costs), len(capacities)
    if split is None:
        return split_proportional(costs, capacities)
    counts = parse_split(split, n, parts) if isinstance(split, str) else list(split)
    if counts == "even":
        if n < parts:
            raise ValueError(f"split 'even': {n} layers cannot be split over {parts} ranks; expected at most {n} ranks")
        return split_evenly(n, parts)
    check_counts(counts, n, parts)
    return ranges_from_counts(counts)
