"""GPU memory on a Mac: the working set macOS lets the GPU keep resident, wiring a model's memory while it generates
(as mlx-lm's ``wired_limit``), the advice when a model does not fit, and MLX's buffer-cache cap.

Conventions:

- The *working set* is Metal's ``recommendedMaxWorkingSetSize`` (``mx.device_info()["max_recommended_working_set_size"]``,
  bytes): the most memory the GPU keeps wired (resident, never paged out). macOS derives it from the RAM
  (``default_working_set``) unless ``sudo sysctl iogpu.wired_limit_mb=N`` raised it (N in MiB; it resets at reboot),
  and the device reports the raised value. MLX keeps up to ``mx.set_wired_limit`` bytes of its buffers wired; the
  limit may not exceed the working set.
- ``FILL``: weights (and, in ``kimi-mlx plan``, the cache at the planned context) may take this fraction of the
  working set; the rest is for the cache and a prefill chunk's activations. Past it the load warns (mlx-lm warns at
  the same fraction) and advises ``wired_limit_mib(bytes)``: the limit at which they take exactly ``FILL`` of it.
- Without a Metal GPU (MLX's CPU backend, CUDA) there is no working set: ``gpu_memory()`` is None and everything here
  that acts on the device does nothing.

``gpu_memory`` and ``set_wired_limit`` are the only functions that talk to the device (tests replace them).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

__all__ = [
    "FILL",
    "GPUMemory",
    "WorkingSetWarning",
    "check_fits",
    "default_cache_limit",
    "default_working_set",
    "fit_advice",
    "gpu_memory",
    "keep_wired",
    "macos_share",
    "set_wired_limit",
    "usable_memory",
    "wired",
    "wired_during",
    "wired_limit_mib",
]

MIB, GIB = 2**20, 2**30
FILL = 0.9


class WorkingSetWarning(UserWarning):
    """A model (or a rank's share) takes more than ``FILL`` of the GPU's working set."""


@dataclass(frozen=True)
class GPUMemory:
    """A Metal GPU's ``working_set`` (bytes the GPU may keep wired: the recommended working set, raised by
    ``iogpu.wired_limit_mb`` where it was) and the Mac's unified ``memory`` (bytes)."""

    working_set: int
    memory: int


def gpu_memory() -> Optional[GPUMemory]:
    """The default device's working set and memory when it is a Metal GPU, else None (CPU backend, CUDA)."""
    if not (mx.metal.is_available() and mx.default_device().type == mx.DeviceType.gpu):
        return None
    info = mx.device_info()
    return GPUMemory(int(info["max_recommended_working_set_size"]), int(info["memory_size"]))


def set_wired_limit(limit: int) -> int:
    """``mx.set_wired_limit``: keep up to ``limit`` bytes of MLX's buffers wired; returns the previous limit."""
    return mx.set_wired_limit(limit)


# macOS's default working set (iogpu.wired_limit_mb = 0), as Macs report it (llama.cpp prints it at start-up as
# recommendedMaxWorkingSetSize, in MiB or, in later builds, 1e6 bytes):
#   macOS 13-15: 2/3 of the memory up to 32 GiB, 3/4 above:
#     16 GiB -> 10,922.67 MiB (M1 Pro)  https://github.com/abetlen/llama-cpp-python/issues/687
#     24 GiB -> 16 GiB (M2; 17,179.89e6 bytes), 36 GiB -> 27 GiB (M4 Max; 28,991.03e6 bytes): llama.cpp logs in
#               public repositories
#     32 GiB -> 21,845.34 MiB (M2 Max)  https://github.com/ollama/ollama/issues/434,
#                                       (M1 Max) https://github.com/ggml-org/llama.cpp/pull/2011
#     64 GiB -> 49,152 MiB (M1/M2 Max)  https://github.com/ggml-org/llama.cpp/issues/1870
#     96 GiB -> 73,728 MiB (M2 Max)     https://github.com/ggml-org/llama.cpp/issues/3213
#   macOS 26 gives more: 128 GiB -> 107.52 GiB (M5 Max and a second machine; 112.00 GiB with
#     iogpu.wired_limit_mb=114688) https://github.com/antirez/ds4/pull/893; in llama.cpp logs: 32 GiB -> 24.96 GiB
#     (M5), 48 GiB -> 37.44 GiB (M4 Pro), 64 GiB -> 51.84 GiB (M3 Max, macOS 26.4.1), 512 GiB -> 464 GiB (M3 Ultra).
# ``default_working_set`` is the macOS 13-15 rule: the smaller value, so a plan that fits it fits on either; a host
# whose limit was raised, or that reports more, is given to ``kimi-mlx plan`` with ``--wired-limit``.
_SMALL_MAC = 32 * GIB


def default_working_set(memory: int) -> int:
    """Bytes of GPU working set macOS gives a Mac of ``memory`` bytes by default (macOS 13-15: 2/3 up to 32 GiB,
    3/4 above; macOS 26 gives more, see the table above)."""
    return memory * 2 // 3 if memory <= _SMALL_MAC else memory * 3 // 4


def macos_share(memory: int) -> int:
    """The least memory a raised wired limit should leave to macOS and other programs: 8 GiB, a quarter of a Mac
    under 32 GiB (its default leaves a third)."""
    return min(8 * GIB, memory // 4)


def wired_limit_mib(nbytes: int) -> int:
    """The ``iogpu.wired_limit_mb`` value (MiB) at which ``nbytes`` take ``FILL`` of the working set."""
    return math.ceil(nbytes / FILL / MIB)


def fit_advice(nbytes: int, gpu: GPUMemory) -> Optional[str]:
    """None when a model's ``nbytes`` of weights take at most ``FILL`` of ``gpu.working_set``; else what happens and
    the ``sysctl`` that fixes it, or, when that would leave macOS less than ``macos_share``, to quantize or split."""
    ws, memory = gpu.working_set, gpu.memory
    if nbytes <= FILL * ws:
        return None
    size = (f"the model's weights take {_size(nbytes)}, "
            + ("more than this Mac's GPU working set" if nbytes > ws else
               f"{nbytes / ws:.0%} of this Mac's GPU working set")
            + f" of {ws / GIB:,.1f} GiB ({memory / GIB:,.0f} GiB of memory): ")
    effect = ("macOS cannot keep them resident, so generating pages weights in and out (slow) or fails. "
              if nbytes > ws else "little is left for the cache and activations, so long prompts page memory "
              "in and out (slow). ")
    limit = wired_limit_mib(nbytes)
    if limit * MIB > memory - macos_share(memory):
        return (size + effect + f"They do not fit beside macOS on this Mac ({macos_share(memory) / GIB:g} GiB "
                "kept for it): quantize the model (e.g. --quantize 4) or split it over several Macs (kimi-mlx plan).")
    return (size + effect + f"Raise the limit (until the next reboot) with: sudo sysctl iogpu.wired_limit_mb={limit} "
            f"(the model's weights plus {1 - FILL:.0%} of the limit for the cache and activations; it leaves "
            f"{(memory - limit * MIB) / GIB:,.1f} GiB to macOS), or quantize the model or split it over several Macs "
            "(kimi-mlx plan).")


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:,.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:,.1f} MB"


def check_fits(nbytes: int, source: str) -> None:
    """Warn (``WorkingSetWarning``, naming ``source``) when a model of ``nbytes`` takes more than ``FILL`` of this
    Mac's GPU working set; nothing without a Metal GPU."""
    gpu = gpu_memory()
    advice = None if gpu is None else fit_advice(nbytes, gpu)
    if advice is not None:
        warnings.warn(f"{source}: {advice}", WorkingSetWarning, stacklevel=2)


@contextlib.contextmanager
def wired(streams: Sequence[mx.Stream] = ()) -> Iterator[None]:
    """Within the block MLX keeps up to the working set of its buffers wired (as ``mlx_lm.generate.wired_limit``);
    on exit it waits for ``streams`` and the default stream (the limit must not change during an evaluation) and
    restores the previous limit. Nothing without a Metal GPU."""
    gpu = gpu_memory()
    if gpu is None:
        yield
        return
    previous = set_wired_limit(gpu.working_set)
    try:
        yield
    finally:
        for s in (*streams, None):
            mx.synchronize(s)
        set_wired_limit(previous)


def wired_during(*streams: mx.Stream) -> Callable:
    """Decorator: run a function, or a generator function for as long as it is iterated, inside ``wired(streams)``."""

    def decorate(fn: Callable) -> Callable:
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def generator(*args, **kwargs):
                with wired(streams):
                    yield from fn(*args, **kwargs)

            return generator

        @functools.wraps(fn)
        def call(*args, **kwargs):
            with wired(streams):
                return fn(*args, **kwargs)

        return call

    return decorate


def keep_wired() -> Optional[int]:
    """For a process that generates until it exits (the CLI commands, the server): keep up to the working set of
    MLX's buffers wired from now on (mlx-lm's server does the same). Returns the limit set, None without a Metal GPU."""
    gpu = gpu_memory()
    if gpu is None:
        return None
    set_wired_limit(gpu.working_set)
    return gpu.working_set


def usable_memory() -> int:
    """Bytes this process can hold: the GPU's working set on a Mac, elsewhere the physical RAM."""
    gpu = gpu_memory()
    return gpu.working_set if gpu is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_cache_limit() -> int:
    """Bytes of freed buffers MLX may keep for reuse in a long-running server: an eighth of ``usable_memory``, at
    most 2 GiB: room to recycle a decode step's and a prefill chunk's activations, not to hoard the buffers of
    evicted caches."""
    return min(2 * GIB, usable_memory() // 8)
