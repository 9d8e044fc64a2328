"""Every collective of a distributed model goes through here: one stream (so every rank runs them in the order they
were scheduled) and a count of the bytes each rank sends (``TRAFFIC``, read by ``bench/bench_distributed.py``).

Counts are taken where the collective is scheduled (its payload size), per kind: ``all_sum`` and ``all_gather``
count this rank's contribution, ``send`` the message, ``recv`` the message received.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Optional

import mlx.core as mx
import numpy as np


_streams = threading.local()


def comm_stream() -> mx.Stream:
    """The one CPU stream that every collective of this thread runs on (send, recv, all_sum, all_gather).

    MLX runs a collective on the caller's stream, and mlx-lm's ``generate_step`` works on its own generation stream
    while other calls use the default one: collectives on two streams may run in a different order on each rank
    (a hang or mixed-up messages). On one stream they run in the order they were scheduled, the same on every rank.
    MLX streams belong to the thread that made them, so each thread gets its own; a process runs its collectives
    from one thread at a time (the server's engine thread on rank 0, the main thread elsewhere).
    """
    stream = getattr(_streams, "stream", None)
    if stream is None:
        stream = _streams.stream = mx.new_stream(mx.cpu)
    return stream


class Traffic:
    """Bytes and calls per collective kind since the last ``reset`` (this process only)."""

    def __init__(self):
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


TRAFFIC = Traffic()


def all_sum(x: mx.array, group: mx.distributed.Group) -> mx.array:
    TRAFFIC.add("all_sum", x.nbytes)
    return mx.distributed.all_sum(x, group=group, stream=comm_stream())


def all_gather(x: mx.array, group: mx.distributed.Group) -> mx.array:
    TRAFFIC.add("all_gather", x.nbytes)
    return mx.distributed.all_gather(x, group=group, stream=comm_stream())


def send(x: mx.array, dst: int, group: mx.distributed.Group) -> mx.array:
    TRAFFIC.add("send", x.nbytes)
    return mx.distributed.send(x, dst, group=group, stream=comm_stream())


def recv(shape: tuple, dtype: mx.Dtype, src: int, group: mx.distributed.Group) -> mx.array:
    out = mx.distributed.recv(shape, dtype, src, group=group, stream=comm_stream())
    TRAFFIC.add("recv", out.nbytes)
    return out


EOF = -1  # broadcast_text's length for "no text" (end of input)


def broadcast_int(value: Optional[int], group: mx.distributed.Group) -> int:
    """Rank 0's ``value`` on every rank (the others pass anything, e.g. None)."""
    mine = int(value) if group.rank() == 0 else 0
    return int(all_sum(mx.array([mine], dtype=mx.int64), group).item())


def broadcast_text(text: Optional[str], group: mx.distributed.Group) -> Optional[str]:
    """Rank 0's ``text`` (None: end of input) on every rank: its UTF-8 length (``EOF`` for None), then its bytes,
    each as an ``all_sum`` to which the other ranks add zeros. Every rank must call it (the others' ``text`` is
    ignored)."""
    data = text.encode("utf-8") if group.rank() == 0 and text is not None else b""
    n = broadcast_int(EOF if group.rank() == 0 and text is None else len(data), group)
    if n == EOF:
        return None
    if n == 0:
        return ""
    mine = np.frombuffer(data, np.uint8).astype(np.int32) if group.rank() == 0 else np.zeros(n, np.int32)
    out = np.array(all_sum(mx.array(mine), group))
    return out.astype(np.uint8).tobytes().decode("utf-8")


def broadcast_ids(ids: list[int], group: mx.distributed.Group) -> list[int]:
    """Rank 0's ``ids`` (a list of ints, any length) on every rank: its length, then the ids, each as an ``all_sum``
    to which the other ranks add zeros. Every rank must call it (the others' ``ids`` are ignored)."""
    n = broadcast_int(len(ids), group)
    if n == 0:
        return []
    mine = mx.array(ids, dtype=mx.int64) if group.rank() == 0 else mx.zeros((n,), mx.int64)
    return [int(v) for v in all_sum(mine, group).tolist()]
