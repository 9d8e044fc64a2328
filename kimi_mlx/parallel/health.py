"""Load steps that every rank of a distributed run passes or fails together, and a check that all ranks loaded the
same model.

A collective waits for every rank, so a rank that raises while the others go on to the next collective leaves them
waiting (MLX's ``ring`` backend raises ``[ring] connection to a peer was lost`` once that rank's process has ended, but
names neither the rank nor its error; a rank that is still alive, e.g. in a REPL, keeps them waiting forever). So each
step runs inside ``agree(group, what)``: its exception is caught, and every rank's status (its host, its error if any,
the fingerprint of what it loaded) is exchanged with ``all_gather``, a collective every rank reaches whether its step
failed or not. Then every rank raises the same ``RankError``, which names each failed rank, its host and its error,
or, when every step passed but the fingerprints differ, which ranks differ and in what. Rank 0 prints it first, and no
rank raises before rank 0 has printed (``mlx.launch`` kills the other ranks as soon as one exits non-zero).

    with agree(group, "opening the model") as step:
        ...                                      # may raise on some ranks only; must run no collective itself
        step.fingerprint = fingerprint(config, tensors, files)
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import mlx.core as mx
import numpy as np

from . import comm

SAMPLE_BYTES = 64 * 1024  # of each file's start and end hashed into the fingerprint
LONG_VALUE = 120  # config values whose JSON is longer are compared by digest (GGUF token lists)
MAX_DIFFERENCES = 8  # listed in a mismatch error


class RankError(ValueError):
    """Raised on every rank: a step failed on some rank(s), or the ranks loaded different models."""


@dataclass
class Step:
    """What a rank hands ``agree`` from inside its step: the fingerprint of what it loaded (None: not compared)."""

    fingerprint: Optional[dict] = None


def gather_bytes(group: mx.distributed.Group, data: bytes) -> list[bytes]:
    """Every rank's ``data``, on every rank: one ``all_gather`` of the lengths, one of the payloads padded to the
    longest (through ``comm``, like every collective of this process)."""
    sizes = comm.all_gather(mx.array([len(data)], dtype=mx.int32), group)
    sizes = sizes.tolist()
    width = max(max(sizes), 1)
    padded = np.zeros(width, np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    rows = np.array(comm.all_gather(mx.array(padded), group))
    return [row[:n].tobytes() for row, n in zip(rows.reshape(len(sizes), width), sizes)]


def barrier(group: mx.distributed.Group) -> None:
    """Return once every rank of ``group`` has reached this point."""
    mx.eval(comm.all_sum(mx.zeros(1), group))


@contextmanager
def agree(group: Optional[mx.distributed.Group], what: str) -> Iterator[Step]:
    """Run the ``with`` body as a step that all ranks of ``group`` pass or fail together.

    Every rank must enter it (it ends with collectives), and the body must run no collective of its own (a rank that
    failed before it would never join). When the body raised on any rank, or the ranks' ``Step.fingerprint``s
    differ, rank 0 prints ``kimi-mlx: error: <message>`` to stderr and then every rank raises ``RankError(message)``
    (chained to its own exception, if any). ``what`` names the step in the message ("loading the weights failed on
    rank 1 (host): ..."). With no group or a group of one, the body runs as is.
    """
    step = Step()
    if group is None or group.size() == 1:
        yield step
        return
    error = None
    try:
        yield step
    except Exception as e:  # reported to every rank, then raised again as RankError
        error = e
    mine = {"host": socket.gethostname(), "error": None if error is None else f"{type(error).__name__}: {error}",
            "fingerprint": step.fingerprint}
    statuses = [json.loads(b) for b in gather_bytes(group, json.dumps(mine).encode())]
    message = _failures(what, statuses) or _mismatch(what, statuses)
    if message is None:
        return
    if group.rank() == 0:
        print(f"kimi-mlx: error: {message}", file=sys.stderr, flush=True)
    barrier(group)
    raise RankError(message) from error


def _failures(what: str, statuses: list[dict]) -> Optional[str]:
    failed = [f"rank {r} ({s['host']}): {s['error']}" for r, s in enumerate(statuses) if s["error"] is not None]
    if not failed:
        return None
    if len(failed) == 1:
        return f"{what} failed on {failed[0]}"
    return f"{what} failed on {len(failed)} of {len(statuses)} ranks:\n  " + "\n  ".join(failed)


def _mismatch(what: str, statuses: list[dict]) -> Optional[str]:
    found = differences([s["fingerprint"] or {} for s in statuses], [s["host"] for s in statuses])
    if not found:
        return None
    more = f"\n  ... and {len(found) - MAX_DIFFERENCES} more" if len(found) > MAX_DIFFERENCES else ""
    return (f"the ranks loaded different models ({what}); give every rank the same files:\n  "
            + "\n  ".join(found[:MAX_DIFFERENCES]) + more)


def fingerprint(config: Mapping[str, Any], tensors: Iterable[tuple[str, Sequence[int], Any]],
                files: Iterable[Path] = ()) -> dict:
    """A JSON-able summary of a loaded model for comparing ranks: each ``config`` key's value (long ones by digest),
    a digest of the tensors' names, shapes and dtypes per group (a layer such as ``model.layers.3``, or a module such
    as ``lm_head``), and each file's size and a digest of its first and last 64 KiB (``files`` by base name).

    Weights that differ only in the middle of a file of the same size and layout are not told apart (that would
    need reading every byte)."""
    groups: dict[str, list[tuple[str, Sequence[int], str]]] = {}
    for name, shape, dtype in sorted(tensors, key=lambda t: t[0]):
        groups.setdefault(_tensor_group(name), []).append((name, tuple(shape), str(dtype).rsplit(".", 1)[-1]))
    return {
        "config": {key: _value(value) for key, value in config.items()},
        "tensors": {group: _tensors_print(items) for group, items in groups.items()},
        "files": {Path(f).name: _file_print(Path(f)) for f in files},
    }


def differences(prints: list[dict], hosts: list[str]) -> list[str]:
    """One line per entry of the ranks' ``fingerprint``s that is not the same on every rank, naming the ranks (and
    their ``hosts``) with each value, e.g. ``config 'rms_norm_eps': rank 0 (a): 1e-05; rank 1 (b): 2e-05``."""
    lines = []
    for section in ("config", "tensors", "files"):
        tables = [p.get(section, {}) for p in prints]
        for key in sorted(set().union(*tables)):
            by_value: dict[str, list[int]] = {}
            for rank, table in enumerate(tables):
                by_value.setdefault(table.get(key, "(missing)"), []).append(rank)
            if len(by_value) > 1:
                values = "; ".join(f"{_ranks(rs, hosts)}: {value}" for value, rs in by_value.items())
                lines.append(f"{section} {key!r}: {values}")
    return lines


def _ranks(ranks: list[int], hosts: list[str]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(f"{r} ({hosts[r]})" for r in ranks)


def _tensor_group(name: str) -> str:
    """``model.layers.3.mlp.gate.weight`` -> ``model.layers.3``; ``lm_head.weight`` -> ``lm_head``."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def _tensors_print(items: list[tuple[str, Sequence[int], str]]) -> str:
    """``21 tensors (F32 9, Q8_0 12), sha256 ...``: the dtypes say what differs when the digest does."""
    dtypes = Counter(dtype for _, _, dtype in items)
    listing = "\n".join(f"{name}:{shape}:{dtype}" for name, shape, dtype in items)
    counts = ", ".join(f"{dtype} {n}" for dtype, n in sorted(dtypes.items()))
    return f"{len(items)} tensor{'s' if len(items) > 1 else ''} ({counts}), sha256 {_digest(listing.encode())}"


def _value(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= LONG_VALUE else f"<{len(text)} chars, sha256 {_digest(text.encode())}>"


def _file_print(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(SAMPLE_BYTES)
        f.seek(max(size - SAMPLE_BYTES, 0))
        tail = f.read(SAMPLE_BYTES)
    return f"{size} bytes, sample sha256 {_digest(head + tail)}"


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
