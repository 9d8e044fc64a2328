"""K3 with an image, end to end against mlx-vlm 0.7.10: our preprocessing, tower and projector on the fixture image
files, the features merged into mlx-vlm's chat prompt (its ``input_ids`` with the placeholders), then the text model
with those ``input_embeddings``: logits within 1e-4 of mlx-vlm's (float32), one image and two images in one message."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import SHARED

from kimi_mlx.loading import load_model
from kimi_mlx.vision.merge import merge_image_features
from kimi_mlx.vision.model import load_vision
from kimi_mlx.vision.preprocess import VisionPreprocessConfig, preprocess

ROOT = SHARED / "fixtures" / "k3_vision"
CKPT = ROOT / "k3-vl-tiny"
REF = ROOT / "mlx_vlm"


@pytest.fixture(scope="module")
def parts():
    model, _ = load_model(CKPT, dtype=mx.float32)
    vision = load_vision(CKPT, dtype=mx.float32)
    cfg = VisionPreprocessConfig.from_file(CKPT / "preprocessor_config.json")
    placeholder = json.loads((CKPT / "config.json").read_text())["media_placeholder_token_id"]
    return model, vision, cfg, placeholder


def _logits(parts, prompt: str, images: list[str]) -> tuple[np.ndarray, np.ndarray]:
    model, vision, cfg, placeholder = parts
    ids = mx.array(np.load(REF / f"{prompt}.chat.input_ids.npy").reshape(1, -1).astype(np.int32))  # [1, L]
    feats = []
    for name in images:
        image = preprocess(ROOT / "images" / f"{name}.png", cfg)
        feats.append(vision(image.pixel_values, image.grid_thw))  # [n, hidden]
    embed = model.language_model.model.embed_tokens
    h = merge_image_features(ids, embed, feats, placeholder)  # [1, L, hidden]
    logits = model(ids, input_embeddings=h)  # [1, L, vocab]
    return np.array(logits[0].astype(mx.float32)), np.load(REF / f"{prompt}.chat.logits.npy")


@pytest.mark.parametrize("img", ["img0_rgb_224x168", "img1_rgba_100x300", "img2_palette_150x90", "img3_large_500x380"])
def test_logits_with_an_image_match_mlx_vlm(parts, img):
    ours, ref = _logits(parts, img, [img])
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() < 1e-4


def test_two_images_in_one_message_match_mlx_vlm(parts):
    ours, ref = _logits(parts, "two_images", ["img0_rgb_224x168", "img2_palette_150x90"])
    assert np.abs(ours - ref).max() < 1e-4


def test_different_images_give_different_logits(parts):
    a, _ = _logits(parts, "img0_rgb_224x168", ["img0_rgb_224x168"])
    model, vision, cfg, placeholder = parts
    ids = mx.array(np.load(REF / "img0_rgb_224x168.chat.input_ids.npy").reshape(1, -1).astype(np.int32))
    other = preprocess(np.full((168, 224, 3), 200, np.uint8), cfg)  # same grid, other pixels
    h = merge_image_features(ids, model.language_model.model.embed_tokens,
                             [vision(other.pixel_values, other.grid_thw)], placeholder)
    b = np.array(model(ids, input_embeddings=h)[0])
    assert np.abs(a[-1] - b[-1]).max() > 1e-2


def test_placeholder_count_must_match_the_features(parts):
    model, vision, cfg, placeholder = parts
    ids = mx.array(np.load(REF / "img0_rgb_224x168.chat.input_ids.npy").reshape(1, -1).astype(np.int32))
    with pytest.raises(ValueError, match="48 image placeholder tokens.*24 feature rows"):
        merge_image_features(ids, model.language_model.model.embed_tokens, [mx.zeros((24, 256))], placeholder)
