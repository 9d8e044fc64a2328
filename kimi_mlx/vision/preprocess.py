"""Kimi-K3 image preprocessing: an image → patches for the vision tower, as Moonshot's processor does it
(``media_utils.py`` / ``KimiK3VisionProcessor.preprocess``; mlx-vlm's ``KimiK3ImageProcessor`` is the same).

    cfg = VisionPreprocessConfig.from_file(ckpt / "preprocessor_config.json")
    inp = preprocess("cat.png", cfg)  # inp.pixel_values [N, 3, P, P], inp.grid_thw (1, h, w), inp.num_tokens

Steps (P = patch_size = 14, (kh, kw) = merge_kernel_size = (2, 2) in K3):
1. size (navit): scale = min(1, sqrt(in_patch_limit / (max(1, W//P)·max(1, H//P))), side_limit·P/W, side_limit·P/H)
   with side_limit = patch_limit_on_one_side; never upscales; new side = max(1, int(side·scale)) (truncated), capped
   at side_limit·P. The limits are checked before padding, so the padded grid may exceed in_patch_limit.
2. transparency (``transparent_bg_config``; K3: chessboard filled ``after_resize``): no config → convert("RGB");
   an RGB image is kept; an image without an alpha band and without ``info["transparency"]`` → convert("RGB");
   else RGBA composited ``uint8(a·rgb + (1−a)·bg)`` (float32, a = alpha/255, truncated) over white / black /
   gray 128 / a chessboard (gray squares where (y//s + x//s) is odd when the top-left square is white).
   ``after_resize``: the image is resized in its own mode (PIL resizes RGBA premultiplied and mode P with NEAREST),
   then composited; ``before_resize``: composited, then resized.
3. resize: PIL BICUBIC to (new_w, new_h); then black padding right/bottom to a multiple of (kw·P, kh·P).
4. normalise: (x/255 − mean) / std per channel (x/255 in float32, the rest in float64, stored float32).
5. patchify: patches row-major over the grid (y, then x); pixel_values[n] is patch n as (C, H, W).

Conventions: sizes are (W, H) as PIL has them; ``grid_thw`` is (t, h, w) in patches with t = 1 for an image;
``num_tokens`` = t·h·w / (kh·kw) is how many ``<|media_pad|>`` placeholders the image takes in the prompt, whose
text says ``image {W}x{H}`` with the ORIGINAL size (``ImageInput.size``).
Not done, as in Moonshot's processor: EXIF orientation (mlx-vlm's generate path applies it), video (t > 1).
Where mlx-vlm differs: it converts a mode-P image to RGBA before the resize (bicubic instead of PIL's NEAREST);
the two agree whenever a palette image is not resized.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import mlx.core as mx
import numpy as np
from PIL import Image, UnidentifiedImageError

from ..config import ConfigError

BG_PATTERNS = ("white", "black", "gray", "chessboard")
FILL_STAGES = ("before_resize", "after_resize")

ImageLike = Union[str, Path, bytes, bytearray, Image.Image, np.ndarray]


def _fail(source: str, key: str, found: Any, expected: str) -> None:
    raise ConfigError(f"{source}: config key '{key}' is {found!r}; expected {expected}")


@dataclass(frozen=True)
class TransparentBg:
    """How transparent pixels are filled (``transparent_bg_config``); defaults are the processor's."""

    pattern: str = "black"
    square_size: int = 16
    square_on_top_left: bool = True
    white_value: int = 255
    gray_value: int = 200


@dataclass(frozen=True)
class VisionPreprocessConfig:
    """``preprocessor_config.json`` (``media_proc_cfg``): the keys the image path reads; video keys are ignored.

    Required: patch_size, in_patch_limit, patch_limit_on_one_side, merge_kernel_size (int or [kh, kw]), image_mean,
    image_std; transparent_bg_fill_stage only when transparent_bg_config is set (missing/null: alpha dropped).
    Errors are ``ConfigError`` naming the file and the key.
    """

    patch_size: int
    in_patch_limit: int
    patch_limit_on_one_side: int
    merge_kernel_size: tuple[int, int]  # (kh, kw)
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    transparent_bg: Optional[TransparentBg] = None  # None: alpha dropped (convert("RGB"))
    transparent_bg_fill_stage: str = "after_resize"

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> "VisionPreprocessConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: cannot read a JSON object ({e})") from e
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "preprocessor_config.json") -> "VisionPreprocessConfig":
        """The released layout nests the keys under ``media_proc_cfg``; a flat dict is read the same way."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, found {type(raw).__name__}")
        prefix = "media_proc_cfg." if "media_proc_cfg" in raw else ""
        d = raw.get("media_proc_cfg", raw)
        if not isinstance(d, dict):
            _fail(source, "media_proc_cfg", d, "an object")

        def positive(name: str) -> int:
            v = d.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(source, prefix + name, v, "an integer >= 1" + (" (missing)" if v is None else ""))
            return v

        def triple(name: str, nonzero: bool) -> tuple[float, float, float]:
            v = d.get(name)
            ok = isinstance(v, list) and len(v) == 3 and all(_is_real(x) and (x != 0 or not nonzero) for x in v)
            if not ok:
                _fail(source, prefix + name, v, "a list of 3 numbers" + (", none zero" if nonzero else ""))
            return tuple(float(x) for x in v)

        merge = d.get("merge_kernel_size")
        merge = [merge, merge] if isinstance(merge, int) and not isinstance(merge, bool) else merge
        if not (isinstance(merge, list) and len(merge) == 2
                and all(isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in merge)):
            _fail(source, prefix + "merge_kernel_size", d.get("merge_kernel_size"), "an integer >= 1 or [kh, kw]")
        bg = _parse_bg(d.get("transparent_bg_config"), source, prefix + "transparent_bg_config")
        stage = d.get("transparent_bg_fill_stage")
        if bg is not None and stage not in FILL_STAGES:
            _fail(source, prefix + "transparent_bg_fill_stage", stage, f"one of {FILL_STAGES}")
        return cls(
            patch_size=positive("patch_size"),
            in_patch_limit=positive("in_patch_limit"),
            patch_limit_on_one_side=positive("patch_limit_on_one_side"),
            merge_kernel_size=(merge[0], merge[1]),
            image_mean=triple("image_mean", nonzero=False),
            image_std=triple("image_std", nonzero=True),
            transparent_bg=bg,
            transparent_bg_fill_stage=stage if bg is not None else "after_resize",
        )


    def to_hf(self) -> dict:
        """``preprocessor_config.json`` content (``media_proc_cfg``, released layout) that ``from_dict`` reads back."""
        bg = self.transparent_bg
        cfg = {
            "patch_size": self.patch_size, "in_patch_limit": self.in_patch_limit,
            "patch_limit_on_one_side": self.patch_limit_on_one_side, "merge_kernel_size": list(self.merge_kernel_size),
            "image_mean": list(self.image_mean), "image_std": list(self.image_std),
            "transparent_bg_config": None if bg is None else {
                "pattern": bg.pattern, "chessboard_square_size": bg.square_size,
                "chessboard_square_on_top_left": bg.square_on_top_left, "chessboard_white_value": bg.white_value,
                "chessboard_gray_value": bg.gray_value},
            "transparent_bg_fill_stage": self.transparent_bg_fill_stage,
        }
        return {"media_proc_cfg": cfg}


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _parse_bg(cfg, source: str, key: str) -> Optional[TransparentBg]:
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        _fail(source, key, cfg, "an object or null")
    d = TransparentBg()
    pattern = cfg.get("pattern", d.pattern)
    if pattern not in BG_PATTERNS:
        _fail(source, key + ".pattern", pattern, f"one of {BG_PATTERNS}")
    square = cfg.get("chessboard_square_size", d.square_size)
    if not isinstance(square, int) or isinstance(square, bool) or square < 1:
        _fail(source, key + ".chessboard_square_size", square, "an integer >= 1")
    top_left = cfg.get("chessboard_square_on_top_left", d.square_on_top_left)
    if not isinstance(top_left, bool):
        _fail(source, key + ".chessboard_square_on_top_left", top_left, "true or false")
    values = {}
    for name, default in (("chessboard_white_value", d.white_value), ("chessboard_gray_value", d.gray_value)):
        v = cfg.get(name, default)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 255:
            _fail(source, f"{key}.{name}", v, "an integer in [0, 255]")
        values[name] = v
    return TransparentBg(pattern, square, top_left, values["chessboard_white_value"], values["chessboard_gray_value"])


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image, ready for the tower and the prompt."""

    pixel_values: mx.array  # [N, 3, P, P] float32, N = h·w patches, row-major (y, then x)
    grid_thw: tuple[int, int, int]  # (t=1, h, w) in patches, h and w multiples of (kh, kw)
    num_tokens: int  # t·h·w / (kh·kw): <|media_pad|> placeholders in the prompt
    size: tuple[int, int]  # (W, H) of the original image: the prompt's "image WxH"


def load_image(x: ImageLike) -> Image.Image:
    """A path, encoded bytes, a PIL image or a uint8 array [H, W, 3|4] → a fully decoded PIL image (mode kept).
    Several frames (an animation, a multi-page file) are refused: K3 here reads still images only."""
    if isinstance(x, Image.Image):
        _one_frame(x, "PIL image")
        try:
            x.load()  # an opened, not yet decoded file: a truncated one fails here
        except (OSError, SyntaxError, ValueError) as e:
            raise ValueError(f"PIL image is not readable ({type(e).__name__}: {e})") from e
        return x
    if isinstance(x, np.ndarray):
        if x.ndim != 3 or x.shape[2] not in (3, 4) or x.shape[0] < 1 or x.shape[1] < 1:
            raise ValueError(f"image array has shape {x.shape}; expected [H, W, 3] (RGB) or [H, W, 4] (RGBA)")
        if x.dtype != np.uint8:
            raise ValueError(f"image array has dtype {x.dtype}; expected uint8 (values 0..255)")
        return Image.fromarray(np.ascontiguousarray(x))  # [H, W, 3] → RGB, [H, W, 4] → RGBA
    if isinstance(x, (bytes, bytearray)):
        return _decode(io.BytesIO(bytes(x)), f"image bytes ({len(x)} bytes)")
    if isinstance(x, (str, Path)):
        if not Path(x).is_file():
            raise ValueError(f"image file {str(x)!r} does not exist or is not a file")
        return _decode(x, f"image file {str(x)!r}")
    raise ValueError(f"cannot read an image from {type(x).__name__}; expected a path, bytes, a PIL image or a "
                     "uint8 array [H, W, 3|4]")


def _decode(src, what: str) -> Image.Image:
    try:
        with Image.open(src) as im:
            frames = getattr(im, "n_frames", 1)
            im.load()  # decode now: a truncated file fails here, not later in resize
            image = im.copy()  # detached from the file, info (e.g. "transparency") kept
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{what} is not a readable image ({type(e).__name__}: {e})") from e
    _one_frame(frames, what)
    return image


def _one_frame(image: Image.Image | int, what: str) -> None:
    """ValueError when ``image`` (or a frame count) has several frames: an animation or a multi-page file."""
    frames = image if isinstance(image, int) else getattr(image, "n_frames", 1)
    if frames > 1:
        raise ValueError(f"{what} has {frames} frames (an animation or a multi-page file); give one still image")


def target_size(width: int, height: int, cfg: VisionPreprocessConfig) -> tuple[int, int, int, int]:
    """(new_w, new_h, pad_w, pad_h): the navit resize (never up) and the right/bottom padding to kw·P, kh·P."""
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    s1 = math.sqrt(cfg.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
    scale = min(1.0, s1, side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    fh, fw = cfg.merge_kernel_size[0] * p, cfg.merge_kernel_size[1] * p
    return new_w, new_h, (fw - new_w % fw) % fw, (fh - new_h % fh) % fh


def fill_transparent(image: Image.Image, bg: Optional[TransparentBg]) -> Image.Image:
    """→ RGB: transparent pixels composited over the configured background (None: alpha dropped)."""
    if bg is None:
        return image.convert("RGB")
    if image.mode == "RGB":
        return image
    if "A" not in image.getbands() and "transparency" not in image.info:
        return image.convert("RGB")
    rgba = np.asarray(image.convert("RGBA"))  # [H, W, 4] uint8
    alpha = rgba[:, :, 3:4].astype(np.float32) / 255.0  # [H, W, 1]
    out = alpha * rgba[:, :, :3] + (1 - alpha) * _background(rgba.shape[0], rgba.shape[1], bg)  # [H, W, 3] f32
    return Image.fromarray(out.astype(np.uint8))  # RGB


def _background(h: int, w: int, bg: TransparentBg) -> np.ndarray:
    """[H, W, 3] uint8."""
    if bg.pattern != "chessboard":
        return np.full((h, w, 3), {"white": 255, "black": 0, "gray": 128}[bg.pattern], dtype=np.uint8)
    s = bg.square_size
    odd = (np.arange(h)[:, None] // s + np.arange(w)[None, :] // s) % 2  # [H, W]
    gray = odd == (1 if bg.square_on_top_left else 0)
    out = np.where(gray, bg.gray_value, bg.white_value).astype(np.uint8)
    return np.repeat(out[:, :, None], 3, axis=2)


def resize_and_pad(image: Image.Image, cfg: VisionPreprocessConfig) -> Image.Image:
    """The image as the tower sees it: resized, background filled, padded black right/bottom (RGB)."""
    new_w, new_h, pad_w, pad_h = target_size(image.width, image.height, cfg)
    if cfg.transparent_bg_fill_stage == "before_resize":
        image = fill_transparent(image, cfg.transparent_bg)
    image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)  # mode P: PIL uses NEAREST
    image = fill_transparent(image, cfg.transparent_bg)
    if pad_w or pad_h:
        padded = Image.new("RGB", (new_w + pad_w, new_h + pad_h), (0, 0, 0))
        padded.paste(image, (0, 0))
        image = padded
    return image


def patchify(image: Image.Image, cfg: VisionPreprocessConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """RGB image (sides multiples of P) → (pixel_values [N, 3, P, P] float32, (1, h, w))."""
    p = cfg.patch_size
    w, h = image.size
    gh, gw = h // p, w // p
    x = np.asarray(image, dtype=np.float32) / 255.0  # [H, W, 3]
    x = ((x - np.array(cfg.image_mean)) / np.array(cfg.image_std)).astype(np.float32)  # float64 math, as reference
    x = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)  # [N, 3, P, P]
    return np.ascontiguousarray(x), (1, gh, gw)


def preprocess(image: ImageLike, cfg: VisionPreprocessConfig) -> ImageInput:
    """One image (anything ``load_image`` takes) → ``ImageInput`` for the tower and the prompt."""
    image = load_image(image)
    size = image.size
    pixels, grid = patchify(resize_and_pad(image, cfg), cfg)
    kh, kw = cfg.merge_kernel_size
    return ImageInput(mx.array(pixels), grid, grid[0] * grid[1] * grid[2] // (kh * kw), size)
