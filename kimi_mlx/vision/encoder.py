"""The model's eyes: an image in (a path, bytes, a PIL image or an array), prompt rows out.

``ImageEncoder.prepare`` preprocesses an image (``preprocess``) into a ``PromptImage`` (digest of the preprocessed
pixels and grid, placeholder count, original size, the pixels). ``ImageEncoder.features`` runs the tower and
projector on one image (in the text model's dtype) and keeps the result by digest within ``cache_bytes``, least
recently used out first, so an image re-sent is not encoded again. A loaded model with a vision tower carries one as
``model.image_encoder`` (a plain attribute, outside the model's parameter tree).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Optional

import mlx.core as mx
import numpy as np

from ..image_prompt import PromptImage
from .config import VisionConfig
from .model import VisionModel
from .preprocess import ImageLike, VisionPreprocessConfig, preprocess

DEFAULT_CACHE_BYTES = 256 << 20


def prepare_image(image: ImageLike | PromptImage, cfg: VisionPreprocessConfig) -> PromptImage:
    """One image -> ``PromptImage``: preprocessed with ``cfg``, its digest that of the pixels [N, 3, P, P] (float32)
    and ``grid_thw`` (a ``PromptImage`` is returned as is). Needs no tower: every rank of a distributed model runs it.
    ValueError for an unreadable image."""
    if isinstance(image, PromptImage):
        return image
    pixels = preprocess(image, cfg)
    values = np.asarray(pixels.pixel_values)  # [N, 3, P, P] float32
    digest = hashlib.blake2b(values.tobytes(), digest_size=16)
    digest.update(repr(pixels.grid_thw).encode())
    return PromptImage(digest.hexdigest(), pixels.num_tokens, pixels.size, pixels)


class ImageEncoder:
    """vision: the tower + projector, or None on a rank that does not hold them (then ``cfg`` gives their config
    and ``features`` serves only what another part of the program put in the cache); preprocess: the checkpoint's
    preprocessing; placeholder_id: the token that holds an image row in a prompt (``<|media_pad|>``); dtype: the
    tower's compute dtype (the text model's); source: where the tower was read from (for messages). ``encoded``
    counts tower runs (cache misses)."""

    def __init__(self, vision: Optional[VisionModel], preprocess: VisionPreprocessConfig, placeholder_id: int,
                 dtype: mx.Dtype = mx.float32, source: str = "", cache_bytes: int = DEFAULT_CACHE_BYTES,
                 cfg: Optional[VisionConfig] = None):
        if vision is None and cfg is None:
            raise ValueError("ImageEncoder: give the vision model, or its config on a rank that does not hold it")
        self.cfg = vision.cfg if vision is not None else cfg
        self.vision, self.preprocess, self.placeholder_id = vision, preprocess, placeholder_id
        self.dtype, self.source, self.cache_bytes = dtype, source, cache_bytes
        self._cache: OrderedDict[str, mx.array] = OrderedDict()
        self.encoded = 0

    @property
    def hidden_size(self) -> int:
        return self.cfg.text_hidden_size

    @property
    def nbytes(self) -> int:
        """Bytes of the tower's and projector's weights held here (0 without them)."""
        from mlx.utils import tree_flatten

        if self.vision is None:
            return 0
        return sum(v.nbytes for _, v in tree_flatten(self.vision.parameters()))

    def prepare(self, image: ImageLike | PromptImage) -> PromptImage:
        """One image -> ``PromptImage`` (a ``PromptImage`` is returned as is). ValueError for an unreadable image."""
        return prepare_image(image, self.preprocess)

    def features(self, image: PromptImage) -> mx.array:
        """The image's features [num_tokens, hidden] (evaluated), from the cache or the tower."""
        hit = self._cache.get(image.digest)
        if hit is not None:
            self._cache.move_to_end(image.digest)
            return hit
        if self.vision is None:
            raise ValueError(f"image {image.digest}: this process holds no vision tower ({self.source}); its "
                             "features come from the rank that does")
        if image.pixels is None:
            raise ValueError(f"image {image.digest}: not in the feature cache and its pixels are not here")
        px = image.pixels
        out = self.vision(px.pixel_values.astype(self.dtype), px.grid_thw)  # [n, hidden]
        if out.shape[0] != image.num_tokens:
            raise ValueError(f"image {image.digest}: the tower gave {out.shape[0]} rows; the prompt holds "
                             f"{image.num_tokens} placeholders")
        mx.eval(out)
        self.encoded += 1
        self._keep(image.digest, out)
        return out

    @property
    def cached_bytes(self) -> int:
        return sum(v.nbytes for v in self._cache.values())

    def _keep(self, digest: str, features: mx.array) -> None:
        self._cache[digest] = features
        while len(self._cache) > 1 and self.cached_bytes > self.cache_bytes:
            self._cache.popitem(last=False)

