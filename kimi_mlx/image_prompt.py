"""Images inside a prompt: which positions each image's features fill, the prompt as a cache key, and a prefill
chunk's embeddings with the features in place.

An image enters a prompt as n placeholder tokens (K3's ``<|media_pad|>``; the chat format writes the text around
them). ``PromptImage`` is one image as a prompt knows it: a digest of its preprocessed pixels, its n, its original
size, and (where the vision tower runs) the preprocessed pixels. ``ImageRows`` lines a prompt's placeholders up with
its images: the k-th placeholder of the prompt is row k of the images' features concatenated in prompt order.

Prefill may cut an image's placeholders anywhere: ``ImageRows.embed`` takes a chunk of ids at absolute position
``start`` and fills the rows of the images it overlaps, asking ``features(image)`` (the model's ``ImageEncoder``,
which caches by digest) only for those images. ``ImagePrefill`` wraps a model so that a token loop that calls
``model(ids, cache=...)`` chunk after chunk (mlx-lm's ``generate_step``) gets the images.

Cache keys: a prompt cache keyed by token ids alone would give two different images the same entry. ``key``
replaces each placeholder with a negative id derived from its image's digest (never a vocabulary id), so stored
prefixes of different images part at their first placeholder and the same image re-sent matches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import numpy as np

Features = Callable[["PromptImage"], mx.array]  # image -> its features [num_tokens, hidden]


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt. digest: hex digest of the preprocessed pixels and grid (equal pixels, equal digest);
    num_tokens: its placeholders; size: (W, H) of the original image (the chat format writes "image WxH");
    pixels: the preprocessed image (``vision.preprocess.ImageInput``) where the tower runs, None where it does not
    (the ranks of a distributed model other than rank 0, a request read from JSON)."""

    digest: str
    num_tokens: int
    size: tuple[int, int]
    pixels: Any = field(default=None, compare=False, repr=False)

    @property
    def key_id(self) -> int:
        """The negative id that stands for each of this image's placeholders in a cache key."""
        return -1 - int(self.digest[:15], 16)

    def to_json(self) -> dict:
        return {"digest": self.digest, "num_tokens": self.num_tokens, "size": list(self.size)}

    @classmethod
    def from_json(cls, d: dict) -> "PromptImage":
        return cls(d["digest"], d["num_tokens"], tuple(d["size"]))


class ImageRows:
    """The placeholders of ``tokens`` (ids ``placeholder_id``) matched with ``images`` in order: the first
    ``images[0].num_tokens`` placeholders are image 0's rows, and so on. ValueError when the counts differ."""

    def __init__(self, tokens: Sequence[int], images: Sequence[PromptImage], placeholder_id: int):
        self.images = list(images)
        self.positions = np.flatnonzero(np.asarray(tokens) == placeholder_id)  # [sum n_i] absolute positions
        counts = [im.num_tokens for im in self.images]
        if len(self.positions) != sum(counts):
            raise ValueError(f"the prompt holds {len(self.positions)} image placeholder tokens (id {placeholder_id}); "
                             f"its {len(counts)} image(s) take {sum(counts)} ({counts})")
        self.owner = np.repeat(np.arange(len(counts)), counts).astype(np.int64)  # [sum n_i] image of each placeholder
        self.row = np.concatenate([np.arange(n) for n in counts]) if counts else np.zeros(0, np.int64)  # [sum n_i]

    @property
    def end(self) -> int:
        """One past the last placeholder (0 without images): chunks from here on are plain text."""
        return int(self.positions[-1]) + 1 if len(self.positions) else 0

    def key(self, tokens: Sequence[int]) -> list[int]:
        """``tokens`` (a prefix of the prompt, or the prompt and more) with each placeholder replaced by its image's
        ``key_id``: the prompt as a cache key."""
        out = list(tokens)
        for p, i in zip(self.positions.tolist(), self.owner.tolist()):
            if p >= len(out):
                break
            out[p] = self.images[i].key_id
        return out

    def embed(self, embed: Callable[[mx.array], mx.array], inputs: mx.array, start: int, features: Features
              ) -> mx.array:
        """inputs [1, T] (the prompt's ids from ``start``) -> embeddings [1, T, hidden]: ``embed(inputs)`` with the
        placeholder rows replaced by the images' features (``features(image)`` [n, hidden], asked only for the
        images the chunk overlaps)."""
        h = embed(inputs)  # [1, T, hidden]
        inside = (self.positions >= start) & (self.positions < start + inputs.shape[1])
        if not inside.any():
            return h
        owners, rows = self.owner[inside], self.row[inside]  # [k]
        parts = []
        for i in np.unique(owners).tolist():
            f = features(self.images[i])  # [n_i, hidden]
            parts.append(f[mx.array(rows[owners == i])])  # [k_i, hidden], in prompt order
        h[:, mx.array(self.positions[inside] - start)] = mx.concatenate(parts).astype(h.dtype)[None]
        return h


class ImagePrefill:
    """``model`` as a token loop calls it (``model(ids [1, T], cache=...)``, chunk after chunk from prompt position
    ``start``), with ``rows``'s images placed: chunks that overlap placeholders go in as ``input_embeddings``.
    Anything else (``make_cache``, ``layers``, ``args``) is the model's."""

    def __init__(self, model, rows: ImageRows, start: int, features: Features):
        self.model, self.rows, self.position, self.features = model, rows, start, features

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None) -> mx.array:
        start, self.position = self.position, self.position + inputs.shape[1]
        if input_embeddings is not None or start >= self.rows.end:
            return self.model(inputs, cache=cache, input_embeddings=input_embeddings)
        h = self.rows.embed(self.model.embed, inputs, start, self.features)  # [1, T, hidden]
        return self.model(inputs, cache=cache, input_embeddings=h)

    def __getattr__(self, name: str):
        return getattr(self.model, name)
