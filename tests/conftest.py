"""Shared test fixtures: paths to ../shared (reference checkpoints and logits) and loaded reference models."""

import json
import os
from pathlib import Path

import mlx.core as mx
import pytest

SHARED = Path(os.environ.get("KIMI_MLX_SHARED", Path(__file__).resolve().parents[2] / "shared"))
KL_FIXTURE = SHARED / "fixtures" / "llamacpp" / "kimi_linear"


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


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """The demo model is written under a per-session temp home, never into the user's cache."""
    monkeypatch.setenv("KIMI_MLX_HOME", str(tmp_path_factory.getbasetemp() / "kimi-mlx-home"))
