"""kimi_mlx.metal: kernel files (header convention, tags), when kernels are enabled, lazy one-time builds, the
emulated() test hook and disabled()."""

import re
from importlib import resources

import mlx.core as mx
import pytest

from kimi_mlx import metal

KERNEL_FILES = sorted(p.name[: -len(".metal")] for p in resources.files("kimi_mlx.metal_kernels").iterdir()
                      if p.name.endswith(".metal"))  # fmt: skip


def test_kernel_files_ship_and_are_registered():
    """The package data holds the kernel files, and importing the ops registers the recurrent and mix kernels."""
    import kimi_mlx.ops.attn_res  # noqa: F401
    import kimi_mlx.ops.kda  # noqa: F401

    assert {"kda_recurrent", "attn_res_mix"} <= set(KERNEL_FILES)
    for name in ("kda_recurrent", "attn_res_mix"):
        assert metal.register(name) == metal.load_kernel_file(name)


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_kernel_file_convention(name):
    """Each file documents grid, threadgroup, inputs and outputs in its comment header; every tagged buffer is used
    by the body, and the header (which would make MLX add parameters for names it mentions) is not in the source."""
    text = resources.files("kimi_mlx.metal_kernels").joinpath(f"{name}.metal").read_text()
    header = "\n".join(ln for ln in text.splitlines() if ln.startswith("//")).lower()
    for word in ("grid", "threadgroup", "inputs", "outputs"):
        assert word in header, f"{name}.metal: header comment does not describe '{word}'"
    kf = metal.load_kernel_file(name)
    for buf in kf.input_names + kf.output_names:
        assert re.search(rf"\b{buf}\b", kf.source + kf.header), f"{name}.metal: buffer {buf!r} unused"
    assert "@inputs" not in kf.source and "@outputs" not in kf.source


def test_parse_helper_header_and_errors():
    kf = metal.parse_kernel_file("t", "// doc\n// @inputs a b\n// @outputs c\ninline float two() { return 2; }\n"
                                 "// @body\nc[0] = a[0] * b[0] * two();\n", "t.metal")  # fmt: skip
    assert (kf.input_names, kf.output_names) == (("a", "b"), ("c",))
    assert kf.header == "inline float two() { return 2; }" and kf.source == "c[0] = a[0] * b[0] * two();\n"
    with pytest.raises(ValueError, match=r"t\.metal: expected exactly one '// @outputs"):
        metal.parse_kernel_file("t", "// @inputs a\nc[0] = a[0];\n", "t.metal")
    with pytest.raises(ValueError, match="not an identifier"):
        metal.parse_kernel_file("t", "// @inputs a-b\n// @outputs c\nc[0] = 1;\n", "t.metal")
    with pytest.raises(ValueError, match="duplicate buffer names"):
        metal.parse_kernel_file("t", "// @inputs a\n// @outputs a\na[0] = 1;\n", "t.metal")
    with pytest.raises(ValueError, match="empty kernel body"):
        metal.parse_kernel_file("t", "// @inputs a\n// @outputs c\n", "t.metal")
    with pytest.raises(FileNotFoundError, match=r"metal_kernels/nope\.metal"):
        metal.load_kernel_file("nope")
    with pytest.raises(KeyError, match="not registered"):
        metal.kernel("nope")


def test_enabled_only_on_a_metal_gpu_without_the_env_switch(monkeypatch):
    gpu, cpu = mx.Device(mx.gpu), mx.Device(mx.cpu)
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: gpu)
    monkeypatch.delenv(metal.ENV_VAR, raising=False)
    assert metal.enabled()
    monkeypatch.setenv(metal.ENV_VAR, "0")
    assert not metal.enabled()
    monkeypatch.setenv(metal.ENV_VAR, "1")
    assert metal.enabled()
    with metal.disabled():
        assert not metal.enabled()
    monkeypatch.setattr(mx, "default_device", lambda: cpu)
    assert not metal.enabled()
    monkeypatch.setattr(mx, "default_device", lambda: gpu)
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    assert not metal.enabled()


def test_emulated_builds_each_kernel_once_and_restores(monkeypatch):
    """Inside emulated(factory) kernels are on and built by the factory once per name; compile is disabled there
    and re-enabled after; disabled() still wins inside."""
    monkeypatch.setenv(metal.ENV_VAR, "0")  # outside the hook: off everywhere, also on a Mac
    metal.register("kda_recurrent")
    built = []

    def factory(**spec):
        built.append(spec)
        return lambda **kw: ("launched", spec["name"])

    calls = []

    @mx.compile
    def traced(x):
        calls.append(1)
        return x + 1

    with metal.emulated(factory):
        assert metal.enabled()
        k1, k2 = metal.kernel("kda_recurrent"), metal.kernel("kda_recurrent")
        assert k1 is k2 and k1() == ("launched", "kimi_kda_recurrent") and len(built) == 1
        assert built[0]["input_names"] == list(metal.load_kernel_file("kda_recurrent").input_names)
        traced(mx.array(1.0))
        traced(mx.array(1.0))
        assert len(calls) == 2, "mx.compile must be disabled inside emulated()"
        with metal.disabled():
            assert metal.kernel("kda_recurrent") is None
    assert metal.kernel("kda_recurrent") is None
    calls.clear()
    traced(mx.array(1.0))
    traced(mx.array(1.0))
    assert len(calls) == 1, "mx.compile must be re-enabled after emulated()"


def test_emulated_nesting_and_keep_compile():
    """keep_compile=True leaves mx.compile on; compile comes back after nested blocks in either order."""
    calls = []

    @mx.compile
    def traced(x):
        calls.append(1)
        return x * 2

    def compiled_now() -> bool:
        calls.clear()
        traced(mx.array([1.0, 2.0, 3.0]))
        traced(mx.array([1.0, 2.0, 3.0]))
        return len(calls) <= 1

    def factory(**spec):
        return spec

    assert compiled_now()
    with metal.emulated(factory, keep_compile=True):
        assert metal.enabled() and compiled_now()
        with metal.emulated(factory):
            assert not compiled_now()
        assert compiled_now()
    with metal.emulated(factory):
        with metal.emulated(factory, keep_compile=True):
            assert not compiled_now()
        assert not compiled_now()
    assert compiled_now()
