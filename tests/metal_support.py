"""Run the project's Metal kernels in tests: on a real Metal GPU when there is one, else in the CPU emulator at
``SHARED / "tools" / "metal_emu"``; with neither, the fixtures fail with a message saying so.

Usage in a test module::

    from metal_support import assert_matches, kernels_fixture, strict_kernels_fixture  # noqa: F401  (fixtures)

    def test_x(kernels):
        with kernels.active():                  # kimi_mlx.metal.kernel(...) returns the real / emulated kernel
            got = op(...)
        with kimi_mlx.metal.disabled():         # the pure-MLX path of the same op
            ref = op(...)
        assert_matches(got, ref)
        kernels.assert_clean()                   # no emulator diagnostics (no-op on a GPU)

``strict_kernels`` runs every launch under the forward, reverse and a random schedule (a race shows as differing
outputs) with the uninitialised threadgroup-memory and local-variable checks on. Emulator compiles are cached under
``$METAL_EMU_CACHE`` (default ``~/.cache/metal_emu``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest
from conftest import SHARED

from kimi_mlx import metal

EMU_DIR = SHARED / "tools" / "metal_emu"
STRICT_CHECKS = {
    "schedules": ("forward", "reverse", "random:7"),
    "check_uninit_threadgroup": True,
    "check_uninit_locals": True,
}


def backend_name() -> str:
    """``"gpu"`` on a Metal machine, ``"emulator"`` when ``metal_emu`` is present; otherwise the test fails."""
    if mx.metal.is_available():
        return "gpu"
    if (EMU_DIR / "metal_emu" / "__init__.py").is_file():
        return "emulator"
    pytest.fail(
        f"Metal kernel tests need a Metal GPU or the CPU emulator at {EMU_DIR} (set KIMI_MLX_SHARED to the shared "
        "folder); neither is available"
    )


class KernelBackend:
    """Where kernels run. On the emulator every launch is recorded (``results``) with the given checks."""

    def __init__(self, **checks):
        self.name = backend_name()
        self.checks = checks
        self.results = []  # (kernel name, metal_emu.EmuResult) of every emulated launch
        self.launched: list[str] = []  # kernel name (``kimi_<file stem>``) of every emulated launch

    def _factory(self, **spec):
        """Builds a kernel (real, or emulated with ``checks``) whose launches are recorded."""
        if self.name == "gpu":
            k = mx.fast.metal_kernel(**spec)
        else:
            if str(EMU_DIR) not in sys.path:
                sys.path.insert(0, str(EMU_DIR))
            import metal_emu

            k = metal_emu.metal_kernel(**spec, **self.checks)

        def launch(**kw):
            out = k(**kw)
            if self.name == "emulator":
                self.results.append((spec["name"], k.last_result))
            self.launched.append(spec["name"])
            return out

        return launch

    @contextlib.contextmanager
    def active(self) -> Iterator[KernelBackend]:
        """Within the block the ops dispatch to the kernels (through ``kimi_mlx.metal.emulated`` with a recording
        factory, also on a GPU, which then is the default device and keeps ``mx.compile`` on)."""
        old = mx.default_device()
        if self.name == "gpu":
            mx.set_default_device(mx.gpu)
        try:
            with metal.emulated(self._factory, keep_compile=self.name == "gpu"):
                yield self
        finally:
            mx.set_default_device(old)

    def diagnostics(self) -> list:
        """Every warning/error the emulator reported, as ``"kernel: diagnostic"`` strings."""
        return [f"{name}: {d}" for name, r in self.results for d in r.diagnostics if d.level in ("warning", "error")]

    def assert_clean(self) -> None:
        """Fail if an emulated launch reported any warning or error."""
        diags = self.diagnostics()
        assert not diags, "emulator diagnostics:\n" + "\n".join(diags)


@pytest.fixture(name="kernels")
def kernels_fixture() -> KernelBackend:
    """Kernels on the GPU, or in the emulator with its default checks (bounds, unwritten outputs, crash guard)."""
    return KernelBackend()


@pytest.fixture(name="strict_kernels")
def strict_kernels_fixture() -> KernelBackend:
    """Kernels on the GPU, or in the emulator under three schedules with the uninitialised-memory checks on."""
    return KernelBackend(**STRICT_CHECKS)


# Fixtures are imported by name into test modules; the ``_fixture`` spellings avoid shadowing the argument names.
kernels, strict_kernels = kernels_fixture, strict_kernels_fixture


def _ulp(x: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    """Spacing of ``dtype`` at |x| (float32 array in, float64 out; normal range)."""
    x32 = np.abs(x).astype(np.float32)
    if dtype == mx.float16:
        return np.spacing(x32.astype(np.float16)).astype(np.float64)
    if dtype == mx.bfloat16:
        return np.spacing(x32).astype(np.float64) * 2.0**16  # 8 significant bits vs float32's 24
    raise ValueError(f"no ulp rule for {dtype}")


def mismatch(got: mx.array, ref: mx.array) -> dict:
    """Errors of ``got`` vs ``ref``: max abs, max abs / max |ref|, and (half types) the worst error in ulps of the
    output dtype at max(|ref|, 1e-3 max|ref|)."""
    assert got.shape == ref.shape, f"shape {got.shape} != {ref.shape}"
    assert got.dtype == ref.dtype, f"dtype {got.dtype} != {ref.dtype}"
    g = np.array(got.astype(mx.float32)).astype(np.float64)
    r = np.array(ref.astype(mx.float32)).astype(np.float64)
    assert np.isfinite(g).all(), "kernel output has non-finite values"
    d = np.abs(g - r)
    scale = float(np.abs(r).max()) if r.size else 0.0
    out = {"max_abs": float(d.max()) if d.size else 0.0}
    out["rel"] = out["max_abs"] / scale if scale else out["max_abs"]
    if got.dtype in (mx.float16, mx.bfloat16) and d.size:
        u = _ulp(np.maximum(np.abs(r), 1e-3 * scale), got.dtype)
        out["ulps"] = float((d / u).max())
    return out


def assert_matches(got: mx.array, ref: mx.array, what: str = "output") -> dict:
    """float32: max |got - ref| <= 1e-5 max |ref|; float16/bfloat16: within 2 ulp of the output dtype."""
    e = mismatch(got, ref)
    if got.dtype == mx.float32:
        assert e["rel"] <= 1e-5, f"{what}: float32 relative error {e['rel']:.3g} > 1e-5 ({e})"
    else:
        assert e["ulps"] <= 2, f"{what}: {got.dtype} error {e['ulps']:.3g} ulp > 2 ({e})"
    return e
