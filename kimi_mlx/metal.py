"""Registry of the project's Metal kernels: loads ``metal_kernels/<name>.metal``, builds each kernel once, lazily.

A kernel file is a plain ``mx.fast.metal_kernel`` body preceded by a ``//`` comment header that documents the
launch (grid, threadgroup, inputs/outputs with shapes and dtypes, template parameters) and names the Python-side
buffers on two tag lines, so the names live next to the body that uses them::

    // my_kernel: what it computes.
    // grid: (32, Dv, B*H)   threadgroup: (32, R, 1)
    // inputs:  x [N, D] InT ...
    // @inputs x scale
    // @outputs y
    // @include shared.h                     (optional, repeatable: metal_kernels/shared.h goes first in the header)
    <optional helper code, passed as the kernel ``header``>
    // @body
    <the kernel body>

Without a ``// @body`` line everything after the comment header is the body. The comment header itself is not
passed to MLX (MLX adds ``x_shape`` parameters or thread attributes for names it finds anywhere in the body text).

Kernels are used only when ``enabled()``: Metal is available, the default device is the GPU, and the environment
variable ``KIMI_MLX_KERNELS`` is not ``"0"``. Everywhere else (CPU, CUDA, ``KIMI_MLX_KERNELS=0``, inside
``disabled()``) ``kernel(name)`` returns None and the ops in ``kimi_mlx.ops`` run their pure-MLX path. Custom
kernels have no VJP of their own: ops wrap a launch in ``with_reference_vjp`` so that gradients (training) come from
the pure-MLX path, or training code runs under ``with kimi_mlx.metal.disabled():``.

How an op registers and calls a kernel (e.g. ``kimi_mlx/ops/kda_chunked_metal.py``)::

    from .. import metal

    metal.register("kda_chunked")            # reads metal_kernels/kda_chunked.metal, builds nothing yet

    def run(...):
        k = metal.kernel("kda_chunked")      # None unless enabled(); built on first use, then cached
        if k is None:
            return pure_mlx_path(...)
        return k(inputs=[...], template=[...], grid=..., threadgroup=...,
                 output_shapes=[...], output_dtypes=[...])

Launch limits: Metal refuses a kernel whose threadgroup arrays pass ``MAX_THREADGROUP_MEMORY`` (32 KB on Apple GPUs),
and MLX refuses a launch whose threadgroup has more threads than the compiled pipeline's
``maxTotalThreadsPerThreadgroup`` (1024 at most, lower for a kernel that uses many registers), both only when the
launch is evaluated, from inside ``mx.eval``. So each op caps its launch settings by what its kernel needs (e.g. no
more SIMD-groups than there are tiles) and passes the result through ``check_threadgroup`` before launching, which
refuses more than ``MAX_THREADS_PER_THREADGROUP`` threads or ``MAX_THREADGROUP_MEMORY`` bytes with an error naming
the kernel, the setting and its value, and the limit.

Test hook: ``with metal.emulated(factory):`` forces kernels on (whatever the device and environment) and builds
them with ``factory`` instead of ``mx.fast.metal_kernel``; ``factory`` has the same signature, e.g.
``metal_emu.metal_kernel`` or ``functools.partial(metal_emu.metal_kernel, schedules=("forward", "reverse"))``.
Emulated kernels run eagerly on concrete arrays, so ``mx.compile`` is disabled inside the block (and re-enabled on
exit; ``keep_compile=True`` for a factory of real kernels). ``tests/metal_support.py`` wraps this in fixtures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources

import mlx.core as mx

__all__ = [
    "KernelFile",
    "MAX_THREADGROUP_MEMORY",
    "MAX_THREADS_PER_THREADGROUP",
    "check_threadgroup",
    "disabled",
    "emulated",
    "enabled",
    "kernel",
    "load_kernel_file",
    "parse_kernel_file",
    "with_reference_vjp",
    "register",
]

ENV_VAR = "KIMI_MLX_KERNELS"
_PACKAGE = "kimi_mlx.metal_kernels"
_BODY_TAG = "// @body"

# Threadgroup memory a kernel may declare: Apple GPUs' maxThreadgroupMemoryLength (Metal feature set tables).
MAX_THREADGROUP_MEMORY = 32768
# Threads per threadgroup every launch stays within. A device allows 1024, but a compiled pipeline's own limit
# (maxTotalThreadsPerThreadgroup, which MLX checks at eval time) drops with the kernel's register use: 896 is
# reported for register-heavy attention kernels on M1 Max and M2 Ultra, and measurements (philipturner's
# metal-benchmarks) put the lowest occupancy register pressure can force at 24 SIMD-groups (768 threads) per core.
# Half the device limit leaves a margin under all of these; no kernel here needs more.
MAX_THREADS_PER_THREADGROUP = 512


@dataclass(frozen=True)
class KernelFile:
    """A parsed ``metal_kernels/<name>.metal``: buffer names, optional helper header, the body."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    header: str
    source: str
    includes: tuple[str, ...] = ()  # metal_kernels/ files whose text goes before ``header`` (``load_kernel_file``)


def _tag(lines: list[str], tag: str, path: str) -> tuple[str, ...]:
    found = [ln.split(tag, 1)[1].split() for ln in lines if ln.startswith(f"// {tag}")]
    if len(found) != 1 or not found[0]:
        raise ValueError(f"{path}: expected exactly one '// {tag} name ...' line in the comment header")
    return tuple(found[0])


def parse_kernel_file(name: str, text: str, path: str) -> KernelFile:
    """Split a kernel file's text into its tagged buffer names, helper header and body (``path`` names errors)."""
    lines = text.splitlines()
    n_head = 0
    while n_head < len(lines) and lines[n_head].startswith("//"):
        n_head += 1
    comment, rest = lines[:n_head], lines[n_head:]
    inputs, outputs = _tag(comment, "@inputs", path), _tag(comment, "@outputs", path)
    for ident in inputs + outputs:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", ident):
            raise ValueError(f"{path}: buffer name {ident!r} is not an identifier")
    if len(set(inputs + outputs)) != len(inputs + outputs):
        raise ValueError(f"{path}: duplicate buffer names in {inputs + outputs}")
    body_at = [i for i, ln in enumerate(rest) if ln.strip() == _BODY_TAG]
    if len(body_at) > 1:
        raise ValueError(f"{path}: more than one '{_BODY_TAG}' line")
    header, body = ("", rest) if not body_at else (rest[: body_at[0]], rest[body_at[0] + 1 :])
    source = "\n".join(body).strip("\n")
    if not source:
        raise ValueError(f"{path}: empty kernel body")
    includes = tuple(ln.split("@include", 1)[1].strip() for ln in comment if ln.startswith("// @include"))
    if not all(re.fullmatch(r"[A-Za-z0-9_]+\.h", f) for f in includes):
        raise ValueError(f"{path}: '// @include' names a metal_kernels/*.h file, got {includes}")
    return KernelFile(name, inputs, outputs, "\n".join(header).strip("\n"), source + "\n", includes)


def load_kernel_file(name: str) -> KernelFile:
    """Read and parse ``metal_kernels/<name>.metal`` (package data of ``kimi_mlx.metal_kernels``)."""
    path = f"metal_kernels/{name}.metal"
    res = resources.files(_PACKAGE).joinpath(f"{name}.metal")
    if not res.is_file():
        raise FileNotFoundError(f"{path}: no such kernel file in package {_PACKAGE}")
    f = parse_kernel_file(name, res.read_text(encoding="utf-8"), path)
    shared = []
    for inc in f.includes:
        r = resources.files(_PACKAGE).joinpath(inc)
        if not r.is_file():
            raise FileNotFoundError(f"{path}: '// @include {inc}': no such file in package {_PACKAGE}")
        shared.append(r.read_text(encoding="utf-8").strip("\n"))
    return dataclasses.replace(f, header="\n\n".join([*shared, f.header]).strip("\n"))


_files: dict[str, KernelFile] = {}
_built: dict[tuple[int, str], Callable] = {}  # (id(factory), name) -> kernel
_override: list[Callable] = []  # innermost emulated() factory last
_disabled_depth = 0
_compile_off = 0  # emulated() blocks that disabled mx.compile


def register(name: str) -> KernelFile:
    """Declare the kernel ``metal_kernels/<name>.metal`` (parsed now, built lazily by ``kernel``). Idempotent."""
    if name not in _files:
        _files[name] = load_kernel_file(name)
    return _files[name]


def enabled() -> bool:
    """True when kernels run: inside ``emulated()``, or on a Metal GPU default device without KIMI_MLX_KERNELS=0
    and outside ``disabled()``."""
    if _disabled_depth:
        return False
    if _override:
        return True
    if os.environ.get(ENV_VAR, "1") == "0":
        return False
    return mx.metal.is_available() and mx.default_device().type == mx.DeviceType.gpu


def kernel(name: str) -> Callable | None:
    """The built kernel for a registered ``name`` (a callable like ``mx.fast.metal_kernel``'s), or None when kernels
    are not ``enabled()``."""
    if name not in _files:
        raise KeyError(f"Metal kernel {name!r} is not registered (call kimi_mlx.metal.register({name!r}) first)")
    if not enabled():
        return None
    factory = _override[-1] if _override else mx.fast.metal_kernel
    key = (id(factory), name)
    if key not in _built:
        f = _files[name]
        _built[key] = factory(
            name=f"kimi_{name}",
            input_names=list(f.input_names),
            output_names=list(f.output_names),
            source=f.source,
            header=f.header,
            ensure_row_contiguous=True,
        )
    return _built[key]


def check_threadgroup(kernel: str, setting: str, threads: int, memory: int = 0, hint: str = "") -> None:
    """Refuse a launch of ``kernel`` whose threadgroup has more than ``MAX_THREADS_PER_THREADGROUP`` threads or
    declares more than ``MAX_THREADGROUP_MEMORY`` bytes of threadgroup memory: ValueError naming the kernel, the
    ``setting`` that sized it (e.g. ``"simdgroups=16"``), what it asks for and the limit, then ``hint`` (e.g. the
    largest value that fits)."""
    if threads > MAX_THREADS_PER_THREADGROUP:
        asks = f"{threads} threads per threadgroup"
        limit = f"{MAX_THREADS_PER_THREADGROUP} (kimi_mlx.metal.MAX_THREADS_PER_THREADGROUP)"
    elif memory > MAX_THREADGROUP_MEMORY:
        asks, limit = f"{memory} bytes of threadgroup memory", f"{MAX_THREADGROUP_MEMORY} bytes (Metal's limit)"
    else:
        return
    raise ValueError(f"{kernel}: {setting} asks for {asks}, above the limit of {limit}" + (f"; {hint}" if hint else ""))


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block every op takes its pure-MLX path (e.g. for training: custom kernels have no VJP)."""
    global _disabled_depth
    _disabled_depth += 1
    try:
        yield
    finally:
        _disabled_depth -= 1


@contextlib.contextmanager
def emulated(factory: Callable, keep_compile: bool = False) -> Iterator[None]:
    """Test hook: kernels forced on and built with ``factory`` (same signature as ``mx.fast.metal_kernel``).

    ``mx.compile`` is disabled inside the block, because an emulated kernel needs concrete inputs; ``keep_compile``
    leaves it on (for a factory that wraps real Metal kernels). Kernels built by ``factory`` are dropped on exit
    (the factory may be a temporary closure).
    """
    global _compile_off
    _override.append(factory)
    if not keep_compile:
        _compile_off += 1
        mx.disable_compile()
    try:
        yield
    finally:
        _override.pop()
        for key in [k for k in _built if k[0] == id(factory)]:
            del _built[key]
        if not keep_compile:
            _compile_off -= 1
            if not _compile_off:
                mx.enable_compile()


def with_reference_vjp(kernel_fn: Callable, reference_fn: Callable) -> Callable:
    """``f(*arrays)`` whose outputs are ``kernel_fn(*arrays)`` and whose VJP is that of ``reference_fn(*arrays)``
    (the pure-MLX path of the same op, recomputed in the backward pass), so ``mx.grad`` works through a kernel.
    Both take the same float arrays and return the same tuple of arrays; non-differentiable arguments (masks,
    scalars) belong in their closures."""

    @mx.custom_function
    def f(*arrays):
        return tuple(kernel_fn(*arrays))

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        primals = primals if isinstance(primals, (tuple, list)) else (primals,)  # one input arrives bare
        _, grads = mx.vjp(lambda *a: list(reference_fn(*a)), list(primals), list(cotangents))
        return tuple(grads)

    return f
