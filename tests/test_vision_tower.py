"""K3 vision tower + projector against mlx-vlm's float32 outputs on the k3_vision fixture (all four images, fed
mlx-vlm's own pixel_values and grid_thw), and strict weight loading."""

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import SHARED
from kimi_mlx.config import ConfigError
from kimi_mlx.vision.config import VisionConfig
from kimi_mlx.vision.model import VisionModel, load_vision, load_vision_weights

VISION = SHARED / "fixtures" / "k3_vision"
HF = VISION / "k3-vl-tiny"
REF = VISION / "mlx_vlm"
IMAGES = ["img0_rgb_224x168", "img1_rgba_100x300", "img2_palette_150x90", "img3_large_500x380"]
TOL = 1e-5


@pytest.fixture(scope="module")
def vision():
    assert (HF / "config.json").exists(), f"k3_vision fixture missing at {VISION}"
    return load_vision(HF, dtype=mx.float32)


@pytest.mark.parametrize("img", IMAGES)
def test_stages_match_mlx_vlm(vision, img):
    pv = mx.array(np.load(REF / f"{img}.pixel_values.npy"))  # [N, 3, 14, 14]
    grid = np.load(REF / f"{img}.grid_thw.npy")  # [1, 3]
    tower = vision.vision_tower
    embed = tower.embed(pv, grid)  # [N, D]
    enc = tower.encode(pv, grid)  # [N, D]
    merged = tower.merge(enc, grid)  # [N/4, 4, D]
    feats = vision.mm_projector(merged)  # [N/4, T]
    full = vision(pv, grid)
    for name, got in [("embed", embed), ("encoder_out", enc), ("vision_tower", merged), ("image_features", feats)]:
        ref = np.load(REF / f"{img}.{name}.npy")
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        diff = float(np.abs(np.array(got) - ref).max())
        assert diff <= TOL, f"{img} {name}: max |diff| {diff:.3g} > {TOL}"
    assert np.array_equal(np.array(full), np.array(feats))
    assert feats.shape == (pv.shape[0] // 4, 256)


@pytest.mark.parametrize("img", ["img3_large_500x380", "img1_rgba_100x300"])
def test_attention_in_query_blocks_matches_mlx_vlm(vision, img, monkeypatch):
    """Scores capped below two query rows: the queries go one row per call, and the encoder output stays within 1e-5
    of mlx-vlm's (which attends in one call)."""
    import kimi_mlx.vision.tower as tower_module

    pv = mx.array(np.load(REF / f"{img}.pixel_values.npy"))
    grid = np.load(REF / f"{img}.grid_thw.npy")
    n, heads = pv.shape[0], vision.cfg.num_heads
    monkeypatch.setattr(tower_module, "ATTENTION_SCORE_BYTES", heads * n * 4 * 2 - 1)  # blocks of one query row
    calls = []
    real = mx.fast.scaled_dot_product_attention
    counted = lambda q, *a, **k: calls.append(q.shape[2]) or real(q, *a, **k)  # noqa: E731
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counted)
    enc = vision.vision_tower.encode(pv, grid)
    assert set(calls) == {1} and len(calls) == n * vision.cfg.num_layers
    diff = float(np.abs(np.array(enc) - np.load(REF / f"{img}.encoder_out.npy")).max())
    assert diff <= TOL, f"{img}: max |diff| {diff:.3g} > {TOL}"


def _hf_vision_weights():
    return {k: v for k, v in mx.load(str(HF / "model.safetensors")).items()
            if k.startswith(("vision_tower.", "mm_projector."))}


def _fresh():
    return VisionModel(VisionConfig.from_hf(json.loads((HF / "config.json").read_text())))


def test_strict_loading_names_the_tensor():
    weights = _hf_vision_weights()
    assert len(weights) == 24

    missing = dict(weights)
    del missing["vision_tower.encoder.blocks.1.wo.weight"]
    with pytest.raises(ValueError, match=r"missing tensor vision_tower\.encoder\.blocks\.1\.wo\.weight"):
        load_vision_weights(_fresh(), missing)

    misshaped = dict(weights)
    misshaped["mm_projector.proj.2.weight"] = mx.zeros((255, 192))
    with pytest.raises(ValueError, match=r"tensor mm_projector\.proj\.2\.weight has shape \(255, 192\)"):
        load_vision_weights(_fresh(), misshaped)

    extra = dict(weights)
    extra["vision_tower.encoder.blocks.3.wo.weight"] = mx.zeros((48, 96))
    with pytest.raises(ValueError, match=r"unexpected tensor vision_tower\.encoder\.blocks\.3\.wo\.weight"):
        load_vision_weights(_fresh(), extra)

    load_vision_weights(_fresh(), weights)  # the checkpoint as is loads


def test_config_errors_name_the_key():
    raw = json.loads((HF / "config.json").read_text())
    cfg = VisionConfig.from_hf(raw)
    assert (cfg.hidden_size, cfg.num_layers, cfg.head_dim, cfg.merged_size, cfg.text_hidden_size) == (48, 3, 24, 192, 256)
    assert cfg.tower_norm_eps == 2.0**-7 and cfg.projector_ln_eps == 1e-5
    vc = dict(raw["vision_config"])
    del vc["qkv_hidden_size"]
    with pytest.raises(ConfigError, match=r"vision_config\.qkv_hidden_size' is missing"):
        VisionConfig.from_hf({"vision_config": vc})
    vc = dict(raw["vision_config"], mm_projector_type="patchmerger")
    with pytest.raises(ConfigError, match=r"vision_config\.mm_projector_type"):
        VisionConfig.from_hf({"vision_config": vc})


def test_grid_must_match_pixels(vision):
    pv = mx.array(np.load(REF / f"{IMAGES[0]}.pixel_values.npy"))
    with pytest.raises(ValueError, match="grid_thw"):
        vision(pv, (1, 12, 14))
