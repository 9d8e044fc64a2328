"""K3 with an image, end to end against mlx-vlm 0.7.10: ``load`` on the fixture checkpoint (its vision tower
becomes ``model.image_encoder``), mlx-vlm's chat prompt (its ``input_ids`` with the placeholders) and the fixture's
image files to ``stream_generate(..., images=)``: the first step's log-probabilities within 1e-4 of mlx-vlm's logits
(float32, log-softmaxed), one image and two images in one message, for prefill chunks that cut the images anywhere."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import SHARED

from kimi_mlx import load, stream_generate
from kimi_mlx.image_prompt import ImageRows, PromptImage

ROOT = SHARED / "fixtures" / "k3_vision"
CKPT = ROOT / "k3-vl-tiny"
REF = ROOT / "mlx_vlm"
IMAGES = ROOT / "images"


@pytest.fixture(scope="module")
def k3():
    return load(CKPT, dtype=mx.float32)


def _ids(prompt: str) -> list[int]:
    return np.load(REF / f"{prompt}.chat.input_ids.npy").reshape(-1).tolist()


def _ref_logprobs(prompt: str) -> np.ndarray:
    ref = np.load(REF / f"{prompt}.chat.last_logits.npy").reshape(-1).astype(np.float64)  # [vocab]
    return ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())


def _first_logprobs(k3, prompt: str, images: list, step: int = 2048) -> np.ndarray:
    model, tok = k3
    first = next(iter(stream_generate(model, tok, _ids(prompt), 1, images=images, prefill_step_size=step)))
    return np.array(first.logprobs)


@pytest.mark.parametrize("img", ["img0_rgb_224x168", "img1_rgba_100x300", "img2_palette_150x90", "img3_large_500x380"])
def test_logits_with_an_image_match_mlx_vlm(k3, img):
    ours = _first_logprobs(k3, img, [IMAGES / f"{img}.png"])
    assert np.abs(ours - _ref_logprobs(img)).max() < 1e-4


@pytest.mark.parametrize("step", [2048, 7, 31])
def test_two_images_in_one_message_match_mlx_vlm(k3, step):
    """Chunks of 7 and 31 tokens end inside each image's placeholders: features are taken in order across chunks."""
    images = [IMAGES / "img0_rgb_224x168.png", IMAGES / "img2_palette_150x90.png"]
    ours = _first_logprobs(k3, "two_images", images, step)
    assert np.abs(ours - _ref_logprobs("two_images")).max() < 1e-4


def test_full_logits_through_the_model_call_match_mlx_vlm(k3):
    """``ImageRows.embed`` + ``model(ids, input_embeddings=)``: every position's logits, not only the last."""
    model, _ = k3
    enc = model.image_encoder
    ids = _ids("two_images")
    images = [enc.prepare(IMAGES / "img0_rgb_224x168.png"), enc.prepare(IMAGES / "img2_palette_150x90.png")]
    rows = ImageRows(ids, images, enc.placeholder_id)
    x = mx.array(ids)[None]  # [1, L]
    logits = model(x, input_embeddings=rows.embed(model.embed, x, 0, enc.features))[0]  # [L, vocab]
    assert np.abs(np.array(logits) - np.load(REF / "two_images.chat.logits.npy")).max() < 1e-4


def test_different_images_give_different_logits(k3):
    a = _first_logprobs(k3, "img0_rgb_224x168", [IMAGES / "img0_rgb_224x168.png"])
    b = _first_logprobs(k3, "img0_rgb_224x168", [np.full((168, 224, 3), 200, np.uint8)])  # same grid, other pixels
    assert np.abs(a - b).max() > 1e-2


def test_same_image_is_encoded_once(k3):
    model, _ = k3
    enc = model.image_encoder
    image = np.random.default_rng(3).integers(0, 255, (168, 224, 3), dtype=np.uint8)
    before = enc.encoded
    first = _first_logprobs(k3, "img0_rgb_224x168", [image])
    again = _first_logprobs(k3, "img0_rgb_224x168", [image.copy()])
    assert enc.encoded == before + 1
    assert np.array_equal(first, again)


def test_placeholder_count_must_match_the_images(k3):
    model, tok = k3
    with pytest.raises(ValueError, match="48 image placeholder tokens.*take 24"):
        list(stream_generate(model, tok, _ids("img0_rgb_224x168"), 1, images=[IMAGES / "img2_palette_150x90.png"]))
    with pytest.raises(ValueError, match="48 image placeholder tokens.*take 0"):
        list(stream_generate(model, tok, _ids("img0_rgb_224x168"), 1))
    with pytest.raises(ValueError, match="text prompt"):
        list(stream_generate(model, tok, "hello", 1, images=[IMAGES / "img2_palette_150x90.png"]))


def test_cache_keys_differ_by_image_content():
    a, b = PromptImage("ab" * 16, 2, (28, 28)), PromptImage("cd" * 16, 2, (28, 28))
    tokens = [1, 7, 7, 2]
    ka, kb = ImageRows(tokens, [a], 7).key(tokens), ImageRows(tokens, [b], 7).key(tokens)
    assert ka[0] == kb[0] == 1 and ka[3] == kb[3] == 2
    assert ka[1] == ka[2] == a.key_id < 0 and ka[1] != kb[1]


def test_text_only_models_refuse_images(kl_dir, k3_dir):
    for path, reason in ((kl_dir, "Kimi Linear is a text-only model"), (k3_dir, "has no vision tower")):
        model, tok = load(path / "hf", dtype=mx.float32) if (path / "hf").is_dir() else load(path, dtype=mx.float32)
        assert model.image_encoder is None
        with pytest.raises(ValueError, match=reason):
            list(stream_generate(model, tok, [1, 2, 3], 1, images=[IMAGES / "img0_rgb_224x168.png"]))
