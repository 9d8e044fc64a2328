"""Rank-0 input and output for commands run on every rank of ``mlx.launch ... -- kimi-mlx CMD --parallel MODE``.

Rank 0 reads the input (a prompt, chat lines) and hands it to the other ranks with ``broadcast_text``; only rank 0
prints (``on_ranks`` discards the others' stdout); sampling draws the same tokens everywhere because every
rank seeds MLX's generator with one seed (``shared_seed``: rank 0's pick unless ``--seed`` is given). Collectives go
through ``kimi_mlx.parallel.comm`` like every other collective of the process, in the same order on every rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager, nullcontext, redirect_stdout
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from ..parallel import MODES
from ..parallel.comm import broadcast_int

ERROR_GRACE_S = 2.0  # a rank other than 0 waits this long after a flag error before exiting


def group_from_args(args: argparse.Namespace) -> Optional[mx.distributed.Group]:
    """The group for ``--parallel`` (``mx.distributed.init()``), None without it (one process: today's behaviour,
    also under ``mlx.launch``). Checks ``--parallel`` / ``--split`` first (ValueError naming the flag)."""
    if args.parallel is None:
        if args.split is not None:
            raise ValueError(f"--split {args.split}: only --parallel pipeline takes a split")
        return None
    if args.parallel not in MODES:
        raise ValueError(f"--parallel {args.parallel}: expected one of {', '.join(MODES)}")
    if args.split is not None:
        if args.parallel != "pipeline":
            raise ValueError(f"--split {args.split}: only --parallel pipeline takes a split")
        parts = args.split.split(",")
        if args.split != "even" and not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--split {args.split}: expected 'even' or positive layer counts per rank such as "
                             "'20,7'")
    return mx.distributed.init()


def rank(group: Optional[mx.distributed.Group]) -> int:
    return 0 if group is None else group.rank()


def is_parallel(group: Optional[mx.distributed.Group]) -> bool:
    return group is not None and group.size() > 1


@contextmanager
def on_ranks(group: Optional[mx.distributed.Group]):
    """stdout as is on rank 0 (and for no group), discarded on the other ranks (their errors still reach stderr)."""
    with open(os.devnull, "w") as sink, redirect_stdout(sink) if rank(group) else nullcontext():
        yield


def wait_for_ranks(group: Optional[mx.distributed.Group]) -> None:
    """After a command succeeded: return once every rank has finished its collectives (mlx-lm's generator evaluates
    the next step ahead, asynchronously); a rank that exited earlier would cut the others' last messages. (After an
    error, a rank just exits: the others' collectives fail and the watchdog names it.)"""
    if is_parallel(group):
        from ..parallel.health import barrier

        barrier(group)


def run_command(args: argparse.Namespace, check: Callable[[], None], body: Callable[[Optional[mx.distributed.Group]], int]) -> int:
    """A command that may run on every rank of ``mlx.launch``: check the flags (``--parallel`` / ``--split``, then
    ``check()``; a ValueError there is the same on every rank, so rank 0 prints it and every rank returns 2), then
    ``body(group)`` inside ``on_ranks``, and when it succeeds ``wait_for_ranks``."""
    try:
        group = group_from_args(args)
        check()
    except ValueError as e:
        if rank(mx.distributed.init()) == 0:
            print(f"kimi-mlx: error: {e}", file=sys.stderr, flush=True)
        else:  # mlx.launch stops every rank once one exits: give rank 0 the time to say why
            time.sleep(ERROR_GRACE_S)
        return 2
    with on_ranks(group):
        rc = body(group)
    if rc == 0:
        wait_for_ranks(group)
    return rc


def rank_path(path: str, group: Optional[mx.distributed.Group]) -> str:
    """Where this rank keeps its part of a file: ``path`` itself on rank 0 (and for one process), ``NAME.rank{r}.EXT``
    for ``NAME.EXT`` on rank r (each Mac writes its own; on one machine the names do not collide)."""
    if rank(group) == 0:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank(group)}{p.suffix}"))


def together(group: Optional[mx.distributed.Group], what: str):
    """A step all ranks pass or fail together (``kimi_mlx.parallel.health.agree``; the error names the rank)."""
    from ..parallel.health import agree

    return agree(group if is_parallel(group) else None, what)


def report_error(e: BaseException, group: Optional[mx.distributed.Group]) -> int:
    """Print ``kimi-mlx: error: ...`` and return 2. A ``RankError`` was printed by rank 0 already (silent here);
    other ranks name themselves (an error of theirs may be theirs alone)."""
    from ..parallel.health import RankError

    if isinstance(e, RankError):
        return 2
    where = f"rank {group.rank()}: " if rank(group) else ""
    print(f"kimi-mlx: error: {where}{e}", file=sys.stderr, flush=True)
    return 2


def shared_seed(seed: Optional[int], group: mx.distributed.Group) -> int:
    """``seed`` if given (the same on every rank: the same command line), else one that rank 0 picks at random,
    on every rank."""
    if seed is not None:
        return seed
    pick = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF if group.rank() == 0 else 0
    return broadcast_int(pick, group)
