"""Image features into a prompt's embeddings: each image's placeholder tokens take its features, in order.

The chat format writes an image as ``<|media_begin|>image WxH<|media_content|>`` + n x ``<|media_pad|>`` +
``<|media_end|>`` with n = the image's tokens (``preprocess.ImageInput.num_tokens``); the model then sees the token
embeddings with the n pad positions replaced, image after image, by the rows of that image's features (the
projector's output, [n, hidden]). The result goes to the text model as ``input_embeddings``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np


def merge_image_features(
    input_ids: mx.array, embed: Callable[[mx.array], mx.array], features: Sequence[mx.array], placeholder_id: int
) -> mx.array:
    """input_ids [1, L] (the placeholders already in place) -> embeddings [1, L, hidden] with the placeholder rows
    replaced by ``features`` (a list of [n_i, hidden], one per image, in prompt order). ``embed``: the text model's
    token embedding. ValueError when the placeholder count differs from the features' rows in all."""
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"merge_image_features: input_ids of shape {tuple(input_ids.shape)}; expected [1, L]")
    positions = np.flatnonzero(np.asarray(input_ids[0]) == placeholder_id)  # [sum n_i]
    rows = sum(int(f.shape[0]) for f in features)
    if len(positions) != rows:
        raise ValueError(f"merge_image_features: the prompt holds {len(positions)} image placeholder tokens (id "
                         f"{placeholder_id}); the images give {rows} feature rows ({[int(f.shape[0]) for f in features]})")
    h = embed(input_ids)  # [1, L, hidden]
    if rows == 0:
        return h
    image = mx.concatenate(list(features), axis=0).astype(h.dtype)  # [sum n_i, hidden]
    h[:, mx.array(positions)] = image[None]  # [1, L, hidden]: placeholders -> features
    return h
