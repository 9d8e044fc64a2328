"""K3 image preprocessing against mlx-vlm 0.7.10 (= a transcription of Moonshot's processor) on the four fixture
images: pixel_values bit-exact, grid_thw and placeholder counts equal; input forms, limits and clear errors."""

import io
import json

import numpy as np
import pytest
from conftest import SHARED
from PIL import Image

from kimi_mlx.config import ConfigError
from kimi_mlx.vision.preprocess import (
    VisionPreprocessConfig,
    load_image,
    preprocess,
    resize_and_pad,
    target_size,
)

K3V = SHARED / "fixtures" / "k3_vision"
IMAGES = {  # name -> (placeholder tokens, original (W, H)), README
    "img0_rgb_224x168": (48, (224, 168)),
    "img1_rgba_100x300": (44, (100, 300)),
    "img2_palette_150x90": (24, (150, 90)),
    "img3_large_500x380": (108, (500, 380)),
}


@pytest.fixture(scope="module")
def cfg() -> VisionPreprocessConfig:
    path = K3V / "k3-vl-tiny" / "preprocessor_config.json"
    assert path.exists(), f"reference fixtures missing at {K3V}"
    return VisionPreprocessConfig.from_file(path)


def test_config_reads_released_layout(cfg):
    assert (cfg.patch_size, cfg.in_patch_limit, cfg.patch_limit_on_one_side) == (14, 400, 24)
    assert cfg.merge_kernel_size == (2, 2) and cfg.image_mean == (0.5,) * 3 and cfg.image_std == (0.5,) * 3
    bg = cfg.transparent_bg
    assert (bg.pattern, bg.square_size, bg.square_on_top_left, bg.white_value, bg.gray_value) == (
        "chessboard", 8, True, 255, 180)
    assert cfg.transparent_bg_fill_stage == "after_resize"


@pytest.mark.parametrize("name", IMAGES)
def test_matches_reference(cfg, name):
    out = preprocess(K3V / "images" / f"{name}.png", cfg)
    ref = np.load(K3V / "mlx_vlm" / f"{name}.pixel_values.npy")
    pv = np.array(out.pixel_values)
    assert pv.dtype == np.float32 and pv.shape == ref.shape
    assert np.array_equal(pv, ref)  # bit-exact
    assert out.grid_thw == tuple(np.load(K3V / "mlx_vlm" / f"{name}.grid_thw.npy").reshape(-1).tolist())
    assert (out.num_tokens, out.size) == IMAGES[name]
    assert pv.shape[0] == out.grid_thw[1] * out.grid_thw[2] == 4 * out.num_tokens


@pytest.mark.parametrize("name", IMAGES)
def test_resized_image_matches_reference(cfg, name):
    mine = resize_and_pad(load_image(K3V / "images" / f"{name}.png"), cfg)
    ref = Image.open(K3V / "mlx_vlm" / f"{name}.resized.png")
    assert mine.mode == "RGB" and mine.size == ref.size
    assert np.array_equal(np.asarray(mine), np.asarray(ref.convert("RGB")))


@pytest.mark.parametrize("name", ["img0_rgb_224x168", "img1_rgba_100x300"])
def test_input_forms_agree(cfg, name):
    path = K3V / "images" / f"{name}.png"
    want = np.array(preprocess(path, cfg).pixel_values)
    pil = Image.open(path)
    for x in (str(path), path.read_bytes(), pil, np.asarray(pil)):
        assert np.array_equal(np.array(preprocess(x, cfg).pixel_values), want), type(x)


def test_never_upscales_and_pads(cfg):
    assert target_size(20, 10, cfg) == (20, 10, 8, 18)
    out = preprocess(np.full((10, 20, 3), 255, np.uint8), cfg)
    assert out.grid_thw == (1, 2, 2) and out.num_tokens == 1 and out.size == (20, 10)
    pv = np.array(out.pixel_values)  # image top-left is white (+1), the padding black (-1)
    assert (pv[0, :, :10, :14] == 1).all() and (pv[0, :, 10:, :] == -1).all() and (pv[1, :, :, 6:] == -1).all()


def test_one_side_limit(cfg):
    assert target_size(1000, 20, cfg)[:2] == (336, 6)  # 24 patches on the long side
    assert target_size(500, 380, cfg) == (325, 247, 11, 5)  # total limit (img3)


def test_transparent_filled_with_chessboard_after_resize(cfg):
    clear = np.zeros((56, 56, 4), np.uint8)
    clear[..., :3] = 77  # colour under alpha 0 must not show
    rgb = np.asarray(resize_and_pad(load_image(clear), cfg))
    yy, xx = np.mgrid[:56, :56]
    want = np.where(((yy // 8 + xx // 8) % 2 == 1), 180, 255)
    assert np.array_equal(rgb, np.repeat(want[..., None], 3, axis=2))


def test_palette_transparency_resized(cfg):
    pal = Image.new("P", (700, 28), 1)  # over the one-side limit: resized, NEAREST for mode P
    pal.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    pal.info["transparency"] = 0
    pal.paste(0, (0, 0, 350, 28))
    rgb = np.asarray(resize_and_pad(pal, cfg))
    assert target_size(700, 28, cfg) == (336, 13, 0, 15) and rgb.shape == (28, 336, 3)
    assert set(np.unique(rgb[:13, :160])) == {180, 255} and (rgb[:13, 180:] == [10, 200, 30]).all()
    assert (rgb[13:] == 0).all()


def truncated_big(tmp_path):
    """A PNG whose header reads but whose pixel data stops half way."""
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    path = tmp_path / "half.png"
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    return path


def test_bad_images_give_clear_errors(cfg, tmp_path):
    png = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(png, "PNG")
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(png.getvalue()[:60])
    cases = [
        (truncated, "not a readable image"),
        (truncated_big(tmp_path), "not a readable image"),
        (b"not an image at all", "not a readable image"),
        (tmp_path / "missing.png", "does not exist"),
        (np.zeros((8, 8), np.uint8), "expected [H, W, 3]"),
        (np.zeros((8, 8, 2), np.uint8), "expected [H, W, 3]"),
        (np.zeros((8, 8, 3), np.float32), "dtype float32; expected uint8"),
        (12, "cannot read an image from int"),
    ]
    with Image.open(truncated_big(tmp_path)) as opened, pytest.raises(ValueError, match="PIL image is not readable"):
        preprocess(opened, cfg)
    for x, msg in cases:
        with pytest.raises(ValueError) as e:
            preprocess(x, cfg)
        assert msg in str(e.value), (x, str(e.value))


def test_config_errors_name_file_and_key(tmp_path):
    raw = json.loads((K3V / "k3-vl-tiny" / "preprocessor_config.json").read_text())
    bad = [
        ("in_patch_limit", None, "media_proc_cfg.in_patch_limit"),
        ("merge_kernel_size", [2], "media_proc_cfg.merge_kernel_size"),
        ("image_std", [0.5, 0, 0.5], "media_proc_cfg.image_std"),
        ("transparent_bg_fill_stage", "sometime", "media_proc_cfg.transparent_bg_fill_stage"),
    ]
    for key, value, named in bad:
        d = json.loads(json.dumps(raw))
        d["media_proc_cfg"][key] = value
        path = tmp_path / "preprocessor_config.json"
        path.write_text(json.dumps(d))
        with pytest.raises(ConfigError) as e:
            VisionPreprocessConfig.from_file(path)
        assert str(path) in str(e.value) and f"'{named}'" in str(e.value)
    d = json.loads(json.dumps(raw))
    d["media_proc_cfg"]["transparent_bg_config"]["pattern"] = "plaid"
    with pytest.raises(ConfigError, match="transparent_bg_config.pattern"):
        VisionPreprocessConfig.from_dict(d)
    d["media_proc_cfg"]["transparent_bg_config"] = None  # no background config: alpha dropped
    assert VisionPreprocessConfig.from_dict(d).transparent_bg is None
