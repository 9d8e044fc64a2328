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
outputs) with the uninitialised threadgroup-memory and local-variable checks on. Every emulated launch is held to the
project's launch limits (``kimi_mlx.metal.MAX_THREADS_PER_THREADGROUP`` threads, ``MAX_THREADGROUP_MEMORY`` bytes):
past them the emulator reports an error. ``KernelBackend(narrow_uint=True)`` runs kernel bodies with a 16-bit
``uint`` (see ``NARROW_UINT``). Emulator compiles are cached under ``$METAL_EMU_CACHE`` (default
``~/.cache/metal_emu``).
"""

from __future__ import annotations

import contextlib
import re
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
LIMITS = {
    "max_threads_per_threadgroup": metal.MAX_THREADS_PER_THREADGROUP,
    "max_threadgroup_memory": metal.MAX_THREADGROUP_MEMORY,
}

# A 32-bit index that wraps at 2^32 cannot be run here (2^32 elements per buffer). With ``narrow_uint`` every `uint`
# of a kernel body becomes this 16-bit type, which wraps at 2^16 where uint wraps at 2^32 and widens into long /
# ulong / size_t as uint does: a launch with more than 2^16 elements in a buffer then runs the body's index arithmetic
# at the scale where a uint index wraps (a wrong element read: the output no longer matches the pure path, or an
# out-of-bounds diagnostic), while an index computed in ulong / size_t is unaffected. Only the body's `uint` is
# narrowed: header helpers, the thread attributes' own type and int arithmetic keep their width.
NARROW_UINT = r"""
struct narrow_uint {
  unsigned short v;
  narrow_uint() = default;
  narrow_uint(unsigned long x) : v((unsigned short)x) {}
  operator unsigned int() const { return v; }
};
template <class T> struct narrow_op {};  // result of narrow_uint op T: narrow_uint up to 32 bits, else T
template <> struct narrow_op<bool> { typedef narrow_uint type; };
template <> struct narrow_op<char> { typedef narrow_uint type; };
template <> struct narrow_op<unsigned char> { typedef narrow_uint type; };
template <> struct narrow_op<short> { typedef narrow_uint type; };
template <> struct narrow_op<unsigned short> { typedef narrow_uint type; };
template <> struct narrow_op<int> { typedef narrow_uint type; };
template <> struct narrow_op<unsigned int> { typedef narrow_uint type; };
template <> struct narrow_op<long> { typedef long type; };
template <> struct narrow_op<unsigned long> { typedef unsigned long type; };
#define NARROW_ARITH(op)                                                                                  \
  inline narrow_uint operator op(narrow_uint a, narrow_uint b) { return narrow_uint(a.v op (unsigned int)b.v); } \
  template <class T> typename narrow_op<T>::type operator op(narrow_uint a, T b) {                         \
    return typename narrow_op<T>::type((unsigned int)a.v op b);                                           \
  }                                                                                                       \
  template <class T> typename narrow_op<T>::type operator op(T a, narrow_uint b) {                         \
    return typename narrow_op<T>::type(a op (unsigned int)b.v);                                           \
  }                                                                                                       \
  template <class T> narrow_uint& operator op##=(narrow_uint& a, T b) {                                   \
    a = narrow_uint((unsigned long)(a op b));                                                             \
    return a;                                                                                             \
  }
#define NARROW_CMP(op)                                                                                    \
  inline bool operator op(narrow_uint a, narrow_uint b) { return a.v op b.v; }                            \
  template <class T, class = typename narrow_op<T>::type> bool operator op(narrow_uint a, T b) {          \
    return (unsigned int)a.v op b;                                                                        \
  }                                                                                                       \
  template <class T, class = typename narrow_op<T>::type> bool operator op(T a, narrow_uint b) {          \
    return a op (unsigned int)b.v;                                                                        \
  }
NARROW_ARITH(+) NARROW_ARITH(-) NARROW_ARITH(*) NARROW_ARITH(/) NARROW_ARITH(%)
NARROW_ARITH(&) NARROW_ARITH(|) NARROW_ARITH(^) NARROW_ARITH(<<) NARROW_ARITH(>>)
NARROW_CMP(<) NARROW_CMP(<=) NARROW_CMP(>) NARROW_CMP(>=) NARROW_CMP(==) NARROW_CMP(!=)
inline narrow_uint& operator++(narrow_uint& a) { return a += 1; }
inline narrow_uint operator++(narrow_uint& a, int) { narrow_uint old = a; a += 1; return old; }
inline narrow_uint& operator--(narrow_uint& a) { return a -= 1; }
inline narrow_uint operator--(narrow_uint& a, int) { narrow_uint old = a; a -= 1; return old; }
"""


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

    def __init__(self, narrow_uint: bool = False, **checks):
        self.name = backend_name()
        if narrow_uint and self.name != "emulator":
            pytest.skip("the 16-bit uint (NARROW_UINT) is an emulator build; a GPU runs the kernels as written")
        self.narrow_uint = narrow_uint
        self.checks = {**LIMITS, **checks}
        self.results = []  # (kernel name, metal_emu.EmuResult) of every emulated launch
        self.launched: list[str] = []  # kernel name (``kimi_<file stem>``) of every emulated launch
        self.threadgroups: list[tuple[int, ...]] = []  # the threadgroup every launch asked for
        self.grids: list[tuple[int, ...]] = []  # the grid every launch asked for

    def _factory(self, **spec):
        """Builds a kernel (real, or emulated with ``checks``) whose launches are recorded."""
        if self.name == "gpu":
            k = mx.fast.metal_kernel(**spec)
        else:
            if str(EMU_DIR) not in sys.path:
                sys.path.insert(0, str(EMU_DIR))
            import metal_emu

            if self.narrow_uint:
                body = re.sub(r"\buint\b", "narrow_uint", spec["source"])
                spec = dict(spec, header=NARROW_UINT + spec["header"], source=body)
            k = metal_emu.metal_kernel(**spec, **self.checks)

        def launch(**kw):
            out = k(**kw)
            if self.name == "emulator":
                self.results.append((spec["name"], k.last_result))
            self.launched.append(spec["name"])
            self.threadgroups.append(tuple(kw["threadgroup"]))
            self.grids.append(tuple(kw["grid"]))
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
