"""Shared test fixtures: paths to ../shared (reference checkpoints and logits) and loaded reference models."""

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

SHARED = Path(os.environ.get("KIMI_MLX_SHARED", Path(__file__).resolve().parents[2] / "shared"))
FIXTURES = SHARED / "fixtures" / "llamacpp"
KL_FIXTURE = FIXTURES / "kimi_linear"
K3_FIXTURE = FIXTURES / "kimi_k3"


@pytest.fixture(scope="session")
def kl_dir() -> Path:
    """The tiny Kimi Linear reference checkpoint (Moonshot key layout) made with transformers."""
    assert (KL_FIXTURE / "hf" / "config.json").exists(), f"reference fixtures missing at {KL_FIXTURE}"
    return KL_FIXTURE


@pytest.fixture(scope="session")
def kl_manifest(kl_dir) -> dict:
    return json.loads((kl_dir / "manifest.json").read_text())


@pytest.fixture(scope="session")
def kl_model(kl_dir):
    """The reference checkpoint loaded in float32 by kimi-mlx."""
    from kimi_mlx.loading import load_model

    model, _ = load_model(kl_dir / "hf", dtype=mx.float32)
    return model


@pytest.fixture(scope="session")
def k3_dir() -> Path:
    """The tiny Kimi-K3 reference checkpoint (official K3 key layout, with dummy vision tensors)."""
    assert (K3_FIXTURE / "hf" / "config.json").exists(), f"reference fixtures missing at {K3_FIXTURE}"
    return K3_FIXTURE


@pytest.fixture(scope="session")
def k3_model(k3_dir):
    """The K3 reference checkpoint loaded in float32 by kimi-mlx."""
    from kimi_mlx.loading import load_model

    model, _ = load_model(k3_dir / "hf", dtype=mx.float32)
    return model


@pytest.fixture(scope="session", params=["kimi_linear", "kimi_k3"])
def arch(request, kl_dir, k3_dir) -> tuple[str, Path, dict, object]:
    """(name, fixture dir, manifest, float32 model) for each architecture."""
    name = request.param
    path = kl_dir if name == "kimi_linear" else k3_dir
    model = request.getfixturevalue("kl_model" if name == "kimi_linear" else "k3_model")
    return name, path, json.loads((path / "manifest.json").read_text()), model


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """The demo model is written under a per-session temp home, never into the user's cache."""
    monkeypatch.setenv("KIMI_MLX_HOME", str(tmp_path_factory.getbasetemp() / "kimi-mlx-home"))


def _writable_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


@pytest.fixture
def kl_copy(kl_dir, tmp_path) -> Path:
    """A writable copy of the Kimi Linear reference checkpoint directory."""
    return _writable_copy(kl_dir / "hf", tmp_path / "hf")


@pytest.fixture
def k3_copy(k3_dir, tmp_path) -> Path:
    """A writable copy of the Kimi-K3 reference checkpoint directory."""
    return _writable_copy(k3_dir / "hf", tmp_path / "hf")


def edit_checkpoint(path: Path, weights=None, config=None) -> None:
    """Apply ``weights(dict)`` to model.safetensors and/or ``config(dict)`` to config.json, in place."""
    if weights is not None:
        w = dict(mx.load(str(path / "model.safetensors")))
        weights(w)
        mx.save_safetensors(str(path / "model.safetensors"), w)
    if config is not None:
        c = json.loads((path / "config.json").read_text())
        config(c)
        (path / "config.json").write_text(json.dumps(c))


def mlx_lm_quantized(src: Path, dst: Path):
    """Convert ``src`` with mlx-lm and 4-bit quantize it (group 32, its own predicate) into ``dst``; returns mlx-lm's
    model of ``dst`` with its float weights in float32 (the reference for our loader of that directory)."""
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    ref, config = load_model(src)
    ref, config = quantize_model(ref, config, 32, 4, quant_predicate=ref.quant_predicate)
    save_model(dst, ref)
    save_config(config, dst / "config.json")
    ref, _ = load_model(dst)
    ref.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a, ref.parameters()))
    return ref
